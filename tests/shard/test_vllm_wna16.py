"""streamctl/shard/engines/vllm_cpu/wna16.py's split rules on stand-in layers (no vLLM: the attributes vLLM 0.33's
parameters and MPLinearKernel configs carry, as its methods' create_weights set them). The same rules run on
vLLM's real layers in test_shard_vllm_cpu_int4.py."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from streamctl.shard.engines.vllm_cpu.wna16 import split_problems


@dataclass
class Param:
    shape: tuple[int, ...]
    input_dim: int | None = None
    output_dim: int | None = None
    packed_dim: int | None = None
    packed_factor: int | Fraction | None = None


@dataclass
class Config:
    full_weight_shape: tuple[int, int]
    partition_weight_shape: tuple[int, int]
    group_size: int


@dataclass
class Kernel:
    config: Config
    w_q_name: str = "qweight"


@dataclass
class Method:
    kernel: Kernel


@dataclass
class Layer:
    quant_method: Method
    output_partition_sizes: list[int]
    params: dict[str, Param] = field(default_factory=dict)

    def named_parameters(self, recurse: bool = True) -> Iterator[tuple[str, Param]]:
        assert recurse is False
        return iter(self.params.items())


@dataclass
class Model:
    layers: dict[str, Any]

    def named_modules(self) -> Iterator[tuple[str, Any]]:
        return iter(self.layers.items())


def awq_layer(full: tuple[int, int], rank_in: int, shards: list[int], group: int) -> Layer:
    """AutoAWQMarlinLinearMethod.create_weights: qweight [in, out/8], qzeros [in/g, out/8], scales [in/g, out]."""
    out = sum(shards)
    groups = rank_in // (group if group != -1 else full[0])
    config = Config(full, (rank_in, out), group)
    return Layer(
        Method(Kernel(config)),
        shards,
        {
            "qweight": Param((rank_in, out // 8), input_dim=0, output_dim=1, packed_dim=1, packed_factor=8),
            "qzeros": Param((groups, out // 8), input_dim=0, output_dim=1, packed_dim=1, packed_factor=8),
            "scales": Param((groups, out), input_dim=0, output_dim=1),
        },
    )


def gptq_layer(full: tuple[int, int], rank_in: int, out: int, group: int) -> Layer:
    """AutoGPTQLinearMethod.create_weights (grouped): qweight [in/8, out], scales [in/g, out]."""
    config = Config(full, (rank_in, out), group)
    params = {
        "qweight": Param((rank_in // 8, out), input_dim=0, output_dim=1, packed_dim=0, packed_factor=8),
        "scales": Param((rank_in // group, out), input_dim=0, output_dim=1),
    }
    return Layer(Method(Kernel(config)), [out], params)


def test_sizes_that_split_exactly_pass() -> None:
    model = Model(
        {
            "model.layers.0.self_attn.qkv_proj": awq_layer((64, 80), 64, [32, 8, 8], 32),
            "model.layers.0.self_attn.o_proj": awq_layer((64, 64), 32, [64], 32),
            "model.layers.0.mlp.down_proj": gptq_layer((64, 64), 32, 64, 32),
            "model.norm": object(),  # not a quantized layer: no kernel, not looked at
        }
    )
    assert split_problems(model, 2) == []


def test_a_fused_output_share_that_is_not_whole_int32_words() -> None:
    """A KV share of 12 channels, packed 8 to an int32 along the output (AWQ): the offsets would round down."""
    model = Model({"model.layers.0.self_attn.qkv_proj": awq_layer((64, 96), 64, [24, 12, 12], 32)})
    problems = split_problems(model, 2)
    assert len(problems) == 2  # qweight and qzeros; scales are not packed
    assert problems[0].startswith("model.layers.0.self_attn.qkv_proj.qweight: packs 8 output channels")
    assert "a rank 12 output channels" in problems[0] and "[24, 12, 12]" in problems[0]
    assert "multiple of 8" in problems[0]


def test_an_input_share_that_is_not_whole_groups_or_words() -> None:
    model = Model(
        {
            "a.o_proj": gptq_layer((64, 64), 32, 64, 64),  # 32 inputs a rank, groups of 64
            "a.down_proj": gptq_layer((72, 64), 36, 64, 4),  # 36 inputs a rank: 4.5 int32 words
        }
    )
    problems = split_problems(model, 2)
    assert problems == [
        "a.o_proj.scales: TP 2 gives each rank 32 of the 64 input channels, not a whole number of quantization "
        "groups of 64 (the checkpoint's group_size), so vLLM's loader cannot cut the rank's share: the input size "
        "/ TP must be a multiple of 64",
        "a.down_proj.qweight: TP 2 gives each rank 36 of the 72 input channels, not a whole number of int32 words "
        "of 8 input channels, so vLLM's loader cannot cut the rank's share: the input size / TP must be a multiple "
        "of 8",
    ]


def test_channelwise_awq_cannot_split_its_input() -> None:
    """AWQ with group_size -1 takes the whole input as one group: a row-parallel rank would hold 0 groups."""
    problems = split_problems(Model({"l.o_proj": awq_layer((64, 64), 32, [64], -1)}), 2)
    assert [problem.split(":")[0] for problem in problems] == ["l.o_proj.qzeros", "l.o_proj.scales"]
    assert "group_size -1: one group over the whole input" in problems[1]


def test_an_unsplit_input_is_the_checkpoint_tensor_whole() -> None:
    """TP 1 (or a column-parallel layer): the input is not cut, so no input rule applies; a pack factor held
    as compressed-tensors' Fraction is read as the integer it is."""
    layer = gptq_layer((36, 64), 36, 64, 4)
    layer.params["qweight"].packed_factor = Fraction(32, 4)
    assert split_problems(Model({"l.qkv_proj": layer}), 1) == []
    layer.params["zeros"] = Param((9, 7), input_dim=1, output_dim=0, packed_dim=0, packed_factor=Fraction(32, 4))
    layer.output_partition_sizes = [60, 4]
    problems = split_problems(Model({"l.qkv_proj": layer}), 1)
    assert problems and "packs 8 output channels" in problems[0] and "a rank 60 output" in problems[0]
