"""Per-request overall deadlines (storage/deadlines.py) against a real slow server on 127.0.0.1.

A SlowProxy (tests/slowproxy.py) sits in front of moto, the GCS emulator, Azurite or the fake hub and answers
chosen requests never, one byte at a time, or slowly but steadily. Every command that reads a remote source
(`transfer`, `verify-index`, `serve --dry-run`'s pre-flight) must end with exit 6 naming the endpoint within
deadline x attempts (+ slack), and a server above the floor rate must not be cut. On the code before the
deadlines these commands ran for many minutes: the subprocess timeout (and pytest-timeout) fails them.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from checkpoints import write_hf_checkpoint
from cli_helpers import run_cli
from servers import azurite_connection_string
from slowproxy import SlowProxy
from streamctl.checkpoint.safetensors import safetensors_bytes
from streamctl.errors import DeadlineExceededError
from streamctl.storage import StorageOptions, open_location
from streamctl.storage.base import default_max_attempts

BASE_S = 1.5  # STREAMCTL_DEADLINE_BASE_S for these tests
# STREAMCTL_MAX_ATTEMPTS for these tests (StorageOptions.max_attempts; the CLI's default is 5): each hanging
# run waits out every attempt, so fewer keep the module's time down while still retrying a cut request.
ATTEMPTS = 3
# Per attempt: the deadline, then an SDK's own back-off before its retry is refused (<= ~2 s); between
# attempts streamctl's back-off (<= 0.5 + 1 s); plus interpreter and SDK start-up.
BOUND_S = ATTEMPTS * (BASE_S + 2.0) + 1.5 + 15.0
CLI_TIMEOUT_S = 90.0  # the old code runs for >900 s here: this fails it instead of hanging

pytestmark = pytest.mark.timeout(300)  # the first test also waits for the `hangs` fixture

# Which requests to slow down, per backend: listings, and reads of the safetensors files (the source's data).
LISTING: dict[str, Callable[[str, str], bool]] = {
    "s3": lambda method, path: method == "GET" and "list-type=2" in path,
    "gs": lambda method, path: method == "GET" and re.search(r"/o\?", path) is not None,
    "az": lambda method, path: method == "GET" and "comp=list" in path,
    "hf": lambda method, path: method == "GET" and "/tree/" in path,
}
READS: dict[str, Callable[[str, str], bool]] = {
    "s3": lambda method, path: method == "GET" and ".safetensors" in path and "list-type" not in path,
    "gs": lambda method, path: method == "GET" and "alt=media" in path and ".safetensors" in path,
    "az": lambda method, path: method == "GET" and ".safetensors" in path and "comp=" not in path,
    "hf": lambda method, path: method == "GET" and "/resolve/" in path and ".safetensors" in path,
}


def _upstream_port(backend: str, storage_servers: Any, fake_hub: Any) -> int:
    endpoint = fake_hub.endpoint if backend == "hf" else storage_servers.get(backend).endpoint
    return int(endpoint.rsplit(":", 1)[1])


def _env_through(backend: str, proxy: SlowProxy, storage_env: dict[str, str], **extra: str) -> dict[str, str]:
    """The CLI's environment with the backend's endpoint pointed at the proxy."""
    env = {**storage_env, "STREAMCTL_DEADLINE_BASE_S": str(BASE_S), "STREAMCTL_MAX_ATTEMPTS": str(ATTEMPTS), **extra}
    if backend == "s3":
        env["AWS_ENDPOINT_URL"] = proxy.url
    elif backend == "gs":
        env["STORAGE_EMULATOR_HOST"] = proxy.url
    elif backend == "az":
        env["AZURE_STORAGE_CONNECTION_STRING"] = azurite_connection_string(proxy.url)
    else:
        env["HF_ENDPOINT"] = proxy.url
    return env


def _source(backend: str, storage_servers: Any, fake_hub: Any, scratch: Path) -> str:
    """The URL of a small valid HF checkpoint on that backend, written directly (not via the proxy)."""
    if backend == "hf":
        staging = open_location(str(scratch / "staging"))
        write_hf_checkpoint(staging)
        files = {info.key: staging.store.read_range(info.key, 0, info.size) for info in staging.list()}
        fake_hub.add_repo("org/slow", files)
        fake_hub.redirect_lfs = False  # every byte from the hub, i.e. through the proxy
        return "hf://org/slow"
    server = storage_servers.get(backend)
    bucket = server.new_container() if backend == "az" else server.new_bucket()
    root = f"{backend}://{bucket}/data"
    write_hf_checkpoint(open_location(root))
    return root


# Each backend meets two of the three ways to hang (all three on S3), to keep the suite's time down.
MODES = {
    "s3": ("dribble", "silent", "slow_head"),
    "gs": ("dribble", "slow_head"),
    "az": ("silent", "dribble"),
    "hf": ("slow_head", "silent"),
}


@dataclass(frozen=True)
class Hang:
    """One command against one backend whose chosen requests hang in one way."""

    command: str  # "verify-index" (the listing hangs), "transfer" (a read dribbles), "serve" (a header read)
    backend: str
    mode: str

    @property
    def id(self) -> str:
        return f"{self.command}-{self.backend}-{self.mode}"


HANGS = [
    *(Hang("verify-index", backend, mode) for backend, modes in MODES.items() for mode in modes),
    *(Hang("transfer", backend, "dribble") for backend in MODES),
    *(Hang("serve", backend, "silent") for backend in MODES if backend != "hf"),  # serve takes no hf:// repo
]
CONCURRENT_HANGS = 3  # each run mostly waits on its deadlines; more would compete for 2 cores at start-up


@dataclass(frozen=True)
class HangOutcome:
    result: Any  # CliResult
    elapsed: float
    endpoint: str  # the proxy's host:port
    hits: int  # requests the proxy slowed down
    out: Path | None  # transfer's DEST


def _run_hang(hang: Hang, url: str, env: dict[str, str], upstream: int, scratch: Path) -> HangOutcome:
    matches = LISTING if hang.command == "verify-index" else READS
    with SlowProxy(upstream, matches[hang.backend], hang.mode, 0.5) as proxy:
        env = _env_through(hang.backend, proxy, env)
        out = scratch / hang.id / "out" if hang.command == "transfer" else None
        args = {
            "verify-index": ("verify-index", url, "--quiet"),
            "transfer": ("transfer", url, str(out), "--quiet"),
            "serve": ("serve", url, "--dry-run"),
        }[hang.command]
        result, elapsed = _run(*args, env=env)
        return HangOutcome(result, elapsed, proxy.endpoint, proxy.hits, out)


@pytest.fixture(scope="module")
def hangs(
    storage_servers: Any,
    fake_hub_server: Any,
    _storage_session_env: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, HangOutcome]]:
    """Every HANGS case, CONCURRENT_HANGS at a time: each one spends its time waiting out deadlines and
    back-offs (~5-15 s), so one after another they took most of three minutes."""
    scratch = tmp_path_factory.mktemp("hangs")
    fake_hub_server.reset()
    try:
        urls = {backend: _source(backend, storage_servers, fake_hub_server, scratch / backend) for backend in MODES}
        env = {**_storage_session_env, **storage_servers.env()}
        with ThreadPoolExecutor(CONCURRENT_HANGS) as pool:
            futures = {
                hang.id: pool.submit(
                    _run_hang, hang, urls[hang.backend], env,
                    _upstream_port(hang.backend, storage_servers, fake_hub_server), scratch,
                )
                for hang in HANGS
            }  # fmt: skip
            yield {name: future.result() for name, future in futures.items()}
    finally:
        fake_hub_server.reset()


def _assert_deadline_failure(outcome: HangOutcome) -> None:
    result = outcome.result
    assert result.exit_code == 6, (result.exit_code, result.stdout, result.stderr)
    assert outcome.endpoint in result.stderr, result.stderr
    assert "within" in result.stderr
    assert f"{ATTEMPTS} attempts" in result.stderr, "STREAMCTL_MAX_ATTEMPTS was not applied"
    assert "Traceback" not in result.stderr
    assert outcome.elapsed < BOUND_S, f"took {outcome.elapsed:.1f} s, bound {BOUND_S:.1f} s"
    assert outcome.hits >= 1


def _run(*args: str, env: dict[str, str]) -> tuple[Any, float]:
    started = time.monotonic()
    result = run_cli(*args, env=env, timeout=CLI_TIMEOUT_S)
    return result, time.monotonic() - started


@pytest.mark.parametrize("hang", [hang for hang in HANGS if hang.command == "verify-index"], ids=lambda h: h.id)
def test_verify_index_ends_when_the_listing_hangs(hangs: dict[str, HangOutcome], hang: Hang) -> None:
    _assert_deadline_failure(hangs[hang.id])


@pytest.mark.parametrize("hang", [hang for hang in HANGS if hang.command == "transfer"], ids=lambda h: h.id)
def test_transfer_ends_when_a_read_dribbles(hangs: dict[str, HangOutcome], hang: Hang) -> None:
    outcome = hangs[hang.id]
    _assert_deadline_failure(outcome)
    assert outcome.out is not None
    assert not any(outcome.out.glob("*.safetensors")), "nothing under a final name"


@pytest.mark.parametrize("hang", [hang for hang in HANGS if hang.command == "serve"], ids=lambda h: h.id)
def test_serve_dry_run_preflight_ends_when_a_header_read_hangs(hangs: dict[str, HangOutcome], hang: Hang) -> None:
    _assert_deadline_failure(hangs[hang.id])


def _large_checkpoint(root: str, size: int) -> None:
    location = open_location(root)
    data = safetensors_bytes([("model.embed_tokens.weight", "U8", [size], os.urandom(size))])
    location.store.put(location.key("model.safetensors"), data)
    location.store.put(location.key("config.json"), b'{"architectures": ["LlamaForCausalLM"]}')


@pytest.mark.parametrize("backend", ["s3", "gs", "az"])
def test_a_slow_but_steady_server_is_not_cut(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path, storage_servers: Any, fake_hub: Any
) -> None:
    root = request.getfixturevalue(f"{backend}_root")
    storage_env = request.getfixturevalue("storage_env")
    _large_checkpoint(root, 768 * 1024)
    # 256 KiB/s: each read of the 768 KiB file takes ~3 s, twice the 1.5 s base, but the floor rate of
    # 64 KiB/s gives it 1.5 + 12 s.
    port = _upstream_port(backend, storage_servers, fake_hub)
    with SlowProxy(port, READS[backend], "steady", rate_bps=256 * 1024) as proxy:
        env = _env_through(backend, proxy, storage_env, STREAMCTL_DEADLINE_FLOOR_BPS="65536")
        result, elapsed = _run("transfer", root, str(tmp_path / "out"), "--quiet", env=env)
    assert result.exit_code == 0, result.stderr
    assert proxy.hits >= 1
    assert elapsed > BASE_S + 1.0, "the server was not slow: the test proves nothing"
    assert (tmp_path / "out" / "model.safetensors").stat().st_size > 768 * 1024


def test_in_process_deadline_error_names_endpoint_and_attempts(
    s3_root: str, storage_servers: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The library's own error: a DeadlineExceededError, after `max_attempts` cut attempts, no credentials."""
    monkeypatch.setenv("STREAMCTL_DEADLINE_BASE_S", "0.5")
    location = open_location(s3_root)
    location.store.put(location.key("x.bin"), b"0123456789" * 100)
    port = int(storage_servers.s3().endpoint.rsplit(":", 1)[1])
    with SlowProxy(port, lambda method, path: method == "GET", "dribble", 0.2) as proxy:
        slow = open_location(s3_root, StorageOptions(endpoint_url=proxy.url, path_style=True, max_attempts=2))
        started = time.monotonic()
        with pytest.raises(DeadlineExceededError) as caught:
            slow.store.read_range(slow.key("x.bin"), 0, 1000)
        elapsed = time.monotonic() - started
    assert proxy.hits == 2, "one request per attempt: the SDK's own retries are refused once cut"
    assert proxy.endpoint in caught.value.message and "2 attempts" in caught.value.message
    assert "testing" not in caught.value.message
    assert elapsed < 2 * (0.5 + 2.0) + 5.0


@pytest.mark.parametrize(
    ("value", "expected"), [("", 5), ("3", 3), ("1", 1), ("0", 5), ("-2", 5), ("two", 5), ("2.5", 5), (" 4", 5)]
)
def test_max_attempts_come_from_the_environment_when_valid(value: str, expected: int) -> None:
    assert default_max_attempts({"STREAMCTL_MAX_ATTEMPTS": value}) == expected
    assert StorageOptions().max_attempts == default_max_attempts()


@pytest.mark.parametrize("command", ["verify-index", "transfer"])
def test_ctrl_c_ends_a_run_stuck_on_a_silent_server(
    command: str, s3_root: str, tmp_path: Path, storage_servers: Any, storage_env: dict[str, str]
) -> None:
    """With the default (long) deadlines, Ctrl-C still ends the run at once: requests in flight on worker
    threads are cut, so the thread pools' shutdown does not wait for them."""
    write_hf_checkpoint(open_location(s3_root))
    port = int(storage_servers.s3().endpoint.rsplit(":", 1)[1])
    with SlowProxy(port, READS["s3"], "silent") as proxy:
        env = {**os.environ, **storage_env, "AWS_ENDPOINT_URL": proxy.url}
        env.pop("STREAMCTL_DEADLINE_BASE_S", None)
        dest = [str(tmp_path / "out")] if command == "transfer" else []
        process = subprocess.Popen(
            [sys.executable, "-m", "streamctl", command, s3_root, *dest, "--quiet"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            deadline = time.monotonic() + 30
            while proxy.hits == 0 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert proxy.hits >= 1, "the transfer never reached a read"
            time.sleep(0.5)
            process.send_signal(signal.SIGINT)
            started = time.monotonic()
            _, stderr = process.communicate(timeout=20)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert process.returncode == 130, stderr
    assert time.monotonic() - started < 10
