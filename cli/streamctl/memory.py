"""Process-level memory settings for commands that move large buffers through many threads."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter
_ONE_MIB = 1 << 20


def return_large_buffers_to_the_os() -> bool:
    """Serve allocations of 1 MiB and more with mmap, so a freed part buffer leaves the process at once.

    glibc otherwise keeps freed multi-MiB buffers in per-thread arenas: measured on a 2 GiB transfer, peak
    RSS 677 MiB with the default, 397 MiB with this, at the same speed. No-op off glibc.
    """
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, _ONE_MIB))
    except (OSError, AttributeError):
        return False
