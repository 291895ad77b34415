"""vLLM 0.33's `serve` options, and how its own parser reads given argument lists (oracle venv).

    serve_options.py --jobs JOBS.json   # {"argvs": [[ARG, ...], ...]}: the arguments after `vllm serve MODEL`

Builds the parser exactly as `vllm serve` does (FlexibleArgumentParser + ServeSubcommand.subparser_init,
as check_serve_args.py) and prints ONE JSON document:
  {"ok", "allow_abbrev", "options": [{"option_strings", "dest", "nargs", "type", "action", "default_is_none"}],
   "parsed": [{"argv", "ok", "values": {dest: value for every option whose value differs from its default},
               "error"}], "error"}
so that streamctl's table of options and its list of secret options can be held against the real parser.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from typing import Any

import _harness as h


def _parser() -> Any:
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")  # type: ignore[no-untyped-call,unused-ignore]
    subparsers = parser.add_subparsers(required=False, dest="subparser")
    ServeSubcommand().subparser_init(subparsers)
    return parser, subparsers.choices["serve"]


def _type_name(kind: Any) -> str | None:
    """The name of an option's type; vLLM's `optional_type(T)` wrappers are named by the T they wrap."""
    if kind is None:
        return None
    for cell in getattr(kind, "__closure__", None) or ():
        inner = cell.cell_contents
        if callable(inner) and hasattr(inner, "__name__"):
            return _type_name(inner)
    return getattr(kind, "__name__", repr(kind))


def _parse(parser: Any, serve: Any, argv: list[str]) -> dict[str, Any]:
    result: dict[str, Any] = {"argv": argv, "ok": False, "values": {}, "error": None}
    messages = io.StringIO()
    try:
        with contextlib.redirect_stderr(messages):
            args = parser.parse_args(["serve", "model", *argv])
    except SystemExit as exit_:
        lines = messages.getvalue().strip().splitlines()
        result["error"] = f"exit {exit_.code}: {lines[-1] if lines else ''}"
        return result
    except Exception as error:  # noqa: BLE001 - vLLM's verdict
        result["error"] = h.describe(error)
        return result
    for action in serve._actions:
        if action.dest in ("help", "model_tag", "subparser"):
            continue
        value = getattr(args, action.dest, action.default)
        if value != action.default:
            result["values"][action.dest] = value if isinstance(value, (str, int, float, bool, list)) else repr(value)
    result["ok"] = True
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out = h.redirect_stdout_to_stderr()
    document: dict[str, Any] = {"ok": False, "allow_abbrev": None, "options": [], "parsed": [], "error": None}
    try:
        if argv[:1] != ["--jobs"] or len(argv) != 2:
            raise ValueError("usage: serve_options.py --jobs FILE")
        with open(argv[1]) as handle:
            jobs = json.load(handle)
        parser, serve = _parser()
        document["allow_abbrev"] = bool(serve.allow_abbrev)
        document["options"] = [
            {
                "option_strings": list(action.option_strings),
                "dest": action.dest,
                "nargs": action.nargs,
                "type": _type_name(action.type),
                "action": type(action).__name__,
            }
            for action in serve._actions
            if action.option_strings
        ]
        document["parsed"] = [_parse(parser, serve, list(job)) for job in jobs["argvs"]]
        document["ok"] = True
    except Exception as error:  # noqa: BLE001
        document["error"] = h.describe(error)
    h.emit(out, document)
    return 0 if document["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
