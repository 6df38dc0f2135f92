"""The one exception of the store tools, carrying the exit code its command ends with."""

from __future__ import annotations

from glm53.errors import Glm53Error

EXIT_OK = 0
EXIT_CHECK_FAILED = 1  # the store (or the O_DIRECT probe) failed a check
EXIT_USAGE = 2  # bad arguments, bad input or an environment that cannot work
EXIT_INTERRUPTED = 130  # Ctrl-C, as shells report SIGINT


class StoreError(Glm53Error):
    """A store command cannot go on. The message names the thing, what is wrong and the fix."""

    def __init__(self, message: str, exit_code: int = EXIT_USAGE):
        super().__init__(message)
        self.exit_code = exit_code


class StoreMismatchError(StoreError):
    """The store was packed from another checkpoint than the one it is checked or served with."""

    def __init__(self, message: str):
        super().__init__(message, EXIT_CHECK_FAILED)


def reason(exc: BaseException) -> str:
    """An exception's message without OSError's "[Errno N]" prefix."""
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.filename}: {exc.strerror}" if exc.filename else exc.strerror
    return str(exc)
