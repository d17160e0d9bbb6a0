"""build/constraints.txt pins every runtime dependency within pyproject's ranges, so the
binary built from it and the test environment installed with it hold one set of versions."""

from __future__ import annotations

import os
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
CONSTRAINTS = REPO / "build" / "constraints.txt"


def _pins() -> dict[str, str]:
    pins: dict[str, str] = {}
    for n, raw in enumerate(CONSTRAINTS.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        assert sep and version.strip(), f"constraints.txt line {n} is not an exact pin (name==version): {raw!r}"
        key = canonicalize_name(name.strip())
        assert key not in pins, f"constraints.txt pins {key} twice"
        pins[key] = version.strip()
    return pins


def _required() -> list[Requirement]:
    """pyproject's runtime dependencies that apply on this platform, and PyInstaller (it makes the binary)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    reqs += [
        Requirement(r)
        for r in project["optional-dependencies"]["test"]
        if canonicalize_name(Requirement(r).name) == "pyinstaller"
    ]
    return [r for r in reqs if r.marker is None or r.marker.evaluate()]


def test_every_runtime_dependency_is_pinned_within_its_range() -> None:
    pins = _pins()
    problems = []
    for req in _required():
        version = pins.get(canonicalize_name(req.name))
        if version is None:
            problems.append(f"{req.name} is not pinned")
        elif not req.specifier.contains(version, prereleases=True):
            problems.append(f"{req.name}=={version} is outside pyproject's {req.specifier}")
    assert not problems, "; ".join(problems) + ": run scripts/update-constraints"


def test_installed_runtime_dependencies_are_the_pinned_ones() -> None:
    # scripts/test installs with the constraints; elsewhere (a developer's own environment)
    # a difference is worth knowing about but is not this checkout's fault.
    pins = _pins()
    differ = []
    for req in _required():
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            have = "not installed"
        want = pins.get(canonicalize_name(req.name))
        if want is not None and have != want:
            differ.append(f"{req.name} {have} (pinned {want})")
    if differ:
        message = "installed versions differ from build/constraints.txt: " + ", ".join(differ)
        if os.environ.get("LLMGW_REQUIRE_E2E") == "1":
            pytest.fail(message + "; install with `-c build/constraints.txt` or run scripts/update-constraints")
        pytest.skip(message)
