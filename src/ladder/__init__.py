"""ladder: Ladder-Residual transformers with tensor parallelism.

Nothing happens at import time: no process group, no compile flags, no downloads.
"""

from ladder.config import LAYOUTS, PRESETS, ModelConfig, get_preset
from ladder.errors import LadderError

__all__ = ["LAYOUTS", "PRESETS", "LadderError", "ModelConfig", "get_preset"]
__version__ = "0.1.0"
