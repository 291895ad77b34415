"""Waits a server asks for (Retry-After, RateLimit): what an answer asks, and who hears about it.

A 429 or 5xx may say how long to wait before the next try: `Retry-After` in seconds or as an HTTP date
(RFC 9110), `retry-after-ms` / `x-ms-retry-after-ms` (Azure), or the IETF RateLimit fields (`RateLimit:
"policy";r=0;t=30`, older drafts' `RateLimit-Reset: 30`). deadlines.py notes what each answer asks on the
thread that received it and makes every retry wait (streamctl's and each SDK's) serve it: capped at
STREAMCTL_MAX_SERVER_WAIT seconds, charged to the request's deadline, announced here and ended at once by a
stop request. Pure: no SDK, no I/O.
"""

from __future__ import annotations

import email.utils
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

# A Retry-After on a 3xx or 201 means something else (when to look again, not a back-off).
_WAIT_STATUSES = frozenset({429, *range(500, 600)})
_RATELIMIT_ITEM = re.compile(r"(?:^|[;,\s])([a-z-]+)\s*=\s*\"?(\d+(?:\.\d+)?)\"?", re.IGNORECASE)


@dataclass(frozen=True)
class ServerWait:
    """One answer's request to wait: `seconds` before the next try, from `endpoint` (host:port)."""

    endpoint: str
    seconds: float
    status: int


def _header(headers: Any, name: str) -> str | None:
    """A header from any SDK's header map (httpx, urllib3 and requests are case-insensitive; a plain dict
    may not be)."""
    value = headers.get(name)
    if value is None and isinstance(headers, Mapping):
        value = next((v for k, v in headers.items() if str(k).lower() == name), None)
    return None if value is None else str(value).strip()


def _retry_after(value: str, now: float) -> float | None:
    """delay-seconds or an HTTP-date (a date in the past: no wait)."""
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # an HTTP-date is GMT by definition
        return None
    return max(0.0, when.timestamp() - now)


def _ratelimit(headers: Any) -> float | None:
    """The IETF RateLimit fields: a wait only when the quota is used up (r=0 / remaining=0)."""
    field = _header(headers, "ratelimit")
    if field:
        items = {key.lower(): float(value) for key, value in _RATELIMIT_ITEM.findall(field)}
        remaining = items.get("r", items.get("remaining"))
        reset = items.get("t", items.get("reset"))
        if remaining == 0 and reset is not None:
            return reset
    reset_field = _header(headers, "ratelimit-reset")
    remaining_field = _header(headers, "ratelimit-remaining")
    if reset_field and (remaining_field is None or remaining_field == "0"):
        try:
            return max(0.0, float(reset_field))
        except ValueError:
            return None
    return None


def asked_wait(status: int, headers: Any, now: float | None = None) -> float | None:
    """Seconds an answer asks the client to wait before trying again; None when it asks nothing."""
    if status not in _WAIT_STATUSES or headers is None:
        return None
    now = time.time() if now is None else now
    asked: list[float] = []
    if (value := _header(headers, "retry-after")) and (seconds := _retry_after(value, now)) is not None:
        asked.append(seconds)
    for name in ("retry-after-ms", "x-ms-retry-after-ms"):
        if value := _header(headers, name):
            try:
                asked.append(max(0.0, float(value) / 1000))
            except ValueError:
                pass
    if (seconds := _ratelimit(headers)) is not None:
        asked.append(seconds)
    return max(asked) if asked else None


def announcement(wait: ServerWait, waiting_s: float, cap_s: float, deadline_left_s: float | None) -> str:
    """The one line the user reads: "rate-limited by HOST: waiting 30 s", and why it is not what was asked."""
    shown = f"{waiting_s:.0f}" if waiting_s >= 1 else f"{waiting_s:.1f}"
    line = f"rate-limited by {wait.endpoint}: waiting {shown} s (HTTP {wait.status}"
    if waiting_s < wait.seconds:
        if deadline_left_s is not None and waiting_s >= deadline_left_s and deadline_left_s < cap_s:
            line += f"; it asked for {wait.seconds:.0f} s, past the request's deadline"
        else:
            line += f"; it asked for {wait.seconds:.0f} s, capped by STREAMCTL_MAX_SERVER_WAIT"
    return line + ")"


# Who hears the announcements: the command's progress (output.py registers it), none for library callers.
_sinks: list[Callable[[str], None]] = []
_sinks_lock = threading.Lock()


@contextmanager
def announcing(sink: Callable[[str], None]) -> Iterator[None]:
    """Send every announcement made while the block runs (from any thread) to `sink` (a Progress.log)."""
    with _sinks_lock:
        _sinks.append(sink)
    try:
        yield
    finally:
        with _sinks_lock:
            _sinks.remove(sink)


def announce(message: str) -> None:
    with _sinks_lock:
        sink = _sinks[-1] if _sinks else None
    if sink is not None:
        sink(message)
