"""The Typer application and the one place where errors become exit codes."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Annotated

import typer

from streamctl import __version__, output
from streamctl.commands import serve, shard, transfer, verify_index
from streamctl.commands.help import HelpCommand, HelpGroup, with_examples
from streamctl.errors import EXIT_INTERRUPTED, StreamctlError

# Exit code for a bug in streamctl itself (sysexits.h EX_SOFTWARE): distinct from every documented code.
EXIT_INTERNAL_ERROR = 70

TOP_LEVEL_EXAMPLES = (
    ("Copy a Hub model into a bucket, then check what arrived:", "streamctl transfer Qwen/Qwen3-0.6B gs://models/qwen3-0.6b"),
    ("Print the vLLM command line for it without running anything:", "streamctl serve gs://models/qwen3-0.6b --dry-run"),
    ("Help for one command:", "streamctl transfer --help"),
)

app = typer.Typer(
    name="streamctl",
    cls=with_examples(HelpGroup, TOP_LEVEL_EXAMPLES),
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
    debug: Annotated[
        bool, typer.Option("--debug", envvar="STREAMCTL_DEBUG", help="Show tracebacks and debug logs.")
    ] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress or logs on stderr.")] = False,
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
        _name, no_args_is_help=True, help=_reflowed_help(_module.command), cls=with_examples(HelpCommand, _module.EXAMPLES)
    )(_module.command)


def main() -> None:
    try:
        app(prog_name="streamctl")
    except StreamctlError as error:
        output.print_error(error)
        sys.exit(error.exit_code)
    except KeyboardInterrupt:  # outside a command (Typer turns one inside into exit 130, silently)
        output.print_error(StreamctlError("interrupted"))
        sys.exit(EXIT_INTERRUPTED)
    except SystemExit as exit_:
        if exit_.code == EXIT_INTERRUPTED:
            output.print_error(StreamctlError("interrupted"))
        raise
    except Exception as error:  # a bug: say so in one line, traceback only on request
        output.print_internal_error(error)
        sys.exit(EXIT_INTERNAL_ERROR)
