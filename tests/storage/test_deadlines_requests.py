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

pytestmark = pytest.mark.timeout(150)

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


@pytest.fixture(params=["s3", "gs", "az", "hf"])
def source(request: pytest.FixtureRequest, fake_hub: Any) -> Iterator[tuple[str, str]]:
    """(backend, URL) of a small valid HF checkpoint on that backend, written directly (not via the proxy)."""
    backend = request.param
    if backend == "hf":
        staging = open_location(str(request.getfixturevalue("tmp_path") / "staging"))
        write_hf_checkpoint(staging)
        files = {info.key: staging.store.read_range(info.key, 0, info.size) for info in staging.list()}
        fake_hub.add_repo("org/slow", files)
        fake_hub.redirect_lfs = False  # every byte from the hub, i.e. through the proxy
        yield backend, "hf://org/slow"
        return
    root = request.getfixturevalue(f"{backend}_root")
    write_hf_checkpoint(open_location(root))
    yield backend, root


def _assert_deadline_failure(result: Any, proxy: SlowProxy, elapsed: float) -> None:
    assert result.exit_code == 6, (result.exit_code, result.stdout, result.stderr)
    assert proxy.endpoint in result.stderr, result.stderr
    assert "within" in result.stderr
    assert f"{ATTEMPTS} attempts" in result.stderr, "STREAMCTL_MAX_ATTEMPTS was not applied"
    assert "Traceback" not in result.stderr
    assert elapsed < BOUND_S, f"took {elapsed:.1f} s, bound {BOUND_S:.1f} s"
    assert proxy.hits >= 1


def _run(*args: str, env: dict[str, str]) -> tuple[Any, float]:
    started = time.monotonic()
    result = run_cli(*args, env=env, timeout=CLI_TIMEOUT_S)
    return result, time.monotonic() - started


# Each backend meets two of the three ways to hang (all three on S3), to keep the suite's time down.
MODES = {
    "s3": ("dribble", "silent", "slow_head"),
    "gs": ("dribble", "slow_head"),
    "az": ("silent", "dribble"),
    "hf": ("slow_head", "silent"),
}


@pytest.mark.parametrize("mode", ["dribble", "silent", "slow_head"])
def test_verify_index_ends_when_the_listing_hangs(
    source: tuple[str, str], mode: str, storage_servers: Any, storage_env: dict[str, str], fake_hub: Any
) -> None:
    backend, url = source
    if mode not in MODES[backend]:
        pytest.skip(f"{mode} is covered on other backends")
    with SlowProxy(_upstream_port(backend, storage_servers, fake_hub), LISTING[backend], mode, 0.5) as proxy:
        result, elapsed = _run("verify-index", url, "--quiet", env=_env_through(backend, proxy, storage_env))
    _assert_deadline_failure(result, proxy, elapsed)


def test_transfer_ends_when_a_read_dribbles(
    source: tuple[str, str], tmp_path: Path, storage_servers: Any, storage_env: dict[str, str], fake_hub: Any
) -> None:
    backend, url = source
    with SlowProxy(_upstream_port(backend, storage_servers, fake_hub), READS[backend], "dribble", 0.5) as proxy:
        result, elapsed = _run(
            "transfer", url, str(tmp_path / "out"), "--quiet", env=_env_through(backend, proxy, storage_env)
        )
    _assert_deadline_failure(result, proxy, elapsed)
    assert not any((tmp_path / "out").glob("*.safetensors")), "nothing under a final name"


def test_serve_dry_run_preflight_ends_when_a_header_read_hangs(
    source: tuple[str, str], storage_servers: Any, storage_env: dict[str, str], fake_hub: Any
) -> None:
    backend, url = source
    if backend == "hf":
        pytest.skip("serve takes a bucket prefix or a local folder, not an hf:// repo")
    with SlowProxy(_upstream_port(backend, storage_servers, fake_hub), READS[backend], "silent") as proxy:
        result, elapsed = _run("serve", url, "--dry-run", env=_env_through(backend, proxy, storage_env))
    _assert_deadline_failure(result, proxy, elapsed)


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
