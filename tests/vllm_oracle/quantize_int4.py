"""Quantize a tiny HF checkpoint to int4, in the three layouts vLLM loads (vLLM oracle venv only: torch).

    quantize_int4.py SRC DEST awq      # AutoAWQ GEMM: `qweight` [in, out/8] (AWQ's bit order), `qzeros`
                                       # [in/g, out/8], `scales` [in/g, out]; asymmetric (zero_point true)
    quantize_int4.py SRC DEST gptq     # AutoGPTQ: `qweight` [in/8, out], `qzeros` [in/g, out/8] (zero - 1),
                                       # `scales` [in/g, out], `g_idx` [in]; symmetric, desc_act false
    quantize_int4.py SRC DEST ct       # compressed-tensors pack-quantized W4A16: `weight_packed` [out, in/8],
                                       # `weight_scale` [out, in/g], `weight_shape` [2]; symmetric, group
    quantize_int4.py SRC DEST KIND@G   # group size G (default 32)
    quantize_int4.py SRC DEST KIND SRC2 DEST2 KIND2 ...   # several in one process (one torch import)
Every 2-D linear weight of the decoder layers is quantized
(not embeddings, norms, lm_head); scales keep the checkpoint's dtype. Round to nearest, one group at a time:
the values only need to be a real int4 checkpoint's, not a good one.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

KINDS = ("awq", "gptq", "ct")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's: nibble i of an int32 holds column 8c + AWQ_ORDER[i]


def is_linear(name: str, tensor) -> bool:
    return tensor.dim() == 2 and ".layers." in name and name.endswith("_proj.weight")


def pack(values, dim: int, order=tuple(range(8))):
    """uint4 values (0..15), 8 to an int32 along `dim`, nibble i from position order[i] of each 8."""
    import torch

    values = values.to(torch.int64).movedim(dim, -1)
    groups = values.reshape(*values.shape[:-1], values.shape[-1] // 8, 8)
    packed = torch.zeros(groups.shape[:-1], dtype=torch.int64)
    for nibble, position in enumerate(order):
        packed |= groups[..., position] << (4 * nibble)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # the bits, as int32
    return packed.movedim(-1, dim).contiguous()


def quantize(kind: str, name: str, w, out: dict, group: int) -> None:
    """w: [out, in] in the checkpoint's dtype; the method's tensors for `name` (…_proj.weight) into out."""
    import torch

    dtype, base = w.dtype, name.removesuffix("weight")
    rows, cols = w.shape
    groups = w.float().reshape(rows, cols // group, group)  # [out, in/g, g]
    if kind == "awq":  # asymmetric: q = round(w / s) + z in 0..15
        low, high = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
        scale = ((high - low) / 15).clamp(min=1e-5)
        zero = (-low / scale).round().clamp(0, 15)
        q = ((groups / scale[..., None]).round() + zero[..., None]).clamp(0, 15).reshape(rows, cols)
        out[base + "qweight"] = pack(q.t(), 1, AWQ_ORDER)  # [in, out/8]
        out[base + "qzeros"] = pack(zero.t(), 1, AWQ_ORDER)  # [in/g, out/8]
        out[base + "scales"] = scale.t().to(dtype).contiguous()  # [in/g, out]
        return
    scale = (groups.abs().amax(-1) / 7).clamp(min=1e-5)  # symmetric: q = round(w / s) in -8..7
    q = (groups / scale[..., None]).round().clamp(-8, 7).reshape(rows, cols)
    if kind == "gptq":  # uint4b8: stored q + 8; zeros stored minus one (GPTQ v1)
        out[base + "qweight"] = pack(q.t() + 8, 0)  # [in/8, out]
        out[base + "qzeros"] = pack(torch.full((cols // group, rows), 7), 1)  # [in/g, out/8]
        out[base + "scales"] = scale.t().to(dtype).contiguous()  # [in/g, out]
        out[base + "g_idx"] = (torch.arange(cols) // group).to(torch.int32)
    else:  # compressed-tensors pack-quantized: q + 8 packed along the input
        out[base + "weight_packed"] = pack(q + 8, 1)  # [out, in/8]
        out[base + "weight_scale"] = scale.to(dtype).contiguous()  # [out, in/g]
        out[base + "weight_shape"] = torch.tensor([rows, cols], dtype=torch.int64)


def quantization_config(kind: str, group: int) -> dict:
    if kind == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    if kind == "gptq":
        return {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": group,
            "desc_act": False,
            "sym": True,
            "checkpoint_format": "gptq",
        }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "group",
                    "group_size": group,
                    "dynamic": False,
                },
                "input_activations": None,
                "output_activations": None,
                "format": "pack-quantized",
            }
        },
        "ignore": ["lm_head"],
    }


def main(src: str, dest: str, kind_group: str) -> None:
    from safetensors.torch import load_file, save_file

    kind, _, group_text = kind_group.partition("@")
    group = int(group_text or 32)
    os.makedirs(dest, exist_ok=True)
    for name in os.listdir(src):
        if not name.endswith(".safetensors"):
            shutil.copy2(os.path.join(src, name), dest)
    out: dict = {}
    for path in sorted(p for p in os.listdir(src) if p.endswith(".safetensors")):
        for name, w in load_file(os.path.join(src, path)).items():
            if is_linear(name, w):
                quantize(kind, name, w, out, group)
            else:
                out[name] = w
    save_file(out, os.path.join(dest, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as handle:
        config = json.load(handle)
    config["quantization_config"] = quantization_config(kind, group)
    with open(os.path.join(dest, "config.json"), "w") as handle:
        json.dump(config, handle, indent=2)


if __name__ == "__main__":
    if not sys.argv[1:] or len(sys.argv[1:]) % 3 or any(k.partition("@")[0] not in KINDS for k in sys.argv[3::3]):
        sys.exit("usage: quantize_int4.py SRC DEST awq|gptq|ct[@GROUP] [SRC DEST KIND ...]")
    for at in range(1, len(sys.argv), 3):
        main(*sys.argv[at : at + 3])
