"""Kubernetes manifests as plain data, and a small YAML writer for them (no YAML dependency needed)."""

from __future__ import annotations

import json
import math
import re
import shlex
from collections.abc import Mapping, Sequence

_PLAIN = re.compile(r"^[A-Za-z0-9_./][A-Za-z0-9_./:=@-]*$")
_YAML_WORDS = {"true", "false", "yes", "no", "on", "off", "null", "~", "y", "n"}


def _scalar(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    if value is None:
        return "null"
    text = str(value)
    numeric = re.fullmatch(r"[-+]?(\d[\d_]*)?(\.\d*)?([eE][-+]?\d+)?", text) is not None
    if _PLAIN.match(text) and text.lower() not in _YAML_WORDS and not numeric and not text.endswith(":"):
        return text
    return json.dumps(text)  # a JSON string is a valid double-quoted YAML scalar


def to_yaml(value: object, indent: int = 0) -> str:
    """Block-style YAML for dicts, lists and scalars."""
    pad = " " * indent
    if isinstance(value, Mapping):
        if not value:
            return pad + "{}\n"
        lines = []
        for key, item in value.items():
            if isinstance(item, (Mapping, list, tuple)) and item:
                lines.append(f"{pad}{_scalar(key)}:\n{to_yaml(item, indent + 2)}")
            else:
                empty = "{}" if isinstance(item, Mapping) else "[]" if isinstance(item, (list, tuple)) else None
                lines.append(f"{pad}{_scalar(key)}: {empty or _scalar(item)}\n")
        return "".join(lines)
    if isinstance(value, Sequence) and not isinstance(value, str):
        lines = []
        for item in value:
            if isinstance(item, (Mapping, list, tuple)) and item:
                nested = to_yaml(item, indent + 2)
                lines.append(f"{pad}- {nested[indent + 2:]}")
            else:
                lines.append(f"{pad}- {_scalar(item)}\n")
        return "".join(lines)
    return pad + _scalar(value) + "\n"


def k8s_name(text: str, limit: int = 63) -> str:
    """A DNS-1123 label derived from free text (repo ids, bucket paths)."""
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    return (name[:limit].rstrip("-")) or "streamctl"


def transfer_job(
    arguments: Sequence[str],
    *,
    name: str,
    namespace: str,
    image: str | None,
    version: str,
    service_account: str | None,
    secret: str | None,
    env: Mapping[str, str],
) -> dict[str, object]:
    """A Job that runs `streamctl transfer ARGUMENTS` in the cluster, next to the bucket.

    Re-runs are cheap (finished objects are skipped), so the Job may retry freely.
    """
    if image:
        command = ["streamctl", "transfer", *arguments]
    else:
        image = "python:3.12-slim"
        quoted = " ".join(shlex.quote(argument) for argument in arguments)
        command = [
            "sh",
            "-c",
            f"pip install --no-cache-dir --quiet 'streamctl=={version}' && exec streamctl transfer {quoted}",
        ]
    container: dict[str, object] = {
        "name": "transfer",
        "image": image,
        "command": command,
        "env": [{"name": key, "value": value} for key, value in sorted(env.items())],
        "resources": {
            "requests": {"cpu": "2", "memory": "1Gi"},
            "limits": {"memory": "2Gi"},
        },
    }
    if secret:
        container["envFrom"] = [{"secretRef": {"name": secret}}]
    pod_spec: dict[str, object] = {"restartPolicy": "OnFailure", "containers": [container]}
    if service_account:
        pod_spec["serviceAccountName"] = service_account
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": namespace, "labels": {"app.kubernetes.io/managed-by": "streamctl"}},
        "spec": {
            "backoffLimit": 6,
            "ttlSecondsAfterFinished": 86400,
            "template": {"metadata": {"labels": {"app.kubernetes.io/name": name}}, "spec": pod_spec},
        },
    }


DEFAULT_VLLM_IMAGE = "vllm/vllm-openai:v0.33.0"
VLLM_PORT = 8000
PROBE_PERIOD_S = 10


def _gibibytes(count: int) -> str:
    return f"{max(1, math.ceil(count / 1024**3))}Gi"


def serve_manifests(
    argv: Sequence[str],
    env: Mapping[str, str],
    *,
    name: str,
    namespace: str,
    image: str,
    tensor_parallel_size: int,
    service_account: str | None,
    accelerator: str | None,
    secret: str | None,
    startup_budget_s: int,
    memory_request_bytes: int | None,
    shm_bytes: int,
) -> list[dict[str, object]]:
    """A Deployment and a Service for `vllm serve`, as the GKE guide describes, with its gaps fixed:
    /dev/shm is mounted, the startup budget follows the checkpoint size, GPUs equal the TP size."""
    labels = {"app.kubernetes.io/name": name, "app.kubernetes.io/managed-by": "streamctl"}
    gpus = str(tensor_parallel_size)
    resources: dict[str, object] = {"limits": {"nvidia.com/gpu": gpus}, "requests": {"nvidia.com/gpu": gpus}}
    if memory_request_bytes:
        resources["requests"] = {"nvidia.com/gpu": gpus, "memory": _gibibytes(memory_request_bytes)}
    health = {"path": "/health", "port": VLLM_PORT}
    container: dict[str, object] = {
        "name": "vllm",
        "image": image,
        "command": [argv[0]],
        "args": list(argv[1:]),
        "ports": [{"containerPort": VLLM_PORT, "name": "http"}],
        "env": [{"name": key, "value": value} for key, value in sorted(env.items())],
        "resources": resources,
        # vLLM answers /health only once the weights are loaded: the startup probe holds the others off.
        "startupProbe": {
            "httpGet": health,
            "periodSeconds": PROBE_PERIOD_S,
            "failureThreshold": max(1, math.ceil(startup_budget_s / PROBE_PERIOD_S)),
        },
        "readinessProbe": {"httpGet": health, "periodSeconds": PROBE_PERIOD_S, "failureThreshold": 3},
        "livenessProbe": {"httpGet": health, "periodSeconds": 30, "failureThreshold": 5},
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }
    if secret:
        container["envFrom"] = [{"secretRef": {"name": secret}}]
    pod_spec: dict[str, object] = {
        "containers": [container],
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": _gibibytes(shm_bytes)}}],
    }
    if service_account:
        pod_spec["serviceAccountName"] = service_account
    if accelerator:
        pod_spec["nodeSelector"] = {"cloud.google.com/gke-accelerator": accelerator}
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app.kubernetes.io/name": name}},
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "selector": {"app.kubernetes.io/name": name},
            "ports": [{"name": "http", "port": VLLM_PORT, "targetPort": VLLM_PORT}],
        },
    }
    return [deployment, service]


def to_yaml_documents(documents: Sequence[object]) -> str:
    return "---\n".join(to_yaml(document) for document in documents)
