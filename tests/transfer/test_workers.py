"""`transfer --worker K/N` (streamctl.dest.shares): N processes copy one model together from the fake hub into one
bucket, each its share; every file is written exactly once (counted on the wire, by a proxy in front of the
S3 server), the manifest is complete only once every share is, and a worker killed mid-way and run again
ends in the same state."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cli_helpers import run_cli
from slowproxy import SlowProxy
from streamctl.checkpoint.files import MANIFEST_NAME
from streamctl.checkpoint.safetensors import safetensors_bytes
from streamctl.dest.shares import parse_worker, split_shares
from streamctl.storage import StorageOptions, open_location
from streamctl.storage.base import Location, is_lease_name

MiB = 1024 * 1024
WORKERS = 3


def sharded_model(seed: int = 7) -> dict[str, bytes]:
    """Six shards of different sizes (two need several 5 MiB parts), an index, config and tokenizer."""
    rng = random.Random(seed)
    sizes = [12 * MiB, 11 * MiB, 3 * MiB, 2 * MiB, MiB, 300_000]
    files: dict[str, bytes] = {}
    weight_map = {}
    for number, size in enumerate(sizes, start=1):
        name = f"model-{number:05d}-of-{len(sizes):05d}.safetensors"
        files[name] = safetensors_bytes([(f"layer.{number}.weight", "U8", [size], rng.randbytes(size))])
        weight_map[f"layer.{number}.weight"] = name
    files["model.safetensors.index.json"] = json.dumps({"metadata": {}, "weight_map": weight_map}).encode()
    files["config.json"] = json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}).encode()
    files["tokenizer.json"] = b'{"version": "1.0"}'
    return files


class WireLog:
    """Every S3 request through the proxy, as (method, key, query); requests of `slow_keys` wait first."""

    def __init__(self, bucket: str, slow_keys: frozenset[str] = frozenset(), delay_s: float = 0.0) -> None:
        self.bucket, self.slow_keys, self.delay_s = bucket, slow_keys, delay_s
        self.requests: list[tuple[str, str, str]] = []
        self.lock = threading.Lock()

    def __call__(self, method: str, target: str) -> bool:
        parts = urlsplit(target)
        path = unquote(parts.path).lstrip("/")
        key = path[len(self.bucket) + 1 :] if path.startswith(self.bucket + "/") else path
        with self.lock:
            self.requests.append((method, key, parts.query))
        if key in self.slow_keys and "partNumber" in parts.query:
            time.sleep(self.delay_s)  # keeps the victim's big file in flight while it is killed
        return False  # pass every request through unchanged

    def completed(self) -> Counter[str]:
        """Objects made visible, by key: single PUTs (no part, no copy) and multipart completions."""
        with self.lock:
            requests = list(self.requests)
        made: Counter[str] = Counter()
        for method, key, query in requests:
            single_put = method == "PUT" and "partNumber" not in query and "uploadId" not in query
            made[key] += int(single_put or (method == "POST" and "uploadId" in query))
        return made

    def parts_sent(self, key: str) -> int:
        with self.lock:
            return sum(
                1 for method, name, query in self.requests if method == "PUT" and name == key and "partNumber" in query
            )


def _start(worker: str, source: str, dest: str, proxy: SlowProxy, env: dict[str, str]) -> subprocess.Popen[str]:
    args = ["transfer", source, dest, "--worker", worker, "-j", "2", "--part-size", "5MiB", "--no-verify"]
    args += ["--endpoint-url", proxy.url, "--path-style"]
    return subprocess.Popen(
        [sys.executable, "-m", "streamctl", *args],
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
    )


def _shares(files: dict[str, bytes]) -> tuple[tuple[str, ...], ...]:
    return split_shares([(name, len(body)) for name, body in files.items()], WORKERS)


def _bucket_and_prefix(url: str) -> tuple[str, str]:
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    return bucket, prefix


def _check_end_state(dest: Location, files: dict[str, bytes], wire: WireLog, prefix: str) -> dict[str, Any]:
    listed = {dest.relative(info.key): info for info in dest.list()}
    assert sorted(listed) == sorted([*files, MANIFEST_NAME])
    for name, body in files.items():
        assert dest.store.read_range(dest.key(name), 0, len(body)) == body, name
    made = wire.completed()
    for name in files:
        assert made[f"{prefix}/{name}"] == 1, (name, made[f"{prefix}/{name}"])  # every file exactly once
    manifest = json.loads(dest.store.read_range(dest.key(MANIFEST_NAME), 0, listed[MANIFEST_NAME].size))
    assert manifest["complete"] is True
    assert manifest["workers"]["finished"] == list(range(WORKERS))
    assert sorted(item["path"] for item in manifest["files"]) == sorted(files)
    leftovers = [info.key for info in dest.store.list(dest.key("")) if is_lease_name(info.key.rpartition("/")[2])]
    assert leftovers == []  # every worker released its lease
    return manifest


def test_three_workers_together_copy_every_file_exactly_once(
    fake_hub: Any, s3_root: str, storage_env: dict[str, str], storage_servers: Any
) -> None:
    files = sharded_model()
    fake_hub.add_repo("org/spread", files)
    bucket, prefix = _bucket_and_prefix(s3_root)
    wire = WireLog(bucket)
    port = int(storage_servers.s3().endpoint.rsplit(":", 1)[1])
    with SlowProxy(port, wire, mode="steady") as proxy:
        runs = [_start(f"{index}/{WORKERS}", "org/spread", s3_root, proxy, storage_env) for index in range(WORKERS)]
        outcomes = [run.communicate(timeout=240) for run in runs]
        assert [run.returncode for run in runs] == [0] * WORKERS, outcomes
        dest = open_location(s3_root, StorageOptions(endpoint_url=proxy.url, path_style=True))
        manifest = _check_end_state(dest, files, wire, prefix)
    assert all(_shares(files)), "every worker had files of its own"
    last = [out for out, _ in outcomes if "manifest complete" in out]
    assert len(last) == 1, outcomes  # exactly one worker completed the manifest
    assert manifest["source"] == "hf://org/spread"


def test_a_worker_killed_mid_way_and_run_again_ends_the_same(
    fake_hub: Any, s3_root: str, storage_env: dict[str, str], storage_servers: Any
) -> None:
    files = sharded_model(seed=8)
    fake_hub.add_repo("org/evicted", files)
    shares = _shares(files)
    victim = next(index for index, share in enumerate(shares) if any(len(files[name]) > 5 * MiB for name in share))
    big = max(shares[victim], key=lambda name: len(files[name]))
    bucket, prefix = _bucket_and_prefix(s3_root)
    wire = WireLog(bucket, slow_keys=frozenset({f"{prefix}/{big}"}), delay_s=1.0)
    port = int(storage_servers.s3().endpoint.rsplit(":", 1)[1])
    with SlowProxy(port, wire, mode="steady") as proxy:
        dest = open_location(s3_root, StorageOptions(endpoint_url=proxy.url, path_style=True))
        runs = {
            index: _start(f"{index}/{WORKERS}", "org/evicted", s3_root, proxy, storage_env) for index in range(WORKERS)
        }
        deadline = time.monotonic() + 120
        while wire.parts_sent(f"{prefix}/{big}") < 1:
            assert runs[victim].poll() is None and time.monotonic() < deadline, runs[victim].communicate()
            time.sleep(0.02)
        runs[victim].send_signal(signal.SIGKILL)  # an evicted pod: no clean-up at all
        runs[victim].wait(timeout=30)
        for index, run in runs.items():
            if index != victim:
                assert run.wait(timeout=240) == 0, run.communicate()
        listed = {dest.relative(info.key): info for info in dest.list()}
        assert big not in listed  # the killed worker's big file never became visible
        half = json.loads(dest.store.read_range(dest.key(MANIFEST_NAME), 0, listed[MANIFEST_NAME].size))
        assert half["complete"] is False and victim not in half["workers"]["finished"]
        warned = run_cli("verify-index", s3_root, "--json", env={**storage_env, "AWS_ENDPOINT_URL": proxy.url})
        codes = {finding["code"] for finding in json.loads(warned.stdout)["findings"]}
        assert "transfer-incomplete" in codes, warned.stdout
        wire.slow_keys = frozenset()
        again = _start(f"{victim}/{WORKERS}", "org/evicted", s3_root, proxy, storage_env)
        out, err = again.communicate(timeout=240)
        assert again.returncode == 0, (out, err)
        assert "manifest complete" in out
        _check_end_state(dest, files, wire, prefix)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("3/3", "the index must be from 0 to 2"),
        ("-1/3", "expected K/N"),
        ("a/b", "expected K/N"),
        ("0/0", "the number of workers must be from 1"),
        ("1", "expected K/N"),
        ("2/1", "the index must be from 0 to 0"),
        ("1/3/5", "expected K/N"),
        ("0/10001", "the number of workers must be from 1"),
    ],
)
def test_a_worker_out_of_range_is_refused_with_exit_2(value: str, message: str, tmp_path: Path) -> None:
    source = tmp_path / "model"
    source.mkdir()
    (source / "config.json").write_text("{}")
    result = run_cli("transfer", str(source), str(tmp_path / "out"), f"--worker={value}")
    assert result.exit_code == 2, (result.stdout, result.stderr)
    assert message in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()
    as_json = run_cli("transfer", str(source), str(tmp_path / "out"), "--worker", value, "--json")
    assert as_json.exit_code == 2 and json.loads(as_json.stdout)["error"]["code"] == "usage-error"


def test_worker_dry_runs_split_the_plan_into_disjoint_shares(tmp_path: Path) -> None:
    source = tmp_path / "model"
    source.mkdir()
    for name, body in sharded_model().items():
        (source / name).write_bytes(body)
    seen: list[str] = []
    for index in range(WORKERS):
        result = run_cli(
            "transfer", str(source), str(tmp_path / "out"), "--worker", f"{index}/{WORKERS}", "--dry-run", "--json"
        )
        assert result.exit_code == 0, result.stderr
        plan = json.loads(result.stdout)
        assert plan["worker"]["index"] == index and plan["worker"]["count"] == WORKERS
        seen += [item["path"] for item in plan["files"]]
    assert sorted(seen) == sorted(sharded_model())


def test_parse_worker_reads_k_of_n() -> None:
    assert (parse_worker("2/3").index, parse_worker("2/3").count) == (2, 3)
    assert str(parse_worker(" 0 / 1 ")) == "0/1"


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.dictionaries(st.text("abcdef", min_size=1, max_size=6), st.integers(0, 10**9), min_size=1, max_size=40),
    count=st.integers(1, 8),
    seed=st.integers(0, 1000),
)
def test_shares_hold_every_file_once_balanced_and_the_same_from_any_listing_order(
    sizes: dict[str, int], count: int, seed: int
) -> None:
    files = list(sizes.items())
    shares = split_shares(files, count)
    shuffled = files[:]
    random.Random(seed).shuffle(shuffled)
    assert split_shares(shuffled, count) == shares  # every worker computes the same split
    assert len(shares) == count
    assert sorted(path for share in shares for path in share) == sorted(sizes)
    loads = [sum(sizes[path] for path in share) for share in shares]
    # Greedy largest-first: the fullest share was the emptiest when it took its last file.
    assert max(loads) - min(loads) <= max(sizes.values())


def test_shares_go_largest_first_into_the_least_loaded_share_ties_by_name() -> None:
    files = [("d", 1), ("a", 5), ("c", 3), ("b", 5), ("e", 3)]
    # a(5) -> 0, b(5) -> 1 (ties by name), c(3) -> 2, e(3) -> 2 (3 < 5), d(1) -> 0 (5 = 5: the lowest index).
    assert split_shares(files, 3) == (("a", "d"), ("b",), ("c", "e"))


@pytest.mark.parametrize("root", ["local_root", "s3_root", "gs_root", "az_root"])
def test_workers_recording_their_shares_at_once_leave_one_complete_manifest(
    root: str, request: pytest.FixtureRequest
) -> None:
    """The conditional create/replace of storage.base: of racing workers each one's share goes in once, and
    exactly one of them sees the manifest complete (that one removes what --force replaces)."""
    from streamctl.dest.manifests import FileEntry
    from streamctl.dest.shares import ShareFields, Worker, record_share

    dest = open_location(request.getfixturevalue(root))
    count = 6
    order = tuple(f"file-{index}" for index in range(count))
    completions: list[int] = []
    barrier = threading.Barrier(count)

    def record(index: int) -> None:
        fields = ShareFields("hf://org/race", None, (FileEntry(order[index], index, "0" * 64),), (), (), order)
        barrier.wait()
        record_share(dest, fields, Worker(index, count), "d" * 32, lambda: completions.append(index))

    threads = [threading.Thread(target=record, args=(index,)) for index in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    stored, _ = dest.store.read_versioned(dest.key(MANIFEST_NAME))
    manifest = json.loads(stored)
    assert manifest["complete"] is True and manifest["workers"]["finished"] == list(range(count))
    assert [item["path"] for item in manifest["files"]] == list(order)
    assert len(set(completions)) == 1  # one worker completed it (it may have retried its write)


def test_a_worker_of_another_split_starts_the_record_again_and_says_so(tmp_path: Path) -> None:
    source = tmp_path / "model"
    source.mkdir()
    for name, body in sharded_model().items():
        (source / name).write_bytes(body)
    dest = tmp_path / "out"
    assert run_cli("transfer", str(source), str(dest), "--worker", "0/2", "--no-verify").exit_code == 0
    other = run_cli("transfer", str(source), str(dest), "--worker", "1/3", "--no-verify")
    assert other.exit_code == 0, other.stderr
    assert "recorded the shares of another split or plan" in " ".join(other.stdout.split())
    manifest = json.loads((dest / MANIFEST_NAME).read_text())
    assert manifest["complete"] is False and manifest["workers"] == {**manifest["workers"], "count": 3, "finished": [1]}
    for index in (0, 2):
        assert run_cli("transfer", str(source), str(dest), "--worker", f"{index}/3", "--no-verify").exit_code == 0
    assert json.loads((dest / MANIFEST_NAME).read_text())["complete"] is True


def test_an_indexed_job_of_a_hub_branch_says_to_pin_the_commit() -> None:
    image = ["--image", "registry.example/streamctl:0.1.0"]
    unpinned = run_cli("transfer", "org/model", "s3://bucket/m", "--k8s-job", "--parallelism", "2", *image)
    assert unpinned.exit_code == 0 and "--revision COMMIT" in unpinned.stderr
    pinned = run_cli(
        "transfer", "org/model", "s3://bucket/m", "--k8s-job", "--parallelism", "2", "--revision", "abc1234", *image
    )
    assert pinned.exit_code == 0 and "--revision COMMIT" not in pinned.stderr


def test_a_worker_without_the_shard_manifest_in_its_share_copies_a_sharded_checkpoint_again(tmp_path: Path) -> None:
    """The DEST checks under the lease see the whole plan: the shard manifest another share carried is the
    plan's own, not a `shard` run's in the way."""
    source = tmp_path / "model"
    source.mkdir()
    for name, body in sharded_model().items():
        (source / name).write_bytes(body)
    (source / "streamctl-shard-manifest.json").write_text(json.dumps({"tool": "streamctl", "complete": True}))
    dest = tmp_path / "out"
    for _ in range(2):  # and every worker re-runs freely
        for index in range(WORKERS):
            result = run_cli("transfer", str(source), str(dest), "--worker", f"{index}/{WORKERS}", "--no-verify")
            assert result.exit_code == 0, (index, result.stderr)
    assert json.loads((dest / MANIFEST_NAME).read_text())["complete"] is True


def test_with_force_only_the_worker_completing_the_manifest_removes_what_the_new_plan_lacks(tmp_path: Path) -> None:
    source = tmp_path / "model"
    source.mkdir()
    files = sharded_model()
    for name, body in files.items():
        (source / name).write_bytes(body)
    (source / "extra.json").write_text("{}")
    dest = tmp_path / "out"
    assert run_cli("transfer", str(source), str(dest), "--no-verify").exit_code == 0
    assert (dest / "extra.json").exists()
    for index in range(WORKERS):
        worker = ["--worker", f"{index}/{WORKERS}", "--force", "--exclude", "extra.json", "--json"]
        result = run_cli("transfer", str(source), str(dest), *worker)
        assert result.exit_code == 0, result.stderr
        removed = json.loads(result.stdout)["removed"]
        last = index == WORKERS - 1
        assert removed == (["extra.json"] if last else []), (index, removed)
        assert (dest / "extra.json").exists() is not last  # the earlier run's file stays until every share is in
    assert sorted(path.name for path in dest.iterdir()) == sorted([*files, MANIFEST_NAME])


def test_files_of_an_unrecorded_share_count_as_streamctls_for_a_later_force(tmp_path: Path) -> None:
    """A worker killed after writing some files, before recording its share: the incomplete manifest names
    the whole plan, so a later --force run that leaves those files out removes them instead of keeping them."""
    source = tmp_path / "model"
    source.mkdir()
    files = sharded_model()
    for name, body in files.items():
        (source / name).write_bytes(body)
    dest = tmp_path / "out"
    assert run_cli("transfer", str(source), str(dest), "--worker", "0/3", "--no-verify").exit_code == 0
    unrecorded = _shares(files)[1][0]
    (dest / unrecorded).write_bytes(files[unrecorded])  # what worker 1 wrote before it was killed
    plan = run_cli("transfer", str(source), str(dest), "--force", "--exclude", unrecorded, "--dry-run", "--json")
    assert plan.exit_code == 0, plan.stderr
    assert json.loads(plan.stdout)["to_remove"] == [unrecorded]
