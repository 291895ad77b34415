"""glibc calls that Python's os module lacks, loaded on first use (ctypes is not imported at start-up)."""

from __future__ import annotations

import sys
from functools import cache
from typing import Any

_SYNC_FILE_RANGE_WRITE = 2  # start writeback of the range's dirty pages; do not wait for it
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@cache
def libc() -> Any | None:
    """The C library as a ctypes handle; None off Linux or where it cannot be loaded."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        return ctypes.CDLL(name, use_errno=True)
    except OSError:
        return None


@cache
def _sync_file_range() -> Any | None:
    handle = libc()
    function = getattr(handle, "sync_file_range", None) if handle is not None else None
    if function is None:
        return None
    import ctypes

    function.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    function.restype = ctypes.c_int
    return function


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing [offset, offset + length) of `fd` to disk now, without waiting.

    A writer that streams gigabytes otherwise leaves them all dirty until its final fsync, which then
    waits for the whole file (and dirty memory piles up meanwhile). Best effort: a no-op where
    sync_file_range is missing or refuses (its errors never matter to correctness; fsync still follows).
    """
    function = _sync_file_range()
    if function is not None:
        function(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


def set_parent_death_signal(signum: int) -> bool:
    """Have the kernel send `signum` to this process when its parent (the thread that started it) dies, a
    SIGKILL included: the one way a child cannot outlive a parent that had no chance to stop it. False where
    prctl is missing (not Linux) or refuses."""
    handle = libc()
    prctl = getattr(handle, "prctl", None) if handle is not None else None
    if prctl is None:
        return False
    import ctypes

    return int(prctl(ctypes.c_int(_PR_SET_PDEATHSIG), ctypes.c_ulong(signum), 0, 0, 0)) == 0


@cache
def keep_unwinder_loaded() -> Any | None:
    """Load libgcc_s now, while memory is plentiful: glibc dlopens it whenever a thread exits (CPython ends
    every thread with pthread_exit, which unwinds), and a process out of address space (`ulimit -v`) then
    aborts ("libgcc_s.so.1 must be installed for pthread_exit to work") instead of exiting with its error."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        return ctypes.CDLL("libgcc_s.so.1")
    except OSError:
        return None


_MADV_DONTNEED = 4  # <asm-generic/mman-common.h>


@cache
def _madvise() -> Any | None:
    handle = libc()
    function = getattr(handle, "madvise", None) if handle is not None else None
    if function is None:
        return None
    import ctypes

    function.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    function.restype = ctypes.c_int
    return function


def drop_pages(address: int, length: int) -> int:
    """Give back the resident pages that lie wholly inside [address, address + length) (MADV_DONTNEED): memory
    whose contents are no longer needed but which stays allocated (a loaded parameter already checked, the
    mapping of a file already read). Anonymous pages read back as zeros afterwards, a file mapping's as the
    file. The bytes released (0 where madvise is missing or refuses: best effort, never an error)."""
    function = _madvise()
    if function is None or length <= 0:
        return 0
    import mmap

    page = mmap.PAGESIZE
    start = -(-address // page) * page  # pages only partly inside the range hold other memory's bytes too
    end = (address + length) // page * page
    if end <= start or function(start, end - start, _MADV_DONTNEED) != 0:
        return 0
    return end - start
