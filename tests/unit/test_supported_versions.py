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


def _bound(name: str, operator: str) -> Version:
    (spec,) = (s for s in _ranges()[name].specifier if s.operator == operator)
    return Version(spec.version)


def test_the_compat_pins_are_the_lower_ends_of_the_ranges():
    compat = _pins("requirements-compat.txt")
    assert set(compat) == {"torch", "megatron-core"}
    assert compat["torch"].release[:2] == _bound("torch", ">=").release[:2]
    assert compat["megatron-core"] == _bound("megatron-core", ">=")
    assert re.search(r"^test-compat:", (REPO / "Makefile").read_text(), re.M)


def test_the_newest_pin_is_the_top_of_the_torch_range():
    newest = _pins("requirements-newest.txt")
    assert set(newest) == {"torch"}
    assert _ranges()["torch"].specifier.contains(newest["torch"])
    top = _bound("torch", "<").release  # (2, 16): the newest supported release is 2.15.x
    assert newest["torch"].release[:2] == (top[0], top[1] - 1)
    # requirements.txt's megatron-core is the newest series of its range.
    top = _bound("megatron-core", "<").release
    assert _pins("requirements.txt")["megatron-core"].release[:2] == (top[0], top[1] - 1)
