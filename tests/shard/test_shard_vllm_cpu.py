"""`streamctl shard --engine vllm-cpu` (and `--engine auto`) end to end: the parent side of the worker
protocol, judged by vLLM 0.33 itself (the oracle venv; skipped without it). One worker serves every
in-process run of this module; tiny models are built once per module by the oracle's python.

Tests without the oracle: the CLI's engine options, and a hostile stand-in worker (a tiny script that speaks
the protocol and then breaks it) to test the parent's reaction to a worker that dies or lies mid-write."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from cli_helpers import run_cli
from oracle import check_sharded_many, installed_vllm_version, oracle_python, requires_vllm_oracle
from progress_helpers import RecordingProgress
from published_models import minilm_folder
from shard_models import write_model
from slowproxy import SlowProxy
from streamctl import output
from streamctl.checkpoint.files import SHARD_MANIFEST_NAME
from streamctl.errors import EngineFailed, UsageError
from streamctl.shard.engines.vllm_cpu.client import VllmWorker, start_worker
from streamctl.shard.plan import ShardOptions
from streamctl.shard.result import ShardCheckFailed, ShardResult
from streamctl.shard.run import shard_checkpoint
from streamctl.storage import open_location
from streamctl.storage.url import resolve_source_url

TINY_BUILDER = Path(__file__).resolve().parents[1] / "vllm_oracle" / "tiny_hf_models.py"
KINDS = ("mixtral", "llama")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny random HF checkpoints written by transformers in the oracle venv, once per module."""
    python = oracle_python()
    assert python is not None
    root = tmp_path_factory.mktemp("tiny-hf")
    built = subprocess.run(
        [python, str(TINY_BUILDER), str(root), *KINDS], capture_output=True, text=True, timeout=600, check=False
    )
    assert built.returncode == 0 and "FAILED" not in built.stdout, built.stdout + built.stderr
    return {kind: root / kind for kind in KINDS}


@pytest.fixture(scope="module")
def worker() -> Iterator[VllmWorker]:
    """One vLLM worker for every in-process run of the module (vLLM's import costs ~6-10 s)."""
    python = oracle_python()
    assert python is not None
    with start_worker(python) as started:
        yield started


def rank_files(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.glob("model-*.safetensors"))


def vllm_cpu(tp: int, **options: Any) -> ShardOptions:
    return ShardOptions(tensor_parallel_size=tp, engine="vllm-cpu", **options)


# ---------------------------------------------------------------------------------------------------
# vLLM 0.33 as the judge


@requires_vllm_oracle
def test_sources_cli_and_parts_are_loaded_by_vllm(
    tmp_path: Path, tiny: dict[str, Path], worker: VllmWorker, s3_root: str, fake_hub: Any, storage_env: Any
) -> None:
    """The CLI (its own worker) on a local Mixtral, and the library with the shared worker on SOURCE in a
    bucket, on the Hub, and with --max-part-size cutting several parts: every output loads in vLLM's own
    ShardedStateLoader equal to vLLM's HF load (check_sharded), and the run's own checks passed."""
    mixtral = tiny["mixtral"]
    cli = run_cli(
        "shard", str(mixtral), str(tmp_path / "cli"), "-tp", "2", "--engine", "vllm-cpu", "--json", timeout=300
    )
    assert cli.exit_code == 0, cli.stderr
    document = cli.json()
    version = installed_vllm_version()  # the oracle's: 0.33.0, or 0.34.0 (STREAMCTL_ORACLE_VLLM_VERSION)
    assert (document["engine"], document["vllm_version"], document["served_dtype"]) == ("vllm-cpu", version, "BF16")
    assert document["checks"]["tensors"]["ok"] and document["checks"]["tensors"]["tensors"] == 72
    assert document["checks"]["vllm_loader"]["ok"] and document["checks"]["vllm_loader"]["ranks_checked"] == 2
    manifest = json.loads((tmp_path / "cli" / SHARD_MANIFEST_NAME).read_text())
    assert manifest["complete"] and manifest["engine"] == "vllm-cpu" and manifest["vllm_version"] == version
    assert manifest["architecture"] == "MixtralForCausalLM" and manifest["served_dtype"] == "BF16"

    bucket = open_location(f"{s3_root}/mixtral")
    for path in mixtral.iterdir():
        bucket.store.put(bucket.key(path.name), path.read_bytes(), {})
    fake_hub.add_repo("org/mixtral", folder=mixtral)
    runs = {
        "s3-source": (bucket, {"read_block": 4096}),  # the worker's reads answered in many ranged reads
        "hub-source": (open_location(resolve_source_url("org/mixtral")), {}),
        "parts": (open_location(str(mixtral)), {"max_part_size": 64 * 1024}),
    }
    jobs = [{"hf_dir": mixtral, "sharded_dir": tmp_path / "cli", "tp": 2}]
    for name, (source, options) in runs.items():
        dest = tmp_path / name
        result = shard_checkpoint(source, open_location(str(dest)), vllm_cpu(2, **options), worker=worker)
        assert result.ok and result.engine == "vllm-cpu", name
        assert result.tensor_check is not None and result.tensor_check.tensors == 72, name
        assert result.loader_check is not None and result.loader_check.checked == 2, name
        jobs.append({"hf_dir": mixtral, "sharded_dir": dest, "tp": 2})
    parts = rank_files(tmp_path / "parts")
    assert len(parts) > 2 * 2 and "model-rank-1-part-2.safetensors" in parts, parts
    verdicts = check_sharded_many(jobs)
    failed = [
        (str(job["sharded_dir"]), verdict) for job, verdict in zip(jobs, verdicts, strict=True) if not verdict["ok"]
    ]
    assert not failed, json.dumps(failed, default=str)[:4000]


@requires_vllm_oracle
def test_dest_bucket_gets_every_tensor_of_vllms_rank_model(
    tiny: dict[str, Path], worker: VllmWorker, s3_root: str
) -> None:
    """DEST in a bucket: written through multipart uploads, every tensor re-read from the bucket against
    the worker's sha256 (vLLM's loader check needs a local DEST and is reported as not run)."""
    dest = open_location(f"{s3_root}/tp2")
    result = shard_checkpoint(open_location(str(tiny["mixtral"])), dest, vllm_cpu(2), worker=worker)
    assert result.ok and result.loader_check is None
    assert result.tensor_check is not None and result.tensor_check.tensors == 72
    data_bytes = sum(file.size - _header_size(dest, file.path) for file in result.files)
    assert result.tensor_check.bytes_compared == data_bytes
    names = sorted(dest.relative(info.key) for info in dest.list())
    assert names == sorted(
        ["config.json", "generation_config.json", SHARD_MANIFEST_NAME, *(f.path for f in result.files)]
    )
    manifest = _manifest(dest)
    assert manifest["engine"] == "vllm-cpu" and manifest["complete"]


@requires_vllm_oracle
def test_a_dest_too_long_for_the_planned_names_is_refused_before_the_lease(
    tiny: dict[str, Path], worker: VllmWorker, s3_root: str
) -> None:
    """The names vLLM's plan gives (rank files, serving files, manifest, lease) are checked
    against S3's 1,024 bytes before the lease: nothing at all lands in the bucket."""
    dest = open_location(f"{s3_root}/{'p' * 990}")
    with pytest.raises(UsageError, match=r"name too long for S3: .* is 1,\d{3} bytes of UTF-8.*; S3 holds 1,024"):
        shard_checkpoint(open_location(str(tiny["llama"])), dest, vllm_cpu(2), worker=worker)
    assert list(open_location(s3_root.rpartition("/")[0]).store.list("")) == []


def _manifest(dest: Any) -> dict[str, Any]:
    document: dict[str, Any] = json.loads(dest.store.read_range(dest.key(SHARD_MANIFEST_NAME), 0, 1 << 20))
    return document


def _header_size(dest: Any, path: str) -> int:
    head = dest.store.read_range(dest.key(path), 0, 8)
    return 8 + int.from_bytes(head, "little")


@requires_vllm_oracle
def test_a_rerun_rewrites_only_the_parts_that_changed(
    tmp_path: Path, tiny: dict[str, Path], worker: VllmWorker
) -> None:
    """Run again into the same DEST: every rank file is unchanged, so none is written (and the worker is
    asked for no part); remove one file and only its part (all TP ranks) is written again."""
    source, dest = open_location(str(tiny["mixtral"])), open_location(str(tmp_path / "out"))
    options = vllm_cpu(2, max_part_size=64 * 1024)
    first = shard_checkpoint(source, dest, options, worker=worker)
    again = shard_checkpoint(source, dest, options, worker=worker)
    assert again.ok and again.bytes_written == 0 and set(again.skipped) == {file.path for file in first.files}
    assert again.tensor_check is not None and again.tensor_check.tensors == 0
    (tmp_path / "out" / "model-rank-1-part-1.safetensors").unlink()
    third = shard_checkpoint(source, dest, options, worker=worker)
    rewritten = {"model-rank-0-part-1.safetensors", "model-rank-1-part-1.safetensors"}
    assert third.ok and set(third.skipped) == {file.path for file in first.files} - rewritten
    assert third.loader_check is not None and third.loader_check.checked == 2
    assert {file.path: file.sha256 for file in third.files} == {file.path: file.sha256 for file in first.files}


@requires_vllm_oracle
def test_auto_picks_the_offline_writer_for_the_table_and_vllm_cpu_otherwise(
    tmp_path: Path, tiny: dict[str, Path], worker: VllmWorker
) -> None:
    picked = {}
    for kind in KINDS:
        progress = RecordingProgress()
        source, dest = open_location(str(tiny[kind])), open_location(str(tmp_path / kind))
        result = shard_checkpoint(source, dest, ShardOptions(tensor_parallel_size=2), progress, worker=worker)
        assert result.ok, kind
        picked[kind] = result.engine
        logs = [message for event, message in progress.events if event == "log"]
        assert any(message.startswith(f"engine {result.engine}: ") for message in logs), logs
    assert picked == {"mixtral": "vllm-cpu", "llama": "offline"}


@requires_vllm_oracle
def test_vllms_refusals_exit_2_with_its_words_before_anything_is_written(
    tmp_path: Path, tiny: dict[str, Path], worker: VllmWorker
) -> None:
    """An architecture vLLM does not know, and a TP that does not divide the heads: UsageError with the
    worker's kind as its code and vLLM's message, DEST untouched; the worker serves the next run."""
    unknown = tmp_path / "unknown"
    shutil.copytree(tiny["llama"], unknown)
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "architectures": ["FooForCausalLM"]}))
    cases = [(unknown, 2, "unsupported-architecture", "FooForCausalLM"), (tiny["mixtral"], 3, "bad-parallel-size", "3")]
    for source, tp, code, words in cases:
        dest = tmp_path / f"out-{code}"
        with pytest.raises(UsageError) as raised:
            shard_checkpoint(open_location(str(source)), open_location(str(dest)), vllm_cpu(tp), worker=worker)
        assert raised.value.code == code and words in raised.value.message, raised.value.message
        assert not dest.exists() or not list(dest.iterdir())
    cli = run_cli("shard", str(unknown), str(tmp_path / "cli"), "-tp", "2", "--json", timeout=300)
    assert cli.exit_code == 2, cli.stderr
    error = cli.json()["error"]
    assert error["code"] == "unsupported-architecture" and "FooForCausalLM" in error["message"]
    assert not (tmp_path / "cli").exists() or not list((tmp_path / "cli").iterdir())
    assert shard_checkpoint(
        open_location(str(tiny["mixtral"])), open_location(str(tmp_path / "after")), vllm_cpu(2), worker=worker
    ).ok


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def _gone(pid: int, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


@requires_vllm_oracle
@pytest.mark.parametrize("how", ["ctrl-c", "sigterm", "kill-9"])
def test_an_interrupted_or_killed_run_leaves_nothing_under_a_final_name(
    tmp_path: Path, tiny: dict[str, Path], s3_root: str, storage_env: dict[str, str], how: str
) -> None:
    """Ctrl-C or SIGTERM while the parts go up (slowly, through a proxy): exit 130 / 143, every upload
    aborted, nothing in DEST, the worker stopped (the signal forwarded to it). kill -9: no weight under a
    final name, the manifest says incomplete, and the worker (its own session: the terminal's signals never
    reach it) dies with streamctl (PR_SET_PDEATHSIG). (A worker that stops answering: the stand-in's tests,
    test_shard_vllm_cpu_lifecycle.py.)"""
    import boto3

    bucket = s3_root.split("/")[2]
    client = boto3.client("s3", endpoint_url=storage_env["AWS_ENDPOINT_URL"])
    dest = f"{s3_root}/{how}"
    port = int(storage_env["AWS_ENDPOINT_URL"].rsplit(":", 1)[1])
    part_upload = lambda method, path: method == "PUT" and "partNumber=" in path  # noqa: E731
    with SlowProxy(port, part_upload, "steady", rate_bps=16 * 1024) as proxy:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "streamctl",
                "shard",
                str(tiny["mixtral"]),
                dest,
                "-tp",
                "2",
                "--engine",
                "vllm-cpu",
            ],
            env={**os.environ, **storage_env, "AWS_ENDPOINT_URL": proxy.url},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 180
        while not client.list_multipart_uploads(Bucket=bucket).get("Uploads"):
            assert process.poll() is None, "shard finished before it could be interrupted"
            assert time.monotonic() < deadline, "no rank file was started"
            time.sleep(0.05)
        workers = _children(process.pid)
        assert workers, "the vLLM worker is not a child of streamctl"
        process.send_signal({"ctrl-c": signal.SIGINT, "sigterm": signal.SIGTERM, "kill-9": signal.SIGKILL}[how])
        sent = time.monotonic()
        _, stderr = process.communicate(timeout=120)
        ended = time.monotonic() - sent
    assert all(_gone(pid, timeout=5) for pid in workers), "the vLLM worker outlived streamctl"
    location = open_location(dest)
    left = sorted(location.relative(info.key) for info in location.list())
    if how in ("ctrl-c", "sigterm"):
        assert process.returncode == {"ctrl-c": 130, "sigterm": 143}[how], stderr
        assert stderr.strip() == {"ctrl-c": "error: interrupted", "sigterm": "error: terminated (SIGTERM)"}[how]
        assert ended < 10
        assert left == []
        assert not client.list_multipart_uploads(Bucket=bucket).get("Uploads"), "a multipart upload was left open"
    else:
        assert not [name for name in left if name.startswith("model-")], left
        manifest = json.loads(location.store.read_range(location.key(SHARD_MANIFEST_NAME), 0, 1 << 20))
        assert manifest["complete"] is False


@requires_vllm_oracle
def test_a_dest_that_fails_mid_write_aborts_every_file(tmp_path: Path, tiny: dict[str, Path]) -> None:
    """A rank file's write fails half-way (a file size limit: EFBIG on the writer thread): the error
    names the file, every upload is aborted and what the run began is removed, DEST is left empty."""
    import resource

    def limit_file_size() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, 256 * 1024))  # the rank files are ~346 KiB

    dest = tmp_path / "out"
    command = [sys.executable, "-m", "streamctl", "shard", str(tiny["mixtral"]), str(dest), "-tp", "2", "--json"]
    completed = subprocess.run(
        command, capture_output=True, text=True, timeout=300, preexec_fn=limit_file_size, check=False
    )
    assert completed.returncode == 6, completed.stderr
    error = json.loads(completed.stdout)["error"]
    assert error["code"] == "out-of-resources", error
    assert "model-rank-" in error["message"] and "file too large" in error["message"], error
    assert not dest.exists() or sorted(dest.rglob("*")) == []


# ---------------------------------------------------------------------------------------------------
# The engine options (no vLLM needed)


def test_data_parallel_above_1_is_refused_naming_why(tmp_path: Path) -> None:
    write_model(tmp_path / "hf", "llama-gqa", num_hidden_layers=2)
    result = run_cli(
        "shard", str(tmp_path / "hf"), str(tmp_path / "out"), "-tp", "2", "--data-parallel-size", "2", "--json"
    )
    assert result.exit_code == 2, result.stderr
    error = result.json()["error"]
    assert error["code"] == "bad-option-value" and "TP (and PP) rank only" in error["message"], error
    assert not (tmp_path / "out").exists()
    one = run_cli("shard", str(tmp_path / "hf"), str(tmp_path / "one"), "-tp", "2", "--data-parallel-size", "1")
    assert one.exit_code == 0, one.stderr


def test_engine_vllm_is_the_old_name_of_vllm_gpu(tmp_path: Path) -> None:
    """`--engine vllm` still works and means vllm-gpu: here (no vllm package in streamctl's Python) both
    stop with the same error naming vllm-gpu."""
    write_model(tmp_path / "hf", "llama-gqa", num_hidden_layers=2)
    answers = [
        run_cli("shard", str(tmp_path / "hf"), str(tmp_path / "out"), "-tp", "2", "--engine", name)
        for name in ("vllm", "vllm-gpu")
    ]
    assert answers[0].exit_code == answers[1].exit_code == 127, answers[0].stderr
    assert answers[0].stderr == answers[1].stderr and "--engine vllm-gpu" in answers[0].stderr
    bad = run_cli("shard", str(tmp_path / "hf"), str(tmp_path / "out"), "-tp", "2", "--engine", "vllm-tpu")
    assert bad.exit_code == 2 and "vllm-cpu" in bad.stderr


def test_expert_parallel_with_the_offline_writer_is_refused(tmp_path: Path) -> None:
    write_model(tmp_path / "hf", "llama-gqa", num_hidden_layers=2)
    result = run_cli(
        "shard", str(tmp_path / "hf"), str(tmp_path / "out"), "-tp", "2", "--engine", "offline",
        "--enable-expert-parallel",
    )  # fmt: skip
    assert result.exit_code == 2 and "lays out no experts" in result.stderr, result.stderr


# ---------------------------------------------------------------------------------------------------
# A hostile worker: speaks the protocol, then breaks it (no vLLM needed)

HOSTILE_WORKER = r"""
import hashlib, json, os, sys
out = sys.stdout.buffer
def send(header, payload=b""):
    out.write(json.dumps(header).encode() + b"\n" + payload)
    out.flush()
mode = os.environ["HOSTILE_MODE"]
for line in sys.stdin.buffer:
    request = json.loads(line)
    if request["op"] == "plan":
        send({"type": "log", "message": "hostile worker: planning"})
        if mode == "refuse":
            send({"type": "error", "kind": "unsupported-quantization", "message": "no MXFP4 expert kernel", "detail": ""})
            continue
        tensors = [{"name": "a.weight", "dtype": "BF16", "shape": [64], "layer": 0},
                   {"name": "b.weight", "dtype": "BF16", "shape": [64], "layer": 0}]
        if mode == "rank-shapes":  # rank 0's shape must be the tensor's own
            tensors[0]["rank_shapes"] = [[32]]
        send({"type": "plan", "vllm_version": "0.33.0", "torch_version": "x", "architecture": "LlamaForCausalLM",
              "served_dtype": "BF16", "num_layers": 1, "quantization": None, "shims": [],
              "stages": [{"pp_rank": 0, "layers": [0, 1], "tensors": tensors}]})
    elif request["op"] == "write":
        first = request["stages"][0]["parts"][0][0]
        if mode in ("sha-right", "sha-wrong", "sha-wrong-bucket", "loader-bad"):
            for name in request["stages"][0]["parts"][0]:
                sha = "0" * 64 if mode.startswith("sha-wrong") else hashlib.sha256(b"\1" * 128).hexdigest()
                send({"type": "tensor", "pp_rank": 0, "tp_rank": 0, "name": name, "dtype": "BF16", "shape": [64],
                      "nbytes": 128, "sha256": sha}, b"\1" * 128)
            send({"type": "written", "seconds": 0.1, "peak_rss_mib": 1.0, "kept_construction_value": []})
            continue
        if mode == "die":
            print("hostile worker: dying now", file=sys.stderr, flush=True)
            send({"type": "tensor", "pp_rank": 0, "tp_rank": 0, "name": first, "dtype": "BF16", "shape": [64],
                  "nbytes": 128, "sha256": "0" * 64}, b"\1" * 40)
            os._exit(3)
        if mode == "nbytes":
            send({"type": "tensor", "pp_rank": 0, "tp_rank": 0, "name": first, "dtype": "BF16", "shape": [64],
                  "nbytes": 100, "sha256": "0" * 64}, b"\1" * 100)
        if mode == "name":
            send({"type": "tensor", "pp_rank": 0, "tp_rank": 0, "name": "c.weight", "dtype": "BF16", "shape": [64],
                  "nbytes": 128, "sha256": "0" * 64}, b"\1" * 128)
        sys.stdin.buffer.read()
    elif request["op"] == "check":  # what the real worker answers: its sha256 of each loaded tensor against the sent one
        problems = {"loader-bad": ["c.weight: loaded but not planned"],
                    "sha-wrong": [f"{n}.weight: loaded bytes differ from the written ones (sha256)" for n in "ab"]}
        problems = problems.get(mode, [])
        matched = 0 if mode == "sha-wrong" else 2
        rank = {"pp_rank": 0, "tp_rank": 0, "ok": not problems, "tensors": 2, "tensors_matched": matched,
                "bytes_matched": 128 * matched, "problems": problems}
        send({"type": "checked", "loader": "runai_streamer_sharded", "ranks": [rank], "peak_rss_mib": 1.0})
"""


def hostile_worker(tmp_path: Path, mode: str, monkeypatch: pytest.MonkeyPatch) -> VllmWorker:
    (tmp_path / "hostile_worker.py").write_text(HOSTILE_WORKER)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("HOSTILE_MODE", mode)
    return start_worker(sys.executable, module="hostile_worker")


@pytest.mark.parametrize("mode", ["die", "nbytes", "name", "refuse"])
def test_a_worker_that_dies_or_lies_mid_write_leaves_nothing(
    tmp_path: Path, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stand-in worker that dies in the middle of a tensor, announces the wrong size, or sends a tensor
    off the plan: EngineFailed naming it, the worker killed, every upload aborted, DEST as it was; one that
    refuses the plan (as it refuses MXFP4): UsageError with its kind, nothing started. With --debug
    (engine_logs) the worker's stderr lines reach the progress log."""
    write_model(tmp_path / "hf", "llama-gqa", num_hidden_layers=1)
    dest = tmp_path / "out"
    hostile = hostile_worker(tmp_path, mode, monkeypatch)
    progress = RecordingProgress()
    try:
        expected = UsageError if mode == "refuse" else EngineFailed
        with pytest.raises(expected) as raised:
            source, options = open_location(str(tmp_path / "hf")), vllm_cpu(1, engine_logs=True)
            shard_checkpoint(source, open_location(str(dest)), options, progress, worker=hostile)
        if mode == "refuse":
            assert raised.value.code == "unsupported-quantization" and "no MXFP4 expert kernel" in raised.value.message
            assert hostile.broken is None  # a refusal ends the request cleanly: the worker stays usable
        else:
            assert hostile.broken is not None and hostile.process.poll() is not None
            words = {"die": "went away", "nbytes": "differs from the plan", "name": "differs from the plan"}[mode]
            assert words in raised.value.message, raised.value.message
            if mode == "die":
                assert "exit 3" in raised.value.message
                assert "hostile worker: dying now" in (raised.value.hint or ""), raised.value.hint
                assert ("log", "vllm: hostile worker: dying now") in progress.events, progress.events
    finally:
        hostile.close()
    assert not dest.exists() or sorted(str(path.relative_to(dest)) for path in dest.rglob("*")) == []


@pytest.mark.parametrize("mode", ["sha-right", "sha-wrong", "sha-wrong-bucket", "loader-bad"])
def test_the_checks_after_writing_judge_the_files_by_the_workers_digests_and_loader(
    tmp_path: Path, mode: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], s3_root: str
) -> None:
    """A worker whose bytes match its sha256 and whose loader check passes: a complete run, the worker's
    log frame shown, the report naming both checks, the tensor check the loader's sha256 comparisons (one read
    of DEST). A sha256 the DEST bytes do not have (found by vLLM's loader on a local DEST, by re-reading every
    tensor from a bucket), or a rank vLLM's loader rejects: ShardCheckFailed (exit 1), the manifest left
    incomplete."""
    write_model(tmp_path / "hf", "llama-gqa", num_hidden_layers=1)
    dest = open_location(s3_root if mode == "sha-wrong-bucket" else str(tmp_path / "out"))
    progress = RecordingProgress()
    with hostile_worker(tmp_path, mode, monkeypatch) as hostile:
        run = partial(shard_checkpoint, open_location(str(tmp_path / "hf")), dest, vllm_cpu(1), progress)
        if mode == "sha-right":
            result = run(worker=hostile)
            assert result.ok and result.tensor_check is not None and result.tensor_check.tensors == 2
            assert result.tensor_check.read_by == "vllm-loader" and result.tensor_check.bytes_compared == 256
            assert result.loader_check is not None and result.loader_check.checked == 1
            assert ("log", "hostile worker: planning") in progress.events
            assert _manifest(dest)["complete"] is True
            output.render_shard_result(result)
            shown = " ".join(capsys.readouterr().out.split())
            assert "engine vllm-cpu" in shown and "vLLM 0.33.0 model code" in shown, shown
            assert "tensors vs vLLM's rank models OK (2 tensors, 256 B loaded back by vLLM)" in shown, shown
            assert "vLLM's ShardedStateLoader OK (1 rank loaded)" in shown, shown
            return
        with pytest.raises(ShardCheckFailed) as raised:
            run(worker=hostile)
    failed = raised.value.result
    assert isinstance(failed, ShardResult) and raised.value.exit_code == 1
    if mode.startswith("sha-wrong"):
        assert failed.tensor_check is not None and not failed.tensor_check.ok
        assert "differ from vLLM's rank model" in failed.tensor_check.problems[0]
        bucket = mode == "sha-wrong-bucket"
        assert (
            "the tensor check failed" if bucket else "the tensor and vLLM loader check failed"
        ) in raised.value.message
        assert failed.tensor_check.read_by == ("re-read" if bucket else "vllm-loader")
        assert (failed.loader_check is None) == bucket
    else:
        assert failed.tensor_check is not None and failed.tensor_check.ok
        assert failed.loader_check is not None and not failed.loader_check.ok
        assert "loaded but not planned" in failed.loader_check.problems[0]
        assert "vLLM loader check failed" in raised.value.message
    assert _manifest(dest)["complete"] is False
    output.render_shard_checks(failed)
    shown = " ".join(capsys.readouterr().out.split())
    assert "tensor check: " in shown and "FAILED" in shown, shown


def test_a_worker_python_that_cannot_run_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError) as raised:
        start_worker(str(tmp_path / "no-such-python"))
    assert "--vllm-python" in (raised.value.hint or "")


def test_the_workers_reads_are_answered_in_blocks_read_ahead(tmp_path: Path) -> None:
    """A read of a bucket or Hub SOURCE is answered block by block (a few in flight), never held whole;
    a file shorter than its header says is an IntegrityError, not short data."""
    from streamctl.errors import IntegrityError
    from streamctl.retry import RetryPolicy
    from streamctl.shard.engines.vllm_cpu.engine import _range_reader

    data = bytes(range(256)) * 100
    (tmp_path / "f.bin").write_bytes(data)
    read = _range_reader(open_location(str(tmp_path)), RetryPolicy(), 4096)
    chunks = list(read("f.bin", 100, 20000))
    assert [len(chunk) for chunk in chunks] == [4096] * 4 + [20000 - 4 * 4096]
    assert b"".join(chunks) == data[100:20100]
    with pytest.raises(IntegrityError):
        list(read("f.bin", 20000, 10000))


def test_a_dest_holding_other_files_is_refused_before_the_worker_starts(tmp_path: Path) -> None:
    """A non-empty DEST that cannot be a re-run is refused before vLLM is even looked for: here the
    --vllm-python does not exist, and the error is about DEST, not about it (nothing waits on a worker)."""
    write_model(tmp_path / "hf", "llama-gqa", num_hidden_layers=2)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    args = ["shard", str(tmp_path / "hf"), str(tmp_path / "out"), "-tp", "2", "--engine", "vllm-cpu"]
    result = run_cli(*args, "--vllm-python", str(tmp_path / "no-such-python"), "--json")
    assert result.exit_code == 2, result.stderr
    assert "already holds 1 file" in result.json()["error"]["message"], result.stdout
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"
    forced = run_cli(*args, "--vllm-python", str(tmp_path / "no-such-python"), "--force", "--json")
    assert forced.exit_code == 2 and "no-such-python" in forced.json()["error"]["message"], forced.stdout


def test_the_tensor_pipe_is_widened_to_a_mebibyte(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Weights cross the worker's stdout pipe: 1 MiB of pipe, not Linux's 64 KiB default (16x fewer wake-ups)."""
    import fcntl

    from streamctl.shard.engines.vllm_cpu.client import PIPE_SIZE

    worker = hostile_worker(tmp_path, "die", monkeypatch)
    try:
        assert fcntl.fcntl(worker.stdout.fileno(), fcntl.F_GETPIPE_SZ) == PIPE_SIZE == 1024 * 1024
    finally:
        worker.close()


@pytest.mark.parametrize(("given", "expected"), [(None, "1"), ("0", "0")])
def test_the_worker_asks_for_huge_pages_unless_told_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given: str | None, expected: str
) -> None:
    """The worker process itself runs with PyTorch's THP_MEM_ALLOC_ENABLE=1 (fresh weights fault in 2 MiB at a
    time); a value the user exported is passed on as it is."""
    if given is None:
        monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    else:
        monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", given)
    worker = hostile_worker(tmp_path, "die", monkeypatch)
    try:
        environ = Path(f"/proc/{worker.process.pid}/environ").read_bytes().split(b"\0")
        assert f"THP_MEM_ALLOC_ENABLE={expected}".encode() in environ
    finally:
        worker.close()


@requires_vllm_oracle
def test_a_published_model_without_pipeline_stages_is_built_a_rank_at_a_time(
    tmp_path: Path, worker: VllmWorker, s3_root: str
) -> None:
    """all-MiniLM-L6-v2 as published (sentence-transformers' BertModel, 1_Pooling/, modules.json): vLLM's
    BertModel has no pipeline stages, so there is no pseudo stage of one layer; each rank is built and loaded
    whole, and the run says so. TP 1 from the folder and TP 2 from a bucket (the worker reads every tensor
    through the parent) land with the serving files beside them, and vLLM judges every rank (its own HF load
    against the runai_streamer_sharded load, bit for bit). PP 2 is vLLM's own refusal (exit 2) before anything
    is written."""
    folder = minilm_folder()
    bucket = open_location(f"{s3_root}/minilm")
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        bucket.store.put(bucket.key(path.relative_to(folder).as_posix()), path.read_bytes(), {})
    source = open_location(str(folder))
    jobs = []
    for tp, run_source in ((1, source), (2, bucket)):
        progress = RecordingProgress()
        dest = tmp_path / f"tp{tp}"
        result = shard_checkpoint(run_source, open_location(str(dest)), vllm_cpu(tp), progress, worker=worker)
        assert result.ok and result.loader_check is not None and result.loader_check.checked == tp
        assert any("no pipeline stages, so each rank is built whole" in line for line in progress.lines)
        manifest = json.loads((dest / SHARD_MANIFEST_NAME).read_text())
        assert manifest["architecture"] == "BertModel" and manifest["layerwise"] is False, manifest
        assert rank_files(dest) == [f"model-rank-{rank}-part-0.safetensors" for rank in range(tp)]
        assert (dest / "1_Pooling" / "config.json").is_file() and (dest / "modules.json").is_file()
        jobs.append({"hf_dir": minilm_folder(), "sharded_dir": dest, "tp": tp})
    verdicts = check_sharded_many(jobs)
    assert all(verdict["ok"] for verdict in verdicts), json.dumps(verdicts, default=str)[:4000]
    assert [len(verdict["ranks"]) for verdict in verdicts] == [1, 2]
    with pytest.raises(UsageError) as raised:
        options = ShardOptions(tensor_parallel_size=1, pipeline_parallel_size=2, engine="vllm-cpu")
        shard_checkpoint(source, open_location(str(tmp_path / "pp2")), options, worker=worker)
    assert "Pipeline parallelism is not supported for this model" in raised.value.message
    assert not (tmp_path / "pp2").exists()


def test_a_plan_with_bad_per_rank_shapes_is_refused_before_anything_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Per-rank shapes (uneven expert parallelism) are checked like the rest of the plan: a worker whose
    "rank_shapes" do not fit the tensor is an EngineFailed naming them, and DEST stays empty."""
    write_model(tmp_path / "hf", "llama-gqa", num_hidden_layers=1)
    dest = tmp_path / "out"
    hostile = hostile_worker(tmp_path, "rank-shapes", monkeypatch)
    try:
        with pytest.raises(EngineFailed) as raised:
            shard_checkpoint(open_location(str(tmp_path / "hf")), open_location(str(dest)), vllm_cpu(1), worker=hostile)
        assert "bad per-rank shapes" in raised.value.message and "a.weight" in raised.value.message
    finally:
        hostile.close()
    assert not dest.exists() or not any(dest.rglob("*"))
