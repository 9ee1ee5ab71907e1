"""The one exception type for input a user can fix.

The CLI prints a UserError as a single line (`kubealign: error: ...`) and exits with code 2, with no
traceback. Messages name the place: a file and line, a config field, or a command-line option.
"""


class UserError(Exception):
    """Bad input (file, config field, option): reported in one line, exit code 2."""


def first_line(exc: BaseException) -> str:
    """The first non-empty line of an exception's message, for wrapping third-party errors."""
    for line in str(exc).splitlines():
        if line.strip():
            return line.strip()
    return type(exc).__name__


class Stopped(Exception):
    """A stage stopped on a signal (SIGTERM, SIGINT) after saving a checkpoint: reported in one line, exit code
    128 + the signal's number (143 for SIGTERM), as a process killed by it would report."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum
