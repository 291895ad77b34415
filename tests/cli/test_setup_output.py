"""Text output: binary units, counted nouns that agree, no rate for an instant step, no `@-` after local
names, transfer shows verify-index's warnings, and nothing wraps mid-value at 80 columns."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cli_helpers import run_cli
from streamctl.demo import build_demo_checkpoint
from streamctl.storage import open_location

SIZE = re.compile(r"\d+(?:\.\d)? (?:B|KiB|MiB|GiB|TiB)\b")
WRONG_AGREEMENT = re.compile(r"(?<![\d.,])1 (errors|warnings|files|tensors|requests|weight files|serving files)\b")
DECIMAL_UNITS = re.compile(r"\b\d+(?:\.\d+)? ?(?:kB|MB|GB|TB)(?:/s)?\b")


@pytest.fixture
def model(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    build_demo_checkpoint(open_location(str(folder)))
    return folder


def test_transfer_shows_verify_warnings_in_text_mode(model: Path, tmp_path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).unlink()
    result = run_cli("transfer", str(model), str(tmp_path / "out"))
    assert result.exit_code == 0, result.stderr
    assert "tokenizer-missing" in result.stdout  # as verify-index prints it, not only under --json
    assert "0 errors, 1 warning;" in result.stdout
    assert not WRONG_AGREEMENT.search(result.stdout)


def test_summaries_count_in_binary_units_and_agree_in_number(model: Path, tmp_path: Path) -> None:
    transfer = run_cli("transfer", str(model), str(tmp_path / "out"))
    shard = run_cli("shard", str(model), str(tmp_path / "tp1"), "-tp", "1")
    verify = run_cli("verify-index", str(tmp_path / "tp1"))
    for result in (transfer, shard, verify):
        assert result.exit_code == 0, result.stderr
        assert SIZE.search(result.stdout), result.stdout
        assert not DECIMAL_UNITS.search(result.stdout), result.stdout
        assert not WRONG_AGREEMENT.search(result.stdout), result.stdout
    assert "1 weight file and" in shard.stdout  # -tp 1: one file, said as one
    assert re.search(r"\b1 file, \d+ tensors", verify.stdout), verify.stdout


def test_no_rate_for_a_step_too_short_to_measure(model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert run_cli("transfer", str(model), str(out)).exit_code == 0
    again = run_cli("transfer", str(model), str(out))  # everything unchanged: nothing copied, ~0 s
    assert again.exit_code == 0, again.stderr
    done = next(line for line in again.stdout.splitlines() if line.startswith("done"))
    assert "0 B in" in done and "/s" not in done, done


def test_no_placeholder_commit_after_local_names(model: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    build_demo_checkpoint(open_location(str(other)))
    out = tmp_path / "out"
    assert run_cli("transfer", str(model), str(out)).exit_code == 0
    result = run_cli("transfer", str(other), str(out))
    assert result.exit_code == 2, result.stderr
    assert f"already holds {model}, not {other}" in result.stderr
    assert "@-" not in result.stderr
    plan = run_cli("transfer", str(model), str(tmp_path / "fresh"), "--dry-run")
    assert "@" not in plan.stdout.splitlines()[0]


def _run_in_terminal(args: list[str], columns: int) -> str:
    """stdout of streamctl on a terminal `columns` wide (a pty: Rich lays out for a terminal, not a pipe)."""
    import os
    import pty
    import subprocess
    import sys

    leader, follower = pty.openpty()
    env = {**os.environ, "COLUMNS": str(columns), "LINES": "50", "TERM": "dumb", "NO_COLOR": "1"}
    env.pop("STREAMCTL_DEBUG", None)
    process = subprocess.Popen([sys.executable, "-m", "streamctl", *args], stdout=follower,
                               stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, env=env)  # fmt: skip
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the child closed its end
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    process.wait(60)
    text = b"".join(chunks).decode("utf-8", "replace").replace("\r\n", "\n")
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)


def _values(text: str) -> set[str]:
    """Sizes and file names: what must never be split across two lines (rates differ run to run)."""
    return set(re.findall(SIZE.pattern + r"(?!/s)", text)) | set(
        re.findall(r"[\w.*{}-]+\.(?:safetensors|json)\b", text)
    )


@pytest.mark.parametrize("command", ["verify", "plan", "shard"])
def test_nothing_wraps_mid_value_at_80_columns(model: Path, tmp_path: Path, command: str) -> None:
    args = {
        "verify": ["verify-index", str(model), "-tp", "2"],  # findings: a wide table
        "plan": ["transfer", str(model), str(tmp_path / "out"), "--dry-run"],
        "shard": ["shard", str(model), str(tmp_path / "tp2"), "-tp", "2", "--force"],
    }[command]
    wide = run_cli(*args, env={"COLUMNS": "200"})
    narrow = _run_in_terminal(args, 80)
    piped = run_cli(*args, env={"COLUMNS": "80"})  # COLUMNS is honoured for a pipe too

    def steady(text: str) -> str:  # rates and timings differ run to run
        return re.sub(r"\d+\.\d+ s|\(\d+(\.\d)? \w+/s\)", "T", text.replace("\r", ""))

    assert steady(piped.stdout) == steady(narrow), (piped.stdout, narrow)
    lines = narrow.splitlines()
    # A line holding a path longer than the screen cannot fit; every other line must.
    too_wide = [line for line in lines if len(line) > 80 and str(tmp_path) not in line]
    assert too_wide == []
    values = _values(wide.stdout)
    assert values, wide.stdout  # the check has something to check
    split = sorted(value for value in values if not any(value in line for line in lines))
    assert split == [], narrow
