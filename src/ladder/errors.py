"""The exceptions users see as one line: errors of their input or environment, and stop signals."""

import signal


class LadderError(Exception):
    """A problem with the user's input or environment, explained in one line."""


class Stopped(BaseException):
    """A signal other than Ctrl-C (SIGTERM from a scheduler, SIGHUP...) stopped the workers: the whole
    command stops, as with KeyboardInterrupt (a BaseException, so no `except Exception` goes on)."""

    def __init__(self, signum: int, said: str = "") -> None:
        self.signum = signum  # `said`: what the stopped work did about it (saved a checkpoint)
        super().__init__(f"stopped by {signal.Signals(signum).name}" + (f": {said}" if said else ""))
