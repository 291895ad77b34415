"""`serve --tune`: stream part of the checkpoint through runai-model-streamer at several concurrency values.

The streamer reads its settings from the environment once, when it starts, so every value is measured
in a fresh subprocess (`python -m streamctl.serve.streamer_probe`). Works on a CPU: tensors land in
host memory, which is what the streamer's read path costs before any GPU copy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from streamctl.checkpoint.files import choose_weights
from streamctl.common.sizes import GiB
from streamctl.errors import MissingProgramError, RemoteError, UsageError
from streamctl.progress import NULL_PROGRESS, Progress
from streamctl.storage import streamer_url
from streamctl.storage.base import Location, ObjectInfo

DEFAULT_CANDIDATES = (4, 8, 16, 32)
DEFAULT_BUDGET_BYTES = 2 * GiB
STREAMER_MISSING_EXIT = 127
_STREAMER_HINT = "pip install 'streamctl[streamer]' (on CPU-only machines install torch==2.13.0 first)"


@dataclass(frozen=True)
class TuneSample:
    concurrency: int
    bytes: int
    seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.bytes / 1e9 / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class TuneResult:
    files: tuple[str, ...]
    samples: tuple[TuneSample, ...]

    @property
    def best(self) -> TuneSample:
        return max(self.samples, key=lambda sample: sample.gb_per_s)

    def to_json(self) -> dict[str, object]:
        return {
            "files": list(self.files),
            "samples": [
                {
                    "concurrency": s.concurrency,
                    "bytes": s.bytes,
                    "seconds": round(s.seconds, 4),
                    "gb_per_s": round(s.gb_per_s, 3),
                }
                for s in self.samples
            ],
            "best_concurrency": self.best.concurrency,
        }


def sample_files(shards: Sequence[ObjectInfo], budget_bytes: int) -> list[ObjectInfo]:
    """The first shards (in name order) adding up to about `budget_bytes`; at least one."""
    chosen: list[ObjectInfo] = []
    total = 0
    for info in sorted(shards, key=lambda item: item.key):
        if chosen and total + info.size > budget_bytes:
            break
        chosen.append(info)
        total += info.size
    return chosen


def _probe(paths: Sequence[str], concurrency: int, env: Mapping[str, str], python: str) -> TuneSample:
    with tempfile.NamedTemporaryFile(prefix="streamctl-streamer-", suffix=".log") as log:
        completed = subprocess.run(
            # -P: the current folder is not put first on sys.path, so a stray module there (a checkout's own
            # runai_model_streamer.py, a json.py) cannot stand in for what the probe imports.
            [python, "-P", "-m", "streamctl.serve.streamer_probe"],
            input=json.dumps({"paths": list(paths)}),
            capture_output=True,
            text=True,
            env={
                **os.environ,
                **env,
                "RUNAI_STREAMER_CONCURRENCY": str(concurrency),
                "RUNAI_STREAMER_LOG_FILE": log.name,
            },
        )
        if completed.returncode == STREAMER_MISSING_EXIT:
            raise MissingProgramError("--tune needs runai-model-streamer, which is not installed", hint=_STREAMER_HINT)
        if completed.returncode != 0:
            tail = (Path(log.name).read_text(errors="replace").strip().splitlines() or [""])[-1]
            last = (completed.stderr.strip().splitlines() or ["no output"])[-1]
            raise RemoteError(
                f"the streamer failed at concurrency {concurrency}: {last}",
                hint=f"streamer log: {tail}" if tail else "check credentials and the endpoint with --dry-run",
            )
    result = json.loads(completed.stdout)
    return TuneSample(concurrency, int(result["bytes"]), float(result["seconds"]))


def top_level_shards(location: Location) -> list[ObjectInfo]:
    """The weights directly under `location` (choose_weights: the HF shards, else consolidated*); UsageError
    if none."""
    infos = {location.relative(info.key): info for info in location.list()}
    shards = [infos[name] for name in choose_weights(infos).weights]
    if not shards:
        raise UsageError(f"--tune found no .safetensors under {location.url}")
    return shards


def tune_concurrency(
    location: Location,
    shards: Sequence[ObjectInfo],
    env: Mapping[str, str],
    *,
    candidates: Sequence[int] = DEFAULT_CANDIDATES,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
    python: str = sys.executable,
    progress: Progress = NULL_PROGRESS,
) -> TuneResult:
    chosen = sample_files(shards, budget_bytes)
    paths = [streamer_url(location, info.key) for info in chosen]
    task = progress.task("tuning concurrency", len(candidates) + 1)
    # One untimed pass first, so every measured pass sees the same page cache (local) or warm connections.
    _probe(paths, candidates[0], env, python)
    progress.advance(task, 1)
    samples = []
    for concurrency in candidates:
        samples.append(_probe(paths, concurrency, env, python))
        progress.advance(task, 1)
    progress.done(task)
    return TuneResult(tuple(paths), tuple(samples))
