"""ladder: Ladder-Residual transformers with tensor parallelism.

Nothing happens at import time: no process group, no compile flags, no downloads.
"""

import os as _os
import signal as _signal

if _os.environ.get("LADDER_LAUNCHED_WORKER") == "1":
    # A process that ladder.comm.launch started, a worker or the fork server of workers (this import comes
    # early in its start-up, before torch's). Ctrl-C reaches the whole process group: the process ends
    # at once and silently (the default action), and the launching process alone reports it, in one
    # line. Python's KeyboardInterrupt would print a traceback from every process. (A worker whose
    # function handles Ctrl-C, as training does, sets that up itself: ladder.comm.launch._worker.)
    _signal.signal(_signal.SIGINT, _signal.SIG_DFL)

from ladder.errors import LadderError  # (torch-free: `ladder --help` imports this package and no torch)

__all__ = ["LadderError"]
__version__ = "0.1.0"
