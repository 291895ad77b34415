"""Retries with exponential backoff and full jitter, for the requests streamctl makes itself.

SDK calls retry inside their SDKs too; this layer retries whole operations (a part, a ranged read)
when a backend still reports a RemoteError, so a flaky link costs a part, never the run.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from streamctl.errors import DeadlineExceededError, OutOfResources, RangeIgnoredError, RemoteError

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
            # a full disk or an exhausted limit does not recover in seconds: the user frees space, runs again;
            # a server that ignores Range would only send the whole file again.
            unrecoverable = (DeadlineExceededError, OutOfResources, RangeIgnoredError)
            final = isinstance(error, unrecoverable) or attempt + 1 >= policy.attempts
            if final or (cancelled is not None and cancelled.is_set()):
                raise
            if on_retry is not None:
                on_retry(attempt + 1, error)
            # The back-off, or the wait the failed answer asked for (capped and announced); a stop request
            # or `cancelled` ends it at once, and the run with this error.
            from streamctl.storage.deadlines import pause  # storage imports this module

            if pause(policy.delay(attempt), cancelled):
                raise
    raise AssertionError("unreachable")
