"""The Run:ai Model Streamer 0.17 (the oracle venv; the reader behind vLLM's runai_streamer load formats) reads
every tensor of what `transfer` wrote into a bucket, straight from the bucket, byte for byte, with the storage
variables `serve` launches vLLM with.

The checkpoint has a file in several parts (an S3 multipart upload; composed part objects on GCS), a second
file, and an index. Azure is not here: the streamer builds https://ACCOUNT.blob.core.windows.net itself and
cannot reach Azurite. Skipped without STREAMCTL_VLLM_PYTHON.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cli_helpers import run_cli
from oracle import requires_vllm_oracle, stream_runai_many
from streamctl.checkpoint.safetensors import safetensors_bytes
from streamctl.serve.plan import ServeOptions, plan_launch

pytestmark = requires_vllm_oracle
MiB = 1024 * 1024


def two_file_checkpoint(folder: Path) -> dict[str, str]:
    """~11 MiB in two safetensors files (bf16, f32, i64) plus an index; tensor name -> sha256 of its bytes."""
    rng = np.random.default_rng(7)
    files = {
        "model-00001-of-00002.safetensors": [
            ("model.embed_tokens.weight", "BF16", [2048, 2560], rng.integers(0, 2**16, 2048 * 2560, dtype=np.uint16)),
            ("model.norm.weight", "F32", [2560], rng.standard_normal(2560, dtype=np.float32)),
        ],
        "model-00002-of-00002.safetensors": [
            ("lm_head.weight", "BF16", [256, 2560], rng.integers(0, 2**16, 256 * 2560, dtype=np.uint16)),
            ("model.position_ids", "I64", [64], np.arange(64, dtype=np.int64)),
        ],
    }
    folder.mkdir(parents=True)
    digests, weight_map = {}, {}
    for file, tensors in files.items():
        (folder / file).write_bytes(
            safetensors_bytes([(name, dtype, shape, data.tobytes()) for name, dtype, shape, data in tensors])
        )
        for name, _, _, data in tensors:
            digests[name] = hashlib.sha256(data.tobytes()).hexdigest()
            weight_map[name] = file
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    return digests


def streamer_env(root: str, storage_env: dict[str, str]) -> dict[str, str]:
    """What the streamer reads to reach the test's server: the variables `serve` would launch vLLM with."""
    launch = plan_launch(
        ServeOptions(root), None, sharded=False, environ=storage_env, cuda_available=False, host_memory_bytes=None
    )
    return {**storage_env, **launch.launch_env()}


@pytest.mark.parametrize("backend", ["s3", "gs"])
def test_the_streamer_reads_every_tensor_transfer_wrote_to_a_bucket(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    root = request.getfixturevalue(f"{backend}_root")
    storage_env = request.getfixturevalue("storage_env")
    digests = two_file_checkpoint(tmp_path / "model")
    done = run_cli("transfer", str(tmp_path / "model"), root, "--part-size", "5MiB", "--json", env=storage_env)
    assert done.exit_code == 0, done.stderr
    files = sorted(path.name for path in (tmp_path / "model").glob("*.safetensors"))
    jobs: list[dict[str, Any]] = [
        {"paths": [f"{root}/{name}" for name in files], "env": streamer_env(root, storage_env), "hash": True}
    ]
    verdict = stream_runai_many(jobs)[0]
    assert verdict["ok"], verdict
    assert verdict["sha256"] == digests
