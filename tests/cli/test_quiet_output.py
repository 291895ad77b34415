"""--quiet prints the result alone on stdout (the DEST written, what a dry run would copy, the
command line asked for, nothing for a check) and only what failed on stderr, for every command, by one rule
(output.QUIET_RENDERERS); and a report written to a pipe fits 80 columns or becomes one line per row."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cli_helpers import run_cli
from streamctl import output
from streamctl.demo import build_demo_checkpoint
from streamctl.storage import open_location

BOX = re.compile(r"[│┃━─┏┓┗┛┡┩└┘]")


@pytest.fixture(autouse=True)
def no_width(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pipe as CI and scripts have it: no COLUMNS."""
    monkeypatch.delenv("COLUMNS", raising=False)


@pytest.fixture
def model(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    build_demo_checkpoint(open_location(str(folder)))
    return folder


def test_every_result_has_a_quiet_form() -> None:
    assert output.QUIET_RENDERERS.keys() == output.RENDERERS.keys()


@pytest.mark.parametrize("before", [False, True], ids=["after", "before-the-command"])
def test_quiet_prints_the_result_alone(model: Path, tmp_path: Path, before: bool) -> None:
    def quiet(*arguments: str) -> tuple[int, str, str]:
        command, *rest = arguments
        typed = ["-q", command, *rest] if before else [command, *rest, "--quiet"]
        result = run_cli(*typed)
        return result.exit_code, result.stdout, result.stderr

    copy, sharded = tmp_path / "copy", tmp_path / "tp2"
    planned = sorted(path.name for path in model.iterdir())
    assert quiet("transfer", str(model), str(copy), "--dry-run") == (0, "".join(f"{n}\n" for n in planned), "")
    assert quiet("transfer", str(model), str(copy)) == (0, f"{copy}\n", "")
    assert quiet("transfer", str(model), str(copy)) == (0, f"{copy}\n", "")  # nothing to copy: the same answer
    assert quiet("shard", str(model), str(sharded), "-tp", "2") == (0, f"{sharded}\n", "")
    assert quiet("verify-index", str(sharded)) == (0, "", "")
    code, stdout, stderr = quiet("serve", str(model), "--no-preflight", "--not-sharded", "--dry-run")
    assert code == 0 and stderr == "" and stdout.startswith("vllm serve ") and stdout.count("\n") == 1, stdout


def test_quiet_failures_go_to_stderr(model: Path, tmp_path: Path) -> None:
    """A failed check: nothing on stdout (a check has no result but its verdict), its findings on stderr."""
    failed = run_cli("verify-index", str(model), "-tp", "2", "--quiet")
    assert failed.exit_code == 1 and failed.stdout == ""
    assert "sharded-rank-missing" in failed.stderr
    (model / "tokenizer.json").unlink()
    (model / "tokenizer_config.json").unlink()
    strict = run_cli("transfer", str(model), str(tmp_path / "copy"), "--quiet")  # a warning is no failure
    assert (strict.exit_code, strict.stdout, strict.stderr) == (0, f"{tmp_path / 'copy'}\n", "")
    missing = run_cli("shard", str(tmp_path / "nowhere"), str(tmp_path / "out"), "-tp", "2", "--quiet")
    assert missing.exit_code == 3 and missing.stdout == "" and "error:" in missing.stderr


def _rows(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.strip()]


@pytest.mark.parametrize("command", ["verify", "plan", "shard"])
def test_a_piped_report_fits_80_columns_or_is_one_line_per_row(model: Path, tmp_path: Path, command: str) -> None:
    args, row_parts = {
        "verify": (["verify-index", str(model), "-tp", "2"], [("sharded-rank-missing", "no file for TP rank")]),
        "plan": (["transfer", str(model), str(tmp_path / "out"), "--dry-run"],
                 [("copy", "KiB", "model-00001-of-00002.safetensors"), ("copy", "B", "config.json")]),
        "shard": (["shard", str(model), str(tmp_path / "tp2"), "-tp", "2"],
                  [("model-rank-0-part-0.safetensors", "KiB", "sha256"), ("model-rank-1-part-0", "KiB", "tensors")]),
    }[command]  # fmt: skip
    result = run_cli(*args)
    assert result.exit_code in (0, 1), result.stderr
    lines = _rows(result.stdout)
    drawn = [line for line in lines if BOX.search(line)]
    assert all(len(line) <= 80 for line in drawn), drawn
    for parts in row_parts:  # each row whole on one line, in a table or not
        assert any(all(part in line for part in parts) for line in lines), (parts, result.stdout)
    summary = [line for line in lines if line.startswith(("OK", "FAILED", "done", "checks:"))] or lines[-1:]
    assert all(not line.startswith("  ") for line in summary)  # a sentence is not broken in a pipe
