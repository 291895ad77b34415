"""`streamctl shard --engine vllm-cpu` on the pre-quantized formats people publish, judged by vLLM 0.34 itself:
FP8 block-quantized (DeepSeek-V3/R1, Qwen3-*-FP8: `weight_block_size`, `weight_scale_inv`), compressed-tensors
FP8 per tensor (static input scales) and per block, compressed-tensors W8A8 int8; and what is refused: MXFP4
(gpt-oss as published), int8 experts, a TP that cuts FP8 blocks.

The checkpoints are tiny models of those architectures written by transformers and quantized by
tests/vllm_oracle/quantize_fp8.py in the published layouts. This machine's CPU has no AMX tiles, so vLLM's
CPU FP8 block kernel refuses every layer: the worker builds them with the method's own `create_weights` and a
build-only kernel (streamctl/shard/engines/vllm_cpu/shims.py), which the result names. vLLM's own
ShardedStateLoader (tests/vllm_oracle/check_sharded.py, Run:ai streamer) then loads every rank's files into a
NaN-filled model: equal to vLLM's own load of the HF checkpoint; for the dense FP8 block model, what that loader
loaded also equals this file's own split of the source tensors and block scales (numpy). One worker and one
oracle process for the module's runs; skipped without STREAMCTL_VLLM_PYTHON.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cli_helpers import run_cli
from oracle import check_sharded_many, oracle_python, quantize_fp8, requires_vllm_oracle, write_tiny_hf_models
from shard_models import read_file
from streamctl.checkpoint.files import SHARD_MANIFEST_NAME
from streamctl.errors import StreamctlError
from streamctl.shard.plan import ShardOptions
from streamctl.shard.run import shard_checkpoint
from streamctl.storage import open_location
from vllm_cpu_helpers import SharedWorker

pytestmark = [requires_vllm_oracle, pytest.mark.timeout(900)]

FP8_BLOCK_KERNEL = "BuildOnlyFp8BlockScaledMMKernel"
# copy -> (tiny architecture, quantize_fp8.py kind). Blocks of 128 (the published size) where the model is
# wide enough for a TP 2 share of whole blocks (llama-wide: hidden 256), 16 on the 64-wide MoE models.
SOURCES: dict[str, tuple[str, str]] = {
    "llama-fp8-block": ("llama-wide", "block@128"),
    "qwen3-moe-fp8-block": ("qwen3-moe", "block@16"),
    "deepseek-v3-fp8-block": ("deepseek-v3", "block@16"),
    "llama-ct-tensor": ("llama-wide", "ct-tensor"),
    "llama-ct-block": ("llama-wide", "ct-block@128"),
    "llama-ct-int8": ("llama-wide", "ct-int8"),
    "mixtral-ct-tensor": ("mixtral", "ct-tensor"),
    "mixtral-ct-block": ("mixtral", "ct-block@16"),
    "llama-fp8-block256": ("llama-wide", "block@256"),  # TP 2 leaves o_proj an input of 128: half a block
    "llama-hd64-fp8-block": ("llama-wide-hd64", "block@128"),  # TP 2 leaves k and v 64 channels a rank
    "mixtral-ct-int8": ("mixtral", "ct-int8"),
    "gpt-oss-mxfp4": ("gpt-oss", "mxfp4"),
}
# (copy, TP, vLLM's name of the method, the build-only kernel expected)
CASES: list[tuple[str, int, str, bool]] = [
    ("llama-fp8-block", 1, "fp8", True),
    ("llama-fp8-block", 2, "fp8", True),
    ("qwen3-moe-fp8-block", 2, "fp8", True),
    ("deepseek-v3-fp8-block", 2, "fp8", True),
    ("llama-hd64-fp8-block", 1, "fp8", True),  # whole blocks at TP 1 (refused at TP 2: below)
    ("llama-ct-tensor", 2, "compressed-tensors", False),
    ("llama-ct-block", 2, "compressed-tensors", True),
    ("llama-ct-int8", 2, "compressed-tensors", False),
    ("mixtral-ct-tensor", 2, "compressed-tensors", False),
    ("mixtral-ct-block", 2, "compressed-tensors", True),
]
NUMPY_DTYPES = {"BF16": np.uint16, "F32": np.float32, "F8_E4M3": np.uint8, "I8": np.int8, "I64": np.int64}
FUSED = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "mlp.gate_up_proj": ("gate_proj", "up_proj")}
ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")


@dataclass
class Run:
    source: str
    tp: int
    dest: Path
    dump: Path
    result: dict[str, Any] | None = None
    error: str | None = None
    verdict: dict[str, Any] | None = None


@pytest.fixture(scope="module")
def hf_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = write_tiny_hf_models(tmp_path_factory.mktemp("quantized-hf"), sorted({a for a, _ in SOURCES.values()}))
    quantize_fp8([(root / architecture, root / copy, kind) for copy, (architecture, kind) in SOURCES.items()])
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
    out = tmp_path_factory.mktemp("quantized-out")
    done = {}
    for source, tp, _, _ in CASES:
        run = Run(source, tp, out / f"{source}-tp{tp}", out / f"{source}-tp{tp}-loaded")
        try:
            run.result = _shard(hf_root, source, run.dest, tp, shared_vllm_worker)
        except Exception as error:  # noqa: BLE001 - one failing case must not hide the others
            run.error = f"{type(error).__name__}: {error}"
        done[(source, tp)] = run
    written = [run for run in done.values() if run.error is None]
    verdicts = check_sharded_many(
        [
            {"hf_dir": hf_root / run.source, "sharded_dir": run.dest, "tp": run.tp, "dump_dir": run.dump}
            for run in written
        ]
    )
    for run, verdict in zip(written, verdicts, strict=True):
        run.verdict = verdict
    return done


def _written(runs: dict[tuple[str, int], Run], source: str, tp: int) -> Run:
    run = runs[(source, tp)]
    assert run.error is None, f"{source} TP {tp}: shard --engine vllm-cpu failed: {run.error}"
    assert run.result is not None
    return run


IDS = [f"{source}-tp{tp}" for source, tp, _, _ in CASES]


@pytest.mark.parametrize(("source", "tp", "method", "stand_in"), CASES, ids=IDS)
def test_shards_and_says_how(
    runs: dict[tuple[str, int], Run], source: str, tp: int, method: str, stand_in: bool
) -> None:
    """Written, the run's own checks passed (every tensor re-read, vLLM's loader on every rank), and the
    manifest and result name the method and whether the build-only FP8 block kernel was used."""
    run = _written(runs, source, tp)
    assert run.result is not None
    manifest = json.loads((run.dest / SHARD_MANIFEST_NAME).read_text())
    assert manifest["complete"] is True and manifest["quantization"] == method, (source, tp, manifest)
    assert (FP8_BLOCK_KERNEL in manifest["shims"]) is stand_in, (source, tp, manifest["shims"])
    assert (FP8_BLOCK_KERNEL in run.result["shims"]) is stand_in and run.result["quantization"] == method
    checks = run.result["checks"]
    assert checks["tensors"]["ok"] and checks["vllm_loader"]["ok"], json.dumps(checks)[:3000]


@pytest.mark.parametrize(("source", "tp", "method", "stand_in"), CASES, ids=IDS)
def test_vllm_loads_every_rank_equal_to_its_own_hf_load(
    runs: dict[tuple[str, int], Run], source: str, tp: int, method: str, stand_in: bool
) -> None:
    run = _written(runs, source, tp)
    assert run.verdict is not None
    bad = [rank for rank in run.verdict["ranks"] if not rank["ok"]]
    assert run.verdict["ok"], json.dumps({"error": run.verdict["error"], "ranks": bad})[:4000]
    assert len(run.verdict["ranks"]) == tp
    assert all(rank["tensors"] > 0 and rank["files"] for rank in run.verdict["ranks"])


def _arrays(path: Path) -> dict[str, np.ndarray]:
    return {
        name: np.frombuffer(data, NUMPY_DTYPES[dtype]).reshape(shape)
        for name, (dtype, shape, data) in read_file(path).items()
    }


def _share(array: np.ndarray, dim: int, parts: int, index: int) -> np.ndarray:
    return np.split(array, parts, axis=dim)[index]


def expected_rank(config: dict[str, Any], source: dict[str, np.ndarray], tp: int, rank: int) -> dict:
    """The rank's tensors from the checkpoint, split by this file's reading of vLLM's Llama: q/k/v fused into
    qkv_proj and gate/up into gate_up_proj along the output (dim 0), o_proj and down_proj along the input
    (dim 1), the FP8 weights and their [out / 128, in / 128] block scales alike (each share is whole blocks),
    the vocabulary by rows."""
    expected = {name: _share(source[name], 0, tp, rank) for name in ("model.embed_tokens.weight", "lm_head.weight")}
    expected["model.norm.weight"] = source["model.norm.weight"]
    for layer in range(int(config["num_hidden_layers"])):
        prefix = f"model.layers.{layer}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            expected[f"{prefix}{norm}.weight"] = source[f"{prefix}{norm}.weight"]
        for suffix in ("weight", "weight_scale_inv"):
            for fused, parts in FUSED.items():
                module = fused.split(".")[0]
                pieces = [_share(source[f"{prefix}{module}.{part}.{suffix}"], 0, tp, rank) for part in parts]
                expected[f"{prefix}{fused}.{suffix}"] = np.concatenate(pieces, axis=0)
            for row in ROW_PARALLEL:
                expected[f"{prefix}{row}.{suffix}"] = _share(source[f"{prefix}{row}.{suffix}"], 1, tp, rank)
    return expected


@pytest.mark.parametrize("tp", [1, 2])
def test_what_vllm_loaded_is_the_fp8_block_source_split(
    runs: dict[tuple[str, int], Run], hf_root: Path, tp: int
) -> None:
    """The tensors vLLM's ShardedStateLoader loaded from each rank's files equal the source FP8 weights and
    block scales split in whole [128, 128] blocks; what the checkpoint does not hold is the attention's own."""
    run = _written(runs, "llama-fp8-block", tp)
    config = json.loads((hf_root / "llama-fp8-block" / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    source = _arrays(hf_root / "llama-fp8-block" / "model.safetensors")
    for rank in range(tp):
        loaded = _arrays(run.dump / f"rank-0-{rank}.safetensors")
        expected = expected_rank(config, source, tp, rank)
        assert set(expected) <= set(loaded), sorted(set(expected) - set(loaded))
        for name, array in expected.items():
            assert loaded[name].dtype == array.dtype and loaded[name].shape == array.shape, (rank, name)
            assert np.array_equal(loaded[name], array), f"TP rank {rank}: {name} differs from the source split"
        rest = sorted(set(loaded) - set(expected))
        assert rest and all(".attn." in name for name in rest), rest


# --- what is refused, before anything is written ---------------------------------------------------------


def _refused(hf_root: Path, tmp_path: Path, shared: SharedWorker, source: str, tp: int) -> StreamctlError:
    dest = tmp_path / f"{source}-tp{tp}"
    with pytest.raises(StreamctlError) as raised:
        _shard(hf_root, source, dest, tp, shared)
    assert "\n" not in str(raised.value), raised.value
    assert not dest.exists() or not any(dest.iterdir())
    return raised.value


def test_a_tp_that_cuts_fp8_blocks_is_refused_naming_the_layer(
    hf_root: Path, tmp_path: Path, shared_vllm_worker: SharedWorker
) -> None:
    """Blocks of 256 at TP 2: o_proj's input share is 128, half a block; vLLM's validate_fp8_block_shape
    refuses it and the line adds the layer it was building and the rule."""
    error = _refused(hf_root, tmp_path, shared_vllm_worker, "llama-fp8-block256", 2)
    assert error.code == "bad-parallel-size", error
    message = str(error)
    for words in ("model.layers.0.self_attn.o_proj", "input_size_per_partition = 128", "block_k = 256", "input"):
        assert words in message, (words, message)


def test_a_fused_share_that_cuts_fp8_blocks_is_refused_where_vllm_does_not_check(
    hf_root: Path, tmp_path: Path, shared_vllm_worker: SharedWorker
) -> None:
    """Heads 64 wide in blocks of 128 at TP 2: each rank's k and v are 64 channels. vLLM 0.34 skips its
    block check for a fused weight whose parts are not whole blocks (allow_fp8_block_shape_mismatch), and its
    own load of this checkpoint then fails in the middle ("start (2) + length (1) exceeds dimension size
    (2)"): streamctl refuses before anything is written, naming the tensor, the shares and the rule."""
    error = _refused(hf_root, tmp_path, shared_vllm_worker, "llama-hd64-fp8-block", 2)
    assert error.code == "bad-parallel-size", error
    message = str(error)
    for words in ("model.layers.0.self_attn.qkv_proj.weight_scale_inv", "[128, 64, 64]", "multiple of 128"):
        assert words in message, (words, message)


def test_experts_whose_share_cuts_fp8_blocks_are_refused(
    hf_root: Path, tmp_path: Path, shared_vllm_worker: SharedWorker
) -> None:
    """Qwen3-MoE's experts (intermediate 32) in blocks of 16 at TP 4: 8 a rank, and no refined block of at
    least 32 divides it (vLLM 0.34's refine_fp8_moe_block_shape), so vLLM refuses; named."""
    error = _refused(hf_root, tmp_path, shared_vllm_worker, "qwen3-moe-fp8-block", 4)
    assert error.code == "bad-parallel-size", error
    assert "model.layers.0.mlp.experts" in str(error) and "block_n = 16" in str(error), error


def test_int8_experts_are_refused_naming_what_the_cpu_lacks(
    hf_root: Path, tmp_path: Path, shared_vllm_worker: SharedWorker
) -> None:
    error = _refused(hf_root, tmp_path, shared_vllm_worker, "mixtral-ct-int8", 2)
    assert error.code == "unsupported-quantization", error
    for words in ("Int8 MoE", "AMX", "No Int8 MoE backend supports"):
        assert words in str(error), (words, error)


def test_gpt_oss_mxfp4_is_refused_through_the_cli(hf_root: Path, tmp_path: Path) -> None:
    """MXFP4 as gpt-oss publishes it: exit 2, the --json error document naming why (the per-backend padding
    of the experts, and no CPU MXFP4 expert kernel), nothing written."""
    python = oracle_python()
    assert python is not None
    dest = tmp_path / "out"
    env = {"STREAMCTL_VLLM_PYTHON": python}
    result = run_cli("shard", str(hf_root / "gpt-oss-mxfp4"), str(dest), "-tp", "2", "--json", env=env, timeout=300)
    assert result.exit_code == 2, (result.exit_code, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    error = json.loads(result.stdout)["error"]
    assert (error["code"], error["exit_code"]) == ("unsupported-quantization", 2), error
    for words in ("MXFP4", "mxfp4_round_up_hidden_size_and_intermediate_size", "AMX", "--engine vllm-gpu"):
        assert words in error["message"], (words, error["message"])
    assert not dest.exists() or not any(dest.iterdir())
