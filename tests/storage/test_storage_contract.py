"""The storage contract (storage/base.py), run against every backend: a local folder, S3 (moto), GCS
(gcp-storage-emulator) and Azure Blob (Azurite). The SDK-error mapping and each backend's configuration are in
test_storage_backends.py, URL parsing in test_storage_url.py.

Access denied with a real 403: S3 via moto's IAM authentication (switched on for one test, with a user whose
policy allows only s3:ListBucket), Azure via Azurite with a wrong account key and with a read-only SAS. The GCS
emulator has no authorization at all, so GCS 401/403 (and the cases no local server produces: throttling,
expired tokens, corruption, missing credentials on Azure) are covered by unit tests of the mapping functions
(test_storage_backends.py).
"""

from __future__ import annotations

import base64
import os
import random
import sys
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from servers import AZURITE_KEY, GCSServer, S3Server, StorageServers, azurite_connection_string, unique_name
from streamctl.errors import (
    AccessDeniedError,
    NotFoundError,
    RemoteError,
    UsageError,
)
from streamctl.storage import Location, StorageOptions, open_location, parse_url

# Few SDK retries: failure paths stay fast, and one retry still exercises the retry configuration.
OPTIONS = StorageOptions(max_attempts=2)
REMOTE = ("s3", "gs", "az")
BACKEND_MODULES = {"s3": "s3", "gs": "gcs", "az": "azure"}


def open_root(url: str, options: StorageOptions = OPTIONS) -> Location:
    return open_location(url, options)


def backend(request: pytest.FixtureRequest) -> str:
    return str(request.node.callspec.params["any_root"])


def put_all(location: Location, names: list[str], data: bytes = b"x") -> None:
    for name in names:
        location.store.put(location.key(name), data)


def names_under(location: Location) -> list[str]:
    return [location.relative(info.key) for info in location.list()]


def xattrs_supported(path: str) -> bool:
    """Local metadata lives in extended attributes; some file systems (older tmpfs) have none."""
    probe = Path(path) / ".xattr-probe"
    probe.write_bytes(b"")
    try:
        os.setxattr(probe, "user.streamctl.probe", b"1")
        return True
    except OSError:
        return False
    finally:
        probe.unlink()


def missing_bucket_url(url: str, tmp_path: Path) -> str:
    parsed = parse_url(url)
    if parsed.scheme == "file":
        return str(tmp_path / "no-such-folder")
    return f"{parsed.scheme}://{unique_name('missing')}/data"


# -- listing ----------------------------------------------------------------------------------------------


def test_list_is_recursive_in_key_order_and_location_excludes_sibling_prefixes(any_root: str) -> None:
    root = open_root(any_root)
    put_all(root, ["ab", "a2/y", "a/b", "a/2/x", "a/1", "b"], data=b"12345")
    folder = Location(root.store, root.key("a"))

    assert names_under(folder) == ["1", "2/x", "b"]  # a2/ and ab are siblings, not children
    assert all(info.size == 5 for info in folder.list())
    # Store.list is a plain string prefix: siblings included, still in key order.
    by_string_prefix = [root.relative(info.key) for info in root.store.list(root.key("a"))]
    assert by_string_prefix == ["a/1", "a/2/x", "a/b", "a2/y", "ab"]
    assert names_under(root) == ["a/1", "a/2/x", "a/b", "a2/y", "ab", "b"]
    assert list(Location(root.store, root.key("nothing-here")).list()) == []


def test_list_follows_pagination(any_root: str, request: pytest.FixtureRequest) -> None:
    root = open_root(any_root)
    if hasattr(root.store, "page_size"):
        root.store.page_size = 3  # type: ignore[attr-defined]
    names = [f"p/{index:02d}" for index in range(11)]
    shuffled = names[:]
    random.Random(7).shuffle(shuffled)
    put_all(root, shuffled)

    # Count listing requests, to prove the listing really spans pages (4 pages of at most 3).
    # The GCS emulator ignores maxResults (one page whatever the size), so there only the result is checked.
    pages: list[int] = []
    if backend(request) == "s3":
        root.store._client.meta.events.register(  # type: ignore[attr-defined]
            "after-call.s3.ListObjectsV2", lambda **_: pages.append(1)
        )
    elif backend(request) == "az":
        container = root.store._container  # type: ignore[attr-defined]
        list_blobs = container.list_blobs
        container.list_blobs = lambda *args, **kwargs: list_blobs(
            *args, raw_response_hook=lambda _: pages.append(1), **kwargs
        )
    assert names_under(root) == names
    if backend(request) in ("s3", "az"):
        assert len(pages) == 4


# -- stat, put, read --------------------------------------------------------------------------------------


def test_put_and_stat_report_size_etag_and_lowercased_metadata(any_root: str, request: pytest.FixtureRequest) -> None:
    root = open_root(any_root)
    key = root.key("dir/model.safetensors")
    metadata = {"Streamctl_SHA256": "ab" * 32, "origin": "hf://org/model"}

    put_info = root.store.put(key, b"hello world", metadata)
    info = root.store.stat(key)

    assert (put_info.key, put_info.size) == (key, 11)
    assert (info.key, info.size) == (key, 11)
    assert info.etag
    if backend(request) == "local" and not xattrs_supported(any_root):
        pytest.skip("no extended attributes on this file system: local metadata is dropped by design")
    expected = {"streamctl_sha256": "ab" * 32, "origin": "hf://org/model"}
    assert dict(put_info.metadata) == expected
    assert dict(info.metadata) == expected


def test_put_overwrites_bytes_and_metadata(any_root: str) -> None:
    root = open_root(any_root)
    key = root.key("file.bin")
    root.store.put(key, b"old old old", {"version": "1"})
    first_etag = root.store.stat(key).etag

    root.store.put(key, b"new", {"other": "2"})

    info = root.store.stat(key)
    assert info.size == 3
    assert root.store.read_range(key, 0, 100) == b"new"
    assert "version" not in info.metadata
    assert info.etag != first_etag
    assert names_under(root) == ["file.bin"]


def test_read_range_edges(any_root: str) -> None:
    root = open_root(any_root)
    key = root.key("range.bin")
    data = bytes(range(256)) * 4  # 1024 bytes, every offset distinguishable within 256
    root.store.put(key, data)
    read = root.store.read_range

    assert read(key, 0, 0) == b""  # zero length
    assert read(key, 0, 10) == data[:10]
    assert read(key, 300, 17) == data[300:317]
    assert read(key, 1023, 1) == data[-1:]  # last byte
    assert read(key, 1020, 10) == data[1020:]  # spans the end: fewer bytes
    assert read(key, 1024, 5) == b""  # at the end
    assert read(key, 5000, 5) == b""  # past the end
    assert read(key, 0, 1 << 20) == data  # more than all
    with pytest.raises(UsageError):
        read(key, -1, 5)


def test_read_range_into_fills_a_buffer_as_read_range_answers(any_root: str) -> None:
    root = open_root(any_root)
    key = root.key("range-into.bin")
    data = random.Random(5).randbytes(3 * 65536 + 17)
    root.store.put(key, data)

    def read_into(start: int, size: int) -> bytes:
        buffer = bytearray(b"\xaa" * (size + 8))  # 8 guard bytes past the view: never written
        count = root.store.read_range_into(key, start, memoryview(buffer)[:size])
        assert buffer[size:] == b"\xaa" * 8
        assert bytes(buffer[count:size]) == b"\xaa" * (size - count)  # nothing written past what was read
        return bytes(buffer[:count])

    for start, size in [(0, 0), (0, len(data)), (5, 65536), (len(data) - 3, 3), (len(data) - 3, 10),
                        (len(data), 5), (len(data) + 100, 5), (0, len(data) + 4096)]:  # fmt: skip
        assert read_into(start, size) == root.store.read_range(key, start, size) == data[start : start + size]


def test_parts_sent_from_one_reused_buffer(any_root: str) -> None:
    """The transfer engine reads, hashes and sends every part from one reused buffer, as a read-only view:
    each store must accept the view and keep nothing of it once upload_part returns."""
    root = open_root(any_root)
    key = root.key("reused/model.safetensors")
    part_size, parts = _parts(root.store.min_part_size, 3, 4321)
    buffer = bytearray(part_size)
    upload = root.store.start_multipart(key, part_size)
    for index, part in enumerate(parts):
        view = memoryview(buffer)[: len(part)]
        view[:] = part
        upload.upload_part(index, view.toreadonly())
        buffer[:] = b"\x00" * part_size  # the next part overwrites it: what was sent must already be gone
    upload.complete()
    assert root.store.read_range(key, 0, part_size * 4) == b"".join(parts)


def test_read_range_of_empty_object(any_root: str) -> None:
    root = open_root(any_root)
    key = root.key("empty")
    root.store.put(key, b"")

    assert root.store.stat(key).size == 0
    assert root.store.read_range(key, 0, 10) == b""
    assert root.store.read_range(key, 0, 0) == b""


# -- multipart --------------------------------------------------------------------------------------------


def _parts(store_min: int, count: int, tail: int) -> tuple[int, list[bytes]]:
    part_size = max(store_min, 64 * 1024)
    rng = random.Random(count)
    parts = [rng.randbytes(part_size) for _ in range(count - 1)] + [rng.randbytes(tail)]
    return part_size, parts


def test_multipart_parallel_out_of_order_is_invisible_until_complete(any_root: str) -> None:
    root = open_root(any_root)
    key = root.key("big/model-00001.safetensors")
    part_size, parts = _parts(root.store.min_part_size, 4, 1234)
    order = [3, 1, 0, 2]

    upload = root.store.start_multipart(key, part_size, {"Streamctl_SHA256": "cafe"})
    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(lambda index: upload.upload_part(index, parts[index]), order))

    assert names_under(root) == []  # nothing visible, temporary part objects included
    with pytest.raises(NotFoundError):
        root.store.stat(key)

    info = upload.complete()

    expected = b"".join(parts)
    assert (info.key, info.size) == (key, len(expected))
    stat = root.store.stat(key)
    assert stat.size == len(expected)
    assert root.store.read_range(key, 0, len(expected) + 10) == expected
    assert root.store.read_range(key, part_size - 3, 6) == expected[part_size - 3 : part_size + 3]
    assert names_under(root) == ["big/model-00001.safetensors"]
    if parse_url(any_root).scheme != "file" or xattrs_supported(any_root):
        assert stat.metadata.get("streamctl_sha256") == "cafe"
    upload.abort()  # a late abort (say, from a cleanup path) must not undo a completed upload
    assert root.store.stat(key).size == len(expected)


def test_multipart_abort_leaves_nothing_and_keeps_an_older_object(any_root: str) -> None:
    root = open_root(any_root)
    fresh, existing = root.key("fresh.bin"), root.key("existing.bin")
    root.store.put(existing, b"old content")
    part_size, parts = _parts(root.store.min_part_size, 2, 100)

    for key in (fresh, existing):
        upload = root.store.start_multipart(key, part_size)
        upload.upload_part(1, parts[1])
        upload.upload_part(0, parts[0])
        upload.abort()
        upload.abort()  # safe twice

    assert names_under(root) == ["existing.bin"]
    assert root.store.read_range(existing, 0, 100) == b"old content"
    with pytest.raises(NotFoundError):
        root.store.stat(fresh)


def test_unfinished_uploads_are_listed_and_discarded(any_root: str) -> None:
    """An upload whose process died (neither completed nor aborted) is listed under its future key and
    discarded without a trace; complete objects are not listed, nor uploads outside the prefix asked for."""
    root = open_root(any_root)
    part_size, parts = _parts(root.store.min_part_size, 2, 100)
    done = root.key("done.bin")
    root.store.put(done, b"complete")
    abandoned = {}
    for name in ("sub/killed.bin", "killed.bin"):
        upload = root.store.start_multipart(root.key(name), part_size)
        upload.upload_part(0, parts[0])  # ... and the process is gone: nobody aborts it
        abandoned[root.key(name)] = upload

    assert [upload.key for upload in root.store.unfinished_uploads(root.key("sub/"))] == [root.key("sub/killed.bin")]
    found = root.store.unfinished_uploads(root.key(""))
    assert sorted(upload.key for upload in found) == sorted(abandoned)
    for upload in found:
        upload.discard()
        upload.discard()  # safe twice
    assert root.store.unfinished_uploads(root.key("")) == []
    assert names_under(root) == ["done.bin"]
    for key in abandoned:
        with pytest.raises(NotFoundError):
            root.store.stat(key)


def test_multipart_without_parts_gives_an_empty_object(any_root: str) -> None:
    root = open_root(any_root)
    key = root.key("empty.bin")
    upload = root.store.start_multipart(key, max(root.store.min_part_size, 1024))

    info = upload.complete()

    assert info.size == 0
    assert root.store.stat(key).size == 0


def test_gcs_multipart_composes_more_than_32_parts_and_cleans_up(gs_root: str, storage_servers: StorageServers) -> None:
    root = open_root(gs_root)
    key = root.key("many-parts.bin")
    parts = [bytes([index]) * 1000 for index in range(70)]  # 70 sources: two levels of compose
    order = list(range(70))
    random.Random(3).shuffle(order)

    upload = root.store.start_multipart(key, 1000, {"k": "v"})
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(lambda index: upload.upload_part(index, parts[index]), order))
    server = storage_servers.gcs()
    assert isinstance(server, GCSServer)
    bucket = parse_url(gs_root).bucket
    assert len(server.object_names(bucket)) == 70  # the parts exist...
    assert names_under(root) == []  # ...but list() hides them

    info = upload.complete()

    assert info.size == 70_000
    assert root.store.read_range(key, 0, 80_000) == b"".join(parts)
    assert root.store.stat(key).metadata == {"k": "v"}
    assert server.object_names(bucket) == [key]  # parts and intermediates deleted
    assert upload.leftovers == []  # type: ignore[attr-defined]


# -- delete -----------------------------------------------------------------------------------------------


def test_delete_removes_and_tolerates_missing(any_root: str) -> None:
    root = open_root(any_root)
    key = root.key("gone.bin")
    root.store.put(key, b"data")

    root.store.delete(key)
    root.store.delete(key)  # already gone
    root.store.delete(root.key("never-existed"))

    with pytest.raises(NotFoundError):
        root.store.stat(key)
    assert names_under(root) == []


# -- not found --------------------------------------------------------------------------------------------


def test_missing_object_is_not_found(any_root: str) -> None:
    root = open_root(any_root)
    key = root.key("missing.bin")
    url = root.store.url(key)

    for call in (lambda: root.store.stat(key), lambda: root.store.read_range(key, 0, 10)):
        with pytest.raises(NotFoundError) as caught:
            call()
        assert url in caught.value.message or str(Path(url)) in caught.value.message
        if parse_url(any_root).scheme in REMOTE:
            assert "no such object" in caught.value.message
    with pytest.raises(NotFoundError):
        root.store.read_range(key, 0, 0)


def test_missing_bucket_is_not_found_and_says_so(any_root: str, tmp_path: Path) -> None:
    url = missing_bucket_url(any_root, tmp_path)
    root = open_root(url)

    with pytest.raises(NotFoundError) as caught:
        list(root.list())
    if parse_url(url).scheme == "file":
        return  # a local folder is created on first write; listing a missing one is the whole contract
    word = "container" if parse_url(url).scheme == "az" else "bucket"
    assert f"{word} {parse_url(url).bucket!r} does not exist" in caught.value.message
    assert caught.value.hint and word in caught.value.hint

    key = root.key("x.bin")
    calls = {
        "stat": lambda: root.store.stat(key),
        "read": lambda: root.store.read_range(key, 0, 10),
        "put": lambda: root.store.put(key, b"x"),
        "multipart": lambda: root.store.start_multipart(key, root.store.min_part_size).upload_part(0, b"x"),
    }
    for name, call in calls.items():
        with pytest.raises(NotFoundError) as caught:
            call()
        assert f"{word} {parse_url(url).bucket!r} does not exist" in caught.value.message, name
    root.store.delete(key)  # deleting from a missing bucket is "already gone"


# -- access denied and unreachable services ---------------------------------------------------------------


def test_s3_policy_denial_is_access_denied_naming_the_permission(
    s3_root: str, storage_servers: StorageServers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real 403 from moto's IAM enforcement: a user allowed s3:ListBucket only."""
    server = storage_servers.s3()
    assert isinstance(server, S3Server)
    bucket = parse_url(s3_root).bucket
    root = open_root(s3_root)
    root.store.put(root.key("secret.bin"), b"data")
    iam = server.iam_client()
    user = unique_name("reader")
    iam.create_user(UserName=user)
    iam.put_user_policy(
        UserName=user,
        PolicyName="list-only",
        PolicyDocument=(
            '{"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:ListBucket",'
            f' "Resource": "arn:aws:s3:::{bucket}"}}]}}'
        ),
    )
    key = iam.create_access_key(UserName=user)["AccessKey"]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])
    limited = open_root(s3_root)

    server.set_auth(True)
    try:
        assert names_under(limited) == ["secret.bin"]  # the policy really is evaluated: listing is allowed
        with pytest.raises(AccessDeniedError) as read_denied:
            limited.store.read_range(limited.key("secret.bin"), 0, 4)
        with pytest.raises(AccessDeniedError) as write_denied:
            limited.store.put(limited.key("new.bin"), b"x")
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAUNKNOWNKEY000000")
        with pytest.raises(AccessDeniedError) as unknown_key:
            list(open_root(s3_root).list())
    finally:
        server.set_auth(False)

    assert s3_root in read_denied.value.message and "access denied to read" in read_denied.value.message
    assert "s3:GetObject" in (read_denied.value.hint or "")
    assert "s3:PutObject" in (write_denied.value.hint or "")
    assert "rejected the credentials" in unknown_key.value.message
    assert "AWS_ACCESS_KEY_ID" in (unknown_key.value.hint or "")


def test_azure_wrong_key_and_read_only_sas_are_access_denied(
    az_root: str, storage_servers: StorageServers, monkeypatch: pytest.MonkeyPatch
) -> None:
    from azure.storage.blob import ContainerSasPermissions, generate_container_sas

    server = storage_servers.azure()
    container = parse_url(az_root).bucket
    open_root(az_root).store.put("data/a.bin", b"a")

    wrong_key = base64.b64encode(b"not the key" * 4).decode()
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite_connection_string(server.endpoint, wrong_key))
    with pytest.raises(AccessDeniedError) as bad_key:
        list(open_root(az_root).list())
    assert "rejected the credentials" in bad_key.value.message
    assert "AZURE_STORAGE_CONNECTION_STRING" in (bad_key.value.hint or "")

    sas = generate_container_sas(
        "devstoreaccount1",
        container,
        account_key=AZURITE_KEY,
        permission=ContainerSasPermissions(read=True, list=True),
        expiry=datetime.now(UTC) + timedelta(hours=1),
    )
    monkeypatch.setenv(
        "AZURE_STORAGE_CONNECTION_STRING",
        f"BlobEndpoint={server.endpoint}/devstoreaccount1;SharedAccessSignature={sas}",
    )
    read_only = open_root(az_root)
    assert names_under(read_only) == ["a.bin"]  # the SAS works for what it grants
    with pytest.raises(AccessDeniedError) as denied:
        read_only.store.put("data/b.bin", b"b")
    assert "access denied to write" in denied.value.message
    assert "Storage Blob Data Contributor" in (denied.value.hint or "")


@pytest.mark.parametrize("scheme", REMOTE)
def test_unreachable_service_is_remote_error(scheme: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from servers import free_port

    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens here
    monkeypatch.setenv("AWS_ENDPOINT_URL", dead)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", dead)
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite_connection_string(dead))
    root = open_root(f"{scheme}://bucket-x/data", StorageOptions(max_attempts=1))

    with pytest.raises(RemoteError) as caught:
        root.store.stat(root.key("a.bin"))
    assert caught.value.message.startswith(f"{scheme}://bucket-x/data/a.bin: ")
    assert "unavailable" in caught.value.message and caught.value.hint


def test_s3_without_credentials_is_access_denied_naming_the_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    from servers import free_port

    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # never reached
    root = open_root("s3://bucket-x/data")

    with pytest.raises(AccessDeniedError) as caught:
        list(root.list())
    assert "no S3 credentials" in caught.value.message
    assert "AWS_ACCESS_KEY_ID" in (caught.value.hint or "") and "AWS_PROFILE" in (caught.value.hint or "")


def test_gcs_without_credentials_is_access_denied_naming_the_fix(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "no-such-key.json"))
    root = open_root("gs://bucket-x/data")

    with pytest.raises(AccessDeniedError) as caught:
        root.store.stat(root.key("a.bin"))
    assert "no GCS credentials" in caught.value.message
    assert "gcloud auth application-default login" in (caught.value.hint or "")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux-only")
def test_local_writes_start_writeback_best_effort(tmp_path: Path) -> None:
    """The local store asks the kernel to write back as it goes (so completing a multi-GB file does not
    wait on one huge fsync); the call is found on Linux, and a refusal never surfaces as an error."""
    from streamctl.common import libc as _libc

    assert _libc._sync_file_range() is not None
    _libc.start_writeback(-1, 0, 4096)  # EBADF is ignored: writeback is an optimisation, fsync still follows
    store = open_location(str(tmp_path)).store
    upload = store.start_multipart("big.bin", 1 << 20)
    upload.upload_part(0, b"a" * (1 << 20))
    upload.upload_part(1, b"b" * 10)
    upload.complete()
    assert (tmp_path / "big.bin").read_bytes() == b"a" * (1 << 20) + b"b" * 10


def test_unfinished_upload_clean_up_is_best_effort_without_the_permission(
    s3_root: str, storage_servers: StorageServers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Credentials that may write objects but not list multipart uploads (a common least-privilege
    policy) are enough for a run: the clean-up of earlier runs' uploads is skipped with a note, not fatal."""
    from progress_helpers import RecordingProgress
    from streamctl.dest.uploads import discard_unfinished_uploads

    server = storage_servers.s3()
    assert isinstance(server, S3Server)
    bucket = parse_url(s3_root).bucket
    root = open_root(s3_root)
    left = root.store.start_multipart(root.key("model.safetensors"), root.store.min_part_size)
    left.upload_part(0, b"x")  # an earlier run's, killed
    iam = server.iam_client()
    user = unique_name("writer")
    iam.create_user(UserName=user)
    actions = '["s3:ListBucket", "s3:GetObject", "s3:PutObject"]'
    iam.put_user_policy(
        UserName=user,
        PolicyName="write-no-uploads-listing",
        PolicyDocument=(
            f'{{"Version": "2012-10-17", "Statement": [{{"Effect": "Allow", "Action": {actions},'
            f' "Resource": ["arn:aws:s3:::{bucket}", "arn:aws:s3:::{bucket}/*"]}}]}}'
        ),
    )
    key = iam.create_access_key(UserName=user)["AccessKey"]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])
    limited = open_root(s3_root)
    progress = RecordingProgress()
    server.set_auth(True)
    try:
        with pytest.raises(AccessDeniedError):
            limited.store.unfinished_uploads(limited.key(""))  # the policy really is evaluated
        assert discard_unfinished_uploads(limited, lambda name: True, progress) == ()
        limited.store.put(limited.key("config.json"), b"{}")  # ... and the run goes on
    finally:
        server.set_auth(False)
    notes = [message for kind, message in progress.events if kind == "log"]
    assert len(notes) == 1 and notes[0].startswith("could not look for unfinished uploads of earlier runs")
    assert [upload.key for upload in root.store.unfinished_uploads(root.key(""))] == [left.key]
    left.abort()
