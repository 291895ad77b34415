"""Benchmark: `streamctl transfer SRC_FOLDER DEST_FOLDER` between local folders (a mounted bucket, a PVC, NFS)
against `cp -r` of the same files, and against the floor of any copier that hashes what it copies.

    python bench/transfer.py --dest local [--size-gib 3] [--shard-gb 2] [--rounds 3] [--dir PARENT] [--quick]

Method
------
- Source: a checkpoint generated into a scratch folder under PARENT (default the system temp folder) with
  Llama-3.1-8B's tensor names and shapes (bf16, random values): the embeddings, then as many decoder layers
  as `--size-gib` (3 GiB; --quick 0.5, which is the embeddings and one layer: 1.5 GB) holds, cut into files of at most `--shard-gb` GB (2) the way
  `save_pretrained` cuts them, with config.json and the index. It is read once before the runs, so every
  method reads it from the page cache (nothing here may drop the cache of a machine others share).
- Methods, each a subprocess measured by os.wait4 (wall, user and system CPU, peak RSS: at least this
  script's own ~20 MB, which ru_maxrss carries across exec), into a fresh DEST
  that is removed (and the disk synced, so one run's dirty pages never bill the next) after each:
  (a) `cp -r SRC DEST` (coreutils: copy_file_range, no hashing, no fsync);
  (a') `cp -r SRC DEST && sync DEST/*` (the same, then every file fsynced: cp made durable, as streamctl's
      files are before they are renamed into place and recorded in the manifest; the floor of any copier
      that keeps that promise);
  (b) `python -m streamctl transfer SRC DEST --json` with its defaults (each file copied inside the kernel,
      copy_file_range as cp does, while one thread reads the source beside it for the sha256 of every byte;
      temporary files renamed into place after fsync, the manifest, verify-index of DEST at the end);
  (c) the floor of a copier that hashes in its own pass: one Python thread reading each file in 8 MiB blocks
      into one buffer, hashing and writing each block, then fsync;
  (d) sha256 alone: the same reads and hashing, nothing written.
  (a), (a') and (b) run in `--rounds` rounds (3; --quick 1), the order rotating, and each round's ratio
  is cp's wall time over streamctl's (1.0 = as fast as cp); the median round is reported, and beside it
  the same against cp + fsync. (c) and (d) run
  once, after the first round.
- Checks: every DEST file streamctl wrote has the source's size, and the sha256 streamctl reports for it is
  the one the floor computed.

Targets (exit 1 on a miss): streamctl >= 0.6x cp (the median round's ratio). The ratio to the floor is
printed beside it, and the overlap bound: per round the slower of cp + fsync and sha256 alone, the least a
durable copier pays that copies in the kernel and hashes beside it on another core (cp's copy itself does not
hash).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import benchlib
from benchlib import GiB, MiB, Table, Targets, human_bytes

TARGET_RATIO = 0.6  # of cp's speed
GB = 1_000_000_000

# Llama-3.1-8B (config.json as published): the shapes each decoder layer's tensors have.
HIDDEN, INTERMEDIATE, KV_WIDTH, VOCAB = 4096, 14336, 1024, 128256
LAYER_TENSORS = (
    ("input_layernorm.weight", [HIDDEN]),
    ("mlp.down_proj.weight", [HIDDEN, INTERMEDIATE]),
    ("mlp.gate_proj.weight", [INTERMEDIATE, HIDDEN]),
    ("mlp.up_proj.weight", [INTERMEDIATE, HIDDEN]),
    ("post_attention_layernorm.weight", [HIDDEN]),
    ("self_attn.k_proj.weight", [KV_WIDTH, HIDDEN]),
    ("self_attn.o_proj.weight", [HIDDEN, HIDDEN]),
    ("self_attn.q_proj.weight", [HIDDEN, HIDDEN]),
    ("self_attn.v_proj.weight", [KV_WIDTH, HIDDEN]),
)

FLOOR_SCRIPT = """
import hashlib, json, os, sys
source, dest, hash_only = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
buffer = bytearray(8 << 20)
view = memoryview(buffer)
digests = {}
for name in sorted(os.listdir(source)):
    reader = os.open(os.path.join(source, name), os.O_RDONLY)
    writer = None if hash_only else os.open(os.path.join(dest, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    digest = hashlib.sha256()
    while count := os.readv(reader, [view]):
        digest.update(view[:count])
        if writer is not None:
            written = 0
            while written < count:
                written += os.write(writer, view[written:count])
    if writer is not None:
        os.fsync(writer)
        os.close(writer)
    os.close(reader)
    digests[name] = digest.hexdigest()
print(json.dumps(digests))
"""


# --------------------------------------------------------------------------------------------- the checkpoint


def _tensors(total_bytes: int) -> Iterator[tuple[str, list[int]]]:
    """Llama-3.1-8B's tensors in file order: the embeddings, then whole decoder layers while they fit."""
    yield "model.embed_tokens.weight", [VOCAB, HIDDEN]
    size = VOCAB * HIDDEN * 2
    layer_bytes = sum(2 * _count(shape) for _, shape in LAYER_TENSORS)
    layer = 0
    while size + layer_bytes <= total_bytes or layer == 0:
        for name, shape in LAYER_TENSORS:
            yield f"model.layers.{layer}.{name}", shape
        size += layer_bytes
        layer += 1


def _count(shape: Sequence[int]) -> int:
    count = 1
    for extent in shape:
        count *= extent
    return count


def _shard_layouts(total_bytes: int, shard_bytes: int) -> list[list[tuple[str, list[int]]]]:
    """The tensors cut into files of at most `shard_bytes`, in order, as save_pretrained cuts them."""
    shards: list[list[tuple[str, list[int]]]] = [[]]
    held = 0
    for name, shape in _tensors(total_bytes):
        size = 2 * _count(shape)
        if shards[-1] and held + size > shard_bytes:
            shards.append([])
            held = 0
        shards[-1].append((name, shape))
        held += size
    return shards


def write_checkpoint(folder: Path, total_bytes: int, shard_bytes: int) -> None:
    """The checkpoint's files written into `folder` (random bf16 values)."""
    import numpy as np

    from streamctl.checkpoint.safetensors import encode_safetensors_header

    folder.mkdir(parents=True)
    generator = np.random.default_rng(2024)
    layouts = _shard_layouts(total_bytes, shard_bytes)
    weight_map: dict[str, str] = {}
    data_bytes = 0
    for number, layout in enumerate(layouts, start=1):
        name = f"model-{number:05d}-of-{len(layouts):05d}.safetensors"
        entries = [(tensor, "BF16", shape, 2 * _count(shape)) for tensor, shape in layout]
        prefix, offsets = encode_safetensors_header(entries, {"format": "pt"})
        with open(folder / name, "wb") as handle:
            handle.write(prefix)
            left = offsets[-1][1]
            while left:
                block = generator.bytes(min(left, 64 * MiB))
                handle.write(block)
                left -= len(block)
        data_bytes += offsets[-1][1]
        weight_map.update({tensor: name for tensor, _ in layout})
    index = {"metadata": {"total_size": data_bytes}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    layers = 1 + max(int(tensor.split(".")[2]) for tensor in weight_map if tensor.startswith("model.layers."))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
              "intermediate_size": INTERMEDIATE, "num_hidden_layers": layers, "num_attention_heads": 32,
              "num_key_value_heads": 8, "vocab_size": VOCAB, "torch_dtype": "bfloat16"}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config, indent=2))


# --------------------------------------------------------------------------------------------- the runs


@dataclass(frozen=True)
class Run:
    name: str
    round: int
    seconds: float
    user_s: float
    sys_s: float
    peak_rss: int
    stdout: str


def measure(name: str, round_number: int, argv: Sequence[str], env: dict[str, str]) -> Run:
    """Run `argv` to the end, its own CPU and peak RSS from os.wait4; SystemExit naming it when it fails."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        started = time.monotonic()
        process = subprocess.Popen(argv, env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL, text=True)
        _, status, usage = os.wait4(process.pid, 0)
        seconds = time.monotonic() - started
        process.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if process.returncode != 0:
        raise SystemExit(f"{name} failed (exit {process.returncode}): {stderr.strip()[-2000:]}")
    return Run(name, round_number, seconds, usage.ru_utime, usage.ru_stime, usage.ru_maxrss * 1024, stdout)


def fresh(dest: Path) -> None:
    """DEST gone and its dirty pages on disk, so the next run starts as this one did."""
    shutil.rmtree(dest, ignore_errors=True)
    os.sync()


def run_cp(source: Path, dest: Path, round_number: int, env: dict[str, str], durable: bool = False) -> Run:
    """cp -r; `durable`: then every copied file fsynced (coreutils sync with file operands)."""
    argv = ["cp", "-r", str(source), str(dest)]
    if durable:
        argv = ["sh", "-c", 'cp -r "$1" "$2" && sync "$2"/*', "cp", str(source), str(dest)]
    try:
        return measure("cp -r + fsync" if durable else "cp -r", round_number, argv, env)
    finally:
        fresh(dest)


def run_streamctl(source: Path, dest: Path, round_number: int, env: dict[str, str]) -> tuple[Run, dict[str, str]]:
    """The run, and the sha256 it reports for each file (after checking DEST holds each at its size)."""
    try:
        argv = [*benchlib.STREAMCTL, "transfer", str(source), str(dest), "--json"]
        run = measure("streamctl", round_number, argv, env)
        files = json.loads(run.stdout)["files"]
        for file in files:
            if (dest / file["path"]).stat().st_size != (source / file["path"]).stat().st_size:
                raise SystemExit(f"streamctl wrote {file['path']} at the wrong size")
        return run, {file["path"]: file["sha256"] for file in files}
    finally:
        fresh(dest)


def run_floor(source: Path, dest: Path, env: dict[str, str], hash_only: bool) -> tuple[Run, dict[str, str]]:
    try:
        if not hash_only:
            dest.mkdir()
        name = "sha256 alone" if hash_only else "floor: read+sha256+write"
        run = measure(name, 1, [sys.executable, "-c", FLOOR_SCRIPT, str(source), str(dest), str(int(hash_only))], env)
        return run, json.loads(run.stdout)
    finally:
        fresh(dest)


# --------------------------------------------------------------------------------------------- the report


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--dest", choices=("local",), default="local", help="this case: a local folder")
    parser.add_argument("--quick", action="store_true", help="smoke run: a 0.5 GiB checkpoint, 1 round")
    parser.add_argument("--size-gib", type=float, default=None, help="checkpoint size (default 3, --quick 0.5)")
    parser.add_argument("--shard-gb", type=float, default=2.0, help="largest file, GB (default 2)")
    parser.add_argument("--rounds", type=int, default=None, help="cp / streamctl rounds (default 3, --quick 1)")
    parser.add_argument("--dir", type=Path, default=None, help="where the scratch folder goes (default: temp)")
    args = parser.parse_args(argv)
    args.size = int((args.size_gib or (0.5 if args.quick else 3.0)) * GiB)
    args.rounds = max(1, args.rounds or (1 if args.quick else 3))
    return args


@contextmanager
def scratch(parent: Path | None) -> Iterator[Path]:
    folder = Path(tempfile.mkdtemp(prefix="streamctl-bench-local-", dir=parent))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def print_runs(runs: list[Run], size: int) -> None:
    table = Table(["run", "round", "wall s", "GB/s", "user s", "sys s", "peak RSS"])
    for run in runs:
        table.add(run.name, run.round, f"{run.seconds:.2f}", f"{size / GB / run.seconds:.2f}",
                  f"{run.user_s:.2f}", f"{run.sys_s:.2f}", human_bytes(run.peak_rss))  # fmt: skip
    table.print()


def generate_worker(argv: list[str]) -> int:
    """The child that writes the checkpoint (FOLDER TOTAL_BYTES SHARD_BYTES), so numpy's pages stay out of the parent."""
    write_checkpoint(Path(argv[0]), int(argv[1]), int(argv[2]))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--generate"]:
        return generate_worker(argv[1:])
    args = parse_args(argv)
    env = dict(os.environ)
    with scratch(args.dir) as folder:
        source, dest = folder / "source", folder / "dest"
        generated = time.monotonic()
        # In a child: numpy's pages would otherwise count in every method's peak RSS (ru_maxrss survives exec).
        generate = [sys.executable, __file__, "--generate", str(source), str(args.size), str(int(args.shard_gb * GB))]
        subprocess.run(generate, check=True, env=env)
        size = sum(path.stat().st_size for path in source.iterdir())
        files = sorted(path.name for path in source.iterdir())
        print(f"checkpoint: Llama-3.1-8B's shapes, {human_bytes(size)} in {len(files)} files "
              f"(largest {human_bytes(max((source / name).stat().st_size for name in files))}), generated in "
              f"{time.monotonic() - generated:.1f} s into {source}")  # fmt: skip
        run_floor(source, dest, env, hash_only=True)  # reads it once: every method finds it in the page cache
        os.sync()
        cp_runs: list[Run] = []
        durable_runs: list[Run] = []
        ours: list[Run] = []
        floors: list[Run] = []
        reported: dict[str, str] = {}
        for round_number in range(1, args.rounds + 1):
            methods = ("cp", "cp+fsync", "streamctl")
            order = methods[round_number % 3 :] + methods[: round_number % 3]
            for method in order:
                if method == "cp":
                    cp_runs.append(run_cp(source, dest, round_number, env))
                elif method == "cp+fsync":
                    durable_runs.append(run_cp(source, dest, round_number, env, durable=True))
                else:
                    run, reported = run_streamctl(source, dest, round_number, env)
                    ours.append(run)
            if round_number == 1:
                for hash_only in (False, True):
                    floor, digests = run_floor(source, dest, env, hash_only)
                    floors.append(floor)
    print()
    print_runs([*sorted(cp_runs + durable_runs + ours, key=lambda run: (run.round, run.name)), *floors], size)
    print()
    ratios = [cp.seconds / mine.seconds for cp, mine in zip(cp_runs, ours, strict=True)]
    ratio = statistics.median(ratios)
    floor_run = floors[0]
    floor_ratio = statistics.median(floor_run.seconds / mine.seconds for mine in ours)
    print(f"streamctl / cp (cp's wall time over streamctl's, per round): {', '.join(f'{r:.2f}x' for r in ratios)}; "
          f"median {ratio:.2f}x")  # fmt: skip
    print(f"streamctl / floor (read+sha256+write, one thread, fsync): {floor_ratio:.2f}x; the floor itself is "
          f"{cp_runs[0].seconds / floor_run.seconds:.2f}x cp's round-1 speed; sha256 alone "
          f"{size / GB / floors[1].seconds:.2f} GB/s")  # fmt: skip
    durable = [cp.seconds / mine.seconds for cp, mine in zip(durable_runs, ours, strict=True)]
    print(f"streamctl / cp + fsync (cp made durable, as streamctl's files are): "
          f"{', '.join(f'{r:.2f}x' for r in durable)}; median {statistics.median(durable):.2f}x; cp + fsync is "
          f"{statistics.median(c.seconds / d.seconds for c, d in zip(cp_runs, durable_runs, strict=True)):.2f}x "
          f"cp's speed")  # fmt: skip
    bounds = [max(cp.seconds, floors[1].seconds) / mine.seconds for cp, mine in zip(durable_runs, ours, strict=True)]
    print(f"streamctl / the overlap bound (per round the slower of cp + fsync and sha256 alone: what a durable "
          f"copier pays that hashes beside a kernel copy): median {statistics.median(bounds):.2f}x")  # fmt: skip
    cpu = statistics.median(run.user_s + run.sys_s for run in ours)
    cp_cpu = statistics.median(run.user_s + run.sys_s for run in cp_runs)
    print(f"CPU (user+sys, median): streamctl {cpu:.2f} s, cp {cp_cpu:.2f} s, floor "
          f"{floor_run.user_s + floor_run.sys_s:.2f} s; {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.1f}")  # fmt: skip
    print()
    targets = Targets()
    wrong = sorted(name for name, sha256 in reported.items() if digests.get(name) != sha256 and name in digests)
    print(targets.check(not wrong, "sha256", "every file's sha256 as the floor computed it" if not wrong else
                        f"differs for {', '.join(wrong)}"))  # fmt: skip
    print(targets.check(ratio >= TARGET_RATIO, "speed", f"streamctl {ratio:.2f}x cp (target >= {TARGET_RATIO}x)"))
    return targets.exit_status()


if __name__ == "__main__":
    sys.exit(main())
