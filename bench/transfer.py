"""Benchmark: `streamctl transfer hf://... gs://...` against the seed script's method, across a simulated link.

Method
------
- Source: a fake Hugging Face Hub (tests/fakehub.py) served from THIS process, holding a ~2 GiB repo: 4
  safetensors shards (valid headers; data = a 1 MiB random block repeated, one block per shard, so each shard
  has its own sha256) plus config, generation config, tokenizer (2 MB, a plain git file), tokenizer config,
  special tokens map, index, README.md and .gitattributes. The hub is local: both methods read it at loopback
  speed (as from the hub's CDN in-region); only the destination is behind the simulated link.
- Destination (default `--dest gs`): gcp-storage-emulator, in memory, started through bench/threaded_gcs.py.
  Stock, the emulator serves ONE request at a time, so behind a per-connection cap it is exactly as fast as
  one connection and parallelism cannot show; the patch serves connections on threads (request bodies move in
  parallel, its storage logic stays serialized) and composes as GCS does (linear, no MD5 for composite
  objects; stock compose copies quadratically). `--dest s3` uses moto instead (see below).
- Link: bench/netsim.py's proxy in its own process, capping EACH connection at `--rate-mb-s` (25 MB/s) and
  delaying each direction by `--delay-ms` (10 ms), as a single cloud stream tops out while parallel streams
  add up. The uncapped throughput of the destination server is measured first and printed, so the ratio can be
  read against what the server itself can take.
- Methods, each run as a SUBPROCESS so its peak RSS is its own (os.wait4's ru_maxrss; the hub's 2 GiB in
  this process is never counted), with its own HOME, HF_HOME and TMPDIR inside a watched scratch folder:
  (a) `python -m streamctl transfer hf://ORG/NAME gs://BUCKET/PREFIX --json` with its defaults (16 parts in
      flight, 16 MiB parts, 256 MiB buffer, sha256 checked, verify-index on the destination at the end);
  (b) the seed script (hf-2-gc.py): `snapshot_download(repo_id, local_dir=DIR, max_workers=10)`, then
      `os.walk(DIR)` and one `blob.upload_from_filename()` per file, one at a time, exactly as the seed does
      (so the .cache/huggingface/ files snapshot_download leaves in DIR are uploaded too). With `--dest s3`
      the upload is `boto3 upload_file()` per file with boto3's default TransferConfig, which already
      uploads 8 MiB parts on 10 threads: a stronger baseline than the seed's.
- Local disk: the growth of each method's scratch folder, polled every 0.1 s; HOME, XDG_CACHE_HOME, HF_HOME,
  TMPDIR (and the seed's DIR) all point inside it. The file system's free space is not used: on a shared
  machine other processes write to the same disk.

Reading the output
------------------
First the calibration: what the destination server takes with no link (one stream, and 16 streams of 16 MiB
like streamctl's parts), what one capped connection gives, and 16 capped connections. Then the two methods side
by side with wall time, throughput, peak RSS and peak local disk, and the speed-up (seed time / streamctl time).
Targets, each PASS/FAIL: >= 4x faster than the seed method; streamctl peak RSS <= 512 MiB; no local copy
(streamctl's disk growth <= 16 MiB). The bound lines say what each method could reach at best on this link:
the seed uploads one file at a time (one capped stream; 10 with boto3 on s3); streamctl min(concurrency x cap,
the 16-connection ceiling measured in the calibration). CPU columns: a 2-core machine running the server, the
link, the hub and the method at once is easily CPU-bound; the server's CPU is the first limit here.

Usage: python bench/transfer.py [--quick] [--size-gib 2] [--rate-mb-s 25] [--delay-ms 10] [--dest gs|s3]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import sys
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import benchlib
from benchlib import MB, ChildRun, GiB, MiB, Table, Targets, human_bytes
from netsim import LinkProcess

REPO_ID = "bench-org/llm-2g"
SHARDS = 4
PART = 16 * MiB  # streamctl's default part size, used for the calibration uploads
TARGET_SPEEDUP = 4.0
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


def start_destination(scheme: str, workdir: Path) -> Destination:
    if scheme == "gs":
        return Destination("gs", benchlib.start_threaded_gcs(workdir), "gcp-storage-emulator (threaded patch)")
    return Destination("s3", benchlib.servers.start_s3(workdir), "moto S3 server")


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


def calibrate(
    destination: Destination, link: LinkProcess, hub: Any, hub_files: dict[str, Any], quick: bool
) -> list[Rate]:
    """What the server takes without the link, what the link gives, and what the local hub serves."""
    bucket = destination.new_bucket()
    part = random.Random(7).randbytes(PART)
    direct, linked = destination.uploader(destination.server.endpoint), destination.uploader(link.url)
    parts = 8 if quick else 16
    single = 64 * MiB if quick else 256 * MiB
    rates = [
        timed_uploads(direct, bucket, f"server, no link, 1 stream of {single // MiB} MiB",
                      [part * (single // PART)], 1),  # fmt: skip
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
    if destination.scheme == "gs":  # free the emulator's memory
        for blob in list(destination.server.client().list_blobs(bucket)):
            blob.delete()
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


# --------------------------------------------------------------------------------------------- main


@dataclass
class MethodResult:
    name: str
    run: ChildRun
    files: int
    bytes: int
    detail: str
    server_cpu: float = 0.0  # CPU seconds the destination server spent while this method ran
    link_cpu: float = 0.0  # CPU seconds of the link process meanwhile


def measured(destination: Destination, link: LinkProcess, argv: list[str], env: dict[str, str],
             watch: Path) -> tuple[ChildRun, float, float]:  # fmt: skip
    """run_measured(), plus the CPU the server and the link burned meanwhile (a 2-core box is easily CPU-bound)."""
    pids = (destination.server.server.process.pid, link.pid)
    before = [benchlib.process_cpu_seconds(pid) for pid in pids]
    run = benchlib.run_measured(argv, env=env, watch=watch)
    server_cpu, link_cpu = (benchlib.process_cpu_seconds(pid) - start for pid, start in zip(pids, before, strict=True))
    return run, server_cpu, link_cpu


def method_env(base: dict[str, str], scratch: Path, extra: dict[str, str]) -> dict[str, str]:
    """HOME, XDG_CACHE_HOME, HF_HOME and TMPDIR all inside `scratch`, so any local write lands where it is watched."""
    folders = {"HOME": "home", "XDG_CACHE_HOME": "home/.cache", "HF_HOME": "hf-home", "TMPDIR": "tmp"}
    for folder in folders.values():
        (scratch / folder).mkdir(parents=True, exist_ok=True)
    return {**base, **{name: str(scratch / folder) for name, folder in folders.items()}, **extra}


def check_run(name: str, run: ChildRun) -> None:
    if run.returncode != 0:
        raise SystemExit(f"{name} failed (exit {run.returncode}):\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--seed-worker"]:
        return seed_worker(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: a 256 MiB repo")
    parser.add_argument("--size-gib", type=float, default=None, help="repo size (default 2, --quick 0.25)")
    parser.add_argument("--rate-mb-s", type=float, default=25.0, help="per-connection cap of the link, MB/s")
    parser.add_argument("--delay-ms", type=float, default=10.0, help="one-way delay of the link")
    parser.add_argument("--dest", choices=("gs", "s3"), default="gs", help="destination store (default gs)")
    parser.add_argument("--concurrency", type=int, default=16, help="streamctl -j (its default is 16)")
    args = parser.parse_args(argv)
    size = int((args.size_gib or (0.25 if args.quick else 2.0)) * GiB)
    bench_started = time.monotonic()
    load_start = os.getloadavg()[0]

    with benchlib.scratch_dir("streamctl-bench-transfer-") as scratch:
        benchlib.isolated_env(scratch)
        base_env = dict(os.environ)  # isolated now: no cloud or Hugging Face settings of whoever runs this
        from fakehub import FakeHub  # tests/fakehub.py

        generated = time.monotonic()
        files = build_repo(size)
        hub = FakeHub().start()
        hub_files = hub.add_repo(REPO_ID, files).files()
        repo_bytes = sum(len(data) for data in files.values())
        del files  # the hub holds the only copy
        generated_s = time.monotonic() - generated
        destination = start_destination(args.dest, scratch / "servers")
        link: LinkProcess | None = None
        try:
            link = LinkProcess(destination.server.server.port, args.delay_ms / 1000, args.rate_mb_s * MB).start()
            rates = calibrate(destination, link, hub, hub_files, args.quick)
            hub_env = {"HF_ENDPOINT": hub.endpoint, **destination.env(link.url)}

            bucket_a, bucket_b = destination.new_bucket(), destination.new_bucket()
            ours_dir = scratch / "streamctl"
            ours_run, ours_server_cpu, ours_link_cpu = measured(
                destination, link,
                [*benchlib.STREAMCTL, "transfer", f"hf://{REPO_ID}", f"{args.dest}://{bucket_a}/model",
                 "--json", "-j", str(args.concurrency)],
                method_env(base_env, ours_dir, hub_env), ours_dir,
            )  # fmt: skip
            check_run("streamctl transfer", ours_run)
            report = json.loads(ours_run.stdout)
            verify = report.get("verify") or {}
            mismatched = [f["path"] for f in report["files"] if f["sha256"] != hub_files[f["path"]].sha256]
            ours = MethodResult(
                "streamctl transfer (subprocess)", ours_run, len(report["files"]), report["bytes_copied"],
                f"copy {report['seconds']:.1f} s + plan/verify-index; verify ok={verify.get('ok')}; "
                f"sha256 vs hub: {'all match' if not mismatched else 'MISMATCH ' + ', '.join(mismatched)}",
                ours_server_cpu, ours_link_cpu,
            )  # fmt: skip

            seed_dir = scratch / "seed"
            seed_run, seed_server_cpu, seed_link_cpu = measured(
                destination, link,
                [sys.executable, str(Path(__file__).resolve()), "--seed-worker", "--repo", REPO_ID,
                 "--local-dir", str(seed_dir / "model"), "--dest", args.dest, "--bucket", bucket_b,
                 "--prefix", "model"],
                method_env(base_env, seed_dir, hub_env), seed_dir,
            )  # fmt: skip
            check_run("seed method", seed_run)
            phases = json.loads(seed_run.stdout.strip().splitlines()[-1])
            upload_call = "upload_from_filename" if args.dest == "gs" else "boto3 upload_file"
            seed = MethodResult(
                f"seed: snapshot_download + {upload_call}", seed_run, phases["files"], phases["bytes"],
                f"download {phases['download_s']:.1f} s, then upload {phases['upload_s']:.1f} s",
                seed_server_cpu, seed_link_cpu,
            )
            landed_a = destination.listing(bucket_a, "model")
            landed_b = destination.listing(bucket_b, "model")
        finally:
            if link is not None:
                link.stop()
            destination.server.server.stop()
            hub.stop()

    link_stats = link.stats if link else None
    print()
    print(f"transfer across a simulated link: {args.rate_mb_s:g} MB/s per connection, {args.delay_ms:g} ms one way; "
          f"destination {destination.label} ({args.dest}://)")  # fmt: skip
    print(f"repo {REPO_ID}: {human_bytes(repo_bytes)} ({repo_bytes / GiB:.2f} GiB) in {len(hub_files)} files, "
          f"{SHARDS} shards of {human_bytes(max(f.size for f in hub_files.values()))}; generated and hashed "
          f"into the in-process fake hub in {generated_s:.1f} s")  # fmt: skip
    print()
    calibration = Table(["calibration (uploads unless noted)", "bytes", "seconds", "MB/s"])
    for rate in rates:
        calibration.add(rate.label, human_bytes(rate.bytes), f"{rate.seconds:.2f}", f"{rate.mb_s:.0f}")
    calibration.print()
    print()
    cap = args.rate_mb_s
    ceiling = rates[3].mb_s
    # The seed uploads one file at a time: with upload_from_filename one stream; with boto3 upload_file
    # (--dest s3) up to 10 parts of 8 MiB of that file at once.
    seed_streams = 1 if args.dest == "gs" else 10
    seed_bound = phases["bytes"] / MB / min(seed_streams * cap, ceiling)
    ours_bound = repo_bytes / MB / min(args.concurrency * cap, ceiling)
    table = Table(["method", "wall", "x faster", "MB/s", "peak RSS", "peak local disk", "files", "bytes",
                   "CPU", "server CPU", "link CPU", "detail"])  # fmt: skip
    for result in (ours, seed):
        table.add(
            result.name, f"{result.run.seconds:.1f} s", f"{seed.run.seconds / result.run.seconds:.2f}x",
            f"{result.bytes / MB / result.run.seconds:.0f}", human_bytes(result.run.peak_rss),
            human_bytes(result.run.peak_disk), result.files, human_bytes(result.bytes),
            f"{result.run.cpu_s:.1f} s", f"{result.server_cpu:.1f} s", f"{result.link_cpu:.1f} s", result.detail,
        )  # fmt: skip
    table.print()
    print(f"bounds on this link: seed upload >= {seed_bound:.1f} s (one file at a time, {seed_streams} stream(s) of "
          f"{cap:g} MB/s, plus its download); streamctl >= {ours_bound:.1f} s (min({args.concurrency} x {cap:g}, "
          f"16-connection ceiling {ceiling:.0f}) MB/s)")  # fmt: skip
    print(f"landed: streamctl {len(landed_a)} objects / {human_bytes(sum(landed_a.values()))}; "
          f"seed {len(landed_b)} objects / {human_bytes(sum(landed_b.values()))}"
          + (f"; the link carried {human_bytes(link_stats.bytes_up)} up in {link_stats.connections} connections"
             if link_stats else ""))  # fmt: skip
    print()
    speedup = seed.run.seconds / ours.run.seconds
    targets = Targets()
    if args.quick:
        print("--quick: a smoke run. The targets are meant for the default 2 GiB: on a small repo streamctl's fixed "
              "costs (interpreter start, planning, verify-index: ~1 s) weigh more.")  # fmt: skip
    print(targets.check(speedup >= TARGET_SPEEDUP, f">= {TARGET_SPEEDUP:g}x faster than the seed method",
                  f"{speedup:.2f}x ({seed.run.seconds:.1f} s / {ours.run.seconds:.1f} s)"))  # fmt: skip
    print(targets.check(ours.run.peak_rss <= TARGET_RSS, "streamctl peak RSS <= 512 MiB",
                  f"{ours.run.peak_rss / MiB:.0f} MiB (seed method: {seed.run.peak_rss / MiB:.0f} MiB)"))  # fmt: skip
    print(targets.check(ours.run.peak_disk <= TARGET_DISK, "no local copy (streamctl disk growth <= 16 MiB)",
                  f"{human_bytes(ours.run.peak_disk)} under its HOME/HF_HOME/TMPDIR "
                  f"(seed method: {human_bytes(seed.run.peak_disk)})"))  # fmt: skip
    load_end = os.getloadavg()[0]
    contended = max(load_start, load_end) > (os.cpu_count() or 1)
    busy = " (above the core count: other work competed for the CPU)" if contended else ""
    print("CPU: the method's process (user+sys); server CPU / link CPU: the destination server's and the link's "
          f"processes while it ran. {os.cpu_count()} cores; load average at start / end "
          f"{load_start:.1f} / {load_end:.1f}{busy}")  # fmt: skip
    print(f"\nbenchmark wall time {time.monotonic() - bench_started:.0f} s")
    return targets.exit_status()


if __name__ == "__main__":
    sys.exit(main())
