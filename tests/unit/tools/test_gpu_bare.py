"""``python -m tools.gpu_check --bare`` without a GPU, and the arithmetic of its measurements.

The whole bare sequence at tiny sizes on CPU is ``tests/distributed/test_gpu_bare.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dcp.bench.bare_check import perf

REPO = Path(__file__).resolve().parents[3]
BROKEN_TE = """raise FileNotFoundError(
    "Could not find shared object file for Transformer Engine core lib"
)
"""
"""What importing Transformer Engine's core wheel does on a machine without its CUDA libraries."""


def _bare_check(extra_path: str | None = None) -> subprocess.CompletedProcess:
    path = os.pathsep.join(p for p in (extra_path, str(REPO)) if p)
    return subprocess.run(
        [sys.executable, "-m", "tools.gpu_check", "--bare"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")
def test_bare_check_without_a_gpu_exits_2_with_one_error_line():
    proc = _bare_check()
    assert proc.returncode == 2, proc.stderr
    lines = (proc.stdout + proc.stderr).splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: tools.gpu_check --bare needs a CUDA device"), lines


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")
def test_bare_check_never_imports_transformer_engine(tmp_path):
    """With a Transformer Engine installed whose import fails the way TE's core wheel does
    without CUDA (and would break ``import megatron.core`` too), the answer is the same line."""
    package = tmp_path / "transformer_engine"
    package.mkdir()
    (package / "__init__.py").write_text(BROKEN_TE)
    proc = _bare_check(extra_path=str(tmp_path))
    assert proc.returncode == 2, proc.stderr
    lines = (proc.stdout + proc.stderr).splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    # The simulation is real: the default check imports TE and trips over it.
    default = subprocess.run(
        [sys.executable, "-c", "import transformer_engine"],
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "FileNotFoundError" in default.stderr


def test_mixed_lengths_halve_and_sum_to_the_total():
    assert perf.mixed_lengths(16384, shortest=512) == [8192, 4096, 2048, 1024, 512, 512]
    lengths = perf.mixed_lengths(65536, shortest=512)
    assert sum(lengths) == 65536 and lengths[0] == 32768 and min(lengths) == 512
    assert sum(perf.mixed_lengths(1000, shortest=100)) == 1000
    with pytest.raises(ValueError, match="total_tokens"):
        perf.mixed_lengths(100, shortest=64)


def test_mfu_is_achieved_flops_over_the_peak():
    out = perf.mfu(4.0e14, 2.0, 400.0)
    assert out == {"seconds": 2.0, "tflops": 200.0, "mfu": 0.5}
    assert perf.mfu(1e12, 1.0, None)["mfu"] is None


def test_peak_by_device_name_reads_the_h200_preset():
    assert perf.bf16_peak_tflops("NVIDIA H200") == 989.0
    assert perf.bf16_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert perf.bf16_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert perf.bf16_peak_tflops("NVIDIA GeForce RTX 4090") is None


def test_mfu_model_is_two_llama3_8b_layers():
    model = perf.llama3_8b_layers(2)
    assert model["num_layers"] == 2 and model["hidden_size"] == 4096
    assert model["ffn_hidden_size"] == 14336 and model["num_query_groups"] == 8
    assert model["vocab_size"] == 128256 and model["rotary_base"] == 500000.0
