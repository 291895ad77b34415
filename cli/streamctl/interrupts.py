"""Interrupts: keeping Ctrl-C from splitting a remote call from its bookkeeping, one stop flag every wait
obeys, and SIGINT/SIGTERM turned into that stop (`stopping_on_signals`, installed by app.main alone)."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Protocol, TypeVar

from streamctl.common.libc import keep_unwinder_loaded

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
    from concurrent.futures import ThreadPoolExecutor  # not at import: app.main imports this module for --help

    with ThreadPoolExecutor(1, thread_name_prefix="streamctl-shielded", initializer=_mark_shielded) as worker:
        worker.submit(lambda: None).result()

        def run(function: Callable[[], T]) -> T:
            return worker.submit(function).result()

        yield run


_thread_state = threading.local()


def _mark_shielded() -> None:
    _thread_state.shielded = True


def requests_outlive_stop() -> bool:
    """Whether this thread's requests still go out once a stop is requested: the main thread's (its clean-up)
    and the shielded runner's (a call that must not be split from its bookkeeping); other threads' are cut."""
    return threading.current_thread() is threading.main_thread() or getattr(_thread_state, "shielded", False)


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


# --------------------------------------------------------------------------------------------- signals
#
# How a signal stops a run (SIGINT from a terminal, SIGTERM from `kill`, a pod's eviction, a Job's deadline):
#   - in the main thread, Python's handler raises KeyboardInterrupt (SIGINT) or Terminated, its subclass
#     (SIGTERM), wherever the thread is, so every clean-up written for Ctrl-C runs for both: uploads aborted,
#     what the run began removed, the lease released, in `except`/`finally` blocks on the way out;
#   - at the C level the signal also wakes a watcher thread (signal.set_wakeup_fd), which requests the stop
#     (every wait in every thread ends: wait_or_stop), runs the `on_stop` callbacks (storage.deadlines cuts
#     the requests worker threads have in flight and refuses their new ones) and then gives the clean-up
#     `grace_s`: a run still alive then is ended by `on_overdue` (app.main: the one error line, os._exit), so a
#     command always stops within the grace, however stuck a thread is. What such an exit leaves (open
#     uploads, the lease) is what a killed run leaves, and the next run discards or resumes it;
#   - a second signal during the clean-up raises nothing (no traceback out of a `finally` block): the first
#     one's grace already bounds how long the clean-up may take.

STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM)
DEFAULT_GRACE_S = 8.0  # clean-up time after the signal: Kubernetes gives a pod 30 s; the commands promise 10 s
GRACE_VARIABLE = "STREAMCTL_STOP_GRACE_S"  # undocumented tuning, as STREAMCTL_DEADLINE_*: tests and odd setups


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread as Ctrl-C's KeyboardInterrupt is (a subclass of it, so that every
    clean-up path written for Ctrl-C runs for it too)."""


_received: signal.Signals | None = None  # the first stop signal, set by the main thread's handler
_ON_STOP: list[Callable[[], object]] = []


def stop_signal() -> signal.Signals | None:
    """The first SIGINT or SIGTERM received while `stopping_on_signals` was active, or None."""
    return _received


def on_stop(callback: Callable[[], object]) -> None:
    """Call `callback` (from the signal watcher's thread, never from a handler) once a signal stops the run:
    for what must end at once in other threads (requests in flight). It must not block for long."""
    if callback not in _ON_STOP:
        _ON_STOP.append(callback)


def _raise_in_main_thread(signum: int, _frame: FrameType | None) -> None:
    global _received
    if _received is not None:
        return  # a second signal during the clean-up: the first one's grace bounds it already
    _received = signal.Signals(signum)
    if _raising:
        raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


_raising = True


def stop_raising() -> None:
    """The run is over (only its result or error is left to print): a signal from now on is recorded (the
    exit code says it) and gets its grace, but raises nothing into the reporting."""
    global _raising
    _raising = False


def _stop_everything(signum: int, grace_s: float, on_overdue: Callable[[signal.Signals], None]) -> None:
    request_stop()
    for callback in tuple(_ON_STOP):
        try:
            callback()
        except Exception:  # noqa: BLE001 - one callback failing must not keep the others, or the grace, from running
            pass
    threading.Event().wait(grace_s)
    on_overdue(_received or signal.Signals(signum))


def _watch(read_fd: int, grace_s: float, on_overdue: Callable[[signal.Signals], None]) -> None:
    """The watcher thread: one byte per signal arrives on `read_fd` (set_wakeup_fd); EOF ends it."""
    try:
        while data := os.read(read_fd, 64):
            signums = [number for number in data if number in STOP_SIGNALS]
            if signums:
                _stop_everything(signums[0], grace_s, on_overdue)
                return
    except OSError:
        return
    finally:
        os.close(read_fd)


def grace_from_environ() -> float:
    try:
        value = float(os.environ.get(GRACE_VARIABLE, "") or DEFAULT_GRACE_S)
    except ValueError:
        return DEFAULT_GRACE_S
    return value if value > 0 else DEFAULT_GRACE_S


@contextmanager
def stopping_on_signals(
    on_overdue: Callable[[signal.Signals], None], grace_s: float = DEFAULT_GRACE_S
) -> Iterator[None]:
    """For the block: SIGINT and SIGTERM stop the run as described above (`on_overdue(signal)` must end the
    process). Outside the main thread, or for a signal this process was started ignoring (`nohup`, a
    background job), nothing changes. The previous handlers are restored on the way out, unless a signal
    stopped the run: then the process is exiting, and further signals are ignored."""
    global _received, _raising
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _received, _raising = None, True
    clear_stop()
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)  # set_wakeup_fd's rule: the C handler must never block
    previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    watcher = threading.Thread(
        target=_watch, args=(read_fd, grace_s, on_overdue), name="streamctl-signals", daemon=True
    )
    keep_unwinder_loaded()  # before any thread can exit (the watcher's exit needs it too)
    try:
        watcher.start()
    except RuntimeError:  # no thread to be had (ulimit -v, -u): run as without the handler, Ctrl-C as Python's
        os.close(read_fd)
        os.close(write_fd)
        yield
        return
    old_wakeup = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    try:
        for signum, handler in previous.items():
            if handler is not signal.SIG_IGN:
                signal.signal(signum, _raise_in_main_thread)
        yield
    finally:
        if _received is not None:
            # The process is exiting: a later signal must not kill it half-way (Python's finalization resets
            # handlers of its own to the default, which would; an ignored signal stays ignored).
            for signum, handler in previous.items():
                if handler is not signal.SIG_IGN:
                    signal.signal(signum, signal.SIG_IGN)
        else:
            for signum, handler in previous.items():
                if handler is not signal.SIG_IGN and handler is not None:
                    signal.signal(signum, handler)
            signal.set_wakeup_fd(old_wakeup)
            os.close(write_fd)  # EOF for the watcher
