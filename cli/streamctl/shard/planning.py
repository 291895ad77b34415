"""Planning a shard run: read SOURCE's config.json and safetensors headers (small reads only), check every
constraint vLLM's layout puts on them, and lay out every output file (`plan_shard`)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from streamctl.checkpoint.files import (
    CONFIG_NAME,
    MAX_CONFIG_BYTES,
    MISTRAL_PARAMS_NAME,
    other_weight_format,
    read_config_references,
    select_serving_files,
    skipped_because,
)
from streamctl.checkpoint.index import INDEX_NAME, MAX_INDEX_BYTES, parse_index
from streamctl.checkpoint.safetensors import HEADER_LENGTH_BYTES, decode_json_strictly, parse_header, read_header
from streamctl.checkpoint.sharded_names import default_pattern, pattern_fields, validate_pattern
from streamctl.checkpoint.vllm_layouts import (
    EMBED_RULE,
    FINAL_NORM_RULE,
    LM_HEAD_RULE,
    SCALE_BUFFER_DTYPE,
    TIED_LM_HEAD_RULE,
    VOCAB_PADDING,
    ArchitectureLayout,
    LayoutRow,
    Split,
    TensorRule,
    installed_vllm_version,
    layout_row,
)
from streamctl.dest.overlap import check_disjoint
from streamctl.errors import NotFoundError, UsageError
from streamctl.shard.dest import plan_dest
from streamctl.shard.plan import (
    DTYPE_CHOICES,
    DtypeChoice,
    ModelDims,
    PlannedTensor,
    ShardOptions,
    ShardPlan,
    SourceTensor,
    StagePlan,
    pipeline_stages,
    rank_segments,
    segments_shape,
    split_into_parts,
)
from streamctl.storage.base import Location

CASTABLE_DTYPES = frozenset({"BF16", "F16", "F32"})
# Hugging Face checkpoints of old models carry rotary caches that vLLM's loaders skip.
IGNORED_SOURCE_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def _read_small(location: Location, name: str, size: int, limit: int = MAX_CONFIG_BYTES) -> bytes:
    if size > limit:
        raise UsageError(f"{location.store.url(location.key(name))} is {size:,} bytes; refusing to read it as JSON")
    return location.store.read_range(location.key(name), 0, size)


def read_json_object(location: Location, name: str, size: int) -> dict[str, Any]:
    document = decode_json_strictly(_read_small(location, name, size), what=name)
    if document.error is not None or not isinstance(document.value, dict):
        why = f" ({document.error.message})" if document.error is not None else ""
        raise UsageError(
            f"{location.store.url(location.key(name))} is not a JSON object{why}",
            hint="verify-index SOURCE reports what is wrong with it (config-invalid)",
        )
    return document.value


def _engine_hint() -> str:
    return "use --engine vllm-cpu (or auto), which lays the files out with vLLM's own model code on the CPU"


def _int_field(config: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UsageError(f"config.json: {key} must be a positive integer, not {value!r}")
    return value


def read_dims(config: Mapping[str, Any], layout: ArchitectureLayout, architecture: str) -> ModelDims:
    hidden = _int_field(config, "hidden_size")
    heads = _int_field(config, "num_attention_heads")
    kv_heads = _int_field(config, "num_key_value_heads", heads)
    configured_head_dim = config.get("head_dim")
    derived_head_dim = hidden // heads
    if layout.head_dim_from_config and configured_head_dim is not None:
        head_dim = _int_field(config, "head_dim")
    else:
        if configured_head_dim not in (None, derived_head_dim):
            raise UsageError(
                f"config.json: head_dim {configured_head_dim} differs from hidden_size / num_attention_heads "
                f"({derived_head_dim}), which vLLM's {architecture} always uses",
                hint=_engine_hint(),
            )
        head_dim = derived_head_dim
    if heads % kv_heads:
        raise UsageError(
            f"config.json: num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv_heads})"
        )
    return ModelDims(
        architecture=architecture,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=_int_field(config, "intermediate_size"),
        vocab_size=_int_field(config, "vocab_size"),
        num_layers=_int_field(config, "num_hidden_layers"),
        tied=bool(config.get("tie_word_embeddings", False)),  # False is the default of all four configs
    )


def check_tensor_parallel(dims: ModelDims, tp: int) -> None:
    """vLLM's constraints on the TP size; UsageError naming the constraint and the values."""
    if dims.num_heads % tp:
        raise UsageError(f"--tensor-parallel-size {tp} does not divide num_attention_heads ({dims.num_heads})")
    if dims.num_kv_heads % tp and tp % dims.num_kv_heads:
        raise UsageError(
            f"--tensor-parallel-size {tp} must divide num_key_value_heads ({dims.num_kv_heads}) or be a multiple of it"
        )
    if dims.intermediate_size % tp:
        raise UsageError(f"--tensor-parallel-size {tp} does not divide intermediate_size ({dims.intermediate_size})")
    if dims.padded_vocab_size % tp:
        raise UsageError(
            f"--tensor-parallel-size {tp} does not divide the padded vocabulary ({dims.padded_vocab_size}: "
            f"vocab_size {dims.vocab_size} rounded up to a multiple of {VOCAB_PADDING})"
        )


def read_config(source: Location, listing: SourceListing) -> dict[str, Any]:
    """SOURCE's config.json, which every engine needs (NotFoundError naming why it is missing)."""
    if CONFIG_NAME not in listing.sizes:
        weight_files(source, listing)  # a Mistral or Meta layout explains the missing config better
        raise NotFoundError(f"no {CONFIG_NAME} under {source.url}{skipped_because(source, CONFIG_NAME)}")
    return read_json_object(source, CONFIG_NAME, listing.sizes[CONFIG_NAME])


def quantization_method(config: Mapping[str, Any]) -> str | None:
    """The checkpoint's quantization method (its `quant_method`, else "quantization_config"); None when
    config.json declares none."""
    quantization = config.get("quantization_config")
    if quantization is None:
        return None
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    return str(method) if method else "quantization_config"


def _check_supported(config: Mapping[str, Any], row: LayoutRow) -> tuple[str, ArchitectureLayout]:
    method = quantization_method(config)
    if method is not None:
        raise UsageError(
            f"the checkpoint is quantized ({method}); the offline writer handles unquantized checkpoints only",
            hint=_engine_hint(),
        )
    architectures = config.get("architectures")
    if not isinstance(architectures, list) or len(architectures) != 1 or not isinstance(architectures[0], str):
        raise UsageError(
            f"config.json: architectures must name one model class, not {architectures!r}", hint=_engine_hint()
        )
    architecture = architectures[0]
    layout = row.architecture(architecture)
    if layout is None:
        raise UsageError(
            f"{architecture} is not supported by the offline writer ({', '.join(row.supported_architectures)})",
            hint=_engine_hint(),
        )
    if config.get("hidden_act", "silu") != "silu":
        raise UsageError(
            f"config.json: hidden_act {config.get('hidden_act')!r}; vLLM's {architecture} supports silu only"
        )
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if isinstance(rope, dict) and rope.get("use_fope"):
        raise UsageError(
            "Fourier rotary embeddings (use_fope) carry parameters the offline writer does not lay out",
            hint=_engine_hint(),
        )
    if config.get("ada_rms_norm_t_cond"):
        raise UsageError("ada_rms_norm_t_cond layers are not laid out by the offline writer", hint=_engine_hint())
    if "text_config" in config:
        raise UsageError(
            f"{architecture} with a nested text_config is not supported by the offline writer", hint=_engine_hint()
        )
    return architecture, layout


@dataclass(frozen=True)
class SourceListing:
    sizes: Mapping[str, int]  # every object, by path relative to the source
    etags: Mapping[str, str | None] = field(default_factory=dict)


def serving_files_to_copy(
    source: Location, listing: SourceListing, config: Mapping[str, Any]
) -> tuple[tuple[str, int], ...]:
    """(path, size) of what DEST gets beside the weights (config, tokenizer, custom code when auto_map, and
    what the configs reference, such as sentence-transformers module folders)."""
    referenced = read_config_references(source, listing.sizes, {"config.json": config} if config else {})
    paths = select_serving_files(listing.sizes, has_auto_map=bool(config.get("auto_map")), referenced=referenced)
    return tuple((path, listing.sizes[path]) for path in paths)


def list_source(source: Location) -> SourceListing:
    infos = {source.relative(info.key): info for info in source.list()}
    infos = {name: info for name, info in infos.items() if name}
    if not infos:
        raise NotFoundError(f"nothing found under {source.url}")
    return SourceListing(
        {name: info.size for name, info in infos.items()}, {name: info.etag for name, info in infos.items()}
    )


def weight_files(source: Location, listing: SourceListing) -> list[str]:
    top = {name: size for name, size in listing.sizes.items() if "/" not in name}
    if INDEX_NAME in top:
        files = parse_index(INDEX_NAME, _read_small(source, INDEX_NAME, top[INDEX_NAME], MAX_INDEX_BYTES)).files
        missing = [file for file in files if file not in top]
        if missing:
            raise NotFoundError(f"{INDEX_NAME} names {missing[0]}, which is not in {source.url}")
        return files
    files = sorted(name for name in top if name.endswith(".safetensors") and not name.startswith("consolidated"))
    if files:
        return files
    # Every engine reads these same files, so the hints point at the weights, not at another engine.
    if (
        any(name.startswith("consolidated") and name.endswith(".safetensors") for name in top)
        or MISTRAL_PARAMS_NAME in top
    ):
        raise UsageError(
            f"{source.url} holds Mistral-format consolidated weights, not Hugging Face safetensors",
            hint=_HF_FORMAT_HINT,
        )
    if any(name.startswith("original/") for name in listing.sizes):
        raise UsageError(
            f"{source.url} holds only Meta original/ weights, not Hugging Face safetensors", hint=_HF_FORMAT_HINT
        )
    others = sorted((name, what) for name in top if (what := other_weight_format(name)) is not None)
    if others:
        name, what = others[0]
        raise UsageError(
            f"{source.url} holds {what.split(' (')[0]} ({name}), not safetensors",
            hint="vLLM's sharded state and the Run:ai streamer read safetensors only: take the repo's safetensors "
            "weights, or convert these first (PyTorch or TensorFlow weights: transformers' from_pretrained, then "
            "save_pretrained writes model.safetensors)",
        )
    raise NotFoundError(f"no .safetensors files under {source.url}")


_HF_FORMAT_HINT = (
    "shard reads Hugging Face safetensors (config.json with model*.safetensors): take the repo's Hugging Face "
    "format weights, or convert these with transformers' conversion script for the model first"
)


def read_source_tensors(source: Location, listing: SourceListing, files: Sequence[str]) -> dict[str, SourceTensor]:
    tensors: dict[str, SourceTensor] = {}
    for file in files:
        size = listing.sizes[file]
        read = read_header(source.store, source.key(file), size)
        if read.header_json is None:
            assert read.problem is not None
            raise UsageError(f"{source.store.url(source.key(file))}: {read.problem.message}")
        header = parse_header(read.header_json, size)
        if not header.ok:
            problem = next(problem for problem in header.problems if problem.severity == "error")
            raise UsageError(f"{source.store.url(source.key(file))}: {problem.describe()}")
        data_start = HEADER_LENGTH_BYTES + header.header_length
        for info in header.tensors:
            if info.name in tensors:
                raise UsageError(f"tensor {info.name} is in both {tensors[info.name].file} and {file}")
            tensors[info.name] = SourceTensor(
                info.name, file, info.dtype, info.shape, data_start + info.begin, info.nbytes
            )
    return tensors


def _output_dtype(name: str, sources: Sequence[SourceTensor], choice: DtypeChoice) -> str:
    dtypes = {source.dtype for source in sources}
    target = DTYPE_CHOICES[choice]
    if target is None:
        if len(dtypes) != 1:
            raise UsageError(
                f"{name}: its sources have different dtypes ({', '.join(sorted(dtypes))})", hint="pass --dtype"
            )
        return dtypes.pop()
    uncastable = sorted(dtypes - CASTABLE_DTYPES)
    if uncastable:
        raise UsageError(f"{name}: cannot cast {uncastable[0]} to {target}; --dtype handles BF16, F16 and F32 sources")
    return target


def _stage_rules(
    row: LayoutRow,
    layout: ArchitectureLayout,
    config: Mapping[str, Any],
    dims: ModelDims,
    layers: range,
    first: bool,
    last: bool,
) -> Iterator[tuple[str, TensorRule]]:
    """(vLLM name, rule) for every tensor of one stage, in the order vLLM's save iterates them."""
    if last and dims.tied:
        # The embedding and lm_head share storage: `_filter_subtensors` keeps lm_head.weight, at the
        # position of the shared storage's first name (the embedding's, first in the state dict).
        yield TIED_LM_HEAD_RULE.name, TIED_LM_HEAD_RULE
    elif first:
        yield EMBED_RULE.name, EMBED_RULE
    for layer in layers:
        prefix = f"model.layers.{layer}."
        for rule in layout.layer_rules:
            if rule.split is Split.SCALE_ONE:
                for buffer in row.attention_scale_buffers:
                    yield f"{prefix}{rule.name}.{buffer}", rule
            elif rule.when is None or layout.features[rule.when](config):
                sources = tuple(prefix + source for source in rule.sources)
                yield prefix + rule.name, TensorRule(prefix + rule.name, rule.split, sources)
    if last:
        yield FINAL_NORM_RULE.name, FINAL_NORM_RULE
        if not dims.tied:
            yield LM_HEAD_RULE.name, LM_HEAD_RULE


def _plan_tensor(
    name: str, rule: TensorRule, tensors: Mapping[str, SourceTensor], dims: ModelDims, tp: int, dtype: DtypeChoice
) -> PlannedTensor:
    if rule.split is Split.SCALE_ONE:
        return PlannedTensor(name, rule.split, (), SCALE_BUFFER_DTYPE, ())
    missing = [source for source in rule.sources if source not in tensors]
    if missing:
        raise UsageError(f"the checkpoint lacks {missing[0]}, which {name} is built from")
    sources = tuple(tensors[source] for source in rule.sources)
    quantized = sorted({source.dtype for source in sources if source.dtype.startswith(("F8", "F6", "F4"))})
    if quantized:
        raise UsageError(
            f"{name}: {quantized[0]} weights are quantized; the offline writer handles unquantized ones only",
            hint=_engine_hint(),
        )
    shapes = [source.shape for source in sources]
    _check_source_shapes(rule, name, shapes, dims, tp)
    shape = segments_shape(rank_segments(rule.split, shapes, dims, tp, 0), shapes)
    return PlannedTensor(name, rule.split, sources, _output_dtype(name, sources, dtype), shape)


def _check_every_source_used(tensors: Mapping[str, SourceTensor], stages: Sequence[StagePlan], tied: bool) -> None:
    used = {source.name for stage in stages for tensor in stage.tensors for source in tensor.sources}
    ignorable = {"lm_head.weight"} if tied else set()
    unknown = sorted(
        name
        for name in tensors
        if name not in used and name not in ignorable and not name.endswith(IGNORED_SOURCE_SUFFIXES)
    )
    if unknown:
        shown = ", ".join(unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
        raise UsageError(
            f"the checkpoint holds tensors the layout table has no place for: {shown}", hint=_engine_hint()
        )


def _check_source_shapes(
    rule: TensorRule, name: str, shapes: Sequence[tuple[int, ...]], dims: ModelDims, tp: int
) -> None:
    """The source tensors must have the shapes config.json implies; otherwise the split would be wrong."""

    def refuse(expected: str) -> UsageError:
        got = ", ".join(f"{source} {list(shape)}" for source, shape in zip(rule.sources, shapes, strict=False))
        return UsageError(f"{name}: source tensors have shapes {got}; config.json implies {expected}")

    if rule.split is Split.VOCAB_ROWS:
        if len(shapes[0]) != 2 or shapes[0][0] != dims.vocab_size:
            raise refuse(f"[vocab_size={dims.vocab_size}, hidden_size={dims.hidden_size}]")
    elif rule.split is Split.QKV_ROWS:
        q_rows, kv_rows = dims.num_heads * dims.head_dim, dims.num_kv_heads * dims.head_dim
        if (
            not all(shapes)
            or [shape[0] for shape in shapes] != [q_rows, kv_rows, kv_rows]
            or len({shape[1:] for shape in shapes}) != 1
        ):
            raise refuse(f"{q_rows}, {kv_rows} and {kv_rows} rows (heads x head_dim {dims.head_dim})")
    elif rule.split is Split.MERGED_ROWS:
        if not all(shapes) or len({shape[1:] for shape in shapes}) != 1 or any(shape[0] % tp for shape in shapes):
            raise refuse(f"rows divisible by TP {tp} and equal trailing dimensions")
    elif rule.split is Split.COLUMNS and (len(shapes[0]) != 2 or shapes[0][1] % tp):
        raise refuse(f"2 dimensions with the second divisible by TP {tp}")


def _checked_pattern(options: ShardOptions, row: LayoutRow, version: str | None) -> str:
    """The file name pattern (vLLM's default for the PP size unless given), checked against what the
    layout row's vLLM fills in and saves."""
    tp, pp = options.tensor_parallel_size, options.pipeline_parallel_size
    if pp > 1 and not row.pipeline_parallel:
        raise UsageError(f"vLLM {version} ({row.label}) saves sharded state without pipeline parallelism; use PP 1")
    pattern = options.pattern or default_pattern(pp)
    unsupported = set(pattern_fields(pattern)) - row.pattern_fields
    if unsupported:
        raise UsageError(
            f"pattern {pattern!r} uses {{{min(unsupported)}}}, which vLLM {version} ({row.label}) does not fill in",
            hint="that vLLM fills in " + ", ".join(f"{{{name}}}" for name in sorted(row.pattern_fields)),
        )
    validate_pattern(pattern, tp, pp)
    return pattern


def plan_shard(source: Location, dest: Location, options: ShardOptions, source_id: str | None = None) -> ShardPlan:
    """Read config.json and the source headers, check every constraint, and lay out every output file.

    Reads only small objects and headers; writes nothing.
    """
    options.validate()
    tp, pp = options.tensor_parallel_size, options.pipeline_parallel_size
    version = options.vllm_version if options.vllm_version is not None else installed_vllm_version()
    row = layout_row(version)
    pattern = _checked_pattern(options, row, version)
    check_disjoint(source, dest)

    listing = list_source(source)
    config = read_config(source, listing)
    architecture, layout = _check_supported(config, row)
    dims = read_dims(config, layout, architecture)
    check_tensor_parallel(dims, tp)
    stage_layers = pipeline_stages(dims.num_layers, pp, options.layer_partition)
    for pp_rank, layers in enumerate(stage_layers):
        if not layers and 0 < pp_rank < pp - 1:
            raise UsageError(
                f"pipeline stage {pp_rank} of {pp} gets no layers ({dims.num_layers} layers), "
                "so it would hold no tensors",
                hint="use fewer stages or set VLLM_PP_LAYER_PARTITION",
            )

    tensors = read_source_tensors(source, listing, weight_files(source, listing))
    stages = []
    for pp_rank, layers in enumerate(stage_layers):
        rules = _stage_rules(row, layout, config, dims, layers, pp_rank == 0, pp_rank == pp - 1)
        planned = [_plan_tensor(name, rule, tensors, dims, tp, options.dtype) for name, rule in rules]
        stages.append(StagePlan(pp_rank, layers, split_into_parts(planned, options.max_part_size)))
    _check_every_source_used(tensors, stages, dims.tied)

    plan = ShardPlan.for_run(
        source_id or source.url,
        dest.url,
        options,
        pattern,
        version,
        row=row,
        dims=dims,
        stages=tuple(stages),
        serving_files=serving_files_to_copy(source, listing, config),
        stale=(),
        tied_lm_head=tensors.get("lm_head.weight") if dims.tied else None,
        source_files=tuple(
            (name, listing.sizes[name], listing.etags.get(name)) for name in sorted({t.file for t in tensors.values()})
        ),
    )
    return plan_dest(dest, plan, options.force)
