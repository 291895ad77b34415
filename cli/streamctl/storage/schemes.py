"""The one scheme table: for each URL scheme, its backend's factory, the other spellings the parser accepts,
whether it can be a DEST, whether it is on this machine, and whether the streamer and vLLM address it as
SCHEME://BUCKET/KEY.

A module of its own, not storage/__init__.py, because the URL parser (url.py) reads it too and
storage/__init__.py imports the parser; storage/__init__.py re-exports it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Scheme:
    name: str
    factory: str  # "module:function", a `(ParsedURL, StorageOptions) -> Store`
    service: str  # what messages call it ("S3's smallest part")
    aliases: tuple[str, ...] = ()  # other spellings of SCHEME:// the parser accepts
    writable: bool = True  # False: a SOURCE only
    object_store: bool = False  # BUCKET/KEY addressing; the streamer reads `SCHEME://BUCKET/KEY`
    local: bool = False  # this machine's file system: nothing a pod (a manifest) can reach


SCHEMES: dict[str, Scheme] = {
    scheme.name: scheme
    for scheme in (
        Scheme("file", "streamctl.storage.local:open_store", "a local folder", local=True),  # also a plain path
        Scheme("s3", "streamctl.storage.s3:open_store", "S3", object_store=True),
        Scheme("gs", "streamctl.storage.gcs:open_store", "GCS", aliases=("gcs",), object_store=True),
        # also https://ACCOUNT.blob.core.windows.net/CONTAINER/PREFIX
        Scheme("az", "streamctl.storage.azure:open_store", "Azure Blob", object_store=True),
        Scheme("hf", "streamctl.storage.hf:open_store", "the Hugging Face Hub", writable=False),
    )
}
ALIASES: dict[str, str] = {alias: scheme.name for scheme in SCHEMES.values() for alias in scheme.aliases}
OBJECT_SCHEMES = tuple(name for name, scheme in SCHEMES.items() if scheme.object_store)
