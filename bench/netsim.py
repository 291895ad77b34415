"""A user-space TCP proxy that makes loopback behave like a cloud link, for benchmarks.

Each client connection gets its own upstream connection. Every chunk that crosses the proxy is held for
`one_way_delay_s` (so a request/response pair pays one round trip), and each connection's throughput is
capped at `bytes_per_second` per direction, the way a single stream to GCS or S3 tops out while parallel
streams add up. The kernel here has no netem, so this is the portable way to simulate both.

Two ways to run it:
- `SimulatedLink(...).start()`: an asyncio loop on a thread of the calling process. Simple, but it shares
  that process's GIL: a benchmark that also serves bytes from Python threads slows its own link down.
- `LinkProcess(...).start()` (or `python bench/netsim.py --upstream-port P [--delay-ms 10] [--rate-mb-s 25]`):
  the same proxy in a process of its own; it prints its port, runs until its stdin closes, then prints its
  counters as one JSON line. Use this when the link must not compete with the benchmark for the GIL.

Only 127.0.0.1 is ever bound or dialled by the proxy.

`KernelLink` is the same link made by the kernel instead, where network namespaces and the qdiscs are
allowed (root, CONFIG_NET_SCH_NETEM and CONFIG_NET_SCH_FQ): the server runs in a network namespace of its own,
reached over two veth pairs with addresses from 198.18.0.0/15 (RFC 2544's benchmarking range, host-local
here): one shaped (`netem delay` each way, and under it `fq maxrate`, which paces each flow, not the sum), one
not (what "no link" means for calibrations). It costs no user-space CPU. `KernelLink.start()` raises
`KernelLinkUnavailable` naming the command that failed and why; callers fall back to the proxy.

Behaviour worth knowing when reading results:
- Connection setup is free (the proxy accepts locally at once); a real link would add a round trip (plus TLS).
- Each direction keeps at most `buffer_bytes` in the proxy. The proxy stops reading from a sender while its
  buffer is full, so a fast client is held back by TCP flow control as on a real link, instead of the proxy
  swallowing a whole upload into memory. The default is large enough not to limit throughput
  (it must exceed rate x delay, the bytes "on the wire").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

CHUNK_BYTES = 256 * 1024
HOST = "127.0.0.1"


@dataclass
class LinkStats:
    connections: int = 0
    bytes_up: int = 0
    bytes_down: int = 0


def default_buffer_bytes(one_way_delay_s: float, bytes_per_second: float | None) -> int:
    """Per-direction buffer: well above what one delay holds at full speed, so it never limits the rate."""
    if bytes_per_second:
        return max(1024 * 1024, int(bytes_per_second * (one_way_delay_s + 0.1)))
    return 16 * 1024 * 1024


@dataclass
class SimulatedLink:
    upstream_host: str
    upstream_port: int
    one_way_delay_s: float = 0.010
    bytes_per_second: float | None = None
    buffer_bytes: int | None = None  # None: default_buffer_bytes()
    stats: LinkStats = field(default_factory=LinkStats)
    port: int = 0
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _server: asyncio.Server | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.upstream_host != HOST:
            raise ValueError(f"the simulated link only dials {HOST}, not {self.upstream_host!r}")

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, upward: bool) -> None:
        """Copy one direction until EOF, then half-close (the other direction may still be talking).

        Chunks are timestamped when read and released `one_way_delay_s` later, in order, so the delay is
        a latency (pipelined), not a pause per chunk. The rate cap then paces what is released.
        """
        limit = self.buffer_bytes or default_buffer_bytes(self.one_way_delay_s, self.bytes_per_second)
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        queued = 0
        room = asyncio.Event()
        room.set()

        async def receive() -> None:
            nonlocal queued
            while True:
                # Wait for room before reading (not after), so the timestamp is when the bytes left the
                # sender, and a full buffer pushes back on the sender through TCP flow control.
                while queued >= limit:
                    room.clear()
                    await room.wait()
                data = await reader.read(CHUNK_BYTES)
                queued += len(data)
                queue.put_nowait((time.monotonic(), data))
                if not data:
                    return

        async def send() -> None:
            nonlocal queued
            budget_start = time.monotonic()
            sent = 0
            while True:
                arrived, data = await queue.get()
                wait = arrived + self.one_way_delay_s - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not data:
                    break
                if self.bytes_per_second:
                    now = time.monotonic()
                    if budget_start + sent / self.bytes_per_second < now - 0.05:
                        budget_start, sent = now, 0  # idle time does not bank credit for a later burst
                    sent += len(data)
                    ahead = budget_start + sent / self.bytes_per_second - time.monotonic()
                    if ahead > 0:
                        await asyncio.sleep(ahead)
                if upward:
                    self.stats.bytes_up += len(data)
                else:
                    self.stats.bytes_down += len(data)
                writer.write(data)
                await writer.drain()
                queued -= len(data)
                room.set()
            if writer.can_write_eof():
                writer.write_eof()

        receiving = asyncio.ensure_future(receive())
        sending = asyncio.ensure_future(send())
        try:
            await asyncio.gather(receiving, sending)
        finally:
            receiving.cancel()  # if one side failed, the other must not wait forever
            sending.cancel()

    async def _handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)  # type: ignore[arg-type]
        self.stats.connections += 1
        upstream_writer: asyncio.StreamWriter | None = None
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(self.upstream_host, self.upstream_port)
            await asyncio.gather(
                self._pipe(client_reader, upstream_writer, upward=True),
                self._pipe(upstream_reader, client_writer, upward=False),
            )
        except (ConnectionError, OSError, asyncio.CancelledError):
            pass
        finally:
            # Both directions are done (or one failed): only now close both sockets. Closing one as soon as
            # its own direction ended would cut off a response still on its way to a half-closed client.
            for writer in (client_writer, upstream_writer):
                if writer is not None:
                    writer.close()
            self._tasks.discard(task)  # type: ignore[arg-type]

    def start(self) -> SimulatedLink:
        ready = threading.Event()
        failure: list[BaseException] = []

        def serve() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop

            async def begin() -> None:
                self._server = await asyncio.start_server(self._handle, HOST, 0)
                self.port = self._server.sockets[0].getsockname()[1]

            try:
                loop.run_until_complete(begin())
            except BaseException as error:  # noqa: BLE001 - reported to start()
                failure.append(error)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            # stop() ran: cancel the connections still open, then close the loop cleanly.
            for task in list(self._tasks):
                task.cancel()
            loop.run_until_complete(asyncio.sleep(0))
            pending = [task for task in asyncio.all_tasks(loop) if not task.done()]
            if pending:
                loop.run_until_complete(asyncio.wait(pending, timeout=2))
            loop.close()

        self._thread = threading.Thread(target=serve, name="netsim", daemon=True)
        self._thread.start()
        if not ready.wait(10) or failure:
            raise RuntimeError(f"the simulated link did not start: {failure[0] if failure else 'timeout'}")
        return self

    def stop(self) -> None:
        loop, server = self._loop, self._server
        if loop is not None and server is not None and not loop.is_closed():
            loop.call_soon_threadsafe(server.close)
            loop.call_soon_threadsafe(loop.stop)
        if self._thread:
            self._thread.join(5)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def __enter__(self) -> SimulatedLink:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class LinkProcess:
    """The same link in a child process (its own GIL); `stats` is filled in by stop()."""

    upstream_port: int
    one_way_delay_s: float = 0.010
    bytes_per_second: float | None = None
    stats: LinkStats = field(default_factory=LinkStats)
    port: int = 0
    _process: subprocess.Popen[str] | None = None

    def start(self) -> LinkProcess:
        argv = [
            sys.executable, os.path.abspath(__file__),
            "--upstream-port", str(self.upstream_port),
            "--delay-ms", repr(self.one_way_delay_s * 1000),
        ]  # fmt: skip
        if self.bytes_per_second:
            argv += ["--rate-mb-s", repr(self.bytes_per_second / 1e6)]
        self._process = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True
        )
        assert self._process.stdout is not None
        line = self._process.stdout.readline()
        if not line.strip().isdigit():
            self._process.kill()
            raise RuntimeError(f"the link process did not start (it printed {line!r})")
        self.port = int(line)
        return self

    def stop(self) -> None:
        process = self._process
        if process is None or process.poll() is not None:
            return
        try:
            output, _ = process.communicate(input="", timeout=15)  # closing stdin asks it to stop
            last = output.strip().splitlines()[-1] if output.strip() else "{}"
            self.stats = LinkStats(**json.loads(last))
        except (subprocess.TimeoutExpired, ValueError, TypeError):
            process.kill()
            process.wait()

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def pid(self) -> int:
        assert self._process is not None, "not started"
        return self._process.pid

    def __enter__(self) -> LinkProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class KernelLinkUnavailable(RuntimeError):
    """The kernel link could not be set up here; the message names the command that failed and why."""


KERNEL_SERVER_PORT = 9000  # the namespace is fresh: nothing else listens in it
_CONFIG_NAMES = ("CONFIG_NET_SCH_NETEM", "CONFIG_NET_SCH_FQ")


def _kernel_config(names: tuple[str, ...]) -> str:
    """How the running kernel was built for `names` (from /proc/config.gz), or '' when that is not readable."""
    import gzip

    try:
        text = gzip.decompress(Path("/proc/config.gz").read_bytes()).decode(errors="replace")
    except OSError:
        return ""
    found = []
    for name in names:
        match = [line for line in text.splitlines() if line.startswith(name + "=") or line == f"# {name} is not set"]
        found.append(match[0] if match else f"{name} absent")
    return "; kernel config: " + ", ".join(found)


@dataclass
class KernelLink:
    """The link made by the kernel: a network namespace for the server, a shaped and a direct veth pair.

    `wrap(argv)` runs a command inside the namespace; the server there listens on 0.0.0.0:`server_port`;
    `url` is the shaped way to it, `direct_url` the unshaped one. `stop()` removes all of it.
    """

    one_way_delay_s: float = 0.010
    bytes_per_second: float | None = None
    server_port: int = KERNEL_SERVER_PORT
    stats: LinkStats = field(default_factory=LinkStats)
    pid: int | None = None  # no process: the kernel does the work (its CPU is softirq time, charged to others)
    _created: list[list[str]] = field(default_factory=list)
    _tx_start: int = 0

    def __post_init__(self) -> None:
        tag = os.getpid()
        self.netns = f"streamctl-bench-{tag}"
        self.shaped_dev, self.direct_dev = f"sbl{tag}", f"sbd{tag}"
        block = 8 * (tag % 32)
        self._net = f"198.18.{(tag // 32) % 256}"
        self.host_address, self.server_address = f"{self._net}.{block + 1}", f"{self._net}.{block + 2}"
        self.direct_host_address, self.direct_address = f"{self._net}.{block + 5}", f"{self._net}.{block + 6}"

    @staticmethod
    def _run(argv: list[str]) -> None:
        try:
            completed = subprocess.run(argv, capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired) as error:
            raise KernelLinkUnavailable(f"`{' '.join(argv)}` failed: {error}") from error
        if completed.returncode != 0:
            why = (completed.stderr or completed.stdout).strip() or f"exit {completed.returncode}"
            raise KernelLinkUnavailable(f"`{' '.join(argv)}` failed: {why}")

    def _shape(self, netns: list[str], dev: str) -> None:
        delay_us = max(1, round(self.one_way_delay_s * 1e6))
        self._run(["tc", *netns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
                   "delay", f"{delay_us}us", "limit", "100000"])  # fmt: skip
        if self.bytes_per_second:
            self._run(["tc", *netns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", "fq",
                       "maxrate", f"{int(self.bytes_per_second * 8)}bit"])  # fmt: skip

    @staticmethod
    def remove_stale() -> None:
        """Remove what a killed earlier run left (its namespace is named after its pid, now gone)."""
        listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20)
        for line in listing.stdout.splitlines():
            name = line.split()[0] if line.split() else ""
            tag = name.removeprefix("streamctl-bench-")
            if tag != name and tag.isdigit() and not Path(f"/proc/{tag}").exists():
                for argv in (["ip", "link", "del", f"sbl{tag}"], ["ip", "link", "del", f"sbd{tag}"],
                             ["ip", "netns", "del", name]):  # fmt: skip
                    subprocess.run(argv, capture_output=True, timeout=20)

    def start(self) -> KernelLink:
        ns = ["-n", self.netns]
        try:
            self.remove_stale()
        except (OSError, subprocess.TimeoutExpired):
            pass  # no `ip` here: the first step below says so
        steps = [
            ["ip", "netns", "add", self.netns],
            ["ip", "link", "add", self.shaped_dev, "type", "veth", "peer", "name", "link0", "netns", self.netns],
            ["ip", "link", "add", self.direct_dev, "type", "veth", "peer", "name", "direct0", "netns", self.netns],
            ["ip", "addr", "add", f"{self.host_address}/30", "dev", self.shaped_dev],
            ["ip", "addr", "add", f"{self.direct_host_address}/30", "dev", self.direct_dev],
            ["ip", *ns, "addr", "add", f"{self.server_address}/30", "dev", "link0"],
            ["ip", *ns, "addr", "add", f"{self.direct_address}/30", "dev", "direct0"],
            *(["ip", *where, "link", "set", dev, "up"]
              for where, dev in (([], self.shaped_dev), ([], self.direct_dev), (ns, "link0"), (ns, "direct0"),
                                 (ns, "lo"))),
        ]  # fmt: skip
        try:
            for step in steps:
                self._run(step)
                self._created.append(step)
            try:
                self._shape([], self.shaped_dev)  # client -> server: uploads
                self._shape(ns, "link0")  # server -> client: responses, ACKs
            except KernelLinkUnavailable as error:
                raise KernelLinkUnavailable(f"{error}{_kernel_config(_CONFIG_NAMES)}") from None
        except BaseException:
            self.stop()
            raise
        self._tx_start = self._tx_bytes()
        return self

    def _tx_bytes(self) -> int:
        try:
            return int(Path(f"/sys/class/net/{self.shaped_dev}/statistics/tx_bytes").read_text())
        except (OSError, ValueError):
            return 0

    def wrap(self, argv: list[str]) -> list[str]:
        """`argv` run inside the server's namespace (`ip netns exec` execs it: the pid stays the command's)."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def stop(self) -> None:
        if not self._created:
            return
        self.stats = LinkStats(bytes_up=max(0, self._tx_bytes() - self._tx_start))
        for argv in (["ip", "link", "del", self.shaped_dev], ["ip", "link", "del", self.direct_dev],
                     ["ip", "netns", "del", self.netns]):  # fmt: skip
            subprocess.run(argv, capture_output=True, timeout=20)
        self._created.clear()

    @property
    def url(self) -> str:
        return f"http://{self.server_address}:{self.server_port}"

    @property
    def direct_url(self) -> str:
        return f"http://{self.direct_address}:{self.server_port}"

    def describe(self) -> str:
        rate = f"fq maxrate {self.bytes_per_second / 1e6:g} MB/s per flow" if self.bytes_per_second else "no cap"
        return (f"kernel (network namespace {self.netns}, veth, netem delay {self.one_way_delay_s * 1000:g} ms "
                f"each way, {rate})")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Simulated cloud link: a delaying, rate-capping TCP proxy.")
    parser.add_argument("--upstream-port", type=int, required=True, help=f"port on {HOST} to forward to")
    parser.add_argument("--delay-ms", type=float, default=10.0, help="one-way delay (a request pays twice this)")
    parser.add_argument("--rate-mb-s", type=float, default=None, help="per-connection cap, MB/s each way")
    args = parser.parse_args(argv)
    link = SimulatedLink(
        HOST,
        args.upstream_port,
        args.delay_ms / 1000,
        args.rate_mb_s * 1e6 if args.rate_mb_s else None,
    ).start()
    print(link.port, flush=True)
    sys.stdin.read()  # until the parent closes our stdin (or dies)
    link.stop()
    print(json.dumps(asdict(link.stats)), flush=True)


if __name__ == "__main__":
    main()
