"""Fixtures the locations tests share: a tiny checkpoint, and each bucket backend with its environment."""

from __future__ import annotations

from pathlib import Path

import pytest

from servers import StorageServers
from shard_models import write_model


@pytest.fixture
def model(tmp_path: Path) -> Path:
    write_model(tmp_path / "hf", "llama-gqa")
    return tmp_path / "hf"


@pytest.fixture(params=["s3", "gs", "az"])
def bucket_root(request: pytest.FixtureRequest) -> str:
    root: str = request.getfixturevalue(f"{request.param}_root")
    return root


@pytest.fixture
def env(bucket_root: str, storage_servers: StorageServers, _storage_session_env: dict[str, str]) -> dict[str, str]:
    return {**_storage_session_env, **storage_servers.env()}
