"""Every core Kubernetes kind streamctl prints goes through the Kubernetes client's models, from the commands
users type: `transfer --k8s-job` (a plain Job and an Indexed one) and `serve --k8s` (Deployment, Service,
and the ServiceAccount an identity brings)."""

from __future__ import annotations

from typing import Any

import yaml

from cli_helpers import run_cli
from kube_models import MODELS, check_with_models

IMAGE = "registry.example/streamctl:0.1.0"
PRINTING_COMMANDS = (
    ("transfer", "org/model", "s3://bucket/m", "--k8s-job", "--image", IMAGE),
    ("transfer", "org/model", "s3://bucket/m", "--k8s-job", "--parallelism", "2", "--image", IMAGE),
    ("serve", "s3://bucket/m", "--k8s", "--no-preflight", "--not-sharded"),
    ("serve", "s3://bucket/m", "--k8s", "--no-preflight", "--not-sharded", "--identity", "eks-irsa",
     "--aws-role-arn", "arn:aws:iam::123456789012:role/vllm-reader", "--cluster", "prod"),
)  # fmt: skip


def documents(arguments: tuple[str, ...]) -> list[dict[str, Any]]:
    result = run_cli(*arguments)
    assert result.exit_code == 0, (arguments, result.stderr)
    return [document for document in yaml.safe_load_all(result.stdout) if document]


def test_every_core_kind_printed_is_valid_for_the_kubernetes_models() -> None:
    seen: set[tuple[str, str]] = set()
    for arguments in PRINTING_COMMANDS:
        for document in documents(arguments):
            key = (document["apiVersion"], document["kind"])
            if key in MODELS:
                check_with_models(document)
                seen.add(key)
    assert seen == set(MODELS)  # each kind the models know was printed by one of these commands
