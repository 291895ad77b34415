"""Kubernetes manifests as plain data, and a small YAML writer for them (no YAML dependency needed)."""

from __future__ import annotations

import json
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
