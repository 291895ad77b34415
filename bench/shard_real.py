"""bench/shard.py's real-shape cases: one real model (bench/shard_shapes.py) at two depths, `cp` + sync and
`streamctl shard` of each in the same rounds, and what is left once the depths are subtracted.

Both checkpoints are generated once (the deep one written, the shallow one hard-linked from its files), so
each round times, in an order that alternates between rounds: cp of the shallow, cp of the deep, shard of
the shallow, shard of the deep. From each round:
- marginal ratio = (cp deep - cp shallow) / (shard deep - shard shallow): cp's extra seconds for the extra
  layers over streamctl's for the same extra bytes (1.0 = the extra bytes cost streamctl what they cost cp);
- fixed start = shard shallow - its bytes x streamctl's extra seconds per extra byte: the seconds a run
  costs whatever its size (the line through both depths, at zero bytes);
- whole-run ratio at each depth, as the other cases: throughput against that round's cp;
- CPU seconds (user + system, the vLLM worker included) and its marginal per GB;
- the floor, informational: cp + sync, then every copied byte read back and sha256-hashed on every core (the
  least a run pays that keeps the README's checks after writing: they read back what was written once it is
  complete), timed in the same rounds, and streamctl's marginal against the floor's.
The medians over rounds are reported and judged.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchlib import GiB, MiB, Table, Targets, human_bytes
from shard_shapes import RealShape, Shapes
from streamctl.checkpoint.safetensors import encode_safetensors_header

GB = 1_000_000_000
BLOCK = 64 * MiB


@dataclass(frozen=True)
class Depth:
    layers: int
    folder: Path
    nbytes: int  # tensor bytes
    largest_layer: int


def _write_file(path: Path, shapes: Shapes, payload: memoryview) -> tuple[dict[str, Any], int]:
    """One safetensors file of bf16 tensors (bytes repeated from `payload`): its weight map entries, bytes."""
    sizes = {name: int(np.prod(shape)) * 2 for name, shape in shapes.items()}
    header, _ = encode_safetensors_header([(name, "BF16", shape, sizes[name]) for name, shape in shapes.items()])
    with open(path, "wb") as handle:
        handle.write(header)
        for name in shapes:
            left = sizes[name]
            while left:
                handle.write(payload[: min(left, BLOCK)])
                left -= min(left, BLOCK)
    return dict.fromkeys(shapes, path.name), sum(sizes.values())


def generate(shape: RealShape, layers: tuple[int, int], root: Path) -> tuple[Depth, Depth]:
    """The deep checkpoint written, the shallow one hard-linked from the same files (its own index, config)."""
    block = np.random.default_rng(0).integers(0, 2**16, BLOCK // 2, dtype=np.uint16)
    block[(block & 0x7F80) == 0x7F80] &= 0xBFFF  # no NaN or infinity: the bytes stand for real weights
    payload = memoryview(block).cast("B")
    shallow, deep = sorted(layers)
    files = shape.files(deep)
    written: dict[str, tuple[dict[str, Any], int]] = {}
    depths = []
    for count in (deep, shallow):
        folder = root / f"hf-{count}"
        folder.mkdir(parents=True)
        chosen = [files[0], *files[1 : count + 1], files[-1]]
        for name, shapes in chosen:
            if name in written:
                os.link(root / f"hf-{deep}" / name, folder / name)
            else:
                written[name] = _write_file(folder / name, shapes, payload)
        weight_map = {key: file for name, _ in chosen for key, file in written[name][0].items()}
        total = sum(written[name][1] for name, _ in chosen)
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
        )
        (folder / "config.json").write_text(json.dumps(shape.config_at(count), indent=2))
        (folder / "tokenizer.json").write_text(json.dumps({"version": "1.0"}))
        largest = max((written[name][1] for name, _ in chosen[1:-1]), default=0)
        depths.append(Depth(count, folder, total, largest))
    subprocess.run(["sync"], check=True)
    return depths[1], depths[0]


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


@dataclass(frozen=True)
class RealCase:
    key: str
    shape: RealShape
    layers: tuple[int, int]
    engine: list[str]  # extra shard options
    marginal_target: float  # x cp's marginal
    fixed_target_s: float


# time_cp(source, dest, drop, read_back=False) -> (seconds, CPU s); time_shard(scratch, tp, drop, engine, source) -> a run or None
CpTimer = Callable[..., tuple[float, float]]
ShardTimer = Callable[[Path, int, bool, list[str], Path], Any]


@dataclass
class Rounds:
    cp: dict[int, list[float]]
    cp_cpu: dict[int, list[float]]
    shard: dict[int, list[Any]]  # layers -> ShardRun per round
    floor: dict[int, list[float]]  # layers -> seconds of cp + sync + a sha256 read-back per round


def measure(
    case: RealCase, depths: tuple[Depth, Depth], scratch: Path, tp: int, args: Any, timers: tuple[CpTimer, ShardTimer]
) -> Rounds | None:
    time_cp, time_shard = timers
    rounds = Rounds({}, {}, {}, {})
    drop = not args.keep_page_cache
    for number in range(args.repeat):
        order = depths if number % 2 == 0 else depths[::-1]
        for depth in order:
            seconds, cpu = time_cp(depth.folder, scratch / "cp", drop)
            rounds.cp.setdefault(depth.layers, []).append(seconds)
            rounds.cp_cpu.setdefault(depth.layers, []).append(cpu)
            rounds.floor.setdefault(depth.layers, []).append(time_cp(depth.folder, scratch / "cp", drop, True)[0])
        for depth in order:
            run = time_shard(scratch, tp, drop, case.engine, depth.folder)
            if run is None:
                return None
            rounds.shard.setdefault(depth.layers, []).append(run)
        print(
            f"[{case.key}] round {number + 1}: "
            + ", ".join(
                f"{d.layers} layers: cp {rounds.cp[d.layers][-1]:.2f} s, shard {rounds.shard[d.layers][-1].seconds:.2f} s "
                f"({rounds.shard[d.layers][-1].cpu_s:.1f} CPU s)"
                for d in depths
            )
            + f"; load average {os.getloadavg()[0]:.1f}",
            flush=True,
        )
    return rounds


def extra_ratio(baseline_extra: float, shard_extra: float) -> float:
    """The baseline's extra seconds for the extra layers over streamctl's (inf: streamctl's did not grow)."""
    return baseline_extra / shard_extra if shard_extra > 0 else float("inf")


def report(case: RealCase, depths: tuple[Depth, Depth], tp: int, rounds: Rounds, targets: Targets) -> list[str]:
    """The table per depth, the marginal and fixed figures per round, and the verdicts."""
    shallow, deep = depths
    extra = deep.nbytes - shallow.nbytes
    headers = ["run (median)", "bytes", "cp s", "floor s", "shard s", "x cp", "x floor", "write s", "CPU s", "cp CPU s"]
    table = Table([*headers, "peak RSS"])
    for depth in depths:
        runs, cps = rounds.shard[depth.layers], rounds.cp[depth.layers]
        ratios = [run.bytes_written / run.seconds / (depth.nbytes / cp) for run, cp in zip(runs, cps, strict=True)]
        floors = rounds.floor[depth.layers]
        to_floor = [floor / run.seconds for run, floor in zip(runs, floors, strict=True)]
        table.add(
            f"{depth.layers} layers, TP {tp}", human_bytes(depth.nbytes), f"{median(cps):.2f}",
            f"{median(floors):.2f}", f"{median([run.seconds for run in runs]):.2f}", f"{median(ratios):.2f}",
            f"{median(to_floor):.2f}",
            f"{median([run.write_seconds for run in runs]):.2f}", f"{median([run.cpu_s for run in runs]):.1f}",
            f"{median(rounds.cp_cpu[depth.layers]):.1f}", human_bytes(max(run.peak_rss for run in runs)),
        )  # fmt: skip
    table.print()
    marginal, fixed, cpu_per_gb, starts, floor_marginal = [], [], [], [], []
    for index in range(len(rounds.cp[deep.layers])):
        low, high = rounds.shard[shallow.layers][index], rounds.shard[deep.layers][index]
        cp_extra = rounds.cp[deep.layers][index] - rounds.cp[shallow.layers][index]
        shard_extra = high.seconds - low.seconds
        floor_extra = rounds.floor[deep.layers][index] - rounds.floor[shallow.layers][index]
        marginal.append(extra_ratio(cp_extra, shard_extra))
        floor_marginal.append(extra_ratio(floor_extra, shard_extra))
        fixed.append(low.seconds - shallow.nbytes * shard_extra / extra)
        cpu_per_gb.append((high.cpu_s - low.cpu_s) / (extra / GB))
        if low.worker_write_seconds is not None:
            starts.append(low.write_seconds - low.worker_write_seconds)
    pairs = zip(rounds.shard[deep.layers], rounds.shard[shallow.layers], strict=True)
    layer_s = median([high.seconds - low.seconds for high, low in pairs])
    cp_layer_s = median([a - b for a, b in zip(rounds.cp[deep.layers], rounds.cp[shallow.layers], strict=True)])
    per_layer = deep.layers - shallow.layers
    print(
        f"[{case.key}] {deep.layers - shallow.layers} more layers ({human_bytes(extra)}): shard +{layer_s:.2f} s "
        f"({layer_s / per_layer:.2f} s per {human_bytes(deep.largest_layer)} layer), cp +{cp_layer_s:.2f} s "
        f"({cp_layer_s / per_layer:.2f} s); streamctl's marginal CPU {median(cpu_per_gb):.1f} s/GB"
        + (f"; worker start + plan of the shallow run {median(starts):.1f} s" if starts else "")
    )
    floor_layer_s = median(
        [a - b for a, b in zip(rounds.floor[deep.layers], rounds.floor[shallow.layers], strict=True)]
    )
    print(
        f"[{case.key}] the floor (cp + sync + a sha256 read-back on every core) +{floor_layer_s:.2f} s for those "
        f"layers: streamctl's marginal is {median(floor_marginal):.2f} x the floor's "
        f"({', '.join(f'{m:.2f}' for m in floor_marginal)}), {median(marginal):.2f} x cp's"
    )
    name = f"{case.key} ({case.shape.name}, {case.shape.kind}, {shallow.layers} and {deep.layers} layers, TP {tp})"
    return [
        targets.check(
            median(marginal) >= case.marginal_target,
            f"{name} marginal",
            f"{median(marginal):.2f} x cp's extra seconds per extra byte, the median of per-round ratios "
            f"({', '.join(f'{m:.2f}' for m in marginal)}; target >= {case.marginal_target})",
        ),
        targets.check(
            median(fixed) <= case.fixed_target_s,
            f"{name} fixed start",
            f"{median(fixed):.1f} s at zero bytes on the line through both depths "
            f"({', '.join(f'{f:.1f}' for f in fixed)}; target <= {case.fixed_target_s:g} s)",
        ),
    ]


def run_real_case(
    case: RealCase, scratch: Path, tp: int, args: Any, targets: Targets, timers: tuple[CpTimer, ShardTimer]
) -> list[str] | None:
    """Generate both depths, measure them in rounds, print the figures; the verdicts (None: a run failed)."""
    shallow_layers, deep_layers = sorted(case.layers)
    need = 2 * sum(int(np.prod(shape)) * 2 for _, shapes in case.shape.files(deep_layers) for shape in shapes.values())
    free = shutil.disk_usage(scratch).free
    if free < need + GiB:
        print(f"[{case.key}] needs {human_bytes(need)} of scratch (source and one output), {human_bytes(free)} free")
        return None
    print(f"[{case.key}] generating {case.shape.name} at {deep_layers} and {shallow_layers} layers in {scratch} ...")
    depths = generate(case.shape, (shallow_layers, deep_layers), scratch)
    print(
        f"[{case.key}] {', '.join(f'{d.layers} layers {human_bytes(d.nbytes)}' for d in depths)}; a decoder layer "
        f"{human_bytes(depths[1].largest_layer)}; load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    rounds = measure(case, depths, scratch, tp, args, timers)
    for depth in depths:
        shutil.rmtree(depth.folder)
    if rounds is None:
        return None
    return report(case, depths, tp, rounds, targets)
