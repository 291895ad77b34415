"""`serve --k8s` across nodes: when TP x PP needs more GPUs than one node has, the Deployment k8s.py builds
becomes a LeaderWorkerSet (leaderworkerset.x-k8s.io/v1) of `size` = nodes pods, every one running vLLM's own
multi-node `mp` backend (no Ray): `vllm serve ... --nnodes N --node-rank $(LWS_WORKER_INDEX) --master-addr
$(LWS_LEADER_ADDRESS)`, the workers `--headless`. Each pod is the Deployment's pod (its GPUs, /dev/shm, the
streamer's environment, credentials, identity and compile-cache volume: one builder, k8s.serve_manifests);
only the leader has the port and the probes, and the Service selects it alone.

vLLM 0.33's flags (engine/arg_utils.py): `--nnodes/-n`, `--node-rank/-r`, `--master-addr`, `--master-port`
(29501), `--headless` (entrypoints/cli/serve.py: a node rank > 0 runs the multiproc executor's workers);
`--distributed-executor-backend mp` is set outright (config/parallel.py: "nnodes > 1 can only be set when
distributed executor backend is mp, uni or external_launcher"). LWS puts LWS_LEADER_ADDRESS, LWS_GROUP_SIZE
and LWS_WORKER_INDEX (0 = the leader) into every container's environment, so Kubernetes expands `$(VAR)`.
With a sharded checkpoint every rank reads only its own `model-pp-*-tp-*` files: that is vLLM's sharded
loader, given the same load format on every node."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from streamctl.errors import UsageError
from streamctl.serve.vllm_args import takes

LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
DEFAULT_GPUS_PER_NODE = 8
# GPUs on the largest GKE machine shape of each accelerator type (--accelerator): A2 megagpu has 16 A100 40GB,
# A4X 4 GB200, N1 at most 4 T4/P4/P100; the others 8. Another shape is --gpus-per-node.
GKE_GPUS_PER_NODE = {
    "nvidia-tesla-t4": 4,
    "nvidia-tesla-p4": 4,
    "nvidia-tesla-p100": 4,
    "nvidia-tesla-v100": 8,
    "nvidia-l4": 8,
    "nvidia-tesla-a100": 16,
    "nvidia-a100-80gb": 8,
    "nvidia-h100-80gb": 8,
    "nvidia-h100-mega-80gb": 8,
    "nvidia-h200-141gb": 8,
    "nvidia-b200": 8,
    "nvidia-gb200": 4,
}
PIPELINE_PARALLEL = ("--pipeline-parallel-size", "-pp")
# vLLM options streamctl sets for a multi-node group, or that change the group's size (TP x PP only).
MULTINODE_OPTIONS = (
    "--nnodes",
    "-n",
    "--node-rank",
    "-r",
    "--master-addr",
    "--headless",
    "--distributed-executor-backend",
    "--data-parallel-size",
    "-dp",
    "--prefill-context-parallel-size",
    "-pcp",
)
ROLE_LABEL = "app.kubernetes.io/component"  # leader or worker: the Service selects the leader
WORKER_INDEX, LEADER_ADDRESS = "LWS_WORKER_INDEX", "LWS_LEADER_ADDRESS"


def _option_value(args: Sequence[str], options: Sequence[str]) -> tuple[str, str] | None:
    """(as written, value) of the last of `options` among vLLM's `args` (argparse keeps the last)."""
    found = None
    for index, arg in enumerate(args):
        if any(takes(arg, option) for option in options):
            written = arg.split("=", 1)[0]
            if "=" in arg:
                found = (written, arg.split("=", 1)[1])
            else:
                found = (written, args[index + 1] if index + 1 < len(args) else "")
    return found


def pipeline_parallel_size(args: Sequence[str]) -> int:
    """The pipeline-parallel size among vLLM's arguments (`--pipeline-parallel-size P`, `-pp=P`, ...), 1 without;
    UsageError for a value vLLM would refuse."""
    given = _option_value(args, PIPELINE_PARALLEL)
    if given is None:
        return 1
    written, value = given
    if not value.isdigit() or int(value) < 1:
        raise UsageError(f"{written} {value!r}: the pipeline-parallel size must be a whole number >= 1")
    return int(value)


@dataclass(frozen=True)
class NodeLayout:
    """How a launch's TP x PP ranks sit on nodes of `gpus_per_node` GPUs: one pod (all ranks), or `nodes` pods
    of `gpus_per_node` ranks each, vLLM numbering ranks pp_rank * TP + tp_rank, node by node."""

    tensor_parallel_size: int
    pipeline_parallel_size: int
    gpus_per_node: int

    @classmethod
    def for_launch(
        cls, tensor_parallel_size: int, argv: Sequence[str], gpus_per_node: int | None, accelerator: str | None
    ) -> NodeLayout:
        """The layout of `vllm serve` argv; the GPUs per node as given, else from the accelerator type, else 8.
        UsageError for a group that does not split into whole nodes."""
        per_node = gpus_per_node or GKE_GPUS_PER_NODE.get(accelerator or "", DEFAULT_GPUS_PER_NODE)
        layout = cls(tensor_parallel_size, pipeline_parallel_size(argv[2:]), per_node)
        layout.check(argv[2:], given=gpus_per_node is not None)
        return layout

    @property
    def ranks(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def nodes(self) -> int:
        return 1 if self.ranks <= self.gpus_per_node else self.ranks // self.gpus_per_node

    @property
    def gpus_per_pod(self) -> int:
        return self.ranks if self.nodes == 1 else self.gpus_per_node

    def check(self, args: Sequence[str], *, given: bool) -> None:
        if self.ranks <= self.gpus_per_node:
            return
        tp, pp, per_node = self.tensor_parallel_size, self.pipeline_parallel_size, self.gpus_per_node
        what = f"TP {tp} x PP {pp} = {self.ranks} GPUs"
        source = "--gpus-per-node" if given else "the GPUs per node (default: from --accelerator, else 8)"
        if self.ranks % per_node:
            raise UsageError(
                f"{what} is not a multiple of {per_node} GPUs per node: the group does not fill whole nodes",
                hint=f"choose TP x PP as a multiple of {per_node}, or set {source} to the nodes' count",
            )
        if per_node % tp and tp % per_node:
            raise UsageError(
                f"{what} on nodes of {per_node} GPUs: a tensor-parallel group of {tp} ranks would straddle two nodes",
                hint=f"choose a TP that divides {per_node} (or a multiple of it), or set {source}",
            )
        for arg in args:
            named = next((option for option in MULTINODE_OPTIONS if takes(arg, option)), None)
            if named is not None:
                raise UsageError(
                    f"{arg.split('=', 1)[0]} after --: streamctl sets the multi-node launch of {what} "
                    f"({self.nodes} nodes) itself",
                    hint="drop it; the group's size comes from -tp and -pp alone",
                )

    def multinode_args(self, args: Sequence[str], *, headless: bool) -> list[str]:
        """A container's `serve MODEL ...` args with the group's flags after MODEL (before the user's own)."""
        flags = [
            "--distributed-executor-backend",
            "mp",
            "--nnodes",
            str(self.nodes),
            "--node-rank",
            f"$({WORKER_INDEX})",
            "--master-addr",
            f"$({LEADER_ADDRESS})",
        ]
        return [*args[:2], *flags, *(["--headless"] if headless else []), *args[2:]]

    def manifests(self, documents: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """On one node `documents` as they are; across nodes the Deployment becomes a LeaderWorkerSet of its pod
        and the Service selects the leader."""
        if self.nodes == 1:
            return [dict(document) for document in documents]
        out: list[dict[str, Any]] = []
        for document in documents:
            if document.get("kind") == "Deployment":
                out.append(self.leader_worker_set(document))
            elif document.get("kind") == "Service":
                service = copy.deepcopy(dict(document))
                service["spec"]["selector"][ROLE_LABEL] = "leader"
                out.append(service)
            else:
                out.append(dict(document))
        return out

    def leader_worker_set(self, deployment: Mapping[str, Any]) -> dict[str, Any]:
        template = deployment["spec"]["template"]
        return {
            "apiVersion": LWS_API_VERSION,
            "kind": "LeaderWorkerSet",
            "metadata": copy.deepcopy(deployment["metadata"]),
            "spec": {
                "replicas": 1,
                "leaderWorkerTemplate": {
                    "size": self.nodes,
                    # one pod of the group lost: all of it restarts (its ranks cannot rejoin a running group)
                    "restartPolicy": "RecreateGroupOnPodRestart",
                    "leaderTemplate": self._pod(template, leader=True),
                    "workerTemplate": self._pod(template, leader=False),
                },
            },
        }

    def _pod(self, template: Mapping[str, Any], *, leader: bool) -> dict[str, Any]:
        """The Deployment's pod template as the leader's (port, probes, the startup budget's note) or a worker's."""
        pod = copy.deepcopy(dict(template))
        metadata = pod["metadata"]
        metadata["labels"][ROLE_LABEL] = "leader" if leader else "worker"
        if not leader:
            metadata.pop("annotations", None)  # the startup budget's note: the leader's probe
        for container in pod["spec"]["containers"]:
            container["args"] = self.multinode_args(container["args"], headless=not leader)
            # vLLM's own address for the group: the pod's IP (production-stack's lws-vllm template does so)
            host_ip = {"name": "VLLM_HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
            container["env"] = [host_ip, *container["env"]]
            if not leader:
                for key in ("ports", "startupProbe", "readinessProbe", "livenessProbe"):
                    container.pop(key, None)
        return pod
