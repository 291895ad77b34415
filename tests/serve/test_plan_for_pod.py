"""`serve --k8s` plans for the pod (its GPUs, its memory), never for this workstation.
`serve --no-preflight` still knows the layout (one listing), and `--pattern` implies sharded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from checkpoints import write_sharded_checkpoint
from cli_helpers import run_cli
from streamctl.demo import build_demo_checkpoint
from streamctl.storage import open_location

NO_HOST_GPU = {"CUDA_VISIBLE_DEVICES": ""}  # whatever this machine has, the tool must see no CUDA device
NO_BUCKET_GPU = {**NO_HOST_GPU, "AWS_ENDPOINT_URL": ""}


def _extra_config(args: list[str]) -> dict[str, object]:
    return json.loads(args[args.index("--model-loader-extra-config") + 1])


@pytest.fixture
def demo_model(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    build_demo_checkpoint(open_location(str(folder)))
    return folder


@pytest.fixture
def sharded_model(tmp_path: Path) -> Path:
    folder = tmp_path / "sharded"
    write_sharded_checkpoint(open_location(str(folder)), tp=2)
    return folder


def test_k8s_turns_distributed_streaming_on_for_the_pods_gpus(demo_model: Path) -> None:
    # a bucket nobody reaches: a manifest refuses a local model, and this plan needs no listing
    result = run_cli("serve", "s3://bkt/m", "--no-preflight", "--not-sharded", "--k8s", "-tp", "2", env=NO_BUCKET_GPU)
    assert result.exit_code == 0, result.stderr
    assert "CUDA" not in result.stderr
    container = yaml.safe_load_all(result.stdout).__next__()["spec"]["template"]["spec"]["containers"][0]
    assert _extra_config(container["args"])["distributed"] is True
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    # the same launch on this GPU-less host says so and leaves it off
    host = run_cli("serve", str(demo_model), "--json", "-tp", "2", env=NO_HOST_GPU)
    assert "distributed" not in host.json()["extra_config"]
    assert any("CUDA" in warning for warning in host.json()["warnings"])


def test_k8s_does_not_weigh_the_pod_against_this_hosts_memory() -> None:
    # a bucket nobody reaches (a manifest's model is never local), and this plan needs no listing
    args = ("s3://bkt/m", "--no-preflight", "--not-sharded", "-tp", "8", "--no-distributed", "--memory-limit", "64TiB")
    host = run_cli("serve", *args, "--dry-run", env=NO_BUCKET_GPU)
    assert host.exit_code == 0 and "RAM" in host.stderr  # this host is compared: it is where vLLM would run
    k8s = run_cli("serve", *args, "--k8s", env=NO_BUCKET_GPU)
    assert k8s.exit_code == 0, k8s.stderr
    assert "RAM" not in k8s.stderr and "CUDA" not in k8s.stderr


def test_no_preflight_detects_a_sharded_layout(sharded_model: Path) -> None:
    result = run_cli("serve", str(sharded_model), "--no-preflight", "-tp", "2", "--json")
    assert result.exit_code == 0, result.stderr
    assert result.json()["load_format"] == "runai_streamer_sharded"


def test_no_preflight_keeps_an_hf_layout(demo_model: Path) -> None:
    result = run_cli("serve", str(demo_model), "--no-preflight", "--json")
    assert result.exit_code == 0, result.stderr
    assert result.json()["load_format"] == "runai_streamer"


def test_pattern_implies_sharded(tmp_path: Path) -> None:
    pattern = "custom-{rank}-part-{part}.safetensors"
    folder = tmp_path / "custom"
    write_sharded_checkpoint(open_location(str(folder)), tp=2, pattern=pattern)
    for preflight in ("--preflight", "--no-preflight"):
        result = run_cli("serve", str(folder), preflight, "--pattern", pattern, "-tp", "2", "--json")
        assert result.exit_code == 0, (preflight, result.stderr)
        document = result.json()
        assert document["load_format"] == "runai_streamer_sharded"
        assert document["extra_config"] == {"pattern": pattern}
    # on a bucket nobody can reach: --pattern alone needs no listing
    remote = run_cli(
        "serve",
        "s3://bkt/m",
        "--no-preflight",
        "--pattern",
        pattern,
        "-tp",
        "2",
        "--json",
        "--endpoint-url",
        "http://127.0.0.1:9",
    )
    assert remote.exit_code == 0, remote.stderr
    assert remote.json()["load_format"] == "runai_streamer_sharded"


def test_pattern_with_not_sharded_is_refused(demo_model: Path) -> None:
    result = run_cli(
        "serve", str(demo_model), "--no-preflight", "--not-sharded", "--pattern", "x-{rank}-{part}.safetensors"
    )
    assert result.exit_code == 2
    assert "--not-sharded" in result.stderr


def test_no_preflight_listing_failure_names_the_way_out(storage_env: dict[str, str]) -> None:
    result = run_cli(
        "serve",
        "s3://bkt/m",
        "--no-preflight",
        "--dry-run",
        "--endpoint-url",
        "http://127.0.0.1:9",
        env={**storage_env, "AWS_MAX_ATTEMPTS": "1"},
    )
    assert result.exit_code == 6, result.stderr
    assert "--sharded or --not-sharded" in result.stderr
    forced = run_cli(
        "serve",
        "s3://bkt/m",
        "--no-preflight",
        "--sharded",
        "-tp",
        "2",
        "--dry-run",
        "--endpoint-url",
        "http://127.0.0.1:9",
        env={**storage_env, "AWS_MAX_ATTEMPTS": "1"},
    )
    assert forced.exit_code == 0, forced.stderr
    assert "runai_streamer_sharded" in forced.stdout
