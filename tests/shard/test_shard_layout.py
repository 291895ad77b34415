"""`streamctl shard`: every rank's names, shapes and bytes as the spec says (checked by tests/shard_models.py's
independent reading), parts and file order, pipeline stages, name patterns, version rows and casts."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from shard_models import (
    NUMPY_DTYPES,
    ONE_F32,
    assert_rank_matches,
    expected_rank,
    rank_files,
    read_file,
    read_rank,
    shard,
    write_model,
)
from streamctl.checkpoint.files import SHARD_MANIFEST_NAME
from streamctl.checkpoint.safetensors import safetensors_bytes
from streamctl.checkpoint.vllm_layouts import LAYOUT_ROWS, layout_row, parse_version
from streamctl.errors import UsageError
from streamctl.shard.blocks import cast_bits
from streamctl.shard.plan import pipeline_stages

# ---------------------------------------------------------------------------------------------------
# Names, shapes and bytes per rank


@pytest.mark.parametrize(
    ("kind", "tp"),
    [
        ("llama-gqa", 1),
        ("llama-gqa", 2),
        ("llama-gqa", 4),  # nkv 2 < TP: KV heads replicated
        ("llama-gqa", 8),
        ("llama-mha", 2),  # nkv 8 > TP: KV heads partitioned
        ("llama-mha", 8),
        ("llama-tied", 2),
        ("llama-head-dim", 2),
        ("llama-bias", 2),
        ("mistral", 4),
        ("qwen2", 2),
        ("qwen2", 4),
        ("qwen3", 4),
    ],
)
def test_every_rank_holds_the_spec_names_shapes_and_bytes(tmp_path: Path, kind: str, tp: int) -> None:
    config, hf = write_model(tmp_path / "hf", kind)
    result = shard(tmp_path / "hf", tmp_path / "out", tensor_parallel_size=tp, vllm_version="0.33.0")
    assert result.ok and result.reconstruction is not None and result.reconstruction.ok
    assert_rank_matches(tmp_path / "out", config, hf, tp)
    names = [path.name for path in (tmp_path / "out").glob("*.safetensors")]
    assert sorted(names) == sorted(f"model-rank-{rank}-part-0.safetensors" for rank in range(tp))


def test_parts_follow_state_dict_order_and_file_layout_follows_safetensors(tmp_path: Path) -> None:
    config, hf = write_model(tmp_path / "hf", "llama-gqa")
    shard(tmp_path / "hf", tmp_path / "out", tensor_parallel_size=2, max_part_size=3000)
    for rank in range(2):
        expected = [name for name, _ in expected_rank(config, hf, 2, rank)]
        files = rank_files(tmp_path / "out", f"model-rank-{rank}-part-")
        assert len(files) > 3
        by_part = [list(read_file(path)) for path in files]
        # Concatenated in part order, every part's names in state-dict order = the state dict.
        assert [name for part in by_part for name in sorted(part, key=expected.index)] == expected
        for names in by_part:
            # Within a file: float32 first (descending dtype alignment), then by name, as safetensors writes.
            dtypes = [read_file(files[by_part.index(names)])[name][0] for name in names]
            assert names == sorted(names, key=lambda name: (dtypes[names.index(name)] != "F32", name))


def test_parts_split_at_max_part_size_and_an_oversized_tensor_goes_alone(tmp_path: Path) -> None:
    config, hf = write_model(tmp_path / "hf", "llama-gqa")
    limit = 3000
    shard(tmp_path / "hf", tmp_path / "out", tensor_parallel_size=1, max_part_size=limit)
    expected = expected_rank(config, hf, 1, 0)
    sizes = {name: array.nbytes for name, array in expected}
    # vLLM's rule, replayed: a new part when the next tensor would exceed the limit (never an empty part).
    parts: list[list[str]] = []
    total = 0
    for name, _ in expected:
        if not parts or (parts[-1] and total + sizes[name] > limit):
            parts.append([])
            total = 0
        parts[-1].append(name)
        total += sizes[name]
    files = rank_files(tmp_path / "out", "model-rank-0-part-")
    assert [sorted(read_file(path)) for path in files] == [sorted(part) for part in parts]
    assert any(len(part) == 1 and sizes[part[0]] > limit for part in parts)  # the 6400-byte embedding
    assert all(read_file(path) for path in files)
    assert_rank_matches(tmp_path / "out", config, hf, 1)


def test_files_are_byte_identical_to_the_safetensors_library(tmp_path: Path) -> None:
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    write_model(tmp_path / "hf", "qwen2", dtype="F16")
    shard(tmp_path / "hf", tmp_path / "out", tensor_parallel_size=2, max_part_size=4096)
    for path in (tmp_path / "out").glob("*.safetensors"):
        written = read_file(path)
        arrays = {
            name: np.frombuffer(data, NUMPY_DTYPES[dtype]).reshape(shape)
            for name, (dtype, shape, data) in written.items()
        }
        # What vLLM's save_file would write for the same state-dict part.
        assert path.read_bytes() == safetensors_numpy.save(arrays)
        loaded = safetensors_numpy.load_file(str(path))
        assert sorted(loaded) == sorted(arrays)
        assert all(np.array_equal(loaded[name], arrays[name]) for name in arrays)


def test_bf16_files_open_in_the_safetensors_library(tmp_path: Path) -> None:
    safetensors = pytest.importorskip("safetensors")
    write_model(tmp_path / "hf", "llama-gqa")
    shard(tmp_path / "hf", tmp_path / "out", tensor_parallel_size=4)
    for path in (tmp_path / "out").glob("*.safetensors"):
        with safetensors.safe_open(str(path), framework="numpy") as handle:  # header parse and checks
            assert sorted(handle.keys()) == sorted(read_file(path))


def test_tied_embedding_is_written_once_as_lm_head(tmp_path: Path) -> None:
    write_model(tmp_path / "hf", "llama-tied")
    shard(tmp_path / "hf", tmp_path / "out", tensor_parallel_size=2)
    names = [name for name, _ in read_rank(tmp_path / "out", 0)]
    assert "lm_head.weight" in names and "model.embed_tokens.weight" not in names


def test_tied_config_with_a_different_lm_head_in_the_checkpoint_is_refused(tmp_path: Path) -> None:
    config, _ = write_model(tmp_path / "hf", "llama-gqa", files=1)  # untied: it has its own lm_head
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    with pytest.raises(UsageError, match="lm_head.weight differs"):
        shard(tmp_path / "hf", tmp_path / "out", tensor_parallel_size=2)
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())  # aborted: nothing left


def test_tied_config_with_an_identical_lm_head_is_accepted(tmp_path: Path) -> None:
    _, hf = write_model(tmp_path / "hf", "llama-tied", files=1)
    hf["lm_head.weight"] = hf["model.embed_tokens.weight"]
    data = safetensors_bytes([(name, "BF16", array.shape, array.tobytes()) for name, array in hf.items()])
    (tmp_path / "hf" / "model-00001-of-00001.safetensors").write_bytes(data)
    index = {"weight_map": dict.fromkeys(hf, "model-00001-of-00001.safetensors")}
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(json.dumps(index))
    assert shard(tmp_path / "hf", tmp_path / "out", tensor_parallel_size=2).ok


# ---------------------------------------------------------------------------------------------------
# Pipeline parallelism


@pytest.mark.parametrize(
    ("kind", "layers", "pp", "tp"),
    [
        ("llama-gqa", 5, 2, 1),
        ("llama-gqa", 5, 3, 1),
        ("llama-gqa", 5, 2, 2),
        ("llama-gqa", 7, 3, 2),
        ("llama-tied", 3, 2, 2),
        ("qwen3", 5, 3, 2),
    ],
)
def test_pipeline_stages_split_layers_like_vllm(tmp_path: Path, kind: str, layers: int, pp: int, tp: int) -> None:
    config, hf = write_model(tmp_path / "hf", kind, num_hidden_layers=layers)
    result = shard(tmp_path / "hf", tmp_path / "out", tensor_parallel_size=tp, pipeline_parallel_size=pp)
    assert result.ok
    assert_rank_matches(tmp_path / "out", config, hf, tp, pp)
    assert result.plan.pattern == "model-pp-{pp_rank}-tp-{tp_rank}-part-{part}.safetensors"
    first = dict(read_rank(tmp_path / "out", 0, pp, 0))
    last = dict(read_rank(tmp_path / "out", 0, pp, pp - 1))
    assert "model.embed_tokens.weight" in first and "lm_head.weight" not in first
    assert "model.norm.weight" in last and "lm_head.weight" in last and "model.embed_tokens.weight" not in last


def test_get_pp_indices_and_the_partition_override() -> None:
    assert [list(stage) for stage in pipeline_stages(7, 3)] == [[0, 1], [2, 3, 4], [5, 6]]
    assert [list(stage) for stage in pipeline_stages(5, 3)] == [[0, 1], [2, 3], [4]]
    assert [list(stage) for stage in pipeline_stages(10, 4)] == [[0, 1], [2, 3, 4], [5, 6, 7], [8, 9]]
    assert [len(stage) for stage in pipeline_stages(7, 3, "1,1,5")] == [1, 1, 5]
    for bad in ("1,1", "1,x,5", "2,2,2"):
        with pytest.raises(UsageError, match="VLLM_PP_LAYER_PARTITION"):
            pipeline_stages(7, 3, bad)


def test_layer_partition_override_is_applied(tmp_path: Path) -> None:
    write_model(tmp_path / "hf", "llama-gqa", num_hidden_layers=5)
    shard(tmp_path / "hf", tmp_path / "out", tensor_parallel_size=1, pipeline_parallel_size=2, layer_partition="1,4")
    first = [name for name, _ in read_rank(tmp_path / "out", 0, 2, 0)]
    assert {name.split(".")[2] for name in first if name.startswith("model.layers.")} == {"0"}


# ---------------------------------------------------------------------------------------------------
# Patterns, versions, dtypes


def test_custom_patterns(tmp_path: Path) -> None:
    write_model(tmp_path / "hf", "llama-gqa", num_hidden_layers=4)
    shard(
        tmp_path / "hf",
        tmp_path / "tp",
        tensor_parallel_size=2,
        pattern="w-{rank}-{part}.safetensors",
        max_part_size=8000,
    )
    assert {path.name for path in (tmp_path / "tp").glob("*.safetensors")} >= {"w-0-0.safetensors", "w-1-1.safetensors"}
    shard(
        tmp_path / "hf",
        tmp_path / "pp",
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
        pattern="s{pp_rank}.r{tp_rank}.p{part}.safetensors",
    )
    assert {path.name for path in (tmp_path / "pp").glob("*.safetensors")} == {
        f"s{stage}.r{rank}.p0.safetensors" for stage in range(2) for rank in range(2)
    }


@pytest.mark.parametrize(
    ("version", "scales"), [("0.33.0", True), ("0.20.1", True), ("0.13.0", False), ("0.10.1.1", False)]
)
def test_version_rows_decide_the_scale_buffers(tmp_path: Path, version: str, scales: bool) -> None:
    config, hf = write_model(tmp_path / "hf", "llama-gqa")
    result = shard(tmp_path / "hf", tmp_path / "out", tensor_parallel_size=2, vllm_version=version)
    assert_rank_matches(tmp_path / "out", config, hf, 2, scales=scales)
    manifest = json.loads((tmp_path / "out" / SHARD_MANIFEST_NAME).read_text())
    assert manifest["layout"] == result.plan.row.label == layout_row(version).label


def test_version_table() -> None:
    assert parse_version("0.33.0+cu128") == (0, 33, 0) and parse_version("0.14.0rc1") == (0, 14, 0)
    assert layout_row("0.14.0").attention_scale_buffers and not layout_row("0.13.0").attention_scale_buffers
    assert layout_row("0.32.0").pipeline_parallel and not layout_row("0.31.0").pipeline_parallel
    assert layout_row(None) in LAYOUT_ROWS
    with pytest.raises(UsageError, match="no sharded-state layout"):
        layout_row("0.9.2")


def f32_to_bf16_reference(value: float) -> int:
    """Round to nearest even, by hand, on the integer bits."""
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    if (bits & 0x7F800000) == 0x7F800000 and bits & 0x007FFFFF:
        return None  # NaN: only NaN-ness is required
    upper, lower = bits >> 16, bits & 0xFFFF
    if lower > 0x8000 or (lower == 0x8000 and upper & 1):
        upper += 1
    return upper & 0xFFFF


def test_casts_round_to_nearest_even_and_keep_nan() -> None:
    values = np.array(
        [
            0.0,
            -0.0,
            1.0,
            1.00390625,
            1.005859375,
            1.0029296875,
            3.4e38,
            -3.4e38,
            1e-40,
            np.inf,
            -np.inf,
            np.nan,
            65504.0,
            70000.0,
        ],
        np.float32,
    )
    extra = np.random.default_rng(1).standard_normal(10_000).astype(np.float32) * 1000
    for array in (values, extra):
        bf16 = cast_bits(array.view(np.uint32), "F32", "BF16")
        for value, got in zip(array.tolist(), bf16.tolist(), strict=False):
            expected = f32_to_bf16_reference(value)
            if expected is None:
                assert (got & 0x7F80) == 0x7F80 and got & 0x7F, "NaN must stay NaN"
            else:
                assert got == expected, value
    # The payload of this NaN sits in the low half: plain truncation would turn it into infinity.
    low_nan = np.array([0x7F800001], np.uint32)
    assert cast_bits(low_nan, "F32", "BF16")[0] & 0x7F
    # BF16 -> F32 is exact; F16 <-> F32 follows IEEE (numpy); BF16 -> F16 rounds once.
    bf16 = cast_bits(values.view(np.uint32), "F32", "BF16")
    back = cast_bits(bf16, "BF16", "F32").view(np.float32)
    assert np.array_equal(cast_bits(back.view(np.uint32), "F32", "BF16"), bf16)
    f16 = cast_bits(bf16, "BF16", "F16").view(np.float16)
    with np.errstate(over="ignore"):
        assert np.array_equal(f16, back.astype(np.float16), equal_nan=True)
    assert np.isnan(f16[11]) and np.isinf(f16[13])


def test_dtype_cast_writes_cast_tensors(tmp_path: Path) -> None:
    config, hf = write_model(tmp_path / "hf", "qwen2")
    result = shard(tmp_path / "hf", tmp_path / "out", tensor_parallel_size=2, dtype="float16")
    assert result.reconstruction is not None and result.reconstruction.ok
    as_f16 = {name: (array.astype(np.uint32) << 16).view(np.float32).astype(np.float16) for name, array in hf.items()}
    assert_rank_matches(tmp_path / "out", config, as_f16, 2)
    written = dict(read_rank(tmp_path / "out", 0))
    assert written["model.layers.0.self_attn.attn._k_scale"] == ("F32", (), ONE_F32)
