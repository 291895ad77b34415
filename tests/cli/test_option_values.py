"""Every numeric and size option of every command refuses absurd values with exit 2, fast.

Values: huge (5,000 digits, past 2**64, huge exponents), negative, zero, NaN, infinity and garbage. Run
in-process through `streamctl.app.main` (the real entry point, exit codes included) to keep 200 runs quick;
a few run as real subprocesses too.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from cli_helpers import run_cli
from headers_helpers import run_main
from tiny_models import write_tiny_checkpoint

HUGE = "9" * 5000
ABSURD = [
    HUGE,
    "-" + HUGE,
    "1" + "0" * 400,
    "18446744073709551616",
    "99999999999999999999999",
    "1e999999",
    "1e308",
    "-1",
    "-0",
    "nan",
    "NaN",
    "inf",
    "-inf",
    "Infinity",
    "0x10",
    "1_0000",  # int() reads 10000
    "",
    " ",
    "abc",
    "1.5.5",
    "\x00",
    "١٢",  # Arabic-Indic digits: int() takes them, a size parser must not
]
ZERO = ["0", "0.0"]

# (command and the arguments before the option, option, whether 0 is allowed, kind)
OPTIONS = [
    (["transfer", "{src}", "{dst}"], "--concurrency", False),
    (["transfer", "{src}", "{dst}"], "-j", False),
    (["transfer", "{src}", "{dst}"], "--part-size", False),
    (["transfer", "{src}", "{dst}"], "--max-buffer", False),
    (["shard", "{src}", "{dst}", "-tp", "2"], "--pipeline-parallel-size", False),
    (["shard", "{src}", "{dst}", "-pp", "2"], "-tp", False),
    (["shard", "{src}", "{dst}", "-tp", "2"], "--max-part-size", False),
    (["shard", "{src}", "{dst}", "-tp", "2"], "--vllm-version", False),
    (["verify-index", "{src}"], "-tp", False),
    (["verify-index", "{src}"], "-pp", False),
    (["verify-index", "{src}"], "--concurrency", False),
    (["serve", "{src}", "--dry-run"], "-tp", False),
    (["serve", "{src}", "--dry-run"], "--concurrency", False),
    (["serve", "{src}", "--dry-run"], "--memory-limit", True),
    (
        ["serve", "{src}", "--dry-run", "--cpu-weight-files", "a.safetensors", "--engram", "x*"],
        "--cpu-memory-limit",
        True,
    ),
]
# Values inside the type but far past any sensible bound: caught by streamctl's own ranges.
TOO_LARGE = {
    "--concurrency": "257",
    "-j": "100000",
    "--part-size": "6GiB",
    "--max-buffer": "2TiB",
    "--pipeline-parallel-size": "10000000",
    "-tp": "1025",
    "-pp": "4097",
    "--max-part-size": "6TiB",
    "--vllm-version": "1.2.3.4.5.6.7",
    "--memory-limit": "65TiB",
    "--cpu-memory-limit": "100PiB",
}


@pytest.fixture()
def paths(tmp_path: Path) -> dict[str, str]:
    return {"src": str(tmp_path / "missing-source"), "dst": str(tmp_path / "dest")}


@pytest.mark.parametrize(("prefix", "option", "zero_allowed"), OPTIONS, ids=[o[1] + "@" + o[0][0] for o in OPTIONS])
def test_absurd_values_exit_2_quickly_without_a_traceback(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    paths: dict[str, str],
    prefix: list[str],
    option: str,
    zero_allowed: bool,
) -> None:
    values = ABSURD + [TOO_LARGE[option]] + ([] if zero_allowed else ZERO)
    if option == "--vllm-version":  # suffixes after the release numbers are fine there (0.33.0+cu128, 1e9 -> 1)
        values = [HUGE, HUGE + ".0", "0." + HUGE, "-1", "nan", "", " ", "abc", "v", "1.2.3.4.5.6.7", "١.٢"]
    if option in ("--memory-limit", "--cpu-memory-limit"):
        values.remove("-1")  # -1 means unlimited there
    for value in values:
        arguments = [part.format(**paths) for part in prefix]
        for form in ([option, value], [f"{option}={value}"] if option.startswith("--") else [option, value]):
            started = time.monotonic()
            code, stdout, stderr = run_main(monkeypatch, capsys, *arguments, *form)
            seconds = time.monotonic() - started
            shown = f"{prefix[0]} {option} {value[:20]!r}"
            assert code == 2, f"{shown}: exit {code}: {stderr[-300:]}"
            assert "Traceback" not in stderr + stdout and "internal error" not in stderr, shown
            assert seconds < 5, f"{shown}: {seconds:.1f} s"
            assert len(stderr) < 4000, shown  # one line (plus Click's usage box), not 5,000 digits echoed


@pytest.mark.parametrize(("prefix", "option", "zero_allowed"), OPTIONS[:8], ids=[o[1] for o in OPTIONS[:8]])
def test_absurd_values_with_json_give_one_error_document(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    paths: dict[str, str],
    prefix: list[str],
    option: str,
    zero_allowed: bool,
) -> None:
    import json

    for value in (HUGE, "nan", TOO_LARGE[option], "-1"):
        arguments = [part.format(**paths) for part in prefix]
        code, stdout, _ = run_main(monkeypatch, capsys, *arguments, option, value, "--json")
        document = json.loads(stdout)
        assert code == 2 and document["ok"] is False
        assert document["error"]["exit_code"] == 2
        assert document["error"]["code"] in ("bad-option-value", "usage-error"), document


def test_a_huge_pipeline_size_is_refused_before_any_work(tmp_path: Path) -> None:
    """`shard -pp 10000000` spent minutes in a quadratic loop before refusing."""
    write_tiny_checkpoint(tmp_path / "src", "llama-gqa")
    started = time.monotonic()
    result = run_cli("shard", str(tmp_path / "src"), str(tmp_path / "dst"), "-tp", "2", "-pp", "10000000")
    assert result.exit_code == 2, result.stderr
    assert "--pipeline-parallel-size must be between 1 and 1,024" in result.stderr
    assert time.monotonic() - started < 30


def test_tp_times_pp_is_bounded(tmp_path: Path) -> None:
    result = run_cli("shard", str(tmp_path / "src"), str(tmp_path / "dst"), "-tp", "1024", "-pp", "1024")
    assert result.exit_code == 2 and "ranks; at most 4,096" in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("64MiB", 64 << 20),
        ("1.5GiB", 3 << 29),
        ("100MB", 10**8),
        ("5368709120", 5 << 30),
        ("0.5KiB", 512),
        ("1.9999b", 1),
    ],
)
def test_sizes_still_parse_exactly(text: str, expected: int) -> None:
    from streamctl.common.sizes import parse_size

    assert parse_size(text, "--x", 5 << 30) == expected
