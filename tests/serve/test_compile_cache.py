"""`serve --k8s` keeps vLLM's compile caches on a volume: torch.compile's graphs and the config and tokenizer
vLLM mirrors from a bucket (VLLM_CACHE_ROOT), Inductor's kernels (TORCHINDUCTOR_CACHE_DIR) and Triton's
(TRITON_CACHE_DIR) all point into it. An emptyDir by default (a restarted container skips compiling),
`--compile-cache-pvc CLAIM` for a PersistentVolumeClaim (a new pod does too)."""

from __future__ import annotations

import posixpath
from typing import Any

import pytest
import yaml

from cli_helpers import run_cli
from kube_models import check_with_models

SERVE = ("serve", "s3://models/llama", "--no-preflight", "--not-sharded", "--k8s")
NO_ENDPOINT = {"AWS_ENDPOINT_URL": ""}
CACHE_VARIABLES = ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


def _pod(*extra: str) -> dict[str, Any]:
    result = run_cli(*SERVE, *extra, env=NO_ENDPOINT)
    assert result.exit_code == 0, result.stderr
    documents = list(yaml.safe_load_all(result.stdout))
    for document in documents:
        check_with_models(document)
    return documents[0]["spec"]["template"]["spec"]


def _cache(pod: dict[str, Any]) -> tuple[dict[str, Any], str, dict[str, str]]:
    """(the cache volume, where the container mounts it, the container's cache variables)."""
    container = pod["containers"][0]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] != "/dev/shm"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    env = {item["name"]: item["value"] for item in container["env"] if item["name"] in CACHE_VARIABLES}
    return volume, mount["mountPath"], env


@pytest.mark.parametrize(
    ("extra", "kind"), [((), "emptyDir"), (("--compile-cache-pvc", "vllm-cache"), "persistentVolumeClaim")]
)
def test_the_compile_caches_live_on_a_volume(extra: tuple[str, ...], kind: str) -> None:
    volume, path, env = _cache(_pod(*extra))
    assert kind in volume
    if kind == "persistentVolumeClaim":
        assert volume["persistentVolumeClaim"] == {"claimName": "vllm-cache"}
    assert sorted(env) == sorted(CACHE_VARIABLES)
    for name, value in env.items():  # each a folder of its own inside the mount
        assert posixpath.commonpath([value, path]) == path and value != path, (name, value)
    assert len(set(env.values())) == len(env)


def test_a_bad_claim_name_is_refused() -> None:
    result = run_cli(*SERVE, "--compile-cache-pvc", "Cache_1", env=NO_ENDPOINT)
    assert result.exit_code == 2 and result.stdout == ""
    assert "--compile-cache-pvc 'Cache_1' is not a valid PersistentVolumeClaim name" in result.stderr


def test_the_claim_needs_k8s() -> None:
    result = run_cli("serve", "s3://models/llama", "--no-preflight", "--dry-run", "--compile-cache-pvc", "c")
    assert result.exit_code == 2
    assert "--compile-cache-pvc applies only with --k8s" in result.stderr
