"""`--help` as plain text: usage, description, options per section, examples; wrapped to the terminal.

Typer's own renderer imports rich.markdown, rich.traceback and (through the group's unset --help value)
pydantic, most of the start-up time of a `--help` (docs/measurements.md). It also prints `<str>`/`<bool>`
metavars, "(required). [required]" and cuts long option names and defaults off with "..." at 80 columns.
This renderer prints what gcloud and git print: each option with a value placeholder, its help, default,
env var and range, sections from `rich_help_panel`, and the command's examples last. Nothing here is cut:
a long name puts its help on the next line, and words are never split.
"""

from __future__ import annotations

import enum
import os
import shutil
import textwrap
from collections.abc import Iterable, Sequence
from typing import Any

import typer.core

from streamctl.commands._typer import choices, signature_types

# Lines are wrapped to the terminal, but no wider than this (long lines are hard to read).
MAX_WIDTH = 100
# The option column; a longer name and placeholder put the help text on the next line.
NAME_COLUMN = 30
INDENT = 2


def help_width() -> int:
    columns = os.environ.get("COLUMNS", "")
    width = int(columns) if columns.isdigit() else shutil.get_terminal_size((80, 24)).columns
    return max(40, min(width, MAX_WIDTH))


def placeholder(param: Any, annotation: object = None) -> str:
    """What goes after an option's name: its metavar, its choices, N for numbers, else its name in capitals
    (`annotation`: the option's type in the command's signature)."""
    if getattr(param, "is_flag", False):
        return ""
    if param.metavar:
        return str(param.metavar)
    names = choices(annotation)
    if names:
        return "|".join(names)
    if annotation in (int, float):
        return "N"
    return (param.name or "VALUE").upper()


def _argument_name(param: Any) -> str:
    name = param.metavar or (param.name or "ARG").upper()
    return f"{name}..." if param.nargs != 1 else name


def _default_text(param: Any) -> str | None:
    if getattr(param, "show_default", True) is False:
        return None
    default = param.default
    if callable(default) or default is None or default == () or default == []:
        return None
    if isinstance(default, bool):
        if not param.secondary_opts:  # a plain flag: off unless given
            return None
        return str((param.opts if default else param.secondary_opts)[0])
    if isinstance(default, enum.Enum):
        return str(default.value)
    return str(default)


def _range_text(param: Any) -> str | None:
    low, high = getattr(param, "min", None), getattr(param, "max", None)
    if low is not None and high is not None:
        return f"{low} to {high}"
    if low is not None:
        return f"at least {low}"
    if high is not None:
        return f"at most {high}"
    return None


def option_help(param: Any) -> str:
    """The help text followed by what the parser knows: required, default, range, env var."""
    text = (param.help or "").strip()
    facts = []
    if param.required and param.param_type_name == "option":  # usage already marks optional arguments
        facts.append("required")
    if (default := _default_text(param)) is not None:
        facts.append(f"default: {default}")
    if (allowed := _range_text(param)) is not None:
        facts.append(allowed)
    envvar = param.envvar
    if envvar and getattr(param, "show_envvar", True):
        facts.append("env: " + ", ".join([envvar] if isinstance(envvar, str) else envvar))
    if facts:
        text = f"{text} [{'; '.join(facts)}]".strip()
    return text


def option_names(param: Any, annotation: object = None) -> str:
    """`-tp, --tensor-parallel-size N`: short names first, as in git and gcloud."""
    names = sorted(param.opts, key=lambda name: name.startswith("--"))
    text = ", ".join(names)
    if param.secondary_opts:
        text += " / " + ", ".join(param.secondary_opts)
    value = placeholder(param, annotation)
    return f"{text} {value}" if value else text


def _wrap(text: str, width: int) -> list[str]:
    return textwrap.wrap(text, width, break_long_words=False, break_on_hyphens=False)


def _definition_list(rows: Iterable[tuple[str, str]], width: int) -> list[str]:
    """Name and help side by side; a long name puts its help on the next line, and a help text holding a
    word too long for its column (a file name pattern) goes below the name across the whole width."""
    rows = list(rows)
    column = min(NAME_COLUMN, max((len(name) for name, _ in rows), default=0))
    help_column = INDENT + column + 2
    lines = []
    for name, text in rows:
        wrapped = _wrap(text, width - help_column) or [""]
        if any(len(line) > width - help_column for line in wrapped):
            lines.append(" " * INDENT + name)
            lines.extend(" " * (INDENT + 4) + line for line in _wrap(text, width - INDENT - 4))
            continue
        if len(name) <= column:
            lines.append((" " * INDENT + name.ljust(column) + "  " + wrapped[0]).rstrip())
            wrapped = wrapped[1:]
        else:
            lines.append(" " * INDENT + name)
        lines.extend(" " * help_column + line for line in wrapped)
    return lines


def _paragraphs(text: str, width: int) -> list[str]:
    lines: list[str] = []
    for paragraph in (text or "").strip().split("\n\n"):
        if lines:
            lines.append("")
        joined = " ".join(line.strip() for line in paragraph.splitlines())
        lines.extend(textwrap.wrap(joined, width - INDENT, break_long_words=False, break_on_hyphens=False,
                                   initial_indent=" " * INDENT, subsequent_indent=" " * INDENT))  # fmt: skip
    return lines


def _examples(examples: Sequence[tuple[str, str]], width: int) -> list[str]:
    lines = ["Examples:"]
    for description, command in examples:
        lines.extend(
            textwrap.wrap(description, width - INDENT, initial_indent=" " * INDENT, subsequent_indent=" " * INDENT)
        )
        lines.append(" " * (INDENT + 2) + "$ " + command)  # a command line is never wrapped: it is copied
        lines.append("")
    return lines[:-1]


def render_help(command: Any, ctx: Any, width: int | None = None, examples: Sequence[tuple[str, str]] = ()) -> str:
    """One command's (or the group's) help page as text."""
    width = width or help_width()
    params = [param for param in command.get_params(ctx) if not getattr(param, "hidden", False)]
    types = signature_types(getattr(command, "callback", None))
    arguments = [param for param in params if param.param_type_name == "argument"]
    options = [param for param in params if param.param_type_name == "option"]
    pieces = ["[OPTIONS]"]
    for argument in arguments:
        name = _argument_name(argument)
        pieces.append(name if argument.required else f"[{name}]")
    subcommands = getattr(command, "commands", None)
    if subcommands:
        pieces.append("COMMAND [ARGS]...")
    usage = f"Usage: {ctx.command_path} {' '.join(pieces)}"
    lines = textwrap.wrap(usage, width, subsequent_indent=" " * 7, break_on_hyphens=False)
    lines.append("")
    lines.extend(_paragraphs(command.help or "", width))
    if arguments:
        lines += ["", "Arguments:"]
        lines += _definition_list(((_argument_name(arg), option_help(arg)) for arg in arguments), width)
    sections: dict[str, list[Any]] = {}
    for option in options:
        sections.setdefault(getattr(option, "rich_help_panel", None) or "Options", []).append(option)
    for title, members in sorted(sections.items(), key=lambda item: item[0] != "Options"):
        lines += ["", f"{title}:"]
        rows = ((option_names(option, types.get(option.name)), option_help(option)) for option in members)
        lines += _definition_list(rows, width)
    if subcommands:
        lines += ["", "Commands:"]
        rows = ((name, (sub.help or "").split("\n\n")[0]) for name, sub in subcommands.items() if not sub.hidden)
        lines += _definition_list(rows, width)
    if examples:
        lines += ["", *_examples(examples, width)]
    return "\n".join(lines) + "\n"


class _HelpFormatting:
    """Mixed into Typer's command and group classes: our help page, examples, and an unset --help that is
    False rather than None (Typer coerces None through a pydantic TypeAdapter, and pydantic's import is
    ~40 ms of every `streamctl COMMAND --help`; a bool passes through untouched)."""

    examples: tuple[tuple[str, str], ...] = ()

    def format_help(self, ctx: Any, formatter: Any) -> None:
        formatter.write(render_help(self, ctx, examples=self.examples))

    def get_help_option(self, ctx: Any) -> Any:
        option = super().get_help_option(ctx)  # type: ignore[misc]
        if option is not None:
            option.default = False
        return option


class HelpCommand(_HelpFormatting, typer.core.TyperCommand):
    pass


class HelpGroup(_HelpFormatting, typer.core.TyperGroup):
    pass


def with_examples(base: type, examples: Sequence[tuple[str, str]]) -> type:
    """`base` whose help ends with these (description, command line) examples."""
    return type(base.__name__, (base,), {"examples": tuple(examples)})
