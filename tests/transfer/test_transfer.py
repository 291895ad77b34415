"""`streamctl transfer` against real servers: the fake hub as source; local, S3, GCS and Azure as destinations."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from datetime import UTC
from pathlib import Path
from typing import Any

import pytest

from cli_helpers import run_cli
from slowproxy import SlowProxy
from streamctl.checkpoint.files import MANIFEST_NAME, select_files
from streamctl.checkpoint.safetensors import safetensors_bytes
from streamctl.common.sizes import parse_size
from streamctl.dest.uploads import PartBuffers, part_size_for
from streamctl.errors import IntegrityError, NotFoundError, UsageError
from streamctl.retry import RetryPolicy
from streamctl.storage import StorageOptions, open_location
from streamctl.storage.base import Location
from streamctl.storage.url import resolve_source_url, source_identity
from streamctl.transfer import (
    TransferOptions,
    execute_transfer,
    plan_transfer,
)
from streamctl.verify.run import verify_checkpoint

MiB = 1024 * 1024
FAST_RETRY = RetryPolicy(attempts=4, base_delay_s=0.01, max_delay_s=0.05)
OPTIONS = TransferOptions(part_size=5 * MiB, max_buffer=20 * MiB, concurrency=4, retry=FAST_RETRY)
SERVING_FILES = {
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "model.safetensors.index.json",
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
}


def model_files(big_bytes: int = 11 * MiB, seed: int = 1) -> dict[str, bytes]:
    """A small but valid HF checkpoint whose first shard needs several multipart parts, plus repo clutter."""
    rng = random.Random(seed)
    shard1 = safetensors_bytes([("model.embed_tokens.weight", "U8", [big_bytes], rng.randbytes(big_bytes))])
    shard2 = safetensors_bytes(
        [("lm_head.weight", "BF16", [4, 8], rng.randbytes(64)), ("model.norm.weight", "BF16", [8], rng.randbytes(16))]
    )
    weight_map = {
        "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
        "lm_head.weight": "model-00002-of-00002.safetensors",
        "model.norm.weight": "model-00002-of-00002.safetensors",
    }
    index = {"metadata": {"total_size": big_bytes + 80}, "weight_map": weight_map}
    return {
        "config.json": json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}).encode(),
        "generation_config.json": b'{"eos_token_id": 2}',
        "tokenizer.json": b'{"version": "1.0"}',
        "tokenizer_config.json": b'{"eos_token": "</s>"}',
        "model.safetensors.index.json": json.dumps(index).encode(),
        "model-00001-of-00002.safetensors": shard1,
        "model-00002-of-00002.safetensors": shard2,
        ".gitattributes": b"*.safetensors filter=lfs\n",
        "README.md": b"# a model\n",
        "pytorch_model.bin": b"pickle",
        "original/consolidated.00.pth": b"meta",
    }


def read_all(location: Location, name: str) -> bytes:
    info = location.store.stat(location.key(name))
    return location.store.read_range(location.key(name), 0, info.size)


def listing(location: Location) -> dict[str, int]:
    try:
        return {location.relative(info.key): info.size for info in location.list()}
    except NotFoundError:
        return {}


def transfer(source_url: str, dest_url: str, options: TransferOptions = OPTIONS, **storage: Any):
    source = open_location(source_url, StorageOptions(**storage))
    dest = open_location(dest_url)
    plan = plan_transfer(source, dest, source_identity(source), options)
    return plan, execute_transfer(plan, source, dest, options)


# ------------------------------------------------------------------------------------------ pure pieces


def test_default_file_set_and_reasons() -> None:
    paths = [*list(model_files(big_bytes=8)), "consolidated.safetensors", "modeling_x.py", "chat_template.jinja"]
    chosen = {
        s.path: s
        for s in select_files(
            paths,
            has_auto_map=False,
            indexed_shards=frozenset({"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}),
        )
    }
    assert {p for p, s in chosen.items() if s.selected} == SERVING_FILES | {"chat_template.jinja"}
    assert chosen["pytorch_model.bin"].reason.startswith("PyTorch pickle")
    assert "original/" in chosen["original/consolidated.00.pth"].reason
    assert chosen[".gitattributes"].reason == "git metadata"
    assert "Mistral" in chosen["consolidated.safetensors"].reason
    assert "auto_map" in chosen["modeling_x.py"].reason
    with_code = select_files(["modeling_x.py"], has_auto_map=True)
    assert with_code[0].selected


def test_include_exclude_and_all_files() -> None:
    paths = ["config.json", "model.safetensors", "pytorch_model.bin", "README.md"]
    refined = {
        s.path: s.selected for s in select_files(paths, has_auto_map=False, include=["*.bin"], exclude=["config.json"])
    }
    assert refined == {"config.json": False, "model.safetensors": True, "pytorch_model.bin": True, "README.md": False}
    everything = select_files([*paths, MANIFEST_NAME], has_auto_map=False, all_files=True, exclude=["README.md"])
    assert [s.path for s in everything if s.selected] == ["config.json", "model.safetensors", "pytorch_model.bin"]


def test_source_resolution_and_sizes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_source_url("org/name") == "hf://org/name"
    assert resolve_source_url("org/name@v1", "dataset") == "hf://datasets/org/name@v1"
    assert resolve_source_url("s3://b/p") == "s3://b/p"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert resolve_source_url("org/name") == "org/name"  # an existing folder wins
    assert parse_size("16MiB") == parse_size("16M") == 16 * MiB
    assert parse_size("1GB") == 10**9
    with pytest.raises(UsageError):
        parse_size("12 parsecs")
    s3 = open_location("s3://bucket/prefix").store  # S3's limits: parts of 5 MiB and up, 10,000 of them
    assert part_size_for(100 * MiB, 5 * MiB, s3) == 5 * MiB
    assert part_size_for(100_000 * MiB, 5 * MiB, s3) == 10 * MiB  # grown to fit 10,000 parts


def test_max_buffer_smaller_than_part_is_refused() -> None:
    with pytest.raises(UsageError, match="max-buffer"):
        TransferOptions(part_size=8 * MiB, max_buffer=4 * MiB).validate()


def test_part_buffers_are_reused_and_idle_ones_of_another_size_freed() -> None:
    buffers = PartBuffers()
    first = buffers.take(8)
    buffers.give(first)
    assert buffers.take(8) is first  # reused: no fresh pages for the next part
    second = buffers.take(8)
    assert second is not first and len(second) == 8  # both busy: another one
    buffers.give(first)
    buffers.give(second)
    assert len(buffers.take(16)) == 16  # another size: the idle 8-byte buffers are let go ...
    fresh = buffers.take(8)
    assert fresh is not first and fresh is not second  # ... so they hold no memory beside the busy ones


def test_parts_move_through_reused_buffers_bounded_by_the_budget(
    fake_hub: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = model_files(big_bytes=31 * MiB)  # a 7-part first shard at 5 MiB parts
    fake_hub.add_repo("org/buffers", files)
    taken: list[int] = []
    take = PartBuffers.take

    def counted(self: PartBuffers, size: int) -> bytearray:
        buffer = take(self, size)
        taken.append(id(buffer))
        return buffer

    monkeypatch.setattr(PartBuffers, "take", counted)
    transfer("hf://org/buffers", str(tmp_path / "dest"))
    assert len(taken) == 7  # every part of the big shard read into a pooled buffer
    assert len(set(taken)) <= OPTIONS.max_buffer // OPTIONS.part_size  # 4: never more than the budget holds
    assert (
        read_all(open_location(str(tmp_path / "dest")), "model-00001-of-00002.safetensors")
        == files["model-00001-of-00002.safetensors"]
    )


# ------------------------------------------------------------------------------------------ hub to buckets


def test_hub_to_every_destination(fake_hub: Any, any_root: str) -> None:
    files = model_files()
    repo = fake_hub.add_repo("org/llama", files)
    plan, result = transfer("hf://org/llama", any_root)
    dest = open_location(any_root)

    assert plan.commit == repo.resolve("main")
    assert {f.path for f in plan.files} == SERVING_FILES
    assert {s.path for s in plan.excluded} == set(files) - SERVING_FILES
    assert set(listing(dest)) == SERVING_FILES | {MANIFEST_NAME}
    for name in SERVING_FILES:
        assert read_all(dest, name) == files[name], name
    big = "model-00001-of-00002.safetensors"
    expected_sha = hashlib.sha256(files[big]).hexdigest()
    assert {f.path: f.sha256 for f in result.files}[big] == expected_sha
    if not any_root.startswith("/"):  # local folders keep metadata only where xattrs work
        assert dest.store.stat(dest.key(big)).metadata["sha256"] == expected_sha
    manifest = json.loads(read_all(dest, MANIFEST_NAME))
    assert manifest["source"] == "hf://org/llama" and manifest["commit"] == plan.commit
    assert {f["path"]: f["sha256"] for f in manifest["files"]}[big] == expected_sha
    assert result.bytes_copied == sum(len(files[name]) for name in SERVING_FILES)
    assert verify_checkpoint(dest).ok

    # A re-run downloads nothing: every object's size and stored sha256 match the hub's.
    fake_hub.clear_requests()
    replan, rerun = transfer("hf://org/llama", any_root)
    assert {f.action for f in replan.files} == {"skip"}
    assert rerun.bytes_copied == 0
    # Planning reads config.json (auto_map), tokenizer_config.json (what it references) and the index
    # (which shards are live); no weights.
    assert fake_hub.count("-of-00002.safetensors", method="GET") == 0
    assert fake_hub.count("/resolve/", method="GET") == 3


def test_bucket_to_bucket_uses_stored_checksums(fake_hub: Any, s3_root: str, gs_root: str) -> None:
    files = model_files(big_bytes=6 * MiB)
    fake_hub.add_repo("org/b2b", files)
    transfer("hf://org/b2b", s3_root)
    plan, result = transfer(s3_root, gs_root)
    gs = open_location(gs_root)
    assert {f.path for f in plan.files} == SERVING_FILES  # the source manifest is not copied as a file
    for name in SERVING_FILES:
        assert read_all(gs, name) == files[name]
    assert json.loads(read_all(gs, MANIFEST_NAME))["source"] == s3_root
    assert all(f.sha256 == hashlib.sha256(files[f.path]).hexdigest() for f in result.files)


def test_faults_on_the_source_still_end_byte_exact(fake_hub: Any, s3_root: str) -> None:
    files = model_files()
    fake_hub.add_repo("org/flaky", files)
    big = "model-00001-of-00002.safetensors"
    fake_hub.fail(big, times=2, kind="reset")
    fake_hub.fail(big, times=2, kind="503")
    fake_hub.fail("config.json", times=1, kind="truncate")
    transfer("hf://org/flaky", s3_root)
    dest = open_location(s3_root)
    for name in SERVING_FILES:
        assert read_all(dest, name) == files[name]


def test_corrupted_hub_bytes_are_detected_and_nothing_committed(fake_hub: Any, s3_root: str) -> None:
    files = model_files()
    fake_hub.add_repo("org/bad", files)
    big = "model-00001-of-00002.safetensors"
    fake_hub.corrupt("org/bad", big)
    with pytest.raises(IntegrityError, match=big):
        transfer("hf://org/bad", s3_root)
    dest = open_location(s3_root)
    assert big not in listing(dest)
    assert MANIFEST_NAME not in listing(dest)
    bucket = s3_root.split("/")[2]
    import boto3

    client = boto3.client("s3")
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_corrupted_small_file_is_detected_by_git_sha1(fake_hub: Any, local_root: str) -> None:
    files = model_files(big_bytes=64)
    fake_hub.add_repo("org/small", files)
    fake_hub.corrupt("org/small", "tokenizer.json")
    with pytest.raises(IntegrityError, match="tokenizer.json"):
        transfer("hf://org/small", local_root)
    assert "tokenizer.json" not in listing(open_location(local_root))


def test_manifest_of_another_source_is_refused_without_force(fake_hub: Any, local_root: str) -> None:
    fake_hub.add_repo("org/one", model_files(big_bytes=64, seed=1))
    fake_hub.add_repo("org/two", model_files(big_bytes=64, seed=2))
    transfer("hf://org/one", local_root)
    with pytest.raises(UsageError, match="already holds hf://org/one"):
        transfer("hf://org/two", local_root)
    forced = TransferOptions(force=True, retry=FAST_RETRY)
    transfer("hf://org/two", local_root, forced)
    assert json.loads(read_all(open_location(local_root), MANIFEST_NAME))["source"] == "hf://org/two"


def test_revision_pins_one_commit(fake_hub: Any, local_root: str) -> None:
    repo = fake_hub.add_repo("org/rev", model_files(big_bytes=64))
    first = repo.resolve("main")
    repo.tag("v1", "main")
    repo.commit({"config.json": '{"architectures": ["LlamaForCausalLM"], "v": 2}'})
    plan, _ = transfer("hf://org/rev", local_root, hf_revision="v1")
    assert plan.commit == first
    assert b'"v": 2' not in read_all(open_location(local_root), "config.json")


# ------------------------------------------------------------------------------------------ through the CLI


def test_cli_json_dry_run_and_token_hygiene(fake_hub: Any, s3_root: str, storage_env: dict[str, str]) -> None:
    token = fake_hub.add_token("hf_secretTOKEN123456")
    fake_hub.add_repo("org/gated", model_files(big_bytes=64), gated=True, granted=[token])

    dry = run_cli("transfer", "org/gated", s3_root, "--dry-run", "--json", "--token", token, env=storage_env)
    assert dry.exit_code == 0, dry.stderr
    plan = dry.json()
    assert {f["path"] for f in plan["files"]} == SERVING_FILES
    assert {f["action"] for f in plan["files"]} == {"copy"}
    assert listing(open_location(s3_root)) == {}  # --dry-run touched nothing

    done = run_cli("transfer", "org/gated", s3_root, "--json", "--token", token, env=storage_env)
    assert done.exit_code == 0, done.stderr
    document = done.json()
    assert set(document) >= {"source", "dest", "commit", "files", "bytes_copied", "seconds", "throughput_mb_s"}
    assert {f["action"] for f in document["files"]} == {"copied"}
    assert document["verify"]["ok"] is True
    assert all(set(f) == {"path", "size", "sha256", "action"} for f in document["files"])

    denied = run_cli("transfer", "org/gated", s3_root + "-2", "--json", env=storage_env)
    assert denied.exit_code == 4
    assert "token" in denied.stderr.lower() or "terms" in denied.stderr.lower()
    wrong = run_cli("transfer", "org/gated", s3_root + "-2", "--token", "hf_wrongTOKEN98765", env=storage_env)
    assert wrong.exit_code == 4
    for result in (dry, done, denied, wrong):
        assert token not in result.stdout + result.stderr
        assert "hf_wrongTOKEN98765" not in result.stdout + result.stderr


@pytest.mark.parametrize(
    "args,code",
    [(("org/missing",), 3), (("org/present", "--revision", "nope"), 3)],
    ids=["unknown-repo", "unknown-revision"],
)
def test_cli_not_found(fake_hub: Any, local_root: str, args: tuple[str, ...], code: int) -> None:
    fake_hub.add_repo("org/present", model_files(big_bytes=64))
    result = run_cli("transfer", *args[:1], local_root, *args[1:])
    assert result.exit_code == code, result.stderr
    assert "Traceback" not in result.stderr


def test_cli_integrity_failure_exits_5(fake_hub: Any, local_root: str) -> None:
    fake_hub.add_repo("org/rotten", model_files(big_bytes=64))
    fake_hub.corrupt("org/rotten", "model-00001-of-00002.safetensors")
    result = run_cli("transfer", "org/rotten", local_root)
    assert result.exit_code == 5
    assert "model-00001-of-00002.safetensors" in result.stderr


def test_cli_unsafe_hub_names_are_refused(fake_hub: Any, local_root: str) -> None:
    files = model_files(big_bytes=64)
    files["sub\\..\\evil.json"] = b"{}"
    fake_hub.add_repo("org/evil", files)
    result = run_cli("transfer", "org/evil", local_root)
    assert result.exit_code == 2, result.stderr
    assert "evil" in result.stderr
    assert listing(open_location(local_root)) == {}


def test_cli_verify_failure_fails_the_transfer(tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    for name, data in model_files(big_bytes=64).items():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_bytes(data)
    (source / "config.json").unlink()  # vLLM cannot serve without it
    result = run_cli("transfer", str(source), str(tmp_path / "dst"))
    assert result.exit_code == 1
    assert "config-missing" in result.stdout
    skipped = run_cli("transfer", str(source), str(tmp_path / "dst2"), "--no-verify")
    assert skipped.exit_code == 0


def _wait_for(condition: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting")
        time.sleep(0.02)


def test_killed_transfer_resumes_without_resending(fake_hub: Any, s3_root: str, storage_env: dict[str, str]) -> None:
    rng = random.Random(7)
    shards = {
        f"model-0000{i}-of-00004.safetensors": safetensors_bytes([(f"t{i}", "U8", [6 * MiB], rng.randbytes(6 * MiB))])
        for i in range(1, 5)
    }
    index = {"metadata": {}, "weight_map": {f"t{i}": f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)}}
    files = {**shards, "model.safetensors.index.json": json.dumps(index).encode(), "config.json": b"{}"}
    fake_hub.add_repo("org/kill", files)
    dest = open_location(s3_root)
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "streamctl",
            "transfer",
            "org/kill",
            s3_root,
            "-j",
            "1",
            "--part-size",
            "5MiB",
            "--max-buffer",
            "5MiB",
            "--no-verify",
        ],
        env={**os.environ, **storage_env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    _wait_for(lambda: any(name in shards for name in listing(dest)))
    process.send_signal(signal.SIGKILL)
    process.wait(10)
    at_kill = listing(dest)
    assert MANIFEST_NAME not in at_kill
    assert len(at_kill) < len(files), "the transfer finished before it could be killed"
    for name in at_kill:  # nothing partial is ever visible under a final name
        assert read_all(dest, name) == files[name]
    left_open = sorted(dest.relative(upload.key) for upload in dest.store.unfinished_uploads(f"{dest.prefix}/"))

    rerun = run_cli("transfer", "org/kill", s3_root, "--json", "--no-verify", env=storage_env)
    assert rerun.exit_code == 0, rerun.stderr
    # The killed run could not abort its open multipart upload (S3 bills its parts): the re-run does.
    assert rerun.json()["discarded_uploads"] == left_open
    assert dest.store.unfinished_uploads(f"{dest.prefix}/") == []
    actions = {f["path"]: f["action"] for f in rerun.json()["files"]}
    assert {name for name, action in actions.items() if action == "skipped"} == set(at_kill)
    for name in files:
        assert read_all(dest, name) == files[name]


def test_interrupt_aborts_open_multipart_uploads(fake_hub: Any, s3_root: str, storage_env: dict[str, str]) -> None:
    import boto3

    rng = random.Random(3)
    big = safetensors_bytes([("t", "U8", [40 * MiB], rng.randbytes(40 * MiB))])
    fake_hub.add_repo("org/intr", {"model.safetensors": big, "config.json": b"{}"})
    bucket = s3_root.split("/")[2]
    client = boto3.client("s3")
    port = int(storage_env["AWS_ENDPOINT_URL"].rsplit(":", 1)[1])
    # Parts go up at 1 MiB/s, so the 40 MiB cannot finish before the Ctrl-C however loaded the machine is.
    part_upload = lambda method, path: method == "PUT" and "partNumber=" in path  # noqa: E731
    with SlowProxy(port, part_upload, "steady", rate_bps=MiB) as proxy:
        process = subprocess.Popen(
            [sys.executable, "-m", "streamctl", "transfer", "org/intr", s3_root, "-j", "1", "--part-size", "5MiB",
             "--max-buffer", "5MiB"],
            env={**os.environ, **storage_env, "AWS_ENDPOINT_URL": proxy.url},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        _wait_for(lambda: client.list_multipart_uploads(Bucket=bucket).get("Uploads"))
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    assert "model.safetensors" not in listing(open_location(s3_root))


def test_cli_unwritable_destination_exits_4_naming_the_permission(
    fake_hub: Any, az_root: str, storage_env: dict[str, str]
) -> None:
    from datetime import datetime, timedelta

    from azure.storage.blob import ContainerSasPermissions, generate_container_sas

    from servers import AZURITE_ACCOUNT, AZURITE_KEY

    fake_hub.add_repo("org/ro", model_files(big_bytes=64))
    container = az_root.split("/")[2]
    endpoint = storage_env["AZURE_STORAGE_CONNECTION_STRING"].split("BlobEndpoint=")[1].split(";")[0]
    sas = generate_container_sas(
        AZURITE_ACCOUNT, container, account_key=AZURITE_KEY,
        permission=ContainerSasPermissions(read=True, list=True),
        expiry=datetime.now(UTC) + timedelta(hours=1),
    )  # fmt: skip
    read_only = {
        **storage_env,
        "AZURE_STORAGE_CONNECTION_STRING": f"BlobEndpoint={endpoint};SharedAccessSignature={sas}",
    }
    result = run_cli("transfer", "org/ro", az_root, env=read_only)
    assert result.exit_code == 4, result.stderr
    assert "Storage Blob Data Contributor" in result.stderr
    assert "Traceback" not in result.stderr


def test_k8s_job_is_a_valid_job_without_the_token() -> None:
    import yaml
    from kubernetes import client

    token = "hf_k8sSECRET4242"
    result = run_cli(
        "transfer",
        "meta-llama/Llama-3.1-70B",
        "gs://models-usc/llama-70b",
        "--k8s-job",
        "--image",
        "registry.example/streamctl:0.1.0",
        "--service-account",
        "gcs-access",
        "--secret",
        "hf-token",
        "--token",
        token,
        "--include",
        "*.py",
        "--revision",
        "v1",
    )
    assert result.exit_code == 0, result.stderr
    assert token not in result.stdout + result.stderr
    document = yaml.safe_load(result.stdout)
    api = client.ApiClient()

    class _Response:
        def __init__(self, data: object) -> None:
            self.data = json.dumps(data)

    assert api.sanitize_for_serialization(api.deserialize(_Response(document), "V1Job")) == document
    pod = document["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "gcs-access"
    container = pod["containers"][0]
    assert container["envFrom"] == [{"secretRef": {"name": "hf-token"}}]
    command = " ".join(container["command"])
    for expected in (
        "streamctl transfer hf://meta-llama/Llama-3.1-70B gs://models-usc/llama-70b",
        "--revision=v1",
        "--include=*.py",
    ):
        assert expected in command
    assert "--include=*.py" in container["command"]  # one argument each: no shell between Kubernetes and streamctl
    assert container["image"] == "registry.example/streamctl:0.1.0"


def test_faults_on_the_destination_still_end_byte_exact(fake_hub: Any, s3_root: str, storage_servers: Any) -> None:
    from faultproxy import FaultProxy

    files = model_files()
    fake_hub.add_repo("org/dest-faults", files)
    port = int(storage_servers.s3().endpoint.rsplit(":", 1)[1])
    dest_url = s3_root
    proxy = FaultProxy(port, fail_503=frozenset({2, 5, 9}), reset=frozenset({3, 7})).start()
    try:
        source = open_location("hf://org/dest-faults")
        dest = open_location(dest_url, StorageOptions(endpoint_url=proxy.url, path_style=True, max_attempts=3))
        plan = plan_transfer(source, dest, source_identity(source), OPTIONS)
        execute_transfer(plan, source, dest, OPTIONS)
    finally:
        proxy.stop()
    assert proxy.faults >= 3, f"only {proxy.faults} faults over {proxy.connections} connections"
    direct = open_location(dest_url)
    for name in SERVING_FILES:
        assert read_all(direct, name) == files[name]
    assert json.loads(read_all(direct, MANIFEST_NAME))["source"] == "hf://org/dest-faults"
