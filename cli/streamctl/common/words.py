"""Counted nouns in messages: "1 error", "2 errors", never "1 errors"."""

from __future__ import annotations


def plural(count: int, singular: str, plural_form: str | None = None) -> str:
    """`count` and the noun agreeing with it, the count written with thousands separators."""
    noun = singular if count == 1 else (plural_form or f"{singular}s")
    return f"{count:,} {noun}"
