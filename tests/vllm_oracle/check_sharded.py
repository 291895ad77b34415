"""Ask vLLM 0.33 itself whether a sharded-state folder is right, rank by rank (oracle venv only).

    check_sharded.py HF_DIR SHARDED_DIR --tp N [--pp P] [--pattern PAT] [--dtype float16|bfloat16|float32]
                     [--load-format runai_streamer_sharded|sharded_state]
    check_sharded.py --jobs JOBS.json      # a JSON list of {"hf_dir", "sharded_dir", "tp", "pp", "pattern",
                                           # "dtype", "load_format", "dump_dir"}: one vLLM import for many checks

For every (pp_rank, tp_rank), in one process (see _harness.py for the rank emulation):
  1. reference: the rank's vLLM model class built on HF_DIR and loaded by its own `load_weights` from the HF
     tensors -- exactly what a vLLM worker holds after loading the HF checkpoint;
  2. candidate: a fresh instance (fresh VllmConfig), every float tensor filled with NaN so nothing left
     unwritten can pass, loaded from SHARDED_DIR by vLLM's own `ShardedStateLoader.load_weights` through
     `get_model_loader(LoadConfig(load_format=..., model_loader_extra_config={"pattern": PAT}))` -- it raises
     on an unexpected (KeyError) or missing (ValueError "Missing keys") name;
  3. `ShardedStateLoader._filter_subtensors` of both state dicts compared with `torch.equal` and dtype.
With "dump_dir" (jobs only), each rank's loaded state dict is also saved there as rank-PP-TP.safetensors,
for a test to compare with its own reading of the source. It also reads the rank's file headers, because vLLM only WARNS (and then casts, or fills the leading part)
when a file tensor's dtype or shape differs from the parameter's; and it checks the folder: config.json must
be there and equal to HF_DIR's (`vllm serve SHARDED_DIR` reads it), and no *.safetensors may be left that
no rank reads. An empty part file is only a warning: vLLM 0.33 loads it, and writes one itself.

The default load format is runai_streamer_sharded, the one `streamctl serve` uses, so the files also go
through the Run:ai streamer. Both folders must be local (copy a bucket's output down first). Prints ONE JSON document:
  {"ok": bool, "ranks": [{"pp_rank", "tp_rank", "ok", "errors": [...], "warnings": [...], "tensors": int,
   "files": [...]}],
   "folder_errors": [...], "error": str | null, ...}      (with --jobs: {"ok", "jobs": [those], "error"})
Exit status 0 if ok, 1 if not, 2 if the check itself could not run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

# Every checkpoint here is a local folder: never wait on a hub. (Not for check_serve_args.py: offline mode
# makes vLLM's EngineArgs resolve MODEL through the HF cache, which `vllm serve` normally does not.)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import _harness as h  # after the environment it reads

LOAD_FORMATS = ("runai_streamer_sharded", "sharded_state")


def _file_header_errors(files: list[str], reference: dict[str, Any], warnings: list[str]) -> list[str]:
    """Exact name/shape/dtype checks of one rank's files against the reference state dict."""
    from safetensors import safe_open

    dtype_names = {
        "F16": "float16",
        "BF16": "bfloat16",
        "F32": "float32",
        "F64": "float64",
        "F8_E4M3": "float8_e4m3fn",
        "F8_E5M2": "float8_e5m2",
        "I8": "int8",
        "U8": "uint8",
        "I32": "int32",
        "I64": "int64",
    }
    errors: list[str] = []
    seen: dict[str, str] = {}  # tensor name -> file, within this rank
    for path in files:
        name_of_file = os.path.basename(path)
        with safe_open(path, framework="pt") as handle:
            keys = list(handle.keys())
            if not keys:
                # Not an error: vLLM 0.33 loads it (through streamer 0.17 too, locally), and its own
                # save_model writes such a part when a rank's first tensor exceeds max_size.
                warnings.append(f"{name_of_file}: no tensors")
            for key in keys:
                if key in seen:
                    errors.append(f"{key}: in both {seen[key]} and {name_of_file}")
                    continue
                seen[key] = name_of_file
                if key not in reference:
                    errors.append(f"{key} ({name_of_file}): not a tensor of this rank's vLLM model")
                    continue
                piece = handle.get_slice(key)
                shape = list(piece.get_shape())
                want = reference[key]
                if shape != list(want.shape):
                    errors.append(f"{key} ({name_of_file}): shape {shape}, vLLM expects {list(want.shape)}")
                dtype = dtype_names.get(piece.get_dtype(), piece.get_dtype())
                if dtype != str(want.dtype).removeprefix("torch."):
                    errors.append(f"{key} ({name_of_file}): dtype {dtype}, vLLM expects {want.dtype}")
    return errors


def _compare(reference: dict[str, Any], loaded: dict[str, Any]) -> list[str]:
    import torch

    errors = [f"{key}: missing from the loaded model" for key in sorted(set(reference) - set(loaded))]
    errors += [f"{key}: not in the reference model" for key in sorted(set(loaded) - set(reference))]
    for key in sorted(set(reference) & set(loaded)):
        want, got = reference[key], loaded[key]
        if want.dtype != got.dtype or want.shape != got.shape:
            errors.append(f"{key}: loaded {got.dtype} {list(got.shape)}, reference {want.dtype} {list(want.shape)}")
        elif not torch.equal(want, got):
            differing = int((want != got).sum()) if want.numel() else 0
            errors.append(
                f"{key}: values differ from vLLM's own load of the HF checkpoint "
                f"({differing} of {want.numel()} elements)"
            )
    return errors


def check_rank(job: dict[str, Any], tensors: dict[str, Any], claimed: set[str]) -> dict[str, Any]:
    """Check the currently emulated rank; `claimed` collects the file names every rank reads."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader

    result: dict[str, Any] = {"ok": False, "errors": [], "warnings": [], "tensors": 0, "files": []}
    reference_model, _ = h.reference_model(job["hf_dir"], job["dtype"], tensors, ep=job["ep"])
    reference = h.filtered_state_dict(reference_model)
    result["tensors"] = len(reference)

    candidate_config = h.make_vllm_config(
        job["hf_dir"],
        job["dtype"],
        job["load_format"],
        job["pattern"],
        model_weights=job["sharded_dir"],
        ep=job["ep"],
    )
    try:
        files = h.rank_files(job["sharded_dir"], job["pattern"])
    except ValueError as error:  # vLLM's own pattern validation
        result["errors"].append(f"vLLM rejects the pattern: {error}")
        return result
    result["files"] = [os.path.basename(path) for path in files]
    claimed.update(result["files"])
    errors = result["errors"]
    errors += _file_header_errors(files, reference, result["warnings"])

    candidate = h.build_model(candidate_config)
    with torch.no_grad():
        for tensor in candidate.state_dict().values():
            if tensor.is_floating_point():
                tensor.fill_(float("nan"))
    loader = get_model_loader(candidate_config.load_config)
    try:
        with set_current_vllm_config(candidate_config), torch.no_grad():
            loader.load_weights(candidate, candidate_config.model_config)
    except Exception as error:  # noqa: BLE001 - vLLM's verdict, reported as such
        errors.append(f"vLLM {type(loader).__name__}.load_weights: {h.describe(error)}")
    else:
        loaded = h.filtered_state_dict(candidate)
        errors += _compare(reference, loaded)
        if job.get("dump_dir"):
            _dump(loaded, Path(job["dump_dir"]) / f"rank-{job['rank'][0]}-{job['rank'][1]}.safetensors")
    result["ok"] = not errors
    return result


def _dump(state: dict[str, Any], path: Path) -> None:
    """What vLLM's ShardedStateLoader loaded for this rank, for a test to compare with its own expectation."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({name: tensor.detach().contiguous() for name, tensor in state.items()}, str(path))


def _folder_errors(job: dict[str, Any], claimed: set[str]) -> list[str]:
    errors = []
    sharded, hf = Path(job["sharded_dir"]), Path(job["hf_dir"])
    if not (sharded / "config.json").is_file():
        errors.append("config.json missing: `vllm serve` on this folder cannot build the model")
    elif json.loads((sharded / "config.json").read_text()) != json.loads((hf / "config.json").read_text()):
        errors.append("config.json differs from the source checkpoint's")
    stray = sorted(p.name for p in sharded.glob("*.safetensors") if p.name not in claimed)
    if stray:
        errors.append(f"*.safetensors read by no rank: {stray}")
    return errors


def check_job(job: dict[str, Any]) -> dict[str, Any]:
    """One HF_DIR/SHARDED_DIR/TP/PP check; never raises (a crash becomes "error")."""
    job = {
        "pp": 1,
        "pattern": None,
        "dtype": None,
        "load_format": "runai_streamer_sharded",
        "ep": False,
        **job,
    }
    document: dict[str, Any] = {
        "ok": False,
        "ranks": [],
        "folder_errors": [],
        "error": None,
        **{key: job[key] for key in ("hf_dir", "sharded_dir", "tp", "pp", "pattern", "load_format")},
    }
    try:
        if job["load_format"] not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}")
        job["dtype"] = job["dtype"] or h.config_dtype(job["hf_dir"])
        document["dtype"] = job["dtype"]
        h.init_vllm()
        tensors = h.load_hf_tensors(job["hf_dir"])
        claimed: set[str] = set()
        for pp_rank, tp_rank in h.rank_list(int(job["tp"]), int(job["pp"])):
            with h.emulate_rank(int(job["tp"]), tp_rank, int(job["pp"]), pp_rank):
                rank = check_rank({**job, "rank": (pp_rank, tp_rank)}, tensors, claimed)
            document["ranks"].append({"pp_rank": pp_rank, "tp_rank": tp_rank, **rank})
        document["folder_errors"] = _folder_errors(job, claimed)
        document["ok"] = not document["folder_errors"] and all(rank["ok"] for rank in document["ranks"])
    except Exception as error:  # noqa: BLE001
        traceback.print_exc()
        document["error"] = h.describe(error)
    return document


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("hf_dir", nargs="?")
    parser.add_argument("sharded_dir", nargs="?")
    parser.add_argument("--tp", type=int)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--pattern")
    parser.add_argument("--dtype", choices=("float16", "bfloat16", "float32"))
    parser.add_argument("--load-format", choices=LOAD_FORMATS, default="runai_streamer_sharded")
    parser.add_argument("--jobs", help="JSON file with a list of jobs")
    args = parser.parse_args(argv)
    out = h.redirect_stdout_to_stderr()
    h.install_build_shims()
    if args.jobs:
        return h.run_jobs_file(out, args.jobs, check_job)
    if not (args.hf_dir and args.sharded_dir and args.tp):
        parser.error("HF_DIR, SHARDED_DIR and --tp are required (or --jobs)")
    document = check_job(
        {
            "hf_dir": args.hf_dir,
            "sharded_dir": args.sharded_dir,
            "tp": args.tp,
            "pp": args.pp,
            "pattern": args.pattern,
            "dtype": args.dtype,
            "load_format": args.load_format,
        }
    )
    h.emit(out, document)
    if document["error"]:
        return 2
    return 0 if document["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
