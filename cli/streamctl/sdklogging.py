"""Whether the cloud SDKs' own loggers may speak: only with --debug.

azure-identity alone logs ~16 lines per failed credential chain at WARNING, which Python's last-resort
handler prints to stderr even under --quiet --json; botocore, urllib3, google-auth and huggingface_hub log
retries and pool warnings the same way. streamctl reports what matters through its own errors and progress
protocol, so these loggers are off unless the user asks for --debug. Nothing here prints.

Only the CLI does this (`manage()`, from app.main): the loggers are the process's, and a program that uses
streamctl as a library keeps its own logging as it set it. Once managed, the setting is applied again each
time storage opens a backend (`backend_imported`), because some SDKs set their logger's level and handler as
they are imported (huggingface_hub adds a stderr handler at WARNING).
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
_managed = False


def manage() -> None:
    """The CLI owns this process (app.main): the SDK loggers follow --debug from now on."""
    global _managed
    _managed = True
    if "logging" in sys.modules:
        apply_all()


def configure(debug: bool) -> None:
    """Remember --debug (cheap: `logging` is imported only once a backend is opened, see apply_all); applied
    at once only where the CLI manages the loggers."""
    global _debug
    _debug = _debug or debug
    if _managed and "logging" in sys.modules:
        apply_all()


def backend_imported() -> None:
    """Storage imported a backend's SDK: where the CLI manages the loggers, apply the setting again (after the
    import: some SDKs set their own level then). A library caller's loggers are left as they are."""
    if _managed:
        apply_all()


def apply_all() -> None:
    """Silence the SDK loggers, or (debug) let them log everything to stderr: now, whoever manages them."""
    import logging

    for name in SDK_LOGGERS:
        apply(name)
    if _debug and not logging.getLogger().handlers:
        logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="%(name)s: %(message)s")


def apply(name: str) -> None:
    """(Re)apply the setting to one logger: libraries that set their own level on import call this after."""
    import logging

    logging.getLogger(name).setLevel(logging.DEBUG if _debug else logging.CRITICAL + 1)
