"""`streamctl shard` refusing, through the CLI, what the vllm-cpu engine cannot shard: an architecture vLLM
does not know, a TP that does not divide the heads or the experts, a truncated shard,
a corrupt header, a weight the checkpoint lacks. Each: exit 2, one `error:` line naming the problem (vLLM's own words where vLLM refused),
no traceback, nothing written to DEST. Tiny checkpoints are written by transformers itself, once per module;
every CLI run is a process of its own with its own vLLM worker, so they run two at a time, once, in the
module fixture. Skipped without STREAMCTL_VLLM_PYTHON.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from cli_helpers import CliResult, run_cli
from oracle import oracle_python, requires_vllm_oracle

pytestmark = [requires_vllm_oracle, pytest.mark.timeout(900)]  # the module fixture runs every case

WORKER_TIMEOUT_S = 300  # one CLI run: a worker start (vLLM's import, ~6-10 s) on 2 shared cores
CONCURRENT_RUNS = 2


@dataclass(frozen=True)
class Refusal:
    kind: str  # the tiny model it starts from
    args: tuple[str, ...]
    spoil: Callable[[Path], None] | None = None  # breaks the copied checkpoint folder


def _unknown_architecture(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["FooForCausalLM"]}))


def _greedy_routing(folder: Path) -> None:
    """DeepSeek-V3's weights with a config.json whose routing builds no score-correction bias."""
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "topk_method": "greedy"}))


def _truncate(folder: Path) -> None:
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 1000])


def _corrupt_header(folder: Path) -> None:
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    data[8 : 8 + length] = b"{" + b"\xff" * (length - 1)  # not JSON, same length: the data is untouched
    weights.write_bytes(bytes(data))


def _drop_a_layer_weight(folder: Path) -> None:
    """The second decoder layer's o_proj left out of the weights (and the index): a checkpoint that lacks it."""
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    body = data[8 + length :]
    dropped = "model.layers.1.self_attn.o_proj.weight"
    assert dropped in header, sorted(header)
    kept, chunks, at = {}, [], 0
    for name, entry in sorted(header.items(), key=lambda item: item[1].get("data_offsets", [0])[0]):
        if name == "__metadata__":
            kept[name] = entry
        elif name != dropped:
            start, end = entry["data_offsets"]
            chunks.append(body[start:end])
            kept[name] = {**entry, "data_offsets": [at, at + end - start]}
            at += end - start
    encoded = json.dumps(kept).encode()
    encoded += b" " * (-len(encoded) % 8)
    weights.write_bytes(struct.pack("<Q", len(encoded)) + encoded + b"".join(chunks))
    index = folder / "model.safetensors.index.json"
    if index.exists():
        document = json.loads(index.read_text())
        document["weight_map"].pop(dropped, None)
        index.write_text(json.dumps(document))


REFUSALS = {
    "unknown-architecture": Refusal("mixtral", ("-tp", "2"), _unknown_architecture),
    "tp-heads": Refusal("mixtral", ("-tp", "3")),
    # mixtral-odd's experts have intermediate size 66: TP 4 cannot slice them (its 4 heads it can)
    "tp-experts": Refusal("mixtral-odd", ("-tp", "4")),
    "meta-build": Refusal("bloom", ("-tp", "2")),
    "config-mismatch": Refusal("deepseek-v3", ("-tp", "2"), _greedy_routing),
    "truncated": Refusal("mixtral", ("-tp", "2"), _truncate),
    "corrupt-header": Refusal("mixtral", ("-tp", "2"), _corrupt_header),
    "missing-weight": Refusal("mixtral", ("-tp", "2"), _drop_a_layer_weight),
}


@dataclass(frozen=True)
class Ran:
    result: CliResult
    dest: Path


@pytest.fixture(scope="module")
def ran(tiny_hf_root: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Ran]:
    root = tiny_hf_root  # tests/conftest.py: written once per session
    python = oracle_python()
    assert python is not None
    work = tmp_path_factory.mktemp("refusals")

    def run(name: str) -> Ran:
        refusal = REFUSALS[name]
        source, dest = root / refusal.kind, work / name / "out"
        if refusal.spoil is not None:
            source = Path(shutil.copytree(root / refusal.kind, work / name / "hf"))
            refusal.spoil(source)
        env = {"STREAMCTL_VLLM_PYTHON": python}
        return Ran(run_cli("shard", str(source), str(dest), *refusal.args, env=env, timeout=WORKER_TIMEOUT_S), dest)

    with ThreadPoolExecutor(CONCURRENT_RUNS) as pool:
        return dict(zip(REFUSALS, pool.map(run, REFUSALS), strict=True))


def _nothing_written(ran: Ran) -> None:
    assert not ran.dest.exists() or not any(ran.dest.iterdir()), sorted(p.name for p in ran.dest.rglob("*"))


def _refused(ran: Ran, *words: str) -> str:
    """Exit 2, exactly one `error:` line holding every word, no traceback, nothing in DEST; the line."""
    result = ran.result
    assert result.exit_code == 2, (result.exit_code, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.stderr[-3000:]
    for word in words:
        assert word in lines[0], (word, lines[0])
    _nothing_written(ran)
    return lines[0]


def test_an_architecture_vllm_does_not_know(ran: dict[str, Ran]) -> None:
    _refused(ran["unknown-architecture"], "FooForCausalLM", "not supported")


def test_a_config_that_does_not_match_the_weights(ran: dict[str, Ran]) -> None:
    """vLLM's model has no parameter for a checkpoint tensor (its load_weights' KeyError): named, with the hint."""
    _refused(
        ran["config-mismatch"], "no parameter for the checkpoint's tensor", "e_score_correction_bias", "config.json"
    )


def test_a_model_class_that_cannot_be_built_on_the_meta_device(ran: dict[str, Ran]) -> None:
    """vLLM's BloomForCausalLM computes its ALiBi slopes while it is constructed, which a meta-device build
    (streamctl's planning: no weights allocated) cannot do."""
    _refused(ran["meta-build"], "meta device", "Cannot copy out of meta tensor")


def test_a_tp_that_does_not_divide_the_heads(ran: dict[str, Ran]) -> None:
    _refused(ran["tp-heads"], "attention heads (4)", "tensor parallel size (3)")


def test_a_tp_that_does_not_divide_the_experts(ran: dict[str, Ran]) -> None:
    _refused(ran["tp-experts"], "66", "4")


def test_a_truncated_shard(ran: dict[str, Ran]) -> None:
    _refused(ran["truncated"], "model.safetensors")


def test_a_corrupt_header(ran: dict[str, Ran]) -> None:
    _refused(ran["corrupt-header"], "model.safetensors")


def test_a_weight_the_checkpoint_lacks(ran: dict[str, Ran]) -> None:
    """Every parameter a pseudo stage sends is NaN-poisoned before its load_weights, so one the checkpoint
    does not feed is caught rather than written with whatever the memory held."""
    _refused(ran["missing-weight"], "load_weights left", "model.layers.1.self_attn.o_proj", "lacks it")
