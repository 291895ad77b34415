"""The shard engines (`--engine`), one package each: offline/, vllm_cpu/, vllm_gpu/. `ENGINES` maps an engine's
name to the factory of one run's engine (shard/engine.py's `ShardEngine`); `run_shard` (shard/run.py) runs
whichever it is given the same way.

The factories import their engine on first use: nothing of the rest of streamctl is imported with this
package, which the vllm-cpu worker's Python imports too (it holds the worker's modules)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from streamctl.shard.engine import ShardEngine

# A factory gets the caller's running engine process to reuse, if any (vllm-cpu: a started VllmWorker);
# the engines that have none ignore it.
EngineFactory = Callable[[Any], "ShardEngine"]


def _offline(_: Any) -> ShardEngine:
    from streamctl.shard.engines.offline.engine import OfflineEngine

    return OfflineEngine()


def _vllm_cpu(worker: Any) -> ShardEngine:
    from streamctl.shard.engines.vllm_cpu.engine import VllmCpuEngine

    return VllmCpuEngine(worker)


def _vllm_gpu(_: Any) -> ShardEngine:
    from streamctl.shard.engines.vllm_gpu.engine import VllmGpuEngine

    return VllmGpuEngine()


ENGINES: Mapping[str, EngineFactory] = {"offline": _offline, "vllm-cpu": _vllm_cpu, "vllm-gpu": _vllm_gpu}


def create_engine(name: str, worker: Any = None) -> ShardEngine:
    """One run's engine by its --engine name (after aliases and `auto` are resolved: shard/run.py)."""
    return ENGINES[name](worker)
