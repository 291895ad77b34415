"""One exception tree for the whole library; `app.py` maps it to exit codes in one place.

Every error carries a one-line message and, where one exists, a hint that names the fix.
"""

from __future__ import annotations


class StreamctlError(Exception):
    """Base of every error the library raises on purpose."""

    exit_code = 2

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message


class UsageError(StreamctlError):
    """Bad usage or bad input: a malformed URL, option or file."""

    exit_code = 2


class NotFoundError(StreamctlError):
    """A bucket, container, prefix, object, repo or file does not exist."""

    exit_code = 3


class AccessDeniedError(StreamctlError):
    """Credentials are missing, or they lack a permission."""

    exit_code = 4


class IntegrityError(StreamctlError):
    """Bytes did not match their checksum."""

    exit_code = 5


class RemoteError(StreamctlError):
    """A remote service or the network failed, after retries."""

    exit_code = 6


class DeadlineExceededError(RemoteError):
    """A request got no complete answer within its deadline, on every attempt: already retried, so callers
    do not retry it again (each retry would cost another full deadline)."""


class VerificationFailed(StreamctlError):
    """A verification ran to the end and found errors."""

    exit_code = 1


class MissingProgramError(StreamctlError):
    """A program or optional extra that this command needs is not installed (as a shell's 127)."""

    exit_code = 127


EXIT_OK = 0
EXIT_INTERRUPTED = 130
