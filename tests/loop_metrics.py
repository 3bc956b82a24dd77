"""A ``--dcp-metrics`` file as Megatron's loop writes it, for the readers' tests."""

from __future__ import annotations

from pathlib import Path

from dcp.observability.metrics import encode_record


def write_loop_metrics(
    path: Path, *, planner: str, plan: bool, steps: int = 6, step_time_s: float = 1.0, load=2.0
) -> Path:
    """``path`` written as ``dcp.integrations.megatron_lm.recorder.LoopRecorder`` writes it:
    ``steps`` records, the static run's without plan keys, a ``--dcp`` run's (``plan``) with
    them (CP 1 and 2, half the micro-steps recomputed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for step in range(1, steps + 1):
            record = {
                "step": step,
                "loss": 6.0 - 0.1 * step,
                "tokens": 1000,
                "sequences": 2,
                "step_time_s": step_time_s,
                "tokens_per_s": 1000 / step_time_s,
                "lr": 1e-3,
                "grad_norm": 1.0,
                "skipped": False,
                "planner": planner,
                "host": {"load_1m": load, "cpus": 2, "device": "cpu"},
            }
            if plan:
                record.update(
                    compute_time_s=0.9 * step_time_s,
                    predicted_step_time_s=0.8 * step_time_s,
                    plan={
                        "cp_hist": {"1": 2, "2": 1},
                        "recompute_fraction": 0.5,
                        "micro_steps_per_rank": [2, 1],
                        "predicted_imbalance": 1.1,
                    },
                )
            f.write(encode_record(step, record)[0] + "\n")
    return path
