"""The offline engine: the layout table's plan (shard/planning.py), the table-driven writer (shard/writer.py),
and both checks against SOURCE (verify-index --sharded, the bit-for-bit reconstruction)."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

from streamctl.checkpoint.files import listing_notes, log_notes
from streamctl.shard.checks import check_reconstruction, check_verify, check_written
from streamctl.shard.dest import plan_dest
from streamctl.shard.engine import Checks, EngineRun, Written
from streamctl.shard.plan import Engine, ShardPlan
from streamctl.shard.planning import plan_shard
from streamctl.shard.writer import write_sharded
from streamctl.storage.base import ListingNote

F32_NOTE = (
    "note: the checkpoint has float32 weights; vLLM serves those as bfloat16/float16 with --dtype auto, "
    "so consider --dtype"
)


class OfflineEngine:
    """Plans by the layout table, writes by it in blocks of a few MiB, checks against SOURCE."""

    name: Engine = "offline"
    plans_rank_files = True

    def __init__(self) -> None:
        self._plan: ShardPlan | None = None

    def session(self) -> AbstractContextManager[None]:
        return nullcontext()  # nothing held beyond the run's own steps

    def plan(self, run: EngineRun) -> tuple[ListingNote, ...]:
        notes = listing_notes(run.source)
        log_notes(notes, run.progress)
        plan = plan_shard(run.source, run.dest, run.options, run.source_id)
        if plan.dtype == "auto" and any(
            source_tensor.dtype == "F32"
            for stage in plan.stages
            for tensor in stage.tensors
            for source_tensor in tensor.sources
        ):
            run.progress.log(F32_NOTE)
        self._plan = plan
        return notes

    def plan_dest(self, run: EngineRun) -> ShardPlan:
        if self._plan is None:
            raise RuntimeError("OfflineEngine.plan_dest before plan")
        return plan_dest(run.dest, self._plan, run.options.force)

    def write(self, run: EngineRun, plan: ShardPlan) -> Written:
        files, bytes_written = write_sharded(plan, run.source, run.dest, run.options, run.progress)
        return Written(files, bytes_written)

    def checks(self, run: EngineRun, plan: ShardPlan, written: Written) -> Checks:
        if plan.share is not None:  # a `--worker` share: its own parts bit for bit; the set is checked at the end
            own = check_reconstruction(
                run.source, run.dest, plan, run.options.retry, run.progress, chunk=run.options.read_block
            )
            return Checks(None, own)
        verify, reconstruction = check_written(
            run.source, run.dest, plan, run.options, run.progress, dtype_from_files=False
        )
        return Checks(verify, reconstruction)

    def whole_checks(self, run: EngineRun, plan: ShardPlan) -> Checks:
        return Checks(check_verify(run.dest, plan, run.progress))
