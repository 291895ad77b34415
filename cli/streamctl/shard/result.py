"""What a shard run reports and records: the written files, `ShardResult` (its JSON), `ShardCheckFailed`,
and DEST's shard manifest, written `"complete": false` before the first byte and completed last."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from streamctl.checkpoint.files import notes_to_json
from streamctl.dest.manifests import FileEntry, Rank, RankFile, ShardManifest, SourceFile, TensorEntry, put_manifest
from streamctl.dest.shares import ShareRecord, Worker
from streamctl.dest.uploads import CopiedFile
from streamctl.errors import VerificationFailed
from streamctl.shard.checks import ReconstructionReport
from streamctl.shard.engine import CheckReport
from streamctl.shard.plan import Engine, ShardPlan
from streamctl.shard.writer import WrittenFile
from streamctl.storage.base import ListingNote, Location
from streamctl.verify.report import VerifyReport


@dataclass(frozen=True)
class ShardResult:
    plan: ShardPlan
    engine: Engine
    files: tuple[WrittenFile, ...]
    copied: tuple[CopiedFile, ...]
    removed: tuple[str, ...]
    bytes_written: int
    seconds: float  # the whole run: plan, write, copy and both checks
    write_seconds: float  # planning and writing the weights, until every file is complete
    verify: VerifyReport | None  # None: a `--worker` share that did not complete the set (the last one checks it)
    reconstruction: ReconstructionReport | None  # None: no layout table row (vllm-gpu, vllm-cpu)
    discarded: tuple[str, ...] = ()  # unfinished uploads of earlier runs removed first
    notes: tuple[ListingNote, ...] = ()  # SOURCE entries left out (FIFOs, links not followed) or read through links
    skipped: tuple[str, ...] = ()  # rank files already in DEST from an identical earlier run, not rewritten
    tensor_check: CheckReport | None = None  # vllm-cpu: every tensor re-read against vLLM's rank model
    loader_check: CheckReport | None = None  # vllm-cpu, local DEST: vLLM's ShardedStateLoader on the files
    engine_report: Mapping[str, Any] = field(default_factory=dict)  # what the engine says of its run (vllm-cpu)
    worker: Worker | None = None  # `--worker K/N`: which share this run wrote (plan.share: its parts)
    share: ShareRecord | None = None  # `--worker`: the shares finished once this one went into the manifest

    @property
    def checks_failed(self) -> tuple[str, ...]:
        checks = (
            ("verify", self.verify),
            ("reconstruction", self.reconstruction),
            ("tensor", self.tensor_check),
            ("vLLM loader", self.loader_check),
        )
        return tuple(name for name, check in checks if check is not None and not check.ok)

    @property
    def ok(self) -> bool:
        return not self.checks_failed

    @property
    def throughput_mb_s(self) -> float:
        return self.bytes_written / 1e6 / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        plan = self.plan
        return {
            "source": plan.source,
            "dest": plan.dest,
            "tensor_parallel_size": plan.tensor_parallel_size,
            "pipeline_parallel_size": plan.pipeline_parallel_size,
            "pattern": plan.pattern,
            "vllm_version": plan.vllm_version,
            "layout": plan.layout,
            "engine": self.engine,
            **plan.engine_settings,
            "dtype": plan.dtype,
            "files": [
                {
                    "path": file.path,
                    "rank": file.tp_rank,
                    "tp_rank": file.tp_rank,
                    "pp_rank": file.pp_rank,
                    "part": file.part,
                    "size": file.size,
                    "sha256": file.sha256,
                    "tensors": len(file.tensors),
                }
                for file in self.files
            ],
            "copied": [{"path": file.path, "size": file.size, "sha256": file.sha256} for file in self.copied],
            "removed": list(self.removed),
            "left_alone": [item.to_json() for item in self.plan.left_alone],
            "skipped": list(self.skipped),
            "discarded_uploads": list(self.discarded),
            **notes_to_json(self.notes),
            "bytes_written": self.bytes_written,
            "seconds": round(self.seconds, 3),
            "write_seconds": round(self.write_seconds, 3),
            "throughput_mb_s": round(self.throughput_mb_s, 2),
            "checks": {
                "verify": self.verify.to_json() if self.verify else None,
                "reconstruction": self.reconstruction.to_json() if self.reconstruction else None,
                "tensors": self.tensor_check.to_json() if self.tensor_check else None,
                "vllm_loader": self.loader_check.to_json() if self.loader_check else None,
            },
            **({"engine_report": dict(self.engine_report)} if self.engine_report else {}),
            **({"worker": self._worker_json()} if self.worker else {}),
        }

    def _worker_json(self) -> dict[str, Any]:
        assert self.worker is not None
        parts = sorted(self.plan.share or ())
        record = self.share.to_json() if self.share else {"finished": None, "complete": False, "restarted": False}
        return {**self.worker.to_json(), **record, "parts": [{"pp_rank": pp, "part": part} for pp, part in parts]}


class ShardCheckFailed(VerificationFailed):
    """The files were written, but a post-write check failed (exit 1); `result` says which."""

    code = "shard-check-failed"

    def __init__(self, result: ShardResult) -> None:
        failed = result.checks_failed
        super().__init__(
            f"{result.plan.dest}: the {' and '.join(failed)} check failed after writing",
            hint="the files are left in place for inspection, marked incomplete (verify-index and serve refuse "
            "them); see the report",
        )
        self.result = result


def completed_manifest(result: ShardResult) -> ShardManifest:
    """The completed manifest: the run's settings, every rank file (size, sha256, tensors), the serving files
    copied, and the older streamctl files left in DEST."""
    copied = tuple(FileEntry(file.path, file.size, file.sha256) for file in result.copied)
    return plan_record(result.plan, result.engine, manifest_ranks(result.files), copied).stamped()


def plan_record(
    plan: ShardPlan, engine: Engine, ranks: tuple[Rank, ...], files: tuple[FileEntry, ...]
) -> ShardManifest:
    """The completed manifest of `plan` with these rank and serving files (not stamped)."""
    return ShardManifest(
        complete=True,
        source=plan.source,
        engine=engine,
        architecture=plan.dims.architecture,
        tensor_parallel_size=plan.tensor_parallel_size,
        pipeline_parallel_size=plan.pipeline_parallel_size,
        pattern=plan.pattern,
        vllm_version=plan.vllm_version,
        layout=plan.layout,
        engine_settings=dict(plan.engine_settings),
        dtype=plan.dtype,
        max_part_size=plan.max_part_size,
        source_files=tuple(SourceFile(*entry) for entry in plan.source_files),
        ranks=ranks,
        files=files,
        older_files=tuple(item.path for item in plan.left_alone if item.streamctl),
    )


def write_shard_manifest(dest: Location, result: ShardResult) -> None:
    """The completed manifest (see completed_manifest), written last."""
    put_manifest(dest, completed_manifest(result))


def manifest_ranks(files: Sequence[WrittenFile]) -> tuple[Rank, ...]:
    """The rank files grouped by (pp_rank, tp_rank), each rank's parts in order."""
    ranks: dict[tuple[int, int], list[WrittenFile]] = {}
    for file in files:
        ranks.setdefault((file.pp_rank, file.tp_rank), []).append(file)
    return tuple(
        Rank(
            pp_rank,
            tp_rank,
            tuple(
                RankFile(
                    file.path,
                    file.part,
                    file.size,
                    file.sha256,
                    tuple(TensorEntry(name, dtype, tuple(shape)) for name, dtype, shape in file.tensors),
                )
                for file in sorted(rank_files, key=lambda item: item.part)
            ),
        )
        for (pp_rank, tp_rank), rank_files in sorted(ranks.items())
    )


def started_manifest(
    *,
    source: str,
    engine: Engine,
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
    pattern: str,
    planned: Sequence[str],
    older_files: Sequence[str],
) -> ShardManifest:
    """The manifest of a shard run in progress (see write_incomplete_manifest)."""
    return ShardManifest(
        complete=False,
        source=source,
        engine=engine,
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
        pattern=pattern,
        planned=tuple(sorted(planned)),
        older_files=tuple(sorted(older_files)),
    ).stamped()


def write_incomplete_manifest(dest: Location, manifest: ShardManifest) -> None:
    """Mark DEST as a shard run in progress (`manifest`: started_manifest's), before its first byte: the
    manifest's own name with `"complete": false`, replaced (atomically: one put) by the completed manifest at
    the very end.

    Why one name and not a separate marker: a reader finds the state in one place, and there is never a
    moment with both a marker and a manifest (or neither) to reconcile. `verify-index` reports such a DEST
    (`shard-incomplete`) and `serve` refuses it, whatever else a killed or out-of-space run left there. It
    also names what the run writes and what it will remove, so a later `--force` still knows them.
    """
    put_manifest(dest, manifest)
