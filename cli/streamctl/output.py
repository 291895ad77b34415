"""Everything streamctl shows a person: errors, progress bars, reports, and the single JSON document.

stdout carries the result (a report, or exactly one JSON document with --json); stderr carries progress
and logs, which are off with --quiet, --json, or when stderr is not a terminal.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape

from streamctl import sdklogging
from streamctl.errors import StreamctlError
from streamctl.progress import NULL_PROGRESS, Progress

if TYPE_CHECKING:
    from rich.progress import Progress as RichProgressBars

    from streamctl.transfer import TransferPlan, TransferResult
    from streamctl.tune import TuneResult
    from streamctl.verify import VerifyReport


@dataclass
class Settings:
    debug: bool = False
    quiet: bool = False
    json: bool = False


settings = Settings(debug=os.environ.get("STREAMCTL_DEBUG", "") not in ("", "0", "false"))


def configure(*, debug: bool | None = None, quiet: bool | None = None, json_output: bool | None = None) -> None:
    """Merge global and per-command flags: any place that turns a flag on turns it on."""
    settings.debug = settings.debug or bool(debug)
    settings.quiet = settings.quiet or bool(quiet)
    settings.json = settings.json or bool(json_output)
    sdklogging.configure(settings.debug)


# Piped output is read by people in logs and by grep: don't fold it to 80 columns.
_PIPE_WIDTH = 200
# Human reports show this many findings of one kind per file, then a count of the rest.
FINDINGS_SHOWN_PER_GROUP = 5


def stdout() -> Console:
    return Console(width=None if sys.stdout.isatty() else _PIPE_WIDTH)


def stderr() -> Console:
    return Console(stderr=True, width=None if sys.stderr.isatty() else _PIPE_WIDTH)


def chatty() -> bool:
    """Whether progress and logs go to stderr at all."""
    return not (settings.quiet or settings.json) and sys.stderr.isatty()


def print_json(document: Any) -> None:
    sys.stdout.write(json.dumps(document, indent=2, sort_keys=False) + "\n")
    sys.stdout.flush()


def print_error(error: StreamctlError) -> None:
    if settings.debug and error.__traceback__ is not None:
        traceback.print_exception(error, file=sys.stderr)
    console = stderr()
    console.print(f"[bold red]error:[/] {escape(error.message)}", markup=True, highlight=False)
    if error.hint:
        console.print(f"[yellow]hint:[/] {escape(error.hint)}", markup=True, highlight=False)


def print_internal_error(error: BaseException) -> None:
    if settings.debug:
        traceback.print_exception(error, file=sys.stderr)
    first_line = (str(error).splitlines() or [""])[0]
    stderr().print(
        f"[bold red]internal error:[/] {type(error).__name__}: {escape(first_line)}",
        markup=True,
        highlight=False,
    )
    if not settings.debug:
        stderr().print("[yellow]hint:[/] rerun with --debug for a traceback and report it", markup=True)


def warn(message: str) -> None:
    """Warnings show unless --quiet or --json, even when stderr is not a terminal (they matter in CI logs)."""
    if not (settings.quiet or settings.json):
        stderr().print(f"[yellow]warning:[/] {escape(message)}", markup=True, highlight=False)


def log(message: str) -> None:
    if chatty():
        stderr().print(message, markup=False, highlight=False)


class RichProgress:
    """The library's Progress protocol drawn as Rich bars on stderr; safe to call from worker threads."""

    def __init__(self, bars: RichProgressBars) -> None:
        self._bars = bars
        self._lock = threading.Lock()

    def task(self, description: str, total: int | None) -> int:
        with self._lock:
            return int(self._bars.add_task(description, total=total))

    def advance(self, task_id: int, amount: int) -> None:
        self._bars.advance(task_id, amount)  # type: ignore[arg-type]

    def done(self, task_id: int) -> None:
        with self._lock:
            self._bars.remove_task(task_id)  # type: ignore[arg-type]

    def log(self, message: str) -> None:
        self._bars.console.print(message, markup=False, highlight=False)


@contextmanager
def progress(byte_counts: bool = False) -> Iterator[Progress]:
    """Bars on stderr when chatty, else the silent implementation."""
    if not chatty():
        yield NULL_PROGRESS
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )
    from rich.progress import Progress as RichProgressBars

    counts = (DownloadColumn(), TransferSpeedColumn()) if byte_counts else (MofNCompleteColumn(),)
    bars = RichProgressBars(
        TextColumn("{task.description}"),
        BarColumn(),
        *counts,
        TimeRemainingColumn(),
        console=stderr(),
        transient=True,
    )
    with bars:
        yield RichProgress(bars)


def human_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count} B"


def render_verify_report(report: VerifyReport, to_stderr: bool = False) -> None:
    from rich.table import Table

    console = stderr() if to_stderr else stdout()
    if report.findings:
        table = Table(show_lines=False, header_style="bold")
        for column in ("severity", "code", "file", "tensor", "message"):
            table.add_column(column, overflow="fold")
        shown: dict[tuple[str, str, str | None], int] = {}
        for finding in report.findings:
            group = (finding.severity, finding.code, finding.file)
            shown[group] = shown.get(group, 0) + 1
            if shown[group] > FINDINGS_SHOWN_PER_GROUP:
                continue
            style = "red" if finding.severity == "error" else "yellow"
            table.add_row(
                f"[{style}]{finding.severity}[/]",
                escape(finding.code),
                escape(finding.file or ""),
                escape(finding.tensor or ""),
                escape(finding.message),
            )
        for (severity, code, file), count in shown.items():
            if count > FINDINGS_SHOWN_PER_GROUP:
                hidden = count - FINDINGS_SHOWN_PER_GROUP
                table.add_row(
                    f"[dim]{severity}[/]", escape(code), escape(file or ""), "", f"[dim]... and {hidden} more (see --json)[/]"
                )
        console.print(table)
    stats = report.stats
    verdict = "[bold green]OK[/]" if report.ok else "[bold red]FAILED[/]"
    console.print(
        f"{verdict} {escape(report.checkpoint)} ({report.layout}): {len(report.errors)} errors, "
        f"{len(report.warnings)} warnings; {stats.files} files, {stats.tensors} tensors, "
        f"{human_bytes(stats.total_bytes)} checkpoint, {human_bytes(stats.bytes_read)} of headers read "
        f"in {stats.requests} requests, {stats.seconds:.2f} s",
        highlight=False,
    )


def render_transfer_plan(plan: TransferPlan, to_stderr: bool = False) -> None:
    from rich.table import Table

    console = stderr() if to_stderr else stdout()
    table = Table(header_style="bold", title=escape(f"{plan.source} -> {plan.dest}") + (f" @ {plan.commit}" if plan.commit else ""))
    for column in ("action", "size", "file", "reason"):
        table.add_column(column, overflow="fold", justify="right" if column == "size" else "left")
    for file in plan.files:
        style = "green" if file.action == "copy" else "dim"
        table.add_row(f"[{style}]{file.action}[/]", human_bytes(file.size), escape(file.path), escape(file.reason))
    for selection in plan.excluded:
        table.add_row("[yellow]leave out[/]", "", escape(selection.path), escape(selection.reason))
    console.print(table)
    copying = sum(1 for file in plan.files if file.action == "copy")
    console.print(
        f"{copying} of {len(plan.files)} files to copy ({human_bytes(plan.copy_bytes)} of "
        f"{human_bytes(plan.total_bytes)}), {len(plan.excluded)} left out",
        highlight=False,
    )


def render_transfer_result(result: TransferResult) -> None:
    copied = sum(1 for file in result.files if file.action == "copied")
    skipped = len(result.files) - copied
    discarded = f"; discarded {len(result.discarded)} unfinished uploads of an earlier run" if result.discarded else ""
    stdout().print(
        f"[bold green]done[/] {escape(result.dest)}: {copied} copied, {skipped} unchanged{discarded}; "
        f"{human_bytes(result.bytes_copied)} in {result.seconds:.1f} s ({result.throughput_mb_s:.1f} MB/s)",
        highlight=False,
    )


def render_tune_result(result: TuneResult) -> None:
    from rich.table import Table

    table = Table(header_style="bold", title=f"streamer throughput over {len(result.files)} files")
    for column in ("concurrency", "GB/s", "seconds"):
        table.add_column(column, justify="right")
    best = result.best.concurrency
    for sample in result.samples:
        mark = " *" if sample.concurrency == best else ""
        table.add_row(f"{sample.concurrency}{mark}", f"{sample.gb_per_s:.2f}", f"{sample.seconds:.2f}")
    console = stderr()
    if not settings.quiet:
        console.print(table)
        console.print(f"using concurrency {best}", highlight=False)


# =========================================================================================================
# shard (appended section)

if TYPE_CHECKING:
    from streamctl.shard import ShardResult


def render_shard_result(result: ShardResult) -> None:
    """The files written per rank, then one line for the run and one for the checks."""
    from rich.table import Table

    plan = result.plan
    console = stdout()
    table = Table(header_style="bold", title=escape(f"{plan.source} -> {plan.dest}"))
    for column in ("pp", "tp", "part", "file", "size", "tensors", "sha256"):
        numeric = column in ("pp", "tp", "part", "size", "tensors")
        table.add_column(column, overflow="fold", justify="right" if numeric else "left")
    for file in result.files:
        table.add_row(
            str(file.pp_rank),
            str(file.tp_rank),
            str(file.part),
            escape(file.path),
            human_bytes(file.size),
            str(len(file.tensors)),
            file.sha256[:16],
        )
    console.print(table)
    parallel = f"TP {plan.tensor_parallel_size} x PP {plan.pipeline_parallel_size}"
    layout = f"{parallel}, {plan.row.label}, pattern {plan.pattern}"
    removed = f"; removed {len(result.removed)} stale files" if result.removed else ""
    if result.discarded:
        removed += f"; discarded {len(result.discarded)} unfinished uploads of an earlier run"
    console.print(
        f"[bold green]done[/] {escape(plan.dest)} ({escape(layout)}, engine {result.engine}): {len(result.files)} "
        f"weight files and {len(result.copied)} serving files{removed}; {human_bytes(result.bytes_written)} in "
        f"{result.seconds:.1f} s ({result.throughput_mb_s:.1f} MB/s)",
        highlight=False,
    )
    render_shard_checks(result)


def render_shard_checks(result: ShardResult) -> None:
    """Both post-write checks; the verify findings and reconstruction problems when they failed."""
    console = stdout()
    if not result.verify.ok:
        render_verify_report(result.verify)
    reconstruction = result.reconstruction
    if reconstruction is not None and not reconstruction.ok:
        for problem in reconstruction.problems:
            console.print(f"[red]reconstruction:[/] {escape(problem)}", highlight=False)
    verify = "[green]OK[/]" if result.verify.ok else "[bold red]FAILED[/]"
    if reconstruction is None:
        rebuilt = "[yellow]skipped[/] (architecture outside the layout table)"
    else:
        state = "[green]OK[/]" if reconstruction.ok else "[bold red]FAILED[/]"
        compared = human_bytes(reconstruction.bytes_compared)
        rebuilt = f"{state} ({reconstruction.tensors} source tensors, {compared} compared)"
    console.print(f"checks: verify-index --sharded {verify}; reconstruction {rebuilt}", highlight=False)
