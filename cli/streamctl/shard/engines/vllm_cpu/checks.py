"""`--engine vllm-cpu`'s checks after writing, beside verify-index --sharded: every written tensor's sha256
from DEST compared with the one the worker computed on vLLM's rank model, and, for a local DEST, vLLM's own
ShardedStateLoader run by the worker on the written files, every rank a tensor at a time (`LoaderCheckReport`,
from the worker's "checked" frame). On a local DEST the loader check hashes every parameter it loads against
the sent sha256, so it is the tensor check too (`digests_from_loader`): one read of DEST, not two. Elsewhere
(a bucket, a `--worker` share) every tensor is re-read from DEST (`check_tensor_digests`)."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from streamctl.dest.uploads import Cancelled
from streamctl.progress import NULL_PROGRESS, Progress
from streamctl.retry import RetryPolicy, with_retries
from streamctl.shard.checks import RECONSTRUCTION_THREADS, WrittenTensor, own_names, read_written_headers
from streamctl.shard.plan import READ_BLOCK, ShardPlan
from streamctl.storage.base import Location

# (pp_rank, tp_rank, tensor name) -> the sha256 of its bytes as the worker sent them
TensorDigests = Mapping[tuple[int, int, str], str]
MAX_PROBLEMS_SHOWN = 50


@dataclass(frozen=True)
class TensorDigestReport:
    ok: bool
    tensors: int  # rank tensors re-read from DEST and hashed
    bytes_compared: int
    problems: tuple[str, ...]
    reused_files: int = 0  # rank files a re-run kept: checked by their whole-file sha256 instead
    read_by: str = "re-read"  # how the bytes came back from DEST: "re-read", or "vllm-loader" (digests_from_loader)

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "tensors": self.tensors,
            "bytes_compared": self.bytes_compared,
            "read_by": self.read_by,
            "reused_files": self.reused_files,
            "problems": list(self.problems),
        }


@dataclass(frozen=True)
class LoaderCheckReport:
    """vLLM's ShardedStateLoader on the written rank files (the worker's "checked" frame): every rank this run
    wrote to, whatever its size (the worker loads it a tensor at a time)."""

    ok: bool
    loader: str
    # {"pp_rank", "tp_rank", "ok", "tensors", "tensors_matched", "bytes_matched", "problems", "rss_peak_mib"}
    ranks: tuple[Mapping[str, Any], ...]
    peak_rss_mib: float | None = None
    missing: tuple[tuple[int, int], ...] = ()  # (pp_rank, tp_rank) written by this run that the worker did not check

    @property
    def checked(self) -> int:
        return len(self.ranks)

    @property
    def problems(self) -> tuple[str, ...]:
        unchecked = tuple(f"PP stage {pp}, TP rank {tp}: written but not loaded by vLLM" for pp, tp in self.missing)
        return unchecked + tuple(
            f"PP stage {rank.get('pp_rank')}, TP rank {rank.get('tp_rank')}: {problem}"
            for rank in self.ranks
            for problem in (rank.get("problems") or (["failed"] if not rank.get("ok") else []))
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "loader": self.loader,
            "ranks_checked": self.checked,
            "ranks": [dict(rank) for rank in self.ranks],
            "missing_ranks": [list(rank) for rank in self.missing],
            "peak_rss_mib": self.peak_rss_mib,
        }

    @classmethod
    def from_frame(cls, frame: Mapping[str, Any], written: Iterable[tuple[int, int]]) -> LoaderCheckReport:
        """The report of a "checked" frame; every rank in `written` (this run wrote some of its files; the
        worker checks exactly those) must be in it, and loaded without a problem."""
        ranks = tuple(rank for rank in frame.get("ranks") or [] if isinstance(rank, dict))
        seen = {(rank.get("pp_rank"), rank.get("tp_rank")) for rank in ranks}
        missing = tuple(sorted(rank for rank in set(written) if rank not in seen))
        ok = not missing and all(bool(rank.get("ok")) and not rank.get("problems") for rank in ranks)
        peak = frame.get("peak_rss_mib")
        return cls(
            ok, str(frame.get("loader", "")), ranks, float(peak) if isinstance(peak, (int, float)) else None, missing
        )


@dataclass(frozen=True)
class _DigestCheck:
    dest: Location
    policy: RetryPolicy
    chunk: int
    cancelled: threading.Event = field(default_factory=threading.Event)

    def check(self, label: str, where: WrittenTensor | None, expected: str) -> tuple[str | None, int]:
        if where is None:
            return f"{label}: missing from the written files", 0
        digest = hashlib.sha256()
        key = self.dest.key(where.file)
        for start in range(0, where.nbytes, self.chunk):
            if self.cancelled.is_set():
                raise Cancelled()
            length = min(self.chunk, where.nbytes - start)
            digest.update(
                with_retries(partial(self.dest.store.read_range, key, where.offset + start, length), self.policy)
            )
        if digest.hexdigest() != expected:
            return f"{label}: the bytes in {where.file} differ from vLLM's rank model (sha256)", where.nbytes
        return None, where.nbytes


def check_tensor_digests(
    dest: Location,
    plan: ShardPlan,
    digests: TensorDigests,
    policy: RetryPolicy,
    progress: Progress = NULL_PROGRESS,
    *,
    reused_files: int = 0,
    chunk: int = READ_BLOCK,
) -> TensorDigestReport:
    """Re-read every tensor the worker sent from DEST's files (located by their own headers) and compare
    its sha256 with the worker's; tensors side by side on a few threads."""
    problems: list[str] = []
    written = read_written_headers(dest, plan.pattern, problems, own_names(plan))
    checker = _DigestCheck(dest, policy, chunk)
    work: Sequence[tuple[str, WrittenTensor | None, str]] = [
        (f"{name} (PP stage {pp_rank}, TP rank {tp_rank})", written.get((pp_rank, tp_rank), {}).get(name), sha256)
        for (pp_rank, tp_rank, name), sha256 in sorted(digests.items())
    ]
    task = progress.task("Checking tensors against vLLM's rank models", len(work))
    compared = 0
    with ThreadPoolExecutor(RECONSTRUCTION_THREADS, thread_name_prefix="shard-digest") as pool:
        try:
            for problem, nbytes in pool.map(lambda item: checker.check(*item), work):
                progress.advance(task, 1)
                compared += nbytes
                if problem is not None:
                    problems.append(problem)
        except BaseException:
            checker.cancelled.set()
            raise
        finally:
            progress.done(task)
    shown = tuple(problems[:MAX_PROBLEMS_SHOWN])
    if len(problems) > MAX_PROBLEMS_SHOWN:
        shown += (f"... and {len(problems) - MAX_PROBLEMS_SHOWN} more",)
    return TensorDigestReport(not problems, len(work), compared, shown, reused_files)


def digests_from_loader(
    loader: LoaderCheckReport, digests: TensorDigests, *, reused_files: int = 0
) -> TensorDigestReport:
    """The tensor check of a local DEST, from vLLM's loader check: it loaded every rank from DEST and compared
    each sent tensor's loaded bytes with the sha256 the worker sent (worker_check.RankTally). Every rank this
    run sent tensors of must have all of them matched."""
    sent: dict[tuple[int, int], int] = {}
    for pp_rank, tp_rank, _ in digests:
        sent[(pp_rank, tp_rank)] = sent.get((pp_rank, tp_rank), 0) + 1
    by_rank = {(rank.get("pp_rank"), rank.get("tp_rank")): rank for rank in loader.ranks}
    problems, matched, compared = [], 0, 0
    for (pp_rank, tp_rank), count in sorted(sent.items()):
        rank = by_rank.get((pp_rank, tp_rank), {})
        rank_matched = int(rank.get("tensors_matched") or 0)
        matched, compared = matched + rank_matched, compared + int(rank.get("bytes_matched") or 0)
        if rank_matched != count:
            problems.append(
                f"PP stage {pp_rank}, TP rank {tp_rank}: {count - rank_matched} of the {count} tensors sent differ "
                "from vLLM's rank model when vLLM's loader reads them back from DEST (sha256), or were not loaded"
            )
    return TensorDigestReport(not problems, matched, compared, tuple(problems), reused_files, "vllm-loader")
