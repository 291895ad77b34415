"""The Typer application and the one place where errors become exit codes."""

from __future__ import annotations

import inspect
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Annotated

import typer

from streamctl import __version__, interrupts, output, sdklogging
from streamctl.commands import _typer as click_errors  # Typer's vendored Click errors: see commands/_typer.py
from streamctl.commands import serve, shard, transfer, verify_index
from streamctl.commands._environment import Command, Group, flag_from_environment
from streamctl.commands._options import DebugOption, QuietOption
from streamctl.commands.help import with_examples
from streamctl.errors import Interrupted, StreamctlError, UsageError
from streamctl.oserrors import user_error  # at start-up: a run out of memory cannot import it then

# Exit code for a bug in streamctl itself (sysexits.h EX_SOFTWARE): distinct from every documented code.
EXIT_INTERNAL_ERROR = 70
# Ctrl-C, as a shell reports a command SIGINT stopped (128 + 2); SIGTERM's (128 + 15).
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143

TOP_LEVEL_EXAMPLES = (
    (
        "Copy a Hub model into a bucket, then check what arrived:",
        "streamctl transfer Qwen/Qwen3-0.6B gs://models/qwen3-0.6b",
    ),
    (
        "Print the vLLM command line for it without running anything:",
        "streamctl serve gs://models/qwen3-0.6b --dry-run",
    ),
    ("Help for one command:", "streamctl transfer --help"),
)

app = typer.Typer(
    name="streamctl",
    cls=with_examples(Group, TOP_LEVEL_EXAMPLES),
    help="Stage LLM checkpoints into object storage and serve them with vLLM and the Run:ai Model Streamer.",
    no_args_is_help=True,
    add_completion=False,  # completions are generated and committed under completions/
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"streamctl {__version__}")
        raise typer.Exit()


@app.callback()
def _global_options(
    debug: DebugOption = False,
    quiet: QuietOption = False,
    # A bool defaulting to False, not Optional[bool] = None: Typer coerces a None through pydantic (~40 ms
    # of every `streamctl COMMAND --help`), a bool it passes through.
    version: Annotated[
        bool,
        typer.Option("--version", callback=_show_version, is_eager=True, help="Print the version and exit."),
    ] = False,
) -> None:
    output.configure(debug=debug, quiet=quiet)


def _reflowed_help(function: Callable[..., object]) -> str:
    """The docstring with each paragraph on one line. Typer keeps a docstring's line breaks, so text wrapped
    for the source came out ragged on a narrow terminal; Rich re-wraps single lines to the terminal's width."""
    text = inspect.cleandoc(function.__doc__ or "")
    return "\n\n".join(" ".join(line.strip() for line in paragraph.splitlines()) for paragraph in text.split("\n\n"))


for _name, _module in (("transfer", transfer), ("verify-index", verify_index), ("shard", shard), ("serve", serve)):
    app.command(
        _name, no_args_is_help=True, help=_reflowed_help(_module.command), cls=with_examples(Command, _module.EXAMPLES)
    )(_module.command)


def command_group() -> object:
    """The Click command tree behind `app` (Typer's public get_command): commands/completions.py renders the
    shell completions from it."""
    return typer.main.get_command(app)


def _json_requested(arguments: list[str]) -> bool:
    """`--json` among streamctl's own arguments (those after `--` belong to vLLM), or --json's variable."""
    own = arguments[: arguments.index("--")] if "--" in arguments else arguments
    return "--json" in own or flag_from_environment("--json")


def _click_error(error: click_errors.ClickException) -> StreamctlError:
    """A usage error Click raised itself (unknown option, missing argument, bad int) as one of ours."""
    if isinstance(error, click_errors.NoSuchOption):
        code = "unknown-option"
    elif isinstance(error, click_errors.MissingParameter):
        code = "missing-parameter"
    elif isinstance(error, typer.BadParameter):
        code = "bad-option-value"
    elif isinstance(error, click_errors.UsageError):
        code = "usage-error"
    else:
        code = "error"
    context = getattr(error, "ctx", None)
    hint = f"see {context.command_path} --help" if context is not None else "see streamctl --help"
    result = UsageError(error.format_message(), hint=hint, code=code)
    result.exit_code = error.exit_code
    return result


def main() -> None:
    """The one entry point. With --json among streamctl's own arguments every failure, Click's own included,
    is one JSON document on stdout; without, Click prints its usage errors itself. Either way each failure
    maps to its exit code here: StreamctlError's own, 130 for Ctrl-C (SIGINT), 143 for SIGTERM, an OSError or exhausted
    resource that escaped its site by streamctl.oserrors, 70 for a bug.
    SIGINT and SIGTERM stop the run through streamctl.interrupts: its clean-up runs, then one error line."""
    sdklogging.manage()  # the process is the CLI's: the SDK loggers are silent unless --debug (the library's never are)
    json_errors = _json_requested(sys.argv[1:])
    if json_errors:
        output.configure(json_output=True)
    _said.clear()
    with interrupts.stopping_on_signals(_stopped_too_late, interrupts.grace_from_environ()):
        outcome: int | BaseException = EXIT_INTERRUPTED
        try:
            outcome = _run(json_errors)
        except KeyboardInterrupt:  # a signal between _run's return and here
            pass
        finally:
            interrupts.stop_raising()  # the run is over: a signal now is recorded, not raised into the reporting
        signum = interrupts.stop_signal()
        if signum is not None and outcome != 0:
            outcome = _stopped(signum)  # whatever the stop made fail on its way out (a cut request) is the stop
        with _LAST_WORD:
            exit_code = _report(outcome)
            _said.append(exit_code)
    sys.exit(exit_code)


# Held by whoever says the run's last word: main, or `_stopped_too_late` when a clean-up overruns its grace;
# `_said` holds the exit code main reported (then the process is only exiting, and stays quiet).
_LAST_WORD = threading.Lock()
_said: list[int] = []


def _run(json_errors: bool) -> int | BaseException:
    """The command's exit code, or the failure to report."""
    try:
        # Standalone, Click prints its own errors and exits; Typer turns Ctrl-C inside a command into 130.
        returned = app(prog_name="streamctl", standalone_mode=not json_errors)
        return returned if isinstance(returned, int) else 0
    except SystemExit as exit_:
        if exit_.code != EXIT_INTERRUPTED:
            raise
        return EXIT_INTERRUPTED
    except click_errors.ClickException as error:  # only with --json: not standalone
        return _click_error(error)
    except (KeyboardInterrupt, typer.Abort):  # outside a command
        return EXIT_INTERRUPTED
    except Exception as error:  # noqa: BLE001 - StreamctlError, or a bug: reported by _report
        return error


def _stopped(signum: int) -> Interrupted:
    """The error a stop signal ends the run with: exit 130 for SIGINT, 143 for SIGTERM, as a shell reports them."""
    if signum == signal.SIGTERM:
        stopped = Interrupted("terminated (SIGTERM)", code="terminated")
        stopped.exit_code = EXIT_TERMINATED
    else:
        stopped = Interrupted("interrupted")
        stopped.exit_code = EXIT_INTERRUPTED
    return stopped


def _report(outcome: int | BaseException) -> int:
    """Print the failure (one line, or one JSON document) and return the exit code."""
    if outcome == EXIT_INTERRUPTED:
        outcome = _stopped(signal.SIGINT)
    if isinstance(outcome, int):
        return outcome
    if isinstance(outcome, StreamctlError):
        output.print_error(outcome)
        return outcome.exit_code
    refused = user_error(outcome) if isinstance(outcome, Exception) else None
    if refused is not None:  # what the machine refused (errno, memory, threads) is the user's, not a bug
        refused.__traceback__ = outcome.__traceback__  # --debug shows where it escaped
        output.print_error(refused)
        return refused.exit_code
    output.print_internal_error(outcome, EXIT_INTERNAL_ERROR)  # a bug: say so in one line, traceback on request
    return EXIT_INTERNAL_ERROR


def _stopped_too_late(signum: int) -> None:
    """The clean-up after a stop signal overran its grace (a thread stuck where no signal reaches): end the
    process now, as a kill would, with the error line main would have printed. From the watcher's thread."""
    stopped = _stopped(signum)
    exit_code = stopped.exit_code
    if _LAST_WORD.acquire(blocking=False):  # else main is saying it right now
        if _said:  # main said it, then the exit got stuck (a thread that never ends)
            exit_code = _said[-1]
        else:
            stopped.message += (
                f" (its clean-up took over {interrupts.grace_from_environ():g} s and was cut short; "
                "the next run resumes or discards what it left)"
            )
            output.print_error(stopped)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(exit_code)
