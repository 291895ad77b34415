"""The Python version streamctl claims (pyproject's requires-python, the README) is one that every
dependency supports and the one the tests run on: claim what is tested."""

from __future__ import annotations

import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def claimed_floor() -> Version:
    """The lowest Python requires-python admits: its `>=X.Y` bound."""
    bounds = [spec.version for spec in SpecifierSet(PROJECT["requires-python"]) if spec.operator == ">="]
    assert len(bounds) == 1, PROJECT["requires-python"]
    return Version(bounds[0])


def test_every_dependency_supports_the_claimed_python() -> None:
    """A dependency whose installed release (at or above our floor for it) refuses the claimed Python makes
    the claim false: typer 0.29 requires 3.11, so ">=3.10" promised an install that pip cannot do."""
    floor = claimed_floor()
    requirements = [Requirement(text) for text in PROJECT["dependencies"]]
    requirements += [Requirement(text) for text in PROJECT["optional-dependencies"]["test"]]
    refused = {}
    for requirement in requirements:
        try:
            distribution = metadata.distribution(requirement.name)
        except metadata.PackageNotFoundError:
            continue  # not installed here (none of the core dependencies may be: checked below)
        needs = distribution.metadata.get("Requires-Python")
        if needs and not SpecifierSet(needs).contains(floor):
            refused[f"{requirement.name} {distribution.version}"] = needs
    assert refused == {}, f"requires-python {PROJECT['requires-python']} claims {floor}, but {refused}"
    for text in PROJECT["dependencies"]:
        metadata.distribution(Requirement(text).name)  # the core dependencies are all installed


def test_the_claim_is_what_the_tests_run_on() -> None:
    floor = claimed_floor()
    assert sys.version_info[:2] >= (floor.major, floor.minor)
    assert SpecifierSet(PROJECT["requires-python"]).contains(f"{sys.version_info.major}.{sys.version_info.minor}")


def test_the_readme_claims_the_same_python() -> None:
    floor = claimed_floor()
    claims = set(re.findall(r"Python (3\.\d+)\+", (REPO / "README.md").read_text()))
    assert claims == {f"{floor.major}.{floor.minor}"}
