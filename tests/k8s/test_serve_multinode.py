"""`serve --k8s` across nodes: TP x PP beyond one node's GPUs prints a LeaderWorkerSet of
whole nodes running vLLM's own multi-node `mp` backend (no Ray), valid against the LWS CRD's published schema
(tests/k8s/schemas/); within one node, still a Deployment; a group that does not split into nodes: exit 2.
The facts are docs/specs/kubernetes-serving.md's, section 2c."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import pytest
import yaml

from cli_helpers import run_cli
from crd_schema import schema_errors
from kube_models import check_with_models
from streamctl.errors import UsageError
from streamctl.k8s import ServeManifestOptions, serve_pod_manifests, serve_pod_yaml
from streamctl.k8s_identity import IdentityOptions
from streamctl.k8s_multinode import NodeLayout, pipeline_parallel_size
from streamctl.serve.plan import CheckpointFacts, ServeOptions, plan_launch

GiB = 1024**3
FACTS = CheckpointFacts(total_bytes=800 * GiB, largest_tensor_bytes=GiB, files=160)
SERVE = ("serve", "--no-preflight", "--not-sharded", "--k8s")  # MODEL goes after "serve"; no request is made
ARN = "arn:aws:iam::123456789012:role/vllm-read"
HOST_KEYS = {
    "AWS_ACCESS_KEY_ID": "AKIAHOSTKEY000000000",
    "AWS_SECRET_ACCESS_KEY": "host-secret-key-material",
    "AWS_SESSION_TOKEN": "host-session-token",
    "AWS_ENDPOINT_URL": "",
}


def _manifests(
    tp: int, vllm_args: tuple[str, ...] = (), *, sharded: bool = False, **kubernetes: Any
) -> list[dict[str, Any]]:
    options = ServeOptions(model="s3://models/qwen3-coder-480b", tensor_parallel_size=tp, vllm_args=vllm_args)
    plan = plan_launch(
        options,
        FACTS,
        sharded=sharded,
        environ=HOST_KEYS,
        cuda_available=True,
        host_memory_bytes=None,
        for_kubernetes=True,
    )
    return serve_pod_manifests(plan, FACTS, options, ServeManifestOptions(namespace="ml", **kubernetes))


def _templates(lws: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    group = lws["spec"]["leaderWorkerTemplate"]
    return group["leaderTemplate"], group["workerTemplate"]


def test_tp8_pp2_on_8_gpu_nodes_is_a_leader_and_one_worker() -> None:
    lws, service = _manifests(8, ("--pipeline-parallel-size", "2", "--max-model-len", "8192"))
    assert (lws["apiVersion"], lws["kind"]) == ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet")
    assert schema_errors(lws) == []
    check_with_models(service)
    group = lws["spec"]["leaderWorkerTemplate"]
    assert group["size"] == 2 and group["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader, worker = _templates(lws)
    (lead,), (work,) = leader["spec"]["containers"], worker["spec"]["containers"]
    group_flags = [
        "--distributed-executor-backend",
        "mp",
        "--nnodes",
        "2",
        "--node-rank",
        "$(LWS_WORKER_INDEX)",
        "--master-addr",
        "$(LWS_LEADER_ADDRESS)",
    ]
    assert lead["args"][: 2 + len(group_flags)] == ["serve", "s3://models/qwen3-coder-480b", *group_flags]
    # the worker runs the very same model arguments, headless (no API server)
    assert work["args"] == [*lead["args"][:10], "--headless", *lead["args"][10:]]
    assert lead["args"][-4:] == ["--pipeline-parallel-size", "2", "--max-model-len", "8192"]
    assert "ray" not in json.dumps(lws).lower()
    for pod, container in ((leader, lead), (worker, work)):
        assert container["resources"]["limits"] == {"nvidia.com/gpu": "8"}
        assert container["resources"]["requests"]["nvidia.com/gpu"] == "8"
        assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
        volumes = {volume["name"]: volume for volume in pod["spec"]["volumes"]}
        assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
        assert "compile-cache" in volumes
        assert container["env"][0] == {"name": "VLLM_HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    assert lead["env"] == work["env"]  # the streamer's environment on every pod
    # only the leader serves: the port, the probes (its startup budget: 800 GiB at 100 MB/s + 600 s), the Service
    assert "ports" not in work and not {"startupProbe", "readinessProbe", "livenessProbe"} & set(work)
    assert lead["startupProbe"]["failureThreshold"] == (-(-800 * GiB // 100_000_000) + 600 + 9) // 10
    assert "streamctl.io/startup-budget" in leader["metadata"]["annotations"]
    assert service["spec"]["selector"] == {
        "app.kubernetes.io/name": lws["metadata"]["name"],
        "app.kubernetes.io/component": "leader",
    }
    assert leader["metadata"]["labels"]["app.kubernetes.io/component"] == "leader"
    assert worker["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"


def test_every_pod_gets_the_identity_secret_and_compile_cache_claim() -> None:
    documents = _manifests(
        8,
        ("-pp=2",),
        identity=IdentityOptions("eks-irsa", aws_role_arn=ARN, cluster="prod"),
        compile_cache_claim="vllm-cache",
    )
    assert [document["kind"] for document in documents] == ["ServiceAccount", "LeaderWorkerSet", "Service"]
    account, lws, _service = documents
    assert schema_errors(lws) == []
    for template in _templates(lws):
        pod = template["spec"]
        assert pod["serviceAccountName"] == account["metadata"]["name"]
        assert {"name": "compile-cache", "persistentVolumeClaim": {"claimName": "vllm-cache"}} in pod["volumes"]
    text = json.dumps(documents)
    assert not any(value in text for value in HOST_KEYS.values() if value)
    assert "AWS_SECRET_ACCESS_KEY" not in text and "envFrom" not in text


def test_a_secret_reaches_both_templates() -> None:
    lws, _service = _manifests(8, ("-pp", "2"), secret="hf")
    for template in _templates(lws):
        assert template["spec"]["containers"][0]["envFrom"] == [{"secretRef": {"name": "hf"}}]


def test_a_sharded_checkpoint_keeps_its_load_format_on_every_rank() -> None:
    lws, _service = _manifests(8, ("-pp", "2"), sharded=True)
    assert schema_errors(lws) == []
    for template in _templates(lws):
        args = template["spec"]["containers"][0]["args"]
        assert args[args.index("--load-format") + 1] == "runai_streamer_sharded"


@pytest.mark.parametrize(
    ("tp", "args", "kubernetes", "gpus"),
    [
        (8, (), {}, "8"),
        (2, ("--pipeline_parallel_size", "2"), {}, "4"),  # the pod has a GPU per rank, not per TP rank
        (8, ("-pp", "2"), {"gpus_per_node": 16}, "16"),
        (8, ("-pp", "2"), {"accelerator": "nvidia-tesla-a100"}, "16"),  # A2 megagpu: 16 per node
    ],
    ids=["tp8", "tp2-pp2", "16-per-node", "a100-40gb"],
)
def test_within_one_node_it_stays_a_deployment(
    tp: int, args: tuple[str, ...], kubernetes: dict[str, Any], gpus: str
) -> None:
    deployment, service = _manifests(tp, args, **kubernetes)
    check_with_models(deployment)
    check_with_models(service)
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": gpus}
    assert "--nnodes" not in container["args"] and "component" not in json.dumps(service["spec"])


def test_the_accelerator_sets_the_gpus_per_node() -> None:
    lws, _service = _manifests(4, ("-pp", "2"), accelerator="nvidia-tesla-t4")  # N1: at most 4 T4
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    assert lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["nodeSelector"] == {
        "cloud.google.com/gke-accelerator": "nvidia-tesla-t4"
    }
    assert NodeLayout.for_launch(8, ["vllm", "serve", "m", "-pp", "4"], None, "nvidia-unknown").nodes == 4


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["-tp", "8", "--gpus-per-node", "16", "--", "-pp", "3"], "is not a multiple of 16 GPUs per node"),
        (["-tp", "6", "--", "-pp", "4"], "a tensor-parallel group of 6 ranks would straddle two nodes"),
        (["-tp", "8", "--", "-pp", "2", "--nnodes", "4"], "--nnodes after --: streamctl sets the multi-node"),
        (["-tp", "8", "--", "-pp", "2", "--headless"], "--headless after --"),
        (["-tp", "8", "--", "-pp", "2", "--data-parallel-size=2"], "--data-parallel-size after --"),
        (["-tp", "8", "--", "--pipeline-parallel-size", "two"], "the pipeline-parallel size must be a whole"),
    ],
    ids=["not-whole-nodes", "tp-straddles", "nnodes", "headless", "data-parallel", "pp-not-a-number"],
)
def test_a_group_that_does_not_fit_is_refused(flags: list[str], message: str) -> None:
    result = run_cli(SERVE[0], "s3://models/big", *SERVE[1:], *flags)
    assert result.exit_code == 2, result.stdout
    assert message in result.stderr, result.stderr
    assert result.stdout == ""


def test_the_refusal_comes_before_the_preflight_reads_anything() -> None:
    # the pre-flight would read the bucket through this endpoint, where nothing listens
    env = {"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}
    result = run_cli("serve", "s3://models/big", "--k8s", "-tp", "6", "--", "-pp", "4", env=env)
    assert result.exit_code == 2, result.stderr
    assert "would straddle two nodes" in result.stderr and "127.0.0.1" not in result.stderr, result.stderr


def test_gpus_per_node_applies_only_with_k8s() -> None:
    result = run_cli("serve", "s3://models/big", "--dry-run", "--no-preflight", "--gpus-per-node", "4")
    assert result.exit_code == 2 and "--gpus-per-node applies only with --k8s" in result.stderr, result.stderr


def test_the_cli_prints_a_valid_leader_worker_set() -> None:
    result = run_cli(SERVE[0], "s3://models/big", *SERVE[1:], "-tp", "8", "--", "-pp", "2", env=HOST_KEYS)
    assert result.exit_code == 0, result.stderr
    lws, service = yaml.safe_load_all(result.stdout)
    assert schema_errors(lws) == [] and lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    check_with_models(service)
    assert not any(value in result.stdout for value in HOST_KEYS.values() if value)


def test_the_schema_check_can_fail() -> None:
    lws, _service = _manifests(8, ("-pp", "2"))
    lws["spec"]["leaderWorkerTemplate"]["sizes"] = 2  # a misspelt field
    lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "Always"  # not one of LWS's policies
    lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["ports"] = "8000"
    errors = schema_errors(lws)
    assert len(errors) == 3, errors
    assert any("'sizes' was unexpected" in error for error in errors)


def test_pipeline_parallel_size_is_read_as_vllm_reads_it() -> None:
    assert pipeline_parallel_size(["m"]) == 1
    assert pipeline_parallel_size(["m", "-pp", "2", "--pipeline-parallel=4"]) == 4  # the last one wins
    assert pipeline_parallel_size(["m", "--pipeline_parallel_size", "3"]) == 3
    with pytest.raises(UsageError, match="whole number"):
        pipeline_parallel_size(["m", "-pp", "0"])


def test_the_yaml_heads_with_the_identitys_steps() -> None:
    options = ServeOptions(model="s3://models/big", tensor_parallel_size=8, vllm_args=("-pp", "2"))
    plan = plan_launch(options, FACTS, sharded=False, environ={}, cuda_available=True, host_memory_bytes=None)
    identity = IdentityOptions("eks-irsa", aws_role_arn=ARN, cluster="prod")
    text = serve_pod_yaml(plan, FACTS, options, ServeManifestOptions(identity=identity))
    assert text.startswith("#")
    assert [document["kind"] for document in yaml.safe_load_all(text)] == [
        "ServiceAccount",
        "LeaderWorkerSet",
        "Service",
    ]


# ------------------------------------------------------------------------------------------ vLLM as the judge

from oracle import _run, check_serve_args_many, requires_vllm_oracle


def _expanded(args: list[str], worker_index: int) -> list[str]:
    """A container's args as Kubernetes expands them in pod `worker_index` of the group (LWS's variables)."""
    values = {"$(LWS_WORKER_INDEX)": str(worker_index), "$(LWS_LEADER_ADDRESS)": "vllm-0.vllm.ml"}
    return [values.get(arg, arg) for arg in args]


@requires_vllm_oracle
def test_every_pods_command_line_passes_vllms_own_parser() -> None:
    argvs, formats = [], []
    for sharded, load_format in ((False, "runai_streamer"), (True, "runai_streamer_sharded")):
        lws, _service = _manifests(8, ("--pipeline-parallel-size", "2", "--max-model-len", "8192"), sharded=sharded)
        leader, worker = (template["spec"]["containers"][0]["args"] for template in _templates(lws))
        argvs += [_expanded(leader, 0)[1:], _expanded(worker, 1)[1:]]  # after `vllm serve`
        formats += [load_format, load_format]
    for verdict, load_format in zip(check_serve_args_many(argvs), formats, strict=True):
        assert verdict["ok"], verdict
        assert verdict["load_format"] == load_format
    argvs = argvs[:2]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as jobs:
        json.dump({"argvs": [argv[1:] for argv in argvs]}, jobs)  # after `vllm serve MODEL`
    try:
        document = _run("serve_options.py", ["--jobs", jobs.name])
    finally:
        os.unlink(jobs.name)
    assert document["ok"], document
    lead, work = (parsed["values"] for parsed in document["parsed"])
    expected = {
        "distributed_executor_backend": "mp",
        "nnodes": 2,
        "master_addr": "vllm-0.vllm.ml",
        "tensor_parallel_size": 8,
        "pipeline_parallel_size": 2,
    }
    assert {key: lead.get(key) for key in expected} == expected, lead
    assert {key: work.get(key) for key in expected} == expected, work
    assert lead.get("node_rank", 0) == 0 and work["node_rank"] == 1
    assert work["headless"] is True and not lead.get("headless")
