"""The process groups megatron-core's parallel state created.

Why upstream can't: megatron-core 0.19.2 gives every group it creates the timeout it was
initialised with and offers no call to change them later. ``parallel_state.create_group``
appends each group to the module list ``_global_process_group_list`` (``None`` stands for the
default group); DCP reads that list to lower every group's timeout once training runs.
"""

from __future__ import annotations

from megatron_patches._version import require_supported_megatron


def megatron_groups() -> list:
    """Every group megatron's parallel state created on this rank (may hold ``None`` for the
    default group and non-member placeholders); empty before it is initialised."""
    require_supported_megatron("process_groups")
    from megatron.core import parallel_state as ps

    return list(ps._global_process_group_list or [])
