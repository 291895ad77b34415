"""The vLLM 0.33 oracle checked against itself, and against specs/sharded-state.md.

Why: `streamctl shard` and `streamctl serve` are judged by vLLM itself (tests/oracle.py). Before anyone
trusts that judge, it must (1) accept what vLLM's own ShardedStateLoader.save_model writes, for every model
family and layout `shard` supports, (2) reject a checkpoint with one permuted tensor, one dropped scale
buffer, an HF name left unfused or an unpadded embedding, and (3) agree with vLLM's serve parser on the
Run:ai extra-config rules.
The reference layouts are also compared with the spec's shape table, so `shard` authors know the table
they implement is what vLLM 0.33 really does.

Cost: three oracle subprocesses for the whole module (vLLM's import dominates), each batching its jobs.
Skipped only when STREAMCTL_VLLM_PYTHON is unset (.ci/test sets it from .ci/vllm-env).
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from oracle import check_serve_args_many, check_sharded_many, requires_vllm_oracle, save_reference_many
from tiny_models import SAFETENSORS_DTYPE, read_safetensors, tiny_config, write_safetensors_file, write_tiny_checkpoint

pytestmark = requires_vllm_oracle

# kind -> served dtype: both half types, so a dtype slip anywhere shows.
KINDS = {
    "llama-gqa": "bfloat16",  # 8 heads / 2 KV: TP 1-2 split KV heads (nkv >= TP), TP 4 replicates (nkv < TP)
    "llama-tied": "float16",  # tie_word_embeddings
    "llama-head-dim": "bfloat16",  # head_dim 32 != 64 / 4
    "qwen2": "bfloat16",  # qkv bias; 4 KV heads, so nkv > TP at TP 2
    "mistral": "float16",
}
LAYOUTS = [(1, 1), (2, 1), (4, 1), (2, 2)]  # (tp, pp); 3 layers, so PP 2 splits them 2 + 1
CUSTOM_PATTERN = "weights-tp{tp_rank}-part{part}.safetensors"
SMALL_PARTS = 5_000  # bytes


def _case_id(kind: str, tp: int, pp: int) -> str:
    return f"{kind}-tp{tp}" + (f"-pp{pp}" if pp > 1 else "")


CASES = [(kind, tp, pp) for kind in KINDS for tp, pp in LAYOUTS]
CASE_IDS = [_case_id(*case) for case in CASES]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-oracle")


@pytest.fixture(scope="module")
def hf_dirs(workdir: Path) -> dict[str, Path]:
    # Mistral comes in two files with an index, as multi-file HF checkpoints do.
    return {
        kind: write_tiny_checkpoint(workdir / "hf" / kind, kind, dtype=dtype, files=2 if kind == "mistral" else 1)
        for kind, dtype in KINDS.items()
    }


@pytest.fixture(scope="module")
def references(workdir: Path, hf_dirs: dict[str, Path]) -> dict[str, tuple[Path, dict[str, Any]]]:
    """vLLM's own sharded output for every case, plus one with a custom file-name pattern."""
    jobs: dict[str, dict[str, Any]] = {
        _case_id(kind, tp, pp): {
            "hf_dir": hf_dirs[kind],
            "out_dir": workdir / "ref" / _case_id(kind, tp, pp),
            "tp": tp,
            "pp": pp,
        }
        for kind, tp, pp in CASES
    }
    jobs["qwen2-tp2-custom-pattern"] = {
        "hf_dir": hf_dirs["qwen2"],
        "out_dir": workdir / "ref" / "qwen2-tp2-custom-pattern",
        "tp": 2,
        "pattern": CUSTOM_PATTERN,
    }
    # Parts of at most 5 kB: several parts per rank, and (vLLM's own behaviour) an EMPTY part 0, because
    # each rank's first tensor, its 8 kB embedding shard, is larger than max_size.
    jobs["llama-gqa-tp2-small-parts"] = {
        "hf_dir": hf_dirs["llama-gqa"],
        "out_dir": workdir / "ref" / "llama-gqa-tp2-small-parts",
        "tp": 2,
        "max_size": SMALL_PARTS,
    }
    results = save_reference_many(list(jobs.values()))
    return {name: (Path(job["out_dir"]), result) for (name, job), result in zip(jobs.items(), results, strict=True)}


def _corrupt(source: Path, target: Path, file_name: str, tensor: str, how: str) -> None:
    """Copy a reference folder and damage one tensor of one file (pure Python, no torch)."""
    shutil.copytree(source, target)
    tensors = read_safetensors(target / file_name)
    name, dtype, shape, data = tensors.pop(tensor)
    if how == "swap-rows":  # a permutation: rows 0 and 1 trade places, same bytes overall
        row = len(data) // shape[0]
        tensors[name] = (name, dtype, shape, data[row : 2 * row] + data[:row] + data[2 * row :])
    elif how == "rename-to-q_proj":  # an HF name left where vLLM has its fused one
        new_name = name.replace("qkv_proj", "q_proj")
        tensors[new_name] = (new_name, dtype, shape, data)
    elif how == "unpad":  # vocab rows without vLLM's padding to a multiple of 64
        rows = tiny_config("llama-gqa")["vocab_size"] // 2
        row = len(data) // shape[0]
        tensors[name] = (name, dtype, (rows, *shape[1:]), data[: rows * row])
    else:
        assert how == "drop", how
    write_safetensors_file(target / file_name, tensors)


RANK0 = "model-rank-0-part-0.safetensors"
RANK1 = "model-rank-1-part-0.safetensors"
NEGATIVES = {
    # name: (file of the llama-gqa TP 2 reference, tensor, damage, what the failing rank's errors must say)
    "permuted-qkv": (
        RANK1,
        "model.layers.0.self_attn.qkv_proj.weight",
        "swap-rows",
        "model.layers.0.self_attn.qkv_proj.weight: values differ from vLLM's own load",
    ),
    "dropped-k-scale": (
        RANK0,
        "model.layers.1.self_attn.attn._k_scale",
        "drop",
        "Missing keys ('model.layers.1.self_attn.attn._k_scale',)",
    ),
    "hf-name-left": (
        RANK0,
        "model.layers.2.self_attn.qkv_proj.weight",
        "rename-to-q_proj",
        f"model.layers.2.self_attn.q_proj.weight ({RANK0}): not a tensor of this rank's vLLM model",
    ),
    "unpadded-embedding": (
        RANK1,
        "model.embed_tokens.weight",
        "unpad",
        f"model.embed_tokens.weight ({RANK1}): shape [50, 64], vLLM expects [64, 64]",
    ),
}


# `shard --engine vllm-gpu` needs GPUs to run vLLM's engine, so here vLLM's own save_model output (the
# references) stands in for what the engine saved, and the rest of the path runs for real: renumbering
# around vLLM's empty parts, copying to DEST, the manifest and both checks; then vLLM loads the result.
ENGINE_CASES: dict[str, tuple[str, int, int, str | None, int | None]] = {
    # reference name: (kind, tp, pp, pattern, max part size)
    "llama-gqa-tp2-small-parts": ("llama-gqa", 2, 1, None, SMALL_PARTS),
    "qwen2-tp2-custom-pattern": ("qwen2", 2, 1, CUSTOM_PATTERN, None),
    "mistral-tp2-pp2": ("mistral", 2, 2, None, None),
    "llama-tied-tp4": ("llama-tied", 4, 1, None, None),
}


@pytest.fixture(scope="module")
def engine_outputs(
    workdir: Path, hf_dirs: dict[str, Path], references: dict[str, tuple[Path, dict[str, Any]]]
) -> dict[str, tuple[Path, Any, list[list[str]]]]:
    """name -> (DEST, ShardResult, the commands the engine runner was given) of `--engine vllm-gpu`."""
    import streamctl.shard.engines.vllm_gpu.engine as shard_module
    from streamctl.progress import NULL_PROGRESS
    from streamctl.shard.plan import ShardOptions
    from streamctl.shard.run import run_shard
    from streamctl.storage import open_location

    outputs = {}
    for name, (kind, tp, pp, pattern, max_size) in ENGINE_CASES.items():
        reference = references[name][0]
        commands: list[list[str]] = []

        def saved_by_vllm(command: list[str], reference: Path = reference, commands: list = commands) -> Any:
            commands.append(command)
            for file in reference.glob("*.safetensors"):  # what vLLM's save_sharded_state writes: weights only
                shutil.copy(file, Path(json.loads(command[-1])["output"]) / file.name)
            return subprocess.CompletedProcess(command, 0, "", "")

        options = ShardOptions(
            tp,
            pipeline_parallel_size=pp,
            pattern=pattern,
            engine="vllm-gpu",
            **({"max_part_size": max_size} if max_size else {}),
        )
        dest = workdir / "engine" / name
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(shard_module, "check_vllm_engine_available", lambda: None)
            engine = shard_module.VllmGpuEngine(saved_by_vllm)
            result = run_shard(
                open_location(str(hf_dirs[kind])), open_location(str(dest)), options, NULL_PROGRESS, engine
            )
        outputs[name] = (dest, result, commands)
    return outputs


@pytest.fixture(scope="module")
def verdicts(
    workdir: Path,
    hf_dirs: dict[str, Path],
    references: dict[str, tuple[Path, dict[str, Any]]],
    engine_outputs: dict[str, tuple[Path, Any, list[list[str]]]],
) -> dict[str, dict[str, Any]]:
    """check_sharded on every reference (must pass) and on the damaged copies (must fail): one process."""
    jobs: dict[str, dict[str, Any]] = {
        name: {"hf_dir": hf_dirs[kind], "sharded_dir": references[name][0], "tp": tp, "pp": pp}
        for name, (kind, tp, pp) in zip(CASE_IDS, CASES, strict=True)
    }
    jobs["qwen2-tp2-custom-pattern"] = {
        "hf_dir": hf_dirs["qwen2"],
        "sharded_dir": references["qwen2-tp2-custom-pattern"][0],
        "tp": 2,
        "pattern": CUSTOM_PATTERN,
    }
    jobs["llama-gqa-tp2-small-parts"] = {
        "hf_dir": hf_dirs["llama-gqa"],
        "sharded_dir": references["llama-gqa-tp2-small-parts"][0],
        "tp": 2,
    }
    # The same files through vLLM's plain safetensors path (load format sharded_state) as well.
    jobs["llama-gqa-tp2-sharded_state"] = {**jobs["llama-gqa-tp2"], "load_format": "sharded_state"}
    for name, (kind, tp, pp, pattern, _) in ENGINE_CASES.items():
        jobs[f"engine-vllm-{name}"] = {
            "hf_dir": hf_dirs[kind],
            "sharded_dir": engine_outputs[name][0],
            "tp": tp,
            "pp": pp,
            "pattern": pattern,
        }
    for name, (file_name, tensor, how, _) in NEGATIVES.items():
        target = workdir / "damaged" / name
        _corrupt(references["llama-gqa-tp2"][0], target, file_name, tensor, how)
        jobs[name] = {"hf_dir": hf_dirs["llama-gqa"], "sharded_dir": target, "tp": 2}
    return dict(zip(jobs, check_sharded_many(list(jobs.values())), strict=True))


def _why(verdict: dict[str, Any]) -> str:
    problems = [f"rank pp{r['pp_rank']}/tp{r['tp_rank']}: {e}" for r in verdict["ranks"] for e in r["errors"]]
    return json.dumps({"error": verdict["error"], "folder": verdict["folder_errors"], "ranks": problems}, indent=1)


@pytest.mark.parametrize(
    "case", [*CASE_IDS, "qwen2-tp2-custom-pattern", "llama-gqa-tp2-sharded_state", "llama-gqa-tp2-small-parts"]
)
def test_vllm_accepts_its_own_sharded_output(verdicts: dict[str, dict[str, Any]], case: str) -> None:
    verdict = verdicts[case]
    assert verdict["ok"], _why(verdict)
    tp, pp = verdict["tp"], verdict["pp"]
    assert [(r["pp_rank"], r["tp_rank"]) for r in verdict["ranks"]] == [(p, t) for p in range(pp) for t in range(tp)]
    assert all(rank["tensors"] > 0 and rank["files"] for rank in verdict["ranks"])


@pytest.mark.parametrize("name", list(NEGATIVES))
def test_oracle_rejects_a_damaged_checkpoint(verdicts: dict[str, dict[str, Any]], name: str) -> None:
    verdict = verdicts[name]
    assert not verdict["ok"] and verdict["error"] is None, _why(verdict)
    file_name, _, _, expected = NEGATIVES[name]
    failing = [r for r in verdict["ranks"] if not r["ok"]]
    assert len(failing) == 1 and file_name in failing[0]["files"], _why(verdict)
    assert any(expected in error for error in failing[0]["errors"]), _why(verdict)


def _pp_indices(layers: int, pp_rank: int, pp: int) -> range:
    """vLLM's get_pp_indices as the spec states it: remainder to the stages before the last."""
    sizes = [layers // pp] * pp
    for i in range(2, layers % pp + 2):
        sizes[-i] += 1
    start = sum(sizes[:pp_rank])
    return range(start, start + sizes[pp_rank])


def _spec_rank_layout(config: dict[str, Any], tp: int, pp: int, pp_rank: int) -> dict[str, tuple[str, list[int]]]:
    """Names, dtypes and per-rank shapes of one rank, from the table in specs/sharded-state.md."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv_heads, inter = config["num_key_value_heads"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // heads
    kv_per_rank = kv_heads // tp if tp <= kv_heads else 1
    vocab_per_rank = math.ceil(config["vocab_size"] / 64) * 64 // tp
    weight = SAFETENSORS_DTYPE[config["torch_dtype"]]
    qkv_rows = (heads // tp + 2 * kv_per_rank) * head_dim
    first, last = pp_rank == 0, pp_rank == pp - 1
    layout: dict[str, tuple[str, list[int]]] = {}
    if first:
        layout["model.embed_tokens.weight"] = (weight, [vocab_per_rank, hidden])
    for i in _pp_indices(config["num_hidden_layers"], pp_rank, pp):
        p = f"model.layers.{i}"
        layout[f"{p}.self_attn.qkv_proj.weight"] = (weight, [qkv_rows, hidden])
        if config["model_type"] == "qwen2" or config.get("attention_bias"):
            layout[f"{p}.self_attn.qkv_proj.bias"] = (weight, [qkv_rows])
        layout[f"{p}.self_attn.o_proj.weight"] = (weight, [hidden, heads * head_dim // tp])
        layout[f"{p}.mlp.gate_up_proj.weight"] = (weight, [2 * inter // tp, hidden])
        layout[f"{p}.mlp.down_proj.weight"] = (weight, [hidden, inter // tp])
        layout[f"{p}.input_layernorm.weight"] = (weight, [hidden])
        layout[f"{p}.post_attention_layernorm.weight"] = (weight, [hidden])
        for scale in ("_k_scale", "_v_scale", "_q_scale", "_prob_scale"):
            layout[f"{p}.self_attn.attn.{scale}"] = ("F32", [])
    if last:
        layout["model.norm.weight"] = (weight, [hidden])
        layout["lm_head.weight"] = (weight, [vocab_per_rank, hidden])
        if config.get("tie_word_embeddings"):
            layout.pop("model.embed_tokens.weight", None)  # shares storage with lm_head: "l" < "m"
    return layout


@pytest.mark.parametrize(("kind", "tp", "pp"), CASES, ids=CASE_IDS)
def test_spec_table_matches_vllm_reference(
    references: dict[str, tuple[Path, dict[str, Any]]], kind: str, tp: int, pp: int
) -> None:
    out_dir, result = references[_case_id(kind, tp, pp)]
    config = json.loads((out_dir / "config.json").read_text())
    assert result["copied"] == ["config.json", "generation_config.json"]
    for rank in result["ranks"]:
        pattern = "model-rank-{tp}-part-0.safetensors" if pp == 1 else "model-pp-{pp}-tp-{tp}-part-0.safetensors"
        assert rank["files"] == [pattern.format(tp=rank["tp_rank"], pp=rank["pp_rank"])]
        listed = {
            name: (entry["dtype"], entry["shape"])
            for file_name in rank["files"]
            for name, entry in result["tensors"][file_name].items()
        }
        assert listed == _spec_rank_layout(config, tp, pp, rank["pp_rank"]), rank


SERVE_CASES: dict[str, tuple[list[str], str | None]] = {
    # name: (arguments after `vllm serve`, None if accepted else a fragment of vLLM's error)
    "streamer-all-keys": (
        [
            "MODEL",
            "--load-format",
            "runai_streamer",
            "--model-loader-extra-config",
            '{"concurrency":16,"memory_limit":5368709120,"distributed":true}',
        ],
        None,
    ),
    "streamer-concurrency-string": (
        ["MODEL", "--load-format", "runai_streamer", "--model-loader-extra-config", '{"concurrency":"16"}'],
        "concurrency must be a positive integer",
    ),
    "sharded-rejects-concurrency": (
        ["MODEL", "--load-format", "runai_streamer_sharded", "--model-loader-extra-config", '{"concurrency":16}'],
        "Unexpected extra config keys",
    ),
    "sharded-pattern": (
        [
            "MODEL",
            "--load-format",
            "runai_streamer_sharded",
            "--model-loader-extra-config",
            '{"pattern":"model-rank-{rank}-part-{part}.safetensors"}',
        ],
        None,
    ),
    "model-option-moved-to-positional": (
        ["--tensor-parallel-size", "2", "--model", "MODEL", "--load-format", "runai_streamer"],
        None,
    ),
}


@pytest.fixture(scope="module")
def serve_verdicts() -> dict[str, dict[str, Any]]:
    return dict(zip(SERVE_CASES, check_serve_args_many([argv for argv, _ in SERVE_CASES.values()]), strict=True))


@pytest.mark.parametrize("name", list(SERVE_CASES))
def test_vllm_serve_arguments(serve_verdicts: dict[str, dict[str, Any]], name: str) -> None:
    argv, expected_error = SERVE_CASES[name]
    verdict = serve_verdicts[name]
    assert verdict["model"] == "MODEL", verdict
    if expected_error is None:
        assert verdict["ok"] and verdict["error"] is None, verdict
        assert verdict["load_format"] == argv[argv.index("--load-format") + 1]
    else:
        assert not verdict["ok"] and expected_error in (verdict["error"] or ""), verdict


def test_serve_extra_config_reaches_the_streamer_environment(serve_verdicts: dict[str, dict[str, Any]]) -> None:
    """vLLM 0.33 turns concurrency/memory_limit into the streamer's environment variables."""
    verdict = serve_verdicts["streamer-all-keys"]
    assert verdict["extra_config"] == {"concurrency": 16, "memory_limit": 5368709120, "distributed": True}
    assert verdict["loader"] == "RunaiModelStreamerLoader"
    # Subset: with AWS_ENDPOINT_URL set (other tests' S3 server) vLLM also copies it to RUNAI_STREAMER_S3_ENDPOINT.
    expected = {"RUNAI_STREAMER_CONCURRENCY": "16", "RUNAI_STREAMER_MEMORY_LIMIT": "5368709120"}
    assert expected.items() <= verdict["env_updates"].items(), verdict["env_updates"]
    assert serve_verdicts["sharded-pattern"]["loader"] == "ShardedStateLoader"


def test_vllm_splits_parts_and_writes_an_empty_first_part(
    references: dict[str, tuple[Path, dict[str, Any]]], verdicts: dict[str, dict[str, Any]]
) -> None:
    """vLLM's save_model starts a new part before a tensor that would overflow max_size, even when the
    current part is still empty: `shard` must not copy that (specs/sharded-state.md: never an empty part),
    yet vLLM loads such a folder, so the oracle only warns."""
    _out_dir, result = references["llama-gqa-tp2-small-parts"]
    for rank in result["ranks"]:
        parts = [result["tensors"][name] for name in rank["files"]]
        assert len(parts) > 2 and parts[0] == {}, rank["files"]
        assert all(parts[1:]), "only the first part is empty"
    verdict = verdicts["llama-gqa-tp2-small-parts"]
    assert all(
        rank["warnings"] == [f"model-rank-{rank['tp_rank']}-part-0.safetensors: no tensors"]
        for rank in verdict["ranks"]
    )


@pytest.mark.parametrize("name", list(ENGINE_CASES))
def test_engine_vllm_path_on_vllms_own_files(
    references: dict[str, tuple[Path, dict[str, Any]]],
    engine_outputs: dict[str, tuple[Path, Any, list[list[str]]]],
    verdicts: dict[str, dict[str, Any]],
    name: str,
) -> None:
    """DEST holds vLLM's bytes unchanged (only empty parts dropped and the rest renumbered from 0), both
    checks and the manifest agree, and vLLM 0.33 loads DEST with no warning."""
    _kind, tp, pp, _pattern, max_size = ENGINE_CASES[name]
    reference, _ = references[name]
    dest, result, commands = engine_outputs[name]
    arguments = json.loads(commands[0][-1])
    assert (arguments["tensor_parallel_size"], arguments["pipeline_parallel_size"]) == (tp, pp)
    assert arguments["max_size"] == (max_size or 5 * 1024**3) and arguments["pattern"] == result.plan.pattern
    assert result.engine == "vllm-gpu" and result.ok
    assert result.reconstruction is not None and result.reconstruction.ok and result.reconstruction.tensors > 0
    non_empty = sorted(
        (path for path in reference.glob("*.safetensors") if read_safetensors(path)), key=lambda path: path.name
    )
    digest = {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in dest.glob("*.safetensors")}
    assert sorted(digest.values()) == sorted(hashlib.sha256(path.read_bytes()).hexdigest() for path in non_empty)
    if max_size:  # vLLM's empty part 0 is gone: parts count from 0 again, in vLLM's order
        for rank in range(tp):
            theirs = sorted(
                (p for p in non_empty if p.name.startswith(f"model-rank-{rank}-")),
                key=lambda p: int(p.name.rsplit("-", 1)[1].split(".")[0]),
            )
            ours = [dest / f"model-rank-{rank}-part-{part}.safetensors" for part in range(len(theirs))]
            assert [p.read_bytes() for p in ours] == [p.read_bytes() for p in theirs]
    manifest = json.loads((dest / "streamctl-shard-manifest.json").read_text())
    listed = {file["path"]: file["sha256"] for rank in manifest["ranks"] for file in rank["files"]}
    assert manifest["engine"] == "vllm-gpu" and listed == digest
    verdict = verdicts[f"engine-vllm-{name}"]
    assert verdict["ok"], _why(verdict)
    assert all(rank["warnings"] == [] for rank in verdict["ranks"]), _why(verdict)
