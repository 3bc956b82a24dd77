"""Test-session set-up: what every DCP entry point does at start-up (``dcp.init()`` would too)."""

import megatron_patches


def pytest_configure(config) -> None:
    megatron_patches.apply()  # the CPU shim, when there is no GPU; nothing on a GPU machine
