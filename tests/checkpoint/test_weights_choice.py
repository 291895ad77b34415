"""Which top-level safetensors are the weights (checkpoint.files.choose_weights), and that the file set
`transfer` copies, `shard` reads and `verify-index` calls an error all follow that one rule."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamctl.checkpoint.files import MISTRAL_DUPLICATE, choose_weights, needs_mistral_tokenizer_mode, select_files
from streamctl.errors import UsageError
from streamctl.serve.tune import top_level_shards
from streamctl.storage import open_location
from streamctl.verify.indexed import check_consolidated_mix
from streamctl.verify.report import Findings

HF = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
MISTRAL = ("consolidated-00001-of-00002.safetensors", "consolidated-00002-of-00002.safetensors")


@pytest.mark.parametrize(
    ("listing", "weights", "duplicate", "mistral_format"),
    [
        (HF, HF, (), False),
        (MISTRAL, MISTRAL, (), True),
        ((*MISTRAL, *HF), HF, MISTRAL, False),
        (("model.safetensors", "consolidated.safetensors", "sub/x.safetensors", "params.json"),
         ("model.safetensors",), ("consolidated.safetensors",), False),
        (("config.json", "original/consolidated.00.pth"), (), (), False),
    ],
)  # fmt: skip
def test_the_weights_are_the_hf_shards_where_there_are_any(
    listing: tuple[str, ...], weights: tuple[str, ...], duplicate: tuple[str, ...], mistral_format: bool
) -> None:
    choice = choose_weights(reversed(listing))
    assert choice.weights == weights
    assert choice.duplicate == duplicate
    assert choice.mistral_format is mistral_format
    assert choice.listed == tuple(sorted(name for name in listing if "/" not in name and name.endswith(".safetensors")))


@pytest.mark.parametrize("indexed", [True, False])
def test_transfer_leaves_out_the_duplicate_with_or_without_an_hf_index(indexed: bool) -> None:
    """Without model.safetensors.index.json the duplicate and its index used to be copied, a copy that
    verify-index then failed (consolidated-mixed)."""
    listing = [*HF, *MISTRAL, "consolidated.safetensors.index.json", "config.json"]
    chosen = {
        s.path: s for s in select_files(listing, has_auto_map=False, indexed_shards=frozenset(HF) if indexed else None)
    }
    assert {path for path, s in chosen.items() if s.selected} == {*HF, "config.json"}
    assert {chosen[name].reason for name in MISTRAL} == {MISTRAL_DUPLICATE}
    assert chosen["consolidated.safetensors.index.json"].reason == "index of the Mistral-format duplicate"


def test_mistral_format_alone_is_copied_whole() -> None:
    listing = [*MISTRAL, "consolidated.safetensors.index.json", "params.json", "tekken.json"]
    selected = {s.path for s in select_files(listing, has_auto_map=False) if s.selected}
    assert selected == set(listing)


def test_verify_calls_exactly_the_duplicate_an_error() -> None:
    findings = Findings()
    check_consolidated_mix(choose_weights([*HF, *MISTRAL]), findings)
    errors = [(finding.code, finding.file) for finding in findings.result() if finding.severity == "error"]
    assert errors == [("consolidated-mixed", name) for name in MISTRAL]
    alone = Findings()
    check_consolidated_mix(choose_weights(MISTRAL), alone)
    assert list(alone.result()) == []


def test_the_mistral_tokenizer_mode_is_needed_only_without_the_duplicate() -> None:
    assert needs_mistral_tokenizer_mode([*HF, "tekken.json"])
    assert not needs_mistral_tokenizer_mode([*HF, *MISTRAL, "tekken.json"])
    assert not needs_mistral_tokenizer_mode([*MISTRAL, "tekken.json"])
    assert not needs_mistral_tokenizer_mode([*HF, "tokenizer.json"])


def test_serve_tune_samples_the_weights_not_the_duplicate(tmp_path: Path) -> None:
    for name in ("model.safetensors", "consolidated.safetensors", "sub/extra.safetensors", "config.json"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x")
    assert [info.key for info in top_level_shards(open_location(str(tmp_path)))] == ["model.safetensors"]
    (tmp_path / "model.safetensors").unlink()
    assert [info.key for info in top_level_shards(open_location(str(tmp_path)))] == ["consolidated.safetensors"]
    (tmp_path / "consolidated.safetensors").unlink()
    with pytest.raises(UsageError, match="found no .safetensors"):
        top_level_shards(open_location(str(tmp_path)))
