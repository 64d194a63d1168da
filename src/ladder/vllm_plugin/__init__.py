"""ladder's vLLM plugin: ladder folders served by vLLM with a native model that keeps the overlap.

`pip install "ladder[vllm]"` installs it; vLLM finds it through the `vllm.general_plugins` entry point
and calls `register()` in every process it starts (the API server, the engine core, each worker).
Registering is lazy: vLLM imports `ladder.vllm_plugin.model` only when a folder asks for its
architecture, so a plain Llama folder never touches ladder (a standard ladder folder *is* a plain
Llama folder and stays vLLM's own `LlamaForCausalLM`).

Settings that vLLM has no flag for come in vLLM's own way, `--additional-config`:
    --additional-config '{"ladder": {"interconnect": "pcie-no-p2p", "tp": 4, "link_scale": 7.7}}'
emulates a TP-4 interconnect inside a TP-1 vLLM: rank 0's exact shard computes, and each all-reduce
is a wait of the modelled duration (as `ladder serve --interconnect`).
"""

from __future__ import annotations

from transformers import AutoConfig
from vllm import ModelRegistry

from ladder.vllm_plugin.config import VllmLadderLlamaConfig, one_line_errors

ARCHITECTURE = "LadderLlamaForCausalLM"
MODEL_TYPE = "ladder_llama"


def register() -> None:
    """vLLM's entry point. Safe to call more than once (vLLM may, per process)."""
    # The folder's config.json names this model type; registered, transformers reads it without
    # trust_remote_code (the folder's own configuration file is the same class, less the refusals).
    AutoConfig.register(MODEL_TYPE, VllmLadderLlamaConfig, exist_ok=True)
    one_line_errors()
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "ladder.vllm_plugin.model:LadderLlamaForCausalLM")
