"""moto's S3 server, patched so a benchmark can hold a full-size checkpoint without the disk or RAM for it.

Run it like `python -m moto.server`: `python bench/sparse_moto.py -H 127.0.0.1 -p PORT`, with
`BENCH_SPARSE_DIR` naming a folder for the backing files (the benchmark creates and removes it).

Two changes to stock moto 5.x, both only for objects uploaded with the user metadata
`x-amz-meta-bench-sparse-size: N` (every other object behaves exactly as in stock moto):

1. Sparse objects. The uploaded body (a safetensors header, a few kB) is written to a file that is then
   extended to N bytes with `ftruncate`, which leaves a hole: the object is N bytes long to every client (size
   in listings, HEAD, Content-Range, GET bodies, where the hole reads as zeros), while the disk holds only the
   header's pages. A 141 GB checkpoint costs a few hundred kB of disk and RAM.
2. Ranged GETs read only the range. Stock moto builds every GET from the whole object (`key.value` reads it all,
   then the Range is sliced out), so a 100 kB header read of a 3 GB object would read 3 GB. Real S3 does not,
   so the benchmark would measure moto, not the link. These objects answer `len()` and slices with `os.pread`,
   and stream whole-object GETs in 1 MiB chunks.

The marker key is removed from the object's metadata, so clients never see it. Objects are immutable here:
they are meant to be uploaded once and read many times.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

SPARSE_SIZE_META = "x-amz-meta-bench-sparse-size"
STREAM_CHUNK = 1024 * 1024


class FileBody:
    """A read-only, bytes-like view of a (sparse) file: len(), slices and iteration, read with pread."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __bool__(self) -> bool:
        return self.size > 0

    def read(self, start: int, length: int) -> bytes:
        pieces: list[bytes] = []
        while length > 0:
            piece = os.pread(self.fd, length, start)
            if not piece:
                break
            pieces.append(piece)
            start += len(piece)
            length -= len(piece)
        return b"".join(pieces)

    def __getitem__(self, item: slice) -> bytes:
        if not isinstance(item, slice):
            raise TypeError("FileBody supports slices only")
        start, stop, step = item.indices(self.size)
        if step != 1:
            raise ValueError("FileBody supports contiguous slices only")
        return self.read(start, max(0, stop - start))

    def __iter__(self) -> Iterator[bytes]:
        for start in range(0, self.size, STREAM_CHUNK):
            yield self.read(start, min(STREAM_CHUNK, self.size - start))


def install_patches(sparse_dir: str) -> None:
    from moto.s3.models import FakeKey

    original_value: property = FakeKey.value  # type: ignore[assignment]
    original_get, original_set = original_value.fget, original_value.fset
    assert original_get is not None and original_set is not None
    original_set_metadata = FakeKey.set_metadata

    def get_value(self: Any) -> Any:
        body = self.__dict__.get("_bench_body")
        return body if body is not None else original_get(self)

    def set_value(self: Any, new_value: bytes) -> None:
        self.__dict__.pop("_bench_body", None)
        original_set(self, new_value)

    def set_metadata(self: Any, metadata: Any, replace: bool = False) -> None:
        size_text = metadata.pop(SPARSE_SIZE_META, None) if metadata is not None else None
        original_set_metadata(self, metadata, replace)
        if size_text is not None:
            make_sparse(self, int(size_text))

    def make_sparse(key: Any, size: int) -> None:
        head = original_get(key)
        if size < len(head):
            raise ValueError(f"sparse size {size} is smaller than the uploaded {len(head)} bytes")
        fd, path = tempfile.mkstemp(prefix="obj-", dir=sparse_dir)
        os.unlink(path)  # the open descriptor keeps it alive; nothing is left behind when the server exits
        os.pwrite(fd, head, 0)
        os.ftruncate(fd, size)
        original_set(key, b"")  # free moto's copy of the upload (this zeroes contentsize, set just below)
        key._bench_body = FileBody(fd, size)
        key.contentsize = size
        key._etag = hashlib.md5(head + str(size).encode()).hexdigest()  # listings never hash the whole file
        key.checksum_value = None
        key.checksum_algorithm = None

    FakeKey.value = property(get_value, set_value)  # type: ignore[assignment, method-assign]
    FakeKey.set_metadata = set_metadata  # type: ignore[method-assign]


def main(argv: list[str]) -> None:
    sparse_dir = os.environ.get("BENCH_SPARSE_DIR") or tempfile.gettempdir()
    install_patches(sparse_dir)
    from moto.server import main as moto_main

    moto_main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
