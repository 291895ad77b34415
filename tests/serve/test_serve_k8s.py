"""k8s.py's serve policy: the pod's memory request, /dev/shm, probes and name come from the launch plan's
parsed values (issue 11: a parsed value is never encoded into the environment and decoded back)."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from streamctl.k8s import ServeManifestOptions, pod_memory_request, serve_pod_manifests
from streamctl.serve.plan import CheckpointFacts, LaunchPlan, ServeOptions, plan_launch

GiB = 1024**3
FACTS = CheckpointFacts(total_bytes=16 * GiB, largest_tensor_bytes=GiB // 2, files=4)


def _plan(options: ServeOptions, *, sharded: bool) -> LaunchPlan:
    return plan_launch(options, FACTS, sharded=sharded, environ={}, cuda_available=True, host_memory_bytes=None)


def test_the_sharded_loaders_limit_is_kept_as_a_number() -> None:
    plan = _plan(ServeOptions(model="s3://bkt/m", tensor_parallel_size=2, memory_limit=GiB), sharded=True)
    assert plan.env["RUNAI_STREAMER_MEMORY_LIMIT"] == str(GiB)  # what the streamer reads ...
    assert plan.memory_limit == GiB and plan.distributed is False  # ... and what the pod sizing uses
    # Every TP worker of the sharded loader stages its own copy; vLLM needs 8 GiB besides.
    assert pod_memory_request(FACTS, plan, 2) == 2 * GiB + 8 * GiB
    # The request follows the plan's value, not the text in the environment.
    assert pod_memory_request(FACTS, replace(plan, env={}), 2) == 2 * GiB + 8 * GiB


@pytest.mark.parametrize(
    ("distributed", "workers"), [(None, 1), (False, 2)], ids=["distributed-by-default", "distributed-off"]
)
def test_distributed_streaming_stages_once(distributed: bool | None, workers: int) -> None:
    options = ServeOptions(model="s3://bkt/m", tensor_parallel_size=2, memory_limit=3 * GiB, distributed=distributed)
    plan = _plan(options, sharded=False)
    assert plan.distributed is (workers == 1)
    assert plan.extra_config["memory_limit"] == 3 * GiB
    assert pod_memory_request(FACTS, plan, 2) == workers * 3 * GiB + 8 * GiB


@pytest.mark.parametrize("limit", [None, -1, 0])
def test_special_limits_size_the_pod_from_the_checkpoint(limit: int | None) -> None:
    plan = _plan(ServeOptions(model="/m", memory_limit=limit, distributed=False), sharded=True)
    expected = {None: 16 * GiB, -1: 16 * GiB, 0: GiB // 2}[limit]  # default 40 GB bounded by the checkpoint
    assert pod_memory_request(FACTS, plan, 1) == expected + 8 * GiB


@pytest.mark.parametrize(("tp", "shm"), [(1, "2Gi"), (4, "16Gi")])
def test_pod_manifest_follows_the_plan(tp: int, shm: str) -> None:
    options = ServeOptions(model="gs://bucket/Qwen3-8B/", tensor_parallel_size=tp, memory_limit=GiB)
    plan = _plan(options, sharded=False)
    deployment, service = serve_pod_manifests(plan, FACTS, options, ServeManifestOptions(namespace="ml"))
    pod = deployment["spec"]["template"]["spec"]  # type: ignore[index]
    container = pod["containers"][0]
    assert deployment["metadata"] == service["metadata"]
    # named after the model, with a hash of its whole location (another bucket's Qwen3-8B is another name)
    assert re.fullmatch(r"vllm-qwen3-8b-[0-9a-f]{8}", deployment["metadata"]["name"])  # type: ignore[arg-type,index]
    assert deployment["metadata"]["namespace"] == "ml"  # type: ignore[index]
    assert container["image"] == "vllm/vllm-openai:v0.33.0"
    assert container["resources"]["limits"] == {"nvidia.com/gpu": str(tp)}
    # One streaming worker either way: TP 1 has one, TP 4 on the pod's GPUs streams distributed.
    assert container["resources"]["requests"]["memory"] == "9Gi"
    assert pod["volumes"][0]["emptyDir"]["sizeLimit"] == shm
    # 16 GiB at the 100 MB/s floor is 172 s, plus 600 s of engine start, in 10 s probe periods.
    assert container["startupProbe"]["failureThreshold"] == 78


def test_without_the_preflight_the_pod_requests_no_memory() -> None:
    options = ServeOptions(model="s3://bkt/m", memory_limit=GiB)
    plan = plan_launch(options, None, sharded=False, environ={}, cuda_available=True, host_memory_bytes=None)
    (deployment, _service) = serve_pod_manifests(plan, None, options, ServeManifestOptions())
    container = deployment["spec"]["template"]["spec"]["containers"][0]  # type: ignore[index]
    assert "memory" not in container["resources"]["requests"]
    assert container["startupProbe"]["failureThreshold"] == 60  # engine start-up only
