"""Azure without credentials: one quick try of the credential chain, no SDK log, exit 4.

The chain's managed-identity step is pointed at a local IMDS stand-in (AZURE_POD_IDENTITY_AUTHORITY_HOST) that
counts its requests and answers "no identity"; HTTPS_PROXY points at a closed local port, so nothing could
reach Azure even by mistake (the network guard in conftest.py would fail the test too).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from cli_helpers import run_cli
from servers import AZURITE_ACCOUNT, free_port
from streamctl import sdklogging

pytestmark = pytest.mark.timeout(120)


class _Imds(ThreadingHTTPServer):
    requests = 0


class _NoIdentity(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        assert isinstance(self.server, _Imds)
        self.server.requests += 1
        body = json.dumps({"error": "invalid_request", "error_description": "Identity not found"}).encode()
        self.send_response(400)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def imds() -> Iterator[_Imds]:
    server = _Imds(("127.0.0.1", 0), _NoIdentity)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def _no_credentials_env(imds: _Imds, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    # run_cli starts from os.environ, which holds Azurite's connection string once another test started it.
    for name in list(os.environ):
        if name.startswith(("AZURE_", "IDENTITY_", "MSI_")):
            monkeypatch.delenv(name)
    env = dict(os.environ)
    env.update(
        AZURE_STORAGE_ACCOUNT_NAME=AZURITE_ACCOUNT,
        AZURE_POD_IDENTITY_AUTHORITY_HOST=f"http://127.0.0.1:{imds.server_address[1]}",
        HTTPS_PROXY=f"http://127.0.0.1:{free_port()}",  # closed: no request leaves this machine
        NO_PROXY="",
        HOME=str(tmp_path),  # no ~/.azure token cache of whoever runs the tests
        PATH="/usr/bin:/bin",  # no az, azd or pwsh
    )
    return env


@pytest.mark.parametrize(
    "args",
    [
        ("verify-index", "az://models/llama"),
        ("serve", "az://models/llama", "--dry-run"),
        ("transfer", "az://models/llama", "OUT"),
    ],
    ids=["verify-index", "serve", "transfer"],
)
def test_azure_without_credentials_fails_fast_and_quietly(
    args: tuple[str, ...], imds: _Imds, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = _no_credentials_env(imds, tmp_path, monkeypatch)
    argv = [str(tmp_path / "out") if arg == "OUT" else arg for arg in args]
    started = time.monotonic()
    result = run_cli(*argv, "--quiet", "--json", env=env, timeout=90)
    elapsed = time.monotonic() - started
    assert result.exit_code == 4, (result.exit_code, result.stderr)
    assert elapsed < 10, f"took {elapsed:.1f} s"
    assert imds.requests <= 1, f"the credential chain ran {imds.requests} times"
    assert "Attempted credentials" not in result.stderr and "DefaultAzureCredential failed" not in result.stderr
    assert len(result.stderr.splitlines()) <= 4, result.stderr  # the error and its hint, nothing else
    message = result.stderr if result.stderr.strip() else result.stdout
    for tried in ("ManagedIdentity", "AzureCli", "Environment"):
        assert tried in message, message


def test_debug_shows_the_sdk_logs(imds: _Imds, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = _no_credentials_env(imds, tmp_path, monkeypatch)
    result = run_cli("--debug", "verify-index", "az://models/llama", env=env, timeout=90)
    assert result.exit_code == 4
    assert "azure.identity" in result.stderr


def test_sdk_loggers_are_silent_unless_debug() -> None:
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep()
    logging.getLogger().addHandler(handler)
    levels = {name: logging.getLogger(name).level for name in sdklogging.SDK_LOGGERS}
    try:
        sdklogging.configure(debug=False)
        sdklogging.apply_all()
        for name in (
            "azure.identity._credentials.chained",
            "botocore.retryhandler",
            "urllib3.connectionpool",
            "google.auth._default",
            "huggingface_hub.utils._http",
        ):
            logging.getLogger(name).warning("noise")
        assert records == []
    finally:
        logging.getLogger().removeHandler(handler)
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
