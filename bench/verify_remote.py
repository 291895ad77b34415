"""Benchmark: `verify-index` on a 48-shard checkpoint in S3 across a simulated 20 ms link, against two baselines.

Method
------
- Store: moto's S3 server on 127.0.0.1 (tests/servers.py machinery), with bench/sparse_moto.py's two patches:
  objects are sparse files (a shard is its real size to every client while the disk holds only its header)
  and a ranged GET reads only its range, as real S3 does (stock moto reads the whole object for each one).
- Checkpoint: a Llama-3-70B-shaped model at REAL SIZE: 723 BF16 tensors with real names and shapes (~141 GB)
  in 48 shards of ~2.9 GB (~15 tensors, a ~1.8 kB header each), plus two shards that also carry ~1,150 tiny
  F32 scale tensors each (headers ~130 kB > the 100 kB first read, so the second read is exercised), the index,
  config.json, generation_config.json and tokenizer files. Tensor data is never written: holes read as zeros.
- Link: every request goes through bench/netsim.py's proxy (in its own process) that delays each direction by
  `--delay-ms` (10 ms: a request pays 20 ms); bandwidth is not capped. Connection setup costs no round trip.
- Methods, each with a fresh boto3 client (its construction is inside the timing), all through the link:
  * streamctl: `verify_checkpoint(open_location("s3://BUCKET", endpoint=link))`, the library call behind
    `streamctl verify-index`, at its default concurrency (16). Median of `--repeat` runs.
  * baseline B: list the bucket, then for each shard, one at a time, GET bytes 0-7 and then the header.
  * baseline A: list, then GET each shard whole, one at a time, and parse its header. Downloading 141 GB
    takes far too long, so A downloads `--whole-shards` shards and scales the time and bytes to all shards
    (marked "extrapolated"; the per-shard cost is bandwidth-bound and shards are equal in size, so this is linear).
  * floor: streamctl again, straight to moto without the link, to show what the server and client cost alone.
- Requests are counted twice: by the method itself and from moto's access log (the latter includes the listing).
  "wire bytes" is what the link carried from the server (HTTP headers included).

Reading the output
------------------
The table gives absolute figures (wall time, requests, bytes) and, in the last column, each method's wall time
divided by streamctl's: compare the ratios, machines are noisy. "ideal" is one round trip per wave of
`concurrency` shards: ceil(shards / concurrency) x RTT. The targets printed with PASS/FAIL:
bytes read <= 0.1% of the checkpoint; <= 2 requests per shard plus one each for the index and config.json;
wall time <= ideal + 5 RTT. The "link share" line subtracts the no-link floor, which isolates what the
round trips cost from what moto and boto3 cost on this 2-core machine.

Usage: python bench/verify_remote.py [--quick] [--delay-ms 10] [--concurrency 16] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import struct
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import benchlib
from benchlib import Table, Targets, human_bytes, ms
from netsim import LinkProcess

BUCKET = "bench-verify-70b"
SPECULATIVE_READ_BYTES = 100_000  # streamctl's first read per shard (and huggingface_hub's)


# --------------------------------------------------------------------------------------------- checkpoint


@dataclass(frozen=True)
class ModelShape:
    """Llama-3-70B: 80 layers, hidden 8192, MLP 28672, 8 KV heads of 128, vocabulary 128256, BF16."""

    layers: int = 80
    hidden: int = 8192
    intermediate: int = 28672
    kv_dim: int = 1024
    vocab: int = 128256


@dataclass(frozen=True)
class Shard:
    name: str
    prefix: bytes  # 8-byte length + header JSON (what is uploaded; the rest of the object is a hole)
    size: int  # the object's full size
    tensors: tuple[str, ...]

    @property
    def header_bytes(self) -> int:
        return len(self.prefix) - 8


@dataclass(frozen=True)
class Checkpoint:
    shards: tuple[Shard, ...]
    small_files: dict[str, bytes]  # index, config, tokenizer...

    @property
    def total_bytes(self) -> int:
        return sum(shard.size for shard in self.shards) + sum(len(data) for data in self.small_files.values())


def model_tensors(model: ModelShape) -> list[tuple[str, list[int]]]:
    """Every tensor of the model, in state-dict order (as transformers saves them)."""
    h, kv, mlp = model.hidden, model.kv_dim, model.intermediate
    tensors: list[tuple[str, list[int]]] = [("model.embed_tokens.weight", [model.vocab, h])]
    for layer in range(model.layers):
        p = f"model.layers.{layer}."
        tensors += [
            (p + "self_attn.q_proj.weight", [h, h]),
            (p + "self_attn.k_proj.weight", [kv, h]),
            (p + "self_attn.v_proj.weight", [kv, h]),
            (p + "self_attn.o_proj.weight", [h, h]),
            (p + "mlp.gate_proj.weight", [mlp, h]),
            (p + "mlp.up_proj.weight", [mlp, h]),
            (p + "mlp.down_proj.weight", [h, mlp]),
            (p + "input_layernorm.weight", [h]),
            (p + "post_attention_layernorm.weight", [h]),
        ]
    tensors += [("model.norm.weight", [h]), ("lm_head.weight", [model.vocab, h])]
    return tensors


def build_checkpoint(shard_count: int, big_header_shards: Sequence[int], experts: int = 384) -> Checkpoint:
    """Split the model into `shard_count` shards by bytes; the shards in `big_header_shards` (0-based) also get
    `experts` x 3 tiny F32 scale tensors, which pushes their headers past the 100 kB first read."""
    from streamctl.checkpoint.safetensors import encode_safetensors_header

    model = ModelShape()
    tensors = model_tensors(model)
    sizes = [math.prod(shape) * 2 for _, shape in tensors]  # BF16
    total = sum(sizes)
    groups: list[list[tuple[str, str, list[int], int]]] = [[] for _ in range(shard_count)]
    position = 0
    for (name, shape), size in zip(tensors, sizes, strict=True):
        middle = position + size / 2  # a tensor goes to the shard its middle byte falls in
        groups[min(shard_count - 1, int(middle * shard_count / total))].append((name, "BF16", shape, size))
        position += size
    if not all(groups):
        raise SystemExit(f"{shard_count} shards is too many for this model (a shard would be empty)")
    for shard_index in big_header_shards:
        first = groups[shard_index][0][0]
        layer = int(first.split(".")[2]) if first.startswith("model.layers.") else 0
        for expert in range(experts):
            for projection in ("gate_proj", "up_proj", "down_proj"):
                name = f"model.layers.{layer}.mlp.experts.{expert}.{projection}.weight_scale"
                groups[shard_index].append((name, "F32", [1], 4))
    shards: list[Shard] = []
    weight_map: dict[str, str] = {}
    for number, group in enumerate(groups, start=1):
        name = f"model-{number:05d}-of-{shard_count:05d}.safetensors"
        prefix, offsets = encode_safetensors_header(group, {"format": "pt"})
        shards.append(Shard(name, prefix, len(prefix) + offsets[-1][1], tuple(t[0] for t in group)))
        weight_map.update({tensor[0]: name for tensor in group})
    index = {"metadata": {"total_size": sum(t[3] for g in groups for t in g)}, "weight_map": weight_map}
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": model.hidden,
        "intermediate_size": model.intermediate, "num_hidden_layers": model.layers, "num_attention_heads": 64,
        "num_key_value_heads": 8, "vocab_size": model.vocab, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
    }  # fmt: skip
    small_files = {
        "model.safetensors.index.json": json.dumps(index, indent=2).encode(),
        "config.json": json.dumps(config, indent=2).encode(),
        "generation_config.json": b'{"bos_token_id": 128000, "eos_token_id": [128001, 128009]}',
        "tokenizer.json": json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {}}}).encode(),
        "tokenizer_config.json": b'{"tokenizer_class": "PreTrainedTokenizerFast"}',
        "special_tokens_map.json": b'{"bos_token": "<|begin_of_text|>"}',
    }
    return Checkpoint(tuple(shards), small_files)


def upload_checkpoint(client: Any, checkpoint: Checkpoint) -> None:
    """Shards as sparse objects (header uploaded, the rest a hole), small files as they are."""

    def put_shard(shard: Shard) -> None:
        client.put_object(
            Bucket=BUCKET, Key=shard.name, Body=shard.prefix, Metadata={"bench-sparse-size": str(shard.size)}
        )

    client.create_bucket(Bucket=BUCKET)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(put_shard, checkpoint.shards))
        list(pool.map(lambda item: client.put_object(Bucket=BUCKET, Key=item[0], Body=item[1]),
                      checkpoint.small_files.items()))  # fmt: skip


# --------------------------------------------------------------------------------------------- methods


@dataclass
class Measurement:
    method: str
    seconds: float
    requests: int  # as counted by the method
    server_requests: int  # from moto's access log (listing included)
    bytes_read: int  # payload bytes the method received
    wire_bytes: int  # bytes the link carried from the server (HTTP included); 0 without the link
    tensors: int
    client_cpu: float = 0.0  # CPU seconds of this benchmark process (where the method runs) during the run
    server_cpu: float = 0.0  # CPU seconds of the moto process during the run
    note: str = ""


def boto3_client(endpoint: str) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.session.Session().client(
        "s3", endpoint_url=endpoint, config=Config(max_pool_connections=64, s3={"addressing_style": "path"})
    )


def list_shards(client: Any) -> list[tuple[str, int]]:
    listing = client.list_objects_v2(Bucket=BUCKET)
    return [(item["Key"], item["Size"]) for item in listing["Contents"] if item["Key"].endswith(".safetensors")]


def run_streamctl(endpoint: str, concurrency: int) -> tuple[float, int, int, int, bool, list[str]]:
    from streamctl.storage import StorageOptions, open_location
    from streamctl.verify.report import VerifyOptions
    from streamctl.verify.run import verify_checkpoint

    started = time.monotonic()
    location = open_location(f"s3://{BUCKET}", StorageOptions(endpoint_url=endpoint, path_style=True))
    report = verify_checkpoint(location, VerifyOptions(concurrency=concurrency))
    seconds = time.monotonic() - started
    problems = [f"{f.severity} {f.code} {f.file}: {f.message}" for f in report.findings]
    return seconds, report.stats.requests, report.stats.bytes_read, report.stats.tensors, report.ok, problems


def time_client_construction(endpoint: str) -> float:
    """Seconds to build a boto3 S3 client and send its first request (botocore loads its models lazily)."""
    started = time.monotonic()
    client = boto3_client(endpoint)
    client.head_bucket(Bucket=BUCKET)
    return time.monotonic() - started


def run_baseline_b(endpoint: str) -> tuple[float, int, int, int]:
    """List, then per shard, sequentially: GET bytes 0-7, GET the header; parse it."""
    started = time.monotonic()
    client = boto3_client(endpoint)
    requests, bytes_read, tensors = 1, 0, 0
    for key, _ in list_shards(client):
        head = client.get_object(Bucket=BUCKET, Key=key, Range="bytes=0-7")["Body"].read()
        (length,) = struct.unpack("<Q", head)
        body = client.get_object(Bucket=BUCKET, Key=key, Range=f"bytes=8-{8 + length - 1}")["Body"].read()
        tensors += len([name for name in json.loads(body) if name != "__metadata__"])
        requests += 2
        bytes_read += len(head) + len(body)
    return time.monotonic() - started, requests, bytes_read, tensors


def run_baseline_a(endpoint: str, shard_limit: int) -> tuple[float, int, int, int, int]:
    """List, then GET whole shards one at a time (the first `shard_limit`), parsing each header from the
    downloaded bytes. Returns (seconds, requests, bytes, tensors, shards downloaded)."""
    started = time.monotonic()
    client = boto3_client(endpoint)
    requests, bytes_read, tensors = 1, 0, 0
    shards = list_shards(client)[:shard_limit]
    for key, size in shards:
        response = client.get_object(Bucket=BUCKET, Key=key)
        requests += 1
        head = b""
        received = 0
        for chunk in response["Body"].iter_chunks(8 * benchlib.MiB):
            received += len(chunk)
            if len(head) < 8 or len(head) < 8 + struct.unpack("<Q", head[:8])[0]:
                head += chunk[: 4 * benchlib.MiB]  # the header is at the front; the rest is only counted
        if received != size:
            raise RuntimeError(f"{key}: downloaded {received} of {size} bytes")
        (length,) = struct.unpack("<Q", head[:8])
        tensors += len([name for name in json.loads(head[8 : 8 + length]) if name != "__metadata__"])
        bytes_read += received
    return time.monotonic() - started, requests, bytes_read, tensors, len(shards)


# --------------------------------------------------------------------------------------------- main

Run = Callable[[str], tuple[float, int, int, int]]  # endpoint -> (seconds, requests, bytes read, tensors)


def measure(name: str, server: Any, run: Run, delay_s: float | None) -> Measurement:
    """One run of `run`: through a fresh link process (so its counters are this run's alone), or straight to
    the server when `delay_s` is None."""
    log_before = benchlib.count_log_requests(server.server)
    pid = server.server.process.pid
    wire = 0
    cpu_before, server_before = benchlib.own_cpu_seconds(), benchlib.process_cpu_seconds(pid)
    if delay_s is None:
        seconds, requests, bytes_read, tensors = run(server.endpoint)
    else:
        with LinkProcess(server.server.port, one_way_delay_s=delay_s) as link:
            seconds, requests, bytes_read, tensors = run(link.url)
        wire = link.stats.bytes_down
    cpu, server_cpu = benchlib.own_cpu_seconds() - cpu_before, benchlib.process_cpu_seconds(pid) - server_before
    time.sleep(0.2)  # let the access log catch up
    server_requests = benchlib.count_log_requests(server.server) - log_before
    return Measurement(name, seconds, requests, server_requests, bytes_read, wire, tensors, cpu, server_cpu)


def median_of(repeat: int, name: str, server: Any, run: Run, delay_s: float | None) -> Measurement:
    samples = sorted((measure(name, server, run, delay_s) for _ in range(repeat)), key=lambda m: m.seconds)
    chosen = samples[len(samples) // 2]
    if repeat > 1:
        chosen.note = f"median of {repeat}: {', '.join(ms(sample.seconds) for sample in samples)}"
    return chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 repeat, 1 whole shard for baseline A")
    parser.add_argument("--shards", type=int, default=48)
    parser.add_argument("--delay-ms", type=float, default=10.0, help="one-way delay; a request pays twice this")
    parser.add_argument("--concurrency", type=int, default=16, help="streamctl's parallel header reads")
    parser.add_argument("--repeat", type=int, default=None, help="runs of streamctl and baseline B (median)")
    parser.add_argument("--whole-shards", type=int, default=None, help="shards baseline A downloads whole")
    parser.add_argument("--slope-delay-ms", type=float, default=50.0,
                        help="a second one-way delay for streamctl: the slope of wall time against RTT counts the "
                             "round trips on its critical path (0 to skip)")  # fmt: skip
    args = parser.parse_args(argv)
    repeat = args.repeat or (1 if args.quick else 3)
    whole_shards = max(1, min(args.shards, args.whole_shards or (1 if args.quick else 3)))
    delay_s = args.delay_ms / 1000
    rtt = 2 * delay_s
    bench_started = time.monotonic()
    load_start = os.getloadavg()[0]

    def streamctl(endpoint: str) -> tuple[float, int, int, int]:
        seconds, requests, bytes_read, tensors, ok, problems = run_streamctl(endpoint, args.concurrency)
        if not ok:
            print("streamctl reported errors:\n  " + "\n  ".join(problems[:10]), file=sys.stderr)
        return seconds, requests, bytes_read, tensors

    whole: list[int] = []

    def baseline_a(endpoint: str) -> tuple[float, int, int, int]:
        seconds, requests, bytes_read, tensors, count = run_baseline_a(endpoint, whole_shards)
        whole.append(count)
        return seconds, requests, bytes_read, tensors

    with benchlib.scratch_dir("streamctl-bench-verify-") as scratch:
        benchlib.isolated_env(scratch)
        checkpoint = build_checkpoint(args.shards, big_header_shards=(args.shards // 2 - 1, args.shards - 1))
        server = benchlib.start_sparse_s3(scratch / "servers")
        try:
            import boto3
            from botocore.config import Config

            created = time.monotonic()
            uploader = boto3.session.Session().client(
                "s3", endpoint_url=server.endpoint,
                config=Config(request_checksum_calculation="when_required", s3={"addressing_style": "path"}),
            )  # fmt: skip
            upload_checkpoint(uploader, checkpoint)
            creation_s = time.monotonic() - created
            run_streamctl(server.endpoint, args.concurrency)  # warm-up: imports, first connections
            floor = median_of(repeat, "streamctl, no link (floor)", server, streamctl, None)
            ours = median_of(repeat, "streamctl verify-index", server, streamctl, delay_s)
            slow = None
            if args.slope_delay_ms > 0:
                slow = median_of(repeat, f"streamctl, {args.slope_delay_ms:g} ms one way", server, streamctl,
                                 args.slope_delay_ms / 1000)  # fmt: skip
            construction = statistics.median(time_client_construction(server.endpoint) for _ in range(3))
            sequential = median_of(repeat, "baseline B: sequential ranged GETs", server, run_baseline_b, delay_s)
            downloads = measure("baseline A: whole shards, sequential", server, baseline_a, delay_s)
        finally:
            server.server.stop()

    shards = args.shards
    # Whole downloads are bandwidth-bound: scale time, bytes and CPU by bytes, requests by shard count.
    shard_bytes = sum(shard.size for shard in checkpoint.shards)
    scale = shard_bytes / downloads.bytes_read
    downloads.note = (
        f"extrapolated x{scale:.1f} (by bytes) from {whole[0]} whole shard(s) = "
        f"{human_bytes(downloads.bytes_read)} in {downloads.seconds:.1f} s"
    )
    downloads.seconds *= scale
    downloads.client_cpu *= scale
    downloads.server_cpu *= scale
    for attribute in ("requests", "server_requests"):
        setattr(downloads, attribute, round(1 + (getattr(downloads, attribute) - 1) * shards / whole[0]))
    downloads.bytes_read = round(downloads.bytes_read * scale)
    downloads.wire_bytes = round(downloads.wire_bytes * scale)
    downloads.tensors = -1  # only the downloaded shards were parsed
    ideal = math.ceil(shards / args.concurrency) * rtt
    header_sizes = [shard.header_bytes for shard in checkpoint.shards]
    big_headers = sum(size > SPECULATIVE_READ_BYTES for size in header_sizes)
    tensor_count = sum(len(shard.tensors) for shard in checkpoint.shards)

    print()
    print(f"verify-index across a simulated link: {shards} shards, {args.delay_ms:g} ms one way = RTT {ms(rtt)}, "
          f"streamctl concurrency {args.concurrency}, repeats {repeat}")  # fmt: skip
    print(f"checkpoint: REAL SIZE, sparse objects in patched moto: {human_bytes(checkpoint.total_bytes)}, "
          f"{shards} shards of ~{human_bytes(checkpoint.shards[0].size)}, {tensor_count} tensors; "
          f"headers {min(header_sizes):,}.."
          f"{max(header_sizes):,} bytes (median {int(statistics.median(header_sizes)):,}; {big_headers} over 100 kB); "
          f"bucket created in {creation_s:.1f} s")  # fmt: skip
    print()
    table = Table(["method", "wall", "x streamctl", "requests", "server reqs", "bytes read", "wire bytes",
                   "tensors", "client CPU", "moto CPU", "note"])  # fmt: skip
    for row in (ours, sequential, downloads, floor, *([slow] if slow else [])):
        table.add(
            row.method, ms(row.seconds), f"{row.seconds / ours.seconds:.2f}x", row.requests, row.server_requests,
            human_bytes(row.bytes_read), human_bytes(row.wire_bytes) if row.wire_bytes else "-",
            row.tensors if row.tensors >= 0 else "-", ms(row.client_cpu), ms(row.server_cpu), row.note,
        )  # fmt: skip
    table.add(f"ideal: ceil({shards}/{args.concurrency}) x RTT", ms(ideal), f"{ideal / ours.seconds:.2f}x", *[""] * 8)
    table.print()
    print("requests: counted by the method (streamctl: its ranged reads, listing excluded); server reqs: moto's "
          "access log (listing included); wire bytes: what the link carried downstream, HTTP included;\n"
          "client CPU: this process (boto3 + streamctl, user+sys); moto CPU: the server process")  # fmt: skip
    print()
    allowed = 2 * shards + 2  # + index + config.json
    targets = Targets()
    budget = ideal + 5 * rtt
    link_share = ours.seconds - floor.seconds
    print(targets.check(ours.bytes_read <= 0.001 * checkpoint.total_bytes, "bytes read <= 0.1% of checkpoint",
                  f"{human_bytes(ours.bytes_read)} = {100 * ours.bytes_read / checkpoint.total_bytes:.4f}% of "
                  f"{human_bytes(checkpoint.total_bytes)}"))  # fmt: skip
    print(targets.check(ours.requests <= allowed, "<= 2 requests per shard (+ index, config)",
                  f"{ours.requests} = {ours.requests / shards:.2f}/shard, allowed {allowed}; "
                  f"{ours.server_requests} at the server with the listing"))  # fmt: skip
    print(targets.check(ours.seconds <= budget, "wall time within 5 RTT of ideal",
                  f"{ms(ours.seconds)} vs ideal {ms(ideal)} + 5 RTT = {ms(budget)} "
                  f"({(ours.seconds - ideal) / rtt:+.1f} RTT from ideal)"))  # fmt: skip
    print(f"      where the time goes: boto3 client construction + first request {ms(construction)} (in every "
          f"method's wall); no-link floor {ms(floor.seconds)}; wall - floor = {ms(link_share)} = "
          f"{link_share / rtt:.1f} RTT")  # fmt: skip
    if slow is not None:
        slow_rtt = 2 * args.slope_delay_ms / 1000
        round_trips = (slow.seconds - ours.seconds) / (slow_rtt - rtt)
        waves = math.ceil(shards / args.concurrency)
        print(targets.check(round_trips <= waves + 5, "critical path within 5 round trips of the header waves",
                            f"{round_trips:.1f} round trips (slope of wall time from RTT {ms(rtt)} to "
                            f"{ms(slow_rtt)}: {ms(ours.seconds)} -> {ms(slow.seconds)}); ideal {waves} header "
                            f"waves + 5 allowed = {waves + 5}"))  # fmt: skip
    print(
        f"\n{os.cpu_count()} cores; load average at start / end {load_start:.1f} / {os.getloadavg()[0]:.1f}; "
        f"benchmark wall time {time.monotonic() - bench_started:.0f} s"
    )
    return targets.exit_status()


if __name__ == "__main__":
    sys.exit(main())
