"""Copy a model (Hugging Face repo, local folder or bucket prefix) into a bucket or folder.

How it moves bytes: every file is split into parts; parts are read with ranged reads and uploaded as
multipart parts by one pool of worker threads, so downloads overlap uploads and several files move at
once. A byte budget (`max_buffer`) is taken before a part is read and given back after it is uploaded,
so memory never grows with the model; each part is read into a reused buffer (uploads.PartBuffers),
hashed and sent from it without a copy. Each file's sha256 is computed in flight, in part order, and
the upload is completed only when it matches the source's (the hub's LFS sha256, or the git blob sha1
of small files); otherwise it is aborted and the file retried once from scratch.

Why it is resumable: nothing is visible under a final name until its upload completes, each object
stores its sha256 as metadata, and a re-run skips objects whose size and stored sha256 match. Inside a
file too: each upload is started under a resume token naming the plan's upload of it (object, size, part
size, source, commit, the source's version of the file), so the next run of the same plan reopens what a
killed run (kill -9, an evicted pod, a link lost past its retries) left and sends only the parts DEST
lacks. It still reads every byte of the source, to hash the whole file before completing and to check
each held part: a part is reused only when the MD5 of the source's bytes matches what DEST holds (see
storage.base.HeldPart); any other is sent again. Uploads of other plans are discarded, as before.

`--worker K/N` (streamctl.shares): the plan is cut to share K of N, the run holds that share's lease, and
the manifest is merged share by share; the worker whose share completes it removes what --force replaces.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Literal, cast

from streamctl.checkpoint.files import (
    CONFIG_NAME,
    MANIFEST_NAME,
    SHARD_MANIFEST_NAME,
    Selection,
    listing_notes,
    notes_to_json,
    read_config_references,
    read_index_contents,
    select_files,
    weights_elsewhere,
    weights_file,
)
from streamctl.checkpoint.index import INDEX_NAME
from streamctl.checkpoint.safetensors import decode_json_strictly
from streamctl.errors import (
    ChecksFailed,
    DestinationBusy,
    IntegrityError,
    NotFoundError,
    RangeIgnoredError,
    RemoteError,
    StreamctlError,
    UsageError,
)
from streamctl.interrupts import Shielded, shielded_calls
from streamctl.lease import Lease, hold_lease, lease_name
from streamctl.limits import MAX_CONCURRENCY, check_count
from streamctl.locations import check_disjoint
from streamctl.manifests import DestManifests, FileEntry, TransferManifest, put_manifest, read_dest_manifests
from streamctl.ownership import Cleanup, plan_cleanup, remove_files, unfollowed_links, written_by_streamctl
from streamctl.progress import NULL_PROGRESS, Progress
from streamctl.retry import RetryPolicy, with_retries
from streamctl.shares import Share, ShareFields, ShareRecord, Worker, record_share, split_shares, take_share
from streamctl.storage import deadlines
from streamctl.storage.base import (
    HeldPart,
    ListingNote,
    Location,
    MiB,
    MultipartUpload,
    ObjectInfo,
    StorageOptions,
    is_safe_relative_path,
    unsafe_path_reason,
)
from streamctl.storage.names import check_names_fit
from streamctl.uploads import (
    SHA256_KEY,
    ByteBudget,
    Cancelled,
    CopiedFile,
    PartBuffers,
    check_part_size,
    discard_unfinished_uploads,
    list_dest,
    part_size_for,
    part_size_note,
    resume_token,
)

if TYPE_CHECKING:
    from streamctl.verify.report import VerifyReport

DEFAULT_PART_SIZE = 16 * MiB
DEFAULT_MAX_BUFFER = 256 * MiB
DEFAULT_CONCURRENCY = 16
HASH_CHUNK = 8 * MiB
GIT_SHA1_KEY = "gitsha1"  # letters and digits only: Azure metadata names must be identifiers


@dataclass(frozen=True)
class FilePlan:
    path: str
    size: int
    sha256: str | None  # the source's, when known before copying
    git_sha1: str | None  # small hub files carry only their git blob sha1
    action: Literal["copy", "skip"]
    reason: str
    # The source's version of the file (its listing's ETag: a hub file's LFS sha256 or git blob id, a bucket
    # object's ETag, a local file's mtime and size): with the size, what tells a resumable upload's source.
    source_etag: str | None = None


@dataclass(frozen=True)
class TransferPlan:
    source: str
    dest: str
    commit: str | None
    files: tuple[FilePlan, ...]
    excluded: tuple[Selection, ...]
    # DEST files besides the plan's: what --force removes once the new files are complete, what stays.
    cleanup: Cleanup = field(default_factory=Cleanup)
    # Entries of a local SOURCE left out (FIFOs, devices, links not followed) or read through a link.
    notes: tuple[ListingNote, ...] = ()
    # `--worker K/N`: `files` are this worker's share of the plan (streamctl.shares), `share` says of which.
    share: Share | None = None

    @property
    def total_bytes(self) -> int:
        return sum(file.size for file in self.files)

    @property
    def copy_bytes(self) -> int:
        return sum(file.size for file in self.files if file.action == "copy")

    def to_json(self) -> dict[str, object]:
        return {
            "source": self.source,
            "dest": self.dest,
            "commit": self.commit,
            "files": [
                {"path": f.path, "size": f.size, "sha256": f.sha256, "action": f.action, "reason": f.reason}
                for f in self.files
            ],
            "excluded": [{"path": s.path, "reason": s.reason} for s in self.excluded],
            "to_remove": list(self.cleanup.to_remove),
            "left_alone": [item.to_json() for item in self.cleanup.left_alone],
            **notes_to_json(self.notes),
            "worker": self.share.to_json() if self.share else None,
            "total_bytes": self.total_bytes,
            "copy_bytes": self.copy_bytes,
        }


@dataclass(frozen=True)
class TransferOptions:
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    all_files: bool = False
    concurrency: int = DEFAULT_CONCURRENCY
    part_size: int = DEFAULT_PART_SIZE
    max_buffer: int = DEFAULT_MAX_BUFFER
    force: bool = False
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    worker: Worker | None = None  # `--worker K/N`: copy share K of N (streamctl.shares)

    def validate(self) -> None:
        check_count("--concurrency", self.concurrency, MAX_CONCURRENCY)
        if self.part_size < 1:
            raise UsageError("--part-size must be positive")
        if self.max_buffer < self.part_size:
            raise UsageError(
                f"--max-buffer ({self.max_buffer} bytes) is smaller than --part-size ({self.part_size} bytes)",
                hint="raise --max-buffer or lower --part-size",
            )


@dataclass(frozen=True)
class TransferResult:
    source: str
    dest: str
    commit: str | None
    files: tuple[CopiedFile, ...]
    bytes_copied: int
    seconds: float
    discarded: tuple[str, ...] = ()  # unfinished uploads of earlier runs removed first (see discard_unfinished_uploads)
    removed: tuple[str, ...] = ()  # files of an earlier streamctl run that --force removed (plan.cleanup.to_remove)
    notes: tuple[ListingNote, ...] = ()  # the plan's: SOURCE entries left out or read through a link
    # Bytes of parts an earlier (killed) run had sent that matched the source: read and hashed, not sent.
    bytes_resumed: int = 0
    share: ShareRecord | None = None  # `--worker`: the shares finished once this one went into the manifest

    @property
    def throughput_mb_s(self) -> float:
        return self.bytes_copied / 1e6 / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, object]:
        return {
            "source": self.source,
            "dest": self.dest,
            "commit": self.commit,
            "files": [{"path": f.path, "size": f.size, "sha256": f.sha256, "action": f.action} for f in self.files],
            "bytes_copied": self.bytes_copied,
            "bytes_resumed": self.bytes_resumed,
            "seconds": round(self.seconds, 3),
            "throughput_mb_s": round(self.throughput_mb_s, 2),
            "discarded_uploads": list(self.discarded),
            "removed": list(self.removed),
            **notes_to_json(self.notes),
            "worker": self.share.to_json() if self.share else None,
        }


# --------------------------------------------------------------------------------------------- hashing


@dataclass
class Digests:
    """sha256 (and, when needed, the git blob sha1) of one file, fed in order."""

    size: int
    with_git_sha1: bool = True  # only small hub files are checked by it: skip the CPU for the rest
    sha256: hashlib._Hash = field(default_factory=hashlib.sha256)
    git_sha1: hashlib._Hash = field(init=False)

    def __post_init__(self) -> None:
        self.git_sha1 = hashlib.sha1(b"blob %d\x00" % self.size)

    def update(self, data: bytes | memoryview) -> None:
        self.sha256.update(data)
        if self.with_git_sha1:
            self.git_sha1.update(data)


def _read_chunks(location: Location, path: str, size: int, policy: RetryPolicy) -> Iterator[bytes]:
    key = location.key(path)
    for start in range(0, size, HASH_CHUNK):
        length = min(HASH_CHUNK, size - start)
        data = with_retries(partial(location.store.read_range, key, start, length), policy)
        if len(data) != length:
            raise IntegrityError(f"{location.store.url(key)} is shorter than its listed size {size}")
        yield data


def hash_object(location: Location, path: str, size: int, policy: RetryPolicy) -> str:
    digests = Digests(size, with_git_sha1=False)
    for chunk in _read_chunks(location, path, size, policy):
        digests.update(chunk)
    return digests.sha256.hexdigest()


def _mismatch(digests: Digests, sha256: str | None, git_sha1: str | None) -> str | None:
    """A description of the checksum mismatch, or None when the bytes are right."""
    got = digests.sha256.hexdigest()
    if sha256 is not None and got != sha256:
        return f"sha256 {got} != expected {sha256}"
    if sha256 is None and git_sha1 is not None and digests.git_sha1.hexdigest() != git_sha1:
        return f"git blob sha1 {digests.git_sha1.hexdigest()} != expected {git_sha1}"
    return None


# --------------------------------------------------------------------------------------------- planning


def _with_metadata(location: Location, info: ObjectInfo) -> ObjectInfo:
    """Listings of some stores (S3) carry no user metadata: ask for it when it is missing."""
    return info if info.metadata else location.store.stat(info.key)


def _read_json(location: Location, path: str, size: int) -> object:
    """The JSON document at `path`; None when it is not one verify-index would accept (nested too deeply, or a
    JSON bomb, included: the same rule, never a RecursionError)."""
    return decode_json_strictly(location.store.read_range(location.key(path), 0, size), what=path).value


def _check_manifest(
    dest: Location,
    manifests: DestManifests,
    source: str,
    commit: str | None,
    selected: set[str],
) -> None:
    """UsageError when DEST holds what another source (or `shard`) wrote; `selected` are the files to copy
    (a sharded checkpoint's own shard manifest travels with it)."""
    if SHARD_MANIFEST_NAME in manifests.present and SHARD_MANIFEST_NAME not in selected:
        shard_source = manifests.shard.source if manifests.shard is not None else None
        raise UsageError(
            f"{dest.url} holds a sharded checkpoint that `streamctl shard` wrote (of {shard_source})",
            hint="choose another destination prefix, or pass --force to replace what streamctl wrote there",
        )
    manifest = manifests.transfer
    if manifest is None:
        return
    if manifest.source != source or manifest.commit != commit:
        held = f"{manifest.source}" + (f"@{manifest.commit}" if manifest.commit else "")
        raise UsageError(
            f"{dest.url} already holds {held}, not {source}" + (f"@{commit}" if commit else ""),
            hint="choose another destination prefix, or pass --force to overwrite it",
        )


def _stored_sha256(dest: Location, path: str, info: ObjectInfo, policy: RetryPolicy) -> str | None:
    stored = info.metadata.get(SHA256_KEY)
    if stored is None and dest.store.scheme == "file":
        return hash_object(dest, path, info.size, policy)  # local disk without xattrs: hashing is cheap
    return stored


def _decide(
    file: FilePlan, existing: ObjectInfo | None, source: Location, dest: Location, options: TransferOptions
) -> FilePlan:
    def plan(action: Literal["copy", "skip"], reason: str, sha256: str | None = file.sha256) -> FilePlan:
        return replace(file, sha256=sha256, action=action, reason=reason)

    if options.force:
        return plan("copy", "--force")
    if existing is None:
        return plan("copy", "new")
    if existing.size != file.size:
        return plan("copy", "size differs")
    existing = _with_metadata(dest, existing)
    if file.sha256 is None and file.git_sha1 is not None and existing.metadata.get(GIT_SHA1_KEY) == file.git_sha1:
        return plan("skip", "unchanged (git sha1 matches)", existing.metadata.get(SHA256_KEY))
    stored = _stored_sha256(dest, file.path, existing, options.retry)
    if stored is None:
        return plan("copy", "no stored checksum")
    sha256 = file.sha256 or hash_object(source, file.path, file.size, options.retry)
    if stored == sha256:
        return plan("skip", "unchanged", sha256)
    return plan("copy", "checksum differs", sha256)


def _refuse_linked_dest_folders(dest: Location, paths: list[str], dest_notes: Sequence[ListingNote]) -> None:
    """Refuse, before anything is written, a plan that would write below a symbolic link inside a local
    DEST (the store refuses it too, at the first such write; a link at DEST itself is the user's choice)."""
    links = {note.key for note in dest_notes if note.kind.startswith("symlink")}
    for path in paths:
        parts = path.split("/")
        for depth in range(1, len(parts)):
            folder = "/".join(parts[:depth])
            if folder in links:
                raise UsageError(
                    f"{dest.store.url(dest.key(folder))} is a symbolic link; streamctl never writes through links inside DEST",
                    hint="remove the link, or name the folder it points to as DEST",
                )


def _check_part_limits(dest: Location, files: Sequence[FilePlan], options: TransferOptions) -> None:
    """Refuse (exit 2, before anything is written) a --part-size DEST takes no parts of, or a file too
    large for it (see uploads.part_size_for); a file that needs more parts than DEST allows gets larger
    parts instead, with a note when it is copied."""
    check_part_size(options.part_size, dest.store)
    for file in files:
        if file.action == "copy":
            part_size_for(file.size, options.part_size, dest.store)


def _refuse_leaving_the_weights(
    source: Location, listing: Mapping[str, object], files: Sequence[FilePlan], options: TransferOptions
) -> None:
    """UsageError (exit 2) when the default file set holds no weights but SOURCE has some where vLLM does not
    look (GGUF or pickle files, safetensors in sub-folders): name them, and the command that copies them."""
    if options.include or options.all_files or any(weights_file(file.path) for file in files):
        return
    elsewhere = weights_elsewhere(listing)
    if elsewhere is not None:
        raise UsageError(
            f"no weights selected from {source.url}: it holds {elsewhere.describe()}",
            hint=elsewhere.transfer_hint(source.url),
        )


def plan_transfer(
    source: Location, dest: Location, source_id: str, options: TransferOptions = TransferOptions()
) -> TransferPlan:
    """List both sides, choose the file set and decide copy or skip for each file, and what --force removes
    in DEST (see streamctl.ownership). Writes nothing; a DEST that overlaps SOURCE is refused (exit 2)."""
    options.validate()
    check_disjoint(source, dest)
    own_names = [MANIFEST_NAME, lease_name(options.worker)]
    check_names_fit(dest, own_names)  # DEST's own prefix or path first: then it can be listed
    listing = {source.relative(info.key): info for info in source.list()}
    notes = listing_notes(source)
    if not listing:
        left_out = f" ({len(notes)} entries skipped: {notes[0].key}: {notes[0].reason})" if notes else ""
        raise NotFoundError(f"no files under {source.url}{left_out}")
    unsafe = sorted(path for path in listing if not is_safe_relative_path(path))
    if unsafe:
        # Folder markers (empty `NAME/` objects) are not listed; one holding bytes is data no file can be named.
        name, size = unsafe[0], listing[unsafe[0]].size
        raise UsageError(
            f"refusing unsafe file name {name!r} in {source.url} ({source.store.url(source.key(name))}, "
            f"{size:,} bytes: it {unsafe_path_reason(name)})"
            + (f", and {len(unsafe) - 1:,} more" if len(unsafe) > 1 else ""),
            hint="names must be plain relative paths: rename or remove that object, or copy a prefix without it",
        )
    commit: str | None = getattr(source.store, "commit", None)

    config = _read_json(source, CONFIG_NAME, listing[CONFIG_NAME].size) if CONFIG_NAME in listing else None
    has_auto_map = isinstance(config, dict) and bool(config.get("auto_map"))
    sizes = {path: info.size for path, info in listing.items()}
    index_contents = read_index_contents(source, sizes)
    # None also when the index cannot be read as one: then every safetensors file is selected, and
    # verify-index says what is wrong with the index.
    indexed_shards = index_contents.get(INDEX_NAME)
    known = {CONFIG_NAME: config} if config is not None else {}
    referenced = {} if options.all_files else read_config_references(source, sizes, known)
    selections = select_files(
        listing,
        has_auto_map=has_auto_map,
        indexed_shards=indexed_shards,
        referenced=referenced,
        include=options.include,
        exclude=options.exclude,
        all_files=options.all_files,
        index_contents=index_contents,
    )
    existing = list_dest(dest)
    manifests = read_dest_manifests(dest, {name: info.size for name, info in existing.items()})
    if not options.force:
        _check_manifest(dest, manifests, source_id, commit, {s.path for s in selections if s.selected})
    dest_notes = listing_notes(dest)  # one scan for both uses below (a bucket DEST: its folder markers only)
    _refuse_linked_dest_folders(dest, [selection.path for selection in selections if selection.selected], dest_notes)
    files = []
    for selection in selections:
        if not selection.selected:
            continue
        info = _with_metadata(source, listing[selection.path])
        candidate = FilePlan(
            selection.path,
            info.size,
            info.metadata.get(SHA256_KEY),
            info.metadata.get(GIT_SHA1_KEY),
            "copy",
            "",
            listing[selection.path].etag,
        )
        files.append(_decide(candidate, existing.get(selection.path), source, dest, options))
    _refuse_leaving_the_weights(source, listing, files, options)
    if not files:
        raise UsageError(f"no files selected from {source.url}", hint="check --include/--exclude, or use --all-files")
    _check_part_limits(dest, files, options)
    check_names_fit(dest, [*(file.path for file in files if file.action == "copy"), *own_names])
    excluded = tuple(selection for selection in selections if not selection.selected)
    writes = {file.path for file in files} | {MANIFEST_NAME}
    candidates = [*existing, *unfollowed_links(dest_notes)]
    written_before = written_by_streamctl(manifests, candidates)
    cleanup = plan_cleanup(candidates, writes, written_before, lambda name: False, options.force)
    plan = TransferPlan(source_id, dest.url, commit, tuple(files), excluded, cleanup, notes)
    return _worker_share(plan, options.worker) if options.worker else plan


def _worker_share(plan: TransferPlan, worker: Worker) -> TransferPlan:
    """The plan cut to this worker's share; what the share is split from is every planned file, copied or
    skipped, so all workers compute the same split whatever DEST holds by now."""
    sized = [(file.path, file.size) for file in plan.files]
    mine = set(split_shares(sized, worker.count)[worker.index])
    share = take_share(plan.source, plan.commit, sized, worker)
    return replace(plan, files=tuple(file for file in plan.files if file.path in mine), share=share)


# --------------------------------------------------------------------------------------------- copying


class _ChecksumMismatch(Exception):
    pass


@dataclass
class _HashChain:
    """Feeds parts to a file's digests strictly in order, whatever order they arrive in."""

    digests: Digests
    next_index: int = 0
    failed: bool = False
    condition: threading.Condition = field(default_factory=threading.Condition)

    def feed(self, index: int, data: bytes | memoryview, cancelled: threading.Event) -> None:
        with self.condition:
            while self.next_index != index:
                if self.failed or cancelled.is_set():
                    raise Cancelled()
                self.condition.wait(0.2)
            self.digests.update(data)
            self.next_index += 1
            self.condition.notify_all()

    def fail(self) -> None:
        with self.condition:
            self.failed = True
            self.condition.notify_all()


@dataclass
class _OneStream:
    """A file read through one GET from its first byte, handed to its parts strictly in order: for a source
    that ignores Range (a CDN answering 200 with the whole file), where each part's own read would fetch
    the file again. Parts are submitted in order to a FIFO pool, so the part a waiting one needs is ahead."""

    chunks: Iterator[bytes]
    position: int = 0
    failed: bool = False
    pending: memoryview = field(default_factory=lambda: memoryview(b""))
    condition: threading.Condition = field(default_factory=threading.Condition)

    def read_into(self, start: int, view: memoryview, cancelled: threading.Event) -> int:
        with self.condition:
            while self.position != start:
                if self.failed or cancelled.is_set():
                    raise Cancelled()
                self.condition.wait(0.2)
            filled = 0
            try:
                while filled < len(view):
                    if not self.pending:
                        chunk = next(self.chunks, b"")
                        if not chunk:
                            break  # the file ended early: the caller reports it
                        self.pending = memoryview(chunk)
                    taken = min(len(self.pending), len(view) - filled)
                    view[filled : filled + taken] = self.pending[:taken]
                    self.pending, filled = self.pending[taken:], filled + taken
            except BaseException:
                self.failed = True
                raise
            finally:
                self.position += filled
                self.condition.notify_all()
            return filled

    def close(self) -> None:
        with self.condition:
            self.failed = True
            self.condition.notify_all()
        close = getattr(self.chunks, "close", None)
        if close is not None:
            close()


@dataclass
class _Engine:
    source: Location
    dest: Location
    options: TransferOptions
    progress: Progress
    overall_task: int
    budget: ByteBudget
    parts: ThreadPoolExecutor
    cancelled: threading.Event = field(default_factory=threading.Event)
    open_uploads: dict[int, MultipartUpload] = field(default_factory=dict)  # by id(): uploads need not be hashable
    lock: threading.Lock = field(default_factory=threading.Lock)
    bytes_sent: int = 0
    buffers: PartBuffers = field(default_factory=PartBuffers)
    bytes_reused: int = 0  # parts an earlier run left at DEST that matched the source: not sent again
    origin: Mapping[str, object] = field(default_factory=dict)  # the plan's source and commit (resume tokens)
    shielded: Shielded | None = None  # runs the uploads' creation (see _copy_once)

    def part_size(self, file: FilePlan) -> int:
        return part_size_for(file.size, self.options.part_size, self.dest.store)

    def resume_token(self, file: FilePlan) -> str:
        """The token of `file`'s upload (Store.start_multipart's `resume`): the same for every run that
        would upload the same source version of it the same way."""
        identity = {"key": self.dest.key(file.path), "size": file.size, "part_size": self.part_size(file)}
        return resume_token({**identity, **self.origin, "version": file.source_etag or file.sha256})

    def _retry(self, operation: Callable[[], object], what: str) -> object:
        def note(attempt: int, error: RemoteError) -> None:
            self.progress.log(f"retrying {what} (attempt {attempt + 1}): {error.message}")

        return with_retries(operation, self.options.retry, note, self.cancelled)

    def _read(self, path: str, start: int, length: int) -> bytes:
        key = self.source.key(path)
        data = self._retry(lambda: self.source.store.read_range(key, start, length), f"read of {path}")
        assert isinstance(data, bytes)
        if len(data) != length:
            raise IntegrityError(f"{self.source.store.url(key)}: source ended early (changed during the copy?)")
        return data

    def _read_into(self, path: str, start: int, buffer: memoryview) -> None:
        key = self.source.key(path)
        read = self._retry(lambda: self.source.store.read_range_into(key, start, buffer), f"read of {path}")
        if read != len(buffer):
            raise IntegrityError(f"{self.source.store.url(key)}: source ended early (changed during the copy?)")

    def _sent(self, task: int, amount: int) -> None:
        with self.lock:
            self.bytes_sent += amount
        self.progress.advance(task, amount)
        self.progress.advance(self.overall_task, amount)

    def copy(self, file: FilePlan) -> CopiedFile:
        """Copy one file; a checksum mismatch is retried once from scratch, then fails with exit 5."""
        note = part_size_note(file.path, file.size, self.options.part_size, self.part_size(file), self.dest.store)
        if note:
            self.progress.log(note)
        for attempt in (1, 2):
            task = self.progress.task(file.path, file.size)
            try:
                sha256 = self._copy_once(file, task)
                return CopiedFile(file.path, file.size, sha256, "copied")
            except _ChecksumMismatch as mismatch:
                if attempt == 2:
                    raise IntegrityError(
                        f"{file.path}: checksum mismatch twice ({mismatch}); nothing was committed",
                        hint="the source served different bytes than it advertises; retry later or report it",
                    ) from None
                self.progress.log(f"{file.path}: checksum mismatch ({mismatch}); retrying once from scratch")
            finally:
                self.progress.done(task)
        raise AssertionError("unreachable")

    def _copy_once(self, file: FilePlan, task: int) -> str:
        store = self.dest.store
        part_size = self.part_size(file)
        if file.size <= part_size:
            return self._copy_small(file, task)
        sha256 = file.sha256
        if sha256 is None:
            # Multipart metadata is fixed when the upload starts, so the digest must be known first.
            sha256 = hash_object(self.source, file.path, file.size, self.options.retry)
        metadata = {SHA256_KEY: sha256, **({GIT_SHA1_KEY: file.git_sha1} if file.git_sha1 else {})}
        key = self.dest.key(file.path)
        token = self.resume_token(file)

        def start_and_record() -> MultipartUpload:
            started = self._retry(
                lambda: store.start_multipart(key, part_size, metadata, None, token), f"upload of {file.path}"
            )
            upload = cast(MultipartUpload, started)
            with self.lock:
                self.open_uploads[id(upload)] = upload
            return upload

        # Shielded: a stop signal cuts worker threads' requests, and must not cut an upload's creation off from
        # its record (the upload would stay open, unknown to the clean-up that aborts the others).
        upload = self.shielded(start_and_record) if self.shielded is not None else start_and_record()
        held_parts = {part.index: part for part in upload.held_parts()}
        kept = False
        try:
            try:
                chain = self._send_parts(file, upload, part_size, held_parts, task, None)
            except RangeIgnoredError as ignored:
                stream = self._one_stream(file, ignored)
                try:  # every part again, from the one stream (parts sent already are simply replaced)
                    chain = self._send_parts(file, upload, part_size, held_parts, task, stream)
                finally:
                    stream.close()
            problem = _mismatch(chain.digests, sha256, file.git_sha1)
            if problem:
                raise _ChecksumMismatch(problem)
            self._retry(lambda: upload.complete(metadata), f"completion of {file.path}")
            return sha256
        except BaseException as error:
            # A lost link or a stopped run leaves sound parts: the run decides whether they stay to resume.
            kept = isinstance(error, (Cancelled, RemoteError))
            if not kept:
                self._abort(upload)
            raise
        finally:
            if not kept:
                with self.lock:
                    self.open_uploads.pop(id(upload), None)

    def _send_parts(
        self,
        file: FilePlan,
        upload: MultipartUpload,
        part_size: int,
        held_parts: Mapping[int, HeldPart],
        task: int,
        stream: _OneStream | None,
    ) -> _HashChain:
        """Every part of `file` read (each on its own, or from `stream`), hashed in order and sent; on any
        failure, returns only once every part has given its budget back."""
        chain = _HashChain(Digests(file.size, with_git_sha1=False))  # sha256 is known here
        futures: list[Future[None]] = []
        try:
            for index, start in enumerate(range(0, file.size, part_size)):
                length = min(part_size, file.size - start)
                if self.cancelled.is_set():
                    raise Cancelled()
                held = self.budget.acquire(length, self.cancelled)
                at_dest = held_parts.get(index)
                future = self.parts.submit(
                    self._part, file, upload, chain, index, start, length, held, task, at_dest, stream
                )
                futures.append(future)
            for future in futures:
                future.result()
            return chain
        except BaseException:
            chain.fail()
            if stream is not None:
                stream.close()
            for future in futures:
                future.exception()  # wait: every part gives its budget back before we abort
            raise

    def _one_stream(self, file: FilePlan, ignored: RangeIgnoredError) -> _OneStream:
        """`file` read once, through one GET, when its source ignores Range and can stream (the Hub's
        iter_range); else the source's error stands."""
        iter_range = getattr(self.source.store, "iter_range", None)
        if iter_range is None:
            raise ignored
        self.progress.log(f"{file.path}: the source ignores byte ranges; reading the file in one stream")
        return _OneStream(iter_range(self.source.key(file.path), 0, file.size, chunk_size=MiB))

    def _part(
        self,
        file: FilePlan,
        upload: MultipartUpload,
        chain: _HashChain,
        index: int,
        start: int,
        length: int,
        held: int,
        task: int,
        at_dest: HeldPart | None = None,
        stream: _OneStream | None = None,
    ) -> None:
        try:
            if self.cancelled.is_set() or chain.failed:
                raise Cancelled()
            # Read, hash and send from one reused buffer: no copy of the part, no fresh pages per part.
            buffer = self.buffers.take(upload.part_size)  # the last part too: one size, reused
            try:
                view = memoryview(buffer)[:length]
                if stream is None:
                    self._read_into(file.path, start, view)
                elif stream.read_into(start, view, self.cancelled) != length:
                    raise IntegrityError(f"{file.path}: source ended early (changed during the copy?)")
                data = view.toreadonly()  # what the SDKs see (some take read-only buffers only)
                chain.feed(index, data, self.cancelled)
                if at_dest is not None and at_dest.matches(data):
                    self._reused(task, length)  # an earlier run sent these very bytes: read and hashed, not sent
                    return
                self._retry(lambda: upload.upload_part(index, data), f"part {index} of {file.path}")
            finally:
                self.buffers.give(buffer)
            self._sent(task, length)
        finally:
            self.budget.release(held)

    def _reused(self, task: int, amount: int) -> None:
        with self.lock:
            self.bytes_reused += amount
        self.progress.advance(task, amount)
        self.progress.advance(self.overall_task, amount)

    def _copy_small(self, file: FilePlan, task: int) -> str:
        held = self.budget.acquire(max(file.size, 1), self.cancelled)
        try:
            data = self._read(file.path, 0, file.size)
            digests = Digests(file.size)
            digests.update(data)
            problem = _mismatch(digests, file.sha256, file.git_sha1)
            if problem:
                raise _ChecksumMismatch(problem)
            sha256 = digests.sha256.hexdigest()
            metadata = {SHA256_KEY: sha256, GIT_SHA1_KEY: digests.git_sha1.hexdigest()}
            key = self.dest.key(file.path)
            self._retry(lambda: self.dest.store.put(key, data, metadata), f"upload of {file.path}")
            self._sent(task, file.size)
            return sha256
        finally:
            self.budget.release(held)

    def _abort(self, upload: MultipartUpload) -> None:
        try:
            upload.abort()
        except StreamctlError as error:
            self.progress.log(f"could not abort the upload of {upload.key}: {error.message}")

    def abort_all(self) -> None:
        with self.lock:
            uploads = list(self.open_uploads.values())
            self.open_uploads.clear()
        for upload in uploads:
            self._abort(upload)

    def keep_for_resume(self) -> None:
        """Leave the open uploads' parts at DEST (a lost link, a lost lease): the next run of the same plan
        reopens them and sends only what they lack; any other run into DEST discards them."""
        with self.lock:
            uploads = list(self.open_uploads.values())
            self.open_uploads.clear()
        if uploads:
            shown = ", ".join(sorted(self.dest.relative(upload.key) for upload in uploads)[:5])
            self.progress.log(f"left {len(uploads)} unfinished upload(s) for the next run to resume: {shown}")


def transfer_manifest(plan: TransferPlan, files: tuple[CopiedFile, ...]) -> TransferManifest:
    """A whole run's manifest: what it copied (or found already right), and the files earlier streamctl runs
    wrote here that this one left (no --force): a later --force removes them."""
    return TransferManifest(plan.source, plan.commit, _entries(files), plan.cleanup.older_files).stamped()


def _entries(files: Sequence[CopiedFile]) -> tuple[FileEntry, ...]:
    return tuple(FileEntry(file.path, file.size, file.sha256) for file in files)


def _finish(
    dest: Location, plan: TransferPlan, files: tuple[CopiedFile, ...], progress: Progress, lease: Lease, force: bool
) -> tuple[tuple[str, ...], ShareRecord | None]:
    """Remove what --force replaces, then write the manifest (a worker: merge its share into it, and only the
    one completing it removes). What was removed, and for a worker the shares finished."""
    if plan.share is None:
        gone = remove_files(dest, plan.cleanup.to_remove, progress)  # only now that the new files are complete
        lease.ensure_held()  # after this renewal nobody can take DEST over before the manifest is written
        put_manifest(dest, transfer_manifest(plan, files))
        return gone, None
    removed: tuple[str, ...] = ()

    def remove_replaced() -> None:  # the files of every share are complete now
        nonlocal removed
        removed = remove_files(dest, plan.cleanup.to_remove, progress)

    cleanup = plan.cleanup
    fields = ShareFields(
        plan.source, plan.commit, _entries(files), cleanup.older_files, cleanup.to_remove, plan.share.planned, force
    )
    lease.ensure_held()
    record = record_share(dest, MANIFEST_NAME, fields, plan.share.worker, plan.share.digest,
                          remove_replaced, lease.guard_commit)  # fmt: skip
    if record.restarted:
        progress.log(
            f"{MANIFEST_NAME} recorded the shares of another split or plan (other files, revision or worker count); "
            f"it records this one's from now on: run every --worker K/{record.count} of this split"
        )
    if not record.complete:
        progress.log(f"worker {plan.share.worker}: share recorded; {len(record.finished)} of {record.count} done")
    return removed, record


def execute_transfer(
    plan: TransferPlan,
    source: Location,
    dest: Location,
    options: TransferOptions = TransferOptions(),
    progress: Progress = NULL_PROGRESS,
) -> TransferResult:
    """Copy every planned file, remove what --force replaces, then write the manifest. Ctrl-C aborts open
    uploads before re-raising.

    The whole write phase holds DEST's lease (DestinationBusy, exit 7, while another run writes there)."""
    options.validate()
    check_disjoint(source, dest)  # again: a plan may come from elsewhere, and nothing is written yet
    worker = plan.share.worker if plan.share else None
    command = f"streamctl transfer {plan.source}" + (f" --worker {worker}" if worker else "")
    with hold_lease(dest, command, progress, worker=worker) as lease:
        dest = lease.fenced(dest)
        if not options.force:
            # Planning ran before the lease: another run may have finished writing here since.
            existing = list_dest(dest)
            manifests = read_dest_manifests(dest, {name: info.size for name, info in existing.items()})
            planned = set(plan.share.planned) if plan.share else {file.path for file in plan.files}
            _check_manifest(dest, manifests, plan.source, plan.commit, planned)
        return _execute_transfer(plan, source, dest, options, progress, lease)


def _execute_transfer(
    plan: TransferPlan, source: Location, dest: Location, options: TransferOptions, progress: Progress, lease: Lease
) -> TransferResult:
    started = time.monotonic()
    to_copy = [file for file in plan.files if file.action == "copy"]
    # A worker's are its own share's files: the other workers' uploads in flight are theirs.
    ours = {file.path for file in plan.files} | ({MANIFEST_NAME} if plan.share is None else set())
    overall = progress.task("total", plan.copy_bytes)
    parts = ThreadPoolExecutor(options.concurrency, thread_name_prefix="streamctl-part")
    files_pool = ThreadPoolExecutor(options.concurrency, thread_name_prefix="streamctl-file")
    engine = _Engine(source, dest, options, progress, overall, ByteBudget(options.max_buffer), parts)
    engine.origin = {"source": plan.source, "commit": plan.commit}
    tokens = {file.path: engine.resume_token(file) for file in to_copy}
    resumable = lambda name, token: tokens.get(name) == token  # noqa: E731
    discarded = discard_unfinished_uploads(dest, ours.__contains__, progress, lease.acquired_at, resumable)
    lease.on_lost(engine.cancelled.set)  # another run holds DEST now: stop writing at once
    copied: dict[str, CopiedFile] = {}
    try:
        with shielded_calls() as engine.shielded:
            # Largest first: the long poles start early and small files fill the gaps.
            ordered = sorted(to_copy, key=lambda file: -file.size)
            futures = {files_pool.submit(engine.copy, file): file for file in ordered}
            for future in futures:
                result = future.result()
                copied[result.path] = result
    except BaseException as error:
        engine.cancelled.set()
        # Requests in flight end now (Ctrl-C, a signal, or a failed file), not at their deadlines; on a stop,
        # uploads being created finish, so that the aborts below see them.
        deadlines.cut_all(spare_clean_up=isinstance(error, KeyboardInterrupt))
        files_pool.shutdown(wait=True, cancel_futures=True)
        if isinstance(error, (RemoteError, DestinationBusy)):
            engine.keep_for_resume()  # the link or the lease was lost, not the will to copy: resume later
        engine.abort_all()  # Ctrl-C, bad input, bad bytes: nothing is left behind
        raise
    finally:
        files_pool.shutdown(wait=True)
        parts.shutdown(wait=True)
        progress.done(overall)
    results = tuple(
        copied.get(file.path) or CopiedFile(file.path, file.size, file.sha256 or "", "skipped") for file in plan.files
    )
    removed, share = _finish(dest, plan, results, progress, lease, options.force)
    return TransferResult(
        plan.source,
        plan.dest,
        plan.commit,
        results,
        engine.bytes_sent,
        time.monotonic() - started,
        discarded,
        removed,
        plan.notes,
        engine.bytes_reused,
        share,
    )


# ------------------------------------------------------------------------------------------ one run


@dataclass(frozen=True)
class TransferRun:
    """What `streamctl transfer` did: the copy, and the check of DEST after it (None: not checked)."""

    result: TransferResult
    verify: VerifyReport | None

    def to_json(self) -> dict[str, object]:
        return {**self.result.to_json(), "verify": self.verify.to_json() if self.verify is not None else None}


def run_transfer(
    source_url: str,
    dest_url: str,
    options: TransferOptions,
    storage: StorageOptions,
    progress: Progress = NULL_PROGRESS,
    *,
    dry_run: bool = False,
    verify: bool = True,
    on_plan: Callable[[TransferPlan], None] = lambda plan: None,
) -> TransferPlan | TransferRun:
    """The whole transfer: open both sides, plan (the plan is the answer with `dry_run`; else `on_plan` sees it
    before anything is written), copy, then verify-index DEST when weights (of any format) were among the files, as
    shard checks what it wrote. A check that fails raises ChecksFailed carrying the run (exit 1)."""
    from streamctl.memory import return_large_buffers_to_the_os
    from streamctl.storage import open_destination, open_location
    from streamctl.storage.url import source_identity
    from streamctl.verify.run import verify_checkpoint

    options.validate()
    return_large_buffers_to_the_os()
    source = open_location(source_url, storage)
    dest = open_destination(dest_url, replace(storage, follow_symlinks=False))  # nothing is written through a link
    plan = plan_transfer(source, dest, source_identity(source), options)
    if dry_run:
        return plan
    on_plan(plan)
    result = execute_transfer(plan, source, dest, options, progress)
    report = None
    whole = result.share is None or result.share.complete  # a worker's share alone is not a checkpoint
    planned = plan.share.planned if plan.share else tuple(file.path for file in plan.files)
    if verify and whole and any(weights_file(path) for path in planned):
        try:
            report = verify_checkpoint(dest)  # verify-index's rule, as `serve` applies it: GGUF alone is none
        except NotFoundError as error:
            error.hint = f"{error.hint or ''} (the copy is complete; --no-verify skips this check)".lstrip()
            raise
    run = TransferRun(result, report)
    if report is not None and not report.ok:
        raise ChecksFailed(run, report)
    return run
