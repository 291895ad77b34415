"""GPU check (not a pytest test): vLLM's greedy output from streamctl's sharded files equals the HF load.

    python tests/gpu/greedy_sharded.py [--tp N] [--tokens 24] [--work DIR]

Run it with a Python that has vLLM (`pip install -e '.[vllm,streamer]'`) on a machine with at least N CUDA
GPUs (default N: 2 if two are visible, else 1). For each tiny model kind it writes a seeded checkpoint
(tests/tiny_models.py, sized so every attention backend takes it: head_dim 64), runs `streamctl shard
-tp N`, then loads three ways, each in a fresh process so GPU memory is really given back:
  hf        the HF folder, load_format auto
  sharded   streamctl's folder, load_format sharded_state
  streamer  streamctl's folder, load_format runai_streamer_sharded
and generates greedily (temperature 0, token-id prompts, no tokenizer) from the same prompts. The
verdict is the token ids: all three must match exactly, or the script exits 1. Exit 3: no CUDA GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/: tiny_models

KINDS = ("llama-gqa", "qwen2", "mistral")
# head_dim 64 (FlashAttention and friends want 64/128), vocab not a multiple of 64 (padding is exercised).
SIZES = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "vocab_size": 1000}
HEADS = {"llama-gqa": (4, 2), "qwen2": (4, 4), "mistral": (4, 2)}
LOADS = {"hf": "auto", "sharded": "sharded_state", "streamer": "runai_streamer_sharded"}
PROMPTS = [[1, 17, 256, 999, 42, 7], [1, 5, 5, 5], list(range(1, 40))]


def generate(model: str, load_format: str, tp: int, tokens: int) -> list[list[int]]:
    """One engine, in this process (the parent runs each in its own child)."""
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model,
        load_format=load_format,
        tensor_parallel_size=tp,
        skip_tokenizer_init=True,
        enforce_eager=True,
        gpu_memory_utilization=0.3,
        max_model_len=256,
        seed=0,
    )
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in PROMPTS], params)
    return [list(output.outputs[0].token_ids) for output in outputs]


def cuda_gpus() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def prepare(work: Path, kind: str, tp: int) -> tuple[Path, Path]:
    from tiny_models import write_tiny_checkpoint

    heads, kv_heads = HEADS[kind]
    hf = write_tiny_checkpoint(
        work / kind / "hf", kind, num_attention_heads=heads, num_key_value_heads=kv_heads, **SIZES
    )
    sharded = work / kind / f"sharded-tp{tp}"
    command = [sys.executable, "-m", "streamctl", "shard", str(hf), str(sharded), "-tp", str(tp), "--force", "--json"]
    completed = subprocess.run(command, capture_output=True, text=True, check=False)
    if completed.returncode != 0:
        raise SystemExit(f"streamctl shard failed for {kind}: {completed.stderr.strip()}")
    return hf, sharded


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--child", nargs=3, metavar=("MODEL", "LOAD_FORMAT", "TP"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        model, load_format, tp = args.child
        print(json.dumps(generate(model, load_format, int(tp), args.tokens)))
        return 0

    gpus = cuda_gpus()
    tp = args.tp or (2 if gpus >= 2 else 1)
    work = args.work or Path(tempfile.mkdtemp(prefix="streamctl-gpu-greedy-"))
    prepared = {kind: prepare(work, kind, tp) for kind in args.kinds}
    print(f"checkpoints and streamctl's TP {tp} files are in {work}", flush=True)
    if gpus < tp:
        print(f"needs {tp} CUDA GPU(s), found {gpus}: nothing loaded", file=sys.stderr)
        return 3
    failures = 0
    for kind, (hf, sharded) in prepared.items():
        results: dict[str, Any] = {}
        for label, load_format in LOADS.items():
            model = hf if label == "hf" else sharded
            child = [
                sys.executable,
                __file__,
                "--tokens",
                str(args.tokens),
                "--child",
                str(model),
                load_format,
                str(tp),
            ]
            completed = subprocess.run(child, capture_output=True, text=True, env=dict(os.environ), check=False)
            if completed.returncode != 0:
                results[label] = f"failed: {completed.stderr.strip().splitlines()[-1:]}"
            else:
                results[label] = json.loads(completed.stdout.strip().splitlines()[-1])
        same = all(results[label] == results["hf"] for label in LOADS) and isinstance(results["hf"], list)
        failures += not same
        print(f"{'PASS' if same else 'FAIL'}  {kind} TP {tp}: " + json.dumps(results)[:2000], flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
