"""Each backend's SDK-error mapping, for what no local server produces (throttling, expired tokens, corruption,
missing credentials), and its configuration: S3 settings, Azure credentials and URLs, lazy SDK imports, and
the test servers' environment reaching a CLI subprocess."""

from __future__ import annotations

import base64
import importlib
import os
import subprocess
import sys

import pytest

from streamctl.common.sizes import MiB
from streamctl.errors import (
    AccessDeniedError,
    IntegrityError,
    NotFoundError,
    RemoteError,
    StreamctlError,
    UsageError,
)
from streamctl.storage import Location, StorageOptions, open_location
from streamctl.storage._errors import Op

# Few SDK retries: failure paths stay fast, and one retry still exercises the retry configuration.
OPTIONS = StorageOptions(max_attempts=2)
REMOTE = ("s3", "gs", "az")
BACKEND_MODULES = {"s3": "s3", "gs": "gcs", "az": "azure"}


def open_root(url: str, options: StorageOptions = OPTIONS) -> Location:
    return open_location(url, options)


# -- the mapping functions, for what no local server produces ---------------------------------------------


def _s3_error(status: int, code: str, message: str = "msg") -> Exception:
    from botocore.exceptions import ClientError

    return ClientError(
        {"Error": {"Code": code, "Message": message}, "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject"
    )


def _gcs_error(status: int, message: str = "msg") -> Exception:
    from google.api_core import exceptions

    return exceptions.from_http_status(status, message)


def _azure_error(status: int, code: str) -> Exception:
    from azure.core.exceptions import HttpResponseError

    error = HttpResponseError(message=f"{code} happened")
    error.status_code = status
    error.error_code = code
    return error


def _s3_cases() -> list[tuple[Exception, Op, type[StreamctlError], str]]:
    from botocore.exceptions import (
        ConnectTimeoutError,
        EndpointConnectionError,
        NoCredentialsError,
        SSOTokenLoadError,
    )

    return [
        (_s3_error(403, "AccessDenied"), Op.READ, AccessDeniedError, "s3:GetObject"),
        (_s3_error(403, "AccessDenied"), Op.LIST, AccessDeniedError, "s3:ListBucket"),
        (_s3_error(403, "AccessDenied"), Op.WRITE, AccessDeniedError, "s3:PutObject"),
        (_s3_error(403, "ExpiredToken"), Op.READ, AccessDeniedError, "AWS_PROFILE"),
        (_s3_error(404, "NoSuchBucket"), Op.LIST, NotFoundError, "bucket"),
        (_s3_error(404, "NoSuchKey"), Op.READ, NotFoundError, "path"),
        (_s3_error(503, "SlowDown"), Op.WRITE, RemoteError, "AWS_ENDPOINT_URL"),
        (_s3_error(500, "InternalError"), Op.READ, RemoteError, "network"),
        (NoCredentialsError(), Op.READ, AccessDeniedError, "AWS_ACCESS_KEY_ID"),
        (SSOTokenLoadError(error_msg="expired"), Op.READ, AccessDeniedError, "aws sso login"),
        (EndpointConnectionError(endpoint_url="https://s3.example"), Op.READ, RemoteError, "endpoint"),
        (ConnectTimeoutError(endpoint_url="https://s3.example"), Op.READ, RemoteError, "endpoint"),
    ]


def _gcs_cases() -> list[tuple[Exception, Op, type[StreamctlError], str]]:
    import requests
    from google.api_core.exceptions import RetryError
    from google.auth.exceptions import DefaultCredentialsError, RefreshError
    from google.cloud.storage.exceptions import DataCorruption

    return [
        (_gcs_error(403), Op.READ, AccessDeniedError, "roles/storage.objectViewer"),
        (_gcs_error(403), Op.LIST, AccessDeniedError, "storage.objects.list"),
        (_gcs_error(403), Op.WRITE, AccessDeniedError, "roles/storage.objectUser"),
        (_gcs_error(401), Op.READ, AccessDeniedError, "gcloud auth application-default login"),
        (_gcs_error(404, "The specified bucket does not exist."), Op.READ, NotFoundError, "bucket"),
        (_gcs_error(404, "No such object: b/k"), Op.READ, NotFoundError, "path"),
        (_gcs_error(429), Op.WRITE, RemoteError, "network"),
        (_gcs_error(503), Op.READ, RemoteError, "network"),
        (DefaultCredentialsError("none"), Op.READ, AccessDeniedError, "GOOGLE_APPLICATION_CREDENTIALS"),
        (RefreshError("invalid_grant: token expired"), Op.READ, AccessDeniedError, "gcloud auth"),
        (RetryError("deadline", cause=_gcs_error(503)), Op.READ, RemoteError, "network"),
        (requests.exceptions.ConnectionError("refused"), Op.READ, RemoteError, "network"),
        (DataCorruption(None, "crc32c mismatch"), Op.READ, IntegrityError, "retry"),
    ]


def _azure_cases() -> list[tuple[Exception, Op, type[StreamctlError], str]]:
    from azure.core.exceptions import ClientAuthenticationError, ServiceRequestError, ServiceResponseError

    class CredentialUnavailableError(ClientAuthenticationError):  # azure.identity's, matched by name
        pass

    return [
        (
            _azure_error(403, "AuthorizationPermissionMismatch"),
            Op.READ,
            AccessDeniedError,
            "Storage Blob Data Reader",
        ),
        (_azure_error(403, "AuthorizationFailure"), Op.WRITE, AccessDeniedError, "Storage Blob Data Contributor"),
        (_azure_error(403, "AuthenticationFailed"), Op.READ, AccessDeniedError, "az login"),
        (_azure_error(404, "ContainerNotFound"), Op.READ, NotFoundError, "container"),
        (_azure_error(404, "BlobNotFound"), Op.READ, NotFoundError, "path"),
        (_azure_error(503, "ServerBusy"), Op.WRITE, RemoteError, "network"),
        (CredentialUnavailableError("none"), Op.READ, AccessDeniedError, "AZURE_STORAGE_CONNECTION_STRING"),
        (
            ClientAuthenticationError(
                "DefaultAzureCredential failed to retrieve a token from the included credentials"
            ),
            Op.READ,
            AccessDeniedError,
            "az login",
        ),
        (ServiceRequestError("connection refused"), Op.READ, RemoteError, "account name"),
        (ServiceResponseError("read timed out"), Op.READ, RemoteError, "network"),
    ]


@pytest.mark.parametrize("scheme", REMOTE)
def test_error_mapping_covers_what_servers_cannot_produce(scheme: str) -> None:
    module = importlib.import_module(f"streamctl.storage.{BACKEND_MODULES[scheme]}")
    cases = {"s3": _s3_cases, "gs": _gcs_cases, "az": _azure_cases}[scheme]()
    url = f"{scheme}://bucket-x/key"
    for error, op, expected, hint_part in cases:
        mapped = module.map_error(error, url=url, bucket="bucket-x", op=op)
        label = f"{type(error).__name__} {getattr(error, 'status_code', '')} -> {mapped!r}"
        assert type(mapped) is expected, label
        assert mapped.message.startswith(f"{url}: ") and "\n" not in mapped.message, label
        assert hint_part in f"{mapped.message} {mapped.hint}", label


def test_guard_translates_sdk_errors_only() -> None:
    from streamctl.storage._errors import guard

    with pytest.raises(RemoteError), guard(lambda error: RemoteError(str(error))):
        raise ConnectionResetError("reset by peer")  # sockets raise OSError through every SDK
    with pytest.raises(KeyError):  # a bug in our own code is not disguised as a service failure
        with guard(lambda error: RemoteError(str(error))):
            raise KeyError("bug")


# -- backend configuration --------------------------------------------------------------------------------


def test_s3_settings_from_options_and_environment() -> None:
    from streamctl.storage.s3 import resolve_settings

    env = {"AWS_ENDPOINT_URL": "http://env:9000", "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0"}
    settings = resolve_settings(StorageOptions(max_attempts=7), env)
    assert (settings.endpoint_url, settings.addressing_style, settings.max_attempts) == ("http://env:9000", "path", 7)
    explicit = resolve_settings(StorageOptions(endpoint_url="http://opt:1", path_style=False), env)
    assert (explicit.endpoint_url, explicit.addressing_style) == ("http://opt:1", "virtual")
    s3_only = resolve_settings(StorageOptions(), {"AWS_ENDPOINT_URL_S3": "http://s3only"})
    assert s3_only.endpoint_url == "http://s3only"
    assert resolve_settings(StorageOptions(), {}).addressing_style == "auto"
    virtual = resolve_settings(StorageOptions(), {"RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "1"})
    assert virtual.addressing_style == "virtual"


def test_azure_auth_order_and_account_resolution() -> None:
    from streamctl.storage.azure import choose_auth

    conn = "DefaultEndpointsProtocol=https;AccountName=acct1;AccountKey=a2V5;EndpointSuffix=core.windows.net"
    everything = {
        "AZURE_STORAGE_CONNECTION_STRING": conn,
        "AZURE_STORAGE_KEY": "a2V5",
        "AZURE_STORAGE_SAS_TOKEN": "?sv=1&sig=x",
        "AZURE_STORAGE_ACCOUNT_NAME": "acct1",
    }
    assert choose_auth(None, None, everything).method == "connection string"
    assert choose_auth(None, None, {"AZURE_STORAGE_CONNECTION_STRING": conn}).account == "acct1"
    # A connection string for another account must not redirect the upload: fall through to the key.
    other = choose_auth("acct2", None, everything)
    assert (other.method, other.account) == ("account key", "acct2")
    assert choose_auth(None, "acct3", {"AZURE_STORAGE_ACCOUNT_KEY": "a2V5"}).method == "account key"
    sas = choose_auth("acct2", None, {"AZURE_STORAGE_SAS_TOKEN": "?sv=1&sig=x"})
    assert (sas.method, sas.secret) == ("SAS token", "sv=1&sig=x")
    assert choose_auth("acct2", None, {}).method == "DefaultAzureCredential"
    assert "a2V5" not in repr(choose_auth("acct2", None, {"AZURE_STORAGE_KEY": "a2V5"}))
    with pytest.raises(UsageError) as caught:
        choose_auth(None, None, {})
    assert "AZURE_STORAGE_ACCOUNT_NAME" in (caught.value.hint or "")


def test_azure_urls_and_metadata_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING", raising=False)
    monkeypatch.setenv("AZURE_STORAGE_KEY", base64.b64encode(b"k" * 32).decode())
    https = open_root("https://myacct.blob.core.windows.net/models/llama")
    assert https.store.url(https.key("a.bin")) == "https://myacct.blob.core.windows.net/models/llama/a.bin"
    assert https.store.account == "myacct"  # type: ignore[attr-defined]
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", "envacct")
    short = open_root("az://models/llama")
    assert short.store.url(short.key("a.bin")) == "az://models/llama/a.bin"
    assert short.store.account == "envacct"  # type: ignore[attr-defined]
    # Azure metadata names are C# identifiers; refuse before sending rather than fail after uploading.
    with pytest.raises(UsageError) as caught:
        short.store.start_multipart(short.key("a.bin"), MiB, {"streamctl-sha256": "x"})
    assert "streamctl_sha256" in (caught.value.hint or "")


def test_storage_import_loads_no_cloud_sdk() -> None:
    code = (
        "import sys, streamctl.storage as s; s.parse_url('s3://bkt/k'); "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('boto3', 'botocore', 'azure') "
        "or m.startswith('google.cloud')); print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_storage_env_reaches_a_subprocess(any_root: str, storage_env: dict[str, str]) -> None:
    """What CLI tests rely on: a fresh process with storage_env sees the same store as this one."""
    root = open_root(any_root)
    root.store.put(root.key("seen.bin"), b"12345")
    code = (
        "import sys; from streamctl.storage import open_location; "
        "print([(o.key, o.size) for o in open_location(sys.argv[1]).list()])"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, any_root],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **storage_env},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == repr([(root.key("seen.bin"), 5)])
