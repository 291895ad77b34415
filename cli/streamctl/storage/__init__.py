"""Storage: one protocol, one URL parser, and a registry of backends chosen by URL scheme.

Backends are imported only when a URL needs them, so `--help` never loads a cloud SDK.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from streamctl import sdklogging
from streamctl.errors import UsageError
from streamctl.storage.base import Location, MultipartUpload, ObjectInfo, StorageOptions, Store
from streamctl.storage.url import ParsedURL, parse_url

# scheme -> "module:factory"; each factory is `(ParsedURL, StorageOptions) -> Store`.
BACKENDS: dict[str, str] = {
    "file": "streamctl.storage.local:open_store",
    "s3": "streamctl.storage.s3:open_store",
    "gs": "streamctl.storage.gcs:open_store",
    "az": "streamctl.storage.azure:open_store",
    "hf": "streamctl.storage.hf:open_store",
}


def _factory(scheme: str) -> Callable[[ParsedURL, StorageOptions], Store]:
    module_name, _, attr = BACKENDS[scheme].partition(":")
    module = importlib.import_module(module_name)
    sdklogging.apply_all()  # SDK loggers are silent unless --debug (after the import: some set levels then)
    factory: Callable[[ParsedURL, StorageOptions], Store] = getattr(module, attr)
    return factory


def open_location(url: str, options: StorageOptions | None = None) -> Location:
    """Parse `url` and open its backend; nothing is contacted until the first request."""
    parsed = parse_url(url)
    store = _factory(parsed.scheme)(parsed, options or StorageOptions())
    return Location(store, parsed.prefix)


READ_ONLY_SCHEMES = frozenset({"hf"})


def open_destination(url: str, options: StorageOptions | None = None) -> Location:
    """open_location for a place to write: a read-only store (the Hub) is refused before any request."""
    parsed = parse_url(url)
    if parsed.scheme in READ_ONLY_SCHEMES:
        raise UsageError(
            f"{url}: the Hugging Face Hub is read-only here; it can be a SOURCE, not a DEST",
            hint="write to a folder or a bucket (publish to the Hub with `hf upload`)",
        )
    return open_location(url, options)


__all__ = [
    "BACKENDS",
    "Location",
    "MultipartUpload",
    "ObjectInfo",
    "ParsedURL",
    "StorageOptions",
    "Store",
    "open_destination",
    "open_location",
    "parse_url",
]
