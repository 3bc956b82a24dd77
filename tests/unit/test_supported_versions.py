"""The supported version range has one home, pyproject.toml's ``dependencies``: the default pins
(requirements.txt) and the oldest-torch pin of ``make test-compat`` (requirements-compat.txt)
must lie inside it, the compat pin at its lower end, and every runtime pin must be declared."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]


def _pins(name: str) -> dict[str, Version]:
    pins = {}
    for line in (REPO / name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"{name}: {line!r} is not an exact pin"
            pins[req.name] = Version(spec.version)
    return pins


def _ranges() -> dict[str, Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return {Requirement(d).name: Requirement(d) for d in project["dependencies"]}


def test_the_default_pins_lie_in_the_supported_range():
    ranges = _ranges()
    for name, version in _pins("requirements.txt").items():
        assert name in ranges, f"requirements.txt pins {name}, pyproject.toml does not declare it"
        assert ranges[name].specifier.contains(version), f"{name}=={version} outside {ranges[name]}"


def test_the_compat_pin_is_the_lower_end_of_the_torch_range():
    (torch_range,) = (s for s in _ranges()["torch"].specifier if s.operator == ">=")
    compat = _pins("requirements-compat.txt")
    assert set(compat) == {"torch"}
    assert compat["torch"].release[:2] == Version(torch_range.version).release[:2]
    assert re.search(r"^test-compat:", (REPO / "Makefile").read_text(), re.M)
