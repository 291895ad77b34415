"""Every command's --help at 80 columns: readable, complete, ends with examples, and cheap to start."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from cli_helpers import run_cli

COMMANDS = ("", "transfer", "verify-index", "shard", "serve")
# Imported by Typer's own help renderer (rich.markdown, rich.traceback) or by its pydantic coercion of an
# unset --help; together ~100 ms of a 180 ms `--help`. None of them is needed to print help.
HEAVY_AT_HELP = (
    "pydantic",
    "pydantic_core",
    "rich.markdown",
    "markdown_it",
    "rich.traceback",
    "rich.syntax",
    "typer.rich_utils",
)
CLOUD_AND_NUMERIC = ("boto3", "botocore", "google", "azure", "huggingface_hub", "numpy", "torch")


def _help(command: str, columns: int = 80) -> str:
    result = run_cli(*([command] if command else []), "--help", env={"COLUMNS": str(columns)})
    assert result.exit_code == 0, result.stderr
    return result.stdout


def _imported(*args: str) -> set[str]:
    completed = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "streamctl", *args], capture_output=True, text=True, check=True
    )
    return {line.rsplit("|", 1)[1].strip() for line in completed.stderr.splitlines() if line.startswith("import time:")}


@pytest.mark.parametrize("command", COMMANDS, ids=lambda name: name or "top")
def test_help_imports_nothing_heavy(command: str) -> None:
    modules = _imported(*([command] if command else []), "--help")
    assert "typer" in modules and "streamctl.app" in modules  # the measurement itself works
    heavy = sorted(module for module in modules if module in HEAVY_AT_HELP or module.split(".")[0] in CLOUD_AND_NUMERIC)
    assert heavy == []


@pytest.mark.parametrize("command", COMMANDS, ids=lambda name: name or "top")
def test_help_reads_well_at_80_columns(command: str) -> None:
    text = _help(command)
    lines = text.splitlines()
    assert lines[0].startswith(f"Usage: streamctl {command}".rstrip())
    too_wide = [line for line in lines if len(line) > 80]
    assert too_wide == []
    assert "…" not in text  # nothing cut off
    assert not re.search(r"<(bool|str|int|float|int range|list\[str\])>", text), "type metavars"
    assert not re.search(r"required\)?\.?\s*\[required", text), "required said twice"
    assert not re.search(r"\{[a-z_]+\}\s*$", lines[0]), "lower-case {argument} in usage"
    # Every option is listed with a description: a line starting with the option has text after it, or
    # the next line is indented help.
    for index, line in enumerate(lines):
        if re.match(r"^  -", line) and not re.search(r"\S\s{2,}\S", line):
            assert index + 1 < len(lines) and lines[index + 1].startswith("      "), f"undescribed: {line!r}"
    examples = text.split("\nExamples:\n", 1)
    assert len(examples) == 2, "no Examples section"
    commands = [line.strip() for line in examples[1].splitlines() if line.strip().startswith("$ ")]
    assert 2 <= len(commands) <= 3 and all(line.startswith("$ streamctl ") for line in commands), commands
    assert examples[1].rstrip().splitlines()[-1].strip().startswith("$ streamctl"), "examples come last"


def test_every_option_and_argument_has_a_help_text() -> None:
    import typer.main

    from streamctl.app import app

    group = typer.main.get_command(app)
    missing = [
        f"{name} {param.name}"
        for name, command in [("", group), *group.commands.items()]  # type: ignore[attr-defined]
        for param in command.params
        if not (getattr(param, "help", None) or "").strip()
    ]
    assert missing == []


def test_help_shows_defaults_ranges_and_env_vars_whole() -> None:
    text = _help("shard")
    assert "-tp, --tensor-parallel-size N" in text
    # Every fact of an option, its environment variable last (the words may wrap, never split).
    assert "[required; at least 1; env: STREAMCTL_SHARD_TENSOR_PARALLEL_SIZE]" in " ".join(text.split())
    assert "model-pp-{pp_rank}-tp-{tp_rank}-part-{part}.safetensors" in text  # not cut off at 80 columns
    assert "AZURE_STORAGE_ACCOUNT_NAME" in text
    assert "--dtype auto|bfloat16|float16|float32" in text
    serve = _help("serve")
    assert "--preflight / --no-preflight" in serve
    assert "[default: --preflight; env: STREAMCTL_PREFLIGHT]" in " ".join(serve.split())
    assert "Usage: streamctl serve [OPTIONS] MODEL [VLLM_ARGS...]" in serve


def test_help_never_splits_a_word_on_a_narrow_terminal() -> None:
    words = set(_help("transfer", columns=200).split())
    narrow = _help("transfer", columns=60)
    assert all(len(line) <= 60 for line in narrow.splitlines() if not line.strip().startswith("$ "))
    assert set(narrow.split()) == words
