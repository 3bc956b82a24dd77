"""The bare check's entry-point launches judge the losses their runs wrote: a non-finite loss,
which ``metrics.jsonl`` stores as ``null`` plus a marker, is a failed check, not a crash.

The launches are replaced by fakes that write the metrics files a real run would write."""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import pytest

from dcp.bench.bare_check import entry
from dcp.observability.metrics import encode_record

NAN = float("nan")


def _write_metrics(path: Path, losses: list[float]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [encode_record(step, {"loss": loss})[0] for step, loss in enumerate(losses, 1)]
    path.write_text("".join(line + "\n" for line in lines))


def _value(args: list[str], key: str) -> str:
    return next(a.split("=", 1)[1] for a in args if a.startswith(f"{key}="))


def _fake_pretrain(losses: dict[str, list[float]]):
    """``_torchrun`` for ``pretrain.pretrain_gpt``: each launch writes its run's losses (as many
    as its ``train.steps``) and checkpoints, and the resumed one says it resumed."""

    def run(args: list[str], *, timeout_s: float) -> subprocess.CompletedProcess:
        run_dir = Path(_value(args, "runs_dir"), _value(args, "name"))
        steps = int(_value(args, "train.steps"))
        _write_metrics(run_dir / "metrics.jsonl", losses[run_dir.name][:steps])
        (run_dir / "checkpoints" / f"step_{steps:06d}").mkdir(parents=True, exist_ok=True)
        resumed = steps == len(losses[run_dir.name]) and run_dir.name == "resumed"
        return subprocess.CompletedProcess(args, 0, "resumed from step 2" if resumed else "", "")

    return run


@pytest.mark.parametrize(
    "losses",
    [
        {"full": [4.0, 3.0, NAN, 2.0], "resumed": [4.0, 3.0, NAN, 2.0]},
        {"full": [4.0, 3.0, 2.5, 2.0], "resumed": [4.0, 3.0, 2.5, NAN]},
    ],
    ids=["both-runs", "resumed-run"],
)
def test_a_nan_loss_fails_the_entry_point_check(monkeypatch, losses):
    monkeypatch.setattr(entry, "_torchrun", _fake_pretrain(losses))
    result = entry.entry_point(device="cpu", steps=4, tiny=True, timeout_s=1.0)
    assert result["ok"] is False
    assert any(math.isnan(x) for x in result["losses"] + result["resumed_losses"])


def test_finite_losses_pass_the_entry_point_check(monkeypatch):
    losses = {"full": [4.0, 3.0, 2.5, 2.0], "resumed": [4.0, 3.0, 2.5, 2.0]}
    monkeypatch.setattr(entry, "_torchrun", _fake_pretrain(losses))
    result = entry.entry_point(device="cpu", steps=4, tiny=True, timeout_s=1.0)
    assert result["ok"] is True and result["resume_max_rel_diff"] == 0.0
    assert result["checkpoints"] == ["step_000002", "step_000004"]


@pytest.mark.parametrize("losses", [[3.0, NAN], [3.0, 2.5]], ids=["nan", "finite"])
def test_megatron_loop_fails_on_a_nan_loss(monkeypatch, losses):
    def prepare_data(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 0, "", "")

    def megatron(args: list[str], *, timeout_s: float) -> subprocess.CompletedProcess:
        _write_metrics(Path(args[args.index("--dcp-metrics") + 1]), losses)
        return subprocess.CompletedProcess(args, 0, "", "")

    monkeypatch.setattr(entry.subprocess, "run", prepare_data)
    monkeypatch.setattr(entry, "_torchrun", megatron)
    result = entry.megatron_loop(device="cpu", iterations=2, timeout_s=1.0)
    assert result["ok"] is all(math.isfinite(x) for x in losses)
    assert len(result["losses"]) == 2
