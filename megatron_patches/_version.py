"""The megatron-core release every patch in this package was written against."""

from __future__ import annotations

PINNED_MEGATRON_CORE = "0.19.2"


def megatron_core_version() -> str:
    from megatron.core import package_info

    return f"{package_info.MAJOR}.{package_info.MINOR}.{package_info.PATCH}"


def require_pinned_megatron(patch_name: str) -> None:
    """Refuse to patch an unknown megatron-core: internals move between releases."""
    found = megatron_core_version()
    if found != PINNED_MEGATRON_CORE:
        raise RuntimeError(
            f"megatron_patches.{patch_name} targets megatron-core {PINNED_MEGATRON_CORE}, "
            f"found {found}. Install the pinned version (pip install -r requirements.txt) "
            "or port the patch and update PINNED_MEGATRON_CORE."
        )
