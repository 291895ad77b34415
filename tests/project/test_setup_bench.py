"""The bench scripts' exit status: a missed target fails the run (no real benchmark runs here)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
# Every script whose docstring states targets; helpers (servers, the link simulator) have none.
SCRIPTS_WITH_TARGETS = sorted(
    path.name
    for path in BENCH.glob("*.py")
    if path.name != "benchlib.py" and "target" in (ast.get_docstring(ast.parse(path.read_text())) or "").lower()
)


def test_the_scripts_with_targets_are_found() -> None:
    assert {"startup.py", "transfer.py", "shard.py", "verify_remote.py"} <= set(SCRIPTS_WITH_TARGETS)


def _benchlib():  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(BENCH))
    try:
        import benchlib
    finally:
        sys.path.remove(str(BENCH))
    return benchlib


def test_targets_exit_status() -> None:
    benchlib = _benchlib()
    all_met = benchlib.Targets()
    assert all_met.check(True, "a", "fine").startswith("PASS")
    assert all_met.exit_status() == 0
    one_missed = benchlib.Targets()
    one_missed.check(True, "a", "fine")
    assert one_missed.check(False, "b", "too slow").startswith("FAIL  b: too slow")
    assert one_missed.exit_status() == benchlib.EXIT_TARGET_MISSED == 1
    assert benchlib.Targets().exit_status() == benchlib.EXIT_NOTHING_CHECKED != 0  # nothing evaluated


def _own_returns(function: ast.FunctionDef) -> list[ast.Return]:
    """The function's return statements, not those of functions defined inside it."""
    found, pending = [], list(ast.iter_child_nodes(function))
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Return):
            found.append(node)
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            pending.extend(ast.iter_child_nodes(node))
    return found


@pytest.mark.parametrize("script", SCRIPTS_WITH_TARGETS)
def test_main_returns_the_targets_verdict(script: str) -> None:
    """main() ends in `return targets.exit_status()` (or a non-zero literal on an early failure, or a hand-off
    to a worker mode), never a bare `return 0`; every PASS/FAIL line comes from Targets.check; the script exits with main()'s value."""
    tree = ast.parse((BENCH / script).read_text())
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    returns = list(_own_returns(functions["main"]))
    verdicts = [
        node
        for node in returns
        if isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Attribute)
        and node.value.func.attr == "exit_status"
    ]
    literals = [node.value.value for node in returns if isinstance(node.value, ast.Constant)]
    # A worker mode of the script (transfer.py's baseline runs as a child of itself) hands off to its function;
    # a case of its own (transfer.py --dest local) to another bench script's main(), itself checked here.
    delegations = [
        node
        for node in returns
        if isinstance(node.value, ast.Call)
        and (
            (isinstance(node.value.func, ast.Name) and node.value.func.id in functions)
            or (
                isinstance(node.value.func, ast.Attribute)
                and node.value.func.attr == "main"
                and isinstance(node.value.func.value, ast.Name)
                and f"{node.value.func.value.id}.py" in SCRIPTS_WITH_TARGETS
            )
        )
    ]
    assert verdicts, f"{script}: main() does not return Targets.exit_status()"
    assert all(isinstance(value, int) and value != 0 for value in literals), f"{script}: main() returns {literals}"
    assert len(verdicts) + len(literals) + len(delegations) == len(returns), f"{script}: main() returns something else"
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)]
    assert not [call for call in calls if isinstance(call.func, ast.Name) and call.func.id == "verdict"]
    assert [call for call in calls if isinstance(call.func, ast.Attribute) and call.func.attr == "check"]
    strings = [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)]
    assert not [text for text in strings if text in ("PASS", "FAIL")], f"{script}: a PASS/FAIL outside Targets"
    last = tree.body[-1]
    assert isinstance(last, ast.If) and ast.unparse(last.body[0]) == "sys.exit(main())"


def test_a_missed_target_exits_non_zero_through_sys_exit(tmp_path: Path) -> None:
    """The same plumbing as the scripts, run as a process: `sys.exit(main())` with one target missed."""
    script = tmp_path / "missed.py"
    script.write_text(
        "import sys\nsys.path.insert(0, sys.argv[1])\nfrom benchlib import Targets\n"
        "def main():\n    targets = Targets()\n    print(targets.check(False, 'x', 'missed'))\n"
        "    return targets.exit_status()\nif __name__ == '__main__':\n    sys.exit(main())\n"
    )
    completed = subprocess.run([sys.executable, str(script), str(BENCH)], capture_output=True, text=True)
    assert completed.returncode == 1, completed.stderr
    assert completed.stdout.startswith("FAIL  x: missed")
