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
