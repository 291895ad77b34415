"""Typer's private API: the names streamctl takes from it, all in commands/_typer.py, are still there.

typer is pinned below its next minor in pyproject.toml. When a Typer release moves one of these names, the first
test here fails naming it (before anything imports streamctl.commands._typer, whose import would only say
ImportError): port commands/_typer.py to the new release, then raise the pin.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "cli" / "streamctl"
COMPAT = PACKAGE / "commands" / "_typer.py"


def private_names() -> tuple[str, ...]:
    """PRIVATE_NAMES of commands/_typer.py, read from its source (importing it needs every one of them)."""
    for node in ast.parse(COMPAT.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "PRIVATE_NAMES" for t in node.targets):
            names: tuple[str, ...] = ast.literal_eval(node.value)
            return names
    raise AssertionError(f"{COMPAT} has no PRIVATE_NAMES")


def missing(names: tuple[str, ...]) -> list[str]:
    """The dotted `module.name`s that cannot be imported."""
    gone = []
    for dotted in names:
        module_name, _, attribute = dotted.rpartition(".")
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            gone.append(dotted)
            continue
        if not hasattr(module, attribute):
            gone.append(dotted)
    return gone


def test_typer_still_has_every_private_name_streamctl_imports() -> None:
    names = private_names()
    assert len(names) >= 1
    gone = missing(names)
    version = importlib.metadata.version("typer")
    assert gone == [], (
        f"typer {version} moved {', '.join(gone)}: streamctl/commands/_typer.py imports them; "
        "port it to this release, then raise the typer pin in pyproject.toml"
    )


def test_the_check_names_a_moved_name() -> None:
    assert missing(("typer._click.exceptions.UsageError", "typer._click.exceptions.NoSuchThing")) == [
        "typer._click.exceptions.NoSuchThing"
    ]
    assert missing(("typer._no_such_module.ClickException",)) == ["typer._no_such_module.ClickException"]


def _private_typer_uses(tree: ast.Module) -> list[tuple[int, str]]:
    """Imports of a private typer module or name, and `typer.x._y` attribute reads."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "typer":
            private_module = any(part.startswith("_") for part in node.module.split("."))
            found += [
                (node.lineno, f"{node.module}.{alias.name}")
                for alias in node.names
                if private_module or alias.name.startswith("_")
            ]
        elif isinstance(node, ast.Import):
            found += [
                (node.lineno, alias.name)
                for alias in node.names
                if alias.name.split(".")[0] == "typer" and any(p.startswith("_") for p in alias.name.split("."))
            ]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id == "typer":
                found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def test_private_typer_names_come_from_commands_typer_only() -> None:
    elsewhere = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != COMPAT
        for line, name in _private_typer_uses(ast.parse(path.read_text()))
    ]
    assert elsewhere == []
    imported = {name for _, name in _private_typer_uses(ast.parse(COMPAT.read_text()))}
    assert imported == set(private_names())  # PRIVATE_NAMES lists exactly what the module imports


def test_the_private_use_checker_sees_each_form() -> None:
    source = (
        "import typer\nimport typer._click.core\nfrom typer._click import exceptions\n"
        "from typer.main import _main\nx = typer.main._private\nfrom typer.core import TyperGroup\n"
    )
    assert _private_typer_uses(ast.parse(source)) == [
        (2, "typer._click.core"),
        (3, "typer._click.exceptions"),
        (4, "typer.main._main"),
        (5, "typer.main._private"),
    ]


def test_typer_is_pinned_below_its_next_minor() -> None:
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    typer = next(Requirement(line) for line in dependencies if Requirement(line).name == "typer")
    installed = Version(importlib.metadata.version("typer"))
    upper = [spec for spec in typer.specifier if spec.operator == "<"]
    assert len(upper) == 1, f"{typer}: an upper bound below the next minor release is required"
    assert Version(upper[0].version) == Version(f"{installed.major}.{installed.minor + 1}")
    assert typer.specifier.contains(installed)
