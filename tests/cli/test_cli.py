"""The command line as a whole: start-up imports, completions, error mapping, exit codes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cli_helpers import run_cli

REPO = Path(__file__).resolve().parents[2]
HEAVY_MODULES = ("boto3", "botocore", "google", "azure", "huggingface_hub", "numpy", "torch")


def _imported_modules(*args: str) -> set[str]:
    completed = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "streamctl", *args],
        capture_output=True,
        text=True,
        check=True,
    )
    modules = set()
    for line in completed.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            modules.add(line.rsplit("|", 1)[1].strip())
    return modules


@pytest.mark.parametrize("args", [("--help",), ("verify-index", "--help")], ids=["top", "verify-index"])
def test_help_imports_no_cloud_sdk(args: tuple[str, ...]) -> None:
    modules = _imported_modules(*args)
    assert "typer" in modules  # the measurement itself works
    heavy = sorted(m for m in modules if m.split(".")[0] in HEAVY_MODULES)
    assert heavy == []


def test_version() -> None:
    from streamctl import __version__

    result = run_cli("--version")
    assert result.exit_code == 0
    assert result.stdout.strip() == f"streamctl {__version__}"


def test_committed_completions_are_current() -> None:
    from streamctl.app import command_group
    from streamctl.commands.completions import SCRIPTS

    group = command_group()
    stale = [name for name, render in SCRIPTS.items() if (REPO / "completions" / name).read_text() != render(group)]
    assert stale == [], "regenerate with: python -m streamctl.commands.completions completions/"


def test_bash_completion_completes_options_and_commands() -> None:
    script = REPO / "completions" / "streamctl.bash"

    def complete(*words: str) -> list[str]:
        words_literal = " ".join(f"'{word}'" for word in words)
        program = (
            f"source '{script}'; COMP_WORDS=({words_literal}); COMP_CWORD={len(words) - 1}; "
            '_streamctl; printf "%s\\n" "${COMPREPLY[@]}"'
        )
        completed = subprocess.run(["bash", "-c", program], capture_output=True, text=True, check=True)
        return completed.stdout.split()

    assert "verify-index" in complete("streamctl", "ver")
    assert complete("streamctl", "verify-index", "--exp") == ["--expect"]
    assert "--tensor-parallel-size" in complete("streamctl", "verify-index", "--ten")


def test_missing_local_checkpoint_is_not_found(tmp_path: Path) -> None:
    result = run_cli("verify-index", str(tmp_path / "nope"))
    assert result.exit_code == 3
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("error:")
    assert result.stdout == ""


@pytest.mark.parametrize(
    "location",
    ["ftp://bucket/model", "s3:///model", "s3://b/../x", "gs://UPPER_bad!/x"],
    ids=["scheme", "no-bucket", "dotdot", "bad-bucket"],
)
def test_bad_locations_are_usage_errors(location: str) -> None:
    result = run_cli("verify-index", location)
    assert result.exit_code == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert "error:" in result.stderr


def test_unknown_option_is_usage_error() -> None:
    result = run_cli("verify-index", ".", "--no-such-option")
    assert result.exit_code == 2
    assert "Traceback" not in result.stderr


def test_debug_shows_traceback(tmp_path: Path) -> None:
    quiet = run_cli("verify-index", str(tmp_path / "nope"))
    loud = run_cli("verify-index", str(tmp_path / "nope"), env={"STREAMCTL_DEBUG": "1"})
    assert "Traceback" not in quiet.stderr
    assert "Traceback" in loud.stderr
    assert loud.exit_code == quiet.exit_code == 3


def test_bad_expect_syntax_is_usage_error(tmp_path: Path) -> None:
    tmp_path.joinpath("x.safetensors").write_bytes(b"")
    result = run_cli("verify-index", str(tmp_path), "--expect", "no-equals-sign")
    assert result.exit_code == 2
    assert "--expect" in result.stderr or "GLOB=FILE" in result.stderr


@pytest.mark.parametrize("shell,name", [("zsh", "_streamctl"), ("fish", "streamctl.fish")])
def test_zsh_and_fish_scripts_parse(shell: str, name: str) -> None:
    import shutil

    if shutil.which(shell) is None:
        pytest.skip(f"{shell} is not installed (.ci/test installs it)")
    completed = subprocess.run([shell, "-n", str(REPO / "completions" / name)], capture_output=True, text=True)
    assert completed.returncode == 0, completed.stderr


def test_fish_completes_verify_index_options() -> None:
    import shutil

    if shutil.which("fish") is None:
        pytest.skip("fish is not installed (.ci/test installs it)")
    script = REPO / "completions" / "streamctl.fish"
    completed = subprocess.run(
        ["fish", "-c", f"source '{script}'; complete -C 'streamctl verify-index --ex'"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert completed.stdout.split("\t")[0] == "--expect"


def test_help_texts_survive_rich_rendering() -> None:
    """Typer renders help with Rich markup: a "[default: x]" in a help string silently vanishes from
    --help. Every help text is checked for square brackets Rich would take as a tag, and every command's
    description must come out as whole paragraphs (the docstring's line breaks are not kept)."""
    import re

    import typer.main

    from streamctl.app import app

    group = typer.main.get_command(app)
    assert sorted(group.commands) == ["serve", "shard", "transfer", "verify-index"]  # type: ignore[attr-defined]
    markup = re.compile(r"(?<!\\)\[[a-zA-Z/#@]")
    for name, command in group.commands.items():  # type: ignore[attr-defined]
        texts = {f"{name} description": command.help or ""}
        texts |= {f"{name} {param.name}": getattr(param, "help", None) or "" for param in command.params}
        for where, text in texts.items():
            assert not markup.search(text), f"{where}: {text!r}"
        paragraphs = (command.help or "").split("\n\n")
        assert all("\n" not in paragraph for paragraph in paragraphs), name
    result = run_cli("transfer", "--help", env={"COLUMNS": "200"})
    assert "Hugging Face repo type (default: model)." in result.stdout


@pytest.mark.parametrize("command", ["transfer", "shard"])
def test_the_hub_is_never_a_destination(tmp_path: Path, command: str) -> None:
    """Refused up front (exit 2, no request sent: HF_ENDPOINT points nowhere), not after a failed listing."""
    extra = ["-tp", "2"] if command == "shard" else []
    result = run_cli(command, str(tmp_path), "hf://org/model", *extra, env={"HF_ENDPOINT": "http://127.0.0.1:9"})
    assert result.exit_code == 2, result.stderr
    assert "read-only here; it can be a SOURCE, not a DEST" in result.stderr and "Traceback" not in result.stderr
