"""Interrupts: keeping Ctrl-C from splitting a remote call from its bookkeeping, and one stop flag every wait obeys."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Protocol, TypeVar

T = TypeVar("T")


class Shielded(Protocol):
    def __call__(self, function: Callable[[], T], /) -> T: ...


@contextmanager
def shielded_calls() -> Iterator[Shielded]:
    """A runner for calls that must not be cut short by Ctrl-C, and a block that waits for them.

    KeyboardInterrupt is raised in the main thread wherever it happens to be. Between a request that
    creates state on a server (a multipart upload started, an object committed) and the line that records
    it for clean-up, it would leave that state unknown, so unremovable. The runner runs each call,
    bookkeeping included, on one worker thread; leaving the block (by an interrupt too) waits until that
    thread is idle, so clean-up placed after the block sees everything that was created. The worker is
    started before the first call, so no interrupt can fall between queueing a call and the thread that
    will run it.
    """
    with ThreadPoolExecutor(1, thread_name_prefix="streamctl-shielded") as worker:
        worker.submit(lambda: None).result()

        def run(function: Callable[[], T]) -> T:
            return worker.submit(function).result()

        yield run


# One process-wide stop flag. The main thread sets it when a signal (SIGINT, SIGTERM) ends the run; every wait
# a worker thread makes (a backoff, a server's Retry-After) waits on it, so a signal ends those waits at once
# instead of after them. KeyboardInterrupt alone reaches only the main thread.
_STOP = threading.Event()


def request_stop() -> None:
    """Ask every wait in every thread to end now (the run is being interrupted or terminated)."""
    _STOP.set()


def stop_requested() -> bool:
    return _STOP.is_set()


def clear_stop() -> None:
    """Forget an earlier stop request: for a process that runs several commands (the tests)."""
    _STOP.clear()


def wait_or_stop(seconds: float) -> bool:
    """Sleep up to `seconds`; True when a stop was requested (at once, or during the wait)."""
    if seconds <= 0:
        return _STOP.is_set()
    return _STOP.wait(seconds)
