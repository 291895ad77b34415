"""Fixtures of the verify tests: a fresh location, local or on every store."""

from __future__ import annotations

import pytest

from streamctl.storage import open_location
from streamctl.storage.base import Location


@pytest.fixture
def location(local_root: str) -> Location:
    return open_location(local_root)


@pytest.fixture
def remote_or_local(any_root: str) -> Location:
    return open_location(any_root)
