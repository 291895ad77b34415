"""The vllm-cpu worker's write: per part, consecutive names grouped by layer; the layer's HF tensors read once
(memory-mapped from local_root, or "read" frames answered by the parent) and kept for the next group; per TP
rank the pseudo stage built on the CPU, what it sends NaN-poisoned and the rest set aside on the meta device,
loaded by the model's own `load_weights`, filtered as vLLM's ShardedStateLoader filters (before
process_weights_after_loading) and each tensor streamed. vLLM's internals through
streamctl/shard/engines/vllm_cpu/compat.py only."""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

from streamctl.shard.engines.vllm_cpu import compat as vllm_compat
from streamctl.shard.engines.vllm_cpu.compat import emulate_rank, pp_partition
from streamctl.shard.engines.vllm_cpu.worker_channel import Channel
from streamctl.shard.engines.vllm_cpu.worker_errors import WorkerError, one_line
from streamctl.shard.engines.vllm_cpu.worker_memory import dropped_after_use
from streamctl.shard.engines.vllm_cpu.worker_plan import (
    SAFETENSORS_DTYPES,
    TORCH_TO_SAFETENSORS,
    WHOLE_RANK,
    Plan,
    make_vllm_config,
)


def peak_rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    return -1.0


@dataclass
class Phases:
    """Seconds the write's main thread spent in each step, for the "written" frame ("phases"): where a
    layer's time goes (the frame-writer thread's hashing and writing overlap them; "send" is the wait for it)."""

    seconds: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started

    def to_json(self) -> dict[str, float]:
        return {name: round(seconds, 3) for name, seconds in self.seconds.items()}


@dataclass
class LayerCache:
    """One layer's HF tensors, kept for the next group (the safetensors handles open while they live:
    get_tensor is a zero-copy view of the file's mmap)."""

    layer: int = -1
    tensors: dict[str, Any] = field(default_factory=dict)
    stack: ExitStack = field(default_factory=ExitStack)

    def drop(self) -> None:
        self.tensors = {}
        self.stack.close()
        self.stack = ExitStack()
        self.layer = -1


def _local_tensors(plan: Plan, names: list[str], stack: ExitStack) -> dict[str, Any]:
    from safetensors import safe_open

    root = plan.request["local_root"]
    handles: dict[str, Any] = {}
    tensors = {}
    for name in names:
        entry = plan.hf_tensors[name]
        file = entry["file"]
        try:
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(os.path.join(root, file), framework="pt"))
            tensor = handles[file].get_tensor(name)
        except Exception as error:
            raise WorkerError("bad-checkpoint", f"{file}: {name}: {one_line(error)}") from error
        got = (TORCH_TO_SAFETENSORS.get(str(tensor.dtype).removeprefix("torch.")), list(tensor.shape))
        if got != (entry["dtype"], list(entry["shape"])):
            raise WorkerError(
                "bad-checkpoint", f"{file}: {name} is {got}, the plan says {entry['dtype']}{entry['shape']}"
            )
        tensors[name] = tensor
    return tensors


def _remote_tensors(channel: Channel, plan: Plan, names: list[str]) -> dict[str, Any]:
    """The layer's tensors through "read" frames, one read per run of adjacent tensors of one file."""
    import torch

    entries = sorted(names, key=lambda n: (plan.hf_tensors[n]["file"], int(plan.hf_tensors[n]["offset"])))
    runs: list[list[str]] = []
    for name in entries:
        entry, last = plan.hf_tensors[name], runs[-1][-1] if runs else None
        if last is not None:
            prev = plan.hf_tensors[last]
            if prev["file"] == entry["file"] and int(prev["offset"]) + int(prev["nbytes"]) == int(entry["offset"]):
                runs[-1].append(name)
                continue
        runs.append([name])
    tensors = {}
    for run in runs:
        first, end = plan.hf_tensors[run[0]], plan.hf_tensors[run[-1]]
        start = int(first["offset"])
        buffer = channel.read_range(first["file"], start, int(end["offset"]) + int(end["nbytes"]) - start)
        for name in run:
            entry = plan.hf_tensors[name]
            at, nbytes = int(entry["offset"]) - start, int(entry["nbytes"])
            raw = (
                torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=at)
                if nbytes
                else torch.empty(0, dtype=torch.uint8)
            )
            tensors[name] = raw.view(getattr(torch, SAFETENSORS_DTYPES[entry["dtype"]])).view(entry["shape"])
    return tensors


def layer_hf_tensors(channel: Channel, plan: Plan, layer: int, cache: LayerCache) -> dict[str, Any]:
    if cache.layer != layer:
        cache.drop()
        names = plan.hf_names_of_layer(layer)
        if plan.request.get("local_root"):
            cache.tensors = _local_tensors(plan, names, cache.stack)
        else:
            cache.tensors = _remote_tensors(channel, plan, names)
        cache.layer = layer
    return cache.tensors


def _must_be_loaded(name: str) -> bool:
    """A model's weights proper (`load_weights` must write them); other parameters (compressed-tensors' scales,
    zero points absent from a checkpoint) may keep their construction value, as in a full build."""
    last = name.rsplit(".", 1)[-1]
    return last in ("weight", "bias") or last.endswith(("_weight", "_bias"))


def _storages(model: Any, names: list[str]) -> set[int]:
    """The storages (data pointers) that hold `names` in the model's state dict (tied aliases and sub-tensor
    views included)."""
    state = model.state_dict(keep_vars=True)
    return {state[name].untyped_storage().data_ptr() for name in names if name in state and state[name].numel()}


def _poison(model: Any, sent: set[int]) -> dict[str, Any]:
    """NaN into every floating parameter whose storage holds a tensor this pseudo stage sends (`_storages`), so
    nothing `load_weights` left unwritten passes as loaded; returns the construction values of the (small)
    parameters that may legitimately keep them. The rest are never sent (a vision tower or embeddings that
    another pseudo stage produces, built on every one): filling them cost a GB of writes per layer and rank."""
    import torch

    saved = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.is_floating_point() and param.numel() and param.untyped_storage().data_ptr() in sent:
                if not _must_be_loaded(name):
                    saved[name] = param.detach().clone()
                param.fill_(float("nan"))
    return saved


def set_aside(model: Any, sent: set[int]) -> None:
    """Every parameter that holds nothing this pseudo stage sends moves to the meta device, its attributes
    (vLLM's weight_loader and shard facts) kept: a pseudo stage fed the tensors outside the decoder layers
    (the last one: embeddings, a vision tower) but producing none of them then copies them nowhere instead
    of into a GB of fresh memory per TP rank. Tied parameters stay one object."""
    import torch

    moved: dict[int, tuple[Any, Any]] = {}  # id -> (the CPU parameter, kept alive while ids are compared; its stand-in)
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or param.is_meta or not param.numel() or param.untyped_storage().data_ptr() in sent:
                continue
            if id(param) not in moved:
                stand_in = torch.Tensor._make_subclass(
                    type(param), torch.empty_like(param, device="meta"), param.requires_grad
                )
                stand_in.__dict__.update(param.__dict__)
                moved[id(param)] = (param, stand_in)
            module._parameters[name] = moved[id(param)][1]


def _built_and_loaded(
    plan: Plan, names: list[str], hf: dict[str, Any], phases: Phases, aside: bool
) -> tuple[dict[str, Any], Any]:
    """Build the emulated rank's pseudo stage, poison what it sends, set the rest aside (`aside`), load it."""
    import torch
    from vllm.config import set_current_vllm_config

    with phases.step("build"):
        config = make_vllm_config(plan.request)
        model = vllm_compat.build_model(config)
    with phases.step("poison"):
        sent = _storages(model, names)
        saved = _poison(model, sent)
        if aside:
            set_aside(model, sent)
    with phases.step("load_weights"), set_current_vllm_config(config), torch.no_grad():
        # a memory-mapped source tensor's pages go once consumed: the layer's files never all resident
        model.load_weights(dropped_after_use(hf.items(), plan.request.get("local_root")))
    return saved, model


def load_pseudo_stage(
    plan: Plan, layer: int, tp_rank: int, hf: dict[str, Any], names: list[str], phases: Phases | None = None
) -> tuple[dict[str, Any], dict[str, Any], Any]:
    """Pseudo stage `layer` at `tp_rank`, built on the CPU and loaded by its own load_weights: its filtered
    state dict (before post-processing), the construction values of its poisoned small parameters (those
    holding `names`, what is sent of it), the model. A weight loader that cannot write to set_aside's meta
    stand-ins (one that computes with the parameter it loads) fails: the stage is then built again whole."""
    if layer == WHOLE_RANK:  # the real (only) stage, every layer at once
        partition, stages, stage = plan.partition, plan.pp, 0
    else:
        partition, stages, stage = ",".join(["1"] * plan.num_layers), plan.num_layers, layer
    phases = phases or Phases()
    with pp_partition(partition), emulate_rank(plan.tp, tp_rank, stages, stage):
        try:
            try:
                saved, model = _built_and_loaded(plan, names, hf, phases, aside=True)
            except KeyError:
                raise
            except Exception:  # noqa: BLE001 - a meta stand-in's failure or the checkpoint's: the whole build says
                saved, model = _built_and_loaded(plan, names, hf, phases, aside=False)
        except KeyError as error:  # vLLM's `params_dict[name]` on a checkpoint tensor its model did not build
            raise WorkerError(
                "bad-checkpoint",
                f"layer {layer}, TP rank {tp_rank}: vLLM's model has no parameter for the checkpoint's tensor "
                f"{error.args[0] if error.args else error!r} (a config.json field decides which parameters exist: "
                "does it match the weights?)",
            ) from error
        except Exception as error:
            raise WorkerError("bad-checkpoint", f"layer {layer}, TP rank {tp_rank}: {one_line(error)}") from error
    with phases.step("filter"):
        state = vllm_compat.filter_subtensors({k: v for k, v in model.state_dict().items() if not v.is_meta})
    return state, saved, model


def release_weights(model: Any) -> None:
    """Drop a sent model's parameter and buffer storage now (the frames still queued keep theirs until they
    are written): its module objects sit in reference cycles until the per-layer gc, its weights need not."""
    import torch

    for module in model.modules():
        for param in module._parameters.values():
            if param is not None and not param.is_meta:  # set_aside's stand-ins hold no memory
                param.data = torch.empty(0, dtype=param.dtype)
        for name, buffer in list(module._buffers.items()):
            if buffer is not None:
                module._buffers[name] = torch.empty(0, dtype=buffer.dtype)


def raw_bytes(tensor: Any) -> memoryview:
    """The tensor's bytes as safetensors holds them (C order), a view, no copy when already contiguous."""
    import torch

    flat = tensor.detach()
    if not flat.is_contiguous():
        flat = flat.contiguous()
    if not flat.numel():
        return memoryview(b"")
    return memoryview(flat.reshape(-1).view(torch.uint8).numpy())


def has_nan(tensor: Any) -> bool:
    """Whether a floating tensor holds a NaN: max propagates NaN, one read pass and no bool tensor the size of
    the input (8x faster than isnan().any()); float8 has no CPU max, so it takes the long way."""
    import torch

    if not tensor.is_floating_point() or not tensor.numel():
        return False
    if tensor.element_size() == 1:
        return bool(torch.isnan(tensor).any())
    return bool(torch.isnan(tensor.amax()))


def send_group(
    channel: Channel,
    plan: Plan,
    pp_rank: int,
    tp_rank: int,
    names: list[str],
    state: dict[str, Any],
    saved: dict[str, Any],
    kept: list[str],
) -> None:
    """Check and send one rank's names of one layer group, in the request's order."""
    import torch

    stage = plan.stages[pp_rank]
    sent = plan.sent.setdefault((pp_rank, tp_rank), {})
    for name in names:
        tensor, want = state.get(name), stage[name]
        if tensor is None:
            raise WorkerError("internal", f"pseudo stage {want.layer} (TP rank {tp_rank}) holds no {name}")
        got = (TORCH_TO_SAFETENSORS.get(str(tensor.dtype).removeprefix("torch.")), tuple(tensor.shape))
        shape = want.shape_on(tp_rank)
        if got != (want.dtype, shape):
            raise WorkerError("internal", f"{name}: built {got}, planned {(want.dtype, shape)}")
        if has_nan(tensor):
            if name not in saved:
                raise WorkerError(
                    "bad-checkpoint",
                    f"TP rank {tp_rank}: load_weights left {name} (partly) unwritten: the checkpoint lacks it",
                )
            with torch.no_grad():
                tensor.copy_(saved[name])
            kept.append(name)
        raw = raw_bytes(tensor)
        header = {
            "type": "tensor",
            "pp_rank": pp_rank,
            "tp_rank": tp_rank,
            "name": name,
            "dtype": want.dtype,
            "shape": list(shape),
            "nbytes": raw.nbytes,
            "sha256": None,  # the writer thread hashes the very bytes it writes
        }
        channel.send(header, (raw, tensor), lambda done: sent.__setitem__(done["name"], done["sha256"]))


def _layer_groups(plan: Plan, pp_rank: int, part: list[str]) -> list[tuple[int, list[str]]]:
    stage = plan.stages[pp_rank]
    groups: list[tuple[int, list[str]]] = []
    for name in part:
        if not isinstance(name, str) or name not in stage:
            raise WorkerError("protocol", f"write: {name!r} is not a tensor of stage {pp_rank} in the plan")
        layer = stage[name].layer
        if groups and groups[-1][0] == layer:
            groups[-1][1].append(name)
        else:
            groups.append((layer, [name]))
    return groups


def write_layer_group(
    channel: Channel,
    plan: Plan,
    pp_rank: int,
    layer: int,
    names: list[str],
    cache: LayerCache,
    phases: Phases,
    kept: list[str],
) -> None:
    """One layer group (one layer, or WHOLE_RANK) of a stage built, loaded and sent for every TP rank."""
    where = "every layer at once" if layer == WHOLE_RANK else f"layer {layer + 1} of {plan.num_layers}"
    channel.log(f"stage {pp_rank}: {where}")
    with phases.step("read"):
        hf = layer_hf_tensors(channel, plan, layer, cache)
    for tp_rank in range(plan.tp):
        state, saved, model = load_pseudo_stage(plan, layer, tp_rank, hf, names, phases)
        with phases.step("send"):
            send_group(channel, plan, pp_rank, tp_rank, names, state, saved, kept)
        release_weights(model)  # one rank's weights alive at a time, without a gc per rank
        del state, saved, model
    with phases.step("gc"):
        gc.collect()  # a built vLLM model sits in reference cycles: once per layer group


def op_write(channel: Channel, plan: Plan | None, request: dict[str, Any]) -> None:
    if plan is None:
        raise WorkerError("protocol", "write before a successful plan")
    started = time.perf_counter()
    cache, phases = LayerCache(), Phases()
    kept: list[str] = []
    try:
        for stage in request.get("stages", []):
            pp_rank = int(stage["pp_rank"])
            if not 0 <= pp_rank < plan.pp:
                raise WorkerError("protocol", f"write: pp_rank {pp_rank} is not a stage of the plan")
            for part in stage.get("parts", []):
                for layer, names in _layer_groups(plan, pp_rank, part):
                    write_layer_group(channel, plan, pp_rank, layer, names, cache, phases, kept)
    finally:
        cache.drop()
        gc.collect()
    channel.send(
        {
            "type": "written",
            "seconds": round(time.perf_counter() - started, 3),
            "peak_rss_mib": peak_rss_mib(),
            "kept_construction_value": sorted(set(kept)),
            "phases": phases.to_json(),
        }
    )
