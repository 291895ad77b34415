"""`--engine vllm-gpu` (formerly `vllm`): vLLM's own `save_sharded_state` (save.py, in a subprocess on GPUs)
writes into a temporary folder; its files are then streamed to DEST, checked and recorded by `run_shard` as
every engine's are."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from streamctl.checkpoint.files import CONFIG_NAME, listing_notes, log_notes
from streamctl.checkpoint.safetensors import ParsedHeader, parse_header, read_header
from streamctl.checkpoint.sharded_names import format_name, parse_sharded_name
from streamctl.checkpoint.vllm_layouts import installed_vllm_version, layout_row
from streamctl.dest.overlap import check_disjoint
from streamctl.errors import MissingProgramError, UsageError
from streamctl.interrupts import shielded_calls
from streamctl.progress import Progress
from streamctl.retry import with_retries
from streamctl.shard.checks import check_verify, check_written
from streamctl.shard.dest import RunKind, check_dest, check_shard_names
from streamctl.shard.engine import Checks, EngineRun, Written
from streamctl.shard.plan import Engine, ModelDims, ShardOptions, ShardPlan
from streamctl.shard.planning import list_source, plan_shard, read_json_object, serving_files_to_copy
from streamctl.shard.writer import PartStream, WrittenFile, abort_all, commit_all, start_stream
from streamctl.storage.base import ListingNote, Location, ObjectInfo

# The script the engine subprocess runs (by path: vLLM's Python need not have streamctl installed).
VLLM_SAVE_SCRIPT = Path(__file__).with_name("save.py")


def _find_gpus() -> bool:
    """Whether this machine has NVIDIA GPUs, without importing torch."""
    return shutil.which("nvidia-smi") is not None or os.path.exists("/dev/nvidia0")


def check_vllm_engine_available() -> None:
    """The error naming what is missing for --engine vllm-gpu: the vllm package (exit 127, as for every missing
    program or extra), or CUDA GPUs (exit 2: nothing to install fixes that here)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise MissingProgramError(
            "--engine vllm-gpu needs the vllm package in this Python environment, and it is not installed",
            hint="pip install 'streamctl[vllm]' on a machine with GPUs, or use --engine vllm-cpu",
        )
    if not _find_gpus():
        raise UsageError(
            "--engine vllm-gpu needs CUDA GPUs (one per TP x PP rank), and this machine has none",
            hint="run it on a GPU machine, or use --engine vllm-cpu (vLLM's own model code on this CPU)",
        )


@dataclass(frozen=True)
class _SourcePlan:
    """What the engine read of SOURCE before the lease."""

    version: str | None
    pattern: str
    serving: tuple[tuple[str, int], ...]
    config: dict[str, Any]


class VllmGpuEngine:
    """vLLM's own save path: under the lease, an engine at the requested TP/PP saves into a temporary folder
    (a subprocess, so the GPUs and torch are released afterwards), before DEST is written (a failed save
    leaves it as it was); `write` streams its files to DEST. `runner` runs the save's command (tests)."""

    name: Engine = "vllm-gpu"
    plans_rank_files = False  # vLLM names its parts as it saves

    def __init__(self, runner: Callable[[list[str]], subprocess.CompletedProcess[str]] | None = None) -> None:
        self.runner = runner or _run
        self._saved: tempfile.TemporaryDirectory[str] | None = None
        self._source_plan: _SourcePlan | None = None

    @contextmanager
    def session(self) -> Iterator[None]:
        try:
            yield
        finally:
            if self._saved is not None:
                self._saved.cleanup()

    def plan(self, run: EngineRun) -> tuple[ListingNote, ...]:
        source, dest, options, progress = run.source, run.dest, run.options, run.progress
        if source.local_path() is None:
            raise UsageError(
                "--engine vllm-gpu needs SOURCE as a local folder", hint="copy it first with `streamctl transfer`"
            )
        check_disjoint(source, dest)
        check_vllm_engine_available()
        version = options.vllm_version or installed_vllm_version()
        pattern = options.file_pattern()
        listing = list_source(source)
        notes = listing_notes(source)
        log_notes(notes, progress)
        sizes = listing.sizes
        config = read_json_object(source, CONFIG_NAME, sizes[CONFIG_NAME]) if CONFIG_NAME in sizes else {}
        serving = serving_files_to_copy(source, listing, config)
        # vLLM names its parts as it saves; each rank's first part stands for them (a longer part number is rare).
        ranks = [
            format_name(pattern, tp_rank=tp_rank, part=0, pp_rank=pp_rank)
            for pp_rank in range(options.pipeline_parallel_size)
            for tp_rank in range(options.tensor_parallel_size)
        ]
        check_shard_names(dest, [*ranks, *(path for path, _ in serving)])
        self._source_plan = _SourcePlan(version, pattern, serving, config)
        return notes

    def plan_dest(self, run: EngineRun) -> ShardPlan:
        """Under the lease (nobody writes meanwhile), and before vLLM runs: a refusal costs nothing. Then
        vLLM's save into the temporary folder, and the plan describing its files."""
        options, planned = run.options, self._planned()
        tp, pp = options.tensor_parallel_size, options.pipeline_parallel_size
        kind = RunKind(run.source_label, "vllm-gpu", tp, pp, planned.pattern)
        serving_names = {path for path, _ in planned.serving}
        cleanup = check_dest(run.dest, planned.pattern, serving_names, options.force, kind=kind)
        self._saved = tempfile.TemporaryDirectory(prefix="streamctl-vllm-save-")
        self._save(run, planned, self._saved.name)
        architecture = str((planned.config.get("architectures") or ["?"])[0])
        plan = _plan_for_saved(run, planned, architecture)
        return replace(plan, stale=cleanup.to_remove, left_alone=cleanup.left_alone)

    def write(self, run: EngineRun, plan: ShardPlan) -> Written:
        from streamctl.storage import open_location

        assert self._saved is not None
        try:
            saved = open_location(self._saved.name)
            files = _copy_saved_files(saved, run.dest, plan.pattern, run.options, run.progress)
        finally:
            self._saved.cleanup()  # vLLM's copy is not needed by the checks (they read DEST)
        return Written(files, sum(file.size for file in files))

    def checks(self, run: EngineRun, plan: ShardPlan, written: Written) -> Checks:
        verify, reconstruction = check_written(
            run.source, run.dest, plan, run.options, run.progress, dtype_from_files=True
        )
        return Checks(verify, reconstruction)

    def whole_checks(self, run: EngineRun, plan: ShardPlan) -> Checks:
        """Never reached: run_shard refuses --worker for this engine (its files are named as vLLM saves them)."""
        return Checks(check_verify(run.dest, plan, run.progress))

    def _planned(self) -> _SourcePlan:
        if self._source_plan is None:
            raise RuntimeError("VllmGpuEngine.plan_dest before plan")
        return self._source_plan

    def _save(self, run: EngineRun, planned: _SourcePlan, folder: str) -> None:
        options = run.options
        arguments = {
            "model": run.source.url,
            "output": folder,
            "tensor_parallel_size": options.tensor_parallel_size,
            "pipeline_parallel_size": options.pipeline_parallel_size,
            "dtype": options.dtype,
            "pattern": planned.pattern,
            "max_size": options.max_part_size,
            "enable_expert_parallel": options.enable_expert_parallel,
        }
        # -P: the script's folder (this package) is not put on the path of vLLM's Python.
        command = [sys.executable, "-P", str(VLLM_SAVE_SCRIPT), json.dumps(arguments)]
        run.progress.log("running vLLM's save_sharded_state (this starts a full engine)")
        completed = self.runner(command)
        if completed.returncode != 0:
            tail = (completed.stderr or "").strip().splitlines()[-5:]
            raise UsageError(f"vLLM's save failed (exit {completed.returncode}): {' | '.join(tail)}")


def _run(command: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL, check=False)


def _copy_saved_files(
    saved: Location, dest: Location, pattern: str, options: ShardOptions, progress: Progress
) -> tuple[WrittenFile, ...]:
    """Stream vLLM's files to DEST (sha256 in flight), completing them all at the end.

    vLLM 0.33 writes an empty part file when a rank's first tensor exceeds max_size, and the Run:ai
    streamer fails on such a file: empty parts are left out and the rank's parts renumbered from 0.
    """
    ranks: dict[tuple[int, int], list[tuple[int, ObjectInfo, ParsedHeader]]] = {}
    for info in saved.list():
        parsed = parse_sharded_name(pattern, saved.relative(info.key))
        if parsed is None:
            continue
        read = read_header(saved.store, info.key, info.size)
        header = parse_header(read.header_json or b"{}", info.size)
        if header.tensors:
            ranks.setdefault((parsed.pp_rank, parsed.tp_rank), []).append((parsed.part, info, header))
    streams: list[PartStream] = []
    written: list[WrittenFile] = []
    try:
        with shielded_calls() as shielded:  # see writer.write_sharded
            for (pp_rank, tp_rank), parts in sorted(ranks.items()):
                for part, (_, info, header) in enumerate(sorted(parts, key=lambda item: item[0])):
                    name = format_name(pattern, tp_rank=tp_rank, pp_rank=pp_rank, part=part)
                    stream = shielded(
                        partial(start_stream, streams, dest, name, info.size, options.upload_chunk, options.retry)
                    )
                    for start in range(0, info.size, options.read_block):
                        length = min(options.read_block, info.size - start)
                        data = with_retries(partial(saved.store.read_range, info.key, start, length), options.retry)
                        stream.write(data)
                    tensors = tuple((tensor.name, tensor.dtype, tensor.shape) for tensor in header.tensors)
                    written.append(WrittenFile(name, pp_rank, tp_rank, part, info.size, stream.finish(), tensors))
        commit_all(streams, dest, options.retry, progress)
    except BaseException:
        abort_all(streams, progress)
        raise
    return tuple(written)


def _plan_for_saved(run: EngineRun, planned: _SourcePlan, architecture: str) -> ShardPlan:
    """A plan describing vLLM's files (what DEST holds not yet decided); it carries the table's layout (for
    the reconstruction check) when the architecture is in the table, and no stages otherwise."""
    options = run.options
    try:
        plan = plan_shard(run.source, run.dest, replace(options, engine="offline", force=True), run.source_id)
        return replace(plan, pattern=planned.pattern)
    except UsageError:
        pass
    return ShardPlan.for_run(
        source=run.source_label,
        dest=run.dest.url,
        options=options,
        pattern=planned.pattern,
        version=planned.version,
        row=layout_row(planned.version),
        dims=ModelDims(architecture, 0, 0, 0, 0, 0, 0, 0, False),
        stages=(),
        serving_files=planned.serving,
        stale=(),
        tied_lm_head=None,
    )
