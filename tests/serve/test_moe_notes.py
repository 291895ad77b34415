"""A mixture of experts served without pre-sharded files: with TP > 1 every rank reads every expert, so serve's
plan suggests vLLM's --enable-ep-weight-filter (vLLM 0.33+, its default loader only, with
--enable-expert-parallel) or `streamctl shard --enable-expert-parallel`; asked for with the streamer's loader,
the filter is said to do nothing. The expert count is read from config.json as vLLM reads it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from checkpoints import write_sharded_checkpoint
from cli_helpers import run_cli
from streamctl.checkpoint.files import expert_count
from streamctl.demo import build_demo_checkpoint
from streamctl.storage import open_location

NO_HOST_GPU = {"CUDA_VISIBLE_DEVICES": ""}


@pytest.mark.parametrize(
    ("config", "experts"),
    [
        ({"model_type": "mixtral", "num_local_experts": 8}, 8),
        ({"model_type": "deepseek_v3", "n_routed_experts": 256, "num_experts_per_tok": 8}, 256),
        ({"model_type": "dbrx", "moe_num_experts": 16}, 16),
        ({"model_type": "qwen3_vl_moe", "text_config": {"num_experts": 128}}, 128),  # vLLM's hf_text_config
        ({"model_type": "ernie4_5_vl_moe", "moe_num_experts": [64, 64]}, 64),
        ({"model_type": "llama", "num_experts": 0}, 0),
        ({"model_type": "llama", "num_local_experts": True}, 0),  # a flag is no count
        ({"model_type": "llama"}, 0),
        ("not a config", 0),
    ],
)
def test_the_expert_count_is_read_as_vllm_reads_it(config: Any, experts: int) -> None:
    assert expert_count(config) == experts


@pytest.fixture
def moe_model(tmp_path: Path) -> Path:
    folder = tmp_path / "moe"
    build_demo_checkpoint(open_location(str(folder)))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_local_experts": 8}))
    return folder


def _plan(model: Path, *args: str) -> dict[str, Any]:
    result = run_cli("serve", str(model), "--json", *args, env=NO_HOST_GPU)
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.parametrize("preflight", ["--preflight", "--no-preflight"])
def test_an_moe_without_sharded_files_gets_both_ways(moe_model: Path, preflight: str) -> None:
    (note,) = _plan(moe_model, "-tp", "4", preflight)["notes"]
    assert "mixture of experts (8 per layer)" in note and "each of the 4 ranks reads every expert" in note
    assert "--enable-ep-weight-filter" in note and "default loader" in note and "vLLM 0.33" in note
    assert f"vllm serve {moe_model} --tensor-parallel-size 4 --enable-expert-parallel --enable-ep-weight-filter" in note
    assert f"streamctl shard {moe_model} {moe_model}-tp4-ep -tp 4 --enable-expert-parallel" in note


def test_no_note_where_it_would_not_help(moe_model: Path, tmp_path: Path) -> None:
    assert _plan(moe_model, "-tp", "1")["notes"] == []  # one rank reads everything anyway
    dense = tmp_path / "dense"
    build_demo_checkpoint(open_location(str(dense)))
    assert _plan(dense, "-tp", "4")["notes"] == []
    sharded = tmp_path / "sharded"
    write_sharded_checkpoint(open_location(str(sharded)), tp=2)
    config = {"model_type": "mixtral", "num_local_experts": 8}
    (sharded / "config.json").write_text(json.dumps(config))
    assert _plan(sharded, "-tp", "2", "--no-preflight")["notes"] == []  # each rank reads its own files already


def test_the_filter_asked_for_with_the_streamer_is_said_to_do_nothing(moe_model: Path) -> None:
    plan = _plan(moe_model, "-tp", "2", "--", "--enable-expert-parallel", "--enable-ep-weight-filter")
    assert any("--enable-ep-weight-filter applies to vLLM's default loader only" in w for w in plan["warnings"])
    assert plan["argv"][-1] == "--enable-ep-weight-filter"  # passed on unchanged


def test_the_note_is_printed_on_stderr(moe_model: Path) -> None:
    result = run_cli("serve", str(moe_model), "-tp", "2", "--dry-run", env=NO_HOST_GPU)
    assert result.exit_code == 0, result.stderr
    assert "note: " in result.stderr and "--enable-ep-weight-filter" in result.stderr
    assert "note:" not in result.stdout  # stdout stays the command line alone
    quiet = run_cli("serve", str(moe_model), "-tp", "2", "--dry-run", "--quiet", env=NO_HOST_GPU)
    assert "note:" not in quiet.stderr


def test_the_suggested_flags_are_vllm_033_serve_options() -> None:
    """VLLM_SERVE_OPTIONS is vLLM 0.33's serve parser (checked against it by test_vllm_secret_flags.py)."""
    from streamctl.serve.plan import EP_WEIGHT_FILTER, EXPERT_PARALLEL
    from streamctl.serve.vllm_args import VLLM_SERVE_OPTIONS

    assert {EP_WEIGHT_FILTER, EXPERT_PARALLEL} <= VLLM_SERVE_OPTIONS
