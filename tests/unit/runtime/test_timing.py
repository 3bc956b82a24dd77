"""Micro-step times under pipelines: each rank's stage slots, reduced with MAX, sum per step."""

from __future__ import annotations

from dcp.runtime.timing import stage_slots, whole_model_times


def test_stage_slots_reduced_with_max_give_each_steps_stages_summed():
    # Plan steps 0-2 on 2 stages; two ranks per stage, each running some of the steps.
    ranks = {
        (0, "a"): [(0, 1.0), (2, 0.5)],
        (0, "b"): [(0, 1.5), (1, 0.25)],
        (1, "a"): [(0, 2.0), (2, 0.75)],
        (1, "b"): [(0, 1.0), (1, 0.5)],
    }
    slots = [stage_slots(times, 3, stage=stage, stages=2) for (stage, _), times in ranks.items()]
    reduced = [max(column) for column in zip(*slots, strict=True)]  # the step's MAX reduction
    # Step 0: slowest rank 1.5 on stage 0 plus 2.0 on stage 1; step 1: 0.25 + 0.5; step 2.
    assert whole_model_times(reduced, 3) == [3.5, 0.75, 1.25]
    # Without pipelining the slots are the times themselves.
    single = stage_slots([(1, 0.5), (0, 2.0)], 2, stage=0, stages=1)
    assert single == [2.0, 0.5] and whole_model_times(single, 2) == [2.0, 0.5]
