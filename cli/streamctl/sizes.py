"""Byte sizes as users type them: 64MiB, 64M, 1.5GiB, 100MB, 5368709120."""

from __future__ import annotations

import re

from streamctl.errors import UsageError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kib": 1024,
    "kb": 1000,
    "m": 1024**2,
    "mib": 1024**2,
    "mb": 1000**2,
    "g": 1024**3,
    "gib": 1024**3,
    "gb": 1000**3,
    "t": 1024**4,
    "tib": 1024**4,
    "tb": 1000**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str, option: str = "size") -> int:
    """K/M/G and KiB/MiB/GiB are binary (as in rclone and vLLM's docs); KB/MB/GB are decimal."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise UsageError(f"invalid {option} {text!r}", hint="write a number with an optional unit: 64MiB, 1G, 500MB")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise UsageError(f"{option} must be positive, got {text!r}")
    return value
