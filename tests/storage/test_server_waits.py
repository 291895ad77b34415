"""Waits a server imposes (Retry-After, RateLimit) and servers that ignore Range, against real servers on 127.0.0.1.

The fake hub (API and CDN) answers chosen requests with a 429 or 503 asking for 999999 s in every form the
standards have; a SlowProxy in front of moto, Azurite and the GCS emulator does the same as a rate-limiting
front end, or strips Range from reads (an S3-compatible server or emulator that ignores it). Every wait must
end within STREAMCTL_MAX_SERVER_WAIT (set to 1 s here), be announced naming the host, count against the
request's deadline, and end at once on a stop request; a Range-ignoring server must never cost the file's
bytes once per part. On the code before, a 999999 s wait slept 11 days (each test fails on its own timeout).
"""

from __future__ import annotations

import email.utils
import hashlib
import os
import random
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from cli_helpers import run_cli
from fakehub import FakeHub, FakeRepo
from servers import azurite_connection_string
from slowproxy import SlowProxy
from streamctl import interrupts
from streamctl.checkpoint.safetensors import safetensors_bytes
from streamctl.errors import DeadlineExceededError, RangeIgnoredError, RemoteError, StreamctlError
from streamctl.retry import RetryPolicy, with_retries
from streamctl.storage import Location, StorageOptions, deadlines, open_location, waits
from streamctl.storage.hf import HfStore

T = TypeVar("T")
MiB = 1024 * 1024
HUGE = 999_999  # seconds: 11.6 days
CAP_S = 1.0  # STREAMCTL_MAX_SERVER_WAIT in these tests
DONE_WITHIN_S = 12.0  # a capped wait plus retries and start-up; a 999999 s wait never gets there
# Valid safetensors files (transfer checks what it copied): 256 KiB and 4 MiB; LFS, so served by the CDN.
WEIGHTS = safetensors_bytes([("model.embed_tokens.weight", "U8", [256 * 1024], os.urandom(256 * 1024))])
BIG = safetensors_bytes([("model.embed_tokens.weight", "U8", [4 * MiB], os.urandom(4 * MiB))])

pytestmark = pytest.mark.timeout(120)


def _waiting_s(line: str) -> int:
    match = re.search(r": waiting (\d+) s", line)
    assert match, line
    return int(match.group(1))


def http_date(seconds_from_now: float) -> str:
    return email.utils.formatdate(time.time() + seconds_from_now, usegmt=True)


def within(seconds: float, function: Callable[[], T]) -> tuple[T, float]:
    """Run `function` on a daemon thread (as transfer's workers do); fail if it is still running after
    `seconds` (the code before: a wait of days), else its result and how long it took."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = function()
        except BaseException as error:  # noqa: BLE001 - handed to the test thread
            outcome["error"] = error

    started = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    elapsed = time.monotonic() - started
    if thread.is_alive():
        pytest.fail(f"still waiting after {seconds:.0f} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"], elapsed


@pytest.fixture
def announced() -> Iterator[list[str]]:
    """The announcements made during the test (what a command's progress shows on stderr)."""
    lines: list[str] = []
    with waits.announcing(lines.append):
        yield lines


@pytest.fixture
def capped(monkeypatch: pytest.MonkeyPatch) -> float:
    monkeypatch.setenv("STREAMCTL_MAX_SERVER_WAIT", str(CAP_S))
    return CAP_S


@pytest.fixture
def no_stop() -> Iterator[None]:
    interrupts.clear_stop()
    yield
    interrupts.clear_stop()


# -- what an answer asks for ------------------------------------------------------------------------------------

NOW = 1_700_000_000.0


@pytest.mark.parametrize(
    ("status", "headers", "expected"),
    [
        (429, {"Retry-After": "120"}, 120.0),
        (503, {"retry-after": "7"}, 7.0),
        (503, {"Retry-After": email.utils.formatdate(NOW + 300, usegmt=True)}, 300.0),
        (429, {"Retry-After": email.utils.formatdate(NOW - 300, usegmt=True)}, 0.0),  # a date past: no wait
        (429, {"RateLimit": '"api";r=0;t=55'}, 55.0),
        (429, {"RateLimit": '"api";r=3;t=55'}, None),  # quota left: the window's reset is no wait
        (429, {"RateLimit": "limit=100, remaining=0, reset=30"}, 30.0),  # an older draft's form
        (429, {"RateLimit-Reset": "40", "RateLimit-Remaining": "0"}, 40.0),
        (429, {"RateLimit-Reset": "40"}, 40.0),
        (503, {"x-ms-retry-after-ms": "1500"}, 1.5),
        (503, {"retry-after-ms": "250"}, 0.25),
        (429, {"Retry-After": "10", "RateLimit": '"a";r=0;t=30'}, 30.0),  # the longest asked
        (500, {"Retry-After": "3"}, 3.0),
        (200, {"Retry-After": "5"}, None),  # not an error: nothing to wait for
        (301, {"Retry-After": "5"}, None),  # a redirect's Retry-After is no back-off
        (429, {"Retry-After": "soon"}, None),
        (429, {}, None),
    ],
)
def test_the_wait_an_answer_asks_for(status: int, headers: dict[str, str], expected: float | None) -> None:
    assert waits.asked_wait(status, headers, now=NOW) == expected


def test_the_announcement_names_host_wait_and_why(capped: float, announced: list[str], no_stop: None) -> None:
    asked = waits.ServerWait("cdn.example:443", HUGE, 429)
    assert waits.announcement(asked, 60, 60, None) == (
        f"rate-limited by cdn.example:443: waiting 60 s (HTTP 429; it asked for {HUGE} s, capped by "
        "STREAMCTL_MAX_SERVER_WAIT)"
    )
    assert "past the request's deadline" in waits.announcement(asked, 12, 60, 12)
    assert waits.announcement(waits.ServerWait("h:80", 30, 503), 30, 60, None) == (
        "rate-limited by h:80: waiting 30 s (HTTP 503)"
    )
    # What a server asks is a floor: `Retry-After: 0` still waits the back-off.
    deadlines.note_answer("h:80", 503, {"Retry-After": "0"})
    started = time.monotonic()
    assert deadlines.pause(0.3) is False
    assert time.monotonic() - started >= 0.29
    assert announced == ["rate-limited by h:80: waiting 0.3 s (HTTP 503)"]
    assert deadlines.asked() is None, "a wait is served once"


@pytest.mark.parametrize(("value", "expected"), [("", 60.0), ("2", 2.0), ("0.5", 0.5), ("0", 60.0), ("x", 60.0)])
def test_the_cap_is_a_setting(value: str, expected: float) -> None:
    assert deadlines.policy({"STREAMCTL_MAX_SERVER_WAIT": value}).max_server_wait_s == expected


# -- the Hub's API and CDN --------------------------------------------------------------------------------------


@pytest.fixture
def model(fake_hub: FakeHub) -> FakeRepo:
    return fake_hub.add_repo("org/model", {"config.json": b'{"architectures": ["X"]}', "model.safetensors": WEIGHTS})


def hf_store(**options: Any) -> HfStore:
    store = open_location("hf://org/model", StorageOptions(max_attempts=3, **options)).store
    assert isinstance(store, HfStore)
    store.retry_wait = 0.01
    return store


def _endpoint(url: str) -> str:
    return url.removeprefix("http://").rstrip("/")


# Where the wait is asked for (the request it answers, and the call that makes it), and in which form.
HF_CASES = {
    "cdn-429-retry-after": ("cdn", 429, {"Retry-After": str(HUGE)}),
    "cdn-503-http-date": ("cdn", 503, {"Retry-After": http_date(HUGE)}),
    "cdn-429-ratelimit": ("cdn", 429, {"RateLimit": f'"cdn";r=0;t={HUGE}', "RateLimit-Policy": '"cdn";q=10;w=60'}),
    "cdn-429-ratelimit-reset": ("cdn", 429, {"RateLimit-Reset": str(HUGE), "RateLimit-Remaining": "0"}),
    "api-revision-429-retry-after": ("revision", 429, {"Retry-After": str(HUGE)}),
    "api-revision-503-ratelimit": ("revision", 503, {"RateLimit": f'"api";r=0;t={HUGE}'}),
    "api-tree-429-http-date": ("tree", 429, {"Retry-After": http_date(HUGE)}),
    "api-tree-503-retry-after": ("tree", 503, {"Retry-After": str(HUGE)}),
}


def _hf_call(where: str, store: HfStore) -> Callable[[], object]:
    if where == "cdn":
        return lambda: store.read_range("model.safetensors", 0, len(WEIGHTS))
    if where == "revision":
        return lambda: store.commit
    return lambda: [info.key for info in store.list("")]


@pytest.mark.parametrize("case", list(HF_CASES), ids=list(HF_CASES))
def test_a_hub_wait_of_days_ends_within_the_cap(
    fake_hub: FakeHub, model: FakeRepo, capped: float, announced: list[str], no_stop: None, case: str
) -> None:
    where, status, headers = HF_CASES[case]
    role = "cdn" if where == "cdn" else "hub"
    pattern = {"cdn": "model.safetensors", "revision": "/revision/", "tree": "/tree/"}[where]
    store = hf_store()
    if where != "revision":
        assert store.commit  # resolved before the fault, so the fault meets the call under test
    fake_hub.fail(pattern, times=1, kind="throttle", role=role, status=status, headers=headers)
    result, elapsed = within(DONE_WITHIN_S, _hf_call(where, store))
    expected = {
        "cdn": WEIGHTS,
        "revision": model.resolve("main"),
        "tree": ["config.json", "model.safetensors"],
    }[where]
    assert result == expected
    assert elapsed >= capped * 0.9, "the server's wait was not served at all"
    host = _endpoint(fake_hub.cdn_endpoint if role == "cdn" else fake_hub.endpoint)
    assert any(line.startswith(f"rate-limited by {host}: waiting 1 s") for line in announced), announced
    assert any("capped by STREAMCTL_MAX_SERVER_WAIT" in line for line in announced), announced


def test_a_stop_request_ends_a_servers_wait_at_once(
    fake_hub: FakeHub, model: FakeRepo, monkeypatch: pytest.MonkeyPatch, announced: list[str], no_stop: None
) -> None:
    """A worker thread waiting out a Retry-After (cap 10 minutes here) ends as soon as the stop flag is set."""
    monkeypatch.setenv("STREAMCTL_MAX_SERVER_WAIT", "600")
    store = hf_store()
    assert store.commit
    fake_hub.fail("model.safetensors", times=100, kind="throttle", role="cdn", headers={"Retry-After": str(HUGE)})
    outcome: dict[str, BaseException] = {}

    def read() -> None:
        try:
            store.read_range("model.safetensors", 0, len(WEIGHTS))
        except BaseException as error:  # noqa: BLE001
            outcome["error"] = error

    worker = threading.Thread(target=read, daemon=True)
    worker.start()
    deadline = time.monotonic() + 10
    while not announced and time.monotonic() < deadline:
        time.sleep(0.02)
    assert announced and _waiting_s(announced[0]) >= 30, announced  # the deadline's 60 s, or the cap's 600
    stopped_at = time.monotonic()
    interrupts.request_stop()
    worker.join(5)
    assert not worker.is_alive(), "the wait did not end on the stop request"
    assert time.monotonic() - stopped_at < 1.0
    assert isinstance(outcome.get("error"), StreamctlError), outcome
    assert fake_hub.count("model.safetensors", role="cdn") == 1, "no try after the stop"


def test_a_servers_wait_counts_against_the_requests_deadline(
    fake_hub: FakeHub, model: FakeRepo, monkeypatch: pytest.MonkeyPatch, announced: list[str], no_stop: None
) -> None:
    """Cap 30 s, deadline 1 s per request: a CDN that always asks for days ends as a deadline failure after
    3 tries of ~1 s each, not after 30 s waits."""
    monkeypatch.setenv("STREAMCTL_MAX_SERVER_WAIT", "30")
    monkeypatch.setenv("STREAMCTL_DEADLINE_BASE_S", "1")
    monkeypatch.setenv("STREAMCTL_DEADLINE_FLOOR_BPS", str(1024 * MiB))  # the body adds nothing to the 1 s
    store = hf_store()
    assert store.commit
    fake_hub.fail("model.safetensors", times=100, kind="throttle", role="cdn", headers={"Retry-After": str(HUGE)})

    def read() -> BaseException | None:
        try:
            store.read_range("model.safetensors", 0, len(WEIGHTS))
        except StreamctlError as error:
            return error
        return None

    error, elapsed = within(DONE_WITHIN_S, read)
    assert isinstance(error, DeadlineExceededError), error
    assert _endpoint(fake_hub.cdn_endpoint) in error.message
    assert 2.5 < elapsed < 6, elapsed
    assert len(announced) == 3 and all("past the request's deadline" in line for line in announced), announced


def test_transfer_from_a_rate_limited_hub_announces_the_wait_and_completes(
    fake_hub: FakeHub, model: FakeRepo, tmp_path: Path
) -> None:
    """The CLI end to end, stderr not a terminal (a pod's log): the wait is announced and capped."""
    fake_hub.fail("model.safetensors", times=1, kind="throttle", role="cdn", headers={"Retry-After": str(HUGE)})
    fake_hub.fail("/tree/", times=1, kind="throttle", role="hub", status=503, headers={"Retry-After": http_date(HUGE)})
    started = time.monotonic()
    result = run_cli(
        "transfer", "hf://org/model", str(tmp_path / "out"), env={"STREAMCTL_MAX_SERVER_WAIT": "1"}, timeout=60
    )
    elapsed = time.monotonic() - started
    assert result.exit_code == 0, result.stderr
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == WEIGHTS
    for host in (_endpoint(fake_hub.cdn_endpoint), _endpoint(fake_hub.endpoint)):
        assert f"rate-limited by {host}: waiting 1 s" in result.stderr, result.stderr
    assert elapsed < 30


def test_quiet_and_json_runs_do_not_announce(fake_hub: FakeHub, model: FakeRepo, tmp_path: Path) -> None:
    fake_hub.fail("model.safetensors", times=1, kind="throttle", role="cdn", headers={"Retry-After": "1"})
    result = run_cli("transfer", "hf://org/model", str(tmp_path / "out"), "--json", timeout=60)
    assert result.exit_code == 0, result.stderr
    assert "rate-limited" not in result.stderr and "rate-limited" not in result.stdout


# -- S3, Azure and GCS behind a rate-limiting front end -----------------------------------------------------------

THROTTLE_ANSWERS: dict[str, tuple[int, dict[str, str], bytes]] = {
    "s3": (
        503,
        {"Retry-After": str(HUGE), "Content-Type": "application/xml"},
        b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>",
    ),
    "az": (
        503,
        {"Retry-After": str(HUGE), "x-ms-error-code": "ServerBusy", "Content-Type": "application/xml"},
        b'<?xml version="1.0" encoding="utf-8"?><Error><Code>ServerBusy</Code><Message>busy</Message></Error>',
    ),
    "gs": (
        429,
        {"Retry-After": http_date(HUGE), "Content-Type": "application/json"},
        b'{"error": {"code": 429, "message": "rate limit exceeded", "errors": []}}',
    ),
}
READS: dict[str, Callable[[str, str], bool]] = {
    "s3": lambda method, path: method == "GET" and "x.bin" in path,
    "az": lambda method, path: method == "GET" and "x.bin" in path,
    "gs": lambda method, path: method == "GET" and "alt=media" in path,
}


def _through(backend: str, root: str, proxy: SlowProxy, monkeypatch: pytest.MonkeyPatch) -> Location:
    """`root` opened with its endpoint pointed at the proxy."""
    if backend == "s3":
        return open_location(root, StorageOptions(endpoint_url=proxy.url, path_style=True, max_attempts=3))
    if backend == "az":
        monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite_connection_string(proxy.url))
    else:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
    return open_location(root, StorageOptions(max_attempts=3))


def _port(storage_servers: Any, backend: str) -> int:
    return int(storage_servers.get(backend).endpoint.rsplit(":", 1)[1])


@pytest.mark.parametrize("backend", ["s3", "az", "gs"])
def test_a_bucket_wait_of_days_ends_within_the_cap(
    backend: str,
    request: pytest.FixtureRequest,
    storage_servers: Any,
    monkeypatch: pytest.MonkeyPatch,
    capped: float,
    announced: list[str],
    no_stop: None,
) -> None:
    root = request.getfixturevalue(f"{backend}_root")
    direct = open_location(root)
    direct.store.put(direct.key("x.bin"), BIG[:100_000])
    status, headers, body = THROTTLE_ANSWERS[backend]
    proxy = SlowProxy(
        _port(storage_servers, backend),
        READS[backend],
        "throttle",
        status=status,
        answer_headers=tuple(headers.items()),
        answer_body=body,
        max_hits=1,
    )
    with proxy:
        location = _through(backend, root, proxy, monkeypatch)
        data, elapsed = within(DONE_WITHIN_S, lambda: location.store.read_range(location.key("x.bin"), 0, 100_000))
    assert data == BIG[:100_000]
    assert proxy.hits == 1
    assert elapsed >= capped * 0.9, "the server's wait was not served"
    assert any(line.startswith(f"rate-limited by {proxy.endpoint}: waiting 1 s") for line in announced), announced


@pytest.mark.parametrize("backend", ["s3", "az"])
def test_a_stop_request_ends_an_sdks_wait_at_once(
    backend: str,
    request: pytest.FixtureRequest,
    storage_servers: Any,
    monkeypatch: pytest.MonkeyPatch,
    announced: list[str],
    no_stop: None,
) -> None:
    monkeypatch.setenv("STREAMCTL_MAX_SERVER_WAIT", "600")
    root = request.getfixturevalue(f"{backend}_root")
    direct = open_location(root)
    direct.store.put(direct.key("x.bin"), b"x" * 1000)
    status, headers, body = THROTTLE_ANSWERS[backend]
    proxy = SlowProxy(
        _port(storage_servers, backend),
        READS[backend],
        "throttle",
        status=status,
        answer_headers=tuple(headers.items()),
        answer_body=body,
    )
    outcome: dict[str, BaseException] = {}
    with proxy:
        location = _through(backend, root, proxy, monkeypatch)

        def read() -> None:
            try:
                location.store.read_range(location.key("x.bin"), 0, 1000)
            except BaseException as error:  # noqa: BLE001
                outcome["error"] = error

        worker = threading.Thread(target=read, daemon=True)
        worker.start()
        deadline = time.monotonic() + 15
        while not announced and time.monotonic() < deadline:
            time.sleep(0.02)
        assert announced and _waiting_s(announced[0]) >= 30, announced
        stopped_at = time.monotonic()
        interrupts.request_stop()
        worker.join(5)
    assert not worker.is_alive(), "the SDK's wait did not end on the stop request"
    assert time.monotonic() - stopped_at < 1.5
    assert isinstance(outcome.get("error"), StreamctlError), outcome
    assert proxy.hits == 1, "no try after the stop"


@pytest.mark.parametrize("backend", ["s3", "az"])
def test_an_sdks_wait_counts_against_the_requests_deadline(
    backend: str,
    request: pytest.FixtureRequest,
    storage_servers: Any,
    monkeypatch: pytest.MonkeyPatch,
    announced: list[str],
    no_stop: None,
) -> None:
    """Cap 30 s, deadline 1 s: a front end that always asks for days ends each try at its deadline (exit 6's
    DeadlineExceededError naming it), not after the SDK's 30 s waits."""
    monkeypatch.setenv("STREAMCTL_MAX_SERVER_WAIT", "30")
    monkeypatch.setenv("STREAMCTL_DEADLINE_BASE_S", "1")
    monkeypatch.setenv("STREAMCTL_DEADLINE_FLOOR_BPS", str(1024 * MiB))
    root = request.getfixturevalue(f"{backend}_root")
    direct = open_location(root)
    direct.store.put(direct.key("x.bin"), b"x" * 1000)
    status, headers, body = THROTTLE_ANSWERS[backend]
    proxy = SlowProxy(
        _port(storage_servers, backend),
        READS[backend],
        "throttle",
        status=status,
        answer_headers=tuple(headers.items()),
        answer_body=body,
    )
    with proxy:
        location = _through(backend, root, proxy, monkeypatch)

        def read() -> BaseException | None:
            try:
                location.store.read_range(location.key("x.bin"), 0, 1000)
            except StreamctlError as error:
                return error
            return None

        error, elapsed = within(DONE_WITHIN_S, read)
    assert isinstance(error, DeadlineExceededError), error
    assert proxy.endpoint in error.message
    assert elapsed < 10, elapsed  # 3 tries of ~1 s and the back-offs between them; 30 s waits would be 90 s
    assert announced and all("past the request's deadline" in line for line in announced), announced


# -- servers that ignore Range ------------------------------------------------------------------------------------


def test_a_cdn_ignoring_range_is_refused_before_the_body(fake_hub: FakeHub) -> None:
    fake_hub.add_repo("org/big", {"model.safetensors": BIG})
    fake_hub.honor_range = False
    store = open_location("hf://org/big", StorageOptions(max_attempts=3)).store
    with pytest.raises(RangeIgnoredError) as caught:
        store.read_range("model.safetensors", 2 * MiB, MiB)
    assert _endpoint(fake_hub.cdn_endpoint) in caught.value.message and "ignored the byte range" in caught.value.message
    assert fake_hub.count("model.safetensors", role="cdn") == 1, "not retried: the server would do it again"
    assert fake_hub.sent["cdn"] < MiB, fake_hub.sent
    # From its start (or a header's few bytes in), the whole-file answer is read only to the range's end.
    fake_hub.sent["cdn"] = 0
    assert store.read_range("model.safetensors", 8, MiB) == BIG[8 : 8 + MiB]
    # The range plus what the loopback's socket buffers took before the hang-up (1.5 MiB seen under load),
    # well under the 4 MiB file.
    assert fake_hub.sent["cdn"] < 2.5 * MiB, fake_hub.sent


@pytest.mark.parametrize("part_size", ["1MiB", "16MiB"])
def test_transfer_from_a_cdn_ignoring_range_reads_the_file_once(
    fake_hub: FakeHub, tmp_path: Path, part_size: str
) -> None:
    """8 MiB in 1 MiB parts: before, each part read the file from its start (36 MiB sent for 8 MiB). Now the
    first part beyond the start is refused before its body and the file is read once, through one stream:
    at most the file plus the first part (and buffers); with parts as large as the file, one read. The copy
    is identical."""
    big = safetensors_bytes([("model.embed_tokens.weight", "U8", [8 * MiB], os.urandom(8 * MiB))])
    fake_hub.add_repo("org/big", {"model.safetensors": big, "config.json": b'{"architectures": ["X"]}'})
    fake_hub.honor_range = False
    out = tmp_path / "out"
    result = run_cli("transfer", "hf://org/big", str(out), "--part-size", part_size, "-j", "4", timeout=60)
    assert result.exit_code == 0, result.stderr
    copied = (out / "model.safetensors").read_bytes()
    assert hashlib.sha256(copied).hexdigest() == hashlib.sha256(big).hexdigest()
    # Plus, with 1 MiB parts: the first part, and what the kernel buffered for the refused parts in flight
    # and the check's header reads before each hung up (~256 KiB each).
    # (3.06 MiB seen on a loaded 2-core machine; before the fix 8 MiB in 1 MiB parts cost 46.9 MB.)
    bound = len(big) + (4 * MiB if part_size == "1MiB" else 512 * 1024)
    assert fake_hub.sent["cdn"] <= bound, f"{fake_hub.sent['cdn']:,} bytes sent for a {len(big):,}-byte file"


def test_transfer_from_a_bucket_ignoring_range_stops_with_a_clear_error(
    s3_root: str, storage_servers: Any, storage_env: dict[str, str], tmp_path: Path
) -> None:
    """12 MiB in S3's 5 MiB parts from a server that ignores Range: before, every part read the whole
    object (36 MiB). S3 sources have no one-stream path: the clear error (exit 6, the endpoint, the
    --part-size way out) after the first part, never the object once per part; nothing under a final name."""
    data = safetensors_bytes([("model.embed_tokens.weight", "U8", [12 * MiB], os.urandom(12 * MiB))])
    direct = open_location(s3_root)
    direct.store.put(direct.key("model.safetensors"), data)
    direct.store.put(direct.key("config.json"), b'{"architectures": ["X"]}')
    reads = lambda method, path: method == "GET" and "model.safetensors" in path  # noqa: E731
    out = tmp_path / "out"
    with SlowProxy(_port(storage_servers, "s3"), reads, "no_range") as proxy:
        env = {**storage_env, "AWS_ENDPOINT_URL": proxy.url}
        result = run_cli("transfer", s3_root, str(out), "--part-size", "5MiB", "-j", "2", env=env, timeout=60)
    assert result.exit_code == 6, result.stderr
    assert f"{proxy.endpoint} ignored the byte range" in result.stderr and "--part-size" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (out / "model.safetensors").exists()
    assert proxy.sent <= len(data), f"{proxy.sent:,} bytes sent for a {len(data):,}-byte object"


@pytest.mark.parametrize("backend", ["s3", "gs"])
def test_a_bucket_ignoring_range_never_costs_the_object_per_part(
    backend: str, request: pytest.FixtureRequest, storage_servers: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 16 MiB object: a refused read costs at most what the kernel buffers; a read from byte 0 of 1 MiB,
    that plus what the client's (autotuned) receive buffer took before it hung up: never the object."""
    root = request.getfixturevalue(f"{backend}_root")
    direct = open_location(root)
    data = os.urandom(16 * MiB)
    direct.store.put(direct.key("x.bin"), data)
    reads = {
        "s3": lambda method, path: method == "GET" and "x.bin" in path,
        "gs": lambda method, path: method == "GET" and "alt=media" in path,
    }[backend]
    with SlowProxy(_port(storage_servers, backend), reads, "no_range") as proxy:
        location = _through(backend, root, proxy, monkeypatch)
        with pytest.raises(RangeIgnoredError) as caught:
            location.store.read_range(location.key("x.bin"), 2 * MiB, MiB)
        assert proxy.endpoint in caught.value.message
        assert proxy.hits == 1, "not retried"
        assert proxy.sent < 1.5 * MiB, proxy.sent
        sent = proxy.sent
        buffer = bytearray(MiB)
        assert location.store.read_range_into(location.key("x.bin"), 0, memoryview(buffer)) == MiB
        assert bytes(buffer) == data[:MiB]
        assert proxy.sent - sent < 8 * MiB, proxy.sent - sent


# -- streamctl's own back-offs ------------------------------------------------------------------------------------


def test_a_stop_request_ends_streamctls_own_backoff_at_once(no_stop: None) -> None:
    """retry.py's wait between whole-operation tries (here up to 100 s) ends as soon as the flag is set,
    with the operation's last error; no try follows."""
    tries: list[float] = []

    def failing() -> None:
        tries.append(time.monotonic())
        raise RemoteError("the server is down")

    policy = RetryPolicy(attempts=5, base_delay_s=100.0, max_delay_s=100.0)
    threading.Timer(0.3, interrupts.request_stop).start()

    def run() -> BaseException | None:
        try:
            with_retries(failing, policy)
        except RemoteError as error:
            return error
        return None

    random.seed(1)  # a first delay of tens of seconds, so the code before fails here for certain
    error, elapsed = within(5.0, run)
    assert isinstance(error, RemoteError) and error.message == "the server is down"
    assert len(tries) == 1 and elapsed < 1.5, (len(tries), elapsed)
