"""Ranged reads received straight into the caller's buffer (storage/base.py `receive_body_into`) on S3 (moto)
and GCS (the emulator), on 127.0.0.1: every byte right, the direct path really taken, connections reused
after a whole body, and a body cut mid-way (through tests/slowproxy.py) handled as that backend's SDK read
handles it (S3: a RemoteError, transfer retries the part; GCS: retried by the store), leaving no broken
connection in the pool."""

from __future__ import annotations

import hashlib
import threading
from typing import Any

import pytest

from slowproxy import SlowProxy
from streamctl.common.sizes import MiB
from streamctl.errors import RemoteError, UsageError
from streamctl.storage import StorageOptions, gcs, open_location, s3
from streamctl.storage.base import Store

DATA = hashlib.sha256(b"body into").digest() * (9 * MiB // 32) + b"tail"  # 9 MiB + 4 bytes
MODULES = {"s3": s3, "gs": gcs}
ENDPOINT_VARIABLES = {"s3": "AWS_ENDPOINT_URL", "gs": "STORAGE_EMULATOR_HOST"}


@pytest.fixture(params=sorted(MODULES))
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def root(backend: str, request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue(f"{backend}_root"))


@pytest.fixture
def received(backend: str, monkeypatch: pytest.MonkeyPatch) -> list[int | None]:
    """What each read's `receive_body_into` returned (None: the SDK's own read was used)."""
    results: list[int | None] = []
    module = MODULES[backend]
    original = module.receive_body_into

    def spy(raw: object, buffer: memoryview) -> int | None:
        result = original(raw, buffer)
        results.append(result)
        return result

    monkeypatch.setattr(module, "receive_body_into", spy)
    return results


def _store(url: str) -> tuple[Store, str]:
    location = open_location(url, StorageOptions(max_attempts=3))
    return location.store, location.key("w.safetensors")


def test_ranged_reads_land_in_the_buffer_through_the_direct_path(root: str, received: list[int | None]) -> None:
    store, key = _store(root)
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
    for start, length in ((0, -1), (-1, 10)):
        with pytest.raises(UsageError):
            store.read_range(key, start, length)


def test_a_body_cut_mid_way_fails_or_retries_as_the_sdk_read_does(
    backend: str,
    root: str,
    storage_servers: Any,
    monkeypatch: pytest.MonkeyPatch,
    received: list[int | None],
) -> None:
    store, key = _store(root)
    store.put(key, DATA)
    upstream = int(storage_servers.get(backend).endpoint.rsplit(":", 1)[1])
    cuts = iter([True])  # the first ranged GET of the object only

    def first_get(method: str, path: str) -> bool:
        return method == "GET" and "w.safetensors" in path and next(cuts, False)

    with SlowProxy(upstream, first_get, "cut", cut_bytes=MiB // 2) as proxy:
        monkeypatch.setenv(ENDPOINT_VARIABLES[backend], proxy.url)
        through, _ = _store(root)
        buffer = bytearray(4 * MiB)
        if backend == "s3":  # botocore does not retry a body: the caller (transfer's part retry) does
            with pytest.raises(RemoteError) as raised:
                through.read_range_into(key, MiB, memoryview(buffer))
            assert raised.value.exit_code == 6
        assert through.read_range_into(key, MiB, memoryview(buffer)) == 4 * MiB
        assert bytes(buffer) == DATA[MiB : 5 * MiB]
        assert proxy.hits == 1 and proxy.requests == 2  # cut once; the next GET (its connection a new one) whole
    assert received == [4 * MiB]  # the cut read raised inside the direct path; the next one took it too
