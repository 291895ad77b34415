"""verify_checkpoint on HF layouts: the index against the shard headers, and `--expect` placements."""

from __future__ import annotations

from typing import Any

import pytest
from verify_helpers import SHARD_1, SHARD_2, edit_index, error_codes, findings_of, run, warning_codes

from checkpoints import (
    INDEX_NAME,
    TensorSpec,
    delete_object,
    put_bytes,
    put_json,
    read_object,
    write_hf_checkpoint,
    write_tensor_file,
)
from streamctl.errors import UsageError
from streamctl.storage.base import Location
from streamctl.verify import indexed as verify_indexed
from streamctl.verify.report import Expectation, parse_expectation

# ---------------------------------------------------------------------------------------------------
# Index rules


def test_unparseable_index(location: Location) -> None:
    write_hf_checkpoint(location)
    put_bytes(location, INDEX_NAME, b'{"weight_map": {"a": "b"')
    assert error_codes(run(location)) == ["index-invalid"]


@pytest.mark.parametrize("document", [[], {"metadata": {}}, {"weight_map": {"a": 1}}, {"weight_map": []}])
def test_index_without_a_weight_map_of_strings(location: Location, document: Any) -> None:
    write_hf_checkpoint(location)
    put_json(location, INDEX_NAME, document)
    assert error_codes(run(location)) == ["index-invalid"]


def test_missing_shard(remote_or_local: Location) -> None:
    write_hf_checkpoint(remote_or_local)
    delete_object(remote_or_local, SHARD_2)
    report = run(remote_or_local)
    assert error_codes(report) == ["missing-shard"]
    assert findings_of(report, "missing-shard") == [(SHARD_2, None)]


def test_index_tensor_absent_from_its_shard(location: Location) -> None:
    write_hf_checkpoint(location)
    edit_index(location, lambda index: index["weight_map"].update({"model.layers.9.mlp.up_proj.weight": SHARD_1}))
    report = run(location)
    assert findings_of(report, "index-tensor-missing") == [(SHARD_1, "model.layers.9.mlp.up_proj.weight")]
    assert error_codes(report) == ["index-tensor-missing"]


def test_header_tensor_absent_from_the_index(location: Location) -> None:
    write_hf_checkpoint(location)
    edit_index(location, lambda index: index["weight_map"].pop("lm_head.weight"))
    report = run(location)
    assert findings_of(report, "tensor-not-in-index") == [(SHARD_2, "lm_head.weight")]
    assert error_codes(report) == ["tensor-not-in-index"]


def test_tensor_mapped_to_the_wrong_shard(location: Location) -> None:
    write_hf_checkpoint(location)
    edit_index(location, lambda index: index["weight_map"].update({"lm_head.weight": SHARD_1}))
    report = run(location)
    assert findings_of(report, "index-wrong-shard") == [(SHARD_1, "lm_head.weight")]
    assert error_codes(report) == ["index-wrong-shard"]


def test_tensor_in_two_shards(location: Location) -> None:
    checkpoint = write_hf_checkpoint(location)
    write_tensor_file(
        location,
        SHARD_2,
        [*checkpoint.tensors_by_file[SHARD_2], TensorSpec("model.embed_tokens.weight", "BF16", (32, 8))],
    )
    report = run(location)
    assert findings_of(report, "tensor-in-two-shards") == [(SHARD_2, "model.embed_tokens.weight")]
    assert error_codes(report) == ["tensor-in-two-shards"]
    assert warning_codes(report) == ["total-size-mismatch"]  # the headers now hold more bytes


def test_a_tensor_twice_in_the_weight_map_is_a_warning_naming_both_files(location: Location) -> None:
    write_hf_checkpoint(location)
    text = read_object(location, INDEX_NAME).decode()
    put_bytes(
        location,
        INDEX_NAME,
        text.replace('"weight_map": {', f'"weight_map": {{\n    "lm_head.weight": "{SHARD_1}",', 1).encode(),
    )
    report = run(location)
    # vLLM and transformers read the index with json.load: the last entry wins (test_reader_agreement).
    assert findings_of(report, "index-duplicate-tensor") == [(INDEX_NAME, "lm_head.weight")]
    assert error_codes(report) == [] and "index-duplicate-tensor" in warning_codes(report)
    (finding,) = [finding for finding in report.findings if finding.code == "index-duplicate-tensor"]
    assert f"to {SHARD_1}, then to {SHARD_2}" in finding.message, finding.message


@pytest.mark.parametrize(
    "shard",
    [
        "../model-00001-of-00002.safetensors",
        "/abs/model.safetensors",
        "sub\\model.safetensors",
        "original/model.safetensors",
        "",
    ],
)
def test_unsafe_shard_names_in_the_index(location: Location, shard: str) -> None:
    write_hf_checkpoint(location)
    edit_index(location, lambda index: index["weight_map"].update({"extra.weight": shard}))
    report = run(location)
    assert error_codes(report) == ["unsafe-shard-name"]
    assert findings_of(report, "unsafe-shard-name") == [(shard, None)]


def test_index_shard_that_is_not_safetensors(location: Location) -> None:
    write_hf_checkpoint(location)
    edit_index(location, lambda index: index["weight_map"].update({"extra.weight": "pytorch_model.bin"}))
    assert error_codes(run(location)) == ["shard-not-safetensors"]


def test_total_size_mismatch_is_only_a_warning(location: Location) -> None:
    write_hf_checkpoint(location)
    edit_index(location, lambda index: index["metadata"].update(total_size=1))
    report = run(location)
    assert report.ok and warning_codes(report) == ["total-size-mismatch"]


def test_a_named_index_that_does_not_exist(location: Location) -> None:
    write_hf_checkpoint(location)
    report = run(location, index_name="other.safetensors.index.json")
    assert (report.layout, error_codes(report)) == ("indexed", ["index-missing"])


def test_an_oversized_index_is_not_read(location: Location, monkeypatch: pytest.MonkeyPatch) -> None:
    write_hf_checkpoint(location)
    monkeypatch.setattr(verify_indexed, "MAX_INDEX_BYTES", 100)
    report = run(location)
    assert error_codes(report) == ["index-too-large"]
    assert report.stats.requests == 2 + 1  # shards and config only


def test_several_files_without_an_index_warn(location: Location) -> None:
    write_hf_checkpoint(location, index=False)
    report = run(location)
    assert (report.layout, report.ok, warning_codes(report)) == ("single", True, ["no-index"])


# ---------------------------------------------------------------------------------------------------
# --expect


def test_parse_expectation() -> None:
    assert parse_expectation("model.layers.0.*=a.safetensors, b.safetensors") == Expectation(
        "model.layers.0.*", ("a.safetensors", "b.safetensors")
    )
    for bad in ["no-equals", "=a.safetensors", "glob=", "glob=a,,b"]:
        with pytest.raises(UsageError):
            parse_expectation(bad)


def test_expectation_met(location: Location) -> None:
    write_hf_checkpoint(location)
    report = run(location, expectations=(parse_expectation(f"model.layers.0.*={SHARD_1}"),))
    assert report.findings == ()


def test_tensor_outside_its_expected_files(location: Location) -> None:
    write_hf_checkpoint(location)
    report = run(location, expectations=(parse_expectation(f"lm_head.*={SHARD_1}"),))
    assert findings_of(report, "expect-violated") == [(SHARD_2, "lm_head.weight")]
    assert error_codes(report) == ["expect-violated"]


def test_expectation_checks_the_index_placement_too(location: Location) -> None:
    write_hf_checkpoint(location)
    edit_index(location, lambda index: index["weight_map"].update({"model.layers.0.mlp.up_proj.weight": SHARD_2}))
    report = run(location, expectations=(parse_expectation(f"model.layers.0.*={SHARD_1}"),))
    assert findings_of(report, "expect-violated") == [(SHARD_2, "model.layers.0.mlp.up_proj.weight")]
    assert error_codes(report) == ["expect-violated", "index-wrong-shard"]


@pytest.mark.parametrize("glob", ["engram.*", "MODEL.layers.*"], ids=["absent", "case-sensitive"])
def test_expectation_matching_nothing(location: Location, glob: str) -> None:
    write_hf_checkpoint(location)
    report = run(location, expectations=(parse_expectation(f"{glob}={SHARD_1}"),))
    assert error_codes(report) == ["expect-no-match"]
