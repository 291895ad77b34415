"""Azure Blob Storage (block blobs) through azure-storage-blob.

URLs: `az://CONTAINER/PREFIX` (account from StorageOptions.azure_account, else AZURE_STORAGE_ACCOUNT_NAME, else
the connection string) or `https://ACCOUNT.blob.core.windows.net/CONTAINER/PREFIX`. Which credential applies
(connection string, account key, SAS token, else DefaultAzureCredential: `az login`, managed identity, workload
identity...) is storage/azure_auth.py's rule.

Multipart uploads stage blocks (`stage_block`, any order, any thread) and commit the block list in index
order. Abort needs no request: staged but uncommitted blocks are never readable or listed, the next commit
of the same blob discards every block not in its list, and Azure deletes the rest after a week. Block ids
carry a per-upload nonce, so two uploads racing for one name never commit each other's blocks, and the CRC32
of the block's bytes (see storage.base.part_digest): Get Block List then says what each staged block holds,
and an upload reopened under its nonce (a `resume` token) reuses only the blocks that match the source.
"""

from __future__ import annotations

import base64
import binascii
import builtins
import os
import re
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, ClassVar, TypeVar

import azure.core.exceptions as aexc
import requests
from azure.core import MatchConditions
from azure.core.pipeline.transport import RequestsTransport
from azure.storage.blob import BlobBlock, BlobServiceClient, ContainerClient, ContentSettings, ExponentialRetry

from streamctl.common.sizes import MiB
from streamctl.errors import PreconditionFailed, StreamctlError, UsageError
from streamctl.storage import _errors, deadlines
from streamctl.storage._errors import Failure, Kind, Op, ServiceHints, kind_for_status, lower_keys, one_line, strip_etag
from streamctl.storage.azure_auth import AzureAuth, choose_auth
from streamctl.storage.base import (
    HeldPart,
    ObjectInfo,
    StorageOptions,
    UnfinishedUpload,
    content_type_for,
    copy_into,
    new_temporary_token,
    part_digest,
)
from streamctl.storage.url import ParsedURL

HINTS = ServiceHints(
    service="Azure Blob",
    container="container",
    credentials=(
        "set AZURE_STORAGE_CONNECTION_STRING (or AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_KEY or "
        "AZURE_STORAGE_SAS_TOKEN), or run `az login`"
    ),
    permissions={
        Op.LIST: "the Storage Blob Data Reader role (or a SAS with list permission)",
        Op.READ: "the Storage Blob Data Reader role (or a SAS with read permission)",
        Op.WRITE: "the Storage Blob Data Contributor role (or a SAS with write permission)",
        Op.DELETE: "the Storage Blob Data Contributor role (or a SAS with delete permission)",
    },
    network="check the network and the storage account name",
)

T = TypeVar("T")
_BAD_CREDENTIAL_CODES = frozenset({"AuthenticationFailed", "InvalidAuthenticationInfo", "NoAuthenticationInformation"})
# Azure metadata names become HTTP headers and must be C# identifiers: no '-', no '.'.
_METADATA_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _error_code(error: aexc.HttpResponseError) -> str:
    code = getattr(error, "error_code", None)
    return str(getattr(code, "value", code) or "")


def classify(error: BaseException) -> Failure:
    """What an exception from azure-core, azure-storage-blob or azure-identity means, in neutral terms."""
    name = type(error).__name__
    if name == "CredentialUnavailableError":  # azure.identity, checked by name to avoid importing it
        return Failure(Kind.NO_CREDENTIALS, _chain_summary(str(error)) or one_line(error))
    if isinstance(error, aexc.ClientAuthenticationError) and getattr(error, "status_code", None) is None:
        # Raised by azure.identity before any storage request: no token could be obtained at all.
        text = one_line(error)
        no_token = "failed to retrieve a token from the included credentials" in text.lower()
        if no_token:
            return Failure(Kind.NO_CREDENTIALS, _chain_summary(str(error)) or text)
        return Failure(Kind.BAD_CREDENTIALS, text)
    if isinstance(error, aexc.HttpResponseError):
        status = getattr(error, "status_code", None)
        code = _error_code(error)
        # The message's first line; the rest is request ids and XML.
        message = str(getattr(error, "message", "") or getattr(error, "reason", "") or "").split("\n", 1)[0]
        detail = one_line(f"{status or ''} {code}: {message}".strip(" :"))
        if code == "ContainerNotFound":
            return Failure(Kind.NO_BUCKET, detail)
        if code == "BlobNotFound":
            return Failure(Kind.NO_OBJECT, detail)
        # Azurite reports a wrong key as AuthorizationFailure, with Azure's AuthenticationFailed wording.
        if code in _BAD_CREDENTIAL_CODES or "failed to authenticate" in message.lower():
            return Failure(Kind.BAD_CREDENTIALS, detail)
        if code.startswith("Authorization") or code == "InsufficientAccountPermissions":
            return Failure(Kind.DENIED, detail)
        if code in ("InvalidResourceName", "OutOfRangeInput") and status == 400:
            return Failure(Kind.INVALID, detail)
        return Failure(kind_for_status(status), detail)
    if isinstance(error, (aexc.ServiceRequestError, aexc.ServiceResponseError, aexc.IncompleteReadError)):
        return Failure(Kind.UNAVAILABLE, one_line(error))
    if isinstance(error, (requests.exceptions.RequestException, OSError)):
        return Failure(Kind.UNAVAILABLE, one_line(error))
    return Failure(Kind.OTHER, one_line(f"{name}: {error}"))


_CHAIN_MEMBER = re.compile(r"^\s+(\w+Credential): ", re.MULTILINE)


def _chain_summary(message: str) -> str | None:
    """DefaultAzureCredential's many-line report as one line: which credentials it tried."""
    tried = [name.removesuffix("Credential") for name in _CHAIN_MEMBER.findall(message)]
    if not tried:
        return None
    return f"DefaultAzureCredential tried {', '.join(tried)}; none is configured here"


SERVICE = _errors.Service(classify, HINTS, listing_404_is_bucket=True)


def map_error(error: BaseException, *, url: str, bucket: str, op: Op) -> StreamctlError:
    """The streamctl error for an SDK exception (without the container probe a store adds for bare 404s)."""
    return _errors.to_error(classify(error), url=url, bucket=bucket, op=op, hints=HINTS)


def _transport() -> RequestsTransport:
    import azure.core.pipeline.transport._base as transport_base

    # Every retry policy sleeps through the transport (azure-core's RetryPolicy waits out any Retry-After).
    deadlines.route_sleeps(transport_base)
    # Transfers run ~32 threads on one client; requests' default pool of 10 would keep reconnecting.
    try:  # azure-core's adapter reads in bigger blocks (faster downloads); private, so optional
        from azure.core.pipeline.transport._bigger_block_size_http_adapters import BiggerBlockSizeHTTPAdapter

        adapter_class: type[requests.adapters.HTTPAdapter] = BiggerBlockSizeHTTPAdapter
    except ImportError:  # pragma: no cover - depends on the azure-core version
        adapter_class = requests.adapters.HTTPAdapter
    retries = requests.adapters.Retry(total=False, redirect=False, raise_on_status=False)  # the SDK retries
    # Timed pools: the SDK's timeouts are per socket read (per chunk), the overall deadline is ours.
    adapter = deadlines.timed_adapter(adapter_class)(pool_connections=4, pool_maxsize=64, max_retries=retries)
    session = requests.Session()
    session.mount("https://", adapter)
    session.mount("http://", adapter)
    return RequestsTransport(session=session, session_owner=False, connection_timeout=20, read_timeout=120)


def _make_service(auth: AzureAuth, max_attempts: int) -> BlobServiceClient:
    common: dict[str, Any] = {
        # The SDK default waits 15 s before the first retry and retries 3 times; keep it bounded by
        # max_attempts and quicker. CRC64 is never requested (Azurite answers 500 to it).
        "retry_policy": ExponentialRetry(
            initial_backoff=1, increment_base=2, retry_total=max(0, max_attempts - 1), random_jitter_range=1
        ),
        "transport": _transport(),
    }
    if auth.method == "connection string":
        try:
            return BlobServiceClient.from_connection_string(auth.secret or "", **common)
        except ValueError as error:
            raise UsageError(
                f"AZURE_STORAGE_CONNECTION_STRING is malformed ({one_line(error)})",
                hint="copy it again from the portal (Access keys) or `az storage account show-connection-string`",
            ) from None
    account_url = f"https://{auth.account}.blob.core.windows.net"
    if auth.method == "account key":
        try:
            base64.b64decode(auth.secret or "", validate=True)
        except (binascii.Error, ValueError):
            raise UsageError(
                "AZURE_STORAGE_KEY is not a base64 account key", hint="copy it again from the portal (Access keys)"
            ) from None
        credential: Any = {"account_name": auth.account, "account_key": auth.secret}
    elif auth.method == "SAS token":
        credential = auth.secret
    else:
        credential = shared_default_credential()
    return BlobServiceClient(account_url, credential=credential, **common)


class CredentialChainFailed(Exception):
    """The credential chain failed (now or earlier in this run). Not an AzureError, so that the storage
    pipeline's retry policy, which retries every AzureError, does not sleep and run the chain again."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


class OnceCredential:
    """A token credential that runs its chain at most once per run when it fails.

    DefaultAzureCredential does not remember failures: every store, request and retry ran the whole chain
    again (managed identity, the CLIs, ...), ~8 s each on a machine without Azure credentials. The first
    failure is kept and raised again at once; successes are cached by the SDK's token policy. Calls are
    serialised, so 32 threads asking for the first token run the chain once, not 32 times.
    """

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._failure: BaseException | None = None
        self._lock = threading.Lock()

    def _once(self, method: str, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            if self._failure is not None:
                raise CredentialChainFailed(self._failure)
            try:
                return getattr(self._inner, method)(*args, **kwargs)
            except aexc.ClientAuthenticationError as error:  # CredentialUnavailableError is a subclass
                self._failure = error
                raise CredentialChainFailed(error) from None

    def get_token(self, *scopes: str, **kwargs: Any) -> Any:
        return self._once("get_token", *scopes, **kwargs)

    def get_token_info(self, *scopes: str, options: Any = None) -> Any:
        return self._once("get_token_info", *scopes, options=options)

    def close(self) -> None:
        self._inner.close()


_credential_lock = threading.Lock()
_credential: OnceCredential | None = None


def shared_default_credential() -> OnceCredential:
    """One DefaultAzureCredential for the whole run, shared by every store (see OnceCredential).

    Its managed-identity probe already uses a 1 s connect timeout and no retries; the developer tools it
    runs (az, azd, pwsh) get 10 s each, and interactive sign-in is excluded (a CLI must never open a browser).
    """
    global _credential
    with _credential_lock:
        if _credential is None:
            from azure.identity import DefaultAzureCredential  # slow import; only when actually used

            _credential = OnceCredential(
                DefaultAzureCredential(exclude_interactive_browser_credential=True, process_timeout=10)
            )
        return _credential


def block_id(nonce: str, index: int, crc32: str) -> str:
    """Block ids of one blob must all have the same length, at most 64 bytes before the SDK base64-encodes
    them; this one is always 34: the upload's 16-hex-digit nonce, the part index and the hex CRC32 of the
    block's bytes."""
    return f"{nonce}-{index:08d}-{crc32}"


_BLOCK_ID = re.compile(r"([0-9a-f]{16})-(\d{8})-([0-9a-f]{8})")


def parse_block_id(block: str) -> tuple[str, int, str] | None:
    """(nonce, index, crc32) of a block id block_id() made (as Get Block List gives it back); None for others."""
    match = _BLOCK_ID.fullmatch(block)
    return (match.group(1), int(match.group(2)), match.group(3)) if match else None


def _check_metadata(metadata: Mapping[str, str], url: str) -> dict[str, str]:
    metadata = lower_keys(metadata)
    bad = [name for name in metadata if not _METADATA_NAME.match(name)]
    if bad:
        raise UsageError(
            f"{url}: Azure metadata names must be letters, digits and '_' (got {', '.join(map(repr, bad))})",
            hint="use names like 'streamctl_sha256' that every store accepts",
        )
    return metadata


@dataclass
class AzureMultipartUpload:
    store: AzureStore
    key: str
    part_size: int
    nonce: str
    metadata: dict[str, str]
    content_type: str
    _blocks: dict[int, tuple[str, int]] = field(default_factory=dict)  # index: (block id, size)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _state: str = "open"  # "open", "completed" or "aborted"
    _held: list[HeldPart] = field(default_factory=list)

    def upload_part(self, index: int, data: bytes | memoryview) -> None:
        _errors.check_part(self.store.url(self.key), self._state, index, self.store.max_parts)
        block = block_id(self.nonce, index, part_digest("crc32", data))
        with self.store._guard(Op.WRITE, self.key):
            blob = self.store._blob(self.key)
            self.store._call(self.key, lambda: blob.stage_block(block, data, length=len(data)), len(data))
        with self._lock:
            self._blocks[index] = (block, len(data))

    def held_parts(self) -> list[HeldPart]:
        return list(self._held)

    def _find_held_blocks(self) -> None:
        """The blocks an earlier run staged under this upload's nonce and never committed (a reopened upload)."""
        with self.store._guard(Op.WRITE, self.key):
            blob = self.store._blob(self.key)
            try:
                _, uncommitted = self.store._call(self.key, lambda: blob.get_block_list("uncommitted"))
            except aexc.ResourceNotFoundError:
                return  # no blob, no blocks: nothing was staged
        for block in uncommitted:
            parsed = parse_block_id(block.id)
            if parsed is not None and parsed[0] == self.nonce and parsed[1] not in self._blocks:
                self._blocks[parsed[1]] = (block.id, int(block.size))
                self._held.append(HeldPart(parsed[1], int(block.size), parsed[2], "crc32"))

    def complete(self, metadata: Mapping[str, str] | None = None) -> ObjectInfo:
        with self._lock:
            if self._state != "open":
                raise UsageError(f"upload of {self.store.url(self.key)} is already {self._state}")
            blocks = dict(self._blocks)
        sizes = {index: size for index, (_, size) in blocks.items()}
        if metadata:
            self.metadata = {**self.metadata, **_check_metadata(metadata, self.store.url(self.key))}
        indices = sorted(sizes)
        _errors.check_no_gaps(self.store.url(self.key), indices)
        with self.store._guard(Op.WRITE, self.key):
            blob = self.store._blob(self.key)
            response = self.store._call(
                self.key,
                lambda: blob.commit_block_list(
                    [BlobBlock(block_id=blocks[index][0]) for index in indices],
                    metadata=self.metadata,
                    content_settings=ContentSettings(content_type=self.content_type),
                ),
                sum(sizes.values()),
            )
        with self._lock:
            self._state = "completed"
        return ObjectInfo(self.key, sum(sizes.values()), strip_etag(response.get("etag")), dict(self.metadata))

    def positional_writer(self) -> None:
        return None  # parts are the only way to write an object here

    def kernel_copier(self) -> None:
        return None

    def abort(self) -> None:
        # Nothing to send: see the module docstring for why uncommitted blocks are harmless.
        with self._lock:
            if self._state == "open":
                self._state = "aborted"


@dataclass
class AzureStore(_errors.CloudRequests):
    service: ClassVar[_errors.Service] = SERVICE
    bucket: str  # the container
    auth: AzureAuth
    max_attempts: int = 5
    https_form: bool = False  # the user wrote https://ACCOUNT.blob.core.windows.net/...; echo that form
    scheme: str = "az"
    min_part_size: int = 1
    max_parts: int = 50_000
    max_part_size: int = 4000 * MiB  # largest block Azure accepts
    page_size: int | None = None  # blobs per listing request; None: the service default (5000)
    _container_instance: ContainerClient | None = field(default=None, repr=False)
    _client_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def account(self) -> str | None:
        return self.auth.account

    @property
    def namespace(self) -> str:
        """The storage account: container names are unique only within it."""
        return (self.auth.account or "").lower()

    @property
    def _container(self) -> ContainerClient:
        if self._container_instance is None:
            with self._client_lock:
                if self._container_instance is None:
                    with self._guard(Op.READ, ""):
                        service = _make_service(self.auth, self.max_attempts)
                        self._container_instance = service.get_container_client(self.bucket)
        return self._container_instance

    def _blob(self, key: str) -> Any:
        return self._container.get_blob_client(key)

    def url(self, key: str) -> str:
        base = (
            f"https://{self.auth.account}.blob.core.windows.net/{self.bucket}"
            if self.https_form
            else f"az://{self.bucket}"
        )
        return f"{base}/{key}" if key else base

    @contextmanager
    def _guard(self, op: Op, key: str) -> Iterator[None]:
        try:
            with super()._guard(op, key):
                yield
        except CredentialChainFailed as failed:
            raise self._error(failed.error, op, key) from failed.error

    def _attempts(self) -> int:
        return self.max_attempts

    def _bucket_exists(self) -> bool | None:  # the container
        try:
            container = self._container
            return bool(deadlines.call(container.exists, url=self.url(""), attempts=1))
        except Exception:  # noqa: BLE001 - a failed probe only means "cannot tell"
            return None

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Blobs come back in name order, folder markers (hdi_isfolder) too: Location.list skips them."""
        with self._guard(Op.LIST, prefix):
            container = self._container
            listing = deadlines.iterate(
                lambda: container.list_blobs(
                    name_starts_with=prefix or None, include=["metadata"], results_per_page=self.page_size
                ),
                lambda blob: blob.name,
                url=self.url(prefix),
                attempts=self.max_attempts,
            )
            for blob in listing:
                yield ObjectInfo(blob.name, int(blob.size or 0), strip_etag(blob.etag), lower_keys(blob.metadata))

    def stat(self, key: str) -> ObjectInfo:
        with self._guard(Op.READ, key):
            blob = self._blob(key)
            props = self._call(key, blob.get_blob_properties)
        return ObjectInfo(key, int(props.size or 0), strip_etag(props.etag), lower_keys(props.metadata))

    def read_range(self, key: str, start: int, length: int) -> bytes:
        if _errors.is_empty_range(start, length, lambda: self.stat(key)):
            return b""
        with self._guard(Op.READ, key):
            try:
                blob = self._blob(key)
                data: bytes = self._call(
                    key, lambda: blob.download_blob(offset=start, length=length, max_concurrency=1).readall(), length
                )
                return data
            except aexc.HttpResponseError as error:
                if getattr(error, "status_code", None) == 416:
                    return b""  # the range starts at or after the end of the blob
                raise

    def read_range_into(self, key: str, start: int, buffer: memoryview) -> int:
        return copy_into(buffer, self.read_range(key, start, len(buffer)))

    def put(
        self, key: str, data: bytes, metadata: Mapping[str, str] | None = None, content_type: str | None = None
    ) -> ObjectInfo:
        metadata = _check_metadata(metadata or {}, self.url(key))
        settings = ContentSettings(content_type=content_type or content_type_for(key))
        with self._guard(Op.WRITE, key):
            blob = self._blob(key)
            response = self._call(
                key,
                lambda: blob.upload_blob(
                    data, overwrite=True, metadata=metadata, content_settings=settings, length=len(data)
                ),
                len(data),
            )
        return ObjectInfo(key, len(data), strip_etag(response.get("etag")), metadata)

    def start_multipart(
        self,
        key: str,
        part_size: int,
        metadata: Mapping[str, str] | None = None,
        content_type: str | None = None,
        resume: str | None = None,
    ) -> AzureMultipartUpload:
        if part_size > self.max_part_size:
            raise UsageError(f"part size {part_size} exceeds Azure's block limit of {self.max_part_size}")
        metadata = _check_metadata(metadata or {}, self.url(key))
        upload = AzureMultipartUpload(
            self, key, part_size, resume or new_temporary_token(), metadata, content_type or content_type_for(key)
        )
        if resume is not None:
            upload._find_held_blocks()
        return upload

    def delete(self, key: str) -> None:
        with self._guard(Op.DELETE, key):
            try:
                blob = self._blob(key)
                self._call(key, lambda: blob.delete_blob(delete_snapshots="include"))
            except aexc.ResourceNotFoundError:
                return  # nothing to delete (blob or container)

    def unfinished_uploads(self, prefix: str) -> builtins.list[UnfinishedUpload]:
        """Blobs that hold only uncommitted blocks: an upload that never committed its block list.

        (Blocks left beside a committed blob need no help: the next commit of that blob drops them, and
        Azure drops uncommitted blocks after a week in any case.)
        """
        with self._guard(Op.LIST, prefix):
            container = self._container
            committed = self._call(
                prefix, lambda: {blob.name for blob in container.list_blobs(name_starts_with=prefix or None)}
            )
            staged = [
                (name, created)
                for name, created in self._call(
                    prefix,
                    lambda: [
                        (blob.name, blob.creation_time)
                        for blob in container.list_blobs(name_starts_with=prefix or None, include=["uncommittedblobs"])
                    ],
                )
                if name not in committed
            ]
        return [
            UnfinishedUpload(name, None, partial(self.delete, name), started, self._staging_nonce(name))
            for name, started in staged
        ]

    def _staging_nonce(self, key: str) -> str | None:
        """The nonce (a `resume` token) of the upload whose blocks `key` holds uncommitted, where one
        upload's blocks are all there is; None when they are not block_id()'s or of several uploads."""
        with self._guard(Op.LIST, key):
            blob = self._blob(key)
            try:
                _, uncommitted = self._call(key, lambda: blob.get_block_list("uncommitted"))
            except aexc.ResourceNotFoundError:
                return None
        nonces = {parsed[0] if parsed else None for parsed in (parse_block_id(block.id) for block in uncommitted)}
        return nonces.pop() if len(nonces) == 1 else None

    @contextmanager
    def _conditional(self, key: str, op: Op) -> Iterator[None]:
        """409 BlobAlreadyExists (If-None-Match: *), 412 ConditionNotMet (If-Match) and a 404 of the blob an
        If-Match named: not in the state we asked for."""
        try:
            with self._guard(op, key):
                yield
        except StreamctlError as error:
            cause = error.__cause__
            if isinstance(cause, (aexc.ResourceExistsError, aexc.ResourceModifiedError)) or (
                isinstance(cause, aexc.ResourceNotFoundError) and _error_code(cause) == "BlobNotFound"
            ):
                raise PreconditionFailed(f"{self.url(key)}: {classify(cause).detail}") from None
            raise

    def create_if_absent(self, key: str, data: bytes, metadata: Mapping[str, str] | None = None) -> str:
        metadata = _check_metadata(metadata or {}, self.url(key))
        with self._conditional(key, Op.WRITE):
            # overwrite=False is the SDK's If-None-Match: * on Put Blob.
            blob = self._blob(key)
            settings = ContentSettings(content_type=content_type_for(key))
            response = self._call(key, lambda: blob.upload_blob(
                data, overwrite=False, metadata=metadata, content_settings=settings, length=len(data)
            ), len(data))  # fmt: skip
        return str(response["etag"])

    def read_versioned(self, key: str) -> tuple[bytes, str]:
        with self._guard(Op.READ, key):
            # One GET for a small blob; the SDK pins any further chunks to the first one's ETag.
            def read() -> tuple[bytes, str]:
                downloader = self._blob(key).download_blob(max_concurrency=1)
                return downloader.readall(), str(downloader.properties.etag)

            return self._call(key, read)

    def replace_if_version(self, key: str, data: bytes, version: str, metadata: Mapping[str, str] | None = None) -> str:
        metadata = _check_metadata(metadata or {}, self.url(key))
        with self._conditional(key, Op.WRITE):
            blob = self._blob(key)
            settings = ContentSettings(content_type=content_type_for(key))
            response = self._call(key, lambda: blob.upload_blob(
                data, overwrite=True, metadata=metadata, content_settings=settings, length=len(data),
                etag=version, match_condition=MatchConditions.IfNotModified,
            ), len(data))  # fmt: skip
        return str(response["etag"])

    def delete_if_version(self, key: str, version: str) -> None:
        with self._conditional(key, Op.DELETE):
            blob = self._blob(key)
            self._call(key, lambda: blob.delete_blob(etag=version, match_condition=MatchConditions.IfNotModified))


def open_store(parsed: ParsedURL, options: StorageOptions) -> AzureStore:
    auth = choose_auth(parsed.account, options.azure_account, os.environ)
    return AzureStore(
        parsed.bucket, auth, max_attempts=max(1, options.max_attempts), https_form=parsed.account is not None
    )
