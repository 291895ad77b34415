"""`streamctl serve`: golden launches, validation, exec through a fake vllm, pre-flight on real servers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from cli_helpers import run_cli
from streamctl.demo import build_demo_checkpoint
from streamctl.errors import UsageError
from streamctl.serve.plan import (
    CheckpointFacts,
    EngramOptions,
    ServeOptions,
    normalize_model,
    parse_memory_limit,
    plan_launch,
)
from streamctl.storage import StorageOptions, open_location

GiB = 1024**3
FACTS = CheckpointFacts(total_bytes=16 * GiB, largest_tensor_bytes=1 * GiB, files=4)


STORAGE_FIELDS = ("endpoint_url", "path_style", "azure_account")


def plan(
    model: str,
    environ: dict[str, str] | None = None,
    *,
    sharded: bool = False,
    cuda: bool = True,
    facts: CheckpointFacts | None = FACTS,
    ram: int | None = 512 * GiB,
    **options: Any,
):
    storage = StorageOptions(**{name: options.pop(name) for name in STORAGE_FIELDS if name in options})
    return plan_launch(
        ServeOptions(model=model, storage=storage, **options),
        facts,
        sharded=sharded,
        environ=environ or {},
        cuda_available=cuda,
        host_memory_bytes=ram,
    )


# ------------------------------------------------------------------------------------------ golden launches


def test_local_tp1() -> None:
    launch = plan("/models/llama")
    assert launch.argv == (
        "vllm",
        "serve",
        "/models/llama",
        "--load-format",
        "runai_streamer",
        "--tensor-parallel-size",
        "1",
        "--model-loader-extra-config",
        '{"concurrency":16}',
    )
    assert dict(launch.env) == {}
    assert launch.warnings == ()


def test_s3_on_aws_sets_no_endpoint_variables() -> None:
    launch = plan("s3://bucket/llama", tensor_parallel_size=8, memory_limit=5 * GiB)
    assert json.loads(launch.argv[-1]) == {"concurrency": 8, "memory_limit": 5 * GiB, "distributed": True}
    assert dict(launch.env) == {}  # AWS_EC2_METADATA_DISABLED would break IRSA on AWS


def test_s3_compatible_endpoint() -> None:
    launch = plan("S3://bucket/llama", endpoint_url="https://storage.googleapis.com", tensor_parallel_size=2)
    assert launch.argv[2] == "s3://bucket/llama"  # the streamer compares schemes case-sensitively
    assert dict(launch.env) == {
        "AWS_ENDPOINT_URL": "https://storage.googleapis.com",
        "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    assert json.loads(launch.argv[-1])["distributed"] is True


def test_user_variables_are_kept_or_overridden_loudly() -> None:
    kept = plan("s3://bkt/m", {"AWS_ENDPOINT_URL": "http://minio:9000", "AWS_EC2_METADATA_DISABLED": "false"})
    assert "AWS_EC2_METADATA_DISABLED" not in kept.env
    assert any("keeping your AWS_EC2_METADATA_DISABLED" in w for w in kept.warnings)
    assert kept.env["AWS_ENDPOINT_URL"] == "http://minio:9000"
    overridden = plan("s3://bkt/m", {"AWS_ENDPOINT_URL": "http://old:9000"}, endpoint_url="http://new:9000")
    assert overridden.env["AWS_ENDPOINT_URL"] == "http://new:9000"
    assert any("using 'http://new:9000' as asked" in w for w in overridden.warnings)


def test_gs_and_az() -> None:
    gs = plan("gs://bucket/gemma", {"STORAGE_EMULATOR_HOST": "http://127.0.0.1:9023"})
    assert dict(gs.env) == {"CLOUD_STORAGE_EMULATOR_ENDPOINT": "http://127.0.0.1:9023"}
    assert dict(plan("gs://bucket/gemma").env) == {}
    az = plan("https://acct1.blob.core.windows.net/models/llama")
    assert dict(az.env) == {"AZURE_STORAGE_ACCOUNT_NAME": "acct1"}
    assert plan("az://models/llama", azure_account="acct2").env["AZURE_STORAGE_ACCOUNT_NAME"] == "acct2"
    with pytest.raises(UsageError, match="Azure storage account"):
        plan("az://models/llama")


def test_sharded_moves_tuning_to_the_environment() -> None:
    launch = plan(
        "s3://bkt/sharded",
        sharded=True,
        tensor_parallel_size=2,
        concurrency=32,
        memory_limit=0,
        facts=CheckpointFacts(8 * GiB, GiB, 2, sharded_ranks=2),
    )
    assert launch.load_format == "runai_streamer_sharded"
    assert "--model-loader-extra-config" not in launch.argv  # default pattern: nothing to say
    assert launch.env["RUNAI_STREAMER_CONCURRENCY"] == "32"
    assert launch.env["RUNAI_STREAMER_MEMORY_LIMIT"] == "0"
    custom = plan(
        "s3://bkt/sharded", sharded=True, tensor_parallel_size=2, pattern="m-{rank}-{part}.safetensors", facts=None
    )
    assert json.loads(custom.argv[-1]) == {"pattern": "m-{rank}-{part}.safetensors"}
    gs = plan("gs://bkt/sharded", sharded=True, facts=None)
    assert any("s3://" in w and "vllm#38568" in w for w in gs.warnings)
    with pytest.raises(UsageError, match="4 ranks"):
        plan("s3://bkt/sharded", sharded=True, tensor_parallel_size=2, facts=CheckpointFacts(8 * GiB, GiB, 4, 4))


@pytest.mark.parametrize("tp,cuda,distributed", [(1, True, None), (2, True, True), (8, True, True), (2, False, None)])
def test_distributed_default(tp: int, cuda: bool, distributed: bool | None) -> None:
    launch = plan("s3://bkt/m", tensor_parallel_size=tp, cuda=cuda)
    assert json.loads(launch.argv[-1]).get("distributed") == distributed
    assert launch.argv[launch.argv.index("--tensor-parallel-size") + 1] == str(tp)


def test_extra_vllm_args_pass_through_unchanged() -> None:
    launch = plan("/m", vllm_args=("--max-model-len", "4096", "--served-model-name", "my model"))
    assert launch.argv[-4:] == ("--max-model-len", "4096", "--served-model-name", "my model")
    with pytest.raises(UsageError, match="--load-format"):
        plan("/m", vllm_args=("--load-format=auto",))


def test_memory_limit_checks() -> None:
    with pytest.raises(UsageError, match="below the largest tensor"):
        plan("/m", memory_limit=GiB // 2)
    small_host = plan("/m", tensor_parallel_size=4, cuda=False, memory_limit=8 * GiB, ram=24 * GiB)
    assert any("4 workers x" in w and "RAM" in w for w in small_host.warnings)
    assert parse_memory_limit("5GiB") == 5 * GiB
    assert parse_memory_limit("512MB") == 512 * 10**6
    assert parse_memory_limit("-1") == -1 and parse_memory_limit("0") == 0
    assert parse_memory_limit("1024") == 1024
    with pytest.raises(UsageError):
        parse_memory_limit("-2")
    with pytest.raises(UsageError):
        plan("/m", concurrency=0)


def test_experimental_engram_recipe() -> None:
    engram = EngramOptions(
        ("model-00047-of-00048.safetensors", "model-00048-of-00048.safetensors"), 100 * GiB, ("*engram*",)
    )
    launch = plan(
        "s3://bucket/deepseek-v4-1-flash/",
        engram=engram,
        tensor_parallel_size=1,
        memory_limit=32 * GiB,
        distributed=True,
    )
    assert launch.experimental
    assert (
        launch.env["VLLM_RUNAI_CPU_WEIGHT_FILES"] == "model-00047-of-00048.safetensors,model-00048-of-00048.safetensors"
    )
    assert launch.env["VLLM_RUNAI_CPU_MEMORY_LIMIT"] == str(100 * GiB)
    for name, value in {
        "VLLM_USE_RUST_FRONTEND": "0",
        "RUNAI_STREAMER_PARTITION_POLICY": "spans",
        "VLLM_RUNAI_SINGLE_ENGRAM_READER": "1",
        "VLLM_RUNAI_BORROWED_WEIGHTS": "1",
        "VLLM_RUNAI_USE_LOCAL_WEIGHT_INDEX": "1",
    }.items():
        assert launch.env[name] == value
    assert any("EXPERIMENTAL" in w for w in launch.warnings)
    assert "VLLM_RUNAI_CPU_WEIGHT_FILES" not in plan("s3://bkt/m").env
    with pytest.raises(UsageError, match="--engram"):
        plan("/m", engram=EngramOptions(("a.safetensors",), GiB, ()))


def test_normalize_model() -> None:
    assert normalize_model("GS://Bucket/Model") == "gs://Bucket/Model"
    assert normalize_model("/Local/Path") == "/Local/Path"


# ------------------------------------------------------------------------------------------ the CLI


@pytest.fixture
def demo_model(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    build_demo_checkpoint(open_location(str(folder)))
    return folder


def test_exec_replaces_the_process_and_passes_the_exit_code(demo_model: Path, fake_vllm: dict[str, str]) -> None:
    env = {**os.environ, **fake_vllm, "FAKE_VLLM_EXIT": "42"}
    process = subprocess.Popen(
        [sys.executable, "-m", "streamctl", "serve", str(demo_model), "-q", "--", "--max-model-len", "2048"],
        env=env,
        stdin=subprocess.DEVNULL,
    )
    assert process.wait(60) == 42
    record = json.loads(Path(fake_vllm["FAKE_VLLM_RECORD"]).read_text())
    assert record["pid"] == process.pid  # exec, not a child process
    assert record["argv"][1:] == [
        "serve",
        str(demo_model),
        "--load-format",
        "runai_streamer",
        "--tensor-parallel-size",
        "1",
        "--model-loader-extra-config",
        '{"concurrency":16}',
        "--max-model-len",
        "2048",
    ]


def test_signals_reach_vllm(demo_model: Path, fake_vllm: dict[str, str]) -> None:
    env = {**os.environ, **fake_vllm, "FAKE_VLLM_SLEEP": "30"}
    process = subprocess.Popen(
        [sys.executable, "-m", "streamctl", "serve", str(demo_model), "-q"], env=env, stdin=subprocess.DEVNULL
    )
    record_path = Path(fake_vllm["FAKE_VLLM_RECORD"])
    deadline = time.monotonic() + 30
    while not record_path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    assert process.wait(30) == 143
    assert json.loads(record_path.read_text())["signal"] == signal.SIGTERM


def test_missing_vllm_exits_127(demo_model: Path, tmp_path: Path) -> None:
    result = run_cli("serve", str(demo_model), env={"PATH": str(tmp_path)})
    assert result.exit_code == 127
    assert "streamctl[vllm]" in result.stderr


def test_dry_run_and_json(demo_model: Path) -> None:
    dry = run_cli("serve", str(demo_model), "--dry-run", "-tp", "2", "--memory-limit", "1GiB", "--", "--enforce-eager")
    assert dry.exit_code == 0, dry.stderr
    line = dry.stdout.strip()
    assert line.startswith("vllm serve ") and line.endswith("--enforce-eager")
    assert """'{"concurrency":16,"memory_limit":1073741824}'""" in line
    document = run_cli("serve", str(demo_model), "--json").json()
    assert set(document) >= {"argv", "env", "load_format", "extra_config", "warnings"}
    assert document["extra_config"] == {"concurrency": 16}


def test_preflight_refuses_stray_shards(demo_model: Path) -> None:
    (demo_model / "model-old.safetensors").write_bytes((demo_model / "model-00001-of-00002.safetensors").read_bytes())
    result = run_cli("serve", str(demo_model), "--dry-run")
    assert result.exit_code == 1
    assert "unindexed-safetensors" in result.stderr
    assert result.stdout == ""
    assert run_cli("serve", str(demo_model), "--dry-run", "--no-preflight").exit_code == 0


def test_memory_limit_below_largest_tensor_through_the_cli(demo_model: Path) -> None:
    result = run_cli("serve", str(demo_model), "--dry-run", "--memory-limit", "1KiB")
    assert result.exit_code == 2
    assert "largest tensor" in result.stderr


def _upload(folder: Path, url: str) -> None:
    location = open_location(url)
    for path in folder.iterdir():
        location.store.put(location.key(path.name), path.read_bytes())


@pytest.mark.parametrize("backend", ["s3", "gs", "az"])
def test_preflight_against_buckets(
    demo_model: Path, backend: str, request: pytest.FixtureRequest, storage_env: dict[str, str]
) -> None:
    root = request.getfixturevalue(f"{backend}_root")
    _upload(demo_model, root)
    ok = run_cli("serve", root, "--json", env=storage_env)
    assert ok.exit_code == 0, ok.stderr
    assert ok.json()["argv"][2] == root
    missing = run_cli("serve", root + "-missing/prefix", "--json", env=storage_env)
    assert missing.exit_code == 3, missing.stderr
    open_location(root).store.put(
        open_location(root).key("stray.safetensors"), (demo_model / "model-00002-of-00002.safetensors").read_bytes()
    )
    stray = run_cli("serve", root, "--json", env=storage_env)
    assert stray.exit_code == 1 and "unindexed-safetensors" in stray.stderr


def test_preflight_wrong_credentials_and_endpoint(
    demo_model: Path, az_root: str, s3_root: str, storage_env: dict[str, str]
) -> None:
    _upload(demo_model, az_root)
    wrong_key = storage_env["AZURE_STORAGE_CONNECTION_STRING"].replace("AccountKey=Eby8", "AccountKey=AAAA")
    denied = run_cli("serve", az_root, "--json", env={**storage_env, "AZURE_STORAGE_CONNECTION_STRING": wrong_key})
    assert denied.exit_code == 4, denied.stderr
    assert "hint:" in denied.stderr
    unreachable = run_cli(
        "serve", s3_root, "--json", "--endpoint-url", "http://127.0.0.1:9", env={**storage_env, "AWS_MAX_ATTEMPTS": "1"}
    )
    assert unreachable.exit_code == 6, unreachable.stderr


def test_secrets_never_printed(demo_model: Path, s3_root: str, storage_env: dict[str, str]) -> None:
    _upload(demo_model, s3_root)
    secrets = {
        "AWS_SECRET_ACCESS_KEY": "testing",
        "HF_TOKEN": "hf_SECRETsecret123",
        "AZURE_STORAGE_KEY": "azSECRETkey==",
    }
    env = {**storage_env, **secrets}
    outputs = []
    for args in (["--dry-run"], ["--json"], ["--k8s", "--secret", "creds"]):
        result = run_cli("serve", s3_root, *args, "--", "--hf-token", "hf_ARGsecret999", env=env)
        assert result.exit_code == (2 if "--k8s" in args else 0), result.stderr  # no clear-text secret in YAML
        outputs.append(result.stdout + result.stderr)
    k8s = run_cli("serve", s3_root, "--k8s", "--secret", "creds", env=env)
    assert k8s.exit_code == 0 and "secretRef" in k8s.stdout
    outputs.append(k8s.stdout + k8s.stderr)
    for text in outputs:
        for value in ("hf_SECRETsecret123", "azSECRETkey==", "hf_ARGsecret999"):
            assert value not in text
    assert "***" in outputs[0] and "***" in outputs[1]


def test_k8s_manifests_match_the_kubernetes_schema(demo_model: Path, s3_root: str, storage_env: dict[str, str]) -> None:
    import yaml
    from kubernetes import client

    _upload(demo_model, s3_root)  # a manifest's model is in a bucket: the pod cannot read this machine's files
    result = run_cli(
        "serve",
        s3_root,
        "--k8s",
        "-tp",
        "2",
        "--service-account",
        "gcs-access",
        "--accelerator",
        "nvidia-l4",
        "--memory-limit",
        "1GiB",
        "--",
        "--max-model-len",
        "2048",
        env=storage_env,
    )
    assert result.exit_code == 0, result.stderr
    documents = list(yaml.safe_load_all(result.stdout))
    assert [d["kind"] for d in documents] == ["Deployment", "Service"]
    api = client.ApiClient()

    class _Response:
        def __init__(self, data: object) -> None:
            self.data = json.dumps(data)

    for document, model in zip(documents, ("V1Deployment", "V1Service"), strict=False):
        parsed = api.deserialize(_Response(document), model)
        # Unknown or misplaced fields are dropped by the models: a round trip must give the document back.
        assert api.sanitize_for_serialization(parsed) == document
    pod = documents[0]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert container["resources"]["requests"]["nvidia.com/gpu"] == "2"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert pod["volumes"][0]["emptyDir"]["medium"] == "Memory"
    assert pod["serviceAccountName"] == "gcs-access"
    assert pod["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-l4"}
    assert container["startupProbe"]["httpGet"] == {"path": "/health", "port": 8000}
    assert container["args"][-2:] == ["--max-model-len", "2048"]
    assert container["resources"]["requests"]["memory"].endswith("Gi")


def test_tune_without_the_streamer_names_the_extra(demo_model: Path) -> None:
    import importlib.util

    if importlib.util.find_spec("runai_model_streamer") is not None:
        pytest.skip("the streamer is installed here (the main test environment has no torch, so none)")
    result = run_cli("serve", str(demo_model), "--tune", "--json")
    assert result.exit_code == 127
    assert "streamctl[streamer]" in result.stderr


def test_tune_imports_nothing_from_the_current_folder(
    demo_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe runs with -P: a module in the folder streamctl is started from (a checkout's own
    runai_model_streamer.py) is never imported in place of the installed one."""
    import importlib.util

    if importlib.util.find_spec("runai_model_streamer") is not None:
        pytest.skip("the streamer is installed here: the stray module would be shadowed either way")
    marker = tmp_path / "stray-imported"
    work = tmp_path / "work"
    work.mkdir()
    (work / "runai_model_streamer.py").write_text(f"open({str(marker)!r}, 'w').close()\nraise SystemExit(99)\n")
    monkeypatch.chdir(work)
    result = run_cli("serve", str(demo_model), "--tune", "--json")
    assert not marker.exists()  # the stray module never ran
    assert result.exit_code == 127, result.stderr  # the installed streamer's absence, as without the stray one
    assert "streamctl[streamer]" in result.stderr


# ------------------------------------------------------------------------------------------ vLLM as the judge

from oracle import check_serve_args_many, oracle_python, requires_vllm_oracle


@requires_vllm_oracle
def test_every_generated_launch_passes_vllms_own_parser() -> None:
    sharded_facts = CheckpointFacts(8 * GiB, GiB, 2, sharded_ranks=2)
    launches = [
        plan("/models/llama"),
        plan("/models/llama", tensor_parallel_size=2, memory_limit=-1),
        plan("s3://bkt/llama", tensor_parallel_size=8, memory_limit=5 * GiB),
        plan("s3://bkt/llama", endpoint_url="https://storage.googleapis.com", memory_limit=0, distributed=False),
        plan("gs://bkt/gemma", tensor_parallel_size=2, concurrency=32),
        plan("az://models/llama", azure_account="acct", vllm_args=("--max-model-len", "2048")),
        plan("s3://bkt/sharded", sharded=True, tensor_parallel_size=2, facts=sharded_facts, concurrency=4),
        plan(
            "s3://bkt/sharded",
            sharded=True,
            tensor_parallel_size=2,
            facts=None,
            pattern="custom-rank-{rank}-part-{part}.safetensors",
        ),
    ]
    verdicts = check_serve_args_many([list(launch.argv[2:]) for launch in launches])
    for launch, verdict in zip(launches, verdicts, strict=False):
        assert verdict["ok"], (launch.argv, verdict)
        assert verdict["load_format"] == launch.load_format
        assert verdict["extra_config"] == dict(launch.extra_config)


@requires_vllm_oracle
@pytest.mark.parametrize("where", ["local", "s3"])
def test_tune_with_the_real_streamer(demo_model: Path, where: str, request: pytest.FixtureRequest) -> None:
    model = str(demo_model)
    env: dict[str, str] = {}
    if where == "s3":
        model = request.getfixturevalue("s3_root")
        env = request.getfixturevalue("storage_env")
        _upload(demo_model, model)
    python = oracle_python()
    assert python is not None
    completed = subprocess.run(
        [python, "-m", "streamctl", "serve", model, "--tune", "--json"],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert completed.returncode == 0, completed.stderr
    document = json.loads(completed.stdout)
    samples = document["tune"]["samples"]
    assert [s["concurrency"] for s in samples] == [4, 8, 16, 32]
    checkpoint_bytes = sum(p.stat().st_size for p in demo_model.glob("*.safetensors"))
    assert all(0 < s["bytes"] <= checkpoint_bytes for s in samples)
    assert document["extra_config"]["concurrency"] == document["tune"]["best_concurrency"]


def test_experimental_flags_refused_when_the_index_disagrees(demo_model: Path) -> None:
    flags = ["--cpu-weight-files", "model-00002-of-00002.safetensors", "--cpu-memory-limit", "1GiB"]
    misplaced = run_cli("serve", str(demo_model), "--json", *flags, "--engram", "model.embed_tokens.*")
    assert misplaced.exit_code == 1
    assert "expect-violated" in misplaced.stderr
    placed = run_cli("serve", str(demo_model), "--json", *flags, "--engram", "lm_head.*")
    assert placed.exit_code == 0, placed.stderr
    assert placed.json()["env"]["VLLM_RUNAI_CPU_WEIGHT_FILES"] == "model-00002-of-00002.safetensors"
    assert placed.json()["experimental"] is True
    unchecked = run_cli("serve", str(demo_model), "--json", *flags, "--engram", "lm_head.*", "--no-preflight")
    assert unchecked.exit_code == 2
