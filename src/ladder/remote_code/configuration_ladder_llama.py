"""Configuration of a Ladder-Residual Llama for transformers (written by ladder; see modeling_ladder_llama.py)."""

from huggingface_hub.dataclasses import strict
from transformers.models.llama.configuration_llama import LlamaConfig

RESIDUAL_LAYOUTS = ("standard", "parallel", "ladder", "desync", "upper-bound")
DESYNC_PATTERNS = ("mlp", "attention", "all", "none")


@strict
class LadderLlamaConfig(LlamaConfig):
    """A Llama configuration plus the residual layout.

    residual_layout: "standard" (sequential), "parallel" (one shared norm, r + A(u) + M(u)), "ladder"
        (each module reads the residual one module stale), or "desync" / "upper-bound", which depend on the
        tensor-parallel degree and run in ladder only (see the modeling file).
    ladder_layers: with "ladder", how many trailing layers follow the ladder recurrence (None: all of
        them; fewer makes a hybrid whose first layers are standard).
    desync_reduce, desync_tp: which module outputs a desync model all-reduces, and the degree it was trained for.
    """

    model_type = "ladder_llama"

    residual_layout: str = "ladder"
    ladder_layers: int | None = None
    desync_reduce: str = "mlp"
    desync_tp: int | None = None

    def validate_architecture(self) -> None:
        super().validate_architecture()
        if self.residual_layout not in RESIDUAL_LAYOUTS:
            raise ValueError(f"unknown residual_layout {self.residual_layout!r}; known: {', '.join(RESIDUAL_LAYOUTS)}")
        if self.ladder_layers is not None and self.residual_layout != "ladder":
            raise ValueError(f"ladder_layers is {self.ladder_layers} but residual_layout is {self.residual_layout!r}")
        if self.ladder_layers is not None and not 0 <= self.ladder_layers <= self.num_hidden_layers:
            raise ValueError(f"ladder_layers must be between 0 and num_hidden_layers={self.num_hidden_layers}, "
                             f"got {self.ladder_layers}")
        if self.desync_reduce not in DESYNC_PATTERNS:
            raise ValueError(f"unknown desync_reduce {self.desync_reduce!r}; known: {', '.join(DESYNC_PATTERNS)}")

    @property
    def first_ladder_layer(self) -> int:
        """The first layer whose modules read the residual one module stale (num_hidden_layers: none)."""
        if self.residual_layout != "ladder":
            return self.num_hidden_layers
        return self.num_hidden_layers - (self.num_hidden_layers if self.ladder_layers is None else self.ladder_layers)


__all__ = ["LadderLlamaConfig"]
