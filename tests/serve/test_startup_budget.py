"""`serve --k8s`'s startup probe waits as long as the model takes to load: the checkpoint's bytes at the pod's
expected rate (the `--tune` figure when there is one, else DEFAULT_POD_BYTES_PER_SECOND) plus the engine's
start, never a fixed 10 minutes; `--no-preflight` sizes it from its one listing; the pod template's annotation
says how the budget was reached; readiness is on /health."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import yaml

from cli_helpers import run_cli
from kube_models import check_with_models
from streamctl.demo import build_demo_checkpoint
from streamctl.k8s import (
    DEFAULT_POD_BYTES_PER_SECOND,
    ENGINE_START_S,
    PROBE_PERIOD_S,
    STARTUP_BUDGET_ANNOTATION,
    TUNED_MARGIN,
    ServeManifestOptions,
    StartupBudget,
    serve_pod_manifests,
)
from streamctl.serve.plan import CheckpointFacts, ServeOptions, plan_launch
from streamctl.serve.run import ServeResult
from streamctl.serve.tune import TuneResult, TuneSample
from streamctl.storage import open_location

GiB = 1024**3
OPTIONS = ServeOptions(model="s3://bkt/m")


def _pod(documents: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the pod template, its vLLM container) of the Deployment."""
    template = documents[0]["spec"]["template"]
    return template, template["spec"]["containers"][0]


def _result(total_bytes: int, tune: TuneResult | None = None) -> ServeResult:
    facts = CheckpointFacts(total_bytes=total_bytes, largest_tensor_bytes=GiB // 4, files=4)
    plan = plan_launch(OPTIONS, facts, sharded=False, environ={}, cuda_available=True, host_memory_bytes=None)
    return ServeResult(OPTIONS, plan, facts, tune, {}, checkpoint_bytes=total_bytes)


def _manifests(result: ServeResult) -> list[dict[str, Any]]:
    return serve_pod_manifests(result.plan, result.facts, OPTIONS, ServeManifestOptions(), startup=result.startup)  # type: ignore[return-value]


def test_a_bigger_checkpoint_waits_proportionally_longer() -> None:
    small, big = (_result(size) for size in (100 * GiB, 400 * GiB))
    # the load part grows with the bytes, four times the checkpoint four times the wait; the engine's start stays
    assert big.startup.load_seconds == pytest.approx(4 * small.startup.load_seconds, abs=1)
    assert small.startup.seconds - small.startup.load_seconds == ENGINE_START_S
    assert small.startup.load_seconds == math.ceil(100 * GiB / DEFAULT_POD_BYTES_PER_SECOND)  # 1074 s at 100 MB/s
    thresholds = [_pod(_manifests(result))[1]["startupProbe"]["failureThreshold"] for result in (small, big)]
    assert thresholds == [(1074 + 600 + 9) // 10, (4295 + 600 + 9) // 10]  # 168 and 490 probes of 10 s
    # a 1 TiB model gets hours, not the 10 minutes that kill a load in progress (aws-do-eks#40)
    assert _result(1024 * GiB).startup.seconds > 3 * 3600


def test_the_tune_figure_changes_the_budget() -> None:
    sample = TuneSample(concurrency=16, bytes=2 * 10**9, seconds=1.0)  # 2 GB/s measured here
    untuned, tuned = _result(100 * GiB), _result(100 * GiB, TuneResult(("s3://bkt/m/a.safetensors",), (sample,)))
    assert tuned.startup.measured and tuned.startup.bytes_per_second == 2e9
    # the measured rate, with its margin, instead of the default 100 MB/s
    assert tuned.startup.load_seconds == math.ceil(100 * GiB * TUNED_MARGIN / 2e9)  # 108 s
    assert tuned.startup.seconds < untuned.startup.seconds
    template, container = _pod(_manifests(tuned))
    assert container["startupProbe"]["failureThreshold"] == (108 + 600 + 9) // PROBE_PERIOD_S
    note = template["metadata"]["annotations"][STARTUP_BUDGET_ANNOTATION]
    assert "--tune" in note and "2.00 GB/s" in note and f"{100 * GiB:,} bytes" in note, note
    assert "default per-pod rate" in _pod(_manifests(untuned))[0]["metadata"]["annotations"][STARTUP_BUDGET_ANNOTATION]


def test_readiness_and_startup_are_on_health() -> None:
    _template, container = _pod(_manifests(_result(GiB)))
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": 8000}, probe


def test_an_unknown_size_says_so_in_the_annotation() -> None:
    budget = StartupBudget(None)
    assert budget.seconds == ENGINE_START_S
    assert "size is unknown" in budget.describe(PROBE_PERIOD_S)


@pytest.fixture
def demo_model(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    build_demo_checkpoint(open_location(str(folder)))
    return folder


def _upload(folder: Path, url: str, copies: int = 1) -> int:
    """The demo checkpoint's files under `url`, the weights `copies` times (more shards); their bytes."""
    location = open_location(url)
    weights = 0
    for path in folder.iterdir():
        data = path.read_bytes()
        names = [path.name]
        if path.suffix == ".safetensors":
            names = [f"{path.stem}-{copy}.safetensors" if copy else path.name for copy in range(copies)]
            weights += len(data) * len(names)
        for name in names:
            location.store.put(location.key(name), data)
    return weights


def _serve_k8s(url: str, env: dict[str, str], *extra: str) -> tuple[dict[str, Any], dict[str, Any], str]:
    result = run_cli("serve", url, "--k8s", *extra, env=env)
    assert result.exit_code == 0, result.stderr
    documents = list(yaml.safe_load_all(result.stdout))
    for document in documents:
        check_with_models(document)
    template, container = _pod(documents)
    return template, container, result.stderr


def test_no_preflight_still_sizes_from_one_listing(demo_model: Path, s3_root: str, storage_env: dict[str, str]) -> None:
    one = _upload(demo_model, f"{s3_root}/one")
    three = _upload(demo_model, f"{s3_root}/three", copies=3)
    assert three == 3 * one
    notes = {}
    for name, size in (("one", one), ("three", three)):
        template, _container, _stderr = _serve_k8s(f"{s3_root}/{name}", storage_env, "--no-preflight")
        notes[name] = template["metadata"]["annotations"][STARTUP_BUDGET_ANNOTATION]
        assert f"{size:,} bytes" in notes[name], notes[name]  # the listing's bytes, without reading a header
    # the pre-flight's own figure is the same bytes
    template, _container, _stderr = _serve_k8s(f"{s3_root}/one", storage_env)
    assert f"{one:,} bytes" in template["metadata"]["annotations"][STARTUP_BUDGET_ANNOTATION]
    # with the layout given, --no-preflight reads nothing: the budget is the engine's start, and a warning says so
    template, container, stderr = _serve_k8s(f"{s3_root}/one", storage_env, "--no-preflight", "--not-sharded")
    assert container["startupProbe"]["failureThreshold"] == ENGINE_START_S // PROBE_PERIOD_S
    assert "size is unknown" in template["metadata"]["annotations"][STARTUP_BUDGET_ANNOTATION]
    assert "drop --sharded/--not-sharded" in " ".join(stderr.split()), stderr
    dry = run_cli("serve", f"{s3_root}/one", "--no-preflight", "--not-sharded", "--json", env=storage_env)
    assert not any("startup probe" in warning for warning in json.loads(dry.stdout)["warnings"])  # pods only
