"""Activation offloading as a per-micro-step option: simulated only, GPU-only, never executed.

megatron-core 0.19's fine-grained activation offloading (``TransformerConfig.
fine_grained_activation_offloading`` with ``offload_modules``) copies module inputs to pinned
host memory during the forward pass and back before their backward. Its manager
(``megatron/core/pipeline_parallel/fine_grained_activation_offload.py``,
``PipelineOffloadManager.__init__``) creates ``torch.cuda.Stream()`` objects for the two copy
directions and ``torch.cuda.Event``s for their ordering, so it cannot run on the CPU machines
DCP's tests run on; DCP's runtime does not use it and no plan asks for it. This module answers
on the cost model what it would add: ``offload_what_if`` re-times a DCP plan with every
recomputing micro-step replaced by offloading where that is predicted faster (same placement,
same memory). ``tools.simulate`` reports it beside its table, labelled as a GPU-only what-if.

The model (assumptions, not measurements; nothing has calibrated it):

- **memory**: offloading every activation of a layer but its input keeps on the device what a
  full recompute keeps, so a step may offload where full recompute fits;
- **traffic**: the rest, (bytes/token without recompute − with full recompute) × the rank's
  tokens, goes to the host during the forward pass and back during the backward pass, over a
  host link of ``host_bytes_per_s`` per direction;
- **time**: the step without recompute plus the copy time no compute hides. The forward pass
  is taken as a third of the step and the backward as two thirds; copies overlap compute
  completely up to that (megatron overlaps them on side streams), which is optimistic.
"""

from __future__ import annotations

from collections.abc import Sequence

from dcp.costmodel import CostModel
from dcp.plan import Plan, Recompute
from dcp.planning.simulator import simulate

H200_HOST_BYTES_PER_S = 50e9
"""Host link bandwidth per direction assumed for an H200 SXM (PCIe Gen5 x16: 64 GB/s nominal,
about 50 GB/s achievable)."""


def offload_step_time_s(
    cost_model: CostModel,
    lengths: Sequence[int],
    cp_size: int,
    ranks: tuple[int, ...] | None = None,
    *,
    host_bytes_per_s: float = H200_HOST_BYTES_PER_S,
) -> float | None:
    """Predicted seconds of a micro-step that offloads instead of recomputing (module
    docstring), or ``None`` where it does not fit memory (where full recompute does not)."""
    if host_bytes_per_s <= 0:
        raise ValueError(f"host_bytes_per_s must be > 0, got {host_bytes_per_s}")
    if not cost_model.fits(lengths, cp_size, Recompute.FULL):
        return None
    compute_s = cost_model.step_time_s(lengths, cp_size, Recompute.NONE, ranks)
    per_token = cost_model.mem_bytes_per_token(Recompute.NONE) - cost_model.mem_bytes_per_token(
        Recompute.FULL
    )
    copy_s = per_token * sum(lengths) / cp_size / host_bytes_per_s
    return compute_s + max(0.0, copy_s - compute_s / 3) + max(0.0, copy_s - 2 * compute_s / 3)


def offload_what_if(
    plan: Plan,
    lengths: Sequence[int],
    cost_model: CostModel,
    *,
    host_bytes_per_s: float = H200_HOST_BYTES_PER_S,
) -> tuple[float, int]:
    """(simulated makespan, steps switched) of ``plan`` with each recomputing micro-step
    offloading instead where ``offload_step_time_s`` is faster; placement and order unchanged."""
    times, switched = [], 0
    for step in plan.steps:
        seq = [lengths[s] for s in step.seq_ids]
        time_s = cost_model.step_time_s(
            seq, step.cp_size, step.recompute, step.ranks, recompute_layers=step.recompute_layers
        )
        if step.recompute != Recompute.NONE:
            offload_s = offload_step_time_s(
                cost_model, seq, step.cp_size, step.ranks, host_bytes_per_s=host_bytes_per_s
            )
            if offload_s is not None and offload_s < time_s:
                time_s, switched = offload_s, switched + 1
        times.append(time_s)
    return simulate(plan, lengths, cost_model, times_s=times).makespan_s, switched
