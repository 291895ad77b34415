"""One exception tree for the whole library; `app.py` maps it to exit codes in one place.

Every error carries a one-line message and, where one exists, a hint that names the fix, and a stable
machine name (`code`) that `--json` prints in its error document; a case may name itself more precisely
than its class (`UsageError(..., code="bad-option-value")`). `details` are extra top-level fields of that
document (a pre-flight's findings); `result`, where a failure has one, is the command's result (a shard
run whose checks failed), shown with the error.
"""

from __future__ import annotations

from typing import Any, Protocol


class StreamctlError(Exception):
    """Base of every error the library raises on purpose."""

    exit_code = 2
    code = "error"
    # The command's result, where a failure has one (a shard run whose checks failed): shown with the error.
    result: object | None = None

    def __init__(
        self, message: str, hint: str | None = None, *, code: str | None = None, details: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        if code is not None:
            self.code = code
        self.details = details

    def __str__(self) -> str:
        return self.message


class UsageError(StreamctlError):
    """Bad usage or bad input: a malformed URL, option or file."""

    exit_code = 2
    code = "usage-error"


class NotFoundError(StreamctlError):
    """A bucket, container, prefix, object, repo or file does not exist."""

    exit_code = 3
    code = "not-found"


class AccessDeniedError(StreamctlError):
    """Credentials are missing, or they lack a permission."""

    exit_code = 4
    code = "access-denied"


class IntegrityError(StreamctlError):
    """Bytes did not match their checksum."""

    exit_code = 5
    code = "integrity-error"


class RemoteError(StreamctlError):
    """A remote service or the network failed, after retries."""

    exit_code = 6
    code = "remote-error"


class DeadlineExceededError(RemoteError):
    """A request got no complete answer within its deadline, on every attempt: already retried, so callers
    do not retry it again (each retry would cost another full deadline)."""


class OutOfResources(RemoteError):
    """The machine ran out of something the run needs: disk space or quota, a file-size limit, memory, open
    files, threads (streamctl.oserrors). Exit 6 as a full disk always was, and like a lost link a transfer's
    sound parts stay to resume once space is freed; its own code, so a script can tell it from the network.
    Not retried (streamctl.retry): waiting seconds frees no disk."""

    code = "out-of-resources"


class RangeIgnoredError(RemoteError):
    """A server answered a ranged GET with the whole object (200, not 206): reading on would fetch the whole
    file once per part, so the read stops before the body (not retried: the server will do it again)."""

    code = "range-ignored"


class EngineFailed(RemoteError):
    """The engine streamctl runs beside itself (`shard --engine vllm-cpu`'s vLLM worker process) died or
    broke its pipe protocol: a service that failed mid-request, so exit 6 as for any other (not retried:
    the process is gone, or in a state nothing can trust)."""

    code = "engine-failed"


class VerificationFailed(StreamctlError):
    """A verification ran to the end and found errors."""

    exit_code = 1
    code = "verification-failed"


class PreflightFailed(VerificationFailed):
    """`serve`'s pre-flight found errors, so vLLM was not launched. `report` is the VerifyReport: the
    command shows its findings above the error line; `details` carry them into the JSON error document."""

    code = "preflight-failed"

    def __init__(
        self, message: str, hint: str | None = None, *, report: Any, details: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message, hint, details=details)
        self.report = report


class _Findings(Protocol):
    """What ChecksFailed reads of a verify report (streamctl.verify's VerifyReport)."""

    @property
    def error_count(self) -> int: ...
    @property
    def warning_count(self) -> int: ...
    @property
    def checkpoint(self) -> str: ...


class ChecksFailed(VerificationFailed):
    """Checks ran to the end and failed (verify-index's, or those after a transfer): `result` is the command's
    whole answer, shown as on success (the report, or its JSON document with an `error` added) and no error
    line under it: the report says what failed."""

    def __init__(self, result: object, report: _Findings) -> None:
        super().__init__(f"{report.error_count:,} errors and {report.warning_count:,} warnings in {report.checkpoint}")
        self.result = result


class DestinationBusy(StreamctlError):
    """Another run holds the DEST's lease and is alive, or took it from this run (see streamctl.dest.lease).

    A code of its own: the remedy is to wait and run again, which a script can tell from bad usage (2) or a
    failing service (6)."""

    exit_code = 7
    code = "destination-busy"


class PreconditionFailed(StreamctlError):
    """A conditional write or delete found the object not in the state it named (it exists, is missing,
    or another writer changed it). Raised by the storage conditional methods; the lease code turns it into
    DestinationBusy, so it reaches the user only through a bug."""

    exit_code = 7
    code = "precondition-failed"


class MissingProgramError(StreamctlError):
    """A program or optional extra that this command needs is not installed (as a shell's 127)."""

    exit_code = 127
    code = "missing-program"


class Interrupted(StreamctlError):
    """Ctrl-C (SIGINT) or SIGTERM (code "terminated"): the run stopped where it was; nothing half-written is
    under a final name. Its exit code (130 or 143, as a shell's) is set where app.py maps it, with the other
    codes no library error carries."""

    code = "interrupted"
