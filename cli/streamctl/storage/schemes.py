"""The one scheme table: for each URL scheme, its backend's factory, the other spellings the parser accepts,
whether it can be a DEST, whether it is on this machine, whether the streamer and vLLM address it as
SCHEME://BUCKET/KEY, and the longest names it holds.

A module of its own, not storage/__init__.py, because the URL parser (url.py) reads it too and
storage/__init__.py imports the parser; storage/__init__.py re-exports it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class NameLimits:
    """The longest names a writable backend holds (checked by storage/names.py before anything is written)."""

    max_length: int  # of a whole key (buckets) or absolute path (local folders), in `unit`
    unit: Literal["bytes", "characters"]  # bytes: of UTF-8 (local: of the file system encoding)
    max_component: int | None = None  # local folders: NAME_MAX, bytes per path segment
    # What the backend's temporary names add after `DIR/.streamctl-tmp/TOKEN/NAME` (GCS's part objects:
    # `/00000`; parts are numbered below 1,024); None where it writes no temporary names (Azure stages blocks).
    temporary_tail: str | None = ""


@dataclass(frozen=True)
class Scheme:
    name: str
    factory: str  # "module:function", a `(ParsedURL, StorageOptions) -> Store`
    service: str  # what messages call it ("S3's smallest part")
    aliases: tuple[str, ...] = ()  # other spellings of SCHEME:// the parser accepts
    writable: bool = True  # False: a SOURCE only
    object_store: bool = False  # BUCKET/KEY addressing; the streamer reads `SCHEME://BUCKET/KEY`
    local: bool = False  # this machine's file system: nothing a pod (a manifest) can reach
    # An upload takes its metadata when it completes at no cost (a local file's extended attributes are
    # written then anyway); a bucket fixes an object's metadata when its upload starts.
    metadata_at_completion: bool = False
    names: NameLimits | None = None  # None: a SOURCE only


SCHEMES: dict[str, Scheme] = {
    scheme.name: scheme
    for scheme in (
        # also a plain path; Linux's PATH_MAX (4,096 with the NUL) and NAME_MAX
        Scheme(
            "file",
            "streamctl.storage.local:open_store",
            "a local folder",
            local=True,
            metadata_at_completion=True,
            names=NameLimits(4095, "bytes", 255),
        ),
        Scheme("s3", "streamctl.storage.s3:open_store", "S3", object_store=True, names=NameLimits(1024, "bytes")),
        Scheme(
            "gs",
            "streamctl.storage.gcs:open_store",
            "GCS",
            aliases=("gcs",),
            object_store=True,
            names=NameLimits(1024, "bytes", temporary_tail="/00000"),
        ),
        # also https://ACCOUNT.blob.core.windows.net/CONTAINER/PREFIX
        Scheme(
            "az",
            "streamctl.storage.azure:open_store",
            "Azure Blob",
            object_store=True,
            names=NameLimits(1024, "characters", temporary_tail=None),
        ),
        Scheme("hf", "streamctl.storage.hf:open_store", "the Hugging Face Hub", writable=False),
    )
}
ALIASES: dict[str, str] = {alias: scheme.name for scheme in SCHEMES.values() for alias in scheme.aliases}
OBJECT_SCHEMES = tuple(name for name, scheme in SCHEMES.items() if scheme.object_store)
