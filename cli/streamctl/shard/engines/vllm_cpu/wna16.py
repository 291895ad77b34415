"""What a tensor-parallel split of a weight-only quantized linear layer needs (int4/int8 weights in int32 words:
AWQ, GPTQ, compressed-tensors pack-quantized), checked on the built (meta) model of a rank before anything is
written. Standard library only at import; the worker calls it inside the vLLM environment.

vLLM 0.33's parameter loaders (model_executor/parameter.py) cut each rank's share of a checkpoint tensor with
the sizes the method's `create_weights` computed by floor division: `RowvLLMParameter.load_row_parallel_weight`
narrows the input dimension by the rank's parameter size, `adjust_shard_indexes_for_packing` divides a fused
weight's output offsets by the pack factor. A share that is not a whole number of int32 words or of
quantization groups therefore loads the wrong rows without an error (AWQ and GPTQ do not check it; only
compressed-tensors' `verify_group_size_divides_partition` does, for the groups). Such a size truly cannot be
split, on any device: refused here, naming the tensor, the size and the rule. Everything else builds with the
method's own parameter layout (the CPU kernel's own size limits are no longer consulted: vllm_shims).
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from streamctl.shard.engines.vllm_cpu.shims import mp_kernel_of


def _number(value: Any) -> int | Fraction:
    """A pack factor as vLLM holds it (int, or compressed-tensors' Fraction(32, bits)) for messages and maths."""
    fraction = Fraction(value)
    return int(fraction) if fraction.denominator == 1 else fraction


def split_problems(model: Any, tp: int) -> list[str]:
    """One line per parameter of a WNA16 layer (one holding an MPLinearKernel) whose TP share cannot be cut
    from the checkpoint's tensor exactly."""
    problems = []
    for prefix, module in model.named_modules():
        kernel = mp_kernel_of(module)
        if kernel is None:
            continue
        config = kernel.config
        full_in, rank_in = int(config.full_weight_shape[0]), int(config.partition_weight_shape[0])
        channelwise = config.group_size in (None, -1)  # AWQ then takes the whole input as one group
        group = full_in if channelwise else int(config.group_size)
        shards = [
            int(size) for size in getattr(module, "output_partition_sizes", None) or [config.partition_weight_shape[1]]
        ]
        for name, param in module.named_parameters(recurse=False):
            problem = _parameter_problem(f"{prefix}.{name}", param, tp, full_in, rank_in, group, channelwise, shards)
            if problem:
                problems.append(problem)
    return problems


def _parameter_problem(
    tensor: str, param: Any, tp: int, full_in: int, rank_in: int, group: int, channelwise: bool, shards: list[int]
) -> str | None:
    packed_dim, factor = getattr(param, "packed_dim", None), getattr(param, "packed_factor", None)
    output_dim, input_dim = getattr(param, "output_dim", None), getattr(param, "input_dim", None)
    factor = _number(factor) if factor else None
    if factor and packed_dim is not None and packed_dim == output_dim and (tp > 1 or len(shards) > 1):
        bad = [size for size in shards if size % factor]
        if bad:
            fused = f" (its fused weights' shares: {shards})" if len(shards) > 1 else ""
            return (
                f"{tensor}: packs {factor} output channels into each int32, and TP {tp} gives a rank {bad[0]} output "
                f"channels of a weight{fused}, so vLLM's loader cannot cut the rank's share: every weight's output "
                f"size / TP must be a multiple of {factor}"
            )
    if input_dim is None or rank_in == full_in:
        return None  # the input is not split: the rank's tensor is the checkpoint's whole
    count = int(param.shape[input_dim])
    if factor and packed_dim == input_dim:
        unit: int | Fraction = factor
        what = f"int32 words of {factor} input channels"
    elif count == rank_in:
        return None  # one entry per input channel: any split is exact
    else:
        unit = group
        what = (
            f"quantization groups of {group} (group_size -1: one group over the whole input)"
            if channelwise
            else f"quantization groups of {group} (the checkpoint's group_size)"
        )
    if count * unit == rank_in:
        return None
    return (
        f"{tensor}: TP {tp} gives each rank {rank_in} of the {full_in} input channels, not a whole number of "
        f"{what}, so vLLM's loader cannot cut the rank's share: the input size / TP must be a multiple of {unit}"
    )
