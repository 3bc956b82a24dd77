"""The start-up version check: a torch outside the supported range stops every entry point with
one line naming the torch (and TE) found and the range, exit 2; NVIDIA's pre-release builds of a
supported release pass."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import torch

from dcp import versions

REPO = Path(__file__).resolve().parents[2]


def test_the_range_is_pyprojects():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert versions.TORCH_REQUIREMENT in project["dependencies"]


@pytest.mark.parametrize(
    "found",
    [
        "2.11.0",
        "2.14.1+cu130",
        "2.15.0",
        "2.14.0a0+b2c75dd062.nv26.09",
        "2.12.0a0+8145d630e8.nv26.05",
    ],
)
def test_a_supported_torch_passes(found):
    assert versions.version_problem(torch_version=found, te_version=None) is None


@pytest.mark.parametrize(
    "found", ["2.10.0a0+b4e4ee81d3", "2.10.1", "2.11.0a0+eb65b36914", "2.16.0", "2.16.0a0+git1"]
)
def test_a_torch_outside_the_range_is_named_with_the_range(found):
    problem = versions.version_problem(torch_version=found, te_version="2.10.0+abc")
    assert problem is not None and "\n" not in problem
    assert f"torch {found}" in problem
    assert "Transformer Engine 2.10.0+abc" in problem
    assert "torch>=2.11,<2.16" in problem
    no_te = versions.version_problem(torch_version=found, te_version=None)
    assert "Transformer Engine" not in no_te


@pytest.mark.parametrize("found", ["0.17.1", "0.20.0", "0.18.0rc1"])
def test_a_megatron_core_outside_the_range_is_named_with_the_range(found):
    problem = versions.version_problem(torch_version="2.14.1", megatron_version=found)
    assert problem == (
        f"megatron-core {found} is outside the range DCP supports, megatron-core>=0.18.0,<0.20: "
        "use a 0.18 or 0.19 release (requirements.txt pins 0.19.2)"
    )


@pytest.mark.parametrize("found", ["0.18.0", "0.18.2", "0.19.2"])
def test_a_supported_megatron_core_passes(found):
    assert versions.version_problem(torch_version="2.14.1", megatron_version=found) is None


def test_the_installed_torch_is_supported():
    assert versions.version_problem() is None, torch.__version__


def test_dcp_init_refuses_an_unsupported_torch(monkeypatch):
    from dcp.runtime.setup import init

    monkeypatch.setattr(torch, "__version__", "2.10.0")
    with pytest.raises(versions.UnsupportedVersion, match=r"torch 2\.10\.0 .*torch>=2\.11"):
        init()


def test_the_megatron_lm_entry_exits_2_with_one_line_on_rank_0(monkeypatch, capsys):
    from pretrain import pretrain_gpt_megatron

    monkeypatch.setattr(torch, "__version__", "2.10.0")
    monkeypatch.setenv("RANK", "0")
    assert pretrain_gpt_megatron.main() == 2
    assert capsys.readouterr().err == f"error: {versions.version_problem()}\n"
    monkeypatch.setenv("RANK", "1")  # the other ranks leave with the same code, quietly
    assert pretrain_gpt_megatron.main() == 2
    assert capsys.readouterr().err == ""


def test_the_trainer_entry_exits_2_with_one_line(tmp_path):
    """Checked by every rank together once the process group exists (here a world of one), in a
    process of its own (the entry point configures logging and torch for the whole process)."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "DCP_EXIT_RECORD"}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="1", RANK="0")
    run = (
        "import runpy, sys, torch; torch.__version__ = '2.10.0'; "
        "sys.argv = ['pretrain_gpt', '--config', 'pretrain/configs/tiny_cpu.yaml']; "
        "runpy.run_module('pretrain.pretrain_gpt', run_name='__main__')"
    )
    out = subprocess.run(
        [sys.executable, "-c", run], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 2, out.stderr[-2000:]
    (line,) = [x for x in out.stderr.splitlines() if "error:" in x]
    assert line.startswith("[rank0] error: torch 2.10.0 is outside the range"), line
    assert "torch>=2.11,<2.16" in line and "while checking the torch version" in line, line
