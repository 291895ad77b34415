"""Write what vLLM 0.33 ITSELF saves as a sharded-state checkpoint, rank by rank (oracle venv only).

    save_reference.py HF_DIR OUT_DIR --tp N [--pp P] [--pattern PAT] [--dtype ...] [--max-size BYTES]
    save_reference.py --jobs JOBS.json     # a JSON list of {"hf_dir", "out_dir", "tp", "pp", "pattern",
                                           # "dtype", "max_size"}: one vLLM import for many layouts

vLLM's producer (examples/.../save_sharded_state.py) needs GPUs at the target TP. Here every rank is built
in one CPU process (see _harness.py), loaded from HF_DIR by the model's own `load_weights`, and then written
by vLLM's own `ShardedStateLoader.save_model(model, OUT_DIR, pattern, max_size)`: same filtered state
dict, names, per-rank shapes, part splitting and file names as vLLM. Non-weight files (config, generation
config, tokenizer) are copied; the stale model.safetensors.index.json is not. Other tests diff their
output (names, shapes, bytes) against this, and check_sharded.py on this output must pass.

--max-size defaults to 5 GiB (the example script's default). Note vLLM's own splitter writes an EMPTY part
when the first tensor of a rank exceeds max_size; this reproduces that faithfully.

Prints ONE JSON document:
  {"ok", "out_dir", "ranks": [{"pp_rank", "tp_rank", "files": [...]}], "copied": [...],
   "tensors": {file: {name: {"dtype": "BF16", "shape": [...]}}}, "error"}
  (with --jobs: {"ok", "jobs": [those], "error"}). Exit status 0 if ok, else 1 (2: bad --jobs file).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from typing import Any

# Every checkpoint here is a local folder: never wait on a hub. (Not for check_serve_args.py: offline mode
# makes vLLM's EngineArgs resolve MODEL through the HF cache, which `vllm serve` normally does not.)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import _harness as h  # after the environment it reads

DEFAULT_MAX_SIZE = 5 * 1024**3


def _listing(path: str) -> dict[str, dict[str, Any]]:
    """name -> safetensors dtype and shape, read back from the written file."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as handle:
        return {
            key: {"dtype": handle.get_slice(key).get_dtype(), "shape": list(handle.get_slice(key).get_shape())}
            for key in handle.keys()  # noqa: SIM118 - safe_open is not a mapping
        }


def save_job(job: dict[str, Any]) -> dict[str, Any]:
    """Write one layout; never raises (a crash becomes "error")."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader

    job = {"pp": 1, "pattern": None, "dtype": None, "max_size": DEFAULT_MAX_SIZE, **job}
    document: dict[str, Any] = {
        "ok": False,
        "out_dir": job["out_dir"],
        "ranks": [],
        "copied": [],
        "tensors": {},
        "error": None,
    }
    try:
        dtype = job["dtype"] or h.config_dtype(job["hf_dir"])
        document["dtype"] = dtype
        h.init_vllm()
        tensors = h.load_hf_tensors(job["hf_dir"])
        os.makedirs(job["out_dir"], exist_ok=True)
        tp, pp = int(job["tp"]), int(job["pp"])
        for pp_rank, tp_rank in h.rank_list(tp, pp):
            with h.emulate_rank(tp, tp_rank, pp, pp_rank):
                model, vllm_config = h.reference_model(job["hf_dir"], dtype, tensors)
                with set_current_vllm_config(vllm_config):
                    ShardedStateLoader.save_model(model, job["out_dir"], job["pattern"], job["max_size"])
                files = h.rank_files(job["out_dir"], job["pattern"])
            document["ranks"].append(
                {"pp_rank": pp_rank, "tp_rank": tp_rank, "files": [os.path.basename(f) for f in files]}
            )
            for path in files:
                document["tensors"][os.path.basename(path)] = _listing(path)
        document["copied"] = h.copy_config_files(job["hf_dir"], job["out_dir"])
        document["ok"] = True
    except Exception as error:  # noqa: BLE001
        traceback.print_exc()
        document["error"] = h.describe(error)
    return document


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("hf_dir", nargs="?")
    parser.add_argument("out_dir", nargs="?")
    parser.add_argument("--tp", type=int)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--pattern")
    parser.add_argument("--dtype", choices=("float16", "bfloat16", "float32"))
    parser.add_argument("--max-size", type=int, default=DEFAULT_MAX_SIZE)
    parser.add_argument("--jobs", help="JSON file with a list of jobs")
    args = parser.parse_args(argv)
    out = h.redirect_stdout_to_stderr()
    if args.jobs:
        return h.run_jobs_file(out, args.jobs, save_job)
    if not (args.hf_dir and args.out_dir and args.tp):
        parser.error("HF_DIR, OUT_DIR and --tp are required (or --jobs)")
    document = save_job(
        {
            "hf_dir": args.hf_dir,
            "out_dir": args.out_dir,
            "tp": args.tp,
            "pp": args.pp,
            "pattern": args.pattern,
            "dtype": args.dtype,
            "max_size": args.max_size,
        }
    )
    h.emit(out, document)
    return 0 if document["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
