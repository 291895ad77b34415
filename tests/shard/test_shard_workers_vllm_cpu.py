"""`shard --worker K/N --engine vllm-cpu`: the shares of a split, each laid out by vLLM's own model code in
its own vLLM worker, make up one run's files byte for byte; the worker completing the set runs vLLM's loader
on every rank of a local DEST (the others check their own tensors against vLLM's rank models)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from oracle import oracle_python, requires_vllm_oracle
from split_helpers import assert_same_as_one_run, contents, run_together, shard_manifest
from streamctl.dest.shares import Worker
from streamctl.shard.plan import ShardOptions
from streamctl.shard.run import shard_checkpoint
from streamctl.storage import open_location
from streamctl.storage.base import Location
from tiny_models import write_tiny_checkpoint
from vllm_cpu_helpers import SharedWorker

pytestmark = [requires_vllm_oracle, pytest.mark.timeout(900)]

CASES = {  # name -> (options, workers)
    "tp2-pp2-n2": (ShardOptions(tensor_parallel_size=2, pipeline_parallel_size=2, max_part_size=30_000), 2),
    "tp2-n3": (ShardOptions(tensor_parallel_size=2, max_part_size=40_000), 3),
}


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Location:
    return open_location(str(write_tiny_checkpoint(tmp_path_factory.mktemp("hf") / "m", "llama-gqa", files=2)))


def vllm_cpu(options: ShardOptions, **changes: object) -> ShardOptions:
    return replace(options, engine="vllm-cpu", vllm_python=oracle_python(), **changes)


@pytest.mark.parametrize("case", CASES)
def test_n_vllm_cpu_workers_write_one_runs_files(
    case: str, source: Location, tmp_path: Path, shared_vllm_worker: SharedWorker
) -> None:
    options, count = CASES[case]
    one = open_location(str(tmp_path / "one"))
    assert shard_checkpoint(source, one, vllm_cpu(options), worker=shared_vllm_worker.get()).ok
    dest = open_location(str(tmp_path / "split"))
    for step, index in enumerate(reversed(range(count))):
        result = shard_checkpoint(
            source, dest, vllm_cpu(options, worker=Worker(index, count)), worker=shared_vllm_worker.get()
        )
        assert result.ok and result.plan.share and result.tensor_check is not None and result.tensor_check.ok
        last = step == count - 1
        assert shard_manifest(dest).complete is last
        if last:  # vLLM's loader on every rank, though this worker sent the tensors of its own parts only
            assert result.loader_check is not None and result.loader_check.ok
            ranks = {(file.pp_rank, file.tp_rank) for file in result.plan.files()}
            assert {(rank["pp_rank"], rank["tp_rank"]) for rank in result.loader_check.to_json()["ranks"]} == ranks
        else:
            assert result.loader_check is None and result.verify is None
    assert_same_as_one_run(contents(dest), contents(one))
    rerun = shard_checkpoint(source, dest, vllm_cpu(options, worker=Worker(0, count)), worker=shared_vllm_worker.get())
    assert rerun.ok and rerun.bytes_written == 0 and rerun.share is not None and rerun.share.complete


def test_two_vllm_cpu_worker_processes_at_once(
    source: Location, tmp_path: Path, shared_vllm_worker: SharedWorker
) -> None:
    options, _ = CASES["tp2-n3"]
    one = open_location(str(tmp_path / "one"))
    assert shard_checkpoint(source, one, vllm_cpu(options), worker=shared_vllm_worker.get()).ok
    dest = str(tmp_path / "split")
    common = ["shard", source.url, dest, "-tp", "2", "--max-part-size", "40000", "--engine", "vllm-cpu"]
    common += ["--vllm-python", str(oracle_python()), "--json"]
    documents = run_together([[*common, "--worker", f"{index}/2"] for index in range(2)])
    assert [document["worker"]["complete"] for document in documents].count(True) == 1
    assert_same_as_one_run(contents(open_location(dest)), contents(one))
