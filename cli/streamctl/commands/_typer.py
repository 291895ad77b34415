"""What the CLI needs from Typer beyond its public API: four error classes, from this module only.

Typer 0.29 vendors Click as `typer._click` and depends on no `click` package, so the commands that
`typer.main.get_command(app)` returns and the usage errors they raise are that copy's classes, not the `click`
package's. Typer re-exports BadParameter, Context, Exit and Abort, but not the errors app.py tells apart for the
exit codes: those four are imported here and nowhere else. pyproject.toml pins typer below its next minor
release, and tests/cli/test_typer_api.py imports exactly PRIVATE_NAMES and fails naming the ones a release moved.

Everything else is public: Click's Context methods (`get_parameter_source`, compared by the source's name),
Typer's documented command classes (typer.core.TyperCommand, TyperGroup), and an option's type read from the
command function's own signature (`Command.callback`, a Click attribute) rather than Typer's parameter internals.
"""

from __future__ import annotations

import enum
import inspect
import types
import typing
from collections.abc import Callable

from typer._click.exceptions import ClickException, MissingParameter, NoSuchOption, UsageError

# What this module takes from Typer's private modules (tests/cli/test_typer_api.py imports each of them).
PRIVATE_NAMES = (
    "typer._click.exceptions.ClickException",
    "typer._click.exceptions.MissingParameter",
    "typer._click.exceptions.NoSuchOption",
    "typer._click.exceptions.UsageError",
)


def signature_types(callback: Callable[..., object] | None) -> dict[str, object]:
    """Parameter name -> its type, `Annotated[...]` and `| None` taken off, from the function a command calls
    (Typer wraps it with functools.update_wrapper, so `inspect.unwrap` finds it)."""
    if callback is None:
        return {}
    try:
        hints = typing.get_type_hints(inspect.unwrap(callback))
    except (NameError, TypeError):  # a signature that names what its module does not define
        return {}
    return {name: _without_none(hint) for name, hint in hints.items() if name != "return"}


def _without_none(hint: object) -> object:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        arguments = [argument for argument in typing.get_args(hint) if argument is not type(None)]
        if len(arguments) == 1:
            return arguments[0]
    return hint


def choices(annotation: object) -> tuple[str, ...]:
    """Enum members or Literal values of an option's type (Optional[...] unwrapped)."""
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return tuple(str(member.value) for member in annotation)
    arguments = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Literal:
        return tuple(str(value) for value in arguments)
    for argument in arguments:
        if argument is not type(None) and (found := choices(argument)):
            return found
    return ()


__all__ = [
    "PRIVATE_NAMES",
    "ClickException",
    "MissingParameter",
    "NoSuchOption",
    "UsageError",
    "choices",
    "signature_types",
]
