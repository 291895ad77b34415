"""verify_checkpoint on what vLLM pulls next to the weights: config, tokenizer, custom code, sub-folders."""

from __future__ import annotations

from verify_helpers import error_codes, findings_of, run, warning_codes

from checkpoints import (
    TensorSpec,
    llama_tensors,
    put_bytes,
    put_json,
    write_hf_checkpoint,
    write_tensor_file,
)
from streamctl.storage.base import Location

# ---------------------------------------------------------------------------------------------------
# Serving readiness


def test_a_stray_top_level_safetensors_is_an_error_on_any_store(remote_or_local: Location) -> None:
    write_hf_checkpoint(remote_or_local)
    write_tensor_file(remote_or_local, "model-00003-of-00003.safetensors", [TensorSpec("old.weight", "F16", (4,))])
    report = run(remote_or_local)
    assert findings_of(report, "unindexed-safetensors") == [("model-00003-of-00003.safetensors", None)]
    assert error_codes(report) == ["unindexed-safetensors"]


def test_a_leftover_single_file_duplicates_every_tensor(location: Location) -> None:
    write_hf_checkpoint(location)
    write_tensor_file(location, "model.safetensors", llama_tensors(2))
    report = run(location)
    assert error_codes(report) == ["tensor-in-two-shards", "unindexed-safetensors"]


def test_consolidated_next_to_hf_shards(location: Location) -> None:
    write_hf_checkpoint(location)
    write_tensor_file(
        location, "consolidated.safetensors", [TensorSpec("layers.0.attention.wq.weight", "BF16", (8, 8))]
    )
    report = run(location)
    assert error_codes(report) == ["consolidated-mixed", "unindexed-safetensors"]
    assert findings_of(report, "consolidated-mixed") == [("consolidated.safetensors", None)]


def test_missing_config(location: Location) -> None:
    write_hf_checkpoint(location, config=False)
    assert error_codes(run(location)) == ["config-missing"]


def test_invalid_config(location: Location) -> None:
    write_hf_checkpoint(location)
    put_bytes(location, "config.json", b"{'not': json}")
    assert error_codes(run(location)) == ["config-invalid"]


def test_missing_tokenizer_is_a_warning(location: Location) -> None:
    write_hf_checkpoint(location, tokenizer=False)
    report = run(location)
    assert report.ok and warning_codes(report) == ["tokenizer-missing"]


def test_vocab_and_merges_count_as_a_tokenizer(location: Location) -> None:
    write_hf_checkpoint(location, tokenizer=False)
    put_json(location, "vocab.json", {"a": 0})
    assert warning_codes(run(location)) == ["tokenizer-missing"]  # vocab.json alone is not enough
    put_bytes(location, "merges.txt", b"#version: 0.2\n")
    assert warning_codes(run(location)) == []


def test_auto_map_without_its_code(location: Location) -> None:
    auto_map = {
        "AutoConfig": "configuration_tiny.TinyConfig",
        "AutoModelForCausalLM": "modeling_tiny.TinyForCausalLM",
        "AutoTokenizer": ["other/repo--tokenization_tiny.TinyTokenizer", None],
    }
    write_hf_checkpoint(location, extra_config={"auto_map": auto_map})
    put_bytes(location, "configuration_tiny.py", b"class TinyConfig: ...\n")
    report = run(location)
    assert report.ok and findings_of(report, "remote-code-missing") == [("modeling_tiny.py", None)]


def test_sub_folders_are_pulled_at_start_up(remote_or_local: Location) -> None:
    write_hf_checkpoint(remote_or_local)
    put_bytes(remote_or_local, "original/consolidated.00.pth", b"x" * 10)
    put_bytes(remote_or_local, ".git/HEAD", b"ref: refs/heads/main\n")
    report = run(remote_or_local)
    assert report.ok and findings_of(report, "subfolder-pulled") == [(".git/", None), ("original/", None)]
