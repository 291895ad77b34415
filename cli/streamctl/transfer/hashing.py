"""The checksums a transfer checks each file by: its sha256, and the git blob sha1 of small hub files."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial

from streamctl.common.sizes import MiB
from streamctl.errors import IntegrityError
from streamctl.retry import RetryPolicy, with_retries
from streamctl.storage.base import Location

HASH_CHUNK = 8 * MiB
GIT_SHA1_KEY = "gitsha1"  # letters and digits only: Azure metadata names must be identifiers


@dataclass
class Digests:
    """sha256 (and, when needed, the git blob sha1) of one file, fed in order."""

    size: int
    with_git_sha1: bool = True  # only small hub files are checked by it: skip the CPU for the rest
    sha256: hashlib._Hash = field(default_factory=hashlib.sha256)
    git_sha1: hashlib._Hash = field(init=False)

    def __post_init__(self) -> None:
        self.git_sha1 = hashlib.sha1(b"blob %d\x00" % self.size)

    def update(self, data: bytes | memoryview) -> None:
        self.sha256.update(data)
        if self.with_git_sha1:
            self.git_sha1.update(data)


def _read_chunks(location: Location, path: str, size: int, policy: RetryPolicy) -> Iterator[bytes]:
    key = location.key(path)
    for start in range(0, size, HASH_CHUNK):
        length = min(HASH_CHUNK, size - start)
        data = with_retries(partial(location.store.read_range, key, start, length), policy)
        if len(data) != length:
            raise IntegrityError(f"{location.store.url(key)} is shorter than its listed size {size}")
        yield data


def hash_object(location: Location, path: str, size: int, policy: RetryPolicy) -> str:
    digests = Digests(size, with_git_sha1=False)
    for chunk in _read_chunks(location, path, size, policy):
        digests.update(chunk)
    return digests.sha256.hexdigest()


def mismatch(digests: Digests, sha256: str | None, git_sha1: str | None) -> str | None:
    """A description of the checksum mismatch, or None when the bytes are right."""
    got = digests.sha256.hexdigest()
    if sha256 is not None and got != sha256:
        return f"sha256 {got} != expected {sha256}"
    if sha256 is None and git_sha1 is not None and digests.git_sha1.hexdigest() != git_sha1:
        return f"git blob sha1 {digests.git_sha1.hexdigest()} != expected {git_sha1}"
    return None
