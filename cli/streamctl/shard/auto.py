"""`--engine auto`: which engine shards a checkpoint, decided from its config.json: the offline writer for
what its layout table covers unquantized, vLLM's model code on the CPU for everything else."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from streamctl.checkpoint.files import CONFIG_NAME
from streamctl.checkpoint.vllm_layouts import LAYOUT_ROWS
from streamctl.progress import Progress
from streamctl.shard.plan import Engine, ShardOptions
from streamctl.shard.planning import list_source, quantization_method, read_json_object
from streamctl.storage.base import Location


def auto_engine(config: Mapping[str, Any] | None, options: ShardOptions) -> tuple[Engine, str]:
    """--engine auto: the offline writer for what its layout table covers unquantized, vLLM's model code
    on the CPU for everything else. (engine, why)."""
    if config is None:
        return "offline", "SOURCE has no config.json"
    architectures = config.get("architectures")
    architecture = architectures[0] if isinstance(architectures, list) and architectures else None
    method = quantization_method(config)
    if method is not None:
        return "vllm-cpu", f"the checkpoint is quantized ({method})"
    if options.enable_expert_parallel:
        return "vllm-cpu", "--enable-expert-parallel"
    if not isinstance(architecture, str) or all(row.architecture(architecture) is None for row in LAYOUT_ROWS):
        return "vllm-cpu", f"{architecture} is not in the offline writer's layout table"
    return "offline", f"{architecture} is in the offline writer's layout table"


def choose_engine(source: Location, options: ShardOptions, progress: Progress) -> ShardOptions:
    """`options` with --engine auto decided from SOURCE's config.json (and logged, with the reason)."""
    if options.engine != "auto":
        return options
    listing = list_source(source)
    config = read_json_object(source, CONFIG_NAME, listing.sizes[CONFIG_NAME]) if CONFIG_NAME in listing.sizes else None
    engine, why = auto_engine(config, options)
    progress.log(f"engine {engine}: {why}")
    return replace(options, engine=engine, vllm_python=None if engine == "offline" else options.vllm_python)
