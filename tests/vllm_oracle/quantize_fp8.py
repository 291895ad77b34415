"""Quantize a tiny HF checkpoint to the 8-bit and MXFP4 formats people publish (vLLM oracle venv only: torch).

    quantize_fp8.py SRC DEST block       # DeepSeek-V3 / Qwen3-*-FP8: quant_method fp8, weight_block_size
                                         # [B, B] (FP8_BLOCK, default 16), `weight` float8_e4m3fn +
                                         # `weight_scale_inv` float32 per block; Qwen's routers in
                                         # modules_to_not_convert
    quantize_fp8.py SRC DEST ct          # compressed-tensors float-quantized, per-channel `weight_scale` [out, 1]
    quantize_fp8.py SRC DEST ct-tensor   # compressed-tensors float-quantized (llm-compressor's FP8): one
                                         # `weight_scale` [1] a weight, static `input_scale` [1]
    quantize_fp8.py SRC DEST ct-block    # compressed-tensors float-quantized, strategy block [B, B]:
                                         # `weight_scale` [ceil(out/B), ceil(in/B)]
    quantize_fp8.py SRC DEST ct-int8     # compressed-tensors int-quantized W8A8: int8 `weight`, per-channel
                                         # `weight_scale`, dynamic per-token int8 activations
    quantize_fp8.py SRC DEST mxfp4       # gpt-oss as published: quant_method mxfp4, experts as
                                         # `*_blocks` U8 [E, out, in/32, 16] (two e2m1 values a byte, low nibble
                                         # first) + `*_scales` U8 [E, out, in/32] (e8m0), biases kept
    quantize_fp8.py SRC DEST KIND@B      # blocks of B (block, ct-block) for this copy
    quantize_fp8.py SRC DEST KIND SRC2 DEST2 KIND2 ...   # several in one process (one torch import)
The 8-bit kinds quantize every 2-D linear weight of the decoder layers (not embeddings, norms, lm_head,
routers); mxfp4 quantizes the experts only, as gpt-oss does. Round to nearest: the values only need to be a
real checkpoint's of the format, not a good one.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Any

BLOCK = int(os.environ.get("FP8_BLOCK", "16"))
FP8_MAX = 448.0
KINDS = ("block", "ct", "ct-tensor", "ct-block", "ct-int8", "mxfp4")
ROUTERS = ("mlp.gate.weight", "block_sparse_moe.gate.weight", "mlp.router.weight")
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the FP4 values of codes 0-7; bit 3 is the sign


def is_linear(name: str, tensor) -> bool:
    return (
        tensor.dim() == 2
        and ".layers." in name
        and name.endswith(".weight")
        and "norm" not in name
        and not name.endswith(ROUTERS)
    )


def _blocks(w, block: int):
    """w padded to whole blocks, viewed [rows/B, B, cols/B, B]."""
    import torch

    rows, cols = w.shape
    pad = torch.zeros(-(-rows // block) * block, -(-cols // block) * block)
    pad[:rows, :cols] = w
    return pad, pad.view(pad.shape[0] // block, block, pad.shape[1] // block, block)


def quantize_weight(kind: str, w) -> dict[str, Any]:
    """suffix -> tensor for one [out, in] weight (blocks of BLOCK)."""
    import torch

    w = w.float()
    if kind in ("block", "ct-block"):
        pad, blocks = _blocks(w, BLOCK)
        scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
        q = (blocks / scale[:, None, :, None]).view_as(pad)[: w.shape[0], : w.shape[1]]
        return {"weight": q.to(torch.float8_e4m3fn), "weight_scale_inv" if kind == "block" else "weight_scale": scale}
    if kind == "ct-int8":
        scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127.0
        return {"weight": (w / scale).round().clamp(-128, 127).to(torch.int8), "weight_scale": scale}
    if kind == "ct-tensor":  # llm-compressor's FP8 scheme: static per-tensor input scales too
        scale = w.abs().amax().clamp(min=1e-12).reshape(1) / FP8_MAX
        # one activation range for every linear layer: what a calibration gives modules that share an input
        input_scale = torch.full((1,), 0.02)
        return {"weight": (w / scale).to(torch.float8_e4m3fn), "weight_scale": scale, "input_scale": input_scale}
    else:
        scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return {"weight": (w / scale).to(torch.float8_e4m3fn), "weight_scale": scale}


def mxfp4(w) -> tuple[Any, Any]:
    """[E, out, in] -> (blocks U8 [E, out, in/32, 16], scales U8 [E, out, in/32]), OCP MX: e8m0 shared
    exponents, e2m1 values, two a byte (element 2k in the low nibble)."""
    import torch

    experts, rows, cols = w.shape
    groups = w.float().reshape(experts, rows, cols // 32, 32)
    amax = groups.abs().amax(dim=-1, keepdim=True).clamp(min=2.0**-126)
    exponent = torch.floor(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)
    values = torch.tensor(E2M1)
    codes = (scaled.abs().unsqueeze(-1) - values).abs().argmin(dim=-1).to(torch.uint8)
    codes |= (scaled < 0).to(torch.uint8) << 3
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), (exponent.squeeze(-1) + 127).to(torch.uint8)


def quantize_experts(out: dict[str, Any], name: str, w) -> bool:
    """gpt-oss's transformers layout (gate_up_proj [E, hidden, 2 x inter], down_proj [E, inter, hidden])
    as the published checkpoint holds it: [E, out, in] blocks and scales."""
    if not name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
        return False
    blocks, scales = mxfp4(w.transpose(1, 2))
    out[name + "_blocks"], out[name + "_scales"] = blocks, scales
    return True


def quantization_config(kind: str, routers: list[str]) -> dict[str, Any]:
    if kind == "block":
        return {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "weight_block_size": [BLOCK, BLOCK],
            # Qwen3-*-FP8's MoE checkpoints list their routers (kept in bf16) by full name (vLLM matches exactly)
            "modules_to_not_convert": ["lm_head", *routers],
        }
    if kind == "mxfp4":
        return {
            "quant_method": "mxfp4",
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
        }
    integer = kind == "ct-int8"
    strategy = {"ct": "channel", "ct-int8": "channel", "ct-tensor": "tensor", "ct-block": "block"}[kind]
    weights: dict[str, Any] = {
        "num_bits": 8,
        "type": "int" if integer else "float",
        "strategy": strategy,
        "symmetric": True,
        "dynamic": False,
    }
    if strategy == "block":
        weights["block_structure"] = [BLOCK, BLOCK]
    activations = {
        "num_bits": 8,
        "type": "int" if integer else "float",
        "strategy": {"block": "group", "tensor": "tensor"}.get(strategy, "token"),
        "symmetric": True,
        "dynamic": strategy != "tensor",
    }
    if strategy == "block":
        activations["group_size"] = BLOCK
    return {
        "quant_method": "compressed-tensors",
        "format": "int-quantized" if integer else "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": activations}},
        "ignore": ["lm_head", "re:.*mlp.gate$", "re:.*block_sparse_moe.gate$", "re:.*mlp.router$"],
    }


def main(src: str, dest: str, kind: str) -> None:
    global BLOCK
    from safetensors.torch import load_file, save_file

    kind, _, block = kind.partition("@")
    BLOCK = int(block) if block else int(os.environ.get("FP8_BLOCK", "16"))
    if kind not in KINDS:
        sys.exit(f"quantize_fp8.py: kind {kind!r}, not one of {', '.join(KINDS)}")
    os.makedirs(dest, exist_ok=True)
    for name in os.listdir(src):
        if not name.endswith(".safetensors"):
            shutil.copy2(os.path.join(src, name), dest)
    out: dict[str, Any] = {}
    routers: list[str] = []
    for path in sorted(p for p in os.listdir(src) if p.endswith(".safetensors")):
        for name, w in load_file(os.path.join(src, path)).items():
            if kind == "mxfp4":
                if not quantize_experts(out, name, w):
                    out[name] = w
            elif is_linear(name, w):
                for suffix, tensor in quantize_weight(kind, w).items():
                    out[name.removesuffix("weight") + suffix] = tensor.contiguous()
            else:
                out[name] = w
            if name.endswith(ROUTERS):
                routers.append(name.removesuffix(".weight"))
    save_file(out, os.path.join(dest, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as handle:
        config = json.load(handle)
    # Qwen3-*-FP8 list their routers; DeepSeek-V3/R1 list nothing (vLLM builds their gate unquantized)
    listed = routers if str(config.get("model_type", "")).startswith("qwen") else []
    config["quantization_config"] = quantization_config(kind, listed)
    with open(os.path.join(dest, "config.json"), "w") as handle:
        json.dump(config, handle, indent=2)


if __name__ == "__main__":
    if not sys.argv[1:] or len(sys.argv[1:]) % 3:
        sys.exit(f"usage: quantize_fp8.py SRC DEST KIND [SRC DEST KIND ...]; KIND: {', '.join(KINDS)}")
    for at in range(1, len(sys.argv), 3):
        main(*sys.argv[at : at + 3])
