"""The megatron-core releases every patch in this package was read against."""

from __future__ import annotations

from packaging.specifiers import SpecifierSet
from packaging.version import Version

MEGATRON_CORE_REQUIREMENT = "megatron-core>=0.18.0,<0.20"
"""pyproject.toml's megatron-core requirement, as written there. Its ends run the tests:
``make test`` at 0.19.2 (requirements.txt), ``make test-compat`` at 0.18.0
(requirements-compat.txt). Releases inside it differ in what the patches touch only as
``tests/unit/test_patch_guards.py`` allows for (docs/testing.md, 'Supported versions')."""

_RANGE = SpecifierSet(MEGATRON_CORE_REQUIREMENT.removeprefix("megatron-core"))


def megatron_core_version() -> str:
    from megatron.core import package_info

    return f"{package_info.MAJOR}.{package_info.MINOR}.{package_info.PATCH}"


def megatron_core_supported(version: str | None = None) -> bool:
    """Whether ``version`` (default: the installed megatron-core) is inside the range."""
    return Version(version or megatron_core_version()) in _RANGE


def require_supported_megatron(patch_name: str) -> None:
    """Refuse to patch a megatron-core outside the range: internals move between releases."""
    found = megatron_core_version()
    if not megatron_core_supported(found):
        raise RuntimeError(
            f"megatron_patches.{patch_name} was written against {MEGATRON_CORE_REQUIREMENT}, "
            f"found {found}: install one inside it (requirements.txt pins 0.19.2) or port the "
            "patch and widen MEGATRON_CORE_REQUIREMENT."
        )
