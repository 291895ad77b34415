"""What only `transfer` needs of its uploads: reusable part buffers and the token that reopens an upload."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Mapping


class PartBuffers:
    """Reusable part buffers, so a part's bytes land in pages already touched: a fresh multi-MiB buffer per
    part costs a page fault and a zeroed page per 4 KiB (large allocations are mmap'd, see
    streamctl.common.memory). How many exist is bounded by the ByteBudget their holders took first: a buffer is
    taken only with a part's share of the budget held, and given back before that share is."""

    def __init__(self) -> None:
        self._free: dict[int, list[bytearray]] = {}
        self._lock = threading.Lock()

    def take(self, size: int) -> bytearray:
        with self._lock:
            free = self._free.get(size)
            if free:
                return free.pop()
            # None of this size is idle: free the idle ones of other sizes (a file whose part size was
            # raised), so that a new buffer is only ever made beside busy ones, which the budget bounds.
            self._free = {}
        return bytearray(size)

    def give(self, buffer: bytearray) -> None:
        with self._lock:
            self._free.setdefault(len(buffer), []).append(buffer)


def resume_token(fields: Mapping[str, object]) -> str:
    """The `resume` token (Store.start_multipart) of an upload: 16 hex digits that name all of `fields`
    (the object, its size, its part size, its sha256, the source it comes from), so only a run that would
    create the same upload reopens it."""
    body = json.dumps(dict(fields), sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(body).hexdigest()[:16]
