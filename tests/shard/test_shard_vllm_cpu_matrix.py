"""`streamctl shard --engine vllm-cpu` judged by vLLM 0.33 itself, across architectures.

Every case goes through the library entry point the CLI calls (`shard_checkpoint`, engine "vllm-cpu"), all of
them through ONE worker process (vLLM's import costs ~6-10 s), then ONE check_sharded.py run (vLLM's own
ShardedStateLoader through the Run:ai streamer loads every rank into a NaN-filled model, and it must equal
vLLM's own load of the HF checkpoint bit for bit) and ONE stream_runai.py run (the Run:ai streamer reads
every written file). The four table architectures must come out byte-identical to the offline engine.
Tiny random checkpoints are written by transformers itself, once per module. Skipped without
STREAMCTL_VLLM_PYTHON.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from oracle import (
    check_sharded_many,
    installed_vllm_version,
    requires_vllm_oracle,
    stream_runai_many,
)
from streamctl.checkpoint.files import SHARD_MANIFEST_NAME
from streamctl.shard.plan import ShardOptions
from streamctl.shard.run import shard_checkpoint
from streamctl.storage import open_location
from vllm_cpu_helpers import SharedWorker

pytestmark = [requires_vllm_oracle, pytest.mark.timeout(900)]  # the module fixture builds and shards every case

# Several parts per rank for the larger tensors (a 40 kB part holds about half a tiny decoder layer).
MAX_PART_SIZE = 40_000
TABLE_KINDS = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class Case:
    kind: str
    tp: int
    pp: int = 1
    ep: bool = False
    again: int = 0  # the same case once more, later in the same worker

    @property
    def id(self) -> str:
        return (
            f"{self.kind}-tp{self.tp}"
            + (f"-pp{self.pp}" if self.pp > 1 else "")
            + ("-ep" if self.ep else "")
            + (f"-again{self.again}" if self.again else "")
        )


TABLE_LAYOUTS = ((1, 1), (2, 1), (2, 2))  # (TP, PP) compared byte for byte with the offline engine
CASES = [
    *(Case(kind, tp, pp) for kind in TABLE_KINDS for tp, pp in (*TABLE_LAYOUTS, (4, 1))),
    *(Case("mixtral", tp) for tp in (1, 2, 4)),
    Case("mixtral", 2, ep=True),
    Case("mixtral", 4, ep=True),
    # 3 experts over EP 2: vLLM gives rank 0 two and rank 1 one (determine_expert_map), each in its own files
    Case("mixtral-odd", 2, ep=True),
    *(Case("qwen3-moe", tp) for tp in (1, 2)),
    Case("qwen3-moe", 2, ep=True),
    *(Case("qwen2-moe", tp) for tp in (1, 2, 4)),
    *(Case("deepseek-v2", tp) for tp in (1, 2, 4)),  # MLA, a dense first layer, shared + routed experts
    Case("deepseek-v2", 2, 2),
    Case("deepseek-v2", 2, ep=True),
    *(Case(kind, tp) for kind in ("gemma2", "gemma3-text", "phi3") for tp in (1, 2, 4)),
    *(Case(kind, tp) for kind in ("gemma3-mm", "qwen2-vl") for tp in (1, 2)),  # vision towers of 2 heads
    Case("qwen2-vl", 2, 2),  # the vision tower on the first stage
    *(Case(kind, tp) for kind in ("gpt2", "falcon") for tp in (1, 2)),  # layers under transformer.h
    Case("gpt-oss", 2),
    Case("gpt-oss", 2, ep=True),
    *(Case(kind, 2) for kind in ("starcoder2", "gemma", "gptneox")),
    Case("deepseek-v3", 2),
    Case("deepseek-v3", 2, ep=True),
    *(Case(kind, 2) for kind in ("olmoe", "phimoe", "granitemoe")),
    *(Case(kind, 2) for kind in ("mamba", "jamba", "qwen3-next")),  # state-space and linear-attention layers
    Case("qwen2_5-vl", 2),
    Case("mixtral-ct", 2),  # compressed-tensors FP8: F8_E4M3 weights + per-channel scales
    Case("mixtral-ct", 2, ep=True),
    # One worker builds and frees hundreds of models: nothing of an earlier one may leak into a later one
    # (vLLM keeps per-model caches keyed by id(model), and a freed model's id comes back).
    *(Case("deepseek-v2", 1 + again % 2, again=again) for again in range(1, 9)),
]


# CI runs this module on every supported vLLM release (.ci/test): the whole matrix on the default (newest) one,
# and on the others, with STREAMCTL_VLLM_MATRIX=subset, the table architectures and one MoE, one MLA and one
# multimodal model. `STREAMCTL_VLLM_MATRIX=full` (or unset) runs every case on whatever release the oracle has.
SUBSET_KINDS = frozenset({*TABLE_KINDS, "mixtral", "deepseek-v2", "gemma3-mm"})
if os.environ.get("STREAMCTL_VLLM_MATRIX", "full") == "subset":
    CASES = [case for case in CASES if case.kind in SUBSET_KINDS and not case.again]


@dataclass
class Outcome:
    case: Case
    dest: Path
    result: dict[str, Any] | None = None  # ShardResult.to_json()
    error: str | None = None  # the library's refusal or failure, when shard_checkpoint raised
    verdict: dict[str, Any] | None = None  # check_sharded's
    streamed: dict[str, Any] | None = None  # stream_runai's, every file of the case in one job

    def files(self) -> list[Path]:
        return sorted(self.dest.glob("*.safetensors"))


def _options(case: Case, **extra: Any) -> ShardOptions:
    return ShardOptions(
        tensor_parallel_size=case.tp,
        pipeline_parallel_size=case.pp,
        enable_expert_parallel=case.ep,
        max_part_size=MAX_PART_SIZE,
        **extra,
    )


def _shard_every_case(hf_root: Path, out_root: Path, shared: SharedWorker) -> Iterator[Outcome]:
    """Every case through shard_checkpoint with engine vllm-cpu, all through the session's one worker."""
    for case in CASES:
        outcome = Outcome(case, out_root / case.id)
        options = _options(case, engine="vllm-cpu", vllm_python=shared.python)
        source, dest = open_location(str(hf_root / case.kind)), open_location(str(outcome.dest))
        try:
            outcome.result = shard_checkpoint(source, dest, options, worker=shared.get()).to_json()
        except Exception as error:  # noqa: BLE001 - one failing case must not hide the others
            outcome.error = f"{type(error).__name__}: {error}"
        yield outcome


@pytest.fixture(scope="module")
def outcomes(
    tiny_hf_root: Path, tmp_path_factory: pytest.TempPathFactory, shared_vllm_worker: SharedWorker
) -> dict[str, Outcome]:
    """Every case sharded (tiny checkpoints and the worker: tests/shard/conftest.py, once per session), then
    judged by one check_sharded.py and one stream_runai.py process."""
    hf_root = tiny_hf_root
    out_root = tmp_path_factory.mktemp("out")
    done = {outcome.case.id: outcome for outcome in _shard_every_case(hf_root, out_root, shared_vllm_worker)}
    written = [outcome for outcome in done.values() if outcome.error is None]
    verdicts = check_sharded_many(
        [
            {
                "hf_dir": hf_root / outcome.case.kind,
                "sharded_dir": outcome.dest,
                "tp": outcome.case.tp,
                "pp": outcome.case.pp,
                "ep": outcome.case.ep,
            }
            for outcome in written
        ]
    )
    streamed = stream_runai_many([{"paths": outcome.files()} for outcome in written])
    for outcome, verdict, stream in zip(written, verdicts, streamed, strict=True):
        outcome.verdict, outcome.streamed = verdict, stream
    return done


def _written(outcomes: dict[str, Outcome], case: Case) -> Outcome:
    outcome = outcomes[case.id]
    assert outcome.error is None, f"{case.id}: shard --engine vllm-cpu failed: {outcome.error}"
    return outcome


def test_every_case_ran_in_the_one_worker(outcomes: dict[str, Outcome], shared_vllm_worker: SharedWorker) -> None:
    """No case (a refusal included) left the worker unusable: one vLLM import served them all."""
    assert len(outcomes) == len(CASES)
    assert shared_vllm_worker.started == 1 and shared_vllm_worker.worker is not None
    assert shared_vllm_worker.worker.broken is None and shared_vllm_worker.worker.process.poll() is None


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_vllm_loads_every_rank_equal_to_its_own_hf_load(outcomes: dict[str, Outcome], case: Case) -> None:
    outcome = _written(outcomes, case)
    assert outcome.verdict is not None
    bad = [rank for rank in outcome.verdict["ranks"] if not rank["ok"]]
    assert outcome.verdict["ok"], json.dumps(
        {"error": outcome.verdict["error"], "folder_errors": outcome.verdict["folder_errors"], "ranks": bad}
    )[:4000]
    assert len(outcome.verdict["ranks"]) == case.tp * case.pp
    assert all(rank["tensors"] > 0 and rank["files"] for rank in outcome.verdict["ranks"])


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_runai_streamer_reads_every_written_file(outcomes: dict[str, Outcome], case: Case) -> None:
    outcome = _written(outcomes, case)
    assert outcome.streamed is not None and outcome.streamed["ok"], outcome.streamed
    assert outcome.result is not None
    listed = sorted(file["path"] for file in outcome.result["files"])
    assert listed == [path.name for path in outcome.files()]
    manifest = json.loads((outcome.dest / SHARD_MANIFEST_NAME).read_text())
    expected = sorted(
        (tensor["name"], tensor["shape"])
        for rank in manifest["ranks"]
        for file in rank["files"]
        for tensor in file["tensors"]
    )
    assert sorted((name, shape) for name, _, shape in outcome.streamed["tensors"]) == expected


@pytest.fixture(scope="module")
def vllm_version() -> str:
    return installed_vllm_version()


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_manifest_records_the_engine_and_the_exact_vllm_version(
    outcomes: dict[str, Outcome], case: Case, vllm_version: str
) -> None:
    outcome = _written(outcomes, case)
    version = vllm_version
    manifest = json.loads((outcome.dest / SHARD_MANIFEST_NAME).read_text())
    assert manifest["complete"] is True
    assert (manifest["engine"], manifest["vllm_version"]) == ("vllm-cpu", version)
    assert outcome.result is not None
    assert (outcome.result["engine"], outcome.result["vllm_version"]) == ("vllm-cpu", version)
    assert (manifest["tensor_parallel_size"], manifest["pipeline_parallel_size"]) == (case.tp, case.pp)


@pytest.mark.parametrize(("kind", "tp", "pp"), [(k, tp, pp) for k in TABLE_KINDS for tp, pp in TABLE_LAYOUTS])
def test_table_architecture_is_byte_identical_to_the_offline_engine(
    outcomes: dict[str, Outcome], tiny_hf_root: Path, tmp_path: Path, kind: str, tp: int, pp: int
) -> None:
    """bf16 checkpoints: dtype auto means the same to both engines. Every file, parts included."""
    outcome = _written(outcomes, Case(kind, tp, pp))
    offline = tmp_path / "offline"
    shard_checkpoint(
        open_location(str(tiny_hf_root / kind)),
        open_location(str(offline)),
        _options(Case(kind, tp, pp), engine="offline"),
    )
    names = sorted(path.name for path in offline.iterdir() if path.name != SHARD_MANIFEST_NAME)
    assert sorted(path.name for path in outcome.dest.iterdir() if path.name != SHARD_MANIFEST_NAME) == names
    assert sum(name.endswith(".safetensors") for name in names) > tp * pp  # several parts per rank
    for name in names:
        assert (outcome.dest / name).read_bytes() == (offline / name).read_bytes(), name
