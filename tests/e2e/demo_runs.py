"""The demo model on synthetic documents, as the cluster tests (test_slurm.py,
test_two_nodes.py) run it: 2 gloo ranks of pretrain/configs/tiny_cpu.yaml's model on documents
of up to 4K tokens, so the plans mix CP sizes and recompute levels; and the loss comparison
with a reference run."""

from __future__ import annotations

import sys
from pathlib import Path

from dcp.observability.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "pretrain" / "configs" / "tiny_cpu.yaml"
BIN = Path(sys.executable).parent  # torchrun of this environment
DEMO = [
    "data.source=synthetic",
    "data.indexed=null",
    "data.synthetic.num_docs=512",
    "optim.warmup_steps=2",
    "checkpoint.interval_steps=0",  # a checkpoint only where a stop signal asks for one
    "metrics.wandb_mode=disabled",
    "metrics.progress_bar=false",
    # Bit-exact comparisons between runs: online refits would make plans depend on timings.
    "planning.calibration=fixed",
    "compare_static.batches=0",  # the losses are the point here (test_pretrain.py measures)
]


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir)]


def assert_same_losses(run_dir: Path, reference: list[float]) -> None:
    """Loss of every step equal to the reference run's, to 1e-6 relative."""
    got = losses(run_dir)
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, len(reference) + 1))
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, reference, strict=True))
    assert worst <= 1e-6, (worst, got, reference)
