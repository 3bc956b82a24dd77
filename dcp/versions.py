"""The torch and megatron-core releases DCP supports, and the start-up check that names what it
found.

The range is pyproject.toml's ``torch`` requirement (``tests/unit/test_version_check.py`` keeps
the two equal); docs/testing.md, 'Supported versions', says why each end is where it is. It is
read by PEP 440 with pre-releases allowed: NVIDIA's containers ship pre-release builds of the
next release (``2.14.0a0+b2c75dd062.nv26.09``), which are inside it when their release is, while
a pre-release of the lowest release (``2.11.0a0``: a snapshot from before 2.11) or of the first
release past the top (``2.15.0a0``) is not. Transformer Engine's version is named, not checked:
which TE a torch works with is the container's business (docs/gpu.md names the image).
megatron-core's range is ``megatron_patches``' own (the patches refuse a release outside it); it
is checked here too, so that a wrong one is one line at start-up, not a patch's error.
"""

from __future__ import annotations

import importlib.metadata

import torch
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from megatron_patches._version import MEGATRON_CORE_REQUIREMENT, megatron_core_supported

TORCH_REQUIREMENT = "torch>=2.11,<2.16"
"""pyproject.toml's torch requirement, as written there."""

_TORCH_RANGE = SpecifierSet(TORCH_REQUIREMENT.removeprefix("torch"), prereleases=True)
_UNSET = object()


class UnsupportedVersion(ValueError):
    """The torch or megatron-core found is outside its range (one line naming it and the range):
    a user's error, so the entry points exit 2 with the line."""


def installed_te_version() -> str | None:
    """Transformer Engine's version from its installed metadata (nothing imported: an
    incomplete TE fails on import), or None without one."""
    for name in ("transformer_engine", "transformer-engine-torch"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def version_problem(
    *, torch_version: str | None = None, te_version=_UNSET, megatron_version: str | None = None
) -> str | None:
    """One line naming the torch (and TE, when installed) found and the supported range when
    ``torch_version`` (default: the running torch) is outside it, or the megatron-core found
    (default: the installed one) and its range; None when both are inside."""
    found = str(torch.__version__ if torch_version is None else torch_version)
    te = installed_te_version() if te_version is _UNSET else te_version
    try:
        supported = _TORCH_RANGE.contains(Version(found))
    except InvalidVersion:
        supported = False
    if supported:
        return _megatron_problem(megatron_version or importlib.metadata.version("megatron-core"))
    with_te = f" (with Transformer Engine {te})" if te else ""
    return (
        f"torch {found}{with_te} is outside the range DCP supports, {TORCH_REQUIREMENT}: use a "
        "torch 2.11 to 2.15 (docs/gpu.md names an NVIDIA container that has one)"
    )


def _megatron_problem(found: str) -> str | None:
    try:
        if megatron_core_supported(found):
            return None
    except InvalidVersion:
        pass
    return (
        f"megatron-core {found} is outside the range DCP supports, {MEGATRON_CORE_REQUIREMENT}: "
        "use a 0.18 or 0.19 release (requirements.txt pins 0.19.2)"
    )


def require_supported_versions() -> None:
    """Raise ``UnsupportedVersion`` (``version_problem``'s line) outside the supported range."""
    problem = version_problem()
    if problem is not None:
        raise UnsupportedVersion(problem)
