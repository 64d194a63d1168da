"""The one exception type users see as a one-line error (the CLI prints it and exits non-zero)."""


class LadderError(Exception):
    """A problem with the user's input or environment, explained in one line."""
