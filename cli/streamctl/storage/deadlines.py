"""An overall deadline for every HTTP request a backend makes: connect, first byte and whole body.

SDK timeouts are per socket operation (botocore's read_timeout, requests' and httpx's read timeouts), so a
server that sends one byte every few seconds, or headers one byte at a time, keeps a request alive forever.
Here each request gets `base + expected_bytes / floor_rate` seconds of wall time, whatever the SDK does.

How it holds against every SDK: the store wraps each SDK call in a *scope* (thread-local). Transport hooks
tell the scope when each HTTP request starts and which socket carries it:
  - urllib3 (botocore for S3; requests for GCS and Azure): the connection pools of streamctl's own clients
    are subclasses (`timed_pool_class`) whose `_make_request` starts a request on a connection and whose
    `_put_conn` ends it when the connection goes back to the pool; urllib3 itself is never patched, so the
    other clients of a program that uses streamctl as a library are untouched;
  - httpx (huggingface_hub): a transport wrapper starts each request, a network-backend wrapper reports the
    socket of every read and write (and counts what each response has delivered, so `body_socket` can hand
    the rest of a large body to a direct `recv_into`).
One watchdog thread shuts down (`shutdown(SHUT_RDWR)`, at the C level, so TLS sockets too) the socket of any
request past its deadline: the SDK's blocked read returns at once with an error the SDK cannot retry into a
hang, because the next request that scope starts is refused (`_Refused`, a BaseException that SDK retry
loops, which catch Exception, let through). The scope then reports a `RequestCut`; `call` and `iterate`
retry the operation (retry.py) up to the store's attempts, each with a fresh deadline, and finally raise
`DeadlineExceededError` (exit 6) naming the endpoint as host:port.

`cut_all()` cuts every request in flight at once: Ctrl-C and failed runs call it, so worker threads blocked
on a silent server end now rather than at their deadlines.

A signal that stops the run (streamctl.interrupts) cuts the requests of worker threads at once, and refuses
their new ones from then on: they end promptly, even mid-part on a slow link, while the main thread's
clean-up requests (aborts, the lease's release) and shielded calls still go out (`requests_outlive_stop`).

Waits between tries (`pause`): the transport hooks note what each answer asks (Retry-After, RateLimit: see
waits.py) on the thread that received it, and every retry wait (streamctl's own, and each SDK's, whose sleeps
`route_sleeps` sends here) serves that wait, never less than its own back-off: capped at STREAMCTL_MAX_SERVER_WAIT
(60 s), charged to the scope's deadline (a wait the deadline cannot hold cuts the request, as a silent
server's would be), announced on the command's progress, and ended at once by interrupts.request_stop().

Tuning (for tests and unusual links): STREAMCTL_DEADLINE_BASE_S and STREAMCTL_DEADLINE_FLOOR_BPS (undocumented)
and STREAMCTL_MAX_SERVER_WAIT (in the README) here, STREAMCTL_MAX_ATTEMPTS (StorageOptions.max_attempts) for
the tries. Nothing here imports an SDK until a backend installs its hook.
"""

from __future__ import annotations

import _socket
import heapq
import itertools
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from streamctl import interrupts
from streamctl.common.sizes import KiB
from streamctl.errors import DeadlineExceededError, Interrupted, RemoteError
from streamctl.interrupts import on_stop, requests_outlive_stop, stop_requested
from streamctl.retry import RetryPolicy
from streamctl.storage import waits

T = TypeVar("T")

# Defaults: a minute for connect + headers + a small body, plus the body at 128 KiB/s. A transfer runs ~32
# requests at once, so 128 KiB/s per request is ~4 MiB/s for the whole link: a 1 TB transfer over a slow but
# healthy 50 Mbit/s link (~190 KiB/s per request) is never cut, while a server that stalls is cut in minutes.
DEFAULT_BASE_S = 60.0
DEFAULT_FLOOR_BPS = 128 * KiB
# The longest a server may make one try wait (Retry-After: 999999 must not stall a run for 11 days); a wait
# a server asks for is usually seconds, a minute at most for a rate limit's window.
DEFAULT_MAX_SERVER_WAIT_S = 60.0
_RETRY_DELAYS = RetryPolicy(attempts=1, base_delay_s=0.5, max_delay_s=5.0)
_SOCKET_RETRY_S = 0.05  # how soon the watchdog looks again for a socket still being connected


@dataclass(frozen=True)
class DeadlinePolicy:
    base_s: float = DEFAULT_BASE_S
    floor_bytes_per_s: float = DEFAULT_FLOOR_BPS
    max_server_wait_s: float = DEFAULT_MAX_SERVER_WAIT_S

    def budget(self, expected_bytes: int = 0) -> float:
        """Seconds one request may take, from its start to the last byte of its answer."""
        return self.base_s + max(0, expected_bytes) / self.floor_bytes_per_s


def policy(environ: dict[str, str] | os._Environ[str] = os.environ) -> DeadlinePolicy:
    def number(name: str, default: float) -> float:
        try:
            value = float(environ.get(name, "") or default)
        except ValueError:
            return default
        return value if value > 0 else default

    return DeadlinePolicy(
        number("STREAMCTL_DEADLINE_BASE_S", DEFAULT_BASE_S),
        number("STREAMCTL_DEADLINE_FLOOR_BPS", DEFAULT_FLOOR_BPS),
        number("STREAMCTL_MAX_SERVER_WAIT", DEFAULT_MAX_SERVER_WAIT_S),
    )


class RequestCut(RemoteError):
    """One attempt was cut at its deadline (internal: `call` and `iterate` retry it or raise the final error)."""

    def __init__(self, endpoint: str, budget_s: float, cancelled: bool) -> None:
        super().__init__(f"no complete answer from {endpoint} within {budget_s:.3g} s")
        self.endpoint = endpoint
        self.budget_s = budget_s
        self.cancelled = cancelled


class _Refused(BaseException):
    """Raised by a transport hook when a cut scope starts another request (an SDK retry): a BaseException,
    so that SDK retry loops (which catch Exception) cannot turn one deadline into several."""


@dataclass(eq=False)
class Scope:
    """The deadline state of one SDK call on one thread; requests inside it are timed one at a time."""

    budget_s: float
    endpoint: str = "the server"
    cut: bool = False
    cancelled: bool = False
    expires_at: float | None = None  # deadline of the request in flight; None between requests
    connection: Any = None  # the urllib3 connection of that request (its .sock may appear later)
    io_socket: socket.socket | None = None  # the socket the httpx hooks last saw
    waited_s: float = 0.0  # server-imposed waits so far: they count against the budget of what follows
    _shut: bool = False
    spared: bool = False  # its thread's requests outlive a stop (interrupts.requests_outlive_stop)

    def socket(self) -> socket.socket | None:
        sock = getattr(self.connection, "sock", None) if self.connection is not None else None
        return sock or self.io_socket


class _Watchdog:
    """One daemon thread that shuts down the sockets of requests past their deadline."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._scopes: set[Scope] = set()
        self._heap: list[tuple[float, int, Scope]] = []
        self._order = itertools.count()
        self._thread: threading.Thread | None = None

    def begin(self, scope: Scope, endpoint: str, connection: Any = None) -> None:
        """A request starts in `scope` (called by the transport hooks on the requesting thread)."""
        spared = requests_outlive_stop()
        if not scope.cut and not spared and stop_requested():
            scope.cut = scope.cancelled = True  # a worker thread's request after a stop: only clean-up goes out
        if scope.cut:
            raise _Refused()
        with self._lock:
            scope.spared = spared
            scope.endpoint = endpoint
            scope.connection = connection
            scope.io_socket = None
            scope.expires_at = time.monotonic() + max(0.0, scope.budget_s - scope.waited_s)
            scope._shut = False
            self._scopes.add(scope)
            heapq.heappush(self._heap, (scope.expires_at, next(self._order), scope))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="streamctl-deadlines", daemon=True)
                self._thread.start()
            self._lock.notify()

    def end_request(self, scope: Scope) -> None:
        with self._lock:
            scope.expires_at = None
            scope.connection = None
            scope.io_socket = None

    def release(self, connection: Any) -> None:
        """A urllib3 connection went back to its pool: the request on it is over."""
        with self._lock:
            for scope in self._scopes:
                if scope.connection is connection:
                    scope.expires_at = None
                    scope.connection = None
                    scope.io_socket = None

    def leave(self, scope: Scope) -> None:
        with self._lock:
            self._scopes.discard(scope)
            scope.expires_at = None
            scope.connection = None
            scope.io_socket = None

    def cut_all(self, spare_clean_up: bool = False) -> int:
        with self._lock:
            scopes = [scope for scope in self._scopes if not (spare_clean_up and scope.spared)]
            for scope in scopes:
                scope.cut = scope.cancelled = True
                self._shutdown(scope)
            return len(scopes)

    def _shutdown(self, scope: Scope) -> bool:
        sock = scope.socket()
        if sock is None:
            return False
        try:
            # The C method: ssl.SSLSocket.shutdown would also drop its TLS state under the reading thread.
            _socket.socket.shutdown(sock, socket.SHUT_RDWR)
        except (OSError, TypeError, ValueError):
            pass  # already closed: the request is over anyway
        scope._shut = True
        return True

    def _run(self) -> None:
        while True:
            with self._lock:
                now = time.monotonic()
                while self._heap:
                    expires_at, _, scope = self._heap[0]
                    if scope not in self._scopes or scope.expires_at != expires_at:
                        heapq.heappop(self._heap)  # that request ended, or a later one replaced it
                        continue
                    if expires_at > now:
                        break
                    scope.cut = True
                    if self._shutdown(scope):
                        heapq.heappop(self._heap)
                    else:  # still connecting: the socket exists in a moment (connect has its own timeout)
                        heapq.heapreplace(self._heap, (now + _SOCKET_RETRY_S, next(self._order), scope))
                        scope.expires_at = now + _SOCKET_RETRY_S
                        break
                wait = self._heap[0][0] - now if self._heap else None
                self._lock.wait(timeout=wait)


_WATCHDOG = _Watchdog()
_local = threading.local()


def current() -> Scope | None:
    return getattr(_local, "scope", None)


def leave(scope: Scope) -> None:
    """`scope` makes no more requests (for scopes entered several times with `entered`)."""
    _WATCHDOG.leave(scope)


def cut_all(spare_clean_up: bool = False) -> int:
    """Cut every request in flight now (Ctrl-C, a failed run); returns how many scopes were cut. With
    `spare_clean_up`, not those of the main thread and of shielded calls (interrupts.requests_outlive_stop)."""
    return _WATCHDOG.cut_all(spare_clean_up)


# A signal stops the run: worker threads' requests end now (the main thread's may be its clean-up).
on_stop(lambda: _WATCHDOG.cut_all(spare_clean_up=True))


@contextmanager
def entered(scope: Scope) -> Iterator[Scope]:
    """Make `scope` the thread's scope for the block; a cut inside it becomes RequestCut (even on success:
    a body cut short may look complete to an SDK that does not check its length)."""
    previous = current()
    _local.scope = scope
    try:
        yield scope
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as error:
        if scope.cut:
            raise RequestCut(scope.endpoint, scope.budget_s, scope.cancelled) from error
        if isinstance(error, _Refused):  # not ours: cannot happen, but never leak the signal
            raise RequestCut(scope.endpoint, scope.budget_s, scope.cancelled) from None
        raise
    finally:
        _local.scope = previous
        _WATCHDOG.end_request(scope)
    if scope.cut:
        raise RequestCut(scope.endpoint, scope.budget_s, scope.cancelled)


@contextmanager
def scoped(budget_s: float) -> Iterator[Scope]:
    scope = Scope(budget_s)
    try:
        with entered(scope):
            yield scope
    finally:
        _WATCHDOG.leave(scope)


def final_error(cut: RequestCut, url: str, attempts: int) -> DeadlineExceededError:
    if cut.cancelled:
        return DeadlineExceededError(f"{url}: request to {cut.endpoint} cancelled")
    tries = f"{attempts} attempts" if attempts > 1 else "1 attempt"
    return DeadlineExceededError(
        f"{url}: {cut.message} ({tries}; connect, headers and body count)",
        hint=f"{cut.endpoint} accepts requests but answers too slowly or not at all: check the network, "
        "the endpoint and any proxy in between",
    )


def call(operation: Callable[[], T], *, url: str, attempts: int, expected_bytes: int = 0) -> T:
    """Run one SDK call under a deadline per request; a cut attempt is retried, up to `attempts` in all."""
    budget = policy().budget(expected_bytes)
    for cuts in itertools.count(1):
        try:
            with scoped(budget):
                return operation()
        except RequestCut as cut:
            if cut.cancelled or cuts >= attempts:
                raise final_error(cut, url, attempts) from cut
            if pause(_RETRY_DELAYS.delay(cuts - 1)):
                raise final_error(RequestCut(cut.endpoint, cut.budget_s, True), url, attempts) from cut
    raise AssertionError("unreachable")


def iterate(
    open_listing: Callable[[], Iterable[T]], key: Callable[[T], str], *, url: str, attempts: int
) -> Iterator[T]:
    """A listing in key order under a deadline per page request. Only fetching the next item runs inside a
    scope (never the caller's work between items); a cut listing starts again and skips what was yielded."""
    budget = policy().budget()
    last: str | None = None
    cuts = 0
    while True:
        try:
            with scoped(budget):
                iterator = iter(open_listing())
            while True:
                with scoped(budget):
                    item = next(iterator, _END)
                if item is _END:
                    return
                name = key(item)  # type: ignore[arg-type]
                if last is not None and name <= last:
                    continue  # already yielded before a restart
                last = name
                yield item  # type: ignore[misc]
        except RequestCut as cut:
            cuts += 1
            if cut.cancelled or cuts >= attempts:
                raise final_error(cut, url, attempts) from cut
            if pause(_RETRY_DELAYS.delay(cuts - 1)):
                raise final_error(RequestCut(cut.endpoint, cut.budget_s, True), url, attempts) from cut


_END = object()


# -- waits between tries -----------------------------------------------------------------------------------


def note_answer(endpoint: str, status: int, headers: Any) -> None:
    """An answer arrived on this thread (transport hooks): remember the wait it asks for, if any, for the
    next `pause` here; an answer that asks none forgets an earlier one."""
    seconds = waits.asked_wait(status, headers)
    _local.asked = None if seconds is None else waits.ServerWait(endpoint, seconds, status)


def asked() -> waits.ServerWait | None:
    """The wait the last answer on this thread asked for (None: none)."""
    return getattr(_local, "asked", None)


def _wait(seconds: float, cancelled: threading.Event | None) -> bool:
    """Sleep up to `seconds`; True when a stop (or `cancelled`) ended it first."""
    if cancelled is None:
        return interrupts.wait_or_stop(seconds)
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        if cancelled.is_set() or interrupts.wait_or_stop(min(left, 0.05)):
            return True
    return cancelled.is_set() or interrupts.stop_requested()


def pause(backoff_s: float, cancelled: threading.Event | None = None) -> bool:
    """Wait before another try: `backoff_s`, or longer when the last answer on this thread asked for a wait
    (that wait capped at the policy's max_server_wait_s, announced, and inside a scope charged to its
    deadline). True when a stop request (or `cancelled`) ended the wait: the caller gives up.

    A server wait the scope's deadline cannot hold waits out what is left, then cuts the scope (RequestCut
    through `entered`, as for a request past its deadline): the next try gets a fresh deadline, or the
    caller's last error names the endpoint."""
    wait, scope = asked(), current()
    _local.asked = None  # served once: a later pause without a new answer is a plain back-off
    if wait is None:
        return _wait(max(0.0, backoff_s), cancelled)
    cap = policy().max_server_wait_s
    left = max(0.0, scope.budget_s - scope.waited_s) if scope is not None else None
    # What the server asks is a floor (a `Retry-After: 0` storm still backs off), the cap and deadline a ceiling.
    wanted = max(wait.seconds, backoff_s)
    seconds = min(wanted, cap, left if left is not None else wanted)
    waits.announce(waits.announcement(wait, seconds, cap, left))
    started = time.monotonic()
    stopped = _wait(seconds, cancelled)
    if scope is not None:
        scope.waited_s += time.monotonic() - started
        if not stopped and left is not None and min(wanted, cap) > left:
            scope.cut = True  # the deadline is spent: refuse the try that would follow
            scope.endpoint = wait.endpoint
            raise _Refused()
    return stopped


def _sdk_sleep(seconds: float) -> None:
    """An SDK's sleep between its own tries (see `route_sleeps`): `pause`, and a stop ends the SDK call."""
    if pause(seconds):
        scope = current()
        if scope is not None:
            scope.cut = scope.cancelled = True
            raise _Refused()  # through the SDK's retry loop; `entered` makes it a cancelled RequestCut
        raise Interrupted("stopped while waiting to retry")


class _SdkClock:
    """The `time` module as an SDK module sees it after `route_sleeps`: everything but sleep is time's."""

    sleep = staticmethod(_sdk_sleep)

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def route_sleeps(module: Any) -> None:
    """Make an SDK module's `time.sleep` (its wait between retries) streamctl's `pause`: huggingface_hub's
    http_backoff (which would wait out any Retry-After), botocore's endpoint, azure-core's transport sleep (its
    RetryPolicy's Retry-After waits and the storage policies' back-off), google-api-core's retry loop.

    The one process-wide change a backend makes, and unavoidable: these SDKs sleep through their module's
    `time.sleep`, with no per-client hook (azure's per-blob clients wrap the transport in one that does not
    pass `sleep` on). It is applied as a backend opens, not only by the CLI, because a library caller's run
    needs it as much: a sleeping thread holds no socket for the deadline to cut, so a Retry-After of days would
    stall it. For every other client it is `time.sleep`: their answers never reach `note_answer` (only
    streamctl's own pools report), and the stop that would end the sleep early is the CLI's signals alone."""
    if getattr(module, "time", None) is time:
        module.time = _SdkClock()


# -- transport hooks ---------------------------------------------------------------------------------------

_install_lock = threading.Lock()


class _TimedPool:
    """Mixed into a urllib3 connection pool class: every request made inside a scope is timed (botocore,
    requests). Only streamctl's own clients get these pools (`timed_pool_classes`): urllib3's classes, and
    every other client in the process, are left as they are."""

    host: str
    port: int | None

    def _make_request(self, conn: Any, *args: Any, **kwargs: Any) -> Any:
        scope = current()
        endpoint = f"{self.host}:{self.port}"
        if scope is None:
            response = super()._make_request(conn, *args, **kwargs)  # type: ignore[misc]
            note_answer(endpoint, response.status, response.headers)
            return response
        _WATCHDOG.begin(scope, endpoint, conn)
        response = super()._make_request(conn, *args, **kwargs)  # type: ignore[misc]
        note_answer(endpoint, response.status, response.headers)
        # http.client drops conn.sock once the headers say `Connection: close`; the body still flows
        # through the response's socket file.
        sock = _response_socket(response)
        if sock is not None and scope.connection is conn:
            scope.io_socket = sock
        return response

    def _put_conn(self, conn: Any) -> None:
        if conn is not None:
            _WATCHDOG.release(conn)
        super()._put_conn(conn)  # type: ignore[misc]


_timed_classes: dict[type, type] = {}


def _mixed(mixin: type, base: type) -> type:
    """`base` with `mixin` in front, one subclass per base (a base that has it already is itself)."""
    if issubclass(base, mixin):
        return base
    with _install_lock:
        timed = _timed_classes.get(base)
        if timed is None:
            timed = _timed_classes[base] = type(f"Timed{base.__name__}", (mixin, base), {"__module__": __name__})
        return timed


def timed_pool_class(base: type) -> type:
    """`base`, a urllib3 connection pool class, with its requests timed."""
    return _mixed(_TimedPool, base)


def timed_pool_classes(table: dict[str, type]) -> dict[str, type]:
    """A copy of a urllib3 PoolManager's `pool_classes_by_scheme` with every class timed: assigned to the
    manager of a streamctl client before its first request (a PoolManager's table is urllib3's module-level
    dict unless set: never changed in place)."""
    return {scheme: timed_pool_class(cls) for scheme, cls in table.items()}


def time_pool_manager(manager: Any) -> Any:
    """Make the pools `manager` (a urllib3 PoolManager or ProxyManager of streamctl's own) creates timed."""
    manager.pool_classes_by_scheme = timed_pool_classes(manager.pool_classes_by_scheme)
    return manager


class _TimedAdapter:
    """Mixed into a requests HTTPAdapter: the pools of its pool manager and proxy managers are timed."""

    poolmanager: Any

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        super().init_poolmanager(*args, **kwargs)  # type: ignore[misc]
        time_pool_manager(self.poolmanager)

    def proxy_manager_for(self, proxy: Any, **kwargs: Any) -> Any:
        return time_pool_manager(super().proxy_manager_for(proxy, **kwargs))  # type: ignore[misc]


def timed_adapter(base: type[T]) -> type[T]:
    """`base`, a requests HTTPAdapter class, whose requests inside a scope are timed (GCS's and Azure's
    sessions mount it: the overall deadline holds for their requests, and no one else's)."""
    return _mixed(_TimedAdapter, base)


def _response_socket(response: Any) -> socket.socket | None:
    """The socket under a urllib3 response (its http.client response's socket file), if it has one."""
    raw = getattr(getattr(getattr(response, "_fp", None), "fp", None), "raw", None)
    sock = getattr(raw, "_sock", None)
    return sock if isinstance(sock, socket.socket) else None


# The end of a response head as h11 finds it (it accepts bare LF line endings too).
_HEAD_END = re.compile(rb"\n\r?\n")


@dataclass
class ResponseBytes:
    """What one connection's wrapper has handed httpx since its last request went out: the response head
    while it is incomplete, then a count of the body bytes after it (interim 1xx heads skipped)."""

    head: bytearray | None = field(default_factory=bytearray)
    body_bytes: int = 0

    def received(self, data: bytes) -> None:
        if self.head is None:
            self.body_bytes += len(data)
            return
        self.head += data
        start = 0
        while (end := _HEAD_END.search(self.head, start)) is not None:
            status = self.head[start : start + 12].split(b" ")
            if len(status) > 1 and status[1][:1] == b"1" and status[1] != b"101":
                start = end.end()  # 100 Continue, 103 Early Hints: the final head follows
                continue
            self.body_bytes, self.head = len(self.head) - end.end(), None
            return


def body_socket(response: Any, delivered: int) -> socket.socket | None:
    """The socket the rest of an httpx response's body can be read from directly (`recv_into`, no copy in
    Python), when that is provably the same bytes: an HTTP/1.1 body of known length, not encoded, whose
    connection's wrapper has handed httpx exactly the `delivered` body bytes (h11 holds none back), read
    from a plain TCP socket or a TLS socket that is the connection's only TLS layer (never TLS inside a
    proxy's TLS). None otherwise: the caller reads the body through httpx. httpcore closes a connection
    whose body it did not see to the end, so it is never reused out of step."""
    headers = response.headers
    if (
        response.http_version != "HTTP/1.1"
        or "content-length" not in headers
        or "transfer-encoding" in headers
        or headers.get("content-encoding", "identity").lower() != "identity"
    ):
        return None
    stream = response.extensions.get("network_stream")
    exchange = getattr(stream, "exchange", None)
    if not isinstance(exchange, ResponseBytes) or exchange.head is not None or exchange.body_bytes != delivered:
        return None
    import ssl  # loaded already wherever httpx is

    sock, tls = stream.get_extra_info("socket"), stream.get_extra_info("ssl_object")
    if isinstance(sock, ssl.SSLSocket):
        return sock if tls is not None and tls is getattr(sock, "_sslobj", None) else None
    return sock if type(sock) is socket.socket and tls is None else None


def httpx_transport(httpx: Any, httpcore: Any, inner: Any) -> Any:
    """Wrap an httpx HTTPTransport so each request inside a scope is timed and its sockets reported."""
    pool = getattr(inner, "_pool", None)
    if pool is not None and hasattr(pool, "_network_backend"):
        pool._network_backend = _network_backend(httpcore, pool._network_backend)

    class _Body(httpx.SyncByteStream):
        def __init__(self, stream: Any, scope: Scope) -> None:
            self._stream, self._scope = stream, scope

        def __iter__(self) -> Iterator[bytes]:
            yield from self._stream

        def close(self) -> None:
            try:
                self._stream.close()
            finally:
                _WATCHDOG.end_request(self._scope)

    class DeadlineTransport(httpx.BaseTransport):
        def handle_request(self, request: Any) -> Any:
            scope = current()
            endpoint = f"{request.url.host}:{request.url.port or _default_port(request.url.scheme)}"
            if scope is not None:
                _WATCHDOG.begin(scope, endpoint)
            response = inner.handle_request(request)
            note_answer(endpoint, response.status_code, response.headers)
            if scope is not None:
                response.stream = _Body(response.stream, scope)
            return response

        def close(self) -> None:
            inner.close()

    return DeadlineTransport()


def _default_port(scheme: str) -> int:
    return 443 if scheme == "https" else 80


def _network_backend(httpcore: Any, inner: Any) -> Any:
    def report(stream: Any) -> None:
        scope = current()
        if scope is not None and scope.expires_at is not None:
            sock = stream.get_extra_info("socket")
            if sock is not None:
                scope.io_socket = sock

    class Stream(httpcore.NetworkStream):
        def __init__(self, stream: Any) -> None:
            self._stream = stream
            self.exchange = ResponseBytes()

        def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
            report(self._stream)
            data: bytes = self._stream.read(max_bytes, timeout)
            self.exchange.received(data)
            return data

        def write(self, buffer: bytes, timeout: float | None = None) -> None:
            report(self._stream)
            self.exchange = ResponseBytes()  # a request goes out: what comes back next is its response
            self._stream.write(buffer, timeout)

        def close(self) -> None:
            self._stream.close()

        def start_tls(self, ssl_context: Any, server_hostname: str | None = None, timeout: float | None = None) -> Any:
            return Stream(self._stream.start_tls(ssl_context, server_hostname, timeout))

        def get_extra_info(self, info: str) -> Any:
            return self._stream.get_extra_info(info)

    class Backend(httpcore.NetworkBackend):
        def connect_tcp(self, *args: Any, **kwargs: Any) -> Any:
            return Stream(inner.connect_tcp(*args, **kwargs))

        def connect_unix_socket(self, *args: Any, **kwargs: Any) -> Any:
            return Stream(inner.connect_unix_socket(*args, **kwargs))

        def sleep(self, seconds: float) -> None:
            inner.sleep(seconds)

    return Backend()
