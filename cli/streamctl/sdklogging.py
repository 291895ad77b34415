"""Whether the cloud SDKs' own loggers may speak: only with --debug.

azure-identity alone logs ~16 lines per failed credential chain at WARNING, which Python's last-resort
handler prints to stderr even under --quiet --json; botocore, urllib3, google-auth and huggingface_hub log
retries and pool warnings the same way. streamctl reports what matters through its own errors and progress
protocol, so these loggers are off unless the user asks for --debug. Nothing here prints.
"""

from __future__ import annotations

import sys

SDK_LOGGERS = (
    "azure",
    "boto3",
    "botocore",
    "s3transfer",
    "urllib3",
    "requests",
    "google",
    "google_auth_httplib2",
    "huggingface_hub",
    "httpx",
    "httpx2",
    "httpcore",
    "httpcore2",
    "filelock",
)
_debug = False


def configure(debug: bool) -> None:
    """Remember --debug (cheap: `logging` is imported only once a backend is opened, see apply_all)."""
    global _debug
    _debug = _debug or debug
    if "logging" in sys.modules:
        apply_all()


def apply_all() -> None:
    """Silence the SDK loggers, or (debug) let them log everything to stderr. Storage calls this as it
    opens a backend, before any SDK can log."""
    import logging

    for name in SDK_LOGGERS:
        apply(name)
    if _debug and not logging.getLogger().handlers:
        logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="%(name)s: %(message)s")


def apply(name: str) -> None:
    """(Re)apply the setting to one logger: libraries that set their own level on import call this after."""
    import logging

    logging.getLogger(name).setLevel(logging.DEBUG if _debug else logging.CRITICAL + 1)
