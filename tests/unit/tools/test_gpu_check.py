"""``tools.gpu_check`` on a machine without a GPU, and its JUnit summary."""

from __future__ import annotations

import importlib.metadata
import json

import pytest
import torch

from tools import gpu_check

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.gpu.test_te_path" name="test_a" time="1.0">
  <properties><property name="mfu.bf16.tflops" value="412.5"/></properties></testcase>
<testcase classname="tests.gpu.test_te_path" name="test_b[blockwise]" time="0.1">
  <skipped type="pytest.skip" message="blockwise FP8 needs CUDA &gt;= 12.9, found 12.8"/></testcase>
<testcase classname="tests.gpu.test_multi_gpu" name="test_c" time="2.0">
  <failure message="AssertionError: grad rel err 4e-2">trace</failure></testcase>
</testsuite></testsuites>"""


def test_junit_report_is_summarised_per_test():
    out = gpu_check.parse_junit(JUNIT)
    assert out["test_te_path::test_a"] == {
        "outcome": "passed",
        "message": "",
        "properties": {"mfu.bf16.tflops": 412.5},
    }
    assert out["test_te_path::test_b[blockwise]"]["outcome"] == "skipped"
    assert "CUDA >= 12.9" in out["test_te_path::test_b[blockwise]"]["message"]
    assert out["test_multi_gpu::test_c"]["outcome"] == "failed"


def test_fp8_support_that_raises_without_a_device_is_a_no(monkeypatch):
    """TE's ``check_fp8_support`` raises ``RuntimeError`` on a machine without a GPU; the check
    reports FP8 as unsupported with TE's reason instead of crashing."""
    import sys
    import types

    def no_device():
        raise RuntimeError("CUDA driver\nnot found")

    te = types.ModuleType("transformer_engine")
    te.__version__ = "2.20.2"
    te.__path__ = []
    pytorch = types.ModuleType("transformer_engine.pytorch")
    pytorch.__path__ = []
    fp8 = types.ModuleType("transformer_engine.pytorch.fp8")
    fp8.check_fp8_support = no_device
    for name, module in (
        ("transformer_engine", te),
        ("transformer_engine.pytorch", pytorch),
        ("transformer_engine.pytorch.fp8", fp8),
    ):
        monkeypatch.setitem(sys.modules, name, module)
    info = gpu_check.versions()
    assert info["transformer_engine"] == "2.20.2"
    assert info["fp8_supported"] is False
    assert info["fp8_reason"] == "check_fp8_support raised: CUDA driver not found"


def test_delayed_scaling_check_passes_on_any_machine():
    out = gpu_check.delayed_scaling_refused()
    assert out["outcome"] == "passed" and "delayed" in out["message"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")
def test_without_a_gpu_it_checks_nothing_and_says_so(capsys):
    assert gpu_check.main([]) == 2
    captured = capsys.readouterr()
    assert "needs a CUDA GPU" in captured.err
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert summary["ok"] is False and summary["checks"] == {}
    assert summary["versions"]["megatron_core"] == importlib.metadata.version("megatron-core")
