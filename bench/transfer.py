"""Benchmark: `streamctl transfer hf://... gs://...` against a bare parallel copier (the ceiling) and the seed's script.

Method
------
- Source: a fake Hugging Face Hub (tests/fakehub.py) served from THIS process, holding a repo of `--size-gib`
  (1 GiB; --quick 128 MiB): 4 safetensors shards (valid headers; data = a 1 MiB random block repeated, one
  block per shard, so each shard has its own sha256) plus config, generation config, tokenizer (2 MB, a plain
  git file), tokenizer config, special tokens map, index, README.md and .gitattributes. The hub is local: every
  method reads it at loopback speed (as from the hub's CDN in-region); only the destination is behind the link.
- Destination (default `--dest gs`): gcp-storage-emulator, in memory, started through bench/threaded_gcs.py.
  Stock, the emulator serves ONE request at a time, so behind a per-connection cap it is exactly as fast as
  one connection and parallelism cannot show; the patch serves connections on threads (request bodies move in
  parallel, its storage logic stays serialized) and composes as GCS does (linear, no MD5 for composite
  objects; stock compose copies quadratically). `--dest s3` uses moto instead (see below). Every run writes to
  a fresh bucket, which is checked (each file at its size) and emptied afterwards.
- Link (`--link auto`, the default): the kernel's where it can be set up (bench/netsim.py's KernelLink: the
  server in a network namespace of its own behind a veth pair with `netem delay` each way and `fq maxrate` per
  flow, no user-space CPU), else the user-space proxy (netsim.py's LinkProcess, its own process, CPU on the
  same 2 cores); a line says which was used and, for the proxy under auto, exactly what the kernel's lacked.
  `--link kernel` fails (exit 2) when the kernel's cannot be had; `--link proxy` forces the proxy. Either caps
  EACH connection at `--rate-mb-s` (25 MB/s) and delays each direction by `--delay-ms` (10 ms), as a single
  cloud stream tops out while parallel streams add up. The calibration measures the destination server with no
  link (the proxy: dialled directly; the kernel's: a second, unshaped veth pair) and through it.
- Methods, each run as a SUBPROCESS so its peak RSS is its own (os.wait4's ru_maxrss, taken by a small
  launcher; the hub's bytes in this process are never counted), with its own HOME, HF_HOME and TMPDIR inside
  a watched scratch folder, on the same link and server:
  (a) `python -m streamctl transfer hf://ORG/NAME gs://BUCKET/PREFIX --json` with its defaults (16 parts in
      flight, 16 MiB parts, 256 MiB buffer, sha256 checked, verify-index on the destination at the end);
  (b) the bare parallel copier, bench/bare_copy.py: 16 threads of 16 MiB ranged GETs (plain HTTP) of the files
      streamctl copied, each part uploaded as it arrives with the same SDK clients (an object per part
      composed into the file on GCS, a multipart upload on S3), no hashing, no bookkeeping: the ceiling;
  (a) and (b) run in `--rounds` rounds (2; --quick 1), alternating which goes first, so drift on a shared
      machine hits both alike;
  (c) the seed script (hf-2-gc.py), once: `snapshot_download(repo_id, local_dir=DIR, max_workers=10)`, then
      `os.walk(DIR)` and one `blob.upload_from_filename()` per file, one at a time, exactly as the seed does
      (so the .cache/huggingface/ files snapshot_download leaves in DIR are uploaded too). With `--dest s3`
      the upload is `boto3 upload_file()` per file with boto3's default TransferConfig, which already
      uploads 8 MiB parts on 10 threads: a stronger baseline than the seed's.
- The CPU floor: sha256 of every byte plus one memory copy (into a reused buffer), timed on this thread's CPU
  clock in this process before and after the runs (the lower figure is kept): CPU seconds per GB that no
  copier checking what it copies can go below on this machine. A method's CPU is its whole process (start-up,
  planning and verify-index included), user + system.
- Local disk: the growth of each method's scratch folder, polled every 0.1 s.

Reading the output
------------------
First the calibration and the link line; then one row per run (wall, MB/s, CPU, CPU s/GB and its multiple of
the floor, peak RSS, peak local disk, the server's and the link's CPU meanwhile), then the ratios. Targets,
each PASS/FAIL, the exit status 1 when any is missed: streamctl >= 85% of the bare copier's speed (wall
times summed over the rounds); streamctl CPU <= 1.5x the floor; streamctl peak RSS <= 512 MiB (the highest
round); >= 5x faster than the seed method (its best round); no local copy (disk growth <= 16 MiB). A 2-core
machine running the server, the link, the hub and the method at once is easily CPU-bound: compare the
server's CPU and the load average printed at the end before reading a ratio as streamctl's own.

Usage: python bench/transfer.py [--quick] [--size-gib 1] [--rounds 2] [--link auto|kernel|proxy]
       [--rate-mb-s 25] [--delay-ms 10] [--dest gs|s3] [--concurrency 16]
       python bench/transfer.py --dest local [--quick] [--size-gib 3] [--shard-gb 2] [--rounds 3] [--dir PARENT]
       (folder to folder against `cp -r` and the read+sha256+write floor: bench/transfer_local.py)
"""

from __future__ import annotations

import argparse
import hashlib
import io
import itertools
import json
import os
import random
import shutil
import sys
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import benchlib
from benchlib import BENCH_DIR, MB, ChildRun, GiB, MiB, Table, Targets, human_bytes
from netsim import KernelLink, KernelLinkUnavailable, LinkProcess

REPO_ID = "bench-org/llm-2g"
SHARDS = 4
PART = 16 * MiB  # streamctl's default part size, used for the calibration uploads
TARGET_SPEEDUP = 5.0
TARGET_SHARE = 0.85  # of the bare copier's speed
TARGET_CPU_FACTOR = 1.5  # CPU seconds per GB, against the floor (sha256 of every byte + one memory copy)
TARGET_RSS = 512 * MiB
TARGET_DISK = 16 * MiB


# --------------------------------------------------------------------------------------------- the repo


def build_repo(total_bytes: int, seed: int = 2024) -> dict[str, bytes]:
    """The repo's files: SHARDS safetensors shards sharing `total_bytes`, plus the small files of a real repo."""
    from streamctl.checkpoint.safetensors import encode_safetensors_header

    rng = random.Random(seed)
    hidden = 4096
    per_shard = total_bytes // SHARDS
    tensors_per_shard = 8
    rows = max(1, per_shard // tensors_per_shard // (hidden * 2))
    files: dict[str, bytes] = {}
    weight_map: dict[str, str] = {}
    total_size = 0
    names = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "mlp.extra_proj")  # fmt: skip
    for shard in range(SHARDS):
        shard_name = f"model-{shard + 1:05d}-of-{SHARDS:05d}.safetensors"
        layout = [
            (f"model.layers.{shard}.{name}.weight", "BF16", [rows, hidden], rows * hidden * 2)
            for name in names[:tensors_per_shard]
        ]
        prefix, offsets = encode_safetensors_header(layout, {"format": "pt"})
        data_bytes = offsets[-1][1]
        block = rng.randbytes(MiB)
        count, rest = divmod(data_bytes, MiB)
        files[shard_name] = prefix + block * count + block[:rest]  # one 1 MiB block per shard, repeated
        weight_map.update({name: shard_name for name, _, _, _ in layout})
        total_size += data_bytes
    vocab = {f"tok{index}": index for index in range(60_000)}
    files["tokenizer.json"] = json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": vocab}}).encode()
    files["model.safetensors.index.json"] = json.dumps(
        {"metadata": {"total_size": total_size}, "weight_map": weight_map}, indent=2
    ).encode()
    files["config.json"] = json.dumps(
        {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
         "num_hidden_layers": SHARDS, "torch_dtype": "bfloat16"}, indent=2,
    ).encode()  # fmt: skip
    files["generation_config.json"] = b'{"bos_token_id": 1, "eos_token_id": 2}'
    files["tokenizer_config.json"] = b'{"tokenizer_class": "PreTrainedTokenizerFast"}'
    files["special_tokens_map.json"] = b'{"bos_token": "<s>", "eos_token": "</s>"}'
    files["README.md"] = b"# bench model\n\nSynthetic weights for streamctl's transfer benchmark.\n"
    files[".gitattributes"] = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"
    return files


# --------------------------------------------------------------------------------------------- destinations


@dataclass
class Destination:
    """One store behind the link: how to start it, reach it, calibrate it, and list what a method wrote."""

    scheme: str  # "gs" or "s3"
    server: Any  # benchlib/servers GCSServer or S3Server
    label: str

    def env(self, endpoint: str) -> dict[str, str]:
        return {"STORAGE_EMULATOR_HOST": endpoint} if self.scheme == "gs" else {"AWS_ENDPOINT_URL": endpoint}

    def new_bucket(self) -> str:
        return self.server.new_bucket()

    def listing(self, bucket: str, prefix: str) -> dict[str, int]:
        """name (relative to prefix) -> size, for every object under `prefix/`."""
        if self.scheme == "gs":
            blobs = self.server.client().list_blobs(bucket, prefix=prefix + "/")
            return {blob.name[len(prefix) + 1 :]: int(blob.size) for blob in blobs}
        paginator = self.server.client().get_paginator("list_objects_v2")
        return {
            item["Key"][len(prefix) + 1 :]: int(item["Size"])
            for page in paginator.paginate(Bucket=bucket, Prefix=prefix + "/")
            for item in page.get("Contents", ())
        }

    def uploader(self, endpoint: str) -> Callable[[str, str, bytes], None]:
        """A function (bucket, key, data) -> None that uploads with this store's SDK through `endpoint`."""
        if self.scheme == "gs":
            import requests
            from google.auth.credentials import AnonymousCredentials
            from google.auth.transport.requests import AuthorizedSession
            from google.cloud import storage

            session = AuthorizedSession(AnonymousCredentials())
            adapter = requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=64)
            session.mount("http://", adapter)
            client = storage.Client(
                project=benchlib.servers.GCS_PROJECT, credentials=AnonymousCredentials(), _http=session,
                client_options={"api_endpoint": endpoint},
            )  # fmt: skip
            return lambda bucket, key, data: client.bucket(bucket).blob(key).upload_from_file(io.BytesIO(data))
        import boto3
        from botocore.config import Config

        s3 = boto3.session.Session().client(
            "s3", endpoint_url=endpoint, config=Config(max_pool_connections=64, s3={"addressing_style": "path"})
        )
        return lambda bucket, key, data: s3.put_object(Bucket=bucket, Key=key, Body=data)

    def clear(self, bucket: str) -> None:
        """Delete every object in `bucket` (the in-memory servers would otherwise hold every run's copy)."""
        if self.scheme == "gs":
            for blob in list(self.server.client().list_blobs(bucket)):
                blob.delete()
            return
        client = self.server.client()
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            keys = [{"Key": item["Key"]} for item in page.get("Contents", ())]
            if keys:
                client.delete_objects(Bucket=bucket, Delete={"Objects": keys})


def start_destination(scheme: str, workdir: Path, link: KernelLink | None) -> Destination:
    """The store, on 127.0.0.1 (for the proxy to dial) or inside the kernel link's namespace."""
    if scheme == "gs":
        return Destination("gs", benchlib.start_threaded_gcs(workdir, link), "gcp-storage-emulator (threaded patch)")
    return Destination("s3", benchlib.start_s3(workdir, link), "moto S3 server")


# --------------------------------------------------------------------------------------------- calibration


@dataclass(frozen=True)
class Rate:
    label: str
    bytes: int
    seconds: float

    @property
    def mb_s(self) -> float:
        return self.bytes / MB / self.seconds


def timed_uploads(upload: Callable[[str, str, bytes], None], bucket: str, label: str, blobs: list[bytes],
                  threads: int) -> Rate:  # fmt: skip
    started = time.monotonic()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda item: upload(bucket, f"calibration/{label}/{item[0]}", item[1]), enumerate(blobs)))
    return Rate(label, sum(len(blob) for blob in blobs), time.monotonic() - started)


def calibrate(destination: Destination, link: Any, hub: Any, hub_files: dict[str, Any], quick: bool) -> list[Rate]:
    """What the server takes without the link, what the link gives, and what the local hub serves."""
    bucket = destination.new_bucket()
    part = random.Random(7).randbytes(PART)
    direct, linked = destination.uploader(destination.server.endpoint), destination.uploader(link.url)
    parts = 8 if quick else 16
    single = 64 * MiB if quick else 256 * MiB
    rates = [
        timed_uploads(
            direct, bucket, f"server, no link, 1 stream of {single // MiB} MiB", [part * (single // PART)], 1
        ),
        timed_uploads(direct, bucket, f"server, no link, {parts} x 16 MiB on 16 threads", [part] * parts, 16),
        timed_uploads(linked, bucket, "link, 1 connection, 2 x 16 MiB", [part] * 2, 1),
        timed_uploads(linked, bucket, f"link, 16 connections, {2 * parts} x 16 MiB", [part] * (2 * parts), 16),
    ]
    # The hub, read the way streamctl reads it: 16 parallel 16 MiB ranged GETs of one shard.
    shard = max(hub_files.values(), key=lambda entry: entry.size)
    url = f"{hub.cdn_endpoint}/blobs/{shard.sha256}/{shard.path}"

    def get(start: int) -> int:
        request = urllib.request.Request(url, headers={"Range": f"bytes={start}-{start + PART - 1}"})
        with urllib.request.urlopen(request) as response:
            return len(response.read())

    started = time.monotonic()
    with ThreadPoolExecutor(16) as pool:
        got = sum(pool.map(get, [index * PART for index in range(min(16, shard.size // PART))]))
    rates.append(Rate("fake hub (this process), 16 x 16 MiB ranged GETs", got, time.monotonic() - started))
    destination.clear(bucket)  # free the server's memory
    return rates


# --------------------------------------------------------------------------------------------- the seed method


def seed_worker(argv: list[str]) -> int:
    """The seed script's method, run as this script's child: download the snapshot, then upload file by file."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--repo", required=True)
    parser.add_argument("--local-dir", required=True)
    parser.add_argument("--dest", choices=("gs", "s3"), required=True)
    parser.add_argument("--bucket", required=True)
    parser.add_argument("--prefix", required=True)
    args = parser.parse_args(argv)
    from huggingface_hub import snapshot_download

    started = time.monotonic()
    # hf-2-gc.py also passes local_dir_use_symlinks=False and resume_download=True, which huggingface_hub 2.x
    # no longer accepts (local_dir always holds real files now; downloads always resume).
    snapshot_download(repo_id=args.repo, local_dir=args.local_dir, max_workers=10)
    downloaded = time.monotonic()
    uploaded_files, uploaded_bytes = 0, 0
    if args.dest == "gs":
        from google.cloud import storage

        storage_client = storage.Client()
        bucket = storage_client.bucket(args.bucket)

        def upload(local_path: str, blob_path: str) -> None:
            bucket.blob(blob_path).upload_from_filename(local_path)
    else:
        import boto3

        s3 = boto3.client("s3")  # default TransferConfig: multipart above 8 MiB, 10 threads

        def upload(local_path: str, blob_path: str) -> None:
            s3.upload_file(local_path, args.bucket, blob_path)

    for root, _, files in os.walk(args.local_dir):
        for file in files:
            local_path = os.path.join(root, file)
            relative_path = os.path.relpath(local_path, args.local_dir)
            upload(local_path, os.path.join(args.prefix, relative_path))
            uploaded_files += 1
            uploaded_bytes += os.path.getsize(local_path)
    finished = time.monotonic()
    print(json.dumps({"download_s": downloaded - started, "upload_s": finished - downloaded,
                      "files": uploaded_files, "bytes": uploaded_bytes}))  # fmt: skip
    return 0


# --------------------------------------------------------------------------------------------- the runs


@dataclass
class MethodResult:
    name: str
    round: int  # 1-based; the seed runs once (round 0)
    run: ChildRun
    files: int
    bytes: int
    detail: str
    server_cpu: float = 0.0  # CPU seconds the destination server spent while this method ran
    link_cpu: float | None = 0.0  # CPU seconds of the link process meanwhile (None: the kernel's link)

    @property
    def mb_s(self) -> float:
        return self.bytes / MB / self.run.seconds

    @property
    def cpu_s_per_gb(self) -> float:
        return self.run.cpu_s / (self.bytes / 1e9)


@dataclass
class Bench:
    """What every run shares: the destination, the link, the hub, the environment, the plan."""

    args: argparse.Namespace
    destination: Destination
    link: Any  # netsim.LinkProcess or netsim.KernelLink
    hub: Any  # tests/fakehub.FakeHub
    hub_files: dict[str, Any]
    base_env: dict[str, str]
    hub_env: dict[str, str]
    scratch: Path
    plan_path: Path  # the bare copier's plan: written after streamctl's first run, of the files it copied
    runs: int = 0

    def measured(self, argv: list[str], name: str) -> tuple[ChildRun, float, float | None, str]:
        """run_measured() in a fresh scratch folder, plus the CPU the server and the link burned meanwhile.

        Returns the run, the server's and the link's CPU seconds, and the fresh bucket the run wrote to: the
        argv names it as BUCKET, and its scratch folder (watched for disk growth, removed after) as RUNDIR."""
        self.runs += 1
        bucket = self.destination.new_bucket()
        folder = self.scratch / f"run-{self.runs}"
        pids = [self.destination.server.server.process.pid, self.link.pid]
        before = [benchlib.process_cpu_seconds(pid) if pid else 0.0 for pid in pids]
        argv = [part.replace("BUCKET", bucket).replace("RUNDIR", str(folder)) for part in argv]
        run = benchlib.run_measured(argv, env=method_env(self.base_env, folder, self.hub_env), watch=folder)
        after = [benchlib.process_cpu_seconds(pid) if pid else 0.0 for pid in pids]
        shutil.rmtree(folder, ignore_errors=True)  # the seed's local copy, the caches
        if run.returncode != 0:
            raise SystemExit(f"{name} failed (exit {run.returncode}):\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}")
        link_cpu = after[1] - before[1] if self.link.pid else None
        return run, after[0] - before[0], link_cpu, bucket

    def check_landed(self, name: str, bucket: str, paths: list[str]) -> str:
        """Each of `paths` landed with its size (or SystemExit); then the bucket is emptied for the next run."""
        landed = self.destination.listing(bucket, "model")
        wrong = [path for path in paths if landed.get(path) != self.hub_files[path].size]
        self.destination.clear(bucket)
        if wrong:
            raise SystemExit(f"{name}: {len(wrong)} files missing or of the wrong size at the destination: {wrong[:5]}")
        return f"{len(landed)} objects landed"


def run_streamctl(bench: Bench, round_number: int) -> MethodResult:
    args = bench.args
    run, server_cpu, link_cpu, bucket = bench.measured(
        [*benchlib.STREAMCTL, "transfer", f"hf://{REPO_ID}", f"{args.dest}://BUCKET/model", "--json",
         "-j", str(args.concurrency)], "streamctl transfer",
    )  # fmt: skip
    report = json.loads(run.stdout)
    verify = report.get("verify") or {}
    mismatched = [f["path"] for f in report["files"] if f["sha256"] != bench.hub_files[f["path"]].sha256]
    if mismatched:
        raise SystemExit(f"streamctl transfer: sha256 differs from the hub's for {mismatched}")
    copied = [f["path"] for f in report["files"]]
    landed = bench.check_landed("streamctl transfer", bucket, copied)
    if not bench.plan_path.exists():
        write_plan(bench.plan_path, bench.hub, [bench.hub_files[path] for path in copied])
    detail = f"copy {report['seconds']:.1f} s + plan/verify-index; verify ok={verify.get('ok')}; sha256 ok; {landed}"
    return MethodResult("streamctl transfer", round_number, run, len(report["files"]), report["bytes_copied"],
                        detail, server_cpu, link_cpu)  # fmt: skip


def run_bare(bench: Bench, round_number: int) -> MethodResult:
    args = bench.args
    run, server_cpu, link_cpu, bucket = bench.measured(
        [sys.executable, str(BENCH_DIR / "bare_copy.py"), "--plan", str(bench.plan_path), "--dest", args.dest,
         "--endpoint", bench.link.url, "--bucket", "BUCKET", "--prefix", "model",
         "--threads", str(args.concurrency), "--part-size-mib", str(PART // MiB)], "bare copier",
    )  # fmt: skip
    report = json.loads(run.stdout.strip().splitlines()[-1])
    landed = bench.check_landed(
        "bare copier", bucket, [entry["path"] for entry in json.loads(bench.plan_path.read_text())]
    )
    detail = f"copy {report['seconds']:.1f} s; {landed}"
    return MethodResult(f"bare copier ({args.concurrency} threads)", round_number, run, report["files"],
                        report["bytes"], detail, server_cpu, link_cpu)  # fmt: skip


def run_seed(bench: Bench) -> MethodResult:
    args = bench.args
    run, server_cpu, link_cpu, bucket = bench.measured(
        [sys.executable, str(Path(__file__).resolve()), "--seed-worker", "--repo", REPO_ID,
         "--local-dir", "RUNDIR/model", "--dest", args.dest, "--bucket", "BUCKET", "--prefix", "model"],
        "seed method",
    )  # fmt: skip
    phases = json.loads(run.stdout.strip().splitlines()[-1])
    landed = bench.check_landed("seed method", bucket, list(bench.hub_files))
    upload_call = "upload_from_filename" if args.dest == "gs" else "boto3 upload_file"
    detail = f"download {phases['download_s']:.1f} s, then upload {phases['upload_s']:.1f} s; {landed}"
    return MethodResult(f"seed: snapshot_download + {upload_call}", 0, run, phases["files"], phases["bytes"],
                        detail, server_cpu, link_cpu)  # fmt: skip


def write_plan(path: Path, hub: Any, entries: list[Any]) -> None:
    """The bare copier's plan: each file with its size and a plain HTTP URL (the CDN's for LFS files)."""
    plan = [
        {"path": entry.path, "size": entry.size,
         "url": f"{hub.cdn_endpoint}/blobs/{entry.sha256}/{entry.path}" if entry.lfs
         else f"{hub.endpoint}/{REPO_ID}/resolve/main/{entry.path}"}
        for entry in entries
    ]  # fmt: skip
    path.write_text(json.dumps(plan))


# --------------------------------------------------------------------------------------------- the floor


def cpu_floor_s_per_gb(total: int, block_size: int = 16 * MiB, repeats: int = 3) -> float:
    """CPU seconds per GB to sha256 every byte and copy it once in memory (into a reused buffer), on this
    machine now: the least any copier that checks what it copies can spend. The best of `repeats` (noise
    only adds), measured on this thread's CPU clock."""
    block = random.Random(11).randbytes(block_size)
    target = bytearray(block_size)
    best = float("inf")
    for _ in range(repeats):
        digest = hashlib.sha256()
        started = time.thread_time()
        for _ in range(max(1, total // block_size)):
            digest.update(block)
            target[:] = block
        best = min(best, (time.thread_time() - started) / (max(1, total // block_size) * block_size / 1e9))
    return best


# --------------------------------------------------------------------------------------------- the link


def open_link(args: argparse.Namespace, workdir: Path) -> tuple[Any, Destination, str]:
    """The kernel's link (auto, kernel) or the proxy (proxy, or auto where the kernel's is not available),
    with the destination server behind it, and a line saying which and why. SystemExit(2) when --link kernel
    cannot be had."""
    delay_s, rate = args.delay_ms / 1000, args.rate_mb_s * MB
    reason = "--link proxy"
    if args.link in ("auto", "kernel"):
        try:
            kernel = KernelLink(delay_s, rate).start()
        except KernelLinkUnavailable as error:
            if args.link == "kernel":
                raise SystemExit(f"--link kernel: the kernel link could not be set up: {error}") from None
            reason = f"the kernel's link is not available here: {error}"
        else:
            try:
                destination = start_destination(args.dest, workdir, kernel)
            except BaseException:
                kernel.stop()
                raise
            return kernel, destination, f"link: {kernel.describe()}"
    destination = start_destination(args.dest, workdir, None)
    try:
        proxy = LinkProcess(destination.server.server.port, delay_s, rate).start()
    except BaseException:
        destination.server.server.stop()
        raise
    return proxy, destination, f"link: user-space proxy (bench/netsim.py, its own process, costs CPU); {reason}"


# --------------------------------------------------------------------------------------------- output


def print_runs(results: list[MethodResult], floor: float, seed_wall: float | None) -> None:
    table = Table(["method", "round", "wall", "x seed", "MB/s", "CPU", "CPU s/GB", "x floor", "peak RSS",
                   "peak local disk", "server CPU", "link CPU", "detail"])  # fmt: skip
    for result in results:
        link_cpu = "kernel" if result.link_cpu is None else f"{result.link_cpu:.1f} s"
        table.add(
            result.name, result.round or "-", f"{result.run.seconds:.1f} s",
            "-" if seed_wall is None else f"{seed_wall / result.run.seconds:.2f}x",
            f"{result.mb_s:.0f}", f"{result.run.cpu_s:.1f} s", f"{result.cpu_s_per_gb:.2f}",
            f"{result.cpu_s_per_gb / floor:.1f}x", human_bytes(result.run.peak_rss), human_bytes(result.run.peak_disk),
            f"{result.server_cpu:.1f} s", link_cpu, result.detail,
        )  # fmt: skip
    table.print()


# The seed method's run, or why it failed (the other methods are still measured and reported).
Seed = MethodResult | str


def print_ratios(ours: list[MethodResult], bare: list[MethodResult], seed: Seed, floor: float) -> None:
    table = Table(["ratio", "value", "from"])
    for mine, theirs in zip(ours, bare, strict=True):
        table.add(f"share of the bare copier's speed, round {mine.round}", f"{theirs.run.seconds / mine.run.seconds:.0%}",
                  f"{theirs.run.seconds:.1f} s / {mine.run.seconds:.1f} s")  # fmt: skip
    ours_s, bare_s = sum(r.run.seconds for r in ours), sum(r.run.seconds for r in bare)
    table.add(
        "share of the bare copier's speed, all rounds", f"{bare_s / ours_s:.0%}", f"{bare_s:.1f} s / {ours_s:.1f} s"
    )
    ours_cpu = sum(r.run.cpu_s for r in ours) / (sum(r.bytes for r in ours) / 1e9)
    bare_cpu = sum(r.run.cpu_s for r in bare) / (sum(r.bytes for r in bare) / 1e9)
    table.add("streamctl CPU per GB / floor", f"{ours_cpu / floor:.2f}x", f"{ours_cpu:.2f} / {floor:.2f} s/GB")
    table.add("bare copier CPU per GB / floor", f"{bare_cpu / floor:.2f}x", f"{bare_cpu:.2f} / {floor:.2f} s/GB")
    if isinstance(seed, str):
        table.add("streamctl speed-up over the seed", "-", f"not measured: {seed}")
    else:
        table.add("streamctl speed-up over the seed", f"{seed.run.seconds / min(r.run.seconds for r in ours):.2f}x",
                  f"{seed.run.seconds:.1f} s / best {min(r.run.seconds for r in ours):.1f} s")  # fmt: skip
    table.print()


def print_calibration(rates: list[Rate], link_line: str, kernel: bool, cap: float) -> None:
    calibration = Table(["calibration (uploads unless noted)", "bytes", "seconds", "MB/s"])
    for rate in rates:
        calibration.add(rate.label, human_bytes(rate.bytes), f"{rate.seconds:.2f}", f"{rate.mb_s:.0f}")
    calibration.print()
    print(link_line)
    one = rates[2].mb_s
    if kernel and not 0.7 * cap <= one <= 1.15 * cap:
        print(f"WARNING: one connection through the kernel link gave {one:.0f} MB/s, not the {cap:g} MB/s it is set "
              "to (check the qdiscs: tc -s qdisc)")  # fmt: skip


def check_targets(ours: list[MethodResult], bare: list[MethodResult], seed: Seed, floor: float,
                  quick: bool) -> Targets:  # fmt: skip
    targets = Targets()
    if quick:
        print("--quick: a smoke run. The targets are meant for the default size: on a small repo streamctl's fixed "
              "costs (interpreter start, planning, verify-index: ~1 s) weigh more.")  # fmt: skip
    ours_s, bare_s = sum(r.run.seconds for r in ours), sum(r.run.seconds for r in bare)
    share = bare_s / ours_s
    print(targets.check(share >= TARGET_SHARE, f">= {TARGET_SHARE:.0%} of the bare copier's speed",
                        f"{share:.0%} (wall, all rounds: {bare_s:.1f} s / {ours_s:.1f} s)"))  # fmt: skip
    ours_cpu = sum(r.run.cpu_s for r in ours) / (sum(r.bytes for r in ours) / 1e9)
    print(targets.check(ours_cpu <= TARGET_CPU_FACTOR * floor, f"CPU <= {TARGET_CPU_FACTOR:g}x the floor",
                        f"{ours_cpu:.2f} s/GB = {ours_cpu / floor:.2f}x the floor's {floor:.2f} s/GB "
                        "(sha256 + one copy; streamctl's whole process: start, plan, verify included)"))  # fmt: skip
    peak = max(r.run.peak_rss for r in ours)
    seed_rss = "failed" if isinstance(seed, str) else f"{seed.run.peak_rss / MiB:.0f} MiB"
    print(targets.check(peak <= TARGET_RSS, "streamctl peak RSS <= 512 MiB",
                        f"{peak / MiB:.0f} MiB (bare copier {max(r.run.peak_rss for r in bare) / MiB:.0f} MiB, "
                        f"seed method {seed_rss})"))  # fmt: skip
    best = min(r.run.seconds for r in ours)
    if isinstance(seed, str):
        print(targets.check(False, f">= {TARGET_SPEEDUP:g}x faster than the seed method", f"not measured: {seed}"))
    else:
        speedup = seed.run.seconds / best
        print(targets.check(speedup >= TARGET_SPEEDUP, f">= {TARGET_SPEEDUP:g}x faster than the seed method",
                            f"{speedup:.2f}x ({seed.run.seconds:.1f} s / {best:.1f} s)"))  # fmt: skip
    disk = max(r.run.peak_disk for r in ours)
    seed_disk = "failed" if isinstance(seed, str) else human_bytes(seed.run.peak_disk)
    print(targets.check(disk <= TARGET_DISK, "no local copy (streamctl disk growth <= 16 MiB)",
                        f"{human_bytes(disk)} under its HOME/HF_HOME/TMPDIR (seed method: {seed_disk})"))  # fmt: skip
    return targets


# --------------------------------------------------------------------------------------------- main


def method_env(base: dict[str, str], scratch: Path, extra: dict[str, str]) -> dict[str, str]:
    """HOME, XDG_CACHE_HOME, HF_HOME and TMPDIR all inside `scratch`, so any local write lands where it is watched."""
    folders = {"HOME": "home", "XDG_CACHE_HOME": "home/.cache", "HF_HOME": "hf-home", "TMPDIR": "tmp"}
    for folder in folders.values():
        (scratch / folder).mkdir(parents=True, exist_ok=True)
    return {**base, **{name: str(scratch / folder) for name, folder in folders.items()}, **extra}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="smoke run (< 60 s): a 128 MiB repo, 1 round")
    parser.add_argument("--size-gib", type=float, default=None, help="repo size (default 1, --quick 0.125)")
    parser.add_argument(
        "--rounds", type=int, default=None, help="streamctl / bare copier rounds (default 2, --quick 1)"
    )
    parser.add_argument("--rate-mb-s", type=float, default=25.0, help="per-connection cap of the link, MB/s")
    parser.add_argument("--delay-ms", type=float, default=10.0, help="one-way delay of the link")
    parser.add_argument("--dest", choices=("gs", "s3", "local"), default="gs",
                        help="destination store (default gs); local: folder to folder against cp, see "
                             "bench/transfer_local.py")  # fmt: skip
    parser.add_argument("--concurrency", type=int, default=16, help="streamctl -j and the bare copier's threads")
    parser.add_argument("--link", choices=("auto", "kernel", "proxy"), default="auto",
                        help="the simulated link: the kernel's (netns, veth, netem, fq), the user-space proxy, "
                             "or the kernel's where it can be set up (default)")  # fmt: skip
    args = parser.parse_args(argv)
    args.size = int((args.size_gib or (0.125 if args.quick else 1.0)) * GiB)
    args.rounds = max(1, args.rounds or (1 if args.quick else 2))
    return args


def _dest_is_local(argv: list[str]) -> bool:
    return "--dest=local" in argv or ("--dest", "local") in itertools.pairwise(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--seed-worker"]:
        return seed_worker(argv[1:])
    if _dest_is_local(argv):
        import transfer_local  # the local-to-local case: against cp, its own options (see its docstring)

        return transfer_local.main(argv)
    args = parse_args(argv)
    bench_started, load_start = time.monotonic(), os.getloadavg()[0]
    floor = cpu_floor_s_per_gb(128 * MiB if args.quick else 512 * MiB)
    with benchlib.scratch_dir("streamctl-bench-transfer-") as scratch:
        benchlib.isolated_env(scratch)
        base_env = dict(os.environ)  # isolated now: no cloud or Hugging Face settings of whoever runs this
        from fakehub import FakeHub  # tests/fakehub.py

        generated = time.monotonic()
        files = build_repo(args.size)
        hub = FakeHub().start()
        hub_files = hub.add_repo(REPO_ID, files).files()
        repo_bytes = sum(len(data) for data in files.values())
        del files  # the hub holds the only copy
        generated_s = time.monotonic() - generated
        try:
            link, destination, link_line = open_link(args, scratch / "servers")
        except SystemExit as error:
            hub.stop()
            print(error, file=sys.stderr)
            return 2
        try:
            rates = calibrate(destination, link, hub, hub_files, args.quick)
            bench = Bench(
                args,
                destination,
                link,
                hub,
                hub_files,
                base_env,
                {"HF_ENDPOINT": hub.endpoint, **destination.env(link.url)},
                scratch,
                scratch / "plan.json",
            )
            ours: list[MethodResult] = []
            bare: list[MethodResult] = []
            for round_number in range(1, args.rounds + 1):  # alternate who goes first: drift hits both alike
                pair = (run_streamctl, run_bare) if round_number % 2 else (run_bare, run_streamctl)
                for method in pair:
                    (ours if method is run_streamctl else bare).append(method(bench, round_number))
            try:
                seed: Seed = run_seed(bench)
            except SystemExit as failed:  # the baseline's own failure (e.g. an emulator dropping a large
                # upload): the other methods' figures still stand, and the seed target fails naming it
                lines = [line.strip() for line in str(failed).splitlines() if line.strip()] or ["seed method failed"]
                seed = f"{lines[0].rstrip(':')}: {lines[-1][:300]}" if len(lines) > 1 else lines[0]
                print(seed, file=sys.stderr)
            startup = benchlib.run_measured([*benchlib.STREAMCTL, "--version"], env=base_env, watch=scratch / "startup")
        finally:
            link.stop()
            destination.server.server.stop()
            hub.stop()
    floor = min(floor, cpu_floor_s_per_gb(128 * MiB if args.quick else 512 * MiB))

    print()
    print(f"transfer across a simulated link: {args.rate_mb_s:g} MB/s per connection, {args.delay_ms:g} ms one way; "
          f"destination {destination.label} ({args.dest}://)")  # fmt: skip
    print(f"repo {REPO_ID}: {human_bytes(repo_bytes)} ({repo_bytes / GiB:.2f} GiB) in {len(hub_files)} files, "
          f"{SHARDS} shards of {human_bytes(max(f.size for f in hub_files.values()))}; generated and hashed "
          f"into the in-process fake hub in {generated_s:.1f} s")  # fmt: skip
    print()
    print_calibration(rates, link_line, isinstance(link, KernelLink), args.rate_mb_s)
    print()
    runs = sorted(ours + bare, key=lambda r: (r.round, r.name))
    if isinstance(seed, str):
        print_runs(runs, floor, None)
        print(seed)
    else:
        print_runs([*runs, seed], floor, seed.run.seconds)
    print(f"floor: sha256 of every byte + one memory copy = {floor:.2f} CPU s/GB on this machine, measured in this run; "
          f"the link carried {human_bytes(link.stats.bytes_up)} up in all")  # fmt: skip
    print()
    print_ratios(ours, bare, seed, floor)
    print(f"for reading the CPU figures: streamctl's start-up alone (`python -m streamctl --version`) costs "
          f"{startup.cpu_s:.2f} CPU s ({startup.seconds:.1f} s wall), {startup.cpu_s / (ours[0].bytes / 1e9):.2f} s/GB "
          "of this repo; transfer imports more (the SDKs)")  # fmt: skip
    print()
    targets = check_targets(ours, bare, seed, floor, args.quick)
    load_end = os.getloadavg()[0]
    busy = (
        " (above the core count: other work competed for the CPU)"
        if max(load_start, load_end) > (os.cpu_count() or 1)
        else ""
    )
    print("CPU: the method's process (user+sys); server CPU / link CPU: the destination server's and the link's "
          f"processes while it ran. {os.cpu_count()} cores; load average at start / end "
          f"{load_start:.1f} / {load_end:.1f}{busy}")  # fmt: skip
    print(f"\nbenchmark wall time {time.monotonic() - bench_started:.0f} s")
    return targets.exit_status()


if __name__ == "__main__":
    sys.exit(main())
