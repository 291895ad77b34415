"""A TCP proxy that breaks some connections on purpose: a 503 instead of an answer, or a reset mid-stream.

Faults are chosen by connection number, so a test gets the same faults on every run. A 503 is sent as
soon as the request head has arrived (the body is not read: the client may also see a broken pipe, as
with a real overloaded front end); a reset forwards `reset_after` bytes of the request, then closes the
socket with SO_LINGER 0 so the client gets ECONNRESET; a corruption flips one byte of what the client
sends, `corrupt_at` bytes into the connection (inside a request body, for uploads of more than that).
"""

from __future__ import annotations

import socket
import struct
import threading
from dataclasses import dataclass, field

SERVICE_UNAVAILABLE = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/xml\r\nContent-Length: 97\r\n"
    b"Connection: close\r\n\r\n"
    b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>\n\n\n\n\n\n\n\n\n\n"
)


@dataclass
class FaultProxy:
    upstream_port: int
    fail_503: frozenset[int] = frozenset()  # connection numbers (from 1) answered with a 503
    reset: frozenset[int] = frozenset()  # connection numbers reset after `reset_after` request bytes
    reset_after: int = 64 * 1024
    corrupt: frozenset[int] = frozenset()  # connection numbers whose request bytes get one byte flipped
    corrupt_at: int = 64 * 1024
    port: int = 0
    connections: int = 0
    faults: int = 0
    _listener: socket.socket | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> FaultProxy:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._listener is not None:
            self._listener.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self.connections += 1
                number = self.connections
            threading.Thread(target=self._serve, args=(client, number), daemon=True).start()

    def _serve(self, client: socket.socket, number: int) -> None:
        if number in self.fail_503:
            self._answer_503(client)
            return
        try:
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
        except OSError:
            client.close()
            return
        limit = self.reset_after if number in self.reset else None
        threading.Thread(target=self._pump, args=(upstream, client, None), daemon=True).start()
        self._pump(client, upstream, limit, self.corrupt_at if number in self.corrupt else None)

    def _answer_503(self, client: socket.socket) -> None:
        with self._lock:
            self.faults += 1
        try:
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = client.recv(65536)
                if not chunk:
                    break
                head += chunk
            client.sendall(SERVICE_UNAVAILABLE)
        except OSError:
            pass
        finally:
            client.close()

    def _pump(self, source: socket.socket, target: socket.socket, limit: int | None, flip: int | None = None) -> None:
        sent = 0
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                if flip is not None and sent <= flip < sent + len(data):
                    changed = bytearray(data)
                    changed[flip - sent] ^= 0xFF
                    data = bytes(changed)
                    with self._lock:
                        self.faults += 1
                target.sendall(data)
                sent += len(data)
                if limit is not None and sent >= limit:
                    with self._lock:
                        self.faults += 1
                    for sock in (source, target):  # RST, not FIN: what a dropped connection looks like
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    break
        except OSError:
            pass
        finally:
            for sock in (source, target):
                try:
                    sock.close()
                except OSError:
                    pass
