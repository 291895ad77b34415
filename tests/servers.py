"""Local stand-ins for S3 (moto), GCS (gcp-storage-emulator) and Azure Blob (Azurite) for the test session.

Each server runs as its own process group on a free 127.0.0.1 port, is polled until it answers HTTP, and is
stopped by process group at the end. A server that cannot be found or started raises `ServerUnavailable`
with the install command and the tail of its log: tests that need it fail loudly instead of skipping.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

AZURITE_ACCOUNT = "devstoreaccount1"
# Azurite's published, well-known development key (not a secret).
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
AZURITE_CACHE_BIN = Path("/root/.cache/streamctl/node/node_modules/.bin/azurite-blob")
GCS_PROJECT = "streamctl-test"
STARTUP_TIMEOUT_S = 30.0
PATCHED_SERVERS = Path(__file__).with_name("patched_servers.py")


class ServerUnavailable(RuntimeError):
    """A test server could not be found or started."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _answers_http(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except urllib.error.HTTPError:
        return True  # any HTTP status means the server is up (Azurite answers 400/403 unauthenticated)
    except (urllib.error.URLError, OSError):
        return False


@dataclass
class ServerProcess:
    name: str
    port: int
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """Stop the whole process group (node and Python servers may fork helpers)."""
        if self.process.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.process.wait(timeout=wait_s)
                return
            except subprocess.TimeoutExpired:
                continue


def start_process(
    name: str,
    argv_for_port: Callable[[int], list[str]],
    ready_path: str,
    workdir: Path,
    env: dict[str, str] | None = None,
    timeout_s: float = STARTUP_TIMEOUT_S,
    attempts: int = 3,
) -> ServerProcess:
    """Start a server on a free port and wait until it answers; retry on a new port if it dies early

    (another process may take the port between our probe and the server's bind).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    last: ServerProcess | None = None
    for attempt in range(attempts):
        port = free_port()
        log_path = workdir / f"{name}-{attempt}.log"
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                argv_for_port(port),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=workdir,
                env={**os.environ, **(env or {})},
                start_new_session=True,  # own process group, so stop() reaches its children
            )
        server = ServerProcess(name, port, process, log_path)
        last = server
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and process.poll() is None:
            if _answers_http(server.base_url + ready_path):
                return server
            time.sleep(0.1)
        died = process.poll() is not None
        server.stop()
        if not died:
            break  # hung rather than died: another port will not help
    assert last is not None
    raise ServerUnavailable(f"{name} did not start within {timeout_s:.0f} s; log tail:\n{last.log_tail()}")


def _require_module(module: str, install: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ServerUnavailable(f"{module} is not installed in {sys.executable}; install it with: {install}")


def unique_name(prefix: str = "t") -> str:
    """A bucket/container name valid on S3, GCS and Azure: lower case, digits and '-', 3..63 characters."""
    return f"{prefix}-{uuid.uuid4().hex[:20]}"


# -- S3: moto ---------------------------------------------------------------------------------------------


@dataclass
class S3Server:
    server: ServerProcess
    _client: Any = None

    @property
    def endpoint(self) -> str:
        return self.server.base_url

    @property
    def env(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": self.endpoint}

    def client(self, **credentials: str) -> Any:
        import boto3

        if credentials:
            return boto3.session.Session(**credentials).client(
                "s3", endpoint_url=self.endpoint, region_name="us-east-1"
            )
        if self._client is None:
            self._client = boto3.session.Session(
                aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1"
            ).client("s3", endpoint_url=self.endpoint)
        return self._client

    def new_bucket(self) -> str:
        name = unique_name()
        self.client().create_bucket(Bucket=name)
        return name

    def set_auth(self, enabled: bool) -> None:
        """Switch moto's IAM authentication on or off for every later request (moto's reset-auth API)."""
        request = urllib.request.Request(
            f"{self.endpoint}/moto-api/reset-auth",
            data=b"0" if enabled else b"inf",
            method="POST",
            # Not form-encoded: Flask would parse a form body away and moto would read an empty one.
            headers={"Content-Type": "text/plain"},
        )
        with urllib.request.urlopen(request, timeout=10):
            pass

    def iam_client(self) -> Any:
        import boto3

        return boto3.session.Session(
            aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1"
        ).client("iam", endpoint_url=self.endpoint)


def start_s3(workdir: Path) -> S3Server:
    _require_module("moto", "pip install 'moto[s3,server]' flask flask-cors")
    server = start_process(
        "moto-s3",
        # moto.server, with the upload times real S3 reports (see patched_servers.py)
        lambda port: [sys.executable, str(PATCHED_SERVERS), "moto", "-H", "127.0.0.1", "-p", str(port)],
        "/moto-api/",
        workdir,
        # Authentication starts off; set_auth() turns it on for the access-denied test.
        env={"INITIAL_NO_AUTH_ACTION_COUNT": "inf"},
    )
    return S3Server(server)


# -- GCS: gcp-storage-emulator ----------------------------------------------------------------------------


@dataclass
class GCSServer:
    server: ServerProcess
    _client: Any = None

    @property
    def endpoint(self) -> str:
        return self.server.base_url

    @property
    def env(self) -> dict[str, str]:
        return {"STORAGE_EMULATOR_HOST": self.endpoint}

    def client(self) -> Any:
        if self._client is None:
            from google.auth.credentials import AnonymousCredentials
            from google.cloud import storage

            self._client = storage.Client(
                project=GCS_PROJECT,
                credentials=AnonymousCredentials(),
                client_options={"api_endpoint": self.endpoint},
            )
        return self._client

    def new_bucket(self) -> str:
        name = unique_name()
        self.client().create_bucket(name)
        return name

    def object_names(self, bucket: str) -> list[str]:
        """Every object in `bucket`, temporary part objects included (the store's list() hides those)."""
        return sorted(blob.name for blob in self.client().list_blobs(bucket))


def start_gcs(workdir: Path) -> GCSServer:
    _require_module("gcp_storage_emulator", "pip install gcp-storage-emulator")
    server = start_process(
        "gcs-emulator",
        lambda port: [  # gcp_storage_emulator, with GCS's ifGenerationMatch (see patched_servers.py)
            sys.executable,
            str(PATCHED_SERVERS),
            "gcs",
            "start",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--in-memory",
        ],
        "/",
        workdir,
    )
    return GCSServer(server)


# -- Azure Blob: Azurite ----------------------------------------------------------------------------------


def find_azurite() -> str | None:
    """$STREAMCTL_AZURITE, else `azurite-blob` on PATH, else the copy this project caches."""
    configured = os.environ.get("STREAMCTL_AZURITE")
    if configured:
        return configured if Path(configured).exists() else None
    on_path = shutil.which("azurite-blob")
    if on_path:
        return on_path
    return str(AZURITE_CACHE_BIN) if AZURITE_CACHE_BIN.exists() else None


def azurite_connection_string(endpoint: str, key: str = AZURITE_KEY) -> str:
    return (
        f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={key};"
        f"BlobEndpoint={endpoint}/{AZURITE_ACCOUNT};"
    )


@dataclass
class AzureServer:
    server: ServerProcess
    _service: Any = None

    @property
    def endpoint(self) -> str:
        return self.server.base_url

    @property
    def connection_string(self) -> str:
        return azurite_connection_string(self.endpoint)

    @property
    def env(self) -> dict[str, str]:
        return {"AZURE_STORAGE_CONNECTION_STRING": self.connection_string}

    def service(self) -> Any:
        if self._service is None:
            from azure.storage.blob import BlobServiceClient

            self._service = BlobServiceClient.from_connection_string(self.connection_string, retry_total=0)
        return self._service

    def new_container(self) -> str:
        name = unique_name()
        self.service().create_container(name)
        return name


def start_azurite(workdir: Path) -> AzureServer:
    binary = find_azurite()
    if binary is None:
        raise ServerUnavailable(
            "Azurite not found: set STREAMCTL_AZURITE to the azurite-blob binary, put azurite-blob on PATH, "
            f"or run `source .ci/setup` (npm install --prefix {AZURITE_CACHE_BIN.parents[2]} azurite@3.35.0)"
        )
    # No --location: Azurite 3.35 refuses it together with --inMemoryPersistence (it writes nothing then;
    # the working directory is the server's own folder anyway).
    server = start_process(
        "azurite",
        lambda port: [
            binary,
            "--blobHost",
            "127.0.0.1",
            "--blobPort",
            str(port),
            "--skipApiVersionCheck",
            "--disableTelemetry",
            "--inMemoryPersistence",
        ],
        f"/{AZURITE_ACCOUNT}?comp=list",
        workdir,
    )
    return AzureServer(server)


# -- the session's registry -------------------------------------------------------------------------------


@dataclass
class StorageServers:
    """Starts each server on first request, remembers failures (so they fail fast), stops all at the end."""

    workdir: Path
    on_env: Callable[[dict[str, str]], None]  # called with a server's env vars once it is up
    _started: dict[str, Any] = field(default_factory=dict)
    _failed: dict[str, ServerUnavailable] = field(default_factory=dict)

    def _get(self, name: str, start: Callable[[Path], Any]) -> Any:
        if name in self._failed:
            raise self._failed[name]
        if name not in self._started:
            try:
                server = start(self.workdir / name)
            except ServerUnavailable as error:
                self._failed[name] = error
                raise
            self._started[name] = server
            self.on_env(server.env)
        return self._started[name]

    def s3(self) -> S3Server:
        return self._get("s3", start_s3)

    def gcs(self) -> GCSServer:
        return self._get("gs", start_gcs)

    def azure(self) -> AzureServer:
        return self._get("az", start_azurite)

    def get(self, backend: str) -> Any:
        """The server for a backend name as used in test ids: "s3", "gs" or "az"."""
        return {"s3": self.s3, "gs": self.gcs, "az": self.azure}[backend]()

    def env(self) -> dict[str, str]:
        """The endpoint variables of every server started so far."""
        merged: dict[str, str] = {}
        for server in self._started.values():
            merged.update(server.env)
        return merged

    def stop_all(self) -> None:
        for server in self._started.values():
            server.server.stop()
