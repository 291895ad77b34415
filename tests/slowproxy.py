"""An HTTP proxy on 127.0.0.1 that answers chosen requests slowly, or never, in front of a real test server.

Every request goes upstream on a connection of its own (the proxy asks for `Connection: close`), so each
request can be judged by its method and path. A matching request gets one of these answers:
  "silent"      the connection is accepted and the request read, but nothing is ever answered;
  "slow_head"   the upstream answer, from its first byte, one byte every `interval_s`;
  "dribble"     the upstream headers at once, then the body one byte every `interval_s`;
  "steady"      the upstream answer at `rate_bps` bytes per second, in small even steps (slow but healthy);
  "cut"         the upstream headers and the first `cut_bytes` of the body at once, then the connection shut
                down and reset, as a load balancer dropping it mid-body;
  "throttle"    `status` with `answer_headers` (a Retry-After, a RateLimit) and `answer_body`, never sent
                upstream, as a rate-limiting front end;
  "no_range"    sent upstream without its Range header (a CDN or S3-compatible server that ignores Range
                answers 200 with the whole object); `sent` counts the body bytes handed to the client.
Only the first `max_hits` matching requests (all when None) are treated so; other requests are passed
through unchanged.
"""

from __future__ import annotations

import re
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

Match = Callable[[str, str], bool]  # (method, path with query) -> whether to slow this request down


def _read_head(sock: socket.socket) -> tuple[bytes, bytes]:
    """(head including the blank line, bytes already read past it); empty head when the peer closed."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return b"", data
        data += chunk
    end = data.index(b"\r\n\r\n") + 4
    return data[:end], data[end:]


def _with_connection_close(head: bytes) -> bytes:
    lines = [line for line in head[:-4].split(b"\r\n") if not line.lower().startswith(b"connection:")]
    return b"\r\n".join([*lines, b"Connection: close"]) + b"\r\n\r\n"


def _content_length(head: bytes) -> int | None:
    match = re.search(rb"\r\ncontent-length:\s*(\d+)", head, re.IGNORECASE)
    return int(match.group(1)) if match else None


@dataclass
class SlowProxy:
    upstream_port: int
    match: Match
    mode: str = "dribble"
    interval_s: float = 0.5
    rate_bps: int = 256 * 1024
    cut_bytes: int = 64 * 1024
    status: int = 503
    answer_headers: tuple[tuple[str, str], ...] = ()
    answer_body: bytes = b""
    max_hits: int | None = None
    sent: int = 0  # "no_range": body bytes sent to clients
    port: int = 0
    hits: int = 0  # requests answered slowly (or not at all)
    requests: int = 0
    _listener: socket.socket | None = None
    _stopped: threading.Event = field(default_factory=threading.Event)
    _sockets: list[socket.socket] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> SlowProxy:
        assert self.mode in ("silent", "slow_head", "dribble", "steady", "cut", "throttle", "no_range"), self.mode
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            for sock in self._sockets:
                try:
                    sock.close()
                except OSError:
                    pass

    def __enter__(self) -> SlowProxy:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self._sockets.append(client)
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        upstream: socket.socket | None = None
        try:
            head, rest = _read_head(client)
            if not head:
                return
            method, target = head.split(b" ", 2)[:2]
            slow = self.match(method.decode(), target.decode())
            with self._lock:
                slow = slow and (self.max_hits is None or self.hits < self.max_hits)
                self.requests += 1
                self.hits += int(slow)
            if slow and self.mode == "throttle":
                self._throttle(client)
                return
            if slow and self.mode == "no_range":
                head = re.sub(rb"\r\n(x-ms-)?range:[^\r]*", b"", head, flags=re.IGNORECASE)
            if slow and self.mode == "silent":
                while not self._stopped.is_set() and client.recv(65536):
                    pass  # read the request (and its body) forever; answer nothing
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            with self._lock:
                self._sockets.append(upstream)
            upstream.sendall(_with_connection_close(head) + rest)
            threading.Thread(target=self._pump_request, args=(client, upstream), daemon=True).start()
            if not slow:
                while data := upstream.recv(65536):
                    client.sendall(data)
                return
            answer_head, body = _read_head(upstream)
            length = _content_length(answer_head)
            while (length is None or len(body) < length) and (data := upstream.recv(65536)):
                body += data
            if self.mode == "dribble":
                client.sendall(answer_head)
                self._trickle(client, body, 1, self.interval_s)
            elif self.mode == "cut":
                client.sendall(answer_head + body[: self.cut_bytes])
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                # Now, not at close(): the request pump's recv on this socket would hold it open until then.
                client.shutdown(socket.SHUT_RDWR)
            elif self.mode == "slow_head":
                self._trickle(client, answer_head + body, 1, self.interval_s)
            elif self.mode == "no_range":
                self._count_out(client, answer_head, body)
            else:  # steady
                step = max(1, self.rate_bps // 50)
                self._trickle(client, answer_head + body, step, step / self.rate_bps)
        except OSError:
            pass
        finally:
            for sock in (client, upstream):
                if sock is not None:
                    try:
                        sock.close()
                    except OSError:
                        pass

    def _throttle(self, client: socket.socket) -> None:
        lines = [f"HTTP/1.1 {self.status} Throttled", *(f"{k}: {v}" for k, v in self.answer_headers)]
        lines += [f"Content-Length: {len(self.answer_body)}", "Connection: close"]
        client.sendall("\r\n".join(lines).encode() + b"\r\n\r\n" + self.answer_body)
        client.shutdown(socket.SHUT_WR)
        while client.recv(65536):
            pass  # the client's request body, if any, until it closes

    def _count_out(self, client: socket.socket, head: bytes, body: bytes) -> None:
        """The answer in 64 KiB steps through a small send buffer, counting the body bytes the client took."""
        client.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
        client.sendall(head)
        for offset in range(0, len(body), 64 * 1024):
            piece = body[offset : offset + 64 * 1024]
            client.sendall(piece)
            with self._lock:
                self.sent += len(piece)

    def _trickle(self, client: socket.socket, data: bytes, step: int, interval_s: float) -> None:
        started = time.monotonic()
        for index, offset in enumerate(range(0, len(data), step)):
            # Paced against the start, so the average rate holds however late the thread wakes.
            if self._stopped.wait(max(0.0, started + index * interval_s - time.monotonic())):
                return
            client.sendall(data[offset : offset + step])

    @staticmethod
    def _pump_request(client: socket.socket, upstream: socket.socket) -> None:
        try:
            while data := client.recv(65536):
                upstream.sendall(data)
        except OSError:
            pass
