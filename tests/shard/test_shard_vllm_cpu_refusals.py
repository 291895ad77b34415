"""`streamctl shard` refusing, through the CLI, what the vllm-cpu engine cannot shard (issue 12): an FP8
block-quantized checkpoint (vLLM's CPU platform has no kernel for it), an architecture vLLM does not know, a
TP that does not divide the heads or the experts, a truncated shard, a corrupt header. Each: exit 2, one
`error:` line naming the problem (vLLM's own words where vLLM refused), no traceback, nothing written to
DEST. Tiny checkpoints are written by transformers itself, once per module. Skipped without
STREAMCTL_VLLM_PYTHON.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

from cli_helpers import CliResult, run_cli
from oracle import oracle_python, quantize_fp8, requires_vllm_oracle, write_tiny_hf_models

pytestmark = requires_vllm_oracle

WORKER_TIMEOUT_S = 240  # one CLI run: a worker start (vLLM's import, ~6-10 s) on 2 shared cores


@pytest.fixture(scope="module")
def hf_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = write_tiny_hf_models(tmp_path_factory.mktemp("hf"), ["llama-wide", "mixtral", "mixtral-odd"])
    # DeepSeek-V3's blocks of [128, 128]: a shape vLLM's CPU FP8 block kernel would accept, were it there
    quantize_fp8(root / "llama-wide", root / "llama-fp8-block", "block", block=128)
    return root


def _copy(hf_root: Path, kind: str, folder: Path) -> Path:
    shutil.copytree(hf_root / kind, folder)
    return folder


def _shard(source: Path, dest: Path, *args: str) -> CliResult:
    python = oracle_python()
    assert python is not None
    return run_cli(
        "shard", str(source), str(dest), *args, env={"STREAMCTL_VLLM_PYTHON": python}, timeout=WORKER_TIMEOUT_S
    )


def _refused(result: CliResult, dest: Path, *words: str) -> str:
    """Exit 2, exactly one `error:` line holding every word, no traceback, nothing in DEST; the line."""
    assert result.exit_code == 2, (result.exit_code, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.stderr[-3000:]
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert not dest.exists() or not any(dest.iterdir()), sorted(path.name for path in dest.rglob("*"))
    return lines[0]


def test_fp8_block_quantized_is_refused_naming_what_the_cpu_lacks(hf_root: Path, tmp_path: Path) -> None:
    """--engine auto picks vllm-cpu for a quantized checkpoint; vLLM's CPU platform cannot build the FP8
    block method (no AMX tiles here, and the CUDA wheel has no vllm._C fp8_scaled_mm_cpu)."""
    dest = tmp_path / "out"
    result = _shard(hf_root / "llama-fp8-block", dest, "-tp", "1", "--json")
    assert result.exit_code == 2, (result.exit_code, result.stderr[-3000:])
    document = json.loads(result.stdout)
    assert document["ok"] is False
    error = document["error"]
    assert (error["code"], error["exit_code"]) == ("unsupported-quantization", 2), error
    assert "\n" not in error["message"]
    assert "AMX" in error["message"] and "fp8_scaled_mm_cpu" in error["message"], error
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert not dest.exists() or not any(dest.iterdir())


def test_an_architecture_vllm_does_not_know(hf_root: Path, tmp_path: Path) -> None:
    source = _copy(hf_root, "mixtral", tmp_path / "hf")
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "architectures": ["FooForCausalLM"]}))
    result = _shard(source, tmp_path / "out", "-tp", "2")
    _refused(result, tmp_path / "out", "FooForCausalLM", "not supported")


def test_a_tp_that_does_not_divide_the_heads(hf_root: Path, tmp_path: Path) -> None:
    result = _shard(hf_root / "mixtral", tmp_path / "out", "-tp", "3")
    _refused(result, tmp_path / "out", "attention heads (4)", "tensor parallel size (3)")


def test_a_tp_that_does_not_divide_the_experts(hf_root: Path, tmp_path: Path) -> None:
    """mixtral-odd's experts have intermediate size 66: TP 4 cannot slice them (4 heads: the heads can)."""
    result = _shard(hf_root / "mixtral-odd", tmp_path / "out", "-tp", "4")
    _refused(result, tmp_path / "out", "66")


def test_an_ep_that_does_not_divide_the_experts(hf_root: Path, tmp_path: Path) -> None:
    """3 experts over EP 2: vLLM itself would give rank 0 two and rank 1 one (determine_expert_map), but
    vLLM's sharded-state files of one stage must hold the same tensors on every rank (shard's plan has one
    list of names and shapes per stage): refused before anything is written, naming the experts."""
    result = _shard(hf_root / "mixtral-odd", tmp_path / "out", "-tp", "2", "--enable-expert-parallel")
    _refused(result, tmp_path / "out", "3", "expert")


def test_a_truncated_shard(hf_root: Path, tmp_path: Path) -> None:
    source = _copy(hf_root, "mixtral", tmp_path / "hf")
    weights = source / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 1000])
    result = _shard(source, tmp_path / "out", "-tp", "2")
    _refused(result, tmp_path / "out", "model.safetensors")


def test_a_corrupt_header(hf_root: Path, tmp_path: Path) -> None:
    source = _copy(hf_root, "mixtral", tmp_path / "hf")
    weights = source / "model.safetensors"
    data = bytearray(weights.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    data[8 : 8 + length] = b"{" + b"\xff" * (length - 1)  # not JSON, same length: the data is untouched
    weights.write_bytes(bytes(data))
    result = _shard(source, tmp_path / "out", "-tp", "2")
    _refused(result, tmp_path / "out", "model.safetensors")
