"""The small callback protocol through which library code reports progress.

The library never prints; a command passes an implementation (Rich bars on a terminal, or
`NULL_PROGRESS`) and the library calls it. Implementations must be thread-safe.
"""

from __future__ import annotations

from typing import Protocol


class Progress(Protocol):
    def task(self, description: str, total: int | None) -> int:
        """Start a task (a file, a phase) and return its id. `total` is in bytes or items."""
        ...

    def advance(self, task_id: int, amount: int) -> None: ...

    def done(self, task_id: int) -> None: ...

    def log(self, message: str) -> None:
        """A one-line note for the user (a retry, a skipped file)."""
        ...


class NullProgress:
    """Reports nothing: for `--quiet`, `--json`, non-terminals and library callers."""

    def task(self, description: str, total: int | None) -> int:
        return 0

    def advance(self, task_id: int, amount: int) -> None:
        pass

    def done(self, task_id: int) -> None:
        pass

    def log(self, message: str) -> None:
        pass


NULL_PROGRESS: Progress = NullProgress()
