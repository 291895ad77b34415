"""S3 ranged reads received straight into the caller's buffer (storage/base.py `receive_body_into`), against
moto on 127.0.0.1: every byte right, the direct path really taken, connections reused after a whole body,
and a body cut mid-way (through tests/slowproxy.py) failing as the SDK's own read does, without a broken
connection left in the pool."""

from __future__ import annotations

import hashlib
import threading
from typing import Any

import pytest

from slowproxy import SlowProxy
from streamctl.errors import RemoteError
from streamctl.storage import StorageOptions, open_location, s3
from streamctl.storage.base import MiB
from streamctl.storage.s3 import S3Store

DATA = hashlib.sha256(b"s3 body").digest() * (9 * MiB // 32) + b"tail"  # 9 MiB + 4 bytes


@pytest.fixture
def received(monkeypatch: pytest.MonkeyPatch) -> list[int | None]:
    """What each read's `receive_body_into` returned (None: the SDK's own read was used)."""
    results: list[int | None] = []
    original = s3.receive_body_into

    def spy(raw: object, buffer: memoryview) -> int | None:
        result = original(raw, buffer)
        results.append(result)
        return result

    monkeypatch.setattr(s3, "receive_body_into", spy)
    return results


def _store(url: str) -> tuple[S3Store, str]:
    location = open_location(url, StorageOptions(max_attempts=3))
    assert isinstance(location.store, S3Store)
    return location.store, location.key("w.safetensors")


def test_ranged_reads_land_in_the_buffer_through_the_direct_path(s3_root: str, received: list[int | None]) -> None:
    store, key = _store(s3_root)
    store.put(key, DATA)
    part = 2 * MiB
    buffers = {start: bytearray(part) for start in range(0, len(DATA), part)}
    counts: dict[int, int] = {}

    def read(start: int) -> None:
        counts[start] = store.read_range_into(key, start, memoryview(buffers[start]))

    threads = [threading.Thread(target=read, args=(start,)) for start in buffers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert b"".join(bytes(buffers[start])[: counts[start]] for start in sorted(buffers)) == DATA
    last = len(DATA) - 4 * part  # 1 MiB + 4 bytes
    assert sorted(counts.values()) == [last, part, part, part, part]
    assert sorted(received, key=lambda n: n or 0) == [last, part, part, part, part]  # none fell back
    # The same store goes on reading on the connections those bodies left clean, the SDK's way too.
    again = bytearray(3 * MiB)
    assert store.read_range_into(key, 5, memoryview(again)) == 3 * MiB and bytes(again) == DATA[5 : 5 + 3 * MiB]
    assert store.read_range(key, len(DATA) - 10, 100) == DATA[-10:]
    # A buffer larger than what is left: the file's end, and the rest of the buffer untouched.
    tail = bytearray(b"\xff" * MiB)
    assert store.read_range_into(key, len(DATA) - 100, memoryview(tail)) == 100
    assert bytes(tail[:100]) == DATA[-100:] and tail[100:] == b"\xff" * (MiB - 100)
    assert store.read_range_into(key, len(DATA), memoryview(bytearray(10))) == 0  # at the end: nothing


def test_a_body_cut_mid_way_is_a_network_failure_and_the_next_read_is_whole(
    s3_root: str, storage_servers: Any, monkeypatch: pytest.MonkeyPatch, received: list[int | None]
) -> None:
    """As with the SDK's own read, a body cut short is a RemoteError (exit 6: transfer retries the part);
    its broken connection is dropped, not pooled, so the next read on the same store is whole."""
    store, key = _store(s3_root)
    store.put(key, DATA)
    upstream = int(storage_servers.get("s3").endpoint.rsplit(":", 1)[1])
    cuts = iter([True])  # the first ranged GET of the object only

    def first_get(method: str, path: str) -> bool:
        return method == "GET" and "w.safetensors" in path and next(cuts, False)

    with SlowProxy(upstream, first_get, "cut", cut_bytes=MiB // 2) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        through, _ = _store(s3_root)
        buffer = bytearray(4 * MiB)
        with pytest.raises(RemoteError) as raised:
            through.read_range_into(key, MiB, memoryview(buffer))
        assert raised.value.exit_code == 6
        assert through.read_range_into(key, MiB, memoryview(buffer)) == 4 * MiB
        assert bytes(buffer) == DATA[MiB : 5 * MiB]
        assert proxy.hits == 1 and proxy.requests == 2
    assert received == [4 * MiB]  # the cut read raised inside the direct path; the next one took it too
