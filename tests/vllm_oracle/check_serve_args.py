"""Ask vLLM 0.33 itself whether a `vllm serve` command line is accepted, up to its model loader (oracle venv).

    check_serve_args.py -- ARGV...        # the arguments that follow `vllm serve`
    check_serve_args.py --jobs JOBS.json  # a JSON list of such argument lists: one vLLM import for many

What `vllm serve ARGV...` does before it loads anything, with vLLM's own code:
  1. `vllm.entrypoints.cli.serve.ServeSubcommand().subparser_init(subparsers)` on a top-level
     `vllm.utils.argparse_utils.FlexibleArgumentParser`, which is
     `vllm.entrypoints.common.cli_args.make_arg_parser(serve_parser)`, and `parse_args(["serve", *ARGV])`:
     the same parser as the `vllm` executable (vllm/entrypoints/cli/main.py), including
     FlexibleArgumentParser's serve-only rewriting (a `--model X` is moved to the positional MODEL slot,
     `--config` YAML files are expanded, underscores become dashes);
  2. `ServeSubcommand.validate(args)` (= `validate_parsed_serve_args`), as main.py does;
  3. the model positional (`model_tag`) overrides `--model`, as `ServeSubcommand.cmd` does;
  4. `AsyncEngineArgs.from_cli_args(args).create_load_config()` (what serve builds its engine config from)
     and `vllm.model_executor.model_loader.get_model_loader(load_config)`: the loader's constructor is
     where vLLM 0.33 validates --model-loader-extra-config (keys and types per load format).
Nothing is downloaded or loaded; MODEL need not exist.

Prints ONE JSON document: {"ok", "model", "load_format", "extra_config", "loader", "env_updates", "error"}
("env_updates": the environment variables the loader set, e.g. RUNAI_STREAMER_CONCURRENCY), or with --jobs
{"ok": all ok, "results": [those], "error"}. Exit status 0 if ok, else 1.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import traceback
from typing import Any

import _harness as h


def check_argv(argv: list[str]) -> dict[str, Any]:
    """Run one argument list through vLLM's serve parser and loader; never raises."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    result: dict[str, Any] = {
        "ok": False,
        "argv": list(argv),
        "model": None,
        "load_format": None,
        "extra_config": None,
        "loader": None,
        "env_updates": {},
        "error": None,
    }
    environ_before = dict(os.environ)
    try:
        parser = FlexibleArgumentParser(prog="vllm")  # type: ignore[no-untyped-call,unused-ignore]
        subparsers = parser.add_subparsers(required=False, dest="subparser")
        command = ServeSubcommand()
        command.subparser_init(subparsers)
        messages = io.StringIO()
        try:
            with contextlib.redirect_stderr(messages):
                args = parser.parse_args(["serve", *argv])
        except SystemExit as exit_:  # argparse reports by printing and exiting
            text = messages.getvalue().strip().splitlines()
            raise ValueError(f"argument parsing failed (exit {exit_.code}): {text[-1] if text else ''}") from None
        command.validate(args)
        if getattr(args, "model_tag", None) is not None:
            args.model = args.model_tag
        result["model"] = args.model
        load_config = AsyncEngineArgs.from_cli_args(args).create_load_config()
        result["load_format"] = str(load_config.load_format)
        result["extra_config"] = load_config.model_loader_extra_config
        loader = get_model_loader(load_config)
        result["loader"] = type(loader).__name__
        result["ok"] = True
    except Exception as error:  # noqa: BLE001 - vLLM's verdict, reported as such
        traceback.print_exc()
        result["error"] = h.describe(error)
    finally:
        result["env_updates"] = {k: v for k, v in os.environ.items() if environ_before.get(k) != v}
        os.environ.clear()
        os.environ.update(environ_before)  # one job's loader must not tune the next job's
    return result


def _validate_jobs(jobs: object) -> None:
    if not isinstance(jobs, list) or not all(
        isinstance(job, list) and all(isinstance(a, str) for a in job) for job in jobs
    ):
        raise ValueError("--jobs must hold a JSON list of lists of strings")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out = h.redirect_stdout_to_stderr()
    if argv[:1] == ["--jobs"] and len(argv) == 2:
        return h.run_jobs_file(out, argv[1], check_argv, key="results", validate=_validate_jobs)
    if argv[:1] != ["--"]:
        print(__doc__, file=sys.stderr)
        h.emit(out, {"ok": False, "error": "usage: check_serve_args.py -- ARGV...  |  --jobs FILE"})
        return 2
    result = check_argv(argv[1:])
    h.emit(out, result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
