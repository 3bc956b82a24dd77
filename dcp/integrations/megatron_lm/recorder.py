"""One JSON line per training step of a Megatron-loop run (``--dcp-metrics``).

Lines are encoded as ``runs/<name>/metrics.jsonl``'s (``dcp.observability.metrics.encode_record``:
flat ``plan/...`` keys, non-finite values marked; ``read_metrics`` reads them), with the keys of
``dcp.observability.record.StepRecord`` where the quantity exists in Megatron's loop: ``step``,
``loss``, ``tokens``, ``sequences``, ``step_time_s`` (Megatron's whole ``train_step``: forward,
backward and optimizer), ``tokens_per_s``, ``lr``, ``grad_norm``, ``skipped``, ``planner`` and,
for ``--dcp`` runs, ``compute_time_s``, ``predicted_step_time_s``, ``prediction_error``,
``plan_time_s``, ``mem_budget_bytes``, ``local_padding_tokens`` (the writing rank's) and the
plan (``PlanStats`` under ``plan/``), and ``host/`` (``HostStats``: load average, CPUs, device),
so ``tools.compare_runs`` reads these files too. Under ``--dcp`` the last rank prints each
step's plan at Megatron's ``--log-interval``, before Megatron's own line for the step. With
Megatron's ``--wandb-project`` the same record goes into Megatron's own W&B run (on the rank that
holds it), flattened as DCP's trainer logs it (``plan/cp_hist/2``, ...), so
``tools.wandb_dashboard``'s panels work on Megatron-loop runs.

Online calibration's micro-step records go beside the step records, named after them
(``microsteps_path``), so two runs writing into one directory keep theirs apart.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import asdict, is_dataclass
from pathlib import Path

import torch.distributed as dist

from dcp.integrations.megatron_lm.data import DocumentBatch
from dcp.observability.host import HostStats
from dcp.observability.metrics import METRICS_FILENAME, encode_record, flatten
from dcp.observability.record import PLAN_NOTATION, PlanStats
from dcp.runtime.dispatch import compute_device
from dcp.step.calibration import RECORDS_FILENAME


def microsteps_path(metrics_path: str | Path) -> Path:
    """Where a ``--dcp-metrics`` run's micro-step records go: beside its step records, named
    after them (``runs/x/dcp.jsonl`` -> ``runs/x/dcp.microsteps.jsonl``); a file named as a run
    directory's (``metrics.jsonl``) gets the run directory's ``microsteps.jsonl``."""
    path = Path(metrics_path)
    if path.name == METRICS_FILENAME:
        return path.with_name(RECORDS_FILENAME)
    return path.with_name(f"{path.stem}.{RECORDS_FILENAME}")


def _writing_rank() -> int:
    """The first global rank of the last pipeline stage (megatron's rank order: the stage is
    the outermost coordinate), 0 without pipelining."""
    from megatron.core import parallel_state as ps

    world, stages = dist.get_world_size(), ps.get_pipeline_model_parallel_world_size()
    return world - world // stages


class LoopRecorder:
    """Times Megatron's ``train_step`` and writes one record per step (the first rank of the
    last pipeline stage writes: global rank 0 without pipelining; Megatron reports the loss on
    the last stage only); the last rank prints the plan of every ``log_interval``-th step."""

    def __init__(self, path: str | None, *, planner: str, log_interval: int = 1) -> None:
        self.path = Path(path) if path else None
        self.planner = planner
        self.log_interval = max(1, log_interval)
        self._batch: DocumentBatch | None = None
        self._plan: dict = {}
        self._file = None
        self._explained = False

    def on_batch(self, batch: DocumentBatch) -> None:
        self._batch = batch

    def on_plan(self, fields: dict) -> None:
        """A ``--dcp`` step's own fields (``PlannedSteps.record_fields`` and this rank's
        padding), kept for the step's record."""
        if is_dataclass(fields.get("plan")):
            fields = {**fields, "plan": asdict(fields["plan"])}
        if fields.get("exploration") is None:
            fields.pop("exploration", None)
        self._plan = fields

    # -- a step observer (dcp.step.observers), attached under --dcp ----------------------------
    def contribute(self, step: int, scalars) -> None:
        """Nothing: Megatron reduces the loss itself."""

    def after_step(self, outcome) -> None:
        """Keep the ``--dcp`` step's fields for the line ``train_step``'s wrapper writes."""
        self.on_plan(outcome.record)

    def wrap(self, train_step):
        """``train_step`` that also records its step (same arguments, same results)."""

        @functools.wraps(train_step)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = train_step(*args, **kwargs)
            optimizer = args[3] if len(args) > 3 else kwargs.get("optimizer")
            lr = optimizer.param_groups[0]["lr"] if optimizer is not None else math.nan
            self._write(kwargs.get("iteration"), out, time.perf_counter() - start, lr)
            return out

        return timed

    def _write(self, iteration: int | None, out, step_time_s: float, lr: float) -> None:
        from megatron.training.global_vars import get_wandb_writer

        loss_reduced, skipped, grad_norm = out[0], out[1], out[5]
        wandb = get_wandb_writer()
        rank0 = not dist.is_initialized() or dist.get_rank() == _writing_rank()
        if self._batch is None or not loss_reduced:
            return
        step = (iteration or 0) + 1
        if self._plan:
            self._print_plan(step, self._plan, step_time_s)
        if not ((self.path and rank0) or wandb):
            self._plan = {}
            return
        batch = self._batch
        tokens = batch.num_loss_tokens
        record = {
            "step": step,
            "loss": float(loss_reduced["lm loss"]),
            "tokens": tokens,
            "sequences": len(batch.doc_ids),
            "step_time_s": step_time_s,
            "tokens_per_s": tokens / step_time_s if step_time_s > 0 else 0.0,
            "lr": float(lr),
            "grad_norm": float(grad_norm) if grad_norm is not None else math.nan,
            "skipped": bool(skipped),
            "planner": self.planner,
            **self._plan,
            "host": asdict(HostStats.now(device=compute_device().type)),
        }
        self._plan = {}
        if wandb is not None:
            # The step Megatron's own training_log uses for this iteration.
            payload = flatten(record, expand_lists=True)
            wandb.log({k: v for k, v in payload.items() if k != "step"}, step=record["step"])
        if not (self.path and rank0):
            return
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")
        line, _ = encode_record(record["step"], record)
        self._file.write(line + "\n")
        self._file.flush()

    def _print_plan(self, step: int, fields: dict, step_time_s: float) -> None:
        """The plan line of ``step`` on the last rank (where Megatron prints its own log line),
        at Megatron's ``--log-interval`` and for the first step of the run."""
        last = not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1
        if not last or (self._explained and step % self.log_interval):
            return
        if not self._explained:
            print(f"DCP {PLAN_NOTATION}", flush=True)
            self._explained = True
        stats = PlanStats(**fields["plan"])
        print(
            f"DCP step {step}: {stats.summary()}; micro-steps predicted "
            f"{fields['predicted_step_time_s']:.2f} s, measured {fields['compute_time_s']:.2f} s "
            f"(rank {dist.get_rank() if dist.is_initialized() else 0}); "
            f"train_step {step_time_s:.2f} s",
            flush=True,
        )

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
