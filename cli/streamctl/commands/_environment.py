"""Every option is also an environment variable (rclone's convention), named and set in one place.

Which name, by one rule: an option that means one thing wherever it appears reads STREAMCTL_<OPTION>
(`--max-part-size`: STREAMCTL_MAX_PART_SIZE); an option name that several commands use for different things
(PER_COMMAND) reads STREAMCTL_<COMMAND>_<OPTION> in each (`serve --image`, the vLLM image:
STREAMCTL_SERVE_IMAGE; `transfer --image`, the streamctl image of the Job: STREAMCTL_TRANSFER_IMAGE), so a
variable set for one command never changes what another does. "One thing" means one declaration: an option
several commands share is declared once in commands/_options.py (the same help text), like --json or
--endpoint-url; an option of one command alone is its own. tests/cli/test_cli_environment.py lists every
option of every command and fails when a flat name would be read by two commands for different options.
`--force` reads STREAMCTL_TRANSFER_FORCE=1 or STREAMCTL_SHARD_FORCE=1 (or true/yes/on; 0/false/no/off
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

import typer

from streamctl.commands.help import HelpCommand, HelpGroup
from streamctl.errors import UsageError

PREFIX = "STREAMCTL_"
# Options that are requests, not settings: they print something and exit.
NOT_SETTINGS = frozenset({"help", "version"})
# Our variable is not read while one of these is set: it says the same thing in the words of the tool it
# belongs to, and users set it before streamctl read STREAMCTL_PATH_STYLE.
DEFERS_TO: dict[str, tuple[str, ...]] = {"path_style": ("RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING",)}
# Long names that several commands use for options of different meanings (their help says so): each
# command reads its own STREAMCTL_<COMMAND>_<OPTION>. The flat STREAMCTL_<OPTION> of these is read by none.
PER_COMMAND = frozenset(
    {
        "--concurrency",  # transfer: parts in flight; verify-index: header reads; serve: streamer readers
        "--dry-run",  # transfer: print the plan; serve: print the vLLM command line
        "--force",  # transfer: copy every file again; shard: write into a DEST that holds files
        "--image",  # transfer: the streamctl image of the Job; serve: the vLLM image
        "--namespace",  # transfer: the Job's; serve: the Deployment's
        "--pattern",  # shard: the names to write; serve: to read; verify-index: to expect
        "--pipeline-parallel-size",  # shard: stages to write; verify-index: stages expected
        "--secret",  # transfer: HF_TOKEN and bucket keys for the copy; serve: vLLM's credentials
        "--service-account",  # transfer: the Job's pod; serve: the vLLM pod
        "--sharded",  # serve: load pre-sharded files; verify-index: check them as such
        "--tensor-parallel-size",  # shard: ranks to write; serve: GPUs; verify-index: ranks expected
    }
)


def variable_for(flag: str, command: str | None = None) -> str:
    """STREAMCTL_, the command's name where PER_COMMAND says so, and the option's long name:
    `--max-part-size` -> STREAMCTL_MAX_PART_SIZE, `--image` of serve -> STREAMCTL_SERVE_IMAGE."""
    words = flag.lstrip("-") if command is None or flag not in PER_COMMAND else f"{command}-{flag.lstrip('-')}"
    return PREFIX + words.upper().replace("-", "_")


def variable_name(param: Any, command: str | None = None) -> str:
    """The variable of option `param` of `command` (its name as typed: `verify-index`; None at the top)."""
    return variable_for(max(param.opts, key=len), command)


def variables(param: Any) -> list[str]:
    """The variables `param` reads, in precedence order (an existing one first)."""
    envvar = param.envvar
    return [] if envvar is None else [envvar] if isinstance(envvar, str) else list(envvar)


def add_variables(params: list[Any], command: str | None) -> None:
    """Give each option of `command` that is a setting its STREAMCTL_ variable, after any it already reads."""
    for param in params:
        if param.param_type_name != "option" or param.name in NOT_SETTINGS or getattr(param, "is_eager", False):
            continue
        existing = variables(param)
        ours = variable_name(param, command)
        param.envvar = existing if ours in existing else [*existing, ours]
        param.show_envvar = True


def flag_from_environment(long_name: str) -> bool:
    """Whether the variable of flag `long_name` (`--json`, one meaning everywhere) turns it on, read as Click
    reads a boolean."""
    assert long_name not in PER_COMMAND, long_name  # a per-command flag has no variable outside its command
    value = os.environ.get(variable_for(long_name), "")
    return value.strip().lower() in ("1", "true", "t", "yes", "y", "on")


def _from_variable(ctx: Any, name: str) -> bool:
    """Whether option `name` took its value from the environment (Click's ParameterSource, compared by name:
    Typer exports no ParameterSource of its own)."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name == "ENVIRONMENT"


def _source_variable(param: Any) -> str:
    """The variable a value from the environment came from: the first one set (Click's own rule)."""
    return next((name for name in variables(param) if os.environ.get(name)), variables(param)[0])


def _from_environment(ctx: Any) -> dict[str, str]:
    """Flags whose value this run took from the environment: flag -> the variable."""
    found = {}
    for param in ctx.command.params:
        if param.name and param.param_type_name == "option" and _from_variable(ctx, param.name):
            for flag in [*param.opts, *param.secondary_opts]:
                found[flag] = _source_variable(param)
    return found


def _warn_of_flat_names(params: list[Any], command: str | None) -> None:
    """A flat variable of a PER_COMMAND option (STREAMCTL_IMAGE) is read by no command: say which one is
    (a setting made before the names were split would otherwise be dropped without a word)."""
    from streamctl import output

    for param in params:
        flag = max(getattr(param, "opts", None) or [""], key=len)
        if param.param_type_name == "option" and flag in PER_COMMAND and os.environ.get(variable_for(flag)):
            ours = variable_name(param, command)
            output.warn(f"{variable_for(flag)} is not read ({flag} means something else in each command): "
                        f"{command} {flag} reads {ours}")  # fmt: skip


def _mentions(message: str, flag: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", message) is not None


class _FromEnvironment:
    """Mixed into the command and group classes: the variables are added as Click builds the command."""

    top_level = False  # the group's own options (--debug, --quiet) are every command's: flat names

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        add_variables(self.params, None if self.top_level else self.name)  # type: ignore[attr-defined]

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        try:
            rest: list[str] = super().parse_args(ctx, args)  # type: ignore[misc]
        except typer.BadParameter as error:
            param = error.param
            if param is not None and param.name and _from_variable(ctx, param.name):
                error.param_hint = f"'{max(param.opts, key=len)}' (from {_source_variable(param)})"
            elif param is not None and param.param_type_name == "option" and error.param_hint is None:
                error.param_hint = " / ".join(f"'{name}'" for name in param.opts)  # no variables: it was typed
            raise
        if not (ctx.params.get("quiet") or ctx.params.get("json_output")):  # the command's own, parsed just now
            _warn_of_flat_names(self.params, self.name)  # type: ignore[attr-defined]
        for name, others in DEFERS_TO.items():
            if _from_variable(ctx, name) and any(os.environ.get(v) for v in others):
                param = next(param for param in self.params if param.name == name)  # type: ignore[attr-defined]
                ctx.params[name] = param.get_default(ctx)
                source = ctx.get_parameter_source(name)
                ctx.set_parameter_source(name, type(source)["DEFAULT"])  # Click's ParameterSource, by name
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
    top_level = True
