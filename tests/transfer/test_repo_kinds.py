"""Repo layouts users bring (issue 22, "Repos"): Mistral's own tokenizer files, LoRA adapters, GGUF-only and
sub-folder-only repos, custom code, pickle indexes; `transfer`, `verify-index` and `serve` agree on each."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from oracle import requires_vllm_oracle, tokenizer_choices
from streamctl.checkpoint.safetensors import safetensors_bytes
from streamctl.storage import StorageOptions
from streamctl.transfer import TransferOptions, TransferPlan, TransferRun, run_transfer


def tensors(*names: str) -> bytes:
    return safetensors_bytes([(name, "BF16", [2, 2], bytes(8)) for name in names])


def write_repo(folder: Path, files: dict[str, bytes | str | dict[str, Any]]) -> Path:
    """A repo as a folder: bytes as they are, str as UTF-8, a dict as JSON."""
    for name, content in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, dict):
            content = json.dumps(content)
        path.write_bytes(content.encode() if isinstance(content, str) else content)
    return folder


def transfer(source: Path, dest: Path, **options: Any) -> TransferRun:
    done = run_transfer(str(source), str(dest), TransferOptions(**options), StorageOptions())
    assert isinstance(done, TransferRun)
    return done


def excluded(source: Path, dest: Path, **options: Any) -> dict[str, str]:
    """What a `transfer --dry-run` leaves out, and why."""
    plan = run_transfer(str(source), str(dest), TransferOptions(**options), StorageOptions(), dry_run=True)
    assert isinstance(plan, TransferPlan)
    return {selection.path: selection.reason for selection in plan.excluded}


def copied(dest: Path) -> set[str]:
    return {str(path.relative_to(dest)) for path in dest.rglob("*") if path.is_file()} - {"streamctl-manifest.json"}


HF_CONFIG = {"architectures": ["MistralForCausalLM"], "model_type": "mistral"}
PARAMS = {"dim": 8, "n_layers": 1, "vocab_size": 32768}


def mistral_both_formats(tokenizer_file: str) -> dict[str, bytes | str | dict[str, Any]]:
    """Like Mistral-7B-Instruct-v0.3: HF shards + index, and the Mistral-format duplicate beside them."""
    return {
        "config.json": HF_CONFIG,
        "model-00001-of-00002.safetensors": tensors("a"),
        "model-00002-of-00002.safetensors": tensors("b"),
        "model.safetensors.index.json": {
            "metadata": {},
            "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"},
        },
        "consolidated.safetensors": tensors("a", "b"),
        "params.json": PARAMS,
        "tokenizer.model": b"\x0a\x0bspm",
        "tokenizer.json": {"version": "1.0"},
        "tokenizer_config.json": {"eos_token": "</s>"},
        tokenizer_file: b"\x0a\x0bspm-mistral",
    }


def mistral_format_only(tokenizer_file: str) -> dict[str, bytes | str | dict[str, Any]]:
    """Like Mistral-Small/Pixtral: consolidated weights, params.json and Mistral's own tokenizer alone."""
    return {"consolidated.safetensors": tensors("a"), "params.json": PARAMS, tokenizer_file: b"\x0a\x0bspm-mistral"}


MISTRAL_LAYOUTS = {
    "both-formats-v3": mistral_both_formats("tokenizer.model.v3"),
    "both-formats-v7m1": mistral_both_formats("tokenizer.model.v7m1"),
    "format-only-v3": mistral_format_only("tokenizer.model.v3"),
    "format-only-v11": mistral_format_only("tokenizer.model.v11"),
    "format-only-tekken": mistral_format_only("tekken.json"),
}


@pytest.mark.parametrize("layout", sorted(MISTRAL_LAYOUTS))
def test_mistral_tokenizer_files_travel(tmp_path: Path, layout: str) -> None:
    """Every tokenizer file of Mistral's own format is copied, and the copy needs no other tokenizer."""
    files = MISTRAL_LAYOUTS[layout]
    source = write_repo(tmp_path / "src", files)
    run = transfer(source, tmp_path / "dest")
    mistral_files = {name for name in files if name == "tekken.json" or name.startswith("tokenizer.model.v")}
    assert mistral_files <= copied(tmp_path / "dest")
    assert run.verify is not None and run.verify.ok
    assert "tokenizer-missing" not in {finding.code for finding in run.verify.findings}


@requires_vllm_oracle
def test_vllm_chooses_the_same_tokenizer_on_the_copy(tmp_path: Path) -> None:
    """vLLM's own tokenizer selection (its auto mode, and the file --tokenizer-mode mistral loads) is the same
    on each source and its copy. The one expected difference: a repo in both formats loses its
    consolidated*.safetensors duplicate (vLLM would load both weight sets from a bucket), so vLLM's auto mode,
    which wants one, says "hf" on the copy; `--tokenizer-mode mistral` still loads the same file."""
    folders: list[Path] = []
    for layout, files in sorted(MISTRAL_LAYOUTS.items()):
        source = write_repo(tmp_path / layout / "src", files)
        transfer(source, tmp_path / layout / "dest")
        folders += [source, tmp_path / layout / "dest"]
    choices = tokenizer_choices(folders)
    for source_choice, copy_choice in zip(choices[::2], choices[1::2], strict=True):
        layout = Path(source_choice["folder"]).parent.name
        assert source_choice["mistral_file"] is not None, source_choice
        assert copy_choice["mistral_file"] == source_choice["mistral_file"], (layout, source_choice, copy_choice)
        assert source_choice["auto_mode"] == "mistral", source_choice
        expected = "hf" if layout.startswith("both-formats") else "mistral"
        assert copy_choice["auto_mode"] == expected, (layout, copy_choice)


def pickle_index(suffix: str) -> dict[str, Any]:
    return {"metadata": {}, "weight_map": {"a": f"model-00001-of-00002{suffix}", "b": f"model-00002-of-00002{suffix}"}}


@pytest.mark.parametrize(
    "index_name,suffix",
    [("pytorch_model.bin.index.json", ".bin"), ("tf_model.h5.index.json", ".h5"),
     ("flax_model.msgpack.index.json", ".msgpack"), ("model.pt.index.json", ".pt")],
)  # fmt: skip
def test_an_index_travels_only_with_the_files_it_names(tmp_path: Path, index_name: str, suffix: str) -> None:
    files: dict[str, bytes | str | dict[str, Any]] = {
        "config.json": HF_CONFIG,
        "tokenizer.json": {"version": "1.0"},
        "model.safetensors": tensors("a", "b"),
        index_name: pickle_index(suffix),
        f"model-00001-of-00002{suffix}": b"pickle",
        f"model-00002-of-00002{suffix}": b"pickle",
    }
    source = write_repo(tmp_path / "src", files)
    transfer(source, tmp_path / "dest")
    assert copied(tmp_path / "dest") == {"config.json", "tokenizer.json", "model.safetensors"}
    assert excluded(source, tmp_path / "dest")[index_name] == f"index of {suffix} files that are not copied"
    # Asked for, the files bring their index with them.
    transfer(source, tmp_path / "with-pickles", include=(f"*{suffix}",))
    assert {index_name, f"model-00001-of-00002{suffix}"} <= copied(tmp_path / "with-pickles")


def test_shard_leaves_a_pickle_index_behind() -> None:
    """`shard` copies the serving files without any weights: no index of weights it does not copy."""
    from streamctl.checkpoint.files import select_serving_files

    paths = ["config.json", "tokenizer.json", "model.safetensors", "pytorch_model.bin.index.json",
             "pytorch_model-00001-of-00001.bin", "tf_model.h5.index.json", "special.index.json"]  # fmt: skip
    assert select_serving_files(paths, has_auto_map=False) == ["config.json", "special.index.json", "tokenizer.json"]
