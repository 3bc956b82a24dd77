"""Test-session set-up: what every DCP entry point does at start-up (``dcp.init()`` would too),
and fixtures shared across suites."""

import subprocess
import sys
from pathlib import Path

import pytest

import megatron_patches

REPO = Path(__file__).resolve().parents[1]


def pytest_configure(config) -> None:
    megatron_patches.apply()  # the CPU shim, when there is no GPU; nothing on a GPU machine


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """The demo corpus (the standard library's own files, ``tools.prepare_data --stdlib``),
    built once per session: ``<dir>/stdlib.{bin,idx}``."""
    out = tmp_path_factory.mktemp("corpus") / "stdlib"
    subprocess.run(
        [sys.executable, "-m", "tools.prepare_data", "--stdlib", "--out", str(out)],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    return out
