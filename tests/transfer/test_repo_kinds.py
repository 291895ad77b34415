"""Repo layouts users bring: Mistral's own tokenizer files, LoRA adapters, GGUF-only and
sub-folder-only repos, custom code, pickle indexes; `transfer`, `verify-index` and `serve` agree on each."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cli_helpers import run_cli
from oracle import model_configs, requires_vllm_oracle, tokenizer_choices
from streamctl.checkpoint.safetensors import safetensors_bytes
from streamctl.errors import ChecksFailed
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


def served_tokenizer_mode(folder: Path, *arguments: str) -> str | None:
    """The --tokenizer-mode `serve --json [ARGUMENTS]` passes to vLLM for `folder`, or None."""
    served = run_cli("serve", str(folder), "--json", *arguments)
    assert served.exit_code == 0, served.stderr
    argv: list[str] = served.json()["argv"]
    assert argv.count("--tokenizer-mode") <= 1, argv
    return argv[argv.index("--tokenizer-mode") + 1] if "--tokenizer-mode" in argv else None


@requires_vllm_oracle
def test_vllm_chooses_the_same_tokenizer_on_the_copy(tmp_path: Path) -> None:
    """vLLM's own tokenizer selection is the same on each source and on its copy as `serve` launches it. A repo
    in both formats loses its consolidated*.safetensors duplicate (vLLM would load both weight sets from a
    bucket); vLLM's auto mode, which wants one, would say "hf" on the copy, so `serve` passes
    `--tokenizer-mode mistral` there, and only there (measured: the auto mode on the bare copy is "hf")."""
    folders: list[Path] = []
    modes: list[str | None] = []
    for layout, files in sorted(MISTRAL_LAYOUTS.items()):
        source = write_repo(tmp_path / layout / "src", files)
        transfer(source, tmp_path / layout / "dest")
        served = served_tokenizer_mode(tmp_path / layout / "dest")
        assert (served == "mistral") is layout.startswith("both-formats"), (layout, served)
        folders += [source, tmp_path / layout / "dest"]
        modes += [None, served]
    choices = tokenizer_choices(folders, modes)
    for source_choice, copy_choice in zip(choices[::2], choices[1::2], strict=True):
        layout = Path(source_choice["folder"]).parent.name
        assert source_choice["mistral_file"] is not None, source_choice
        assert copy_choice["mistral_file"] == source_choice["mistral_file"], (layout, source_choice, copy_choice)
        assert source_choice["auto_mode"] == "mistral", source_choice
        assert copy_choice["mode"] == source_choice["auto_mode"], (layout, copy_choice)
        bare = "hf" if layout.startswith("both-formats") else "mistral"
        assert copy_choice["auto_mode"] == bare, (layout, copy_choice)


def test_serve_asks_for_mistrals_tokenizer_only_where_auto_would_miss_it(tmp_path: Path) -> None:
    """`--tokenizer-mode mistral` is added for HF shards beside a Mistral tokenizer file without consolidated*;
    never beside consolidated* (vLLM's auto finds it), never without a Mistral tokenizer file, never twice, and
    the user's own --tokenizer-mode (any spelling vLLM takes) wins."""
    both = write_repo(tmp_path / "both", mistral_both_formats("tokenizer.model.v3"))
    copy = tmp_path / "copy"
    transfer(both, copy)
    # consolidated*.safetensors is there: auto chooses mistral (the pre-flight refuses the mix; its rule is apart)
    assert served_tokenizer_mode(both, "--no-preflight") is None
    assert served_tokenizer_mode(copy) == "mistral"
    assert served_tokenizer_mode(copy, "--", "--tokenizer-mode", "hf") == "hf"
    assert served_tokenizer_mode(copy, "--", "--tokenizer_mode=hf") is None  # vLLM reads it as --tokenizer-mode
    assert served_tokenizer_mode(copy, "--no-preflight") == "mistral"  # one listing tells
    plain = mistral_both_formats("tokenizer.model")
    plain.pop("consolidated.safetensors")
    assert served_tokenizer_mode(write_repo(tmp_path / "plain", plain)) is None
    note = run_cli("serve", str(copy), "--dry-run")
    assert note.exit_code == 0 and "added --tokenizer-mode mistral" in note.stderr, note.stderr
    assert "--tokenizer-mode mistral" in note.stdout


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


def lora_adapter(base: str | None, *, tokenizer: bool) -> dict[str, bytes | str | dict[str, Any]]:
    """Like a PEFT LoRA repo: adapter config and weights, the trainer's state, sometimes a tokenizer."""
    config: dict[str, Any] = {"peft_type": "LORA", "r": 8, "target_modules": ["q_proj", "v_proj"]}
    if base is not None:
        config["base_model_name_or_path"] = base
    files: dict[str, bytes | str | dict[str, Any]] = {
        "adapter_config.json": config,
        "adapter_model.safetensors": tensors("base_model.model.q_proj.lora_A.weight"),
        "training_args.bin": b"pickle",
        "README.md": "# adapter\n",
    }
    if tokenizer:
        files |= {"tokenizer.json": {"version": "1.0"}, "tokenizer_config.json": {"eos_token": "</s>"}}
    return files


ADAPTERS = {
    "lora-llama": lora_adapter("meta-llama/Llama-3.1-8B", tokenizer=False),
    "lora-mistral-with-tokenizer": lora_adapter("mistralai/Mistral-7B-v0.3", tokenizer=True),
    "lora-unnamed-base": lora_adapter(None, tokenizer=False),
}


@pytest.mark.parametrize("layout", sorted(ADAPTERS))
def test_an_adapter_transfers_and_says_how_to_serve_it(tmp_path: Path, layout: str) -> None:
    source = write_repo(tmp_path / "src", ADAPTERS[layout])
    assert excluded(source, tmp_path / "dest")["training_args.bin"] == "trainer state (not needed to serve)"
    run = transfer(source, tmp_path / "dest")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= copied(tmp_path / "dest")
    assert run.verify is not None and run.verify.ok, run.verify
    codes = {finding.code: finding for finding in run.verify.findings}
    assert "config-missing" not in codes and "tokenizer-missing" not in codes
    base = ADAPTERS[layout]["adapter_config.json"].get("base_model_name_or_path", "BASE_MODEL")  # type: ignore[union-attr]
    assert f"vllm serve {base} --enable-lora --lora-modules dest={tmp_path / 'dest'}" in codes["lora-adapter"].message

    served = run_cli("serve", str(tmp_path / "dest"), "--dry-run")
    assert served.exit_code == 2, served.stderr
    assert "is an adapter of" in served.stderr and "--enable-lora --lora-modules" in served.stderr
    assert "Traceback" not in served.stderr


def test_an_adapters_header_is_checked(tmp_path: Path) -> None:
    files = lora_adapter("meta-llama/Llama-3.1-8B", tokenizer=False)
    files["adapter_model.safetensors"] = tensors("a")[:-4]  # truncated
    source = write_repo(tmp_path / "src", files)
    with pytest.raises(ChecksFailed) as failed:
        transfer(source, tmp_path / "dest")
    run = failed.value.result
    assert isinstance(run, TransferRun) and run.verify is not None
    assert {finding.code for finding in run.verify.errors} == {"file-truncated"}


QWEN_CONFIG = {
    "architectures": ["QWenLMHeadModel"],
    "model_type": "qwen",
    "auto_map": {
        "AutoConfig": "configuration_qwen.QWenConfig",
        "AutoModelForCausalLM": "modeling_qwen.QWenLMHeadModel",
    },
}


def custom_code_repo(tokenizer_file: str) -> dict[str, bytes | str | dict[str, Any]]:
    """Like Qwen-7B: its own config, model and tokenizer classes, a tiktoken (or other) vocabulary."""
    return {
        "config.json": QWEN_CONFIG,
        "configuration_qwen.py": "class QWenConfig: ...\n",
        "modeling_qwen.py": "class QWenLMHeadModel: ...\n",
        "tokenization_qwen.py": "class QWenTokenizer: ...\n",
        "tokenizer_config.json": {"auto_map": {"AutoTokenizer": ["tokenization_qwen.QWenTokenizer", None]}},
        tokenizer_file: b"IQ== 0\n",
        "model.safetensors": tensors("transformer.wte.weight"),
    }


CUSTOM_CODE = {
    "qwen-tiktoken": custom_code_repo("qwen.tiktoken"),
    "own-vocabulary-file": custom_code_repo("vocab.bpe.bin"),
}


@pytest.mark.parametrize("layout", sorted(CUSTOM_CODE))
def test_custom_code_needs_trust_remote_code_asked_for(
    tmp_path: Path, s3_root: str, storage_env: dict[str, str], layout: str
) -> None:
    source = write_repo(tmp_path / "src", CUSTOM_CODE[layout])
    run = transfer(source, tmp_path / "dest")
    assert {"configuration_qwen.py", "modeling_qwen.py", "tokenization_qwen.py"} <= copied(tmp_path / "dest")
    assert run.verify is not None and run.verify.ok
    assert "tokenizer-missing" not in {finding.code for finding in run.verify.findings}
    assert run_cli("transfer", str(source), s3_root, env=storage_env).exit_code == 0

    for where, extra in (
        (str(tmp_path / "dest"), []),
        (str(tmp_path / "dest"), ["--no-preflight"]),
        (s3_root, ["--k8s"]),
    ):
        refused = run_cli("serve", where, "--dry-run", *extra, env=storage_env)
        assert refused.exit_code == 2, (extra, refused.stderr)
        assert "auto_map in config.json names configuration_qwen.QWenConfig" in refused.stderr
        assert "-- --trust-remote-code" in refused.stderr and "Traceback" not in refused.stderr
    accepted = run_cli("serve", str(tmp_path / "dest"), "--json", "--", "--trust-remote-code")
    assert accepted.exit_code == 0, accepted.stderr
    assert accepted.json()["argv"].count("--trust-remote-code") == 1
    manifest = run_cli("serve", s3_root, "--k8s", "--", "--trust-remote-code", env=storage_env)
    assert manifest.exit_code == 0, manifest.stderr
    assert manifest.stdout.count("--trust-remote-code") == 1


def test_trust_remote_code_is_never_added_for_a_plain_model(tmp_path: Path) -> None:
    files = custom_code_repo("qwen.tiktoken")
    files["config.json"] = HF_CONFIG
    files["tokenizer_config.json"] = {"eos_token": "</s>"}
    source = write_repo(tmp_path / "src", files)
    served = run_cli("serve", str(source), "--json")
    assert served.exit_code == 0, served.stderr
    assert "--trust-remote-code" not in served.json()["argv"]


WEIGHTS_ELSEWHERE = {
    "gguf-only": (
        {"README.md": "# q\n", "model-Q4_K_M.gguf": b"GGUF", "model-Q8_0.gguf": b"GGUF"},
        "GGUF export (model-Q4_K_M.gguf, model-Q8_0.gguf)",
        "--include '*.gguf'",
    ),
    "gguf-with-config": (
        {"config.json": HF_CONFIG, "tokenizer.json": {"version": "1.0"}, "model.Q4_0.gguf": b"GGUF"},
        "GGUF export (model.Q4_0.gguf)",
        "--include '*.gguf'",
    ),
    "pickle-only": (
        {"config.json": HF_CONFIG, "pytorch_model.bin": b"pickle"},
        "PyTorch pickle weights (pytorch_model.bin)",
        "--include '*.bin'",
    ),
    "subfolders-only": (
        {"model_index.json": {"_class_name": "Pipeline"}, "unet/diffusion_pytorch_model.safetensors": tensors("a"),
         "text_encoder/model.safetensors": tensors("b"), "text_encoder/config.json": HF_CONFIG},
        "*.safetensors in sub-folders text_encoder/, unet/",
        "transfer hf://org/{layout}/text_encoder DEST",
    ),
}  # fmt: skip


@pytest.mark.parametrize("layout", sorted(WEIGHTS_ELSEWHERE))
def test_no_weights_selected_names_where_they_are(fake_hub: Any, tmp_path: Path, layout: str) -> None:
    files, where, command = WEIGHTS_ELSEWHERE[layout]
    repo = write_repo(tmp_path / "repo", files)
    fake_hub.add_repo(
        f"org/{layout}", {str(path.relative_to(repo)): path.read_bytes() for path in repo.rglob("*") if path.is_file()}
    )
    result = run_cli("transfer", f"hf://org/{layout}", str(tmp_path / "dest"))
    assert result.exit_code == 2, result.stderr
    assert where in result.stderr and command.format(layout=layout) in result.stderr, result.stderr
    assert not (tmp_path / "dest").exists() or not any((tmp_path / "dest").iterdir())


@pytest.mark.parametrize("suffix", [".gguf", ".bin"])
def test_transfer_verify_index_and_serve_agree_on_a_copy_without_safetensors(tmp_path: Path, suffix: str) -> None:
    source = write_repo(tmp_path / "src", {"config.json": HF_CONFIG, f"model{suffix}": b"weights"})
    dest = str(tmp_path / "dest")
    copied_run = run_cli("transfer", str(source), dest, "--include", f"*{suffix}")
    assert (tmp_path / "dest" / f"model{suffix}").exists()
    verified = run_cli("verify-index", dest)
    served = run_cli("serve", dest, "--dry-run")
    for result in (copied_run, verified, served):
        assert result.exit_code == 3, result.stderr
        assert f"no .safetensors files directly under {dest}" in result.stderr
        assert f"(model{suffix})" in result.stderr and "Traceback" not in result.stderr
    assert "--no-verify" in copied_run.stderr
    assert run_cli("transfer", str(source), dest + "-2", "--include", f"*{suffix}", "--no-verify").exit_code == 0


CONFIGS_WITH_CODE = {
    "qwen-unknown-type": (QWEN_CONFIG, "configuration_qwen.py"),
    "made-up-type": ({"model_type": "acme_lm", "auto_map": {"AutoConfig": "conf.AcmeConfig"}}, "conf.py"),
    "known-type-with-auto-map": (
        {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3",
         "auto_map": {"AutoConfig": "configuration_phi3.Phi3Config"}},
        "configuration_phi3.py",
    ),
    "known-type-via-vllm": (
        {"model_type": "chatglm", "auto_map": {"AutoConfig": "configuration_chatglm.ChatGLMConfig"}},
        "configuration_chatglm.py",
    ),
    "plain": (HF_CONFIG, "unused.py"),
}  # fmt: skip


@requires_vllm_oracle
def test_trust_remote_code_is_asked_for_exactly_where_vllm_needs_it(tmp_path: Path) -> None:
    """streamctl's rule against vLLM's own config loading (get_config, trust_remote_code=False) on each
    layout, and its list of known model types against the installed vLLM and transformers."""
    from streamctl.checkpoint.files import repo_kind
    from streamctl.checkpoint.model_types import KNOWN_MODEL_TYPES

    folders = []
    for layout, (config, code_file) in sorted(CONFIGS_WITH_CODE.items()):
        folders.append(write_repo(tmp_path / layout, {"config.json": config, code_file: "class C: ...\n"}))
    verdict = model_configs(folders)
    assert set(verdict["known_model_types"]) == KNOWN_MODEL_TYPES
    for (layout, (config, _)), result in zip(sorted(CONFIGS_WITH_CODE.items()), verdict["results"], strict=True):
        needs_trust = repo_kind({"config.json": config}).custom_code is not None
        assert needs_trust is not result["loads"], (layout, result)
        if needs_trust:
            assert "trust_remote_code" in result["error"] or "custom code" in result["error"], result
