"""Build-only stand-ins for what a CPU-only vLLM environment lacks but vLLM's model code LOOKS UP while a model
is constructed (never called: nothing here runs a kernel). Standard library only at import; torch is imported
by `install()`, which runs inside the vLLM environment (the worker, tests/vllm_oracle/check_sharded.py). Where
they hook into vLLM's internals (the CPU platform's Triton check, its kernel list, the registry's subprocess),
they go through streamctl/shard/engines/vllm_cpu/compat.py, whose version table says which release needs what.

- `torchvision`: vLLM's gemma3_mm.py imports transformers' Gemma3ImageProcessor, which imports
  torchvision.transforms.v2 (vLLM's own imports of transformers' image/video utilities touch it too). When the
  real package is absent, a stand-in package answers every import and attribute; instantiating or calling
  anything of it raises ShimCalled.
- `torch.ops._C.<op>`: vLLM's CUDA wheel on a CPU has no vllm._C, yet some activations look their op up in
  __init__ on the CPU platform (vllm/model_executor/layers/activation.py, vLLM 0.33: QuickGELU -> gelu_quick
  (Qwen2-VL's vision MLP), NewGELU -> gelu_new, FastGELU -> gelu_fast). Each missing one is defined with
  torch.library; its implementation raises ShimCalled.
- Triton: vLLM 0.34's CPU platform refuses to configure on x86 without triton-cpu ("vLLM on x86 CPUs requires
  Triton (triton-cpu)", platforms/cpu.py `check_and_update_config`): its new CPU model runner compiles Triton
  kernels to RUN. triton-cpu is not published; building and loading weights never compiles a kernel, so that
  one check sees Triton present while it runs (TRITON_FOR_CONFIG), and nowhere else.
- a last-resort mixed-precision linear kernel on the CPU platform (`BuildOnlyWNA16LinearKernel`): vLLM 0.33's
  int4/int8 weight-only methods (AWQ: auto_awq.py `AutoAWQMarlinLinearMethod`, GPTQ: auto_gptq.py
  `AutoGPTQLinearMethod`, compressed-tensors: schemes/compressed_tensors_wNa16.py `CompressedTensorsWNA16`, and
  the other `choose_mp_linear_kernel` callers) register their parameters themselves in `create_weights`, and
  only then need a kernel: `choose_mp_linear_kernel` (model_executor/kernels/linear/__init__.py) walks
  `_POSSIBLE_KERNELS[PlatformEnum.CPU]` (Dynamic4bit, Zentorch, CPUWNA16) and raises when none `can_implement`
  the layer; CPUWNA16 (kernels/linear/mixed_precision/cpu.py) wants every rank's input and output size a
  multiple of 32 ("Output size (48) not supported by CPUWNA16"), a limit of its CPU GEMM, not of the layout.
  The stand-in is appended LAST to that list: it is chosen only where every real CPU kernel refused, it
  accepts any layer, and its process_weights_after_loading and apply_weights raise ShimCalled. Building and
  load_weights (all a sharding run and its checks do) never call either.
- a last-resort FP8 block-scaled linear kernel on the CPU platform (`BuildOnlyFp8BlockScaledMMKernel`): an
  FP8 block-quantized layer (fp8.py `Fp8LinearMethod` with `weight_block_size`, compressed-tensors'
  `strategy: block`) registers its `weight` and block scales in `create_weights`, then `init_fp8_linear_kernel`
  walks `_POSSIBLE_FP8_BLOCK_KERNELS[PlatformEnum.CPU]` (CPUFp8W8A8BlockScaledMMKernel,
  CPUFp8BlockScaledMMKernel: both need AMX tiles and vllm._C's fp8_scaled_mm_cpu) and raises when none is
  supported. Appended LAST, the same way as the WNA16 one; its process_weights_after_loading, apply_weights
  and apply_block_scaled_mm raise ShimCalled.
- vLLM inspects a model class in a subprocess (model_executor/models/registry.py `_run_in_subprocess`, there
  only to keep CUDA uninitialised) that would not see these stand-ins: `install()` runs it in this process.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

from streamctl.shard.engines.vllm_cpu import compat as vllm_compat

TORCHVISION = "torchvision"
TRITON_FOR_CONFIG = "triton (the CPU platform's configuration check)"
MP_KERNEL = "BuildOnlyWNA16LinearKernel"  # its name in vLLM's "Using ... for ..." log lines too
FP8_BLOCK_KERNEL = "BuildOnlyFp8BlockScaledMMKernel"  # vLLM logs "Selected ... for Fp8LinearMethod"
# The torch.ops._C ops vLLM 0.33's CPU __init__ paths look up (activation.py); only the missing ones are defined.
C_OPS: dict[str, str] = {
    "gelu_quick": "gelu_quick(Tensor(a!) out, Tensor input) -> ()",
    "gelu_new": "gelu_new(Tensor(a!) out, Tensor input) -> ()",
    "gelu_fast": "gelu_fast(Tensor(a!) out, Tensor input) -> ()",
}


class ShimCalled(RuntimeError):
    """A build-only stand-in was called: the model needs the real package/op to RUN, not to be built."""


def _refuse(what: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise ShimCalled(f"{what} is a build-only stand-in (streamctl vllm_shims): it cannot compute")

    return refuse


class _StandInMeta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return cls


class _StandIn(metaclass=_StandInMeta):
    """Any torchvision class or function: usable in annotations, as a base class, as a default value."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _refuse(f"{TORCHVISION} (stand-in)")()

    def __mro_entries__(self, bases: tuple[type, ...]) -> tuple[type, ...]:
        return (object,)


class _StandInModule(types.ModuleType):
    __version__ = "0.0.0+streamctl.build-only"

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.__path__: list[str] = []  # a package: every submodule import comes back here

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _StandIn


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name: str, path: Sequence[str] | None, target: Any = None) -> Any:
        if name == TORCHVISION or name.startswith(TORCHVISION + "."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _StandInModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        return None


_INSTALLED: list[str] = []
_LIBRARY: list[Any] = []  # the torch.library fragment must stay alive


def install_torchvision() -> bool:
    """The stand-in torchvision, where the real one is absent: before vLLM imports transformers (it decides
    once whether torchvision exists)."""
    if any(isinstance(finder, _StandInFinder) for finder in sys.meta_path):
        return True
    if importlib.util.find_spec(TORCHVISION) is not None:
        return False
    sys.meta_path.insert(0, _StandInFinder())
    return True


def _install_c_ops() -> list[str]:
    import torch

    missing = [name for name in C_OPS if not hasattr(torch.ops._C, name)]
    if not missing:
        return []
    library = torch.library.Library("_C", "FRAGMENT")
    for name in missing:
        library.define(C_OPS[name])
        library.impl(name, _refuse(f"torch.ops._C.{name}"), "CompositeExplicitAutograd")
    _LIBRARY.append(library)
    return [f"torch.ops._C.{name}" for name in missing]


def _install_mp_kernel() -> bool:
    """The build-only mixed-precision kernel, last in the CPU platform's list (see the module docstring)."""
    found = vllm_compat.cpu_mp_kernels()
    if found is None:
        return False
    listed, base = found
    if any(kernel.__name__ == MP_KERNEL for kernel in listed):
        return True

    class BuildOnlyWNA16LinearKernel(base):  # type: ignore[valid-type,misc]
        """Any weight-only quantized linear layer, for building and loading only: no CPU GEMM behind it."""

        @classmethod
        def get_min_capability(cls) -> int:
            return -1

        @classmethod
        def can_implement(cls, c: Any) -> tuple[bool, str | None]:
            return True, None

        process_weights_after_loading = _refuse(f"{MP_KERNEL}.process_weights_after_loading")
        apply_weights = _refuse(f"{MP_KERNEL}.apply_weights")

    BuildOnlyWNA16LinearKernel.__name__ = BuildOnlyWNA16LinearKernel.__qualname__ = MP_KERNEL
    listed.append(BuildOnlyWNA16LinearKernel)
    return True


def _install_fp8_block_kernel() -> bool:
    """The build-only FP8 block-scaled kernel, last in the CPU platform's list (see the module docstring)."""
    found = vllm_compat.cpu_fp8_block_kernels()
    if found is None:
        return False
    listed, base = found
    if any(kernel.__name__ == FP8_BLOCK_KERNEL for kernel in listed):
        return True

    class BuildOnlyFp8BlockScaledMMKernel(base):  # type: ignore[valid-type,misc]
        """Any FP8 block-quantized linear layer, for building and loading only: no CPU GEMM behind it."""

        @classmethod
        def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
            return True, None

        @classmethod
        def can_implement(cls, config: Any) -> tuple[bool, str | None]:
            return True, None

        process_weights_after_loading = _refuse(f"{FP8_BLOCK_KERNEL}.process_weights_after_loading")
        apply_weights = _refuse(f"{FP8_BLOCK_KERNEL}.apply_weights")
        apply_block_scaled_mm = _refuse(f"{FP8_BLOCK_KERNEL}.apply_block_scaled_mm")

    BuildOnlyFp8BlockScaledMMKernel.__name__ = BuildOnlyFp8BlockScaledMMKernel.__qualname__ = FP8_BLOCK_KERNEL
    listed.append(BuildOnlyFp8BlockScaledMMKernel)
    return True


def fp8_kernel_of(module: Any) -> Any:
    """The FP8 linear kernel a built linear layer holds (Fp8LinearMethod's `fp8_linear`, a compressed-tensors
    scheme's), or None."""
    for owner in (getattr(module, "quant_method", None), getattr(module, "scheme", None)):
        for name in ("fp8_linear", "fp8_block_linear", "kernel"):
            kernel = getattr(owner, name, None)
            if kernel is not None and type(kernel).__name__ == FP8_BLOCK_KERNEL:
                return kernel
    return None


def mp_kernel_of(module: Any) -> Any:
    """The MPLinearKernel a built linear layer holds (its quant method's, or its compressed-tensors
    scheme's), or None."""
    for owner in (getattr(module, "quant_method", None), getattr(module, "scheme", None)):
        kernel = getattr(owner, "kernel", None)
        if kernel is not None and hasattr(kernel, "config") and hasattr(kernel, "w_q_name"):
            return kernel
    return None


def install() -> list[str]:
    """Install every stand-in whose real thing is missing (once per process); the names of those installed."""
    if not _INSTALLED:
        if install_torchvision():
            _INSTALLED.append(TORCHVISION)
        _INSTALLED.extend(_install_c_ops())
        if vllm_compat.configure_without_triton():
            _INSTALLED.append(TRITON_FOR_CONFIG)
        if _install_mp_kernel():
            _INSTALLED.append(MP_KERNEL)
        if _install_fp8_block_kernel():
            _INSTALLED.append(FP8_BLOCK_KERNEL)
        vllm_compat.inspect_in_process()
        _INSTALLED.append("")  # marks "done" even when nothing was missing
    return [name for name in _INSTALLED if name]


def used_by(model: Any) -> list[str]:
    """The installed stand-ins this built model looked up: the shim ops its modules hold, the build-only
    kernels its quantized linear layers hold, and the stand-in
    torchvision whenever it is imported (vLLM's own imports of transformers' image and video utilities
    already import it, whatever the model; Gemma 3 multimodal then needs it to build)."""
    installed = set(install())
    used = set()
    for module in model.modules():
        op = getattr(module, "op", None)
        name = f"torch.ops._C.{getattr(op, '__name__', '')}"
        if name in installed:
            used.add(name)
        kernel = mp_kernel_of(module)
        if kernel is not None and type(kernel).__name__ == MP_KERNEL:
            used.add(MP_KERNEL)
        if fp8_kernel_of(module) is not None:
            used.add(FP8_BLOCK_KERNEL)
    if TORCHVISION in installed and isinstance(sys.modules.get(TORCHVISION), _StandInModule):
        used.add(TORCHVISION)
    return sorted(used)
