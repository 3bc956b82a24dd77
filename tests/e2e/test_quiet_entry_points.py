"""Every entry point prints its own output first: the third-party notices in
``dcp.console.KNOWN_NOISE`` are filtered in that one place, before the modules that print them
are imported. The entry points run as subprocesses, all at once (they mostly wait on imports)."""

from __future__ import annotations

import ast
import json
import logging
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from dcp import console
from dcp.console import KNOWN_NOISE, VERBOSE_ENV

REPO = Path(__file__).resolve().parents[2]
ENTRY_POINTS = sorted(
    [REPO / "pretrain/pretrain_gpt.py", REPO / "pretrain/example_engine.py"]
    + [p for p in (REPO / "tools").glob("*.py") if p.name != "__init__.py"]
)
# Python's own rendering of any warning, known or not: "file.py:12: UserWarning: text".
WARNING_LINE = re.compile(r"\b\w*Warning: ")
TORCHRUN = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node"]
TIMEOUT_S = 300


# What each entry point should print first (a regular expression matched at the line's start).
FIRST_LINE = {
    "tools.plan": r"\{$",
    "tools.simulate": r"h200x8\+llama3-8b: ",
    "tools.memory_budget": r"spec cpu-tiny",
    "tools.gpu_check": r"error: tools\.gpu_check needs a CUDA GPU",
    "pretrain.pretrain_gpt": r"\[rank0\] \S+ \S+ dcp\.",  # a DCP log line on rank 0
    # DCPEngine logs its start-up (process groups warmed) and online calibration on rank 0.
    "pretrain.example_engine": r"\[rank0\] \S+ \S+ dcp\.",
}


def _runs(tmp: Path) -> dict[str, list[str]]:
    """The cheapest command line of each entry point that imports megatron-core."""
    lengths = tmp / "lengths.json"
    lengths.write_text(json.dumps([100, 200, 300, 4000]))
    python = [sys.executable, "-m"]
    return {
        # the megatron planner imports megatron-core
        "tools.plan": [*python, "tools.plan", "--lengths", str(lengths), "--spec", "cpu-tiny"]
        + ["--planner", "megatron"],
        "tools.simulate": [*python, "tools.simulate", "--clusters", "8", "--batches", "1"]
        + ["--workloads", "lognormal", "--planners", "dcp,megatron", "--tokens-per-rank", "2048"]
        + ["--no-plan-time", "--out-dir", str(tmp / "simulate")],
        "tools.memory_budget": [*python, "tools.memory_budget"]
        + ["--config", "pretrain/configs/tiny_cpu.yaml"],
        "tools.gpu_check": [*python, "tools.gpu_check"],  # exits 2 at once without a GPU
        "pretrain.pretrain_gpt": [*TORCHRUN, "2", "-m", "pretrain.pretrain_gpt"]
        + ["--config", "pretrain/configs/tiny_cpu.yaml", "name=quiet", f"runs_dir={tmp}"]
        + ["data.source=synthetic", "data.indexed=null", "data.synthetic.max_len=500"]
        + ["model.max_seq_len=512", "train.steps=1", "metrics.wandb_mode=disabled"],
        "pretrain.example_engine": [*TORCHRUN, "2", "-m", "pretrain.example_engine"],
    }


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict[str, tuple[str, int]]:
    """``{entry point: (stdout and stderr as a terminal shows them, exit code)}``."""
    env = {k: v for k, v in os.environ.items() if k not in (VERBOSE_ENV, "PYTHONWARNINGS")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    runs = _runs(tmp_path_factory.mktemp("quiet"))
    procs = {
        name: subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for name, cmd in runs.items()
    }
    try:
        return {
            name: (p.communicate(timeout=TIMEOUT_S)[0], p.returncode) for name, p in procs.items()
        }
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


# KNOWN_NOISE lists what megatron-core and torch print on a machine without a GPU; the runs
# are CPU configs (gloo, the CPU shim) and tools.gpu_check would run its whole GPU suite.
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU machine's notices and configs")
@pytest.mark.parametrize("name", sorted(FIRST_LINE))
def test_entry_point_prints_its_own_output_first(name, outputs):
    output, code = outputs[name]
    assert code == (2 if name == "tools.gpu_check" else 0), output[-3000:]
    lines = [line for line in output.splitlines() if line.strip()]
    assert re.match(FIRST_LINE[name], lines[0]), f"{name} printed first: {lines[0]!r}"
    for noise in KNOWN_NOISE:
        assert noise.message not in output, f"{name} printed {noise.message!r}"
    assert not [line for line in lines if WARNING_LINE.search(line)], output[-3000:]


def test_entry_points_set_up_the_console_in_main_and_nowhere_else():
    """One place: each entry point's ``main`` calls ``console.setup`` and none configures
    logging or warnings itself."""
    for path in ENTRY_POINTS:
        tree = ast.parse(path.read_text())
        calls = {ast.unparse(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
        main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
        in_main = {ast.unparse(n.func) for n in ast.walk(main) if isinstance(n, ast.Call)}
        assert "console.setup" in in_main, f"{path.name}: main() does not call console.setup()"
        assert not calls & {"logging.basicConfig", "warnings.filterwarnings"}, path.name


def test_entry_point_modules_import_no_module_that_warns_on_import():
    """``console.setup()`` in ``main`` only catches import-time warnings of modules imported
    after it: importing an entry point must not import megatron-core or torch's cpp_extension."""
    modules = [".".join(p.relative_to(REPO).with_suffix("").parts) for p in ENTRY_POINTS]
    code = (
        "import importlib, json, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted(m for m in ('megatron', 'torch.utils.cpp_extension') "
        "if m in sys.modules)))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == [], proc.stdout


@pytest.fixture
def restored_logging():
    """``console.setup`` changes process-wide logging; put it back for the other tests."""
    names = ["", *console.QUIET_LOGGERS, *(n.module for n in KNOWN_NOISE if n.category is None)]
    saved = {n: (logging.getLogger(n).level, list(logging.getLogger(n).filters)) for n in names}
    root_handlers = list(logging.getLogger().handlers)
    yield
    for name, (level, filters) in saved.items():
        logging.getLogger(name).setLevel(level)
        logging.getLogger(name).filters[:] = filters
    logging.getLogger().handlers[:] = root_handlers


def _shown(noise: console.Noise, text: str) -> bool:
    """Whether ``text``, emitted the way ``noise`` is, gets through the current filters."""
    if noise.category is None:
        logger = logging.getLogger(noise.module)
        return all(
            f.filter(logger.makeRecord(noise.module, 30, "f.py", 1, text, (), None))
            for f in logger.filters
        )
    module = noise.module.replace("\\", "").rstrip(".") + ".x"  # a module the pattern matches
    with warnings.catch_warnings(record=True) as caught:
        warnings.warn_explicit(text, noise.category, "f.py", 1, module=module, registry={})
    return bool(caught)


def test_only_the_known_messages_are_dropped(restored_logging, monkeypatch):
    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        console.setup()
        for noise in KNOWN_NOISE:
            assert not _shown(noise, noise.message + " and the rest of it"), noise
            assert _shown(noise, "something new went wrong"), noise
        assert logging.getLogger("megatron").level == logging.WARNING


def test_verbose_drops_nothing(restored_logging, monkeypatch):
    monkeypatch.setenv(VERBOSE_ENV, "1")
    for name in {n.module for n in KNOWN_NOISE if n.category is None}:
        logging.getLogger(name).filters.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        console.setup()
        for noise in KNOWN_NOISE:
            assert _shown(noise, noise.message), noise
