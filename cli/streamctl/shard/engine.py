"""The contract between a shard run (`run_shard`, shard/run.py: lease, DEST state, the manifests, the result)
and an engine (shard/engines/<name>/: what lays the rank files out): the engine plans, writes and checks;
the run does everything else, the same way for every engine."""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

from streamctl.progress import Progress
from streamctl.shard.checks import ReconstructionReport
from streamctl.shard.plan import Engine, ShardOptions, ShardPlan
from streamctl.shard.writer import WrittenFile
from streamctl.storage.base import ListingNote, Location
from streamctl.verify.report import VerifyReport


@dataclass(frozen=True)
class EngineRun:
    """What every step of an engine is given: the run's locations, options and progress."""

    source: Location
    dest: Location  # under the lease (plan_dest on): every write behind the lease's fence
    options: ShardOptions
    progress: Progress
    source_id: str | None = None  # what the manifest names SOURCE by (a pinned Hub revision), else its URL

    @property
    def source_label(self) -> str:
        return self.source_id or self.source.url


@dataclass(frozen=True)
class Written:
    """What an engine's write step made: the rank files (complete, under their final names)."""

    files: tuple[WrittenFile, ...]
    bytes_written: int
    report: Mapping[str, Any] = field(default_factory=dict)  # what the engine says of its run (the result's)


class CheckReport(Protocol):
    """An engine's own check after writing (vllm-cpu: the tensor digests, vLLM's loader)."""

    @property
    def ok(self) -> bool: ...

    @property
    def problems(self) -> tuple[str, ...]: ...

    def to_json(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Checks:
    """The checks of the written files: verify-index --sharded always, then what the engine adds."""

    verify: VerifyReport | None  # None: a `--worker` share's own checks (the whole set's come with whole_checks)
    reconstruction: ReconstructionReport | None = None  # bit for bit against SOURCE (needs a layout table row)
    tensors: CheckReport | None = None
    loader: CheckReport | None = None


class ShardEngine(Protocol):
    """One engine for one run (shard/engines' factories make a new one each time), its steps in this order:
    `plan` (before the lease), `plan_dest` (under it), `write`, `checks`; all inside `session()`."""

    name: Engine  # recorded in the manifest and the result; a re-run reuses the files of the same engine only
    # Whether the plan names every rank file before it is written (the incomplete manifest lists them);
    # vllm-gpu's are named by vLLM as it saves.
    plans_rank_files: bool

    def session(self) -> AbstractContextManager[None]:
        """What the engine holds during the run (a worker, a temporary folder), released on every way out."""
        ...

    def plan(self, run: EngineRun) -> tuple[ListingNote, ...]:
        """Before the lease: read SOURCE, plan, refuse bad input (nothing is written anywhere yet). Returns
        SOURCE's listing notes (entries left out or read through links), already logged."""
        ...

    def plan_dest(self, run: EngineRun) -> ShardPlan:
        """Under the lease, before DEST is written: the plan with what DEST holds decided (what --force
        removes, what a re-run keeps), or the refusal of a DEST that holds other files."""
        ...

    def write(self, run: EngineRun, plan: ShardPlan) -> Written:
        """The rank files into DEST, all complete at the end, or none under its final name if this fails."""
        ...

    def checks(self, run: EngineRun, plan: ShardPlan, written: Written) -> Checks:
        """The checks of what `write` made (a failed one fails the run, exit 1, no completed manifest). A
        `--worker` share's (`plan.share` set): those of its own files only, without verify-index."""
        ...

    def whole_checks(self, run: EngineRun, plan: ShardPlan) -> Checks:
        """The checks of the whole set, which the `--worker` run completing it runs (shard/shares.py):
        verify-index --sharded, and what the engine checks only of complete ranks."""
        ...
