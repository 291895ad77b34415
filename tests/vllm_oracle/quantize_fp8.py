"""Quantize a tiny HF checkpoint to FP8 (vLLM oracle venv only).

    quantize_fp8.py SRC DEST block      # DeepSeek-V3 style: quant_method fp8, weight_block_size [16, 16],
                                        # `weight` float8_e4m3fn + `weight_scale_inv` float32 per block
    quantize_fp8.py SRC DEST ct         # compressed-tensors float-quantized, per-channel `weight_scale`
    quantize_fp8.py SRC DEST KIND SRC2 DEST2 KIND2 ...   # several in one process (one torch import)
Every 2-D linear weight of the decoder layers is quantized (not embeddings, norms, lm_head, routers).
"""

from __future__ import annotations

import json
import os
import shutil
import sys

BLOCK = int(os.environ.get("FP8_BLOCK", "16"))
FP8_MAX = 448.0


def is_linear(name: str, tensor) -> bool:
    return (
        tensor.dim() == 2
        and ".layers." in name
        and name.endswith(".weight")
        and "norm" not in name
        and not name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight"))
    )


def main(src: str, dest: str, kind: str) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    os.makedirs(dest, exist_ok=True)
    for name in os.listdir(src):
        if not name.endswith(".safetensors"):
            shutil.copy2(os.path.join(src, name), dest)
    out = {}
    for path in sorted(p for p in os.listdir(src) if p.endswith(".safetensors")):
        for name, w in load_file(os.path.join(src, path)).items():
            if not is_linear(name, w):
                out[name] = w
                continue
            w = w.float()
            if kind == "block":
                rows, cols = w.shape
                pad = torch.zeros(-(-rows // BLOCK) * BLOCK, -(-cols // BLOCK) * BLOCK)
                pad[:rows, :cols] = w
                blocks = pad.view(pad.shape[0] // BLOCK, BLOCK, pad.shape[1] // BLOCK, BLOCK)
                scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
                q = (blocks / scale[:, None, :, None]).view_as(pad)[:rows, :cols]
                out[name] = q.to(torch.float8_e4m3fn)
                out[name.removesuffix("weight") + "weight_scale_inv"] = scale.float()
            else:
                scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX
                out[name] = (w / scale).to(torch.float8_e4m3fn)
                out[name.removesuffix("weight") + "weight_scale"] = scale.float()
    save_file(out, os.path.join(dest, "model.safetensors"), metadata={"format": "pt"})
    config = json.load(open(os.path.join(src, "config.json")))
    if kind == "block":
        config["quantization_config"] = {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "weight_block_size": [BLOCK, BLOCK],
        }
    else:
        config["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 8,
                        "type": "float",
                        "strategy": "channel",
                        "symmetric": True,
                        "dynamic": False,
                    },
                    "input_activations": {
                        "num_bits": 8,
                        "type": "float",
                        "strategy": "token",
                        "symmetric": True,
                        "dynamic": True,
                    },
                }
            },
            "ignore": ["lm_head", "re:.*mlp.gate$", "re:.*block_sparse_moe.gate$"],
        }
    json.dump(config, open(os.path.join(dest, "config.json"), "w"), indent=2)


if __name__ == "__main__":
    if not sys.argv[1:] or len(sys.argv[1:]) % 3:
        sys.exit("usage: quantize_fp8.py SRC DEST block|ct [SRC DEST block|ct ...]")
    for at in range(1, len(sys.argv), 3):
        main(*sys.argv[at : at + 3])
