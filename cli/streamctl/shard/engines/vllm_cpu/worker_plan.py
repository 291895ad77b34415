"""The vllm-cpu worker's plan: what every rank holds (names, dtypes, shapes in state-dict order, after vLLM's
sub-tensor filter), and which pseudo stage (one decoder layer) produces each name; the plan types write and
check refer to. The `plan` operation of streamctl/shard/engines/vllm_cpu/protocol.py (worker.py's docstring says
how). vLLM's internals through streamctl/shard/engines/vllm_cpu/compat.py only."""

from __future__ import annotations

import gc
import re
from dataclasses import dataclass, field, replace
from typing import Any

from streamctl.shard.engines.vllm_cpu import compat as vllm_compat
from streamctl.shard.engines.vllm_cpu import quantized as vllm_quantized
from streamctl.shard.engines.vllm_cpu import shims as vllm_shims
from streamctl.shard.engines.vllm_cpu import wna16 as vllm_wna16
from streamctl.shard.engines.vllm_cpu.compat import emulate_rank, pp_partition
from streamctl.shard.engines.vllm_cpu.protocol import PROTOCOL_VERSION
from streamctl.shard.engines.vllm_cpu.worker_channel import Channel
from streamctl.shard.engines.vllm_cpu.worker_errors import WorkerError, classify_build_error, one_line

# safetensors dtype names <-> torch dtype names
SAFETENSORS_DTYPES: dict[str, str] = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "U16": "uint16",
    "I16": "int16",
    "U32": "uint32",
    "I32": "int32",
    "U64": "uint64",
    "I64": "int64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
}
TORCH_TO_SAFETENSORS = {torch_name: st_name for st_name, torch_name in SAFETENSORS_DTYPES.items()}

# What checkpoints and vLLM's model classes call the decoder-layer list: `model.layers` (Llama and most),
# `transformer.h` (GPT-2, Falcon, GPT-J, BLOOM, Qwen 1), `transformer.blocks` (MPT, DBRX).
_LAYER_LISTS = ("layers", "h", "blocks")
# The decoder-layer index of an HF tensor name (the language model's layers, not a vision or audio encoder's):
# what a pseudo stage is fed. The NaN poison check catches a tensor this rule fails to feed.
_HF_LAYER = re.compile(r"(?:^|\.)(?:" + "|".join(_LAYER_LISTS) + r")\.(\d+)\.")
_NOT_DECODER = ("vision", "visual", "audio", "encoder", "mm_projector", "multi_modal")


def hf_layer_index(name: str) -> int | None:
    if any(word in name for word in _NOT_DECODER):
        return None
    match = _HF_LAYER.search(name)
    return int(match.group(1)) if match else None


WHOLE_RANK = -2  # the "layer" of every name of a model built a whole rank at a time (no pipeline stages)


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    dtype: str  # safetensors name
    shape: tuple[int, ...]  # TP rank 0's
    layer: int = -1
    rank_shapes: tuple[tuple[int, ...], ...] = ()  # every TP rank's, where they differ (EP over uneven experts)

    def shape_on(self, tp_rank: int) -> tuple[int, ...]:
        return self.rank_shapes[tp_rank] if self.rank_shapes else self.shape


@dataclass
class Plan:
    """The last plan: what write and check refer to."""

    request: dict[str, Any]
    tp: int
    pp: int
    ep: bool
    partition: str | None
    num_layers: int
    stage_layers: list[tuple[int, int]]
    stages: list[dict[str, PlannedTensor]]  # per pp_rank: name -> tensor, in state-dict order
    hf_tensors: dict[str, dict[str, Any]]
    quantization: str | None = None
    sent: dict[tuple[int, int], dict[str, str]] = field(default_factory=dict)  # (pp, tp) -> name -> sha256
    global_feeders: set[int] = field(default_factory=set)  # pseudo stages fed the non-layer HF tensors too
    layerwise: bool = True  # False: the model has no pipeline stages, every rank is built whole (WHOLE_RANK)

    hf_by_layer: dict[int | None, list[str]] = field(default_factory=dict)  # HF names by decoder layer

    def __post_init__(self) -> None:
        for name in self.hf_tensors:
            self.hf_by_layer.setdefault(hf_layer_index(name), []).append(name)

    def hf_names_of_layer(self, layer: int) -> list[str]:
        """The HF tensors pseudo stage `layer` is fed: its decoder layer's, and on the first and last pseudo
        stage (and any other that produces a non-layer name) every tensor outside the decoder layers
        (embeddings, vision tower, norm, head)."""
        if layer == WHOLE_RANK:
            return list(self.hf_tensors)
        names = list(self.hf_by_layer.get(layer, []))
        if layer in (0, self.num_layers - 1) or layer in self.global_feeders:
            names += self.hf_by_layer.get(None, [])
        return names


def make_vllm_config(
    request: dict[str, Any], load_format: str = "auto", pattern: str | None = None, model_weights: str = ""
) -> Any:
    """A fresh VllmConfig (one per model instance: attention layers register their names in it), compilation
    off: otherwise every model registers a bound method as a global torch._dynamo bytecode hook that is never
    removed (vllm/compilation/wrapper.py), and no built model is ever freed."""
    from vllm.config import CompilationConfig, CompilationMode, LoadConfig, ModelConfig, ParallelConfig, VllmConfig

    model_config = ModelConfig(
        model=request["model_dir"],
        skip_tokenizer_init=True,
        dtype=request.get("dtype") or "auto",
        model_weights=model_weights,
    )
    extra = {"pattern": pattern} if pattern else {}
    return VllmConfig(
        model_config=model_config,
        load_config=LoadConfig(load_format=load_format, model_loader_extra_config=extra, use_tqdm_on_load=False),
        parallel_config=ParallelConfig(enable_expert_parallel=bool(request.get("ep"))),
        compilation_config=CompilationConfig(mode=CompilationMode.NONE),
    )


def config_or_refusal(request: dict[str, Any]) -> Any:
    try:
        return make_vllm_config(request)
    except Exception as error:
        message = one_line(error)
        lowered = message.lower()
        if "architecture" in lowered and ("not supported" in lowered or "failed to be inspected" in lowered):
            raise WorkerError("unsupported-architecture", message) from error
        if "quantiz" in lowered:
            raise WorkerError("unsupported-quantization", message) from error
        if "divisible" in lowered:
            raise WorkerError("bad-parallel-size", message) from error
        # Anything else vLLM's ModelConfig raised is its verdict on config.json (a field this vLLM reads and
        # the file lacks, a value it rejects): the checkpoint's to fix, in vLLM's words.
        raise WorkerError("bad-checkpoint", f"vLLM's ModelConfig does not accept config.json: {message}") from error


def meta_tensors(vllm_config: Any) -> tuple[list[PlannedTensor], Any]:
    """The tensors `_filter_subtensors` keeps for the emulated rank, in its order, from a meta build (no
    memory). data_ptr() is 0 on meta, so aliases (tied embeddings) are decided by parameter identity, the
    filter's rule for whole-tensor aliases: the group sits where its first name is, and keeps its smallest."""
    model = vllm_compat.build_model(vllm_config, "meta")
    groups: dict[int, list[tuple[str, Any]]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if tensor.numel():
            groups.setdefault(id(tensor), []).append((name, tensor))
    kept = []
    for group in groups.values():
        name, tensor = min(group, key=lambda item: item[0])
        dtype = TORCH_TO_SAFETENSORS.get(str(tensor.dtype).removeprefix("torch."))
        if dtype is None:
            raise WorkerError("internal", f"{name}: dtype {tensor.dtype} has no safetensors name")
        kept.append(PlannedTensor(name, dtype, tuple(int(n) for n in tensor.shape)))
    return kept, model


def _decoder_layers_built(model: Any) -> int:
    """How many decoder layers a (pseudo-stage) model really built (the longest `layers` ModuleList)."""
    import torch

    lists = [
        module
        for name, module in model.named_modules()
        if (name.endswith("layers") or name.rsplit(".", 1)[-1] in _LAYER_LISTS)
        and isinstance(module, torch.nn.ModuleList)
        and not any(word in name for word in _NOT_DECODER)
    ]
    if not lists:
        return 0
    return sum(1 for layer in max(lists, key=len) if not vllm_compat.is_pp_missing(layer))


def _describe_difference(first: list[PlannedTensor], other: list[PlannedTensor]) -> str:
    a, b = {t.name: t for t in first}, {t.name: t for t in other}
    only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    if only_a or only_b:
        return f"names only on TP rank 0: {only_a[:5]}, only on this rank: {only_b[:5]}"
    changed = [n for n in a if a[n] != b[n]][:3]
    if changed:
        return "; ".join(f"{n}: {a[n].dtype}{list(a[n].shape)} vs {b[n].dtype}{list(b[n].shape)}" for n in changed)
    return "the same names in a different order"


def plan_stage_names(
    request: dict[str, Any], plan: Plan, pp_rank: int, quantization: str | None
) -> tuple[list[PlannedTensor], set[str]]:
    """Meta builds of every TP rank of real stage pp_rank: one list (TP rank 0's), and the build-only shims
    the builds looked up. Every rank must hold the same names and dtypes in the same order; shapes may differ
    only under expert parallelism (vLLM gives the first ranks one expert more when EP does not divide the
    experts, determine_expert_map), and then the tensor carries every rank's (rank_shapes)."""
    ranks: list[list[PlannedTensor]] = []
    shims: set[str] = set()
    for tp_rank in range(plan.tp):
        with pp_partition(plan.partition), emulate_rank(plan.tp, tp_rank, plan.pp, pp_rank):
            try:
                tensors, model = meta_tensors(make_vllm_config(request))
            except Exception as error:
                raise classify_build_error(error, quantization) from error
        if quantization and tp_rank == 0:
            refuse_unsplittable(model, plan.tp)
        shims.update(vllm_shims.used_by(model))
        del model
        same_names = [(t.name, t.dtype) for t in tensors] == [(t.name, t.dtype) for t in ranks[0]] if ranks else True
        if ranks and (not same_names or (tensors != ranks[0] and not plan.ep)):
            raise WorkerError(
                "internal",
                f"stage {pp_rank}: TP rank {tp_rank}'s tensors differ from TP rank 0's: "
                + _describe_difference(ranks[0], tensors),
            )
        ranks.append(tensors)
    merged = []
    for index, tensor in enumerate(ranks[0]):
        shapes = tuple(rank[index].shape for rank in ranks)
        merged.append(replace(tensor, rank_shapes=shapes) if len(set(shapes)) > 1 else tensor)
    return merged, shims


def refuse_unsplittable(model: Any, tp: int) -> None:
    """A quantized layer whose TP share is not whole int32 words or quantization groups (vllm_wna16), or not
    whole FP8 blocks (vllm_quantized)."""
    problems = vllm_wna16.split_problems(model, tp) + vllm_quantized.block_split_problems(model, tp)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise WorkerError("bad-parallel-size", problems[0] + more)


def _choose_layer(name: str, candidates: list[int], num_layers: int) -> int:
    """The producing pseudo stage of a name more than one holds (Mixtral builds its norm on every stage): the
    name's own decoder layer, else a first/last pseudo stage (they are fed the non-layer HF tensors), else
    the first (it is then fed them too: Plan.global_feeders)."""
    index = hf_layer_index(name)
    if index in candidates:
        return index
    edges = [layer for layer in candidates if layer in (0, num_layers - 1)]
    return (edges or candidates)[0]


def producing_layers(request: dict[str, Any], plan: Plan, pp_rank: int, tensors: list[PlannedTensor]) -> dict[str, int]:
    """name -> the pseudo stage (decoder layer) that produces it, from meta builds of the stage's pseudo
    stages at TP rank 0; every pseudo stage must build exactly one decoder layer."""
    start, end = plan.stage_layers[pp_rank]
    ones = ",".join(["1"] * plan.num_layers)
    wanted = {t.name: t for t in tensors}
    candidates: dict[str, list[int]] = {}
    for layer in range(start, end):
        with pp_partition(ones), emulate_rank(plan.tp, 0, plan.num_layers, layer):
            try:
                pseudo, model = meta_tensors(make_vllm_config(request))
            except Exception as error:
                raise classify_build_error(error, plan.quantization) from error
        built = _decoder_layers_built(model)
        del model
        if built != 1:
            raise WorkerError(
                "internal",
                f"pseudo stage {layer} of {plan.num_layers} built {built} decoder layers, not 1: this model's "
                "layer count is not its config's num_hidden_layers",
            )
        for tensor in pseudo:
            real = wanted.get(tensor.name)
            if real is not None:
                if (real.dtype, real.shape) != (tensor.dtype, tensor.shape):
                    raise WorkerError("internal", f"{tensor.name}: pseudo stage {layer} has a different shape")
                candidates.setdefault(tensor.name, []).append(layer)
    missing = [name for name in wanted if name not in candidates]
    if missing:
        raise WorkerError(
            "internal", f"stage {pp_rank}: no pseudo stage of one layer produces {missing[:5]} (of {len(missing)})"
        )
    return {name: _choose_layer(name, layers, plan.num_layers) for name, layers in candidates.items()}


def _checked_hf_tensors(request: dict[str, Any]) -> dict[str, dict[str, Any]]:
    import torch

    tensors = request.get("tensors")
    if not isinstance(tensors, dict) or not tensors:
        raise WorkerError("bad-checkpoint", "the plan request lists no source tensors")
    for name, entry in tensors.items():
        if not isinstance(entry, dict) or not {"file", "dtype", "shape", "offset", "nbytes"} <= set(entry):
            raise WorkerError("protocol", f"plan: tensor {name!r} needs file, dtype, shape, offset and nbytes")
        torch_name = SAFETENSORS_DTYPES.get(str(entry.get("dtype")))
        if torch_name is None:
            raise WorkerError("bad-checkpoint", f"{name}: dtype {entry.get('dtype')!r} is not a safetensors dtype")
        count = 1
        for size in entry["shape"]:
            count *= int(size)
        if count * getattr(torch, torch_name).itemsize != int(entry["nbytes"]):
            raise WorkerError("bad-checkpoint", f"{name}: {entry['nbytes']} bytes do not fit {entry['shape']}")
    return tensors


def op_plan(channel: Channel, request: dict[str, Any]) -> Plan:
    from vllm.config import ParallelConfig

    if request.get("protocol") != PROTOCOL_VERSION:
        raise WorkerError("protocol", f"protocol {request.get('protocol')!r}, this worker speaks {PROTOCOL_VERSION}")
    vllm_shims.install()
    hf_tensors = _checked_hf_tensors(request)
    tp, pp, ep = int(request.get("tp", 1)), int(request.get("pp", 1)), bool(request.get("ep"))
    partition = request.get("layer_partition")
    if isinstance(partition, list):
        partition = ",".join(str(int(n)) for n in partition)
    config = config_or_refusal(request)
    model_config = config.model_config
    quantization = model_config.quantization
    refusal = vllm_quantized.refusal_before_build(quantization)
    if refusal:
        raise WorkerError("unsupported-quantization", refusal)
    try:
        model_config.verify_with_parallel_config(
            ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp, enable_expert_parallel=ep)
        )
        layerwise = bool(model_config.is_pp_supported)  # pp > 1 without it: vLLM refused just above
        num_layers = int(getattr(model_config.hf_text_config, "num_hidden_layers", 0) or 0)
        if layerwise and num_layers < 1:
            raise WorkerError("bad-checkpoint", "config.json gives no num_hidden_layers for the model's layers")
        stage_layers = vllm_compat.stage_layers(num_layers, pp, partition)
    except Exception as error:
        raise WorkerError("bad-parallel-size", one_line(error)) from error
    plan = Plan(
        request, tp, pp, ep, partition, num_layers, stage_layers, [], hf_tensors, quantization, layerwise=layerwise
    )
    used: set[str] = set()
    for pp_rank in range(pp):
        tensors, stage_shims = plan_stage_names(request, plan, pp_rank, quantization)
        used |= stage_shims
        if layerwise:
            layer_of = producing_layers(request, plan, pp_rank, tensors)
        else:
            layer_of = dict.fromkeys((t.name for t in tensors), WHOLE_RANK)
        plan.stages.append({t.name: replace(t, layer=layer_of[t.name]) for t in tensors})
        plan.global_feeders |= {layer_of[t.name] for t in tensors if hf_layer_index(t.name) is None}
    gc.collect()
    channel.send(_plan_reply(plan, config, quantization, sorted(used)))
    return plan


def _tensor_entry(tensor: PlannedTensor) -> dict[str, Any]:
    entry = {"name": tensor.name, "dtype": tensor.dtype, "shape": list(tensor.shape), "layer": tensor.layer}
    if tensor.rank_shapes:
        entry["rank_shapes"] = [list(shape) for shape in tensor.rank_shapes]
    return entry


def _plan_reply(plan: Plan, config: Any, quantization: str | None, shims: list[str]) -> dict[str, Any]:
    import torch
    import vllm

    served = TORCH_TO_SAFETENSORS[str(config.model_config.dtype).removeprefix("torch.")]
    architecture = config.model_config.architectures[0] if config.model_config.architectures else None
    return {
        "type": "plan",
        "vllm_version": vllm.__version__,
        "torch_version": torch.__version__,
        "architecture": architecture,
        "served_dtype": served,
        "num_layers": plan.num_layers,
        "layerwise": plan.layerwise,
        "quantization": quantization,
        "shims": shims,
        "stages": [
            {
                "pp_rank": pp_rank,
                "layers": list(plan.stage_layers[pp_rank]),
                "tensors": [_tensor_entry(t) for t in stage.values()],
            }
            for pp_rank, stage in enumerate(plan.stages)
        ],
    }
