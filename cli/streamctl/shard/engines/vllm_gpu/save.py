"""The script `--engine vllm-gpu` runs in its subprocess (by path, in vLLM's Python): build a vLLM engine at the
requested TP/PP and save its sharded state, as vLLM's examples/features/sharded_state script does."""

from __future__ import annotations

import json
import sys

NO_GPUS_EXIT = 3  # fewer CUDA GPUs than TP x PP ranks: nothing was built or written


def main(argv: list[str]) -> int:
    """`argv`: one JSON object (model, output, tensor_parallel_size, pipeline_parallel_size, dtype, pattern,
    max_size, enable_expert_parallel). Imports torch and vllm only here: they exist in vLLM's environment, not streamctl's."""
    args = json.loads(argv[0])
    import torch

    needed = args["tensor_parallel_size"] * args["pipeline_parallel_size"]
    if not torch.cuda.is_available() or torch.cuda.device_count() < needed:
        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        print(f"needs {needed} CUDA GPUs, found {found}", file=sys.stderr)
        return NO_GPUS_EXIT
    from vllm import LLM

    llm = LLM(
        model=args["model"],
        tensor_parallel_size=args["tensor_parallel_size"],
        pipeline_parallel_size=args["pipeline_parallel_size"],
        dtype=args["dtype"],
        enforce_eager=True,
        enable_expert_parallel=bool(args.get("enable_expert_parallel", False)),
    )
    # As vLLM's examples/features/sharded_state/save_sharded_state_offline.py does.
    llm.llm_engine.engine_core.save_sharded_state(
        path=args["output"], pattern=args["pattern"], max_size=args["max_size"]
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
