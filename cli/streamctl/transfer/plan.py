"""Plan a transfer: list both sides, choose the file set, decide copy or skip for each file, and what
--force removes in DEST (streamctl.dest.ownership). Writes nothing.

`--worker K/N` (streamctl.dest.shares): the plan is cut to share K of N, split from every planned file, so all
workers compute the same split whatever DEST holds by now.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

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
from streamctl.common.limits import MAX_CONCURRENCY, check_count
from streamctl.dest.lease import lease_name
from streamctl.dest.manifests import DestManifests, read_dest_manifests
from streamctl.dest.overlap import check_disjoint
from streamctl.dest.ownership import Cleanup, plan_cleanup, unfollowed_links, written_by_streamctl
from streamctl.dest.shares import Share, Worker, split_shares, take_share
from streamctl.dest.uploads import SHA256_KEY, check_part_size, list_dest, part_size_for
from streamctl.errors import NotFoundError, UsageError
from streamctl.retry import RetryPolicy
from streamctl.storage.base import ListingNote, Location, MiB, ObjectInfo, is_safe_relative_path, unsafe_path_reason
from streamctl.storage.names import check_names_fit
from streamctl.transfer.hashing import GIT_SHA1_KEY, hash_object

DEFAULT_PART_SIZE = 16 * MiB
DEFAULT_MAX_BUFFER = 256 * MiB
DEFAULT_CONCURRENCY = 16


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
    # `--worker K/N`: `files` are this worker's share of the plan (streamctl.dest.shares), `share` says of which.
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
    worker: Worker | None = None  # `--worker K/N`: copy share K of N (streamctl.dest.shares)

    def validate(self) -> None:
        check_count("--concurrency", self.concurrency, MAX_CONCURRENCY)
        if self.part_size < 1:
            raise UsageError("--part-size must be positive")
        if self.max_buffer < self.part_size:
            raise UsageError(
                f"--max-buffer ({self.max_buffer} bytes) is smaller than --part-size ({self.part_size} bytes)",
                hint="raise --max-buffer or lower --part-size",
            )


def _with_metadata(location: Location, info: ObjectInfo) -> ObjectInfo:
    """Listings of some stores (S3) carry no user metadata: ask for it when it is missing."""
    return info if info.metadata else location.store.stat(info.key)


def _read_json(location: Location, path: str, size: int) -> object:
    """The JSON document at `path`; None when it is not one verify-index would accept (nested too deeply, or a
    JSON bomb, included: the same rule, never a RecursionError)."""
    return decode_json_strictly(location.store.read_range(location.key(path), 0, size), what=path).value


def check_manifest(
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


def _list_source(source: Location) -> tuple[dict[str, ObjectInfo], tuple[ListingNote, ...]]:
    """SOURCE's files by relative path, and the entries its listing left out; NotFoundError when it holds
    none, UsageError (exit 2) for a name that is not a plain relative path."""
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
    return listing, notes


def _select(source: Location, listing: Mapping[str, ObjectInfo], options: TransferOptions) -> list[Selection]:
    """Every SOURCE file, selected or excluded (with why), from config.json, the index and the options."""
    config = _read_json(source, CONFIG_NAME, listing[CONFIG_NAME].size) if CONFIG_NAME in listing else None
    has_auto_map = isinstance(config, dict) and bool(config.get("auto_map"))
    sizes = {path: info.size for path, info in listing.items()}
    index_contents = read_index_contents(source, sizes)
    # None also when the index cannot be read as one: then every safetensors file is selected, and
    # verify-index says what is wrong with the index.
    indexed_shards = index_contents.get(INDEX_NAME)
    known = {CONFIG_NAME: config} if config is not None else {}
    referenced = {} if options.all_files else read_config_references(source, sizes, known)
    return select_files(
        listing,
        has_auto_map=has_auto_map,
        indexed_shards=indexed_shards,
        referenced=referenced,
        include=options.include,
        exclude=options.exclude,
        all_files=options.all_files,
        index_contents=index_contents,
    )


def _file_plans(
    source: Location,
    dest: Location,
    listing: Mapping[str, ObjectInfo],
    selected: Sequence[str],
    existing: Mapping[str, ObjectInfo],
    options: TransferOptions,
) -> list[FilePlan]:
    """Copy or skip, for each selected file (in the selection's order)."""
    files = []
    for path in selected:
        info = _with_metadata(source, listing[path])
        candidate = FilePlan(
            path,
            info.size,
            info.metadata.get(SHA256_KEY),
            info.metadata.get(GIT_SHA1_KEY),
            "copy",
            "",
            listing[path].etag,
        )
        files.append(_decide(candidate, existing.get(path), source, dest, options))
    return files


def plan_transfer(
    source: Location, dest: Location, source_id: str, options: TransferOptions = TransferOptions()
) -> TransferPlan:
    """List both sides, choose the file set and decide copy or skip for each file, and what --force removes
    in DEST (see streamctl.dest.ownership). Writes nothing; a DEST that overlaps SOURCE is refused (exit 2)."""
    options.validate()
    check_disjoint(source, dest)
    own_names = [MANIFEST_NAME, lease_name(options.worker)]
    check_names_fit(dest, own_names)  # DEST's own prefix or path first: then it can be listed
    listing, notes = _list_source(source)
    commit: str | None = getattr(source.store, "commit", None)
    selections = _select(source, listing, options)
    selected = [selection.path for selection in selections if selection.selected]
    existing = list_dest(dest)
    manifests = read_dest_manifests(dest, {name: info.size for name, info in existing.items()})
    if not options.force:
        check_manifest(dest, manifests, source_id, commit, set(selected))
    dest_notes = listing_notes(dest)  # one scan for both uses below (a bucket DEST: its folder markers only)
    _refuse_linked_dest_folders(dest, selected, dest_notes)
    files = _file_plans(source, dest, listing, selected, existing, options)
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
