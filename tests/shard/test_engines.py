"""The shard engines behind one lifecycle: the registry (shard/engines/__init__.py) makes each engine by its
--engine name, and `run_shard` (shard/run.py) takes any engine through the same steps in the same order on
DEST: the engine's plan before the lease; under it its DEST plan, the "incomplete" manifest and the serving
files, its write, its checks, and the completed manifest last."""

from __future__ import annotations

import json
from contextlib import AbstractContextManager
from pathlib import Path
from typing import get_args

import pytest

from shard_models import write_model
from streamctl.checkpoint.files import SHARD_MANIFEST_NAME
from streamctl.errors import UsageError
from streamctl.progress import NULL_PROGRESS
from streamctl.shard.checks import ReconstructionReport
from streamctl.shard.engine import Checks, EngineRun, ShardEngine, Written
from streamctl.shard.engines import ENGINES, create_engine
from streamctl.shard.engines.offline.engine import OfflineEngine
from streamctl.shard.plan import Engine, ShardOptions, ShardPlan
from streamctl.shard.result import ShardCheckFailed
from streamctl.shard.run import run_shard
from streamctl.storage import open_location
from streamctl.storage.base import LEASE_NAME, ListingNote


def test_the_registry_makes_every_engine_by_its_name_without_starting_anything() -> None:
    assert sorted(ENGINES) == sorted(get_args(Engine))
    for name in ENGINES:
        engine = create_engine(name)
        assert engine.name == name
        assert engine.plans_rank_files == (name != "vllm-gpu")  # vLLM's save names its parts as it goes
    with pytest.raises(KeyError):
        create_engine("auto")  # decided before the registry (shard/auto.py)


class RecordingEngine:
    """The offline engine, recording what DEST holds as each step begins."""

    def __init__(self, dest: Path, fail_checks: bool = False) -> None:
        self.inner = OfflineEngine()
        self.name: Engine = self.inner.name
        self.plans_rank_files = self.inner.plans_rank_files
        self.dest = dest
        self.fail_checks = fail_checks
        self.steps: list[tuple[str, frozenset[str], bool | None]] = []

    def _record(self, step: str) -> None:
        names = frozenset(p.name for p in self.dest.iterdir()) if self.dest.exists() else frozenset()
        manifest = self.dest / SHARD_MANIFEST_NAME
        complete = json.loads(manifest.read_text())["complete"] if manifest.exists() else None
        self.steps.append((step, names, complete))

    def session(self) -> AbstractContextManager[None]:
        return self.inner.session()

    def plan(self, run: EngineRun) -> tuple[ListingNote, ...]:
        self._record("plan")
        return self.inner.plan(run)

    def plan_dest(self, run: EngineRun) -> ShardPlan:
        self._record("plan_dest")
        return self.inner.plan_dest(run)

    def write(self, run: EngineRun, plan: ShardPlan) -> Written:
        self._record("write")
        return self.inner.write(run, plan)

    def checks(self, run: EngineRun, plan: ShardPlan, written: Written) -> Checks:
        self._record("checks")
        checks = self.inner.checks(run, plan, written)
        if self.fail_checks:
            return Checks(checks.verify, ReconstructionReport(False, 0, 0, ("made to fail",)))
        return checks


def test_run_shard_takes_an_engine_through_the_lifecycle_in_order(tmp_path: Path) -> None:
    write_model(tmp_path / "hf", "llama-gqa")
    dest = tmp_path / "out"
    engine = RecordingEngine(dest)
    conforming: ShardEngine = engine
    result = run_shard(
        open_location(str(tmp_path / "hf")), open_location(str(dest)), ShardOptions(2), NULL_PROGRESS, conforming
    )
    steps = [step for step, _, _ in engine.steps]
    assert steps == ["plan", "plan_dest", "write", "checks"]
    (_, before_plan, _), (_, under_lease, _), (_, before_write, marked), (_, before_checks, still) = engine.steps
    assert before_plan == frozenset()  # nothing in DEST before the plan, not even the lease
    assert under_lease == {LEASE_NAME}
    assert marked is False and "config.json" in before_write  # marked incomplete, serving files first
    assert not any(name.endswith(".safetensors") for name in before_write)
    assert still is False and {file.path for file in result.files} <= before_checks
    manifest = json.loads((dest / SHARD_MANIFEST_NAME).read_text())
    assert manifest["complete"] is True and manifest["engine"] == "offline" and result.ok
    assert not (dest / LEASE_NAME).exists()  # released


def test_a_failed_engine_check_leaves_dest_marked_incomplete(tmp_path: Path) -> None:
    write_model(tmp_path / "hf", "llama-gqa")
    dest = tmp_path / "out"
    engine = RecordingEngine(dest, fail_checks=True)
    with pytest.raises(ShardCheckFailed, match="reconstruction check failed"):
        run_shard(open_location(str(tmp_path / "hf")), open_location(str(dest)), ShardOptions(2), NULL_PROGRESS, engine)
    assert json.loads((dest / SHARD_MANIFEST_NAME).read_text())["complete"] is False
    assert not (dest / LEASE_NAME).exists()


def test_an_engine_refusing_in_its_plan_leaves_dest_untouched(tmp_path: Path) -> None:
    write_model(tmp_path / "hf", "llama-gqa")
    dest = tmp_path / "out"
    engine = RecordingEngine(dest)
    with pytest.raises(UsageError):
        run_shard(open_location(str(tmp_path / "hf")), open_location(str(dest)), ShardOptions(3), NULL_PROGRESS, engine)
    assert [step for step, _, _ in engine.steps] == ["plan"] and not dest.exists()
