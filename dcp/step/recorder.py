"""The metrics record of each training step (``runs/<name>/metrics.jsonl`` lines)."""

from __future__ import annotations

import torch.distributed as dist

from dcp.collectives import all_gather_ints
from dcp.costmodel.flops import batch_flops, throughput
from dcp.model import ModelConfig
from dcp.observability.host import HostStats
from dcp.observability.record import PlanStats, StepRecord
from dcp.runtime.dispatch import compute_device
from dcp.runtime.runtime import Runtime, StepStats
from dcp.step.batches import BatchPlanner, PlannedBatch


def plan_fields(
    planned: PlannedBatch, *, compute_time_s: float, num_ranks: int, mem_budget_bytes: float
) -> dict:
    """The fields of a step record that come from its plan and the measured time of its
    micro-steps (``compute_time_s``: the slowest rank's, what the planner predicts): one
    definition for every loop's record (``StepRecord``; Megatron-LM's ``--dcp-metrics``)."""
    predicted = planned.predicted_step_time_s
    return {
        "planner": planned.plan.planner,
        "compute_time_s": compute_time_s,
        "predicted_step_time_s": predicted,
        "prediction_error": (
            abs(predicted - compute_time_s) / compute_time_s if compute_time_s > 0 else 0.0
        ),
        "calibration_version": planned.calibration_version,
        "plan_time_s": planned.plan_time_s,
        "dropped_sequences": len(planned.dropped),
        "mem_budget_bytes": float(mem_budget_bytes),
        "exploration": planned.exploration,
        "plan": PlanStats.of(
            planned.plan,
            planned.lengths,
            num_ranks=num_ranks,
            predicted_imbalance=planned.predicted_imbalance,
        ),
    }


class StepRecorder:
    """Builds each step's ``StepRecord`` from the runtime's results and the plan."""

    def __init__(self, model: ModelConfig, planner: BatchPlanner, runtime: Runtime) -> None:
        self.model = model
        self.planner = planner
        self.runtime = runtime
        self.world_size = dist.get_world_size()
        self._opt_state_bytes: list[int] | None = None

    def record(
        self, step: int, stats: StepStats, planned: PlannedBatch, *, plan_wait_s: float = 0.0
    ) -> StepRecord:
        """The record of ``step`` (``stats`` carries the values already reduced over ranks; a
        collective only once, for the optimizer state bytes after the first optimizer step)."""
        tokens = stats.loss_tokens
        dropped = set(planned.dropped)
        trained = [n for i, n in enumerate(planned.lengths) if i not in dropped]
        speed = throughput(
            batch_flops(trained, self.model.shape),
            stats.step_time_s,
            num_gpus=self.world_size,
            peak_tflops=self.planner.peak_tflops_per_gpu,
        )
        return StepRecord(
            step=step,
            loss=stats.loss,
            tokens=tokens,
            sequences=len(planned.lengths) - len(planned.dropped),
            step_time_s=stats.step_time_s,
            tokens_per_s=tokens / stats.step_time_s if stats.step_time_s > 0 else 0.0,
            lr=stats.lr,
            grad_norm=stats.grad_norm,
            skipped=stats.skipped,
            peak_mem_bytes=stats.peak_mem_bytes,
            optimizer_state_bytes=self._optimizer_state_bytes(),
            padding_tokens=stats.padding_tokens,
            expert_load=stats.expert_load,
            plan_wait_s=plan_wait_s,
            tflops_per_gpu=speed["tflops_per_gpu"] if stats.step_time_s > 0 else None,
            mfu=speed["mfu"] if stats.step_time_s > 0 else None,
            host=HostStats.now(device=compute_device().type),
            **plan_fields(
                planned,
                compute_time_s=stats.compute_time_s,
                num_ranks=self.planner.num_planner_ranks,
                mem_budget_bytes=self.planner.cost_model.mem_budget_bytes,
            ),
        )

    def _optimizer_state_bytes(self) -> list[int] | None:
        """Each rank's optimizer state bytes (collective; gathered once, after the first
        optimizer step created the state; ``None`` before)."""
        if self._opt_state_bytes is None and self.runtime.step > 0:
            every = all_gather_ints([self.runtime.optimizer_state_bytes()])
            self._opt_state_bytes = [values[0] for values in every]
        return self._opt_state_bytes
