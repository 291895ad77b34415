"""A Progress (streamctl.progress) that records every call, for tests of what a library reports."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RecordingProgress:
    events: list[tuple[str, Any]] = field(default_factory=list)

    def task(self, description: str, total: int | None) -> int:
        self.events.append(("task", total))
        return 7

    def advance(self, task_id: int, amount: int) -> None:
        self.events.append(("advance", (task_id, amount)))

    def done(self, task_id: int) -> None:
        self.events.append(("done", task_id))

    def log(self, message: str) -> None:
        self.events.append(("log", message))

    @property
    def lines(self) -> list[str]:
        """The log lines, in order."""
        return [str(message) for kind, message in self.events if kind == "log"]
