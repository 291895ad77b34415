"""Benchmark: how fast streamctl starts, and how long `serve`'s pre-flight takes on a 48-shard bucket.

Method
------
- Start-up: each command runs `--runs` times as a fresh process (the installed `streamctl` console script,
  as users run it); the median is reported next to a bare `python -c pass` from the same interpreter, in
  the same run. `serve --dry-run --no-preflight` builds a launch line without touching storage.
- Pre-flight: the 70B-shaped, 48-shard checkpoint of bench/verify_remote.py in moto's S3 server (sparse
  objects), reached through bench/netsim.py's link with 10 ms each way (20 ms per request). `serve --json`
  (pre-flight on) is timed against `serve --json --no-preflight`; the difference is the pre-flight. The
  ideal is one round trip per wave of 16 parallel header reads: ceil(48 / 16) x RTT.

Targets: `--help` of every command <= 150 ms over bare Python; pre-flight within 5 round trips of the ideal.
Exit status: 0 when every target is met, 1 when one is missed.
Usage: python bench/startup.py [--quick] [--runs 15]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import benchlib
from benchlib import Table, Targets, ms
from netsim import LinkProcess
from verify_remote import BUCKET, build_checkpoint, upload_checkpoint

STREAMCTL_BIN = str(Path(sys.executable).with_name("streamctl"))
HELP_COMMANDS = ("transfer", "verify-index", "shard", "serve")


def median_wall(argv: list[str], runs: int, env: dict[str, str] | None = None) -> float:
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        completed = subprocess.run(argv, capture_output=True, env=env, stdin=subprocess.DEVNULL)
        samples.append(time.perf_counter() - started)
        if completed.returncode != 0:
            raise RuntimeError(f"{argv} failed: {completed.stderr.decode()[-500:]}")
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="fewer runs, a 16-shard checkpoint")
    parser.add_argument("--runs", type=int, default=None)
    parser.add_argument("--delay-ms", type=float, default=10.0)
    args = parser.parse_args(argv)
    runs = args.runs or (5 if args.quick else 15)
    shards = 16 if args.quick else 48
    rtt = 2 * args.delay_ms / 1000
    results: list[str] = []
    targets = Targets()
    with benchlib.scratch_dir("streamctl-bench-startup-") as scratch:
        env = {**os.environ, **benchlib.isolated_env(scratch)}
        model = scratch / "model"
        subprocess.run(
            [sys.executable, "-c", "import sys; from streamctl.demo import build_demo_checkpoint as b; "
             "from streamctl.storage import open_location as o; b(o(sys.argv[1]))", str(model)],
            check=True,
        )  # fmt: skip
        bare = median_wall([sys.executable, "-c", "pass"], runs)
        timings = {
            "python -c pass": bare,
            "streamctl --help": median_wall([STREAMCTL_BIN, "--help"], runs),
            **{
                f"streamctl {command} --help": median_wall([STREAMCTL_BIN, command, "--help"], runs)
                for command in HELP_COMMANDS
            },
            "streamctl serve --dry-run --no-preflight": median_wall(
                [STREAMCTL_BIN, "serve", str(model), "--dry-run", "--no-preflight"], runs
            ),
            "streamctl serve --dry-run (local pre-flight)": median_wall(
                [STREAMCTL_BIN, "serve", str(model), "--dry-run"], runs
            ),
        }
        table = Table(["command", "median wall", "over bare python"])
        for name, seconds in timings.items():
            table.add(name, ms(seconds), ms(seconds - bare))
        print(f"start-up, median of {runs} fresh processes")
        print(table.render())
        helps = {name: seconds - bare for name, seconds in timings.items() if name.endswith("--help")}
        slowest = max(helps, key=helps.__getitem__)
        results.append(
            targets.check(
                helps[slowest] <= 0.150,
                "every command's --help <= 150 ms over bare Python",
                f"slowest: {slowest}, {ms(helps[slowest])} over",
            )
        )

        checkpoint = build_checkpoint(shards, big_header_shards=(shards - 1,))
        server = benchlib.start_sparse_s3(scratch / "servers")
        try:
            import boto3
            from botocore.config import Config

            uploader = boto3.session.Session().client(
                "s3", endpoint_url=server.endpoint,
                config=Config(request_checksum_calculation="when_required", s3={"addressing_style": "path"}),
            )  # fmt: skip
            upload_checkpoint(uploader, checkpoint)
            url = f"s3://{BUCKET}"
            preflight_runs = max(3, runs // 3)
            direct = {**env, "AWS_ENDPOINT_URL": server.endpoint}
            # The same pre-flight straight to moto: what boto3's import, client set-up and both sides' CPU cost.
            floor = median_wall([STREAMCTL_BIN, "serve", url, "--json"], preflight_runs, direct)
            with LinkProcess(server.server.port, one_way_delay_s=args.delay_ms / 1000) as link:
                linked = {**env, "AWS_ENDPOINT_URL": link.url}
                with_check = median_wall([STREAMCTL_BIN, "serve", url, "--json"], preflight_runs, linked)
                without = median_wall([STREAMCTL_BIN, "serve", url, "--json", "--no-preflight"], preflight_runs, linked)
        finally:
            server.server.stop()
    preflight = with_check - without
    ideal = math.ceil(shards / 16) * rtt
    table = Table(["serve on s3:// through the link", "median wall"])
    table.add(f"--json (pre-flight on {shards} shards)", ms(with_check))
    table.add("--json --no-preflight", ms(without))
    table.add("pre-flight alone (difference)", ms(preflight))
    table.add("--json, no link (CPU floor)", ms(floor))
    table.add("link share (with link - no link)", ms(with_check - floor))
    table.add(f"ideal: ceil({shards}/16) x RTT {ms(rtt)}", ms(ideal))
    print()
    print(table.render())
    results.append(
        targets.check(
            preflight <= ideal + 5 * rtt,
            "pre-flight within 5 round trips of the ideal",
            f"{ms(preflight)} vs {ms(ideal)} + 5 x {ms(rtt)} = {ms(ideal + 5 * rtt)} "
            f"({(preflight - ideal) / rtt:+.1f} RTT from ideal)",
        )
    )
    link_share = with_check - floor
    results.append(
        targets.check(
            link_share <= ideal + 5 * rtt,
            "round trips the pre-flight waits for, within 5 of the ideal",
            f"{ms(link_share)} = {link_share / rtt:.1f} RTT vs ideal {ideal / rtt:.0f} + 5",
        )
    )
    print()
    print("\n".join(results))
    print(f"{os.cpu_count()} cores; load average {os.getloadavg()[0]:.1f}")
    return targets.exit_status()


if __name__ == "__main__":
    sys.exit(main())
