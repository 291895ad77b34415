"""Helpers of the `shard --worker K/N` tests (tests/shard/test_shard_workers*.py, tests/cli/test_k8s_shard_job.py):
DEST's files read whole, the comparison of a split's files with one run's, worker processes started at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from streamctl.checkpoint.files import SHARD_MANIFEST_NAME
from streamctl.dest.manifests import ShardManifest, parse_manifest
from streamctl.storage.base import Location

# What differs between one run's manifest and a split's: when it was written, and the split's record.
RUN_FIELDS = ("created", "started", "workers")


def contents(location: Location) -> dict[str, bytes]:
    """Every file of DEST (relative name -> bytes)."""
    return {location.relative(info.key): location.store.read_range(info.key, 0, info.size) for info in location.list()}


def manifest_of(files: dict[str, bytes]) -> dict[str, Any]:
    document: dict[str, Any] = json.loads(files[SHARD_MANIFEST_NAME])
    return {key: value for key, value in document.items() if key not in RUN_FIELDS}


def shard_manifest(location: Location) -> ShardManifest:
    key = location.key(SHARD_MANIFEST_NAME)
    manifest = parse_manifest(ShardManifest, location.store.read_range(key, 0, location.store.stat(key).size))
    assert manifest is not None
    return manifest


def assert_same_as_one_run(split: dict[str, bytes], whole: dict[str, bytes]) -> None:
    assert sorted(split) == sorted(whole)
    for name, body in whole.items():
        if name != SHARD_MANIFEST_NAME:
            assert split[name] == body, name
    assert manifest_of(split) == manifest_of(whole)


def _start(argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "streamctl", *argv],
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
    )


def run_together(argvs: list[list[str]], env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """The commands as processes started at once; each one's --json document (all must exit 0)."""
    processes = [_start(argv, env) for argv in argvs]
    documents = []
    for process in processes:
        out, err = process.communicate(timeout=600)
        assert process.returncode == 0, err
        documents.append(json.loads(out))
    return documents
