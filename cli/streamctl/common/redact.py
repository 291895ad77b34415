"""What streamctl shows a person carries no credential and no terminal control sequence.

Two pure functions, used by every place that displays text (output.py's consoles, the `serve --dry-run`
command line, the storage errors) so that no path can forget one:

* `mask_credentials` replaces the userinfo of every URL in a text (`http://user:pass@host` becomes
  `http://***@host`) and the values of the signing parameters of pre-signed / SAS URLs (`sig=`,
  `X-Amz-Signature=`, ...). Only what is shown is masked: launches and requests keep the real values.
* `printable` escapes what a terminal would act on instead of print (C0/C1 controls, DEL, the line and
  paragraph separators and the bidirectional overrides that reorder what is displayed), so that a file
  named `\\x1b[2J.safetensors` shows as that text instead of clearing the screen.

JSON output keeps names as they are (`json.dumps` escapes controls itself) but masks credentials too.
"""

from __future__ import annotations

import re

MASK = "***"

# scheme://userinfo@ : greedy up to the last "@" before the path, as URL parsers split it (a password may
# hold a raw "@"). Whitespace ends a URL inside a message.
_URL_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)[^/?#\s]*@")
# Query parameters that carry a credential in pre-signed S3/GCS URLs and Azure SAS URLs, and bearer tokens.
_URL_SECRET_PARAMETERS = re.compile(
    r"(?P<name>[?&](?:sig|signature|x-amz-signature|x-amz-credential|x-amz-security-token|x-goog-signature"
    r"|x-goog-credential|access_token|token|api_key|apikey|key|password|secret)=)[^&#\s'\"]*",
    re.IGNORECASE,
)
# C0 controls, DEL, C1 controls, the Arabic letter mark, LRM/RLM, the line/paragraph separators, the
# bidirectional embeddings/overrides (U+202A..U+202E) and isolates (U+2066..U+2069).
_NOT_PRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_NAMED_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def mask_credentials(text: str) -> str:
    """`text` with the userinfo of every URL and the signing parameters of signed URLs replaced by ***."""
    if "://" not in text and "=" not in text:
        return text  # the common case, and cheap
    masked = _URL_USERINFO.sub(lambda match: f"{match.group('scheme')}{MASK}@", text)
    return _URL_SECRET_PARAMETERS.sub(lambda match: f"{match.group('name')}{MASK}", masked)


def has_credentials(text: str) -> bool:
    """Whether `text` holds what `mask_credentials` would hide."""
    return mask_credentials(text) != text


def _escape(character: str) -> str:
    named = _NAMED_ESCAPES.get(character)
    if named is not None:
        return named
    code = ord(character)
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def printable(text: str) -> str:
    """`text` with every character a terminal would act on written as a visible escape (`\\x1b`, `\\u202e`)."""
    return _NOT_PRINTABLE.sub(lambda match: _escape(match.group()), text)


def for_display(text: str) -> str:
    """What a person may be shown of `text`: credentials masked, controls escaped."""
    return printable(mask_credentials(text))
