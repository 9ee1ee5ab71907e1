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


# What a person does about a refusal by an MLflow server with authentication on (the chart's registry,
# docs/reliability.md "Trust boundaries"), by MLflow's error code.
AUTH_HINTS = {
    "UNAUTHENTICATED": " (no or wrong credentials: set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, on a"
    " cluster through kubernetes.mlflow_secret)",
    "PERMISSION_DENIED": " (this identity may not change it: the pipeline identity, which created it, or the admin"
    " can; the tracking identity of the pods that run reward functions, kubernetes.tracking_secret, logs runs only"
    " in the experiments the chart's mlflow.auth.experiments lists)",
}


def auth_hint(exc: BaseException) -> str:
    """The AUTH_HINTS line for an MLflow error, or ""."""
    return AUTH_HINTS.get(getattr(exc, "error_code", None) or "", "")


class Stopped(Exception):
    """A stage stopped on a signal (SIGTERM, SIGINT) after saving a checkpoint: reported in one line, exit code
    128 + the signal's number (143 for SIGTERM), as a process killed by it would report."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum
