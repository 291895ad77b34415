"""The vllm-cpu worker's end of the pipe (streamctl/shard/engines/vllm_cpu/protocol.py): frames in from the parent, frames
out through one writer thread. Standard library only."""

from __future__ import annotations

import hashlib
import json
import queue
import threading
import time
from collections.abc import Callable
from typing import IO, Any

from streamctl.shard.engines.vllm_cpu.protocol import ProtocolError, read_header, write_frame

LOG_INTERVAL_S = 2.0
INFLIGHT_BYTES = 64 * 1024 * 1024  # tensor payload queued for the writer thread, at most (one tensor always)


class Channel:
    """The protocol streams: frames in from the parent, frames out to it. Outgoing frames go through one
    writer thread, in order: it hashes a tensor's bytes and writes them (both release the GIL) while the
    main thread builds and loads the next pseudo stage; at most INFLIGHT_BYTES of payload wait for it."""

    def __init__(self, inp: IO[bytes], out: IO[bytes]) -> None:
        self.inp, self.out = inp, out
        self.last_log = 0.0
        self._queue: queue.Queue[tuple[dict[str, Any], Any, Callable[[dict[str, Any]], None] | None] | None]
        self._queue = queue.Queue()
        self._inflight = 0
        self._changed = threading.Condition()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._write_frames, name="frame-writer", daemon=True)
        self._thread.start()

    def _write_frames(self) -> None:
        while (item := self._queue.get()) is not None:
            header, payload, on_sent = item
            try:
                if self._failure is None:
                    view = payload[0] if isinstance(payload, tuple) else payload  # (bytes, what keeps them alive)
                    if header.get("sha256", "") is None:
                        header["sha256"] = hashlib.sha256(view).hexdigest()
                    write_frame(self.out, header, view)
                    if on_sent is not None:
                        on_sent(header)
            except BaseException as error:  # noqa: BLE001 - re-raised in the main thread by the next send
                self._failure = error
            finally:
                with self._changed:
                    self._inflight -= int(header.get("nbytes", 0))
                    self._changed.notify_all()
                self._queue.task_done()
        self._queue.task_done()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    def send(
        self,
        header: dict[str, Any],
        payload: Any = None,
        on_sent: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        """Queue one frame (a "sha256": None header gets the payload's sha256 filled in before it is written)."""
        self._raise_failure()
        size = int(header.get("nbytes", 0))
        with self._changed:
            self._changed.wait_for(  # a frame without payload (a heartbeat, a log) never waits for room
                lambda: (
                    size == 0
                    or self._inflight == 0
                    or self._inflight + size <= INFLIGHT_BYTES
                    or self._failure is not None
                )
            )
            self._inflight += size
        self._queue.put((header, payload, on_sent))

    def flush(self) -> None:
        """Every queued frame written (or the writer's failure raised)."""
        self._queue.join()
        self._raise_failure()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=60)

    def log(self, message: str, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self.last_log >= LOG_INTERVAL_S:
            self.last_log = now
            self.send({"type": "log", "message": message})

    def read_range(self, file: str, offset: int, length: int) -> bytearray:
        """`length` bytes of the source's FILE at OFFSET, asked from the parent (one "read", one "data")."""
        self.send({"type": "read", "file": file, "offset": offset, "length": length})
        self.flush()
        header = read_header(self.inp)
        if header is None:
            raise ProtocolError("stdin ended while waiting for a data frame")
        nbytes = int(header.get("nbytes", 0))
        if header.get("op") != "data" or nbytes != length:
            raise ProtocolError(f"expected a data frame of {length} bytes, got {json.dumps(header)[:200]}")
        buffer = bytearray(length)
        view, filled = memoryview(buffer), 0
        while filled < length:
            got = self.inp.readinto(view[filled:])  # type: ignore[attr-defined]
            if not got:
                raise ProtocolError(f"a data frame ended {length - filled} bytes early")
            filled += got
        return buffer
