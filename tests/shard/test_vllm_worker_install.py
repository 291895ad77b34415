"""The vllm-cpu worker started from a NORMAL install of streamctl (a built wheel, not `pip install -e`): there
the folder above the streamctl package is the parent's whole site-packages, and none of its packages may reach
the worker, which must import the vLLM environment's own (issue 22: the parent's numpy 2.4.6 was imported in
the worker instead of the environment's 2.3.5).

The parent here is a fresh venv whose site-packages holds the installed wheel and shadows of packages the vLLM
environment also has (numpy, torch, safetensors: marker modules, as a different version would be) plus one the
vLLM environment lacks. A probe module (start_worker's `module`: the tests' hook) records what the worker's
process imports, then runs the real worker, which must plan a tiny model."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from oracle import oracle_python, requires_vllm_oracle
from shard_models import write_model

ROOT = Path(__file__).resolve().parents[2]
SHADOWED = ("numpy", "torch", "safetensors")  # in both environments: the parent's must not win in the worker
PARENT_ONLY = "streamctl_parent_only_marker"  # in the parent's alone: must not be importable in the worker

PROBE = f"""
import importlib, importlib.util, json, os, runpy, sys

report = {{"sys_path": sys.path, "streamctl": os.path.realpath(importlib.util.find_spec("streamctl").origin)}}
report["parent_only"] = importlib.util.find_spec({PARENT_ONLY!r}) is not None
for name in {SHADOWED!r}:
    module = importlib.import_module(name)
    report[name] = {{"file": module.__file__, "shadow": getattr(module, "SHADOW", False)}}
with open(os.environ["PROBE_REPORT"], "w") as handle:
    json.dump(report, handle)
runpy.run_module("streamctl.shard.engines.vllm_cpu.worker", run_name="__main__", alter_sys=True)
"""

# Run by the parent venv's python: streamctl's own start_worker and plan request, as the engine uses them.
DRIVER = """
import json, os, sys
import streamctl
from streamctl.shard.engines.vllm_cpu.client import plan_request, start_worker

vllm_python, request_file = sys.argv[1:]
worker = start_worker(vllm_python, module="worker_probe")
folder = getattr(worker, "path_folder", None)
outcome = {"package_dir": os.path.dirname(os.path.realpath(streamctl.__file__)), "path_folder": folder}
try:
    with open(request_file) as handle:
        worker.request(plan_request(**json.load(handle)))
    reply = worker.receive(None)
    outcome["reply"] = {key: reply.get(key) for key in ("type", "architecture", "num_layers")}
except Exception as error:
    outcome["error"] = f"{error} ({getattr(error, 'hint', None)})"
finally:
    worker.close()
outcome["left_behind"] = folder is not None and os.path.lexists(folder)
print(json.dumps(outcome))
"""


def read_tensors(folder: Path) -> dict[str, dict[str, Any]]:
    """The "tensors" of a plan request: every tensor's file, dtype, shape, absolute offset and size."""
    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        with path.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        for name, entry in header.items():
            if name != "__metadata__":
                start, end = entry["data_offsets"]
                shape, dtype = entry["shape"], entry["dtype"]
                tensors[name] = {"file": path.name, "dtype": dtype, "shape": shape, "offset": 8 + length + start}
                tensors[name]["nbytes"] = end - start
    return tensors


def pip(command: str, *args: str) -> None:
    """This environment's pip, offline, streamctl alone (its dependencies are not what is tested)."""
    options = ("-q", "--disable-pip-version-check", "--no-deps", "--no-index")
    done = subprocess.run([sys.executable, "-m", "pip", command, *options, *args], capture_output=True, text=True)
    assert done.returncode == 0, f"pip {command}: {done.stderr[-2000:]}"


def build_wheel(tmp: Path) -> Path:
    """streamctl's wheel, built from a copy of the sources (an in-tree build would leave build/ and egg-info)."""
    source = tmp / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(
        ROOT / "cli" / "streamctl", source / "cli" / "streamctl", ignore=shutil.ignore_patterns("__pycache__")
    )
    wheels = tmp / "wheels"
    pip("wheel", "--no-build-isolation", "-w", str(wheels), str(source))
    (wheel,) = wheels.glob("streamctl-*.whl")
    return wheel


def parent_install(tmp: Path) -> tuple[Path, Path]:
    """A venv with streamctl installed from its wheel beside the shadows: (its python, its site-packages)."""
    venv = tmp / "parent"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, capture_output=True)
    python = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    pip("install", "--target", str(site), str(build_wheel(tmp)))
    for name in (*SHADOWED, PARENT_ONLY):
        (site / name).mkdir()
        (site / name / "__init__.py").write_text("SHADOW = True  # the parent's copy: never the worker's\n")
    return python, site


def is_shadow(init: Path) -> bool:
    return init.is_file() and "SHADOW = True" in init.read_text()


def origins(python: str, names: tuple[str, ...]) -> dict[str, str]:
    """Where the vLLM environment's own python finds each module (alone: -P, no PYTHONPATH)."""
    script = "import importlib.util, json, sys; print(json.dumps({n: importlib.util.find_spec(n).origin for n in sys.argv[1:]}))"
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    done = subprocess.run([python, "-P", "-c", script, *names], check=True, capture_output=True, text=True, env=env)
    found: dict[str, str] = json.loads(done.stdout)
    return found


@requires_vllm_oracle
def test_worker_from_a_wheel_install_imports_the_vllm_environments_packages(tmp_path: Path) -> None:
    vllm_python = oracle_python()
    assert vllm_python is not None
    parent_python, parent_site = parent_install(tmp_path)
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "worker_probe.py").write_text(textwrap.dedent(PROBE))
    (tmp_path / "driver.py").write_text(textwrap.dedent(DRIVER))
    model = tmp_path / "hf"
    write_model(model, "llama-gqa", num_hidden_layers=1)
    request = {"model_dir": str(model), "tensors": read_tensors(model), "local_root": str(model), "tp": 2, "pp": 1}
    request.update({"ep": False, "dtype": "bfloat16", "layer_partition": None})
    (tmp_path / "request.json").write_text(json.dumps(request))
    report_file = tmp_path / "report.json"
    # The parent's PYTHONPATH, as a user's shell has it: the tests' network guard and the probe, no site-packages.
    pythonpath = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH", ""), str(probe)) if p)
    env = {
        **os.environ,
        "PYTHONPATH": pythonpath,
        "PROBE_REPORT": str(report_file),
        "STREAMCTL_ENGINE_HEARTBEAT_S": "1",
    }
    done = subprocess.run(
        [parent_python, "-P", str(tmp_path / "driver.py"), vllm_python, str(tmp_path / "request.json")],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    outcome = json.loads(done.stdout.splitlines()[-1])
    assert Path(outcome["package_dir"]).parent == parent_site.resolve()  # the parent runs the installed wheel
    report = json.loads(report_file.read_text())

    # Every package the vLLM environment has comes from it, not from the parent's site-packages.
    assert {name: report[name]["file"] for name in SHADOWED} == origins(vllm_python, SHADOWED), report
    assert not any(report[name]["shadow"] for name in SHADOWED)
    assert report["parent_only"] is False
    # No folder on the worker's path holds any of the parent's packages; its streamctl is the installed copy.
    shadowing = [
        f"{entry}: {name}"
        for entry in report["sys_path"]
        for name in (*SHADOWED, PARENT_ONLY)
        if is_shadow(Path(entry) / name / "__init__.py")
    ]
    assert shadowing == []
    assert Path(report["streamctl"]).is_relative_to(parent_site.resolve())
    # The real worker answered, and its path folder went with it.
    assert outcome.get("reply") == {"type": "plan", "architecture": "LlamaForCausalLM", "num_layers": 1}, outcome
    assert outcome["path_folder"] is not None and outcome["left_behind"] is False


# Without vLLM: the path folder itself, with a stand-in worker run by this Python (an editable install here).
STANDIN = """
import json, os, sys
with open(os.environ["PROBE_REPORT"], "w") as handle:
    json.dump({"sys_path": sys.path, "pythonpath": os.environ["PYTHONPATH"]}, handle)
sys.stdin.buffer.read()  # until the parent closes its end, as the real worker does
"""


@pytest.fixture
def standin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in worker module on PYTHONPATH; temporary folders made under tmp_path/tmp. Its report file."""
    (tmp_path / "standin").mkdir()
    (tmp_path / "standin" / "standin_probe.py").write_text(textwrap.dedent(STANDIN))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(tmp_path / "standin")) if p)
    )
    monkeypatch.setenv("PROBE_REPORT", str(tmp_path / "report.json"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    return tmp_path / "report.json"


def wait_for(path: Path, timeout: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline, f"the stand-in never wrote {path}"
        time.sleep(0.02)
    time.sleep(0.05)  # written whole
    report: dict[str, Any] = json.loads(path.read_text())
    return report


@pytest.mark.parametrize("end", ["close", "kill"])
def test_the_worker_path_holds_the_package_alone_and_goes_with_the_worker(standin: Path, end: str) -> None:
    from streamctl.shard.engines.vllm_cpu.client import PACKAGE_DIR, start_worker

    worker = start_worker(sys.executable, module="standin_probe")
    try:
        report = wait_for(standin)
        folder = worker.path_folder
        assert folder is not None and Path(folder).parent == Path(tempfile.gettempdir())
        assert os.listdir(folder) == ["streamctl"] and Path(folder, "streamctl").resolve() == PACKAGE_DIR
        assert os.stat(folder).st_mode & 0o077 == 0  # private: nobody else can put a module beside it
        # First on the worker's path (-P: no cwd before it); the folder above the package (cli/ here,
        # site-packages in an install) is not given to it.
        assert report["sys_path"][0] == folder
        entries = report["pythonpath"].split(os.pathsep)
        assert entries[0] == folder and str(PACKAGE_DIR.parent) not in entries
    finally:
        worker.close() if end == "close" else worker.kill()
    assert worker.process.poll() is not None
    assert os.listdir(tempfile.gettempdir()) == []  # the folder and its link went, the package did not
    assert (PACKAGE_DIR / "__init__.py").is_file()


def test_no_path_folder_is_left_when_the_python_cannot_run(standin: Path, tmp_path: Path) -> None:
    from streamctl.errors import UsageError
    from streamctl.shard.engines.vllm_cpu.client import start_worker

    for python in (
        tmp_path / "missing" / "python",
        tmp_path / "standin" / "standin_probe.py",
    ):  # absent; not executable
        with pytest.raises(UsageError, match="cannot run the vLLM environment's python"):
            start_worker(str(python))
    assert os.listdir(tempfile.gettempdir()) == []
