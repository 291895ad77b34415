"""Retries with exponential backoff and full jitter, for the requests streamctl makes itself.

SDK calls retry inside their SDKs too; this layer retries whole operations (a part, a ranged read)
when a backend still reports a RemoteError, so a flaky link costs a part, never the run.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from streamctl.errors import DeadlineExceededError, OutOfResources, RemoteError

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 5
    base_delay_s: float = 0.5
    max_delay_s: float = 20.0

    def delay(self, attempt: int) -> float:
        """Full jitter: uniform in [0, min(cap, base * 2**attempt)]."""
        return random.uniform(0, min(self.max_delay_s, self.base_delay_s * (2**attempt)))


def with_retries(
    operation: Callable[[], T],
    policy: RetryPolicy,
    on_retry: Callable[[int, RemoteError], None] | None = None,
    cancelled: threading.Event | None = None,
) -> T:
    for attempt in range(policy.attempts):
        try:
            return operation()
        except RemoteError as error:
            # A request past its deadline was already retried by the storage layer, each try a full deadline;
            # a full disk or an exhausted limit does not recover in seconds: the user frees space, runs again.
            final = isinstance(error, (DeadlineExceededError, OutOfResources)) or attempt + 1 >= policy.attempts
            if final or (cancelled is not None and cancelled.is_set()):
                raise
            if on_retry is not None:
                on_retry(attempt + 1, error)
            if cancelled is not None:
                if cancelled.wait(policy.delay(attempt)):
                    raise
            else:
                time.sleep(policy.delay(attempt))
    raise AssertionError("unreachable")
