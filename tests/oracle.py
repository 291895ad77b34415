"""vLLM as the judge (the default release, 0.34; 0.33 of the architecture matrix too), from the main
(torch-free) test venv: thin wrappers over tests/vllm_oracle/.

The oracle scripts run under the separate vLLM venv that `.ci/vllm-env` builds; `.ci/test` exports its
python as STREAMCTL_VLLM_PYTHON. Without that variable (local development without the 4 GB env) tests that
need the oracle skip, via `requires_vllm_oracle`; with it set, a broken oracle FAILS the test, never skips.
Each call is one subprocess, and importing vLLM costs ~5 s: use the `*_many` forms to batch.

    from oracle import requires_vllm_oracle, check_sharded, save_reference, check_serve_args

    @requires_vllm_oracle
    def test_shard_llama_tp2(tmp_path):
        hf = write_tiny_checkpoint(tmp_path / "hf", "llama-gqa")        # tests/tiny_models.py
        run_streamctl_shard(hf, tmp_path / "out", tp=2)                  # your code under test
        verdict = check_sharded(hf, tmp_path / "out", tp=2)
        assert verdict["ok"], verdict                                    # per-rank "errors" say why

    save_reference(hf, tmp_path / "ref", tp=2)   # vLLM's own files, to diff names/shapes/bytes against
    check_serve_args(["s3://b/m", "--load-format", "runai_streamer_sharded"])["ok"]

Result documents (see each script's docstring for every field):
  check_sharded   {"ok", "ranks": [{"pp_rank", "tp_rank", "ok", "errors", "tensors", "files"}],
                   "folder_errors", "error"}
  save_reference  {"ok", "ranks": [{"pp_rank", "tp_rank", "files"}], "tensors": {file: {name: {"dtype",
                   "shape"}}}, "copied", "error"}
  check_serve_args {"ok", "model", "load_format", "extra_config", "loader", "env_updates", "error"}
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

ENV_VAR = "STREAMCTL_VLLM_PYTHON"
SCRIPTS = Path(__file__).resolve().parent / "vllm_oracle"
DEFAULT_TIMEOUT_S = 600

requires_vllm_oracle = pytest.mark.skipif(
    not os.environ.get(ENV_VAR),
    reason=f"{ENV_VAR} is unset: no vLLM oracle venv (CI sets it; locally: "
    f"export {ENV_VAR}=$(bash .ci/vllm-env | tail -n 1))",
)


class OracleError(RuntimeError):
    """The oracle could not give a verdict (missing venv, crash, no JSON) -- unlike a verdict of 'not ok'."""


def oracle_python() -> str | None:
    """The oracle venv's python from STREAMCTL_VLLM_PYTHON, or None when unset."""
    return os.environ.get(ENV_VAR) or None


def _run(script: str, args: Sequence[str], timeout: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
    python = oracle_python()
    if python is None:
        raise OracleError(f"{ENV_VAR} is unset; guard the test with @requires_vllm_oracle")
    command = [python, str(SCRIPTS / script), *args]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise OracleError(f"{' '.join(command)}: {error}") from error
    try:
        document = json.loads(done.stdout)
    except ValueError:
        document = None
    if done.returncode not in (0, 1) or not isinstance(document, dict):
        raise OracleError(
            f"{script} exited {done.returncode} without a verdict\n--- stdout\n{done.stdout[-4000:]}"
            f"\n--- stderr\n{done.stderr[-8000:]}"
        )
    document.setdefault("stderr_tail", done.stderr[-4000:])  # vLLM's own log lines, for failure messages
    return document


def _run_jobs(script: str, jobs: list[Any], key: str, timeout: float) -> list[dict[str, Any]]:
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="oracle-jobs-", delete=False) as handle:
        json.dump(jobs, handle)
    try:
        document = _run(script, ["--jobs", handle.name], timeout)
    finally:
        os.unlink(handle.name)
    if document.get("error") or len(document.get(key, [])) != len(jobs):
        raise OracleError(f"{script} --jobs failed: {document.get('error')}\n{document.get('stderr_tail', '')}")
    results: list[dict[str, Any]] = document[key]
    return results


def _sharded_job(
    hf_dir: str | Path,
    sharded_dir: str | Path,
    tp: int,
    pp: int = 1,
    pattern: str | None = None,
    dtype: str | None = None,
    load_format: str = "runai_streamer_sharded",
    ep: bool = False,
    dump_dir: str | Path | None = None,
) -> dict[str, Any]:
    job = {
        "hf_dir": str(hf_dir),
        "sharded_dir": str(sharded_dir),
        "tp": tp,
        "pp": pp,
        "pattern": pattern,
        "dtype": dtype,
        "load_format": load_format,
        "ep": ep,
    }
    return {**job, "dump_dir": str(dump_dir)} if dump_dir is not None else job


def check_sharded(
    hf_dir: str | Path,
    sharded_dir: str | Path,
    tp: int,
    pp: int = 1,
    pattern: str | None = None,
    dtype: str | None = None,
    load_format: str = "runai_streamer_sharded",
    timeout: float = DEFAULT_TIMEOUT_S,
    ep: bool = False,
) -> dict[str, Any]:
    """vLLM's verdict on SHARDED_DIR as the sharded form of HF_DIR at TP x PP (dtype: config's if None;
    ep: experts laid out with --enable-expert-parallel)."""
    job = _sharded_job(hf_dir, sharded_dir, tp, pp, pattern, dtype, load_format, ep)
    return check_sharded_many([job], timeout)[0]


def check_sharded_many(jobs: Sequence[dict[str, Any]], timeout: float = DEFAULT_TIMEOUT_S) -> list[dict[str, Any]]:
    """Several check_sharded jobs in one vLLM process; each job is a dict of check_sharded's arguments
    (plus "ep": True for a layout with --enable-expert-parallel: experts split over the TP ranks; "dump_dir":
    each rank's tensors as vLLM's loader loaded them, saved there as rank-PP-TP.safetensors)."""
    return _run_jobs("check_sharded.py", [_sharded_job(**job) for job in jobs], "jobs", timeout)


def _reference_job(
    hf_dir: str | Path,
    out_dir: str | Path,
    tp: int,
    pp: int = 1,
    pattern: str | None = None,
    dtype: str | None = None,
    max_size: int | None = None,
) -> dict[str, Any]:
    job: dict[str, Any] = {
        "hf_dir": str(hf_dir),
        "out_dir": str(out_dir),
        "tp": tp,
        "pp": pp,
        "pattern": pattern,
        "dtype": dtype,
    }
    if max_size is not None:
        job["max_size"] = max_size
    return job


def save_reference(
    hf_dir: str | Path,
    out_dir: str | Path,
    tp: int,
    pp: int = 1,
    pattern: str | None = None,
    dtype: str | None = None,
    max_size: int | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> dict[str, Any]:
    """Write into OUT_DIR what vLLM's own ShardedStateLoader.save_model writes for HF_DIR at TP x PP.

    max_size: bytes per part (None: vLLM's script default, 5 GiB). Raises OracleError unless it worked.
    """
    return save_reference_many([_reference_job(hf_dir, out_dir, tp, pp, pattern, dtype, max_size)], timeout)[0]


def save_reference_many(jobs: Sequence[dict[str, Any]], timeout: float = DEFAULT_TIMEOUT_S) -> list[dict[str, Any]]:
    """Several save_reference jobs in one vLLM process; each job is a dict of save_reference's arguments."""
    results = _run_jobs("save_reference.py", [_reference_job(**job) for job in jobs], "jobs", timeout)
    for result in results:
        if not result["ok"]:
            raise OracleError(f"save_reference {result['out_dir']}: {result['error']}")
    return results


def check_serve_args(argv: Sequence[str], timeout: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
    """vLLM's verdict on `vllm serve ARGV...`: parser, serve validation, load config and model loader."""
    return check_serve_args_many([argv], timeout)[0]


def check_serve_args_many(argvs: Sequence[Sequence[str]], timeout: float = DEFAULT_TIMEOUT_S) -> list[dict[str, Any]]:
    """Several `vllm serve` argument lists in one vLLM process."""
    return _run_jobs("check_serve_args.py", [list(argv) for argv in argvs], "results", timeout)


def stream_runai_many(jobs: Sequence[dict[str, Any]], timeout: float = DEFAULT_TIMEOUT_S) -> list[dict[str, Any]]:
    """The Run:ai streamer 0.17's verdict per job {"paths": [file, ...], "env": {NAME: VALUE}, "hash": bool}:
    {"ok", "tensors": [[name, torch dtype, shape]], "sha256" (with "hash"), "error"} (tests/vllm_oracle/stream_runai.py)."""
    jobs = [
        {"paths": [str(path) for path in job["paths"]], "env": dict(job.get("env", {})), "hash": bool(job.get("hash"))}
        for job in jobs
    ]
    return _run_jobs("stream_runai.py", jobs, "results", timeout)


def read_safetensors_many(folders: Sequence[str | Path], timeout: float = DEFAULT_TIMEOUT_S) -> list[dict[str, Any]]:
    """What the reference safetensors reader, vLLM's weight iterator and the Run:ai streamer load from each
    folder: {READER: {"ok", "tensors": {name: [shape, sha256]}, "error"}} (tests/vllm_oracle/read_safetensors.py)."""
    return _run_jobs("read_safetensors.py", [{"folder": str(folder)} for folder in folders], "results", timeout)


def pooling_config_many(folders: Sequence[str | Path], timeout: float = DEFAULT_TIMEOUT_S) -> list[dict[str, Any]]:
    """vLLM's `get_pooling_config` per local folder: {"pooling": {key: str(value)} or None, "error"}."""
    return _run_jobs("pooling_config.py", [str(folder) for folder in folders], "results", timeout)


def _run_script(script: str, args: Sequence[str], timeout: float, env: dict[str, str] | None = None) -> str:
    """Run an oracle script that writes files (no JSON verdict); its stdout. Raises OracleError unless exit 0."""
    python = oracle_python()
    if python is None:
        raise OracleError(f"{ENV_VAR} is unset; guard the test with @requires_vllm_oracle")
    command = [python, str(SCRIPTS / script), *map(str, args)]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise OracleError(f"{' '.join(command)}: {error}") from error
    if done.returncode != 0:
        raise OracleError(f"{script} exited {done.returncode}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    return done.stdout


def write_tiny_hf_models(root: str | Path, kinds: Sequence[str], timeout: float = DEFAULT_TIMEOUT_S) -> Path:
    """Tiny random HF checkpoints written by transformers itself, ROOT/KIND/ per kind, in ONE oracle process
    (tests/vllm_oracle/tiny_hf_models.py; ~5 s of imports): build them once per module or session."""
    output = _run_script("tiny_hf_models.py", [str(root), *kinds], timeout)
    failed = [line for line in output.splitlines() if ": FAILED " in line]
    missing = [kind for kind in kinds if not (Path(root) / kind / "config.json").is_file()]
    if failed or missing:
        raise OracleError(f"tiny_hf_models.py could not write {missing}: {failed}")
    return Path(root)


def quantize_fp8(jobs: Sequence[tuple[str | Path, str | Path, str]], block: int | None = None) -> None:
    """Quantized copies of tiny checkpoints, (SOURCE, DEST, kind) each, in ONE oracle process
    (tests/vllm_oracle/quantize_fp8.py, whose docstring lists the kinds): "block" (DeepSeek-V3 / Qwen3-FP8
    `weight_scale_inv`), "ct", "ct-tensor", "ct-block", "ct-int8" (compressed-tensors), "mxfp4" (gpt-oss);
    "KIND@B" for blocks of B, else `block` (the script's default 16)."""
    env = {"FP8_BLOCK": str(block)} if block else {}
    _run_script("quantize_fp8.py", [str(part) for job in jobs for part in job], DEFAULT_TIMEOUT_S, env)


def quantize_int4(jobs: Sequence[tuple[str | Path, str | Path, str]]) -> None:
    """int4 copies of tiny checkpoints, (SOURCE, DEST, kind) each, in ONE oracle process
    (tests/vllm_oracle/quantize_int4.py): kind "awq", "gptq" or "ct" (compressed-tensors pack-quantized), with
    "@G" for a group size other than 32."""
    _run_script("quantize_int4.py", [str(part) for job in jobs for part in job], DEFAULT_TIMEOUT_S)


def installed_vllm_version() -> str:
    """The oracle venv's exact vLLM version, from its package metadata (no vLLM import)."""
    python = oracle_python()
    if python is None:
        raise OracleError(f"{ENV_VAR} is unset; guard the test with @requires_vllm_oracle")
    code = "import importlib.metadata as m; print(m.version('vllm'))"
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    return done.stdout.strip()


def tokenizer_choices(
    folders: Sequence[str | Path], modes: Sequence[str | None] | None = None, timeout: float = DEFAULT_TIMEOUT_S
) -> list[dict[str, Any]]:
    """vLLM's own tokenizer choice for each folder, in ONE oracle process (tests/vllm_oracle/tokenizer_mode.py):
    {"folder", "auto_mode" ("mistral" or "hf"), "mode" (with --tokenizer-mode MODE, `modes[i]`; auto for None),
    "mistral_file" (what --tokenizer-mode mistral loads, or None)}."""
    given = list(modes) if modes is not None else [None] * len(folders)
    arguments = [f"{folder}={mode}" if mode else str(folder) for folder, mode in zip(folders, given, strict=True)]
    verdict = _run("tokenizer_mode.py", arguments, timeout)
    if not verdict.get("ok"):
        raise OracleError(f"tokenizer_mode.py: {verdict.get('error')}")
    results: list[dict[str, Any]] = verdict["results"]
    return results


def model_configs(folders: Sequence[str | Path], timeout: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
    """Whether vLLM builds each folder's config without --trust-remote-code, in ONE oracle process
    (tests/vllm_oracle/model_config.py): {"results": [{"folder", "loads", "error"}], "known_model_types"}."""
    verdict = _run("model_config.py", [str(folder) for folder in folders], timeout)
    if not verdict.get("ok"):
        raise OracleError(f"model_config.py: {verdict.get('error')}")
    return verdict
