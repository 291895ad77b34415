"""`serve` warns when its checkpoint is a `transfer --worker K/N` copy some of whose shares have not finished
(the pre-flight's `transfer-incomplete` finding), for a launch here and for `--k8s` alike (on a bucket:
a manifest's model is never local)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli_helpers import run_cli
from streamctl.checkpoint.files import MANIFEST_NAME
from streamctl.demo import build_demo_checkpoint
from streamctl.storage import open_location


@pytest.fixture
def source(tmp_path: Path) -> Path:
    folder = tmp_path / "source"
    build_demo_checkpoint(open_location(str(folder)))
    return folder


@pytest.fixture
def copied_model(source: Path, s3_root: str, storage_env: dict[str, str]) -> str:
    """The demo model, copied into a bucket by two `--worker` runs."""
    for worker in ("0/2", "1/2"):
        result = run_cli("transfer", str(source), s3_root, "--worker", worker, "--no-verify", env=storage_env)
        assert result.exit_code == 0, result.stderr
    return s3_root


def _mark_share_unfinished(model: str, index: int) -> None:
    """As if worker `index` had been evicted before it recorded its share."""
    location = open_location(model)
    key = location.key(MANIFEST_NAME)
    manifest = json.loads(location.store.read_versioned(key)[0])
    manifest["workers"]["finished"].remove(index)
    manifest["complete"] = False
    location.store.put(key, json.dumps(manifest).encode())


def test_serve_k8s_warns_on_a_copy_with_shares_still_to_run(copied_model: str, storage_env: dict[str, str]) -> None:
    complete = run_cli("serve", copied_model, "--k8s", env=storage_env)
    assert complete.exit_code == 0, complete.stderr
    assert "not complete" not in complete.stderr
    _mark_share_unfinished(copied_model, 1)
    warned = run_cli("serve", copied_model, "--k8s", env=storage_env)
    assert warned.exit_code == 0, warned.stderr
    line = " ".join(warned.stderr.split())
    assert "warning:" in line and "the copy here is not complete" in line and "--worker 1/2" in line
    here = run_cli("serve", copied_model, "--dry-run", "--json", env=storage_env)  # a launch on this host says it too
    assert here.exit_code == 0, here.stderr
    warnings = json.loads(here.stdout)["warnings"]
    assert any("--worker 1/2" in warning for warning in warnings), warnings


def test_serve_k8s_shows_the_finding_when_the_copy_misses_files(
    source: Path, s3_root: str, storage_env: dict[str, str]
) -> None:
    shares = {}
    for worker in ("0/2", "1/2"):
        plan = run_cli("transfer", str(source), s3_root, "--worker", worker, "--dry-run", "--json", env=storage_env)
        shares[worker] = [item["path"] for item in json.loads(plan.stdout)["files"]]
    first = next(worker for worker, files in shares.items() if any(f.endswith(".safetensors") for f in files))
    copied = run_cli("transfer", str(source), s3_root, "--worker", first, "--no-verify", env=storage_env)
    assert copied.exit_code == 0, copied.stderr
    served = run_cli("serve", s3_root, "--k8s", env=storage_env)
    assert "transfer-incomplete" in served.stderr + served.stdout, (served.stdout, served.stderr)
