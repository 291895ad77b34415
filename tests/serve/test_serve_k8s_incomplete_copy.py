"""`serve` warns when its checkpoint is a `transfer --worker K/N` copy some of whose shares have not finished
(the pre-flight's `transfer-incomplete` finding), for a launch here and for `--k8s` alike."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli_helpers import run_cli
from streamctl.checkpoint.files import MANIFEST_NAME
from streamctl.demo import build_demo_checkpoint
from streamctl.storage import open_location


@pytest.fixture
def copied_model(tmp_path: Path) -> Path:
    """The demo model, copied by two `--worker` runs."""
    source = tmp_path / "source"
    build_demo_checkpoint(open_location(str(source)))
    dest = tmp_path / "copy"
    for worker in ("0/2", "1/2"):
        result = run_cli("transfer", str(source), str(dest), "--worker", worker, "--no-verify")
        assert result.exit_code == 0, result.stderr
    return dest


def _mark_share_unfinished(model: Path, index: int) -> None:
    """As if worker `index` had been evicted before it recorded its share."""
    manifest = json.loads((model / MANIFEST_NAME).read_text())
    manifest["workers"]["finished"].remove(index)
    manifest["complete"] = False
    (model / MANIFEST_NAME).write_text(json.dumps(manifest))


def test_serve_k8s_warns_on_a_copy_with_shares_still_to_run(copied_model: Path) -> None:
    complete = run_cli("serve", str(copied_model), "--k8s")
    assert complete.exit_code == 0, complete.stderr
    assert "not complete" not in complete.stderr
    _mark_share_unfinished(copied_model, 1)
    warned = run_cli("serve", str(copied_model), "--k8s")
    assert warned.exit_code == 0, warned.stderr
    line = " ".join(warned.stderr.split())
    assert "warning:" in line and "the copy here is not complete" in line and "--worker 1/2" in line
    here = run_cli("serve", str(copied_model), "--dry-run", "--json")  # a launch on this host says it too
    assert here.exit_code == 0, here.stderr
    warnings = json.loads(here.stdout)["warnings"]
    assert any("--worker 1/2" in warning for warning in warnings), warnings


def test_serve_k8s_shows_the_finding_when_the_copy_misses_files(tmp_path: Path) -> None:
    source = tmp_path / "source"
    build_demo_checkpoint(open_location(str(source)))
    dest = tmp_path / "copy"
    shares = {}
    for worker in ("0/2", "1/2"):
        plan = run_cli("transfer", str(source), str(dest), "--worker", worker, "--dry-run", "--json")
        shares[worker] = [item["path"] for item in json.loads(plan.stdout)["files"]]
    first = next(worker for worker, files in shares.items() if any(f.endswith(".safetensors") for f in files))
    assert run_cli("transfer", str(source), str(dest), "--worker", first, "--no-verify").exit_code == 0
    served = run_cli("serve", str(dest), "--k8s")
    assert "transfer-incomplete" in served.stderr + served.stdout, (served.stdout, served.stderr)
