"""DCP's Megatron-LM integration without processes: arguments, checks, global batches, spec."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import numpy as np
import pytest

from dcp.integrations import megatron_lm as dcp_mlm
from dcp.integrations.megatron_lm.args import overridden_flags, planning_config
from dcp.integrations.megatron_lm.data import (
    DocumentBatch,
    DocumentBatches,
    parse_split,
    split_documents,
)
from dcp.integrations.megatron_lm.recorder import LoopRecorder, microsteps_path
from dcp.observability.metrics import read_metrics
from dcp.observability.record import PLAN_NOTATION
from dcp.plan import PLANNERS


def megatron_args(*argv: str) -> argparse.Namespace:
    """Megatron's own parser with DCP's arguments (nothing validated or initialised)."""
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser = dcp_mlm.add_dcp_args(add_megatron_arguments(parser))
    return parser.parse_args(list(argv))


GOOD = (
    "--micro-batch-size",
    "1",
    "--dataloader-type",
    "external",
    "--calculate-per-token-loss",
    "--eval-iters",
    "0",
)


def test_dcp_arguments_parse_into_a_planning_config():
    args = megatron_args(*GOOD, "--dcp", "--dcp-planner", "megatron", "--dcp-spec", "cpu-tiny")
    assert args.dcp
    cfg = planning_config(args)
    assert (cfg.planner, cfg.spec, cfg.calibration) == ("megatron", "cpu-tiny", "fixed")
    dcp_mlm.check_args(args)  # nothing to refuse


def test_unsupported_megatron_settings_are_refused_with_the_flag():
    args = megatron_args(
        "--micro-batch-size",
        "2",
        "--dataloader-type",
        "single",
        "--dcp",
        "--dcp-calibration",
        "online",
        "--pipeline-model-parallel-size",
        "2",
        "--context-parallel-size",
        "2",
        "--eval-iters",
        "5",
        "--full-validation",
        "--valid-data-path",
        "data/other",
        "--split",
        "90,x",
    )
    with pytest.raises(ValueError) as err:
        dcp_mlm.check_args(args)
    message = str(err.value)
    for flag in (
        "give --dcp-metrics or --save",  # where online calibration keeps its records
        "--micro-batch-size 1",
        "--dataloader-type external",
        "--calculate-per-token-loss",
        "--context-parallel-size 1",
        "drop --full-validation and --skip-train",
        "give --data-path and --split instead of --train-data-path",
        "--split '90,x': give up to three comma-separated shares",
    ):
        assert flag in message, flag


EXPERTS = ("--num-experts", "4", "--moe-token-dispatcher-type", "alltoall")


@pytest.mark.parametrize("dcp", [False, True])
def test_experts_run_in_both_modes(dcp):
    mode = ["--dcp"] if dcp else []
    dcp_mlm.check_args(megatron_args(*GOOD, *EXPERTS, *mode))
    shared = ("--moe-shared-expert-intermediate-size", "64", "--moe-router-topk", "1")
    dcp_mlm.check_args(megatron_args(*GOOD, *EXPERTS, *shared, *mode))
    # Aux-loss-free balancing: its counts skip DCP's padding (the executor's padding mask).
    bias = ("--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias")
    dcp_mlm.check_args(megatron_args(*GOOD, *EXPERTS, *bias, *mode))


@pytest.mark.parametrize("dcp", [False, True])
@pytest.mark.parametrize(
    "flags, match",
    [
        (("--expert-model-parallel-size", "2"), "needs a mixture-of-experts model: --num-experts"),
        (("--num-experts", "4"), "--moe-token-dispatcher-type alltoall"),  # allgather: default
        ((*EXPERTS, "--moe-aux-loss-coeff", "0.01"), "--moe-aux-loss-coeff 0"),
        ((*EXPERTS, "--moe-z-loss-coeff", "0.001"), "drop --moe-z-loss-coeff"),
        ((*EXPERTS, "--moe-expert-capacity-factor", "1.0"), "drop --moe-expert-capacity-factor"),
        ((*EXPERTS, "--moe-layer-freq", "2"), "drop --moe-layer-freq"),
        ((*EXPERTS, "--moe-grouped-gemm"), "--transformer-impl transformer_engine"),
        ((*EXPERTS, "--moe-router-load-balancing-type", "sinkhorn"), "sinkhorn routing"),
    ],
)
def test_expert_settings_dcp_cannot_honour_are_refused(dcp, flags, match):
    # Never a dense model or a plan-dependent loss in place of what was asked for.
    args = megatron_args(*GOOD, "--transformer-impl", "local", *flags, *(["--dcp"] if dcp else []))
    with pytest.raises(ValueError, match=re.escape(match)):
        dcp_mlm.check_args(args)


def test_expert_parallelism_runs_with_every_planner_checkpoints_and_virtual_stages():
    """tests/e2e/test_megatron_lm.py runs EP 2 x PP 2 x VP 2 with a checkpoint, resumed in
    Megatron's schedule and at EP 4 under --dcp-planner megatron-dev."""
    ep2 = (*GOOD, *EXPERTS, "--expert-model-parallel-size", "2")
    vp2 = ("--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1")
    checkpoints = ("--save", "ckpt", "--load", "ckpt")
    for mode in ((), ("--dcp",)):
        dcp_mlm.check_args(megatron_args(*ep2, *mode, *checkpoints))
        dcp_mlm.check_args(megatron_args(*ep2, *mode, *vp2))
    for planner in PLANNERS:
        dcp_mlm.check_args(megatron_args(*ep2, "--dcp", "--dcp-planner", planner))
    with pytest.raises(ValueError, match="--dcp-static-cp-size 1 would split"):
        dcp_mlm.check_args(
            megatron_args(*ep2, "--dcp", "--dcp-planner", "static", "--dcp-static-cp-size", "1")
        )


@pytest.mark.parametrize("dcp", [False, True])
def test_evaluation_runs_in_both_modes_but_not_as_full_validation_or_alone(dcp):
    mode = ["--dcp"] if dcp else []
    for flags in (("--eval-iters", "2", "--eval-interval", "3"), ("--eval-iters", "100")):
        dcp_mlm.check_args(megatron_args(*GOOD, *flags, "--split", "90,8,2", *mode))
    for flags in (("--skip-train",), ("--full-validation",)):
        args = megatron_args(*GOOD, *flags, *mode)
        with pytest.raises(ValueError, match="drop --full-validation and --skip-train"):
            dcp_mlm.check_args(args)
    args = megatron_args(*GOOD, "--eval-iters", "2", "--eval-micro-batch-size", "2", *mode)
    with pytest.raises(ValueError, match="--eval-micro-batch-size 1"):
        dcp_mlm.check_args(args)


@pytest.mark.parametrize(
    ("text", "shares"),
    [("969, 30, 1", (969.0, 30.0, 1.0)), ("1", (1.0, 0.0, 0.0)), ("0.9,0.1", (0.9, 0.1, 0.0))],
)
def test_megatrons_split_is_read_as_three_shares(text, shares):
    assert parse_split(text) == shares


@pytest.mark.parametrize("text", ["", "90,5,5,0", "-1,2", "0,0,0", "nan,1", "90/10"])
def test_a_bad_split_is_refused_by_flag(text):
    with pytest.raises(ValueError, match="--split"):
        parse_split(text)


@pytest.mark.parametrize(
    "virtual",
    [
        (),
        ("--num-virtual-stages-per-pipeline-rank", "2"),
        ("--num-layers-per-virtual-pipeline-stage", "1"),
    ],
    ids=["no-virtual-stages", "virtual-stages", "layers-per-virtual-stage"],
)
def test_pipeline_parallelism_runs_with_either_calibration_and_virtual_stages(virtual):
    pp = ("--pipeline-model-parallel-size", "2", *virtual)
    dcp_mlm.check_args(megatron_args(*GOOD, *pp))  # static: Megatron's own (interleaved) 1F1B
    dcp_mlm.check_args(megatron_args(*GOOD, *pp, "--dcp", "--dcp-calibration", "fixed"))
    online = ("--dcp-calibration", "online", "--dcp-metrics", "m.jsonl")
    dcp_mlm.check_args(megatron_args(*GOOD, *pp, "--dcp", *online))


@pytest.mark.parametrize(
    ("batch", "group", "ok"),
    [("4", (), True), ("2", (), False), ("6", (), False), ("8", (), True)]
    + [("6", ("--microbatch-group-size-per-virtual-pipeline-stage", "3"), True)]
    + [("10", ("--microbatch-group-size-per-virtual-pipeline-stage", "3"), True)]
    + [("14", ("--microbatch-group-size-per-virtual-pipeline-stage", "3"), False)]
    + [("4", ("--microbatch-group-size-per-virtual-pipeline-stage", "1"), False)],
)
def test_the_static_interleaved_schedule_needs_whole_micro_batch_groups(batch, group, ok):
    """Megatron's interleaved schedule raises at its first step unless each data-parallel rank
    has at least one group of micro-batches and its last group is whole or holds >= PP; DCP
    says so before anything is built, naming --global-batch-size (2 data-parallel ranks)."""
    pp = ("--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2")
    args = megatron_args(*GOOD, *pp, *group, "--global-batch-size", batch)
    args.data_parallel_size = 2  # what megatron's validation derives from the launch
    if ok:
        dcp_mlm.check_args(args)
    else:
        fix = "at least --pipeline-model-parallel-size" if group[-1:] == ("1",) else "give a"
        with pytest.raises(ValueError, match=fix):
            dcp_mlm.check_args(args)
    if not group:
        args.dcp = True  # DCP's plans need no micro-batch groups
        dcp_mlm.check_args(args)


def test_dcp_refuses_another_interleaved_group_size_and_names_p2p_overlap():
    """DCP's interleaved order runs groups of PP micro-steps per chunk (megatron's default);
    megatron's p2p overlap, on by default under virtual stages, has no counterpart in it."""
    pp = ("--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2")
    group = ("--microbatch-group-size-per-virtual-pipeline-stage", "4")
    with pytest.raises(ValueError) as err:
        dcp_mlm.check_args(megatron_args(*GOOD, *pp, *group, "--dcp"))
    (line,) = [x for x in str(err.value).splitlines() if "group-size" in x]
    assert "drop --microbatch-group-size-per-virtual-pipeline-stage 4" in line, line
    dcp_mlm.check_args(megatron_args(*GOOD, *pp, *group))  # Megatron's own schedule runs it
    same = ("--microbatch-group-size-per-virtual-pipeline-stage", "2")
    dcp_mlm.check_args(megatron_args(*GOOD, *pp, *same, "--dcp"))  # megatron's default, given
    (line,) = [x for x in overridden_flags(megatron_args(*GOOD, *pp, "--dcp")) if "p2p" in x]
    assert line.startswith("--overlap-p2p-communication (megatron's default under virtual"), line
    assert "gives no overlap" in line
    flush = megatron_args(*GOOD, *pp, "--dcp", "--overlap-p2p-communication-warmup-flush")
    assert any("--overlap-p2p-communication-warmup-flush" in x for x in overridden_flags(flush))
    # Turned off, or without virtual stages (megatron then turns it off), nothing to name.
    off = megatron_args(*GOOD, *pp, "--dcp", "--no-overlap-p2p-communication")
    assert not any("p2p" in x for x in overridden_flags(off))
    plain = ("--pipeline-model-parallel-size", "2", "--dcp")
    assert not any("p2p" in x for x in overridden_flags(megatron_args(*GOOD, *plain)))


def test_a_batch_size_ramp_up_is_refused():
    args = megatron_args(*GOOD, "--rampup-batch-size", "1", "1", "100")
    with pytest.raises(ValueError, match="drop --rampup-batch-size"):
        dcp_mlm.check_args(args)


@pytest.mark.parametrize("dcp", [(), ("--dcp",)], ids=["static", "dcp"])
def test_megatrons_sft_dataset_is_refused_since_its_loss_mask_would_be_ignored(dcp):
    args = megatron_args(*GOOD, *dcp, "--sft")
    with pytest.raises(ValueError, match="drop --sft"):
        dcp_mlm.check_args(args)


def test_megatrons_hybrid_cp_is_refused_with_the_way_to_its_scheduler():
    args = megatron_args(*GOOD, "--hybrid-context-parallel")
    with pytest.raises(ValueError, match="--dcp --dcp-planner megatron"):
        dcp_mlm.check_args(args)


def test_a_bad_dcp_value_is_refused_by_name():
    args = megatron_args(*GOOD, "--dcp", "--dcp-refit-interval", "0")
    with pytest.raises(ValueError, match="refit_interval_steps"):
        dcp_mlm.check_args(args)


class _Docs:
    def __init__(self, lengths):
        self.doc_lengths = np.asarray(lengths, dtype=np.int64)


def test_global_batches_pack_every_document_once_within_the_micro_batches():
    rng = np.random.default_rng(0)
    lengths = rng.integers(2, 101, size=500)
    batches = DocumentBatches(_Docs(lengths), num_bins=4, bin_tokens=100, seed=3)
    seen = []
    for _ in range(20):
        batch = next(batches)
        assert len(batch.bins) == 4 and all(batch.bins)
        assert sorted(i for b in batch.bins for i in b) == list(range(len(batch.doc_ids)))
        for b in batch.bins:
            assert sum(batch.lengths[i] - 1 for i in b) <= 100
        assert batch.lengths == tuple(int(lengths[d]) for d in batch.doc_ids)
        seen += batch.doc_ids
    assert len(seen) == len(set(seen))  # less than one epoch: no document twice
    # Deterministic, and a resumed run skips to the same next batch.
    again = DocumentBatches(_Docs(lengths), num_bins=4, bin_tokens=100, seed=3)
    again.skip(20)
    assert next(again) == next(batches)


def test_batches_of_one_split_draw_only_its_documents():
    lengths = np.arange(2, 62)
    part = np.arange(10, 60, 3)
    batches = DocumentBatches(_Docs(lengths), num_bins=2, bin_tokens=100, seed=1, doc_ids=part)
    seen = [d for _ in range(12) for d in next(batches).doc_ids]
    assert set(seen) == set(part.tolist())  # more than an epoch: every one, nothing else
    batch = next(batches)
    assert batch.lengths == tuple(int(lengths[d]) for d in batch.doc_ids)
    with pytest.raises(ValueError, match="no documents"):
        DocumentBatches(_Docs(lengths), num_bins=2, bin_tokens=100, seed=1, doc_ids=[])


class _Splittable(_Docs):
    def __init__(self, parts):
        super().__init__([5] * sum(len(p) for p in parts))
        self.parts = [np.asarray(p, dtype=np.int64) for p in parts]

    def __len__(self):
        return self.doc_lengths.size

    def split(self, shares):
        assert len(shares) == 3
        return self.parts


def test_evaluation_needs_validation_documents_under_the_split():
    args = argparse.Namespace(split="99,1,0", eval_iters=2)
    parts = split_documents(_Splittable([[0, 1], [2], []]), args)
    assert [p.tolist() for p in parts] == [[0, 1], [2], []]  # no test documents: no test set
    with pytest.raises(ValueError, match="no validation documents of the 2 in --data-path"):
        split_documents(_Splittable([[0, 1], [], []]), args)
    args.eval_iters = 0
    split_documents(_Splittable([[0, 1], [], []]), args)  # no evaluation: none needed
    with pytest.raises(ValueError, match="no training documents"):
        split_documents(_Splittable([[], [0, 1], []]), args)


def test_a_document_longer_than_a_micro_batch_is_refused():
    with pytest.raises(ValueError, match="more than a micro-batch holds"):
        DocumentBatches(_Docs([50, 102]), num_bins=2, bin_tokens=100, seed=0)


def test_dcp_attention_replaces_megatrons_local_core_attention_only():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from dcp.attention import DCPCoreAttention

    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    replaced = dcp_mlm.with_dcp_attention(spec)
    assert replaced.submodules.self_attention.submodules.core_attention is DCPCoreAttention
    # The caller's spec is left as it was.
    assert spec.submodules.self_attention.submodules.core_attention is DotProductAttention
    other = dcp_mlm.with_dcp_attention(replaced)
    assert other.submodules.self_attention.submodules.core_attention is DCPCoreAttention
    attn = spec.submodules.self_attention
    bogus = type(spec)(
        module=spec.module,
        submodules=type(spec.submodules)(
            **{
                **vars(spec.submodules),
                "self_attention": type(attn)(
                    module=attn.module,
                    params=attn.params,
                    submodules=type(attn.submodules)(
                        **{**vars(attn.submodules), "core_attention": object}
                    ),
                ),
            }
        ),
    )
    with pytest.raises(ValueError, match="cannot run core attention"):
        dcp_mlm.with_dcp_attention(bogus)


def test_a_distributed_optimizer_resume_without_apex_or_te_is_refused(tmp_path):
    from megatron.core.optimizer import distrib_optimizer

    args = megatron_args(*GOOD, "--dcp", "--use-distributed-optimizer", "--load", str(tmp_path))
    dcp_mlm.check_args(args)  # no checkpoint there yet: a fresh start is fine
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("3")
    if distrib_optimizer.HAVE_APEX_OR_TE:
        dcp_mlm.check_args(args)
    else:
        with pytest.raises(ValueError, match="cannot resume its distributed optimizer"):
            dcp_mlm.check_args(args)


def test_megatron_flags_dcp_overrides_are_named_one_line_each():
    args = megatron_args(
        *GOOD,
        "--dcp",
        "--global-batch-size",
        "4",
        "--seq-length",
        "4096",
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "uniform",
        "--recompute-num-layers",
        "1",
    )
    cp, batch, recompute = overridden_flags(args)
    assert cp.startswith("--context-parallel-size 1: the model is built without context")
    assert batch.startswith("--global-batch-size 4: each step trains the documents of 4 packed")
    assert recompute.startswith(
        "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1: "
        "not applied; DCP sets the recompute level of every micro-step"
    )
    assert "--dcp-planner static --dcp-static-recompute" in recompute
    # Megatron's shorthand for selective recompute is named as given.
    shorthand = megatron_args(*GOOD, "--dcp", "--recompute-activations")
    assert overridden_flags(shorthand)[-1].startswith("--recompute-activations: not applied")
    # Without recompute flags only the two lines DCP always overrides; without --dcp, none.
    assert len(overridden_flags(megatron_args(*GOOD, "--dcp"))) == 2
    assert overridden_flags(megatron_args(*GOOD, "--recompute-granularity", "full")) == []


@pytest.mark.parametrize(
    "recipe", [(), ("--fp8-recipe", "delayed")], ids=["megatron-default", "delayed"]
)
def test_delayed_fp8_scaling_is_refused_under_dcp(recipe):
    """Delayed scaling all-reduces amax after every FP8 forward; DCP's ranks run different
    micro-step counts, so the reductions would pair up wrongly or hang. Megatron's default
    recipe is delayed, so ``--fp8-format`` alone asks for it."""
    args = megatron_args(*GOOD, "--dcp", "--fp8-format", "hybrid", *recipe)
    with pytest.raises(ValueError) as err:
        dcp_mlm.check_args(args)
    (line,) = [x for x in str(err.value).splitlines() if "--fp8-recipe" in x]
    assert "--fp8-recipe tensorwise" in line, line
    for ok in ("tensorwise", "blockwise"):
        dcp_mlm.check_args(
            megatron_args(*GOOD, "--dcp", "--fp8-format", "e4m3", "--fp8-recipe", ok)
        )
    # Megatron's own schedule (no --dcp) runs as many micro-batches on every rank.
    dcp_mlm.check_args(megatron_args(*GOOD, "--fp8-format", "hybrid", *recipe))
    dcp_mlm.check_args(megatron_args(*GOOD, "--dcp"))  # no FP8: the default recipe is unused


@pytest.mark.parametrize("dcp", [False, True])
def test_tensor_parallel_comm_overlap_is_refused(dcp):
    """TE's overlap buffers are sized once to --seq-length tokens; packed micro-batches vary."""
    args = megatron_args(*GOOD, "--tp-comm-overlap", *(["--dcp"] if dcp else []))
    with pytest.raises(ValueError) as err:
        dcp_mlm.check_args(args)
    (line,) = [x for x in str(err.value).splitlines() if "--tp-comm-overlap" in x]
    assert "--seq-length" in line and "drop --tp-comm-overlap" in line, line


def test_overlap_grad_reduce_is_named_as_giving_no_overlap_under_dcp():
    args = megatron_args(*GOOD, "--dcp", "--overlap-grad-reduce")
    dcp_mlm.check_args(args)  # accepted: it runs, without overlap
    (line,) = [x for x in overridden_flags(args) if x.startswith("--overlap-grad-reduce")]
    assert "no overlap" in line and "once after the last micro-step" in line, line
    assert overridden_flags(megatron_args(*GOOD, "--overlap-grad-reduce")) == []


def test_overlap_param_gather_is_refused_under_dcp():
    """Megatron gathers parameters over the whole data-parallel group inside each rank's first
    forward; DCP ranks start a step in different CP groups."""
    flags = ("--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather")
    with pytest.raises(ValueError) as err:
        dcp_mlm.check_args(megatron_args(*GOOD, "--dcp", *flags))
    (line,) = [x for x in str(err.value).splitlines() if "--overlap-param-gather" in x]
    assert "drop --overlap-param-gather" in line, line
    dcp_mlm.check_args(megatron_args(*GOOD, *flags))  # Megatron's own schedule runs it


def test_microstep_records_are_named_after_the_metrics_file():
    """Two runs writing step records into one directory keep their micro-step records apart."""
    assert microsteps_path("runs/m/dcp.jsonl") == Path("runs/m/dcp.microsteps.jsonl")
    assert microsteps_path("runs/m/static.jsonl") == Path("runs/m/static.microsteps.jsonl")
    assert microsteps_path("runs/m/metrics.jsonl") == Path("runs/m/microsteps.jsonl")
    run = dcp_mlm.MegatronLMRun(megatron_args(*GOOD, "--dcp", "--dcp-metrics", "r/a.jsonl"))
    assert run.records_path == Path("r/a.microsteps.jsonl")
    run = dcp_mlm.MegatronLMRun(megatron_args(*GOOD, "--dcp", "--save", "ckpt"))
    assert run.records_path == Path("ckpt/microsteps.jsonl")


def _train_step(loss):
    """What megatron's train_step returns: (loss_reduced, skipped, ..., grad_norm, ...)."""
    return lambda *args, **kwargs: ({"lm loss": loss}, False, False, False, 0, 1.0, None, None)


def test_the_plan_is_printed_at_megatrons_log_interval(tmp_path, capsys):
    recorder = LoopRecorder(str(tmp_path / "dcp.jsonl"), planner="dcp", log_interval=2)
    step = recorder.wrap(_train_step(2.0))
    batch = DocumentBatch(doc_ids=(0, 1), lengths=(9, 5), bins=((0,), (1,)), step=0)
    stats = {
        "cp_hist": {"1": 1, "2": 1},
        "recompute_fraction": 0.5,
        "micro_steps_per_rank": [2, 1],
        "micro_steps_max": 2,
        "micro_steps_min": 1,
        "num_micro_steps": 2,
        "predicted_imbalance": 1.1,
    }
    for iteration in range(4):
        recorder.on_batch(batch)
        recorder.on_plan({"predicted_step_time_s": 1.5, "compute_time_s": 1.25, "plan": stats})
        step(iteration=iteration)
    recorder.close()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"DCP {PLAN_NOTATION}"
    plan = "cp {1:1, 2:1} recompute 50% micro-steps [2,1]; micro-steps predicted 1.50 s"
    assert [line.split(":")[0] for line in lines[1:]] == ["DCP step 1", "DCP step 2", "DCP step 4"]
    assert all(line.split(": ", 1)[1].startswith(plan) for line in lines[1:])
    records = read_metrics(tmp_path / "dcp.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[0]["host/device"] == "cpu" and records[0]["host/cpus"] >= 1
