"""A ladder folder's configuration as vLLM reads it, and the layouts the plugin serves.

vLLM reads config.json in the process the user started, before it starts any worker: a layout the
plugin cannot serve is refused there, in one line (`one_line_errors`), not in a worker's traceback.
"""

from __future__ import annotations

import sys
from types import TracebackType

from huggingface_hub.dataclasses import strict

from ladder.errors import LadderError
from ladder.remote_code.configuration_ladder_llama import LadderLlamaConfig

# Desync is refused: each rank keeps its own residual stream, and vLLM's vocabulary-parallel head would
# gather each slice of the logits from a different rank's stream. Upper bound is served as what it is
# in ladder: the speed with no communication at all, not a valid model at TP > 1.
SUPPORTED_LAYOUTS = ("standard", "parallel", "ladder", "upper-bound")


def check_layout(layout: str) -> None:
    if layout not in SUPPORTED_LAYOUTS:
        raise LadderError(
            f"ladder's vLLM model does not serve residual_layout {layout!r} (each tensor-parallel rank keeps its "
            "own residual stream); serve the folder with `ladder serve --model FOLDER --tp N`, or convert it "
            "with `ladder convert FOLDER --layout ladder`")


@strict
class VllmLadderLlamaConfig(LadderLlamaConfig):
    """`LadderLlamaConfig`, refusing the layouts vLLM cannot serve when it is read."""

    def validate_architecture(self) -> None:
        super().validate_architecture()
        check_layout(self.residual_layout)


def one_line_errors() -> None:
    """Let an uncaught LadderError (or an error raised from one: transformers wraps the config's) end
    the process with its one line instead of a traceback; any other error keeps the usual hook."""
    previous = sys.excepthook
    if getattr(previous, "ladder", False):
        return

    def hook(kind: type[BaseException], error: BaseException, traceback: TracebackType | None) -> None:
        cause: BaseException | None = error
        while cause is not None and not isinstance(cause, LadderError):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            previous(kind, error, traceback)
        else:
            sys.stderr.write(f"ladder: {cause}\n")

    hook.ladder = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def layout_of(config: object) -> tuple[str, int]:
    """(residual layout, first ladder layer) of a ladder folder's config; a plain Llama config (a Llama folder
    served through the plugin with `--hf-overrides '{"architectures": ["LadderLlamaForCausalLM"]}'`, to
    give standard the emulated link too) is standard, no layer ladder."""
    n_layers = config.num_hidden_layers  # type: ignore[attr-defined]
    return getattr(config, "residual_layout", "standard"), getattr(config, "first_ladder_layer", n_layers)
