"""A user-space TCP proxy that makes loopback behave like a cloud link, for benchmarks.

Each client connection gets its own upstream connection. Every chunk that crosses the proxy is held for
`one_way_delay_s` (so a request/response pair pays one round trip), and each connection's throughput is
capped at `bytes_per_second` per direction, the way a single stream to GCS or S3 tops out while parallel
streams add up. The kernel here has no netem, so this is the portable way to simulate both.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field


@dataclass
class LinkStats:
    connections: int = 0
    bytes_up: int = 0
    bytes_down: int = 0


@dataclass
class SimulatedLink:
    upstream_host: str
    upstream_port: int
    one_way_delay_s: float = 0.010
    bytes_per_second: float | None = None
    stats: LinkStats = field(default_factory=LinkStats)
    port: int = 0
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _server: asyncio.base_events.Server | None = None

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, upward: bool) -> None:
        # Chunks are timestamped on arrival and released `one_way_delay_s` later, in order, so the delay
        # is a latency (pipelined), not a pause per chunk.
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def receive() -> None:
            while True:
                data = await reader.read(256 * 1024)
                await queue.put((time.monotonic(), data))
                if not data:
                    return

        async def send() -> None:
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
                    sent += len(data)
                    ahead = budget_start + sent / self.bytes_per_second - time.monotonic()
                    if ahead > 0:
                        await asyncio.sleep(ahead)
                    elif ahead < -0.05:  # idle time does not bank credit for a later burst
                        budget_start, sent = time.monotonic(), 0
                if upward:
                    self.stats.bytes_up += len(data)
                else:
                    self.stats.bytes_down += len(data)
                writer.write(data)
                await writer.drain()
            try:
                writer.write_eof()
            except (OSError, RuntimeError):
                pass

        try:
            await asyncio.gather(receive(), send())
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def _handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self.stats.connections += 1
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(self.upstream_host, self.upstream_port)
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(
            self._pipe(client_reader, upstream_writer, upward=True),
            self._pipe(upstream_reader, client_writer, upward=False),
        )

    def start(self) -> SimulatedLink:
        ready = threading.Event()

        def serve() -> None:
            self._loop = asyncio.new_event_loop()

            async def begin() -> None:
                self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
                self.port = self._server.sockets[0].getsockname()[1]
                ready.set()

            self._loop.run_until_complete(begin())
            self._loop.run_forever()

        self._thread = threading.Thread(target=serve, daemon=True)
        self._thread.start()
        ready.wait(10)
        return self

    def stop(self) -> None:
        if self._loop and self._server:
            self._loop.call_soon_threadsafe(self._server.close)
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread:
            self._thread.join(5)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"
