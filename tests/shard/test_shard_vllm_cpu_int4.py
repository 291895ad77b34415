"""`streamctl shard --engine vllm-cpu` on int4 weight-only checkpoints: AWQ, GPTQ and compressed-tensors
pack-quantized (W4A16), judged by vLLM 0.33 itself.

The tiny Llama (tests/vllm_oracle/tiny_hf_models.py `llama-int4`, quantized by quantize_int4.py) has sizes
vLLM's CPU int4 kernel refuses ("Output size (80)", at TP 2 "(48) not supported by CPUWNA16": it wants every
rank's input and output a multiple of 32). The worker builds those layers with each method's own
`create_weights` and a build-only kernel (streamctl/shard/engines/vllm_cpu/shims.py), which the result names. vLLM's own
ShardedStateLoader (tests/vllm_oracle/check_sharded.py, Run:ai streamer) then loads every rank's files into a
NaN-filled model: equal to vLLM's own load of the HF checkpoint, and, read back from what that loader
loaded, equal to this file's own split of the source tensors (numpy, the methods' published layouts). Sizes
no loader can split (a group size that does not divide a rank's input) are refused before anything is
written. One worker for the module's runs; skipped without STREAMCTL_VLLM_PYTHON.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cli_helpers import run_cli
from oracle import check_sharded_many, oracle_python, quantize_int4, requires_vllm_oracle, write_tiny_hf_models
from shard_models import read_file
from streamctl.checkpoint.files import SHARD_MANIFEST_NAME
from streamctl.errors import StreamctlError
from streamctl.shard.plan import ShardOptions
from streamctl.shard.run import shard_checkpoint
from streamctl.storage import open_location
from vllm_cpu_helpers import SharedWorker

pytestmark = [requires_vllm_oracle, pytest.mark.timeout(900)]

SOURCE = "llama-int4"
METHODS = ("awq", "gptq", "ct")
CASES = [(method, tp) for method in METHODS for tp in (1, 2)]
# Groups of 64 over o_proj's and down_proj's 64 inputs: TP 2 leaves each rank 32, half a group.
UNSPLITTABLE = {f"{method}-g64": f"{method}@64" for method in METHODS}
STAND_IN = "BuildOnlyWNA16LinearKernel"
NUMPY_DTYPES = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32, "I32": np.int32, "I64": np.int64}

# Per method: quantized tensor suffix -> (input dim, output dim) of the checkpoint's tensor; both split in
# whole elements (int32 words where packed): the published layouts (AutoAWQ GEMM, AutoGPTQ, compressed-tensors).
LAYOUTS: dict[str, dict[str, tuple[int, int]]] = {
    "awq": {"qweight": (0, 1), "qzeros": (0, 1), "scales": (0, 1)},
    "gptq": {"qweight": (0, 1), "scales": (0, 1), "qzeros": (0, 1)},
    "ct": {"weight_packed": (1, 0), "weight_scale": (1, 0)},
}
FUSED = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "mlp.gate_up_proj": ("gate_proj", "up_proj")}
ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")


@dataclass
class Run:
    method: str
    tp: int
    dest: Path
    dump: Path
    result: dict[str, Any] | None = None
    error: str | None = None
    verdict: dict[str, Any] | None = None


@pytest.fixture(scope="module")
def hf_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = write_tiny_hf_models(tmp_path_factory.mktemp("int4-hf"), [SOURCE])
    jobs = [(root / SOURCE, root / method, method) for method in METHODS]
    quantize_int4(jobs + [(root / SOURCE, root / name, kind) for name, kind in UNSPLITTABLE.items()])
    return root


def _shard(hf_root: Path, name: str, dest: Path, tp: int, shared: SharedWorker) -> dict[str, Any]:
    options = ShardOptions(tensor_parallel_size=tp, engine="vllm-cpu", vllm_python=shared.python)
    source, target = open_location(str(hf_root / name)), open_location(str(dest))
    return shard_checkpoint(source, target, options, worker=shared.get()).to_json()


@pytest.fixture(scope="module")
def runs(
    hf_root: Path, tmp_path_factory: pytest.TempPathFactory, shared_vllm_worker: SharedWorker
) -> dict[tuple[str, int], Run]:
    """Every case sharded through the one worker, then every written one judged by one check_sharded.py."""
    out = tmp_path_factory.mktemp("int4-out")
    done = {}
    for method, tp in CASES:
        run = Run(method, tp, out / f"{method}-tp{tp}", out / f"{method}-tp{tp}-loaded")
        try:
            run.result = _shard(hf_root, method, run.dest, tp, shared_vllm_worker)
        except Exception as error:  # noqa: BLE001 - one failing case must not hide the others
            run.error = f"{type(error).__name__}: {error}"
        done[(method, tp)] = run
    written = [run for run in done.values() if run.error is None]
    verdicts = check_sharded_many(
        [
            {"hf_dir": hf_root / run.method, "sharded_dir": run.dest, "tp": run.tp, "dump_dir": run.dump}
            for run in written
        ]
    )
    for run, verdict in zip(written, verdicts, strict=True):
        run.verdict = verdict
    return done


def _written(runs: dict[tuple[str, int], Run], method: str, tp: int) -> Run:
    run = runs[(method, tp)]
    assert run.error is None, f"{method} TP {tp}: shard --engine vllm-cpu failed: {run.error}"
    assert run.result is not None
    return run


def _arrays(path: Path) -> dict[str, np.ndarray]:
    return {
        name: np.frombuffer(data, NUMPY_DTYPES[dtype]).reshape(shape)
        for name, (dtype, shape, data) in read_file(path).items()
    }


def _share(array: np.ndarray, dim: int, parts: int, index: int) -> np.ndarray:
    return np.split(array, parts, axis=dim)[index]


def expected_rank(config: dict[str, Any], source: dict[str, np.ndarray], method: str, tp: int, rank: int) -> dict:
    """Every tensor of the rank that comes from the checkpoint, split by this file's reading of vLLM's Llama:
    q/k/v fused into qkv_proj and gate/up into gate_up_proj along the output dim (a KV head replicated when
    TP exceeds the KV heads), o_proj and down_proj split along the input dim, the vocabulary split by rows."""
    kv_heads = int(config["num_key_value_heads"])
    expected = {}
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        expected[name] = _share(source[name], 0, tp, rank)  # 128 rows: a multiple of 64, no padding
    expected["model.norm.weight"] = source["model.norm.weight"]
    for layer in range(int(config["num_hidden_layers"])):
        prefix = f"model.layers.{layer}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            expected[f"{prefix}{norm}.weight"] = source[f"{prefix}{norm}.weight"]
        for suffix, (input_dim, output_dim) in LAYOUTS[method].items():
            for fused, parts in FUSED.items():
                module = fused.split(".")[0]
                pieces = []
                for part in parts:
                    array = source[f"{prefix}{module}.{part}.{suffix}"]
                    if part in ("k_proj", "v_proj") and tp > kv_heads:
                        pieces.append(_share(array, output_dim, kv_heads, rank * kv_heads // tp))
                    else:
                        pieces.append(_share(array, output_dim, tp, rank))
                expected[f"{prefix}{fused}.{suffix}"] = np.concatenate(pieces, axis=output_dim)
            for row in ROW_PARALLEL:
                expected[f"{prefix}{row}.{suffix}"] = _share(source[f"{prefix}{row}.{suffix}"], input_dim, tp, rank)
    return expected


CPU_KERNEL_VERDICT = """
import json, torch
from vllm.model_executor.kernels.linear import CPUWNA16LinearKernel, MPLinearLayerConfig
from vllm.scalar_type import scalar_types
verdicts = {}
for tp, shape in ((1, (64, 80)), (2, (64, 48))):  # qkv_proj's (input, output) on a rank
    config = MPLinearLayerConfig(full_weight_shape=(64, 80), partition_weight_shape=shape, group_size=32,
                                 weight_type=scalar_types.uint4b8, act_type=torch.bfloat16, zero_points=False)
    verdicts[tp] = CPUWNA16LinearKernel.can_implement(config)
print(json.dumps(verdicts))
"""


def test_vllm_cpu_kernel_refuses_these_sizes() -> None:
    """Why the stand-in is needed: vLLM's own CPU int4 kernel refuses qkv_proj at TP 1 and TP 2."""
    python = oracle_python()
    assert python is not None
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_LOGGING_LEVEL": "ERROR"}
    done = subprocess.run(
        [python, "-c", CPU_KERNEL_VERDICT], capture_output=True, text=True, timeout=300, env=env, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    verdicts = json.loads(done.stdout.strip().splitlines()[-1])
    assert verdicts["1"] == [False, "Output size (80) not supported by CPUWNA16, supported sizes are multiples of 32"]
    assert verdicts["2"][0] is False and "Output size (48) not supported by CPUWNA16" in verdicts["2"][1]


def test_cpu_int4_sizes_shard_through_the_build_only_kernel(runs: dict[tuple[str, int], Run]) -> None:
    """vLLM's CPU kernel refuses these sizes; the run builds them anyway and says how (result and manifest)."""
    for method, tp in CASES:
        run = _written(runs, method, tp)
        assert run.result is not None
        quantization = {"awq": "awq", "gptq": "auto_gptq", "ct": "compressed-tensors"}[method]  # vLLM's name
        manifest = json.loads((run.dest / SHARD_MANIFEST_NAME).read_text())
        assert manifest["complete"] is True and manifest["quantization"] == quantization, (method, tp)
        assert STAND_IN in manifest["shims"], (method, tp, manifest["shims"])
        assert (manifest["engine"], manifest["tensor_parallel_size"]) == ("vllm-cpu", tp)
        assert STAND_IN in run.result["shims"] and run.result["quantization"] == quantization
        checks = run.result["checks"]  # the run's own: every tensor re-read, vLLM's loader on every rank
        assert checks["tensors"]["ok"] and checks["vllm_loader"]["ok"], json.dumps(checks)[:3000]


@pytest.mark.parametrize(("method", "tp"), CASES, ids=[f"{m}-tp{tp}" for m, tp in CASES])
def test_vllm_loads_every_rank_equal_to_its_own_hf_load(runs: dict[tuple[str, int], Run], method: str, tp: int) -> None:
    run = _written(runs, method, tp)
    assert run.verdict is not None
    bad = [rank for rank in run.verdict["ranks"] if not rank["ok"]]
    assert run.verdict["ok"], json.dumps({"error": run.verdict["error"], "ranks": bad})[:4000]
    assert len(run.verdict["ranks"]) == tp
    assert all(rank["tensors"] > 0 and rank["files"] for rank in run.verdict["ranks"])


@pytest.mark.parametrize(("method", "tp"), CASES, ids=[f"{m}-tp{tp}" for m, tp in CASES])
def test_what_vllm_loaded_is_the_source_split(
    runs: dict[tuple[str, int], Run], hf_root: Path, method: str, tp: int
) -> None:
    """The tensors vLLM's ShardedStateLoader loaded from each rank's files equal the source tensors split as
    the method's layout says; what the checkpoint does not hold is only the attention's own (its scales)."""
    run = _written(runs, method, tp)
    config = json.loads((hf_root / method / "config.json").read_text())
    source = _arrays(hf_root / method / "model.safetensors")
    for rank in range(tp):
        loaded = _arrays(run.dump / f"rank-0-{rank}.safetensors")
        expected = expected_rank(config, source, method, tp, rank)
        assert set(expected) <= set(loaded), sorted(set(expected) - set(loaded))
        for name, array in expected.items():
            assert loaded[name].dtype == array.dtype and loaded[name].shape == array.shape, (rank, name)
            assert np.array_equal(loaded[name], array), f"TP rank {rank}: {name} differs from the source split"
        rest = sorted(set(loaded) - set(expected))
        shapes = sorted(name for name in rest if name.endswith(".weight_shape"))
        assert all(".attn." in name for name in rest if name not in shapes), rest
        packed = [name for name in expected if name.endswith(".weight_packed")]  # compressed-tensors' layers
        assert shapes == sorted(name.replace("weight_packed", "weight_shape") for name in packed)
        for name in shapes:  # compressed-tensors: the unpacked [out, in] of a checkpoint weight of the layer
            module = name.removesuffix(".weight_shape")
            fused = next((parts for key, parts in FUSED.items() if module.endswith(key)), None)
            layer_prefix = module.rsplit(".", 1)[0]
            candidates = [source[f"{layer_prefix}.{part}.weight_shape"] for part in fused] if fused else [source[name]]
            assert any(np.array_equal(loaded[name], shape) for shape in candidates), (name, loaded[name])


# --- sizes no loader can split -----------------------------------------------------------------------------


def test_a_group_size_that_does_not_divide_a_rank_input_is_refused(hf_root: Path, tmp_path: Path) -> None:
    """GPTQ groups of 64 at TP 2: o_proj's 64 inputs give each rank 32, half a group (vLLM's GPTQ would load
    the wrong scale rows without a word). Exit 2, one `error:` line naming the tensor, the sizes and the rule,
    nothing written."""
    python = oracle_python()
    assert python is not None
    dest = tmp_path / "out"
    result = run_cli(
        "shard", str(hf_root / "gptq-g64"), str(dest), "-tp", "2", env={"STREAMCTL_VLLM_PYTHON": python}, timeout=300
    )
    assert result.exit_code == 2, (result.exit_code, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.stderr[-3000:]
    for words in ("model.layers.0.self_attn.o_proj.scales", "TP 2", "32 of the 64 input channels", "groups of 64"):
        assert words in lines[0], (words, lines[0])
    assert "must be a multiple of 64" in lines[0], lines[0]
    assert not dest.exists() or not any(dest.iterdir())


@pytest.mark.parametrize("method", ["awq", "ct"])
def test_every_method_refuses_a_group_a_rank_splits(
    hf_root: Path, tmp_path: Path, shared_vllm_worker: SharedWorker, method: str
) -> None:
    """AWQ (streamctl's check: vLLM's AWQ would silently load the wrong groups) and compressed-tensors (vLLM's
    own verify_group_size_divides_partition) refuse groups of 64 at TP 2 as a bad parallel size."""
    dest = tmp_path / "out"
    with pytest.raises(StreamctlError) as raised:
        _shard(hf_root, f"{method}-g64", dest, 2, shared_vllm_worker)
    assert raised.value.code == "bad-parallel-size", raised.value
    message = str(raised.value)
    assert "\n" not in message and "o_proj" in message and "64" in message and "32" in message, message
    assert not dest.exists() or not any(dest.iterdir())
    whole = _shard(hf_root, f"{method}-g64", tmp_path / "tp1", 1, shared_vllm_worker)  # TP 1: nothing to split
    assert whole["checks"]["vllm_loader"]["ok"] and whole["tensor_parallel_size"] == 1
