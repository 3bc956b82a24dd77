"""The torch releases DCP supports, and the start-up check that names what it found.

The range is pyproject.toml's ``torch`` requirement (``tests/unit/test_version_check.py`` keeps
the two equal); docs/testing.md, 'Supported versions', says why each end is where it is. It is
read by PEP 440 with pre-releases allowed: NVIDIA's containers ship pre-release builds of the
next release (``2.14.0a0+b2c75dd062.nv26.09``), which are inside it when their release is, while
a pre-release of the lowest release (``2.11.0a0``: a snapshot from before 2.11) or of the first
release past the top (``2.15.0a0``) is not. Transformer Engine's version is named, not checked:
which TE a torch works with is the container's business (docs/gpu.md names the image).
"""

from __future__ import annotations

import importlib.metadata

import torch
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

TORCH_REQUIREMENT = "torch>=2.11,<2.15"
"""pyproject.toml's torch requirement, as written there."""

_TORCH_RANGE = SpecifierSet(TORCH_REQUIREMENT.removeprefix("torch"), prereleases=True)
_UNSET = object()


class UnsupportedVersion(ValueError):
    """The torch found is outside ``TORCH_REQUIREMENT`` (one line naming it and the range): a
    user's error, so the entry points exit 2 with the line."""


def installed_te_version() -> str | None:
    """Transformer Engine's version from its installed metadata (nothing imported: an
    incomplete TE fails on import), or None without one."""
    for name in ("transformer_engine", "transformer-engine-torch"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def version_problem(*, torch_version: str | None = None, te_version=_UNSET) -> str | None:
    """One line naming the torch (and TE, when installed) found and the supported range when
    ``torch_version`` (default: the running torch) is outside it; None when it is inside."""
    found = str(torch.__version__ if torch_version is None else torch_version)
    te = installed_te_version() if te_version is _UNSET else te_version
    try:
        supported = _TORCH_RANGE.contains(Version(found))
    except InvalidVersion:
        supported = False
    if supported:
        return None
    with_te = f" (with Transformer Engine {te})" if te else ""
    return (
        f"torch {found}{with_te} is outside the range DCP supports, {TORCH_REQUIREMENT}: use a "
        "torch 2.11 to 2.14 (docs/gpu.md names an NVIDIA container that has one)"
    )


def require_supported_versions() -> None:
    """Raise ``UnsupportedVersion`` (``version_problem``'s line) outside the supported range."""
    problem = version_problem()
    if problem is not None:
        raise UnsupportedVersion(problem)
