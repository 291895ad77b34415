"""The hf:// read-only source, against the fake hub (tests/fakehub.py) with the real huggingface_hub client."""

from __future__ import annotations

import hashlib
import ipaddress
import ssl
import threading
from pathlib import Path

import pytest

from fakehub import FakeHub, FakeRepo, git_blob_sha1
from streamctl.errors import AccessDeniedError, NotFoundError, RemoteError, StreamctlError, UsageError
from streamctl.storage import Location, StorageOptions, deadlines, open_location, parse_url
from streamctl.storage.hf import HfStore

MiB = 1024 * 1024
SECRET = "hf_SECRETtoken0123456789"
CONFIG = b'{"architectures": ["LlamaForCausalLM"]}\n'
WEIGHTS = bytes(range(256)) * 40  # 10,240 bytes; *.safetensors is LFS whatever its size


def open_hf(url: str, **options: object) -> Location:
    location = open_location(url, StorageOptions(max_attempts=3, **options))  # type: ignore[arg-type]
    assert isinstance(location.store, HfStore)
    location.store.retry_wait = 0.01  # keep retry tests fast
    return location


def store_of(url: str, **options: object) -> HfStore:
    store = open_hf(url, **options).store
    assert isinstance(store, HfStore)
    return store


def resolve_paths(hub: FakeHub) -> list[str]:
    return [r.path for r in hub.requests("hub") if "/resolve/" in r.path]


@pytest.fixture
def model(fake_hub: FakeHub) -> FakeRepo:
    return fake_hub.add_repo(
        "org/model",
        {
            "config.json": CONFIG,
            "model.safetensors": WEIGHTS,
            "tokenizer/tokenizer.json": b"{}",
            "tokenizer/vocab.txt": b"a\nb\n",
            "README.md": b"# model\n",
        },
    )


# -- URL syntax -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "repo", "revision", "repo_type", "prefix"),
    [
        ("hf://org/name", "org/name", None, "model", ""),
        ("hf://org/name@v1.0", "org/name", "v1.0", "model", ""),
        ("hf://models/org/name@main/sub/dir/", "org/name", "main", "model", "sub/dir"),
        ("hf://datasets/org/name", "org/name", None, "dataset", ""),
        ("hf://datasets/org/name@refs/pr/3/data", "org/name", "refs/pr/3", "dataset", "data"),
        ("hf://org/name@feature%2Fx/a", "org/name", "feature/x", "model", "a"),
        ("hf://org/name/dir/a@b", "org/name", None, "model", "dir/a@b"),
    ],
)
def test_parse_hf_urls(url: str, repo: str, revision: str | None, repo_type: str, prefix: str) -> None:
    parsed = parse_url(url)
    assert (parsed.scheme, parsed.bucket, parsed.revision, parsed.repo_type, parsed.prefix) == (
        "hf",
        repo,
        revision,
        repo_type,
        prefix,
    )


@pytest.mark.parametrize(
    "url", ["hf://gpt2", "hf://org/name@", "hf://org/..", "hf://org/na--me", "hf://spaces/org/x", "hf://org/n/../"]
)
def test_parse_hf_rejects(url: str) -> None:
    with pytest.raises(UsageError):
        parse_url(url)


def test_store_url_shows_the_requested_revision(fake_hub: FakeHub) -> None:
    url = "hf://datasets/org/d@feature%2Fx"
    assert store_of(url).url("a/b.json") == f"{url}/a/b.json"
    assert store_of("hf://org/m").url("x") == "hf://org/m/x"
    assert fake_hub.count() == 0  # opening a store contacts nothing


# -- revisions --------------------------------------------------------------------------------------------------


def test_branch_resolves_once_and_reads_stay_pinned(fake_hub: FakeHub, model: FakeRepo) -> None:
    first = model.refs["main"]
    store = store_of("hf://org/model")
    assert store.commit == first
    model.commit({"config.json": b"moved on\n", "model.safetensors": b"new weights"})  # main moves
    assert model.refs["main"] != first
    assert store.read_range("config.json", 0, 1000) == CONFIG
    assert store.read_range("model.safetensors", 0, 100) == WEIGHTS[:100]
    assert {info.key: info.size for info in store.list("")}["config.json"] == len(CONFIG)
    assert fake_hub.count("/revision/") == 1
    assert resolve_paths(fake_hub) and all(f"/resolve/{first}/" in path for path in resolve_paths(fake_hub))
    assert store_of("hf://org/model").read_range("config.json", 0, 100) == b"moved on\n"


def test_concurrent_first_use_resolves_once(fake_hub: FakeHub, model: FakeRepo) -> None:
    store = store_of("hf://org/model")
    seen: list[str] = []
    threads = [threading.Thread(target=lambda: seen.append(store.commit)) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen == [model.refs["main"]] * 8
    assert fake_hub.count("/revision/") == 1


def test_tag_sha_and_revision_option(fake_hub: FakeHub, model: FakeRepo) -> None:
    v1 = model.tag("v1")
    model.commit({"config.json": b"v2"})
    assert store_of("hf://org/model@v1").commit == v1
    assert store_of(f"hf://org/model@{v1}").read_range("config.json", 0, 100) == CONFIG
    # --revision beats the URL's @REV
    assert store_of("hf://org/model@main", hf_revision="v1").commit == v1
    assert store_of("hf://org/model@v1").read_range("config.json", 0, 100) == CONFIG


def test_refs_pr_revision_with_slash(fake_hub: FakeHub, model: FakeRepo) -> None:
    pr = model.commit({"config.json": b"pr"}, branch="refs/pr/1")
    store = store_of("hf://org/model@refs/pr/1")
    assert store.commit == pr
    assert store.read_range("config.json", 0, 10) == b"pr"


# -- listing and stat -------------------------------------------------------------------------------------------


def test_list_follows_pagination_sorted_with_hub_checksums(fake_hub: FakeHub, model: FakeRepo) -> None:
    fake_hub.page_size = 2  # 6 entries (5 files + 1 folder) -> 3 pages
    store = store_of("hf://org/model")
    infos = list(store.list(""))
    assert [i.key for i in infos] == sorted(model.files())
    by_key = {i.key: i for i in infos}
    weights = by_key["model.safetensors"]
    assert weights.size == len(WEIGHTS)
    assert weights.metadata == {"sha256": hashlib.sha256(WEIGHTS).hexdigest()}
    assert weights.etag == hashlib.sha256(WEIGHTS).hexdigest()
    config = by_key["config.json"]
    assert config.metadata == {"gitsha1": git_blob_sha1(CONFIG)}
    assert (config.size, config.etag) == (len(CONFIG), git_blob_sha1(CONFIG))
    assert fake_hub.count("/tree/", role="hub") == 3
    assert [i.key for i in store.list("tok")] == ["tokenizer/tokenizer.json", "tokenizer/vocab.txt"]
    assert store.stat("README.md").size == len(b"# model\n")
    assert fake_hub.count("/tree/") == 3 and fake_hub.count("/paths-info/") == 0  # served from the cache


def test_location_in_a_subfolder_lists_only_that_folder(fake_hub: FakeHub, model: FakeRepo) -> None:
    location = open_hf("hf://org/model/tokenizer")
    assert [location.relative(i.key) for i in location.list()] == ["tokenizer.json", "vocab.txt"]
    assert fake_hub.count("/tree/") == 1
    last = fake_hub.requests("hub")[-1].path
    assert "/tree/" in last and last.endswith("/tokenizer")
    assert list(open_hf("hf://org/model/no-such-folder").list()) == []


def test_stat_without_a_listing_asks_paths_info(fake_hub: FakeHub, model: FakeRepo) -> None:
    store = store_of("hf://org/model")
    assert store.stat("model.safetensors").metadata["sha256"] == hashlib.sha256(WEIGHTS).hexdigest()
    assert store.stat("tokenizer/vocab.txt").metadata["gitsha1"] == git_blob_sha1(b"a\nb\n")
    assert fake_hub.count("/paths-info/") == 2
    with pytest.raises(NotFoundError):
        store.stat("missing.bin")
    with pytest.raises(NotFoundError):
        store.stat("tokenizer")  # a folder is not a file


# -- reading ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["config.json", "model.safetensors"])  # hub origin, and CDN redirect
@pytest.mark.parametrize("listed", [False, True])
def test_read_range_edges(fake_hub: FakeHub, model: FakeRepo, path: str, listed: bool) -> None:
    data = model.files()[path].data
    size = len(data)
    store = store_of("hf://org/model")
    if listed:
        list(store.list(""))  # sizes known: reads past the end are clipped without asking
    for start, length in [(0, size), (0, 1), (size - 1, 1), (size - 1, 10), (5, 7), (0, size + 100), (3, 0)]:
        assert store.read_range(path, start, length) == data[start : start + length], (start, length)
    requests = len(fake_hub.requests())
    assert store.read_range(path, size, 10) == b""
    assert store.read_range(path, size + 50, 10) == b""
    assert (len(fake_hub.requests()) == requests) == listed  # a known size spares the 416 round trip
    with pytest.raises(UsageError):
        store.read_range(path, -1, 5)


@pytest.mark.parametrize("path", ["config.json", "model.safetensors"])
def test_a_server_ignoring_range_still_yields_the_range(fake_hub: FakeHub, model: FakeRepo, path: str) -> None:
    fake_hub.honor_range = False  # answers 200 with the whole file
    data = model.files()[path].data
    store = store_of("hf://org/model")
    assert store.read_range(path, 5, 7) == data[5:12]
    assert b"".join(store.iter_range(path, 3, len(data), chunk_size=4)) == data[3:]


def test_iter_range_streams_one_request_in_chunks(fake_hub: FakeHub) -> None:
    data = hashlib.sha256(b"seed").digest() * (3 * MiB // 32 + 100)  # 3 MiB + 3,200 bytes
    fake_hub.add_repo("org/big", {"big.safetensors": data})
    store = store_of("hf://org/big")
    chunks = list(store.iter_range("big.safetensors", 1000, 3 * MiB, chunk_size=256 * 1024))
    assert b"".join(chunks) == data[1000 : 1000 + 3 * MiB]
    assert all(len(chunk) == 256 * 1024 for chunk in chunks)
    assert fake_hub.count("big.safetensors", role="cdn", method="GET") == 1
    assert fake_hub.requests("cdn")[0].header("Range") == f"bytes=1000-{1000 + 3 * MiB - 1}"


def test_iter_range_resumes_after_a_truncated_body(fake_hub: FakeHub) -> None:
    data = bytes(range(251)) * 4000  # ~1 MB, LFS (.bin)
    fake_hub.add_repo("org/big", {"shard.bin": data})
    fake_hub.fail("shard.bin", kind="truncate", role="cdn")
    store = store_of("hf://org/big")
    assert b"".join(store.iter_range("shard.bin", 0, len(data), chunk_size=64 * 1024)) == data
    ranges = [r.header("Range") for r in fake_hub.requests("cdn")]
    assert len(ranges) == 2 and ranges[0] == f"bytes=0-{len(data) - 1}"
    resumed_at = int(ranges[1].removeprefix("bytes=").split("-")[0])
    assert 0 < resumed_at < len(data)  # the second request asked only for what was missing


def test_read_range_into_resumes_after_a_truncated_body(fake_hub: FakeHub) -> None:
    data = bytes(range(251)) * 4000  # ~1 MB, LFS (.bin)
    fake_hub.add_repo("org/big", {"shard.bin": data})
    fake_hub.fail("shard.bin", kind="truncate", role="cdn")
    store = store_of("hf://org/big")
    buffer = bytearray(len(data) + 10)
    assert store.read_range_into("shard.bin", 0, memoryview(buffer)) == len(data)  # the file ends first
    assert buffer[: len(data)] == data and buffer[len(data) :] == bytes(10)
    assert fake_hub.count("shard.bin", role="cdn", method="GET") == 2  # resumed, not started again


@pytest.mark.parametrize("kind", ["503", "reset"])
def test_transient_failures_are_retried(fake_hub: FakeHub, model: FakeRepo, kind: str) -> None:
    fake_hub.fail("config.json", times=2, kind=kind)  # type: ignore[arg-type]
    assert store_of("hf://org/model").read_range("config.json", 0, 100) == CONFIG
    assert fake_hub.count("config.json") == 3


@pytest.mark.parametrize("kind", ["503", "reset"])
def test_persistent_failures_become_remote_errors(fake_hub: FakeHub, model: FakeRepo, kind: str) -> None:
    fake_hub.fail("config.json", times=10, kind=kind)  # type: ignore[arg-type]
    with pytest.raises(RemoteError) as raised:
        store_of("hf://org/model").read_range("config.json", 0, 100)
    assert raised.value.exit_code == 6
    assert fake_hub.count("config.json") == 3  # max_attempts


def test_revision_lookup_retries_transient_failures(fake_hub: FakeHub, model: FakeRepo) -> None:
    fake_hub.fail("/revision/", times=2, kind="reset")
    assert store_of("hf://org/model").commit == model.refs["main"]
    fake_hub.fail("/revision/", times=10, kind="503")
    with pytest.raises(RemoteError):
        store_of("hf://org/model").commit
    assert fake_hub.count("/revision/") == 3 + 3


def test_cdn_redirect_never_carries_the_token(fake_hub: FakeHub) -> None:
    token = fake_hub.add_token(SECRET)
    fake_hub.add_repo("org/private", {"model.safetensors": WEIGHTS}, private=True, granted=[token])
    store = store_of("hf://org/private", hf_token=token)
    assert store.read_range("model.safetensors", 100, 50) == WEIGHTS[100:150]
    hub_resolve = [r for r in fake_hub.requests("hub") if "/resolve/" in r.path]
    assert hub_resolve and all(r.header("Authorization") == f"Bearer {SECRET}" for r in hub_resolve)
    cdn = fake_hub.requests("cdn")
    assert len(cdn) == 1 and cdn[0].header("Authorization") is None
    assert cdn[0].header("Range") == "bytes=100-149"
    assert all(SECRET not in r.text for r in cdn)


def test_corrupt_knob_flips_one_byte(fake_hub: FakeHub, model: FakeRepo) -> None:
    fake_hub.corrupt("org/model", "model.safetensors")
    got = store_of("hf://org/model").read_range("model.safetensors", 0, len(WEIGHTS))
    assert len(got) == len(WEIGHTS) and got != WEIGHTS
    assert sum(a != b for a, b in zip(got, WEIGHTS, strict=True)) == 1


# -- access and errors ------------------------------------------------------------------------------------------


def test_gated_repo_needs_a_granted_token(fake_hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    granted = fake_hub.add_token(SECRET)
    other = fake_hub.add_token("hf_otherUSERtoken42")
    fake_hub.add_repo("meta/gated", {"model.safetensors": WEIGHTS}, gated=True, granted=[granted])
    anonymous = store_of("hf://meta/gated")
    assert [i.key for i in anonymous.list("")] == ["model.safetensors"]  # metadata is public, files are not
    with pytest.raises(AccessDeniedError) as raised:
        anonymous.read_range("model.safetensors", 0, 10)
    hint = raised.value.hint or ""
    assert "meta/gated" in hint and "HF_TOKEN" in hint and "--token" in hint
    assert raised.value.exit_code == 4 and "gated" in raised.value.message
    with pytest.raises(AccessDeniedError) as raised:
        store_of("hf://meta/gated", hf_token=other).read_range("model.safetensors", 0, 10)  # 403: not granted
    assert "hf_otherUSERtoken42" not in f"{raised.value.message} {raised.value.hint}"
    assert store_of("hf://meta/gated", hf_token=granted).read_range("model.safetensors", 0, 10) == WEIGHTS[:10]
    monkeypatch.setenv("HF_TOKEN", granted)  # HF_TOKEN, found by huggingface_hub
    assert store_of("hf://meta/gated").read_range("model.safetensors", 0, 10) == WEIGHTS[:10]


def test_token_from_the_login_file(fake_hub: FakeHub) -> None:
    from huggingface_hub import constants

    token = fake_hub.add_token(SECRET)
    fake_hub.add_repo("org/private", {"a.txt": b"hello"}, private=True, granted=[token])
    with pytest.raises(NotFoundError):
        store_of("hf://org/private").read_range("a.txt", 0, 5)
    Path(constants.HF_TOKEN_PATH).write_text(token)  # what `hf auth login` leaves in this test's HF_HOME
    assert store_of("hf://org/private").read_range("a.txt", 0, 5) == b"hello"


def test_bad_token_is_access_denied_without_leaking_it(fake_hub: FakeHub, model: FakeRepo) -> None:
    store = store_of("hf://org/model", hf_token=SECRET)  # the hub does not know this token
    with pytest.raises(AccessDeniedError) as raised:
        store.read_range("config.json", 0, 10)
    assert "401" in raised.value.message
    assert "HF_TOKEN" in raised.value.hint and "hf auth login" in raised.value.hint
    assert SECRET not in f"{raised.value} {raised.value.hint} {store!r}"


def test_private_repo_without_token_is_not_found_with_a_token_hint(fake_hub: FakeHub) -> None:
    fake_hub.add_repo("org/private", {"a.txt": b"x"}, private=True)
    with pytest.raises(NotFoundError) as raised:
        list(store_of("hf://org/private").list(""))
    assert "--token" in raised.value.hint and raised.value.exit_code == 3


@pytest.mark.parametrize(
    ("url", "key", "words"),
    [
        ("hf://org/nope", "config.json", "org/nope"),
        ("hf://org/model@no-such-branch", "config.json", "no-such-branch"),
        ("hf://org/model", "no-such-file.json", "no such file"),
        ("hf://org/model@0123456789abcdef0123456789abcdef01234567", "config.json", "0123456789abcdef"),
    ],
)
def test_unknown_repo_revision_or_file_is_not_found(
    fake_hub: FakeHub, model: FakeRepo, url: str, key: str, words: str
) -> None:
    fake_hub.add_token(SECRET)
    for options in ({}, {"hf_token": SECRET}):  # 401 RepoNotFound without a token, 404 with one
        with pytest.raises(NotFoundError) as raised:
            store_of(url, **options).read_range(key, 0, 10)
        assert words in raised.value.message
        assert SECRET not in f"{raised.value} {raised.value.hint}"


def test_errors_never_contain_the_token(fake_hub: FakeHub, model: FakeRepo) -> None:
    fake_hub.add_token(SECRET)
    fake_hub.add_repo("org/gated", {"w.safetensors": b"w"}, gated=True)
    fake_hub.fail("flaky.json", times=10, kind="503")
    cases = [
        ("hf://org/missing", lambda s: s.commit),
        ("hf://org/model@nope", lambda s: list(s.list(""))),
        ("hf://org/model", lambda s: s.stat("nope")),
        ("hf://org/gated", lambda s: s.read_range("w.safetensors", 0, 1)),
        ("hf://org/model", lambda s: s.read_range("flaky.json", 0, 1)),
        ("hf://org/model", lambda s: s.put("x", b"")),
    ]
    for url, action in cases:
        store = store_of(url, hf_token=SECRET)
        with pytest.raises(StreamctlError) as raised:
            action(store)
        assert SECRET not in f"{raised.value} {raised.value.hint} {raised.value!r} {store!r}", url


def test_dataset_repos(fake_hub: FakeHub, model: FakeRepo) -> None:
    files = {"train/part-0.parquet": b"PAR1" * 100, "README.md": b"# data"}
    fake_hub.add_repo("org/data", files, repo_type="dataset")
    store = store_of("hf://datasets/org/data")
    infos = list(store.list(""))
    assert [i.key for i in infos] == ["README.md", "train/part-0.parquet"]
    assert infos[1].metadata["sha256"] == hashlib.sha256(b"PAR1" * 100).hexdigest()  # .parquet is LFS
    assert store.read_range("README.md", 2, 4) == b"data"
    paths = [r.path for r in fake_hub.requests("hub")]
    assert any(p.startswith("/api/datasets/org/data/") for p in paths)
    assert any(p.startswith("/datasets/org/data/resolve/") for p in paths)
    assert store_of("hf://org/data", hf_repo_type="dataset").read_range("README.md", 0, 1) == b"#"
    with pytest.raises(NotFoundError):
        store_of("hf://org/data").commit  # a model of that name does not exist


def test_unsafe_file_names_are_refused(fake_hub: FakeHub) -> None:
    fake_hub.add_repo("org/evil", {"ok.txt": b"ok", "../escape.txt": b"x"})
    store = store_of("hf://org/evil")
    with pytest.raises(UsageError):
        list(store.list(""))
    for key in ["../escape.txt", "/etc/passwd", "a\\b.txt", "a/../b", "a//b", ""]:
        with pytest.raises(UsageError):
            store.read_range(key, 0, 1)
        with pytest.raises(UsageError):
            list(store.iter_range(key, 0, 1))
        with pytest.raises(UsageError):
            store.stat(key)
    assert not resolve_paths(fake_hub)


def test_the_hub_is_read_only(fake_hub: FakeHub) -> None:
    store = store_of("hf://org/model")
    with pytest.raises(UsageError, match="read-only"):
        store.put("a", b"x")
    with pytest.raises(UsageError, match="read-only"):
        store.start_multipart("a", MiB)
    with pytest.raises(UsageError, match="read-only"):
        store.delete("a")
    assert fake_hub.count() == 0


def test_the_real_clients_own_download_works_against_the_fake(
    fake_hub: FakeHub, model: FakeRepo, tmp_path: Path
) -> None:
    """Guards the fake's fidelity: snapshot_download (HEAD metadata, CDN redirect, cache) must succeed."""
    from huggingface_hub import snapshot_download

    folder = Path(snapshot_download("org/model", local_dir=tmp_path / "snap"))
    assert (folder / "model.safetensors").read_bytes() == WEIGHTS
    assert (folder / "tokenizer" / "vocab.txt").read_bytes() == b"a\nb\n"
    assert fake_hub.count("model.safetensors", role="cdn") == 1


def test_parsing_and_opening_load_huggingface_hub_only_for_hf_urls() -> None:
    import subprocess
    import sys

    code = (
        "import sys; from streamctl.storage import open_location, parse_url; parse_url('hf://org/name@v1'); "
        "open_location('file:///tmp'); assert 'huggingface_hub' not in sys.modules, 'loaded too early'; "
        "open_location('hf://org/name'); assert 'huggingface_hub' in sys.modules"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_fake_hub_head_metadata_is_what_the_client_expects(fake_hub: FakeHub, tmp_path: Path) -> None:
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    (tmp_path / "src" / "sub").mkdir(parents=True)
    (tmp_path / "src" / "config.json").write_bytes(CONFIG)
    (tmp_path / "src" / "sub" / "model.safetensors").write_bytes(WEIGHTS)
    repo = fake_hub.add_repo("org/folder", folder=tmp_path / "src")
    small = get_hf_file_metadata(hf_hub_url("org/folder", "config.json"))
    assert (small.commit_hash, small.etag, small.size) == (repo.refs["main"], git_blob_sha1(CONFIG), len(CONFIG))
    big = get_hf_file_metadata(hf_hub_url("org/folder", "sub/model.safetensors"))
    assert (big.etag, big.size) == (hashlib.sha256(WEIGHTS).hexdigest(), len(WEIGHTS))
    assert big.location.startswith(fake_hub.cdn_endpoint + "/")  # the 302 to the CDN origin
    assert fake_hub.count(role="cdn") == 0  # HEAD stops at the redirect


def test_parallel_ranged_reads(fake_hub: FakeHub) -> None:
    data = hashlib.sha256(b"parallel").digest() * 32 * 1024  # 1 MiB
    fake_hub.add_repo("org/big", {"w.safetensors": data, "small.json": data[:5000]})
    store = store_of("hf://org/big")
    part = 64 * 1024
    results: dict[tuple[str, int], bytes] = {}

    def read(key: str, index: int) -> None:
        results[(key, index)] = store.read_range(key, index * part, part)

    jobs = [("w.safetensors", i) for i in range(16)] + [("small.json", i) for i in range(2)]
    threads = [threading.Thread(target=read, args=job) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert b"".join(results[("w.safetensors", i)] for i in range(16)) == data
    assert results[("small.json", 0)] + results[("small.json", 1)] == data[:5000]
    assert fake_hub.count("/revision/") == 1


# -- bodies received straight into the caller's buffer ----------------------------------------------------------


@pytest.fixture
def handed(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """What each `deadlines.body_socket` call handed out (a socket, or None: the body stayed with httpx)."""
    results: list[object] = []
    body_socket = deadlines.body_socket

    def spy(response: object, delivered: int) -> object:
        sock = body_socket(response, delivered)
        results.append(sock)
        return sock

    monkeypatch.setattr(deadlines, "body_socket", spy)
    return results


def test_read_range_into_receives_large_bodies_straight_into_the_buffer(
    fake_hub: FakeHub, handed: list[object]
) -> None:
    """Parts of a large file, on threads: every byte right, and after httpx's first piece each body came
    through the direct path (the socket handed out), on connections that are then not reused out of step."""
    data = hashlib.sha256(b"direct").digest() * (8 * MiB // 32) + b"tail"  # 8 MiB + 4 bytes
    fake_hub.add_repo("org/big", {"w.safetensors": data})
    store = store_of("hf://org/big")
    part = 2 * MiB
    buffers = {start: bytearray(part) for start in range(0, len(data), part)}

    def read(start: int) -> int:
        return store.read_range_into("w.safetensors", start, memoryview(buffers[start]))

    threads = [threading.Thread(target=read, args=(start,)) for start in buffers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert b"".join(bytes(buffers[start]) for start in sorted(buffers))[: len(data)] == data
    assert [sock is not None for sock in handed] == [True] * 4  # the 4-byte tail is all in httpx's first piece
    # The same store goes on reading (pooled connections of finished bodies, fresh ones for the rest).
    again = bytearray(3 * MiB)
    assert store.read_range_into("w.safetensors", 5, memoryview(again)) == 3 * MiB
    assert bytes(again) == data[5 : 5 + 3 * MiB]
    assert store.read_range("w.safetensors", len(data) - 10, 100) == data[-10:]


def _self_signed_certificate(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 (its IP in subjectAltName, as hostname checks need) and its key."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "cdn.pem", folder / "cdn.key"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


def test_read_range_into_over_tls_receives_the_body_from_the_tls_socket(
    fake_hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, handed: list[object]
) -> None:
    """The CDN over HTTPS, as the real hub's is: the direct path reads the TLS socket (decrypted bytes, right
    ones), and a body cut short over TLS resumes where it stopped."""
    from huggingface_hub import close_session

    cert, key = _self_signed_certificate(tmp_path)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    assert fake_hub.serve_cdn_over_tls(context).startswith("https://127.0.0.1:")
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # what httpx's default context trusts
    close_session()  # the next client is built with it
    try:
        data = hashlib.sha256(b"tls").digest() * (3 * MiB // 32) + b"end"
        fake_hub.add_repo("org/tls", {"w.safetensors": data})
        store = store_of("hf://org/tls")
        buffer = bytearray(len(data))
        assert store.read_range_into("w.safetensors", 0, memoryview(buffer)) == len(data)
        assert bytes(buffer) == data
        assert len(handed) == 1 and isinstance(handed[0], ssl.SSLSocket)
        fake_hub.fail("w.safetensors", kind="truncate", role="cdn")
        again = bytearray(len(data) - 7)
        assert store.read_range_into("w.safetensors", 7, memoryview(again)) == len(data) - 7
        assert bytes(again) == data[7:]
        assert fake_hub.count("w.safetensors", role="cdn", method="GET") == 3  # 1, then 2: cut and resumed
    finally:
        close_session()  # later tests get a client without this test's certificate


@pytest.mark.parametrize(
    ("pieces", "body_bytes"),
    [
        ([b"HTTP/1.1 206 Partial Content\r\nContent-Length: 9\r\n\r\nabc"], 3),
        ([b"HTTP/1.1 206 OK\r\nContent-", b"Length: 9\r", b"\n\r", b"\nab", b"cdef"], 6),  # the head split anywhere
        ([b"HTTP/1.1 200 OK\nContent-Length: 5\n\nab"], 2),  # bare LF line endings, which h11 accepts too
        ([b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 206 OK\r\nContent-Length: 4\r\n\r\nxy"], 2),
        ([b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n", b"HTTP/1.1 200 OK\r\n\r\n", b"1234"], 4),
        ([b"HTTP/1.1 101 Switching Protocols\r\n\r\nraw"], 3),  # 101 is a final head
    ],
)
def test_response_bytes_counts_the_body_after_the_final_head(pieces: list[bytes], body_bytes: int) -> None:
    exchange = deadlines.ResponseBytes()
    for piece in pieces:
        exchange.received(piece)
    assert exchange.head is None
    assert exchange.body_bytes == body_bytes


@pytest.mark.parametrize(
    "pieces",
    [[b"HTTP/1.1 206 OK\r\nContent-Length: 9\r\n"], [b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n"], []],
)
def test_response_bytes_knows_no_body_before_the_final_head_ends(pieces: list[bytes]) -> None:
    exchange = deadlines.ResponseBytes()
    for piece in pieces:
        exchange.received(piece)
    assert exchange.head is not None  # body_socket hands out nothing then
