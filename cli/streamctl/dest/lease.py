"""One writer per DEST: a lease object at the root of DEST, held while a run writes there.

Why: two runs into one DEST (the same model or two, started together) would discard each other's
unfinished uploads and interleave their files. The lease makes the second one stop before it writes
anything, with a message naming the run that holds it.

How: the lease is a small JSON object named LEASE_NAME (hidden from every folder-like listing, see
storage.base). It is created with the store's atomic create-if-absent (S3 `If-None-Match: *`, GCS
`ifGenerationMatch=0`, Azure `If-None-Match: *`, a hard link locally), so of two runs racing exactly one
gets it. A heartbeat thread renews it every `heartbeat_s` with a conditional replace (the version it last
wrote), pushing its expiry `ttl_s` ahead; the lease is deleted, conditionally again, when the run ends
(success, failure or Ctrl-C). A lease is stale when its expiry has passed (its run was killed or lost its
machine), or at once when it names a process of this very machine (same host, boot and pid namespace) that
no longer exists; a stale lease is taken over by a conditional replace of the version that was read, so two
runs taking over one stale lease cannot both win. A run whose lease was taken from it (it was paused past
its expiry) learns so at its next renewal and stops, and it renews once more right before it writes its
manifest: after a renewal no other run can take the lease for `ttl_s`, so a manifest is only ever written
by the lease's holder.

`transfer --worker K/N` and `shard --worker K/N` runs (streamctl.dest.shares, streamctl.shard.shares) write
one DEST together: each holds its own lease, LEASE_NAME + ".worker-K-of-N", with the same semantics, so two
runs of one share exclude each other. A
whole-DEST run and worker runs exclude each other too, as do workers of different counts N: each run takes
its own lease first, then looks for a live lease it conflicts with, and if it finds one it releases its own
and stops. Of two such runs starting together at least one sees the other (every store here reads its own
and others' completed writes); at worst both stop, and neither writes.

Expiry compares wall clocks of different machines: the default TTL (two minutes) is far beyond usual
clock skew; STREAMCTL_LEASE_TTL and STREAMCTL_LEASE_HEARTBEAT (seconds) change them.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from streamctl.dest.shares import Worker
from streamctl.errors import DestinationBusy, NotFoundError, PreconditionFailed, StreamctlError, UsageError
from streamctl.interrupts import shielded_calls
from streamctl.progress import Progress
from streamctl.storage.base import LEASE_NAME, Location, MultipartUpload, ObjectInfo, Store

DEFAULT_TTL_S = 120.0
DEFAULT_HEARTBEAT_S = 20.0
_ACQUIRE_ATTEMPTS = 5
_WORKER_PREFIX = f"{LEASE_NAME}.worker-"
_WORKER_LEASE = re.compile(re.escape(_WORKER_PREFIX) + r"([0-9]+)-of-([0-9]+)")


def lease_name(worker: Worker | None) -> str:
    """The lease a run holds: DEST's own, or its `--worker` share's."""
    return LEASE_NAME if worker is None else f"{_WORKER_PREFIX}{worker.index}-of-{worker.count}"


@dataclass(frozen=True)
class LeaseSettings:
    ttl_s: float = DEFAULT_TTL_S  # how long a lease stays live after its last renewal
    heartbeat_s: float = DEFAULT_HEARTBEAT_S  # how often the holder renews it

    def validate(self) -> None:
        if not (0 < self.heartbeat_s < self.ttl_s <= 86_400):
            raise UsageError(
                f"lease heartbeat {self.heartbeat_s} s and TTL {self.ttl_s} s: need 0 < heartbeat < TTL <= 86400",
                hint="fix STREAMCTL_LEASE_HEARTBEAT / STREAMCTL_LEASE_TTL",
            )

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> LeaseSettings:
        values = {}
        for name, attribute in (("STREAMCTL_LEASE_TTL", "ttl_s"), ("STREAMCTL_LEASE_HEARTBEAT", "heartbeat_s")):
            text = environ.get(name, "").strip()
            if text:
                try:
                    values[attribute] = float(text)
                except ValueError:
                    raise UsageError(f"{name}={text!r} is not a number of seconds") from None
        settings = cls(**values)
        if "heartbeat_s" not in values and settings.heartbeat_s >= settings.ttl_s:
            settings = replace(settings, heartbeat_s=settings.ttl_s / 4)  # a short TTL alone keeps working
        settings.validate()
        return settings


@dataclass(frozen=True)
class Holder:
    """What a lease says about the run that holds it."""

    owner: str  # a random token per run: tells our own lease from another's
    host: str
    pid: int
    command: str
    started: datetime
    heartbeat: datetime
    expires: datetime
    boot_id: str | None = None  # with pid_ns: whether `pid` can be checked from here
    pid_ns: str | None = None

    def to_bytes(self) -> bytes:
        document = {
            "tool": "streamctl",
            "lease": 1,
            "owner": self.owner,
            "host": self.host,
            "pid": self.pid,
            "command": self.command,
            "started": _iso(self.started),
            "heartbeat": _iso(self.heartbeat),
            "expires": _iso(self.expires),
            "boot_id": self.boot_id,
            "pid_ns": self.pid_ns,
        }
        return json.dumps(document, indent=2).encode() + b"\n"

    @classmethod
    def from_bytes(cls, data: bytes) -> Holder | None:
        """None for anything that is not a lease this code understands."""
        try:
            document = json.loads(data)
            return cls(
                owner=str(document["owner"]),
                host=_printable(str(document["host"])),
                pid=int(document["pid"]),
                command=_printable(str(document.get("command", "?"))),
                started=_parse_time(document["started"]),
                heartbeat=_parse_time(document["heartbeat"]),
                expires=_parse_time(document["expires"]),
                boot_id=document.get("boot_id"),
                pid_ns=document.get("pid_ns"),
            )
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError):  # nested too deep: not ours
            return None

    def describe(self) -> str:
        return f"{self.command!r} on {self.host}, pid {self.pid}, started {_shown(self.started)}"


def _iso(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat(timespec="milliseconds")


def _shown(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat(timespec="seconds")


def _parse_time(text: object) -> datetime:
    moment = datetime.fromisoformat(str(text))
    if moment.tzinfo is None:
        raise ValueError("naive time")
    return moment


def _printable(text: str, limit: int = 200) -> str:
    """Another run's words, safe to print on one line (the lease is a file anyone may write)."""
    cleaned = "".join(char if char.isprintable() else "?" for char in text)
    return cleaned if len(cleaned) <= limit else cleaned[: limit - 3] + "..."


def _now() -> datetime:
    return datetime.now(UTC)


def _read_text(path: str) -> str | None:
    try:
        with open(path) as handle:
            return handle.read().strip() or None
    except OSError:
        return None


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # it exists, we just may not signal it
    return True


def stale_reason(holder: Holder, now: datetime) -> str | None:
    """Why a lease no longer protects a live run, or None while it does."""
    if holder.expires <= now:
        return f"its last heartbeat was {_shown(holder.heartbeat)} and it expired {_shown(holder.expires)}"
    here = holder.host == socket.gethostname() and holder.boot_id is not None and holder.pid_ns is not None
    if (
        here
        and holder.boot_id == _read_text("/proc/sys/kernel/random/boot_id")
        and holder.pid_ns == _pid_namespace()
        and not _process_alive(holder.pid)
    ):
        return f"process {holder.pid} no longer runs on this host"
    return None


@dataclass
class Lease:
    """A lease this run holds: renewed by a heartbeat thread until released."""

    location: Location
    holder: Holder
    version: str
    settings: LeaseSettings
    progress: Progress
    acquired_at: datetime  # our clock, just before the request that got it
    name: str = LEASE_NAME  # lease_name(): DEST's own, or a `--worker` share's
    taken_over: Holder | None = None  # the stale lease replaced, if any
    lost: DestinationBusy | None = None  # set once another run holds it (or it expired unrenewed)
    _on_lost: list[Callable[[], None]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    @property
    def key(self) -> str:
        return self.location.key(self.name)

    @property
    def url(self) -> str:
        return self.location.store.url(self.key)

    def on_lost(self, callback: Callable[[], None]) -> None:
        """Call `callback` (from the heartbeat thread) when the lease is lost: the writer should stop."""
        self._on_lost.append(callback)
        if self.lost is not None:
            callback()

    def _lose(self, error: DestinationBusy) -> DestinationBusy:
        if self.lost is None:
            self.lost = error
            self.progress.log(f"lost the lease on {self.location.url}: {error.message}")
            for callback in self._on_lost:
                callback()
        return self.lost

    def renew(self) -> None:
        """Push the expiry `ttl_s` ahead; DestinationBusy when another run holds the lease now."""
        with self._lock:
            if self.lost is not None:
                raise self.lost
            now = _now()
            renewed = replace(self.holder, heartbeat=now, expires=now + timedelta(seconds=self.settings.ttl_s))
            body = renewed.to_bytes()
            try:
                self.version = self.location.store.replace_if_version(self.key, body, self.version, _metadata(body))
            except PreconditionFailed:
                current = self._stored()
                if current is None or current[0] != body:
                    raise self._lose(
                        DestinationBusy(
                            f"another run took over the lease on {self.location.url} (this run was paused or cut "
                            "off past its expiry); this run stopped writing",
                            hint="check what that run wrote, then run this command again",
                        )
                    ) from None
                self.version = current[1]  # our own write, answered 412 when the SDK retried it
            self.holder = renewed

    def _stored(self) -> tuple[bytes, str] | None:
        try:
            return self.location.store.read_versioned(self.key)
        except StreamctlError:  # gone, or unreadable: not ours in any case
            return None

    def ensure_held(self) -> None:
        """Renew now, so nobody else can take the lease for `ttl_s`: call right before a final write."""
        self.renew()

    def guard_commit(self) -> None:
        """Before a write becomes visible under a final name: DestinationBusy when the lease is lost, and a
        renewal first when it is close to expiry by our own clock. A run that was paused (SIGSTOP, a frozen VM)
        past its expiry may have been taken over meanwhile; this is where it finds out, before it commits."""
        if self.lost is not None:
            raise self.lost
        if _now() >= self.holder.expires - timedelta(seconds=self.settings.heartbeat_s):
            self.renew()

    def fenced(self, location: Location) -> Location:
        """`location` with every write (put, multipart completion, delete) behind guard_commit()."""
        return Location(FencedStore(location.store, self.guard_commit), location.prefix)

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.settings.heartbeat_s):
            try:
                self.renew()
            except DestinationBusy:
                return
            except StreamctlError as error:
                if _now() >= self.holder.expires:
                    self._lose(
                        DestinationBusy(
                            f"could not renew the lease on {self.location.url} before it expired ({error.message})",
                            hint="check the network, then run the command again",
                        )
                    )
                    return
                self.progress.log(f"could not renew the lease on {self.location.url} ({error.message}); retrying")

    def start(self) -> None:
        self._thread = threading.Thread(target=self._heartbeat, name="streamctl-lease", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stop the heartbeat and delete the lease if it is still ours. Never raises: it runs on every way
        out, and an error here must not hide the run's own."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        with self._lock:
            if self.lost is not None:
                return
            try:
                self.location.store.delete_if_version(self.key, self.version)
            except PreconditionFailed:
                if self._stored() is not None:  # (absent: our own delete, retried by the SDK)
                    self.progress.log(
                        f"the lease on {self.location.url} was taken by another run before this one ended"
                    )
            except StreamctlError as error:
                self.progress.log(
                    f"could not remove the lease {self.url} ({error.message}); it expires at {_shown(self.holder.expires)}"
                )


@dataclass
class FencedStore:
    """A store whose writes first call `guard` (Lease.guard_commit); everything else is the store's own."""

    store: Store
    guard: Callable[[], None]

    def __getattr__(self, name: str) -> Any:  # every other member of the Store protocol, as the store has it
        return getattr(self.store, name)

    def put(
        self, key: str, data: bytes, metadata: Mapping[str, str] | None = None, content_type: str | None = None
    ) -> ObjectInfo:
        self.guard()
        return self.store.put(key, data, metadata, content_type)

    def delete(self, key: str) -> None:
        self.guard()
        self.store.delete(key)

    def start_multipart(
        self,
        key: str,
        part_size: int,
        metadata: Mapping[str, str] | None = None,
        content_type: str | None = None,
        resume: str | None = None,
    ) -> MultipartUpload:
        upload = self.store.start_multipart(key, part_size, metadata, content_type, resume)
        complete = upload.complete

        def guarded_complete(metadata: Mapping[str, str] | None = None) -> ObjectInfo:
            self.guard()
            return complete(metadata)

        # Patched on the instance rather than wrapped, so the upload keeps its type (local fast paths test it).
        upload.complete = guarded_complete  # type: ignore[method-assign]
        return upload


def _metadata(body: bytes) -> dict[str, str]:
    return {"sha256": hashlib.sha256(body).hexdigest()}  # like every object streamctl writes


def _busy(location: Location, holder: Holder | None, name: str = LEASE_NAME) -> DestinationBusy:
    lease_url = location.store.url(location.key(name))
    if holder is None:
        return DestinationBusy(
            f"{location.url} is being written by another streamctl run (its lease kept changing)",
            hint="wait for it to finish, then run this command again",
        )
    return DestinationBusy(
        f"{location.url} is being written by another streamctl run ({holder.describe()})",
        hint=(
            f"wait for it to finish; if that run is gone, its lease (last heartbeat {_shown(holder.heartbeat)}) "
            f"expires at {_shown(holder.expires)} and the next run takes over, at once on its own host; "
            f"or delete {lease_url} if you are sure"
        ),
    )


def acquire(
    location: Location,
    command: str,
    progress: Progress,
    settings: LeaseSettings | None = None,
    worker: Worker | None = None,
) -> Lease:
    """Take the lease of `location` (creating it, or taking over a stale one) and start its heartbeat; with
    `worker`, that share's lease (see the module's doc).

    DestinationBusy when a live run holds it, or holds a lease this one conflicts with."""
    settings = settings or LeaseSettings.from_environ()
    settings.validate()
    lease = _take(location, lease_name(worker), command, progress, settings)
    conflict = _live_conflict(location, worker)
    if conflict is not None:
        lease.release()
        raise _busy(location, *conflict)
    return lease


def _take(location: Location, name: str, command: str, progress: Progress, settings: LeaseSettings) -> Lease:
    store, key = location.store, location.key(name)
    owner = uuid.uuid4().hex
    boot_id, pid_ns = _read_text("/proc/sys/kernel/random/boot_id"), _pid_namespace()
    started = _now()
    last_seen: Holder | None = None
    for _ in range(_ACQUIRE_ATTEMPTS):
        acquired_at = _now()
        holder = Holder(
            owner, socket.gethostname(), os.getpid(), command, started, acquired_at,
            acquired_at + timedelta(seconds=settings.ttl_s), boot_id, pid_ns,
        )  # fmt: skip
        body = holder.to_bytes()
        try:
            version = store.create_if_absent(key, body, _metadata(body))
            return _started(Lease(location, holder, version, settings, progress, acquired_at, name))
        except PreconditionFailed:
            pass
        try:
            data, version = store.read_versioned(key)
        except NotFoundError:
            continue  # released meanwhile: try to create it again
        held = Holder.from_bytes(data)
        if held is not None and held.owner == owner:  # our own create, answered 412 after a retried request
            return _started(Lease(location, held, version, settings, progress, acquired_at, name))
        reason = "it is unreadable" if held is None else stale_reason(held, _now())
        if reason is None:
            raise _busy(location, held, name)
        last_seen = held
        try:
            version = store.replace_if_version(key, body, version, _metadata(body))
        except PreconditionFailed:
            continue  # renewed, released or taken by another run meanwhile: look again
        what = "an unreadable lease" if held is None else f"the lease of a stale run ({held.describe()})"
        progress.log(f"took over {what} on {location.url}: {reason}")
        return _started(Lease(location, holder, version, settings, progress, acquired_at, name, taken_over=held))
    raise _busy(location, last_seen, name)


def _conflicting_names(location: Location, worker: Worker | None) -> list[str]:
    """The leases of `location` a run of `worker` (None: a whole-DEST run) must not run beside: for a
    whole-DEST run every worker's, for a worker DEST's own and those of workers of another count."""
    try:
        listed = list(location.store.list(location.key(_WORKER_PREFIX)))
    except NotFoundError:
        listed = []  # a local folder not made yet
    names = [info.key.rpartition("/")[2] for info in listed if info.key.rpartition("/")[0] == location.prefix]
    workers = [(name, match) for name in names if (match := _WORKER_LEASE.fullmatch(name)) is not None]
    if worker is None:
        return [name for name, _ in workers]
    return [LEASE_NAME] + [name for name, match in workers if int(match[2]) != worker.count]


def _live_conflict(location: Location, worker: Worker | None) -> tuple[Holder, str] | None:
    """A live lease (its holder and name) that excludes a run of `worker`; stale and unreadable ones do not."""
    for name in _conflicting_names(location, worker):
        try:
            data, _ = location.store.read_versioned(location.key(name))
        except NotFoundError:
            continue
        held = Holder.from_bytes(data)
        if held is not None and stale_reason(held, _now()) is None:
            return held, name
    return None


def _appended(taken: list[Lease], lease: Lease) -> Lease:
    taken.append(lease)
    return lease


def _started(lease: Lease) -> Lease:
    lease.start()
    return lease


@contextmanager
def hold_lease(
    location: Location,
    command: str,
    progress: Progress,
    settings: LeaseSettings | None = None,
    worker: Worker | None = None,
) -> Iterator[Lease]:
    """Hold the lease of `location` (with `worker`: that share's) for the block; released on every way out. A
    failure inside the block caused by losing the lease (the writer was cancelled) is reported as the lost lease.

    The lease is taken by a shielded call: a signal arriving while it is being created cannot leave it in DEST
    unknown to this run (then the next run, on another host, would wait out its TTL): it is released."""
    taken: list[Lease] = []  # filled by the shielded call itself: seen here however the block is left
    try:
        with shielded_calls() as shielded:
            shielded(lambda: _appended(taken, acquire(location, command, progress, settings, worker)))
        yield taken[0]
    except Exception as error:
        lost = taken[0].lost if taken else None
        if lost is not None and error is not lost:
            raise lost from error
        raise
    finally:
        for lease in taken:
            lease.release()
