"""GCS part uploads (storage/gcs.py): each part is one media upload sent straight from the caller's buffer,
checked by CRC32C against what the service stored, against the GCS emulator behind a FaultProxy."""

from __future__ import annotations

import base64
import random

import google_crc32c
import pytest

from faultproxy import FaultProxy
from servers import StorageServers
from streamctl.errors import IntegrityError
from streamctl.storage import StorageOptions, open_location
from streamctl.storage.gcs import crc32c_base64

KiB = 1024


def test_crc32c_of_a_view_is_the_crc32c_of_its_bytes() -> None:
    data = random.Random(3).randbytes(700 * KiB + 5)  # several 256 KiB slices and a short tail
    expected = crc32c_base64(data)
    assert expected == crc32c_base64(memoryview(bytearray(data)).toreadonly())
    assert base64.b64decode(expected) == google_crc32c.value(data).to_bytes(4, "big")


def test_a_part_corrupted_in_transit_is_refused_and_the_next_send_lands(
    storage_servers: StorageServers, gs_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = int(storage_servers.gcs().endpoint.rsplit(":", 1)[1])
    # One byte of the first connection's request stream flipped, 200 KiB in: inside the part's body.
    proxy = FaultProxy(port, corrupt=frozenset({1}), corrupt_at=200 * KiB).start()
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
    try:
        root = open_location(gs_root, StorageOptions(max_attempts=1))
        part = random.Random(4).randbytes(512 * KiB)
        upload = root.store.start_multipart(root.key("model.bin"), len(part))
        with pytest.raises(IntegrityError, match="corrupted in transit"):
            upload.upload_part(0, memoryview(part))
        assert proxy.faults == 1
        upload.upload_part(0, memoryview(part))  # sent again, intact this time: it replaces the bad part object
        upload.complete()
        assert root.store.read_range(root.key("model.bin"), 0, 2 * len(part)) == part
    finally:
        proxy.stop()
