"""Every option is also an environment variable, STREAMCTL_<LONG_NAME> (rclone's convention), set in one place.

`--max-part-size` reads STREAMCTL_MAX_PART_SIZE, `--force` STREAMCTL_FORCE=1 (or true/yes/on; 0/false/no/off
turn it off), `--verify/--no-verify` STREAMCTL_VERIFY=0; a repeatable option takes a space-separated list.
The command line beats the environment. An option that already read a variable (--endpoint-url:
AWS_ENDPOINT_URL, --token: HF_TOKEN, ...) reads it first, and a variable that sets the same thing in another
tool's words (RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING for --path-style) keeps precedence over ours. A bad
value from the environment is refused naming the variable. A value from the environment is a standing
default, so the checks of what was typed (an option for another kind of location, two that contradict each
other; commands/_options.py) never count it, as they never counted AWS_ENDPOINT_URL.
"""

from __future__ import annotations

import os
import re
from typing import Any

try:  # Typer 0.2x vendors Click (see app.py)
    from typer._click import exceptions as click_errors
    from typer._click.core import ParameterSource
except ImportError:  # pragma: no cover - an older Typer on the real Click
    import click.exceptions as click_errors  # type: ignore[no-redef]
    from click.core import ParameterSource  # type: ignore[assignment]

from streamctl.commands.help import HelpCommand, HelpGroup
from streamctl.errors import UsageError

PREFIX = "STREAMCTL_"
# Options that are requests, not settings: they print something and exit.
NOT_SETTINGS = frozenset({"help", "version"})
# Our variable is not read while one of these is set: it says the same thing in the words of the tool it
# belongs to, and users set it before streamctl read STREAMCTL_PATH_STYLE.
DEFERS_TO: dict[str, tuple[str, ...]] = {"path_style": ("RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING",)}


def variable_for(flag: str) -> str:
    """STREAMCTL_ and an option's long name: `--tensor-parallel-size` -> STREAMCTL_TENSOR_PARALLEL_SIZE."""
    return PREFIX + flag.lstrip("-").upper().replace("-", "_")


def variable_name(param: Any) -> str:
    return variable_for(max(param.opts, key=len))


def variables(param: Any) -> list[str]:
    """The variables `param` reads, in precedence order (an existing one first)."""
    envvar = param.envvar
    return [] if envvar is None else [envvar] if isinstance(envvar, str) else list(envvar)


def add_variables(params: list[Any]) -> None:
    """Give each option that is a setting its STREAMCTL_ variable, after any it already reads."""
    for param in params:
        if param.param_type_name != "option" or param.name in NOT_SETTINGS or getattr(param, "is_eager", False):
            continue
        existing = variables(param)
        ours = variable_name(param)
        param.envvar = existing if ours in existing else [*existing, ours]
        param.show_envvar = True


def flag_from_environment(long_name: str) -> bool:
    """Whether the variable of flag `long_name` (`--json`) turns it on, read as Click reads a boolean."""
    value = os.environ.get(variable_for(long_name), "")
    return value.strip().lower() in ("1", "true", "t", "yes", "y", "on")


def _source_variable(param: Any) -> str:
    """The variable a value from the environment came from: the first one set (Click's own rule)."""
    return next((name for name in variables(param) if os.environ.get(name)), variables(param)[0])


def _from_environment(ctx: Any) -> dict[str, str]:
    """Flags whose value this run took from the environment: flag -> the variable."""
    found = {}
    for param in ctx.command.params:
        if (
            param.name
            and param.param_type_name == "option"
            and ctx.get_parameter_source(param.name) == ParameterSource.ENVIRONMENT
        ):
            for flag in [*param.opts, *param.secondary_opts]:
                found[flag] = _source_variable(param)
    return found


def _mentions(message: str, flag: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", message) is not None


class _FromEnvironment:
    """Mixed into the command and group classes: the variables are added as Click builds the command."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        add_variables(self.params)  # type: ignore[attr-defined]

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        try:
            rest: list[str] = super().parse_args(ctx, args)  # type: ignore[misc]
        except click_errors.BadParameter as error:
            param = error.param
            if param is not None and param.name and ctx.get_parameter_source(param.name) == ParameterSource.ENVIRONMENT:
                error.param_hint = f"'{max(param.opts, key=len)}' (from {_source_variable(param)})"
            elif param is not None and param.param_type_name == "option" and error.param_hint is None:
                error.param_hint = " / ".join(f"'{name}'" for name in param.opts)  # no variables: it was typed
            raise
        for name, others in DEFERS_TO.items():
            if ctx.get_parameter_source(name) == ParameterSource.ENVIRONMENT and any(os.environ.get(v) for v in others):
                param = next(param for param in self.params if param.name == name)  # type: ignore[attr-defined]
                ctx.params[name] = param.get_default(ctx)
                ctx.set_parameter_source(name, ParameterSource.DEFAULT)
        return rest

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)  # type: ignore[misc]
        except UsageError as error:
            # The command's own checks name the flag (`invalid --part-size 'x'`): say where the value came from.
            named = {name: None for flag, name in _from_environment(ctx).items() if _mentions(error.message, flag)}
            if named:
                error.message += f" (from {', '.join(named)})"
            raise


class Command(_FromEnvironment, HelpCommand):
    pass


class Group(_FromEnvironment, HelpGroup):
    pass
