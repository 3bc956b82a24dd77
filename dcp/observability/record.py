"""The per-step metrics record: what one training step did and how long it took.

``StepRecord`` is the schema of every line of ``runs/<name>/metrics.jsonl`` (and of the W&B
run): the trainer builds one per step, the metrics logger writes ``to_dict()``, the benchmark
reads the records back. Keys are the same for every planner, so runs overlay.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from dcp.observability.host import HostStats
from dcp.plan import Plan

if TYPE_CHECKING:
    pass


PLAN_NOTATION = (
    "plan lines: cp {CP size: sequences run at that size}, recompute = share of the batch's "
    "tokens in micro-steps that recompute activations, micro-steps [count per planner rank]"
)
"""What ``PlanStats.summary`` means, printed once before the first plan line of a run."""


@dataclass(frozen=True, kw_only=True)
class PlanStats:
    """What the plan of one step looked like (logged under ``plan/``)."""

    cp_hist: dict[str, int]
    """Sequences per CP degree (``"1"``, ``"2"``, ...)."""
    recompute_fraction: float
    """Share of the batch's tokens in micro-steps with any recompute."""
    micro_steps_per_rank: list[int]
    micro_steps_max: int
    micro_steps_min: int
    num_micro_steps: int
    predicted_imbalance: float
    """Max over ranks of predicted busy time / mean busy time (1.0 = perfectly balanced)."""

    @classmethod
    def of(
        cls, plan: Plan, lengths: list[int], *, num_ranks: int, predicted_imbalance: float
    ) -> PlanStats:
        """Stats of ``plan`` over ``num_ranks`` planner ranks (one per TP group)."""
        cp_hist = Counter()
        recompute_tokens = 0
        for step in plan.steps:
            for sid in step.seq_ids:
                cp_hist[step.cp_size] += 1
                if step.recompute != "none":
                    recompute_tokens += lengths[sid]
        per_rank = Counter(r for step in plan.steps for r in step.ranks)
        counts = [per_rank.get(r, 0) for r in range(num_ranks)]
        return cls(
            cp_hist={str(k): v for k, v in sorted(cp_hist.items())},
            recompute_fraction=recompute_tokens / max(1, sum(lengths)),
            micro_steps_per_rank=counts,
            micro_steps_max=max(counts),
            micro_steps_min=min(counts),
            num_micro_steps=len(plan.steps),
            predicted_imbalance=predicted_imbalance,
        )

    def summary(self) -> str:
        """One compact line, ``cp {1:7, 2:1} recompute 6% micro-steps [4,3]``
        (``PLAN_NOTATION`` says what it means)."""
        hist = ", ".join(f"{k}:{v}" for k, v in self.cp_hist.items())
        counts = ",".join(str(c) for c in self.micro_steps_per_rank)
        return f"cp {{{hist}}} recompute {self.recompute_fraction:.0%} micro-steps [{counts}]"


@dataclass(frozen=True, kw_only=True)
class StepRecord:
    """One line of ``metrics.jsonl``."""

    step: int
    loss: float
    """Mean loss over the batch's loss tokens (all ranks)."""
    tokens: int
    """Loss tokens of the global batch."""
    sequences: int
    """Sequences trained (dropped ones excluded)."""
    step_time_s: float
    tokens_per_s: float
    compute_time_s: float
    """Slowest rank's wall time for its micro-steps (what the planner predicts)."""
    predicted_step_time_s: float
    prediction_error: float
    """|predicted - measured| / measured step compute time (the planner's accuracy)."""
    calibration_version: int
    """Version of the cost model that planned this step (0: the spec as given; each accepted
    online refit adds one)."""
    plan_time_s: float
    lr: float
    grad_norm: float
    skipped: bool
    """A non-finite loss skipped the optimizer step."""
    dropped_sequences: int
    peak_mem_bytes: int
    """The step's peak memory, max over ranks (``dcp.observability.memory``): from the previous
    step's reduction to this one's, so the previous optimizer update counts."""
    planner: str
    plan: PlanStats
    tflops_per_gpu: float | None = None
    """Model TFLOP/s per GPU: the trained sequences' model FLOPs (``dcp.costmodel.flops``,
    Megatron's count) over the step time and every rank of the job."""
    mfu: float | None = None
    """``tflops_per_gpu`` over the spec's dense bf16 ``peak_tflops`` (absent when the spec has
    none). On CPU the presets' ``peak_tflops`` is a nominal figure, so the reports leave CPU
    runs' MFU out."""
    optimizer_state_bytes: list[int] | None = None
    """Optimizer state bytes held by each rank, by rank (``Runtime.optimizer_state_bytes``)."""
    exploration: str | None = None
    """The configuration online calibration tried on this step's longest sequence, if any."""
    mem_budget_bytes: float | None = None
    """The per-rank memory budget the plan was made against (the cost model's
    ``mem_budget_bytes``; emulated on the CPU presets)."""
    padding_tokens: int = 0
    """Padding tokens the step ran (zig-zag layout, TE and sequence-parallel alignment), masked
    out of the loss; each planner rank's counted once."""
    plan_wait_s: float = 0.0
    """Seconds the step waited for its plan: planning runs in the background while the previous
    step trains, and only a plan slower than that step (or planned again after a refit) delays
    this one."""
    host: HostStats | None = None
    """Rank 0's host at the end of the step: load average, CPUs, device (``host/...`` in the
    file; absent in files written before it existed)."""
    expert_load: float | None = None
    """Mixture-of-experts runs with the expert bias: the step's most loaded expert's tokens
    over the mean, worst layer (1: perfectly even; ``Runtime.train_step``)."""

    def to_dict(self) -> dict:
        out = asdict(self)
        for key in (
            "tflops_per_gpu",
            "mfu",
            "optimizer_state_bytes",
            "exploration",
            "mem_budget_bytes",
            "host",
            "expert_load",
        ):
            if out[key] is None:
                del out[key]
        return out
