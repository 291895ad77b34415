"""streamctl/shard/engines/vllm_cpu/quantized.py's rules on stand-in layers and errors (no vLLM: the attributes
vLLM 0.34's linear layers and FP8 methods set, the messages its checks raise). The same rules run on vLLM's
real layers in test_shard_vllm_cpu_quantized.py."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from streamctl.shard.engines.vllm_cpu.quantized import (
    MXFP4_REFUSAL,
    block_refusal,
    block_split_problems,
    classify,
    refusal_before_build,
)


class BlockQuantScaleParameter:  # the name is what the rule looks for, as vLLM's parameter class is named
    pass


@dataclass
class Layer:
    """A linear layer as vLLM builds it: LinearBase's sizes, Fp8LinearMethod's `weight_block_size`."""

    input_size: int
    input_size_per_partition: int
    output_size: int
    output_partition_sizes: list[int]
    weight_block_size: list[int] | None = field(default_factory=lambda: [128, 128])
    params: dict[str, Any] = field(default_factory=lambda: {"weight": object(), "weight_scale_inv": None})

    def __post_init__(self) -> None:
        if self.params.get("weight_scale_inv", 1) is None:
            self.params["weight_scale_inv"] = BlockQuantScaleParameter()

    def named_parameters(self, recurse: bool = True) -> Iterator[tuple[str, Any]]:
        assert recurse is False
        return iter(self.params.items())


@dataclass
class Model:
    layers: dict[str, Any]

    def named_modules(self) -> Iterator[tuple[str, Any]]:
        return iter(self.layers.items())


def test_whole_blocks_pass() -> None:
    """Qwen3-8B-FP8 at TP 8: q 512, k and v 128 a rank, o_proj's input 512, gate/up 1536, down's input 1536."""
    model = Model(
        {
            "l.qkv_proj": Layer(4096, 4096, 6144, [512, 128, 128]),
            "l.o_proj": Layer(4096, 512, 4096, [4096]),
            "l.gate_up_proj": Layer(4096, 4096, 24576, [1536, 1536]),
            "l.down_proj": Layer(12288, 1536, 4096, [4096]),
            "l.norm": object(),  # no weight_block_size: not looked at
        }
    )
    assert block_split_problems(model, 8) == []


def test_a_fused_share_of_half_a_block_is_named() -> None:
    """k and v 64 wide a rank in blocks of 128: the part vLLM 0.34 lets through unchecked."""
    problems = block_split_problems(Model({"l.qkv_proj": Layer(256, 256, 512, [128, 64, 64])}), 2)
    assert problems == [
        "l.qkv_proj.weight_scale_inv: FP8 blocks of [128, 128], and TP 2 gives a rank 64 output channels of a "
        "weight (its fused weights' shares: [128, 64, 64]), not whole blocks of 128, so vLLM's loader cannot cut "
        "the rank's rows of the block scales: every weight's output size / TP (and every part of a fused weight "
        "but the last) must be a multiple of 128"
    ]


def test_at_tp_1_only_the_last_part_of_a_fused_weight_may_end_in_a_partial_block() -> None:
    """DeepSeek-V3's fused_qkv_a_proj: q_a 1536 and kv_a 576 (4.5 blocks), not split: whole blocks but the last."""
    assert block_split_problems(Model({"l.fused_qkv_a_proj": Layer(7168, 7168, 2112, [1536, 576])}), 1) == []
    problems = block_split_problems(Model({"l.fused": Layer(7168, 7168, 2112, [576, 1536])}), 1)
    assert len(problems) == 1 and "leaves 576 output channels" in problems[0]


def test_a_row_parallel_input_of_half_a_block_is_named() -> None:
    problems = block_split_problems(Model({"l.down_proj": Layer(320, 160, 256, [256])}), 2)
    assert problems == [
        "l.down_proj.weight_scale_inv: FP8 blocks of [128, 128], and TP 2 gives each rank 160 of the 320 input "
        "channels, not whole blocks of 128: the input size / TP must be a multiple of 128"
    ]


def test_compressed_tensors_block_scales_are_named_as_registered() -> None:
    layer = Layer(256, 256, 512, [128, 64, 64], params={"weight": object(), "weight_scale": None})
    layer.params["weight_scale"] = BlockQuantScaleParameter()
    problems = block_split_problems(Model({"l.qkv_proj": layer}), 2)
    assert problems and problems[0].startswith("l.qkv_proj.weight_scale: FP8 blocks of [128, 128]")


def _raised_while_building(prefix: str, message: str) -> ValueError:
    def create_weights() -> None:
        raise ValueError(message)

    def linear_init(prefix: str) -> None:  # LinearBase.__init__ takes its state-dict prefix as `prefix`
        create_weights()

    try:
        linear_init(prefix)
    except ValueError as error:
        return error
    raise AssertionError("not raised")


def test_vllms_block_check_gets_the_layer_and_the_rule() -> None:
    words = "Weight input_size_per_partition = 128 is not divisible by weight quantization block_k = 256."
    error = _raised_while_building("model.layers.0.self_attn.o_proj", words)
    assert classify(error, words) == (
        "bad-parallel-size",
        "model.layers.0.self_attn.o_proj: Weight input_size_per_partition = 128 is not divisible by weight "
        "quantization block_k = 256: each TP rank's share of an FP8 block-quantized weight must be whole blocks "
        "of 256 along its input (weight_block_size), or the rank's rows of its block scales (weight_scale_inv) "
        "cannot be cut from the checkpoint's",
    )
    assert block_refusal(ValueError("other"), "something else") is None


def test_experts_without_a_cpu_kernel_and_mxfp4() -> None:
    words = "No Int8 MoE backend supports the deployment configuration (weight_key=...)"
    kind, line = classify(RuntimeError(words), words) or ("", "")
    assert kind == "unsupported-quantization"
    assert "Int8 MoE kernel" in line and "AMX tiles" in line and "No Int8 MoE backend supports" in line
    assert refusal_before_build("gpt_oss_mxfp4") == refusal_before_build("mxfp4") == MXFP4_REFUSAL
    assert refusal_before_build("fp8") is None and refusal_before_build(None) is None
    assert "\n" not in MXFP4_REFUSAL and "--engine vllm-gpu" in MXFP4_REFUSAL
