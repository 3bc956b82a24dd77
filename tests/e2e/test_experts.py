"""Experts in DCP's trainer end to end: ``make demo-moe``'s configuration (pretrain/configs/
tiny_cpu.yaml, 4 routed experts, top-2, ``parallel.expert_parallel_size=2`` on 4 gloo ranks) on
test_pretrain.py's smaller model and documents, run under ``tests.device_check``: the experts
train (megatron's token-dispatch all-to-alls run in every step on every rank, the loss falls,
the expert bias balances the load and every step logs it),
every step runs on whole EP groups, the end-of-run comparison with the best static configuration
runs and the run exits 0, and every collective DCP issues gets tensors on the run's device."""

from __future__ import annotations

import json

from tests.e2e.test_collective_devices import assert_every_collective_on_the_run_device, checked_run
from tests.e2e.test_pretrain import OVERRIDES, REPO

STEPS = 5
DEMO_MOE = [
    "model.num_experts=4",
    "model.moe_router_topk=2",
    "model.moe_router_score_function=sigmoid",
    "model.moe_router_expert_bias=true",
    "model.moe_router_bias_update_rate=0.02",
    "parallel.expert_parallel_size=2",
]


def test_the_demo_moe_configuration_trains_its_experts_at_ep2(tmp_path):
    reports = checked_run(
        tmp_path,
        4,
        "pretrain.pretrain_gpt",
        "--config",
        str(REPO / "pretrain/configs/tiny_cpu.yaml"),
        "name=moe",
        f"runs_dir={tmp_path}",
        *OVERRIDES,
        *DEMO_MOE,
        f"train.steps={STEPS}",
        "compare_static.batches=1",
        "metrics.wandb_mode=disabled",
    )
    assert_every_collective_on_the_run_device(reports)
    for rank, report in enumerate(reports):
        assert len(report["steps"]) == STEPS, rank
        for step in report["steps"]:
            # Each MoE layer dispatches and combines with all-to-alls, forward and backward.
            assert step["all_collectives"].get("all_to_all_single", 0) >= 4, (rank, step)
    rows = [json.loads(line) for line in (tmp_path / "moe/metrics.jsonl").read_text().split()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert rows[-1]["loss"] < rows[0]["loss"], [r["loss"] for r in rows]
    for row in rows:  # CP sizes of at least EP: every step on whole EP groups
        sizes = [int(k.rsplit("/", 1)[1]) for k in row if k.startswith("plan/cp_hist/")]
        assert sizes and min(sizes) >= 2, row
        assert row["expert_load"] >= 1.0, row  # the worst layer's busiest expert over the mean
    side = json.loads((tmp_path / "moe/side_by_side.json").read_text())
    assert side["static_config"][0] >= 2, side
    assert all(min(t) > 0 for t in side["measured_s"].values()), side
