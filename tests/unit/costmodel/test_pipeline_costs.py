"""The cost model under pipeline parallelism: stage split, per-stage terms, link, checks."""

from __future__ import annotations

import copy

import pytest

from dcp.costmodel import CostModel, load_cost_model, load_preset
from dcp.costmodel.pipeline import (
    PipelineCosts,
    chunk_layer_counts,
    in_flight_micro_steps,
    planning_view,
    stage_layer_counts,
)
from dcp.mesh import Mesh
from dcp.plan import MicroStep, Recompute


def _spec(pp: int, *, gpus: int = 32, tp: int = 1, tied: bool = False) -> dict:
    spec = copy.deepcopy(load_preset("h200x32+llama3-8b"))
    spec["cluster"]["num_gpus"] = gpus
    spec["options"] = {
        **spec["options"],
        "pipeline_parallel_size": pp,
        "tensor_parallel_size": tp,
        "tied_embeddings": tied,
    }
    return spec


def test_stage_layer_counts():
    assert stage_layer_counts(80, 8) == (10,) * 8
    # Llama 3 405B: 126 layers over 16 stages, the first and last one layer short.
    assert stage_layer_counts(126, 16) == (7,) + (8,) * 14 + (7,)
    # One layer short of even: the last stage (it has the output layer) gives it up.
    assert stage_layer_counts(31, 4) == (8, 8, 8, 7)
    assert stage_layer_counts(5, 1) == (5,)
    with pytest.raises(ValueError, match="pipeline_parallel_size must be between 1 and"):
        stage_layer_counts(4, 8)


def test_planner_ranks_are_one_stage_of_the_mesh():
    cm = CostModel.from_spec(_spec(4, gpus=32, tp=2))
    assert (cm.num_ranks, cm.tensor_parallel_size, cm.pipeline_parallel_size) == (4, 2, 4)
    with pytest.raises(ValueError, match="options.pipeline_parallel_size=3 must divide"):
        CostModel.from_spec(_spec(3))
    with pytest.raises(ValueError, match="options.pipeline_parallel_size must be >= 1"):
        CostModel.from_spec(_spec(0))


def test_load_cost_model_checks_the_jobs_pipeline():
    spec = _spec(4)
    assert load_cost_model(spec, mesh=Mesh(32, pipeline_parallel_size=4)).num_ranks == 8
    # A job that does not name its PP size runs without pipelining.
    with pytest.raises(ValueError, match=r"pipeline parallelism 4 .* the run uses 1 pipeline"):
        load_cost_model(spec, mesh=Mesh(32))
    with pytest.raises(ValueError, match=r"describes 32 GPUs \(8 planner ranks x TP 1 x PP 4\)"):
        load_cost_model(spec, mesh=Mesh(16, pipeline_parallel_size=4))
    # Virtual stages: the spec's interleaving must be the run's, or the planner checks memory
    # and predicts times for another schedule.
    interleaved = {**spec, "options": {**spec["options"], "virtual_pipeline_parallel_size": 2}}
    vp2 = Mesh(32, pipeline_parallel_size=4, virtual_pipeline_parallel_size=2)
    assert PipelineCosts.of(load_cost_model(interleaved, mesh=vp2)).virtual_stages == 2
    with pytest.raises(ValueError, match=r"plans with 1 virtual stage\(s\) .* the run uses 2"):
        load_cost_model(spec, mesh=vp2)
    with pytest.raises(ValueError, match=r"plans with 2 virtual stage\(s\) .* the run uses 1"):
        load_cost_model(interleaved, mesh=Mesh(32, pipeline_parallel_size=4))


def test_stages_split_the_whole_models_terms():
    whole = CostModel.from_spec(_spec(4))
    costs = PipelineCosts.of(whole)
    c, stages = whole.coefficients, [s.coefficients for s in costs.stages]
    assert costs.layer_counts == (8, 8, 8, 8)
    for name in ("linear_s_per_token", "attention_s_per_token2", "cp_bytes_per_token"):
        assert sum(getattr(s, name) for s in stages) == pytest.approx(getattr(c, name))
    assert sum(s.tp_comm_s_per_token for s in stages) == pytest.approx(c.tp_comm_s_per_token)
    # The output layer and loss live on the last stage only.
    assert [s.logits_s_per_token > 0 for s in stages] == [False, False, False, True]
    assert [s.logits_bytes_per_token > 0 for s in stages] == [False, False, False, True]
    # Untied: the stages hold the whole model's parameters exactly once.
    assert sum(s.static_mem_bytes for s in stages) == pytest.approx(c.static_mem_bytes)
    assert stages[0].static_mem_bytes > stages[1].static_mem_bytes < stages[3].static_mem_bytes
    # Without recompute activations split by layers; full recompute keeps one layer's working
    # set on every stage.
    none, full = Recompute.NONE, Recompute.FULL
    act = c.activation_bytes_per_token
    assert stages[1].activation_bytes_per_token[none] == pytest.approx(act[none] / 4)
    one_layer = act[none] / 32
    assert stages[1].activation_bytes_per_token[full] == pytest.approx(
        act[full] / 4 + 0.75 * one_layer
    )


def test_a_tied_embedding_is_held_by_the_first_and_the_last_stage():
    untied = PipelineCosts.of(CostModel.from_spec(_spec(4, tied=False)))
    tied = PipelineCosts.of(CostModel.from_spec(_spec(4, tied=True)))
    first, last = tied.stages[0].static_mem_bytes, tied.stages[-1].static_mem_bytes
    assert first == pytest.approx(untied.stages[0].static_mem_bytes)
    assert last == pytest.approx(untied.stages[-1].static_mem_bytes)
    assert sum(s.static_mem_bytes for s in tied.stages) > tied.cost_model.static_mem_bytes


def test_stage_times_and_the_link():
    whole = load_cost_model("h200x256+llama3-70b-tp4pp8")
    costs = PipelineCosts.of(whole)
    step = MicroStep(ranks=(0,), seq_ids=(0,))
    times = costs.step_times(step, [8192])
    assert len(times) == 8
    forward, backward, comm = times[3]
    assert comm == 0.0 and backward == pytest.approx(2 * forward)
    assert times[-1][0] > times[3][0]  # the output layer
    # The stages' seconds add up to the whole model's, plus each further stage's overhead.
    fixed = whole.coefficients.step_overhead_s
    total = sum(f + b for f, b, _ in times)
    assert total == pytest.approx(whole.step_time_s([8192], 1, "none") + 7 * fixed, rel=1e-3)
    # Each GPU sends its sequence-parallel slice [tokens / TP, hidden] in bf16 over the NIC.
    assert costs.p2p_bytes_per_token == 8192 * 2 / 4
    assert costs.p2p_bytes_per_s == whole.coefficients.inter_node_bytes_per_s
    assert costs.p2p_time_s(1000) == pytest.approx(
        1000 * 4096 / costs.p2p_bytes_per_s + whole.options.link_latency_s
    )
    # Recompute runs in the backward pass.
    full = costs.step_times(MicroStep(ranks=(0,), seq_ids=(0,), recompute="full"), [8192])
    assert full[3][0] == pytest.approx(forward) and full[3][1] > backward


def test_recompute_layers_count_per_stage():
    costs = PipelineCosts.of(load_cost_model("h200x1024+llama3-405b"))
    assert costs.layer_counts[0] == 7 and costs.layer_counts[1] == 8
    partial = MicroStep(ranks=(0,), seq_ids=(0,), recompute="full", recompute_layers=8)
    every = MicroStep(ranks=(0,), seq_ids=(0,), recompute="full")
    # N = 8 covers a 7-layer stage whole and an 8-layer stage whole.
    assert costs.step_activation_bytes(partial, [65536]) == pytest.approx(
        costs.step_activation_bytes(every, [65536])
    )
    four = MicroStep(ranks=(0,), seq_ids=(0,), recompute="full", recompute_layers=4)
    acts4, acts_all = (costs.step_activation_bytes(s, [65536]) for s in (four, every))
    assert all(a > b for a, b in zip(acts4, acts_all, strict=True))


def test_the_planning_view_holds_a_stages_micro_steps_in_flight():
    whole = load_cost_model("h200x256+llama3-70b-tp4pp8")
    costs = PipelineCosts.of(whole)
    view, alone = costs.planning_model(), costs.planning_model(in_flight=False)
    assert view.pipeline_parallel_size == 1 and view.num_ranks == whole.num_ranks
    for level in ("none", "selective", "full"):
        expected = max(
            (8 - s) * stage.coefficients.activation_bytes_per_token[level]
            + stage.coefficients.logits_bytes_per_token
            for s, stage in enumerate(costs.stages)
        )
        assert view.mem_bytes_per_token(level) == pytest.approx(expected)
        assert alone.mem_bytes_per_token(level) < view.mem_bytes_per_token(level)
    assert view.static_mem_bytes == max(s.static_mem_bytes for s in costs.stages)
    # Time: every stage's at most.
    for stage in costs.stages:
        assert stage.step_time_s([30000], 2, "selective") <= view.step_time_s(
            [30000], 2, "selective"
        )
    assert planning_view(load_cost_model("h200x8+llama3-8b")).pipeline_parallel_size == 1


# -- interleaved virtual stages --------------------------------------------------------------


def _interleaved_order(p: int, v: int, m: int, rank: int) -> list[tuple[str, int, int]]:
    """Megatron's interleaved 1F1B order of one rank (microbatch group size P), written from
    its published algorithm as an oracle: (``F`` or ``B``, chunk on the rank, micro-batch).
    The k-th forward runs chunk (k mod PV) // P on micro-batch (k // PV)·P + k mod P, the
    backwards the chunks in reverse; 2(P - s - 1) + (V - 1)P warm-up forwards (P - s - 1
    without interleaving), then one forward and one backward in turn."""
    total = m * v

    def op(kind: str, k: int) -> tuple[str, int, int]:
        group, within = divmod(k, p * v)
        chunk = within // p
        return kind, chunk if kind == "F" else v - 1 - chunk, group * p + within % p

    warmup = min(2 * (p - rank - 1) + (v - 1) * p if v > 1 else p - rank - 1, total)
    ops = [op("F", k) for k in range(warmup)]
    for k in range(total - warmup):
        ops += [op("F", warmup + k), op("B", k)]
    return ops + [op("B", k) for k in range(total - warmup, total)]


def _run_schedule(p: int, v: int, m: int, *, forward: float, backward: float, transfer: float):
    """Makespan of every rank running its ``_interleaved_order`` as soon as the chunk before
    it (forward) or after it (backward) is done and its message ``transfer`` later has
    arrived (messages in flight occupy no rank), and each rank's peak chunk forwards in
    flight."""
    orders = [_interleaved_order(p, v, m, s) for s in range(p)]
    done: dict[tuple[str, int, int], float] = {}
    free, position, peak = [0.0] * p, [0] * p, [0] * p
    live = [0] * p
    while any(position[s] < len(orders[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            while position[s] < len(orders[s]):
                kind, local, mb = orders[s][position[s]]
                chunk = local * p + s
                if kind == "F":
                    dep, duration = ("F", chunk - 1, mb) if chunk > 0 else None, forward
                else:
                    last = chunk == p * v - 1
                    dep, duration = ("F", chunk, mb) if last else ("B", chunk + 1, mb), backward
                if dep is not None and dep not in done:
                    break
                ready = 0.0 if dep is None else done[dep] + (0.0 if dep[1] == chunk else transfer)
                free[s] = max(free[s], ready) + duration
                done[(kind, chunk, mb)] = free[s]
                live[s] += 1 if kind == "F" else -1
                peak[s] = max(peak[s], live[s])
                position[s] += 1
                progressed = True
        assert progressed, "the interleaved order deadlocked"
    return max(free), peak


def _costs(pp: int, vp: int) -> PipelineCosts:
    return PipelineCosts.of(CostModel.from_spec(_spec(pp, gpus=8 * pp)), virtual_stages=vp)


@pytest.mark.parametrize(
    ("p", "v", "m"), [(2, 1, 4), (4, 1, 8), (2, 2, 4), (4, 2, 4), (4, 2, 8), (4, 4, 8), (8, 4, 16)]
)
def test_the_interleaved_bubble_is_that_of_the_explicit_schedule(p, v, m):
    """Megatron's interleaved schedule with equal chunks (forward 1, backward 2 per chunk)
    takes exactly m·t·(1 + (P - 1)/(V·m)), t = 3V per micro-batch and rank; with transfers
    it lies between the formula with them overlapped and with them blocking."""
    costs = _costs(p, v)
    assert costs.bubble_fraction(m) == (p - 1) / (v * m)
    makespan, _ = _run_schedule(p, v, m, forward=1.0, backward=2.0, transfer=0.0)
    t = 3.0 * v
    assert makespan == pytest.approx(m * t * (1 + costs.bubble_fraction(m)))
    assert costs.schedule_time_s(t, m) == pytest.approx(makespan)
    with_transfers, _ = _run_schedule(p, v, m, forward=1.0, backward=2.0, transfer=0.1)
    overlapped = costs.schedule_time_s(t, m, transfer_s=0.1, overlap_p2p=True)
    blocking = costs.schedule_time_s(t, m, transfer_s=0.1)
    assert overlapped <= with_transfers + 1e-9 <= blocking + 1e-9
    assert blocking == pytest.approx(m * (t + 2 * v * 0.1) * (1 + costs.bubble_fraction(m)))


@pytest.mark.parametrize(("p", "v"), [(2, 1), (4, 1), (2, 2), (4, 2), (4, 5), (8, 3)])
def test_in_flight_micro_steps_are_the_interleaved_schedules(p, v):
    """Each rank's peak of chunk forwards in flight under the explicit schedule, in units of
    its V chunks: P - s without interleaving, rank 0 P + (P - 1)/V with it."""
    _, peak = _run_schedule(p, v, 4 * p, forward=1.0, backward=2.0, transfer=0.0)
    assert [in_flight_micro_steps(p, v, s) for s in range(p)] == [n / v for n in peak]
    assert in_flight_micro_steps(p, v, 0) == pytest.approx(p + (p - 1) / v if v > 1 else p)


def test_chunk_layer_counts():
    # Llama 3.1 405B at PP 8, VP 8: megatron's recipe counts the embedding and the loss as a
    # layer each, which leaves one layer on the first and last chunks.
    assert chunk_layer_counts(126, 8, 8) == (1,) + (2,) * 62 + (1,)
    assert chunk_layer_counts(80, 8, 5) == (2,) * 40
    assert chunk_layer_counts(32, 4) == stage_layer_counts(32, 4)
    with pytest.raises(ValueError, match=r"4 x 3 chunks exceeds the model's 8 layers"):
        chunk_layer_counts(8, 4, 3)
    with pytest.raises(ValueError, match="virtual_stages must be an integer >= 1"):
        chunk_layer_counts(8, 2, 0)


def test_a_ranks_chunks_do_its_stages_work():
    """Under V chunks per rank, rank s holds chunks s, s + P, ...: their layers, times and
    activations add up to the non-interleaved stage's (at CP 1, where the time is additive;
    activations at every recompute, a partial one at the same share of a chunk's and a stage's
    layers),
    the embedding sits in chunk 0 and the output layer in the last chunk, and each chunk
    pays a V-th of the fixed per-micro-step cost."""
    plain, interleaved = _costs(4, 1), _costs(4, 2)
    assert interleaved.virtual_stages == 2 and len(interleaved.chunks) == 8
    assert plain.chunks == plain.stages
    assert [c.num_layers for c in interleaved.chunks] == [4] * 8
    assert interleaved.layer_counts == plain.layer_counts == (8, 8, 8, 8)
    chunks = [c.coefficients for c in interleaved.chunks]
    assert [c.logits_s_per_token > 0 for c in chunks] == [False] * 7 + [True]
    assert chunks[0].static_mem_bytes > chunks[1].static_mem_bytes < chunks[7].static_mem_bytes
    whole = plain.cost_model.coefficients
    assert chunks[3].step_overhead_s == whole.step_overhead_s / 2
    step = MicroStep(ranks=(0,), seq_ids=(0, 1), recompute="selective")
    lengths = [8192, 3000]
    flat = [x for stage in plain.step_times(step, lengths) for x in stage]
    assert [x for stage in interleaved.step_times(step, lengths) for x in stage] == (
        pytest.approx(flat)
    )
    by_chunk = interleaved.chunk_step_times(step, lengths)
    assert interleaved.step_times(step, lengths)[1][1] == pytest.approx(
        by_chunk[1][1] + by_chunk[5][1]
    )
    # A micro-step's chunks on a rank hold what its stage holds without interleaving, at every
    # recompute: full recompute's one-layer working set is split over the V chunks, not
    # counted in each (else 47 chunks in flight on rank 0 at PP 8 x VP 5 count 47 of them,
    # where the planning view counts 9.4 micro-steps' worth, and plans it passes fail the check).
    # (N counts per chunk: 2 of a chunk's 4 layers are 4 of a stage's 8.)
    for level, chunk_n, stage_n in [("none", None, None), ("selective", None, None)] + [
        ("full", None, None),
        ("full", 2, 4),
    ]:
        by_chunks = MicroStep((0,), (0, 1), level, chunk_n)
        by_stage = MicroStep((0,), (0, 1), level, stage_n)
        assert interleaved.step_activation_bytes(by_chunks, lengths) == pytest.approx(
            plain.step_activation_bytes(by_stage, lengths)
        )
    assert interleaved.messages_per_micro_step == 2 * plain.messages_per_micro_step == 4


def test_the_planning_view_holds_the_interleaved_micro_steps_in_flight():
    """Rank s holds ``in_flight_micro_steps`` micro-steps' activations: rank 0 P + (P - 1)/V
    under interleaving, P without."""
    for v in (1, 2):
        costs = _costs(4, v)
        for level in ("none", "full"):
            expected = max(
                in_flight_micro_steps(4, v, s)
                * stage.coefficients.activation_bytes_per_token[level]
                + stage.coefficients.logits_bytes_per_token
                for s, stage in enumerate(costs.stages)
            )
            assert costs.planning_model().mem_bytes_per_token(level) == pytest.approx(expected)
    assert _costs(4, 2).planning_model().mem_bytes_per_token("none") > (
        _costs(4, 1).planning_model().mem_bytes_per_token("none")
    )


def test_the_planning_views_recompute_layers_count_per_chunk():
    """A micro-step's ``recompute_layers`` count per model chunk (megatron's block recompute
    per chunk): the view's layers are a chunk's, so N = a chunk's layers is a full recompute."""
    plain, interleaved = _costs(4, 1).planning_model(), _costs(4, 2).planning_model()
    assert (plain.num_layers, interleaved.num_layers) == (8, 4)
    full = interleaved.mem_bytes_per_token("full")
    assert interleaved.mem_bytes_per_token("full", 4) == pytest.approx(full)
    assert interleaved.mem_bytes_per_token("full", 2) > full
    assert plain.mem_bytes_per_token("full", 4) > plain.mem_bytes_per_token("full")
