"""Storage: one protocol, one URL parser, and a registry of backends chosen by URL scheme.

Backends are imported only when a URL needs them, so `--help` never loads a cloud SDK.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from streamctl import sdklogging
from streamctl.errors import UsageError
from streamctl.storage.base import Location, MultipartUpload, ObjectInfo, StorageOptions, Store
from streamctl.storage.schemes import SCHEMES, Scheme
from streamctl.storage.url import ParsedURL, parse_url


def _factory(scheme: str) -> Callable[[ParsedURL, StorageOptions], Store]:
    module_name, _, attr = SCHEMES[scheme].factory.partition(":")
    module = importlib.import_module(module_name)
    sdklogging.backend_imported()  # the CLI's SDK loggers stay silent unless --debug; a library caller's are its own
    factory: Callable[[ParsedURL, StorageOptions], Store] = getattr(module, attr)
    return factory


def open_location(url: str, options: StorageOptions | None = None) -> Location:
    """Parse `url` and open its backend; nothing is contacted until the first request."""
    parsed = parse_url(url)
    store = _factory(parsed.scheme)(parsed, options or StorageOptions())
    return Location(store, parsed.prefix)


def open_destination(url: str, options: StorageOptions | None = None) -> Location:
    """open_location for a place to write: a read-only store (the Hub) is refused before any request."""
    parsed = parse_url(url)
    if not SCHEMES[parsed.scheme].writable:
        raise UsageError(
            f"{url}: the Hugging Face Hub is read-only here; it can be a SOURCE, not a DEST",
            hint="write to a folder or a bucket (publish to the Hub with `hf upload`)",
        )
    return open_location(url, options)


def streamer_url(location: Location, key: str) -> str:
    """What the Run:ai streamer and vLLM open for `key`: a local path, or SCHEME://BUCKET/KEY."""
    store = location.store
    if SCHEMES[store.scheme].object_store:
        return f"{store.scheme}://{store.bucket}/{key}"
    return store.url(key)


__all__ = [
    "SCHEMES",
    "Location",
    "MultipartUpload",
    "ObjectInfo",
    "ParsedURL",
    "Scheme",
    "StorageOptions",
    "Store",
    "open_destination",
    "open_location",
    "parse_url",
    "streamer_url",
]
