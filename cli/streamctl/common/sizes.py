"""Byte units, defined once for the whole package (KiB..TiB), and byte sizes as users type them: 64MiB,
64M, 1.5GiB, 100MB, 5368709120."""

from __future__ import annotations

import re

from streamctl.errors import UsageError

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
TiB = 1024 * GiB

_UNITS = {
    "": 1,
    "b": 1,
    "k": KiB,
    "kib": KiB,
    "kb": 1000,
    "m": MiB,
    "mib": MiB,
    "mb": 1000**2,
    "g": GiB,
    "gib": GiB,
    "gb": 1000**3,
    "t": TiB,
    "tib": TiB,
    "tb": 1000**4,
}
_SIZE = re.compile(r"^\s*(\d+)(?:\.(\d+))?\s*([a-zA-Z]*)\s*$", re.ASCII)
_MAX_DIGITS = 20  # more integer digits than this is beyond every bound (10**20 bytes is 86 EiB)
_MAX_DECIMALS = 18  # finer than a byte at any unit; the rest cannot change the result


def parse_size(text: str, option: str = "size", maximum: int | None = None) -> int:
    """K/M/G and KiB/MiB/GiB are binary (as in rclone and vLLM's docs); KB/MB/GB are decimal.

    Exact integer arithmetic (no float: `1e400` digits would overflow it); UsageError (exit 2) for
    anything malformed, not positive, or above `maximum`.
    """
    match = _SIZE.match(text)
    unit = match.group(3).lower() if match else None
    if not match or unit not in _UNITS:
        raise UsageError(
            f"invalid {option} {text[:40]!r}{'...' if len(text) > 40 else ''}",
            hint="write a number with an optional unit: 64MiB, 1G, 500MB",
            code="bad-option-value",
        )
    whole, decimals = match.group(1).lstrip("0") or "0", (match.group(2) or "")[:_MAX_DECIMALS]
    value: int  # int ** int is typed Any (a negative exponent gives a float); these exponents are not negative
    if len(whole) > _MAX_DIGITS:
        value = 10**_MAX_DIGITS * _UNITS[unit]
    else:
        value = (int(whole + decimals) * _UNITS[unit]) // 10 ** len(decimals)
    if value <= 0:
        raise UsageError(f"{option} must be positive, got {text!r}", code="bad-option-value")
    if maximum is not None and value > maximum:
        raise UsageError(
            f"{option} must be at most {binary_size(maximum)}, got {text[:40]!r}{'...' if len(text) > 40 else ''}",
            code="bad-option-value",
        )
    return value


def binary_size(count: int) -> str:
    """`count` bytes in the largest binary unit that divides it exactly (5 MiB, 10,000 bytes)."""
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if count >= size and count % size == 0:
            return f"{count // size:,} {unit}"
    return f"{count:,} bytes"
