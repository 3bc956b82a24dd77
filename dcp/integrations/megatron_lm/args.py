"""DCP's command-line arguments for a Megatron-LM script, and the checks on Megatron's own.

``parse_args`` is megatron's ``parse_and_validate_args`` with ``add_dcp_args`` added to the
parser (an ``extra_args_provider``, usable on its own). ``check_args`` refuses, before anything
is built, the Megatron settings DCP cannot honour, each with the flag to change;
``overridden_flags`` names those it accepts but replaces with its plans.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dcp.console import setup as setup_console
from dcp.integrations.megatron_lm.data import parse_split
from dcp.plan import ON_OVERSIZE, PLANNERS
from dcp.planning.static import STATIC_RECOMPUTE
from dcp.step.config import CALIBRATION_MODES, PlanningConfig
from megatron_patches.argument_dump import argument_dump_if
from megatron_patches.megatron_training import arguments_on_cpu


def parse_args(extra_args_provider=None, **kwargs) -> argparse.Namespace:
    """megatron's ``parse_and_validate_args`` (``kwargs`` passed on) with DCP's arguments and
    ``extra_args_provider``'s, runnable on a machine without a GPU; sets megatron's global
    args as megatron's own call does. Sets up the console first (``dcp.console.setup``: rank-
    aware logging, the known third-party notices filtered) and lists megatron's arguments only
    under ``--dcp-print-args``."""
    from megatron.training.arguments import parse_and_validate_args

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        parser = add_dcp_args(parser)
        return extra_args_provider(parser) if extra_args_provider else parser

    setup_console()  # the known third-party notices, filtered once (a no-op when done)
    with arguments_on_cpu(), argument_dump_if("dcp_print_args"):
        args = parse_and_validate_args(extra_args_provider=provider, **kwargs)
    if not args.dcp_print_args and args.rank == 0:
        print("megatron's argument list not printed (--dcp-print-args prints it)", flush=True)
    if args.pipeline_model_parallel_size > 1:
        # Megatron's validation sets it False ("set it if the dataloader supports generation of
        # variable sequence lengths"): DCP's packed micro-batches and plans vary in length, so
        # Megatron's pipeline schedule (static mode) exchanges each message's shape first
        # (p2p_communication: ``_communicate_shapes`` under ``config.variable_seq_lengths``).
        args.variable_seq_lengths = True
        if not getattr(args, "num_experts", None):
            # TransformerConfig.__post_init__ refuses variable lengths with the default
            # "allgather" MoE token dispatcher even for a dense model, which has no dispatcher.
            args.moe_token_dispatcher_type = "alltoall"
    return args


def add_dcp_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DCP's arguments (``--dcp`` and ``--dcp-*``, Megatron's naming) to ``parser``."""
    defaults = PlanningConfig()
    group = parser.add_argument_group(title="DCP (data-centric parallelism)")
    group.add_argument(
        "--dcp",
        action="store_true",
        help="Run each global batch as a DCP plan: per-micro-step CP groups, micro-step counts "
        "and recompute levels chosen from the batch's document lengths. Needs "
        "--calculate-per-token-loss and --dataloader-type external.",
    )
    group.add_argument(
        "--dcp-spec",
        default=defaults.spec,
        help="Cost-model spec: presets of dcp/costmodel/profiles, spec JSON paths and key=value "
        "overrides joined by + (cpu-tiny, h200x8+llama3-8b, h200x8+llama3-8b+my.json). Its "
        "model is replaced by this run's.",
    )
    group.add_argument(
        "--dcp-planner",
        choices=PLANNERS,
        default=defaults.planner,
        help="dcp: DCP's planner; static: one CP size and recompute level for every batch; "
        "megatron: megatron-core's Hybrid-CP scheduler (BalancedCPScheduler) run by DCP's "
        "executor.",
    )
    group.add_argument(
        "--dcp-calibration",
        choices=CALIBRATION_MODES,
        default="fixed",
        help="fixed: plan with the spec as it is; online: refit its compute terms on this run's "
        "measured micro-steps every --dcp-refit-interval steps (records beside --dcp-metrics, "
        "else in --save; a --load restarts the refits from the spec, so plans after a resume "
        "may differ).",
    )
    group.add_argument(
        "--dcp-refit-interval",
        type=int,
        default=defaults.refit_interval_steps,
        help="Steps between online refits (--dcp-calibration online).",
    )
    group.add_argument(
        "--dcp-static-cp-size",
        type=int,
        default=None,
        help="--dcp-planner static: the run's CP size (default: the fastest feasible one).",
    )
    group.add_argument(
        "--dcp-static-recompute",
        choices=STATIC_RECOMPUTE,
        default=None,
        help="--dcp-planner static: the run's recompute setting (default: the fastest).",
    )
    group.add_argument(
        "--dcp-on-oversize",
        choices=ON_OVERSIZE,
        default=defaults.on_oversize,
        help="A document no plan can fit: error, or drop it (counted in the step records).",
    )
    group.add_argument(
        "--dcp-metrics",
        default=None,
        help="Write one JSON line per training step here (loss, tokens, step time, plan).",
    )
    group.add_argument(
        "--dcp-print-args",
        action="store_true",
        help="List every Megatron argument at start, as Megatron does by default (some 830 "
        "lines on rank 0); without it one line says how to see them.",
    )
    return parser


def planning_config(args: argparse.Namespace) -> PlanningConfig:
    """The ``PlanningConfig`` the ``--dcp-*`` arguments describe (validated)."""
    return PlanningConfig(
        planner=args.dcp_planner,
        spec=args.dcp_spec,
        prefetch_plans=False,
        on_oversize=args.dcp_on_oversize,
        static_cp_size=args.dcp_static_cp_size,
        static_recompute=args.dcp_static_recompute,
        calibration=args.dcp_calibration,
        refit_interval_steps=args.dcp_refit_interval,
        explore=False,
    )


def _resumes(args: argparse.Namespace) -> bool:
    """Whether ``--load`` names a directory holding a Megatron checkpoint."""
    return bool(args.load) and (Path(args.load) / "latest_checkpointed_iteration.txt").exists()


def _apex_or_te() -> bool:
    from megatron.core.optimizer import distrib_optimizer

    return bool(distrib_optimizer.HAVE_APEX_OR_TE)


_RECOMPUTE_FLAGS = (
    ("recompute_granularity", "--recompute-granularity"),
    ("recompute_method", "--recompute-method"),
    ("recompute_num_layers", "--recompute-num-layers"),
    ("recompute_modules", "--recompute-modules"),
)


def _virtual_stages(args: argparse.Namespace) -> bool:
    """Whether ``args`` ask for interleaved virtual pipeline stages: either flag, or the size
    megatron's validation derives from them (``None`` when 1)."""
    flags = ("num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank")
    return (getattr(args, "virtual_pipeline_model_parallel_size", None) or 1) > 1 or any(
        getattr(args, name, None) is not None for name in flags
    )


def _interleaved_batch_problems(args: argparse.Namespace) -> list[str]:
    """Megatron's interleaved schedule (the static run under virtual stages) takes each
    data-parallel rank's micro-batches in groups of G (``--microbatch-group-size-per-virtual-
    pipeline-stage``, default PP): it raises at the first step unless G >= PP, there are at
    least G and the last group is whole or holds at least PP (``schedules.py``,
    ``forward_backward_pipelining_with_interleaving``). Checked once validation has derived the
    data-parallel size."""
    num_ranks = getattr(args, "data_parallel_size", None)
    if not num_ranks:
        return []
    stages = args.pipeline_model_parallel_size
    group = getattr(args, "microbatch_group_size_per_vp_stage", None) or stages
    if group < stages:
        return [
            f"--microbatch-group-size-per-virtual-pipeline-stage {group}: Megatron's "
            f"interleaved schedule needs at least --pipeline-model-parallel-size ({stages})"
        ]
    per_rank = args.global_batch_size // (args.micro_batch_size * num_ranks)
    if per_rank >= group and per_rank % group in (0, *range(stages, group)):
        return []
    return [
        f"Megatron's interleaved schedule runs each data-parallel rank's micro-batches in groups "
        f"of {group} (--microbatch-group-size-per-virtual-pipeline-stage, default "
        f"--pipeline-model-parallel-size), and --global-batch-size {args.global_batch_size} "
        f"gives each of the {num_ranks} data-parallel ranks {per_rank}: give a multiple of "
        f"{group * num_ranks}"
    ]


def overridden_flags(args: argparse.Namespace) -> list[str]:
    """Under ``--dcp``, one line for each Megatron setting DCP's plans replace (printed at the
    start of the run, so no flag is silently ignored); empty without ``--dcp``."""
    if not args.dcp:
        return []
    lines = [
        f"--context-parallel-size {args.context_parallel_size}: the model is built without "
        "context parallelism; DCP groups ranks into a CP group of its own size for every "
        "micro-step (the plan lines' cp {size: sequences})",
        f"--global-batch-size {args.global_batch_size}: each step trains the documents of "
        f"{args.global_batch_size} packed micro-batches of up to --seq-length "
        f"{args.seq_length} tokens; how many micro-steps each rank runs is the plan's, not "
        "global batch / (micro-batch size x data-parallel size)",
    ]
    given = [
        f"{flag} {' '.join(map(str, value)) if isinstance(value, list) else value}"
        for name, flag in _RECOMPUTE_FLAGS
        if (value := getattr(args, name, None)) is not None
    ]
    if getattr(args, "recompute_activations", False):  # before validation turns it into
        given.insert(0, "--recompute-activations")  # --recompute-granularity selective
    if given:
        lines.append(
            f"{' '.join(given)}: not applied; DCP sets the recompute level of every micro-step "
            "(the plan lines' recompute share); for one level for the whole run use "
            f"--dcp-planner static --dcp-static-recompute {{{','.join(STATIC_RECOMPUTE)}}}"
        )
    if args.overlap_grad_reduce:
        # Under no_sync megatron's bucket groups never see a gradient marked ready, so they
        # stay in their first-batch mode and finish_grad_sync starts each reduction itself
        # (param_and_grad_buffer.py: reset, finish_grad_sync).
        lines.append(
            "--overlap-grad-reduce: gives no overlap; DCP runs its micro-steps under DDP's "
            "no_sync and reduces the gradients once after the last micro-step"
        )
    if _virtual_stages(args) and args.overlap_p2p_comm:
        # On by default under virtual stages (megatron's validation demands it at PP = 2).
        flush = getattr(args, "overlap_p2p_comm_warmup_flush", False)
        lines.append(
            "--overlap-p2p-communication"
            + (" --overlap-p2p-communication-warmup-flush" if flush else "")
            + " (megatron's default under virtual stages): gives no overlap; DCP's pipeline "
            "executor posts each batch of its messages and waits for them before the next "
            "forward or backward"
        )
    return lines


def _nonzero(coeff) -> bool:
    """Whether megatron's ``--moe-aux-loss-coeff`` (a number, or one per loss type) is set."""
    return any(c != 0 for c in (coeff if isinstance(coeff, list) else [coeff]))


def expert_problems(args: argparse.Namespace) -> list[str]:
    """The mixture-of-experts settings DCP cannot honour, one line each with the flag to change
    (docs/design.md, 'Experts'); both modes, since both run the packed documents of DCP's data
    and ``pretrain_gpt_megatron``'s ``model_provider``."""
    if not getattr(args, "num_experts", None):
        if args.expert_model_parallel_size != 1:
            return ["--expert-model-parallel-size needs a mixture-of-experts model: --num-experts"]
        return []
    problems = []
    ep = args.expert_model_parallel_size
    # Megatron's own schedule runs the same micro-batches on every rank of an EP group, and
    # every planner's plans run each step on whole EP groups (plan_batch): lockstep either way,
    # unless the user pins a CP size below the EP size.
    if ep > 1 and args.dcp and (args.dcp_static_cp_size or ep) < ep:
        problems.append(
            f"--dcp-static-cp-size {args.dcp_static_cp_size} would split expert-parallel "
            f"groups: at least {ep}"
        )
    if args.expert_tensor_parallel_size not in (None, args.tensor_model_parallel_size):
        problems.append(
            "experts split over the tensor-parallel group only: drop --expert-tensor-parallel-size"
        )
    if args.moe_token_dispatcher_type != "alltoall":
        # TransformerConfig refuses variable lengths with allgather; flex needs DeepEP/HybridEP.
        problems.append(
            "DCP's packed micro-batches vary in length, which megatron routes with its alltoall "
            "dispatcher only: --moe-token-dispatcher-type alltoall"
        )
    if args.moe_layer_freq != 1:
        problems.append(
            "every layer of DCP's Megatron-LM script is a mixture-of-experts layer: drop "
            "--moe-layer-freq"
        )
    if args.moe_grouped_gemm and args.transformer_impl != "transformer_engine":
        problems.append(
            "grouped GEMM for the experts is Transformer Engine's: --transformer-impl "
            "transformer_engine, or drop --moe-grouped-gemm"
        )
    # Each of these depends on which tokens share a micro-batch, which DCP's plans choose.
    if _nonzero(args.moe_aux_loss_coeff):
        problems.append(
            "megatron's load-balancing losses average over a micro-batch (aux_loss), its rows "
            "(seq_aux_loss) or the micro-batches so far (global_aux_loss), all of which DCP's "
            "plans change: --moe-aux-loss-coeff 0"
        )
    routing = args.moe_router_load_balancing_type
    if "sinkhorn" in (routing if isinstance(routing, list) else [routing]):
        problems.append(
            "sinkhorn routing normalises over a micro-batch's tokens, which DCP's plans choose: "
            "--moe-router-load-balancing-type none"
        )
    if args.moe_z_loss_coeff:
        problems.append("the router z-loss is a mean over a micro-batch: drop --moe-z-loss-coeff")
    if args.moe_expert_capacity_factor is not None or args.moe_pad_expert_input_to_capacity:
        problems.append(
            "expert capacity is counted over each rank's tokens of a micro-step, so which tokens "
            "are dropped would depend on the plan: drop --moe-expert-capacity-factor and "
            "--moe-pad-expert-input-to-capacity (dropless)"
        )
    if args.moe_input_jitter_eps is not None:
        problems.append("router input jitter is not supported: drop --moe-input-jitter-eps")
    return problems


def check_args(args: argparse.Namespace) -> None:
    """Raise ``ValueError`` naming the flag for every Megatron setting DCP cannot run with."""
    problems = []
    problems.extend(expert_problems(args))
    if args.micro_batch_size != 1:
        problems.append(
            "documents are packed into one sequence per micro-batch: --micro-batch-size 1"
        )
    if args.dataloader_type != "external":
        problems.append("DCP feeds Megatron its own batch iterator: --dataloader-type external")
    if args.use_distributed_optimizer and _resumes(args) and not _apex_or_te():
        problems.append(
            "megatron-core 0.19.2 cannot resume its distributed optimizer without apex or "
            "Transformer Engine (distrib_optimizer.py: state_dict() asserts one Adam step count "
            "on the fresh optimizer it loads into, and the parameter state load runs without "
            "no_grad); resume without --use-distributed-optimizer, or where apex or TE is "
            "installed"
        )
    if getattr(args, "full_validation", False) or args.skip_train:
        # Full validation asks the validation iterator for its length (training.py:
        # build_train_valid_test_data_iterators); DCP's batch iterators are endless.
        problems.append(
            "DCP evaluates --eval-iters batches of its validation documents at every "
            "--eval-interval and after training: drop --full-validation and --skip-train"
        )
    # None until megatron's validation sets it to --micro-batch-size.
    if args.eval_iters and getattr(args, "eval_micro_batch_size", None) not in (None, 1):
        problems.append(
            "validation documents are packed into one sequence per micro-batch: "
            "--eval-micro-batch-size 1"
        )
    per_split = ("train_data_path", "valid_data_path", "test_data_path", "per_split_data_args_path")
    if any(getattr(args, name, None) for name in per_split):
        problems.append(
            "DCP reads one corpus and divides its documents by --split: give --data-path "
            "and --split instead of --train-data-path / --valid-data-path / --test-data-path"
        )
    if args.split is not None:
        try:
            parse_split(args.split)
        except ValueError as exc:
            problems.append(str(exc))
    if getattr(args, "rampup_batch_size", None):
        problems.append(
            "global batches are packed at --global-batch-size from the first step: drop "
            "--rampup-batch-size"
        )
    if getattr(args, "sft", False):
        # DocumentBatches reads --data-path itself; megatron's SFTDataset and its loss mask on
        # the assistant's tokens never run, in either mode.
        problems.append(
            "DCP feeds Megatron whole documents of --data-path with every label in the loss; "
            "megatron's --sft dataset and its assistant-token loss mask are not read: drop "
            "--sft (loss masks through DCP: DCPEngine.train_step(loss_masks=...), "
            "docs/recipes.md)"
        )
    if args.tp_comm_overlap:
        # megatron's initialize._initialize_tp_communicators: TE's userbuffers hold
        # seq_length * micro_batch_size / context_parallel_size tokens, fixed at start-up.
        problems.append(
            "TE's tensor-parallel overlap buffers are sized once to --seq-length tokens and "
            "DCP's packed micro-batches vary in length: drop --tp-comm-overlap"
        )
    if args.hybrid_context_parallel:
        problems.append(
            "megatron's --hybrid-context-parallel does not run end to end in megatron-core "
            "0.19.2 (training.py replaces the RerunDataIterator that train_step requires; "
            "docs/megatron_lm.md): drop it, or run its scheduler with --dcp --dcp-planner megatron"
        )
    if not args.dcp and _virtual_stages(args):
        problems.extend(_interleaved_batch_problems(args))
    if args.dcp:
        if not args.calculate_per_token_loss:
            problems.append(
                "DCP divides the loss by the global batch's token count, so gradients must be "
                "summed, not averaged, over ranks: --calculate-per-token-loss"
            )
        if args.fp8 and args.fp8_recipe == "delayed":
            # Megatron's default recipe: TE reduces amax over the DP x CP x TP group after every
            # FP8 forward, and DCP's ranks run different numbers of micro-steps.
            problems.append(
                "FP8 delayed scaling (Megatron's default recipe) all-reduces amax after every "
                "FP8 forward and DCP's ranks run different numbers of micro-steps, which would "
                "hang: --fp8-recipe tensorwise (or blockwise: Hopper, CUDA >= 12.9)"
            )
        if args.context_parallel_size != 1:
            problems.append(
                "DCP chooses the CP size of every micro-step itself: --context-parallel-size 1"
            )
        if args.overlap_param_gather:
            # distributed_data_parallel.py's forward pre-hook: each bucket's all-gather over the
            # whole data-parallel group is dispatched and waited for inside a rank's first
            # forward of the step; a rank whose first micro-step waits on a CP peer still in
            # another micro-step would wait on that peer, and the peer on its all-gather.
            problems.append(
                "--overlap-param-gather all-gathers the parameters over every data-parallel "
                "rank inside each rank's first forward of a step, and DCP's ranks start their "
                "steps in different CP groups, which can hang: drop --overlap-param-gather (the "
                "distributed optimizer then gathers them after its step)"
            )
        group_size = getattr(args, "microbatch_group_size_per_vp_stage", None)
        stages = args.pipeline_model_parallel_size
        if _virtual_stages(args) and group_size not in (None, stages):
            # dcp.planning.pipeline.slot_order: groups of P slots per chunk, megatron's default.
            problems.append(
                "DCP's interleaved order runs each model chunk over groups of "
                "--pipeline-model-parallel-size micro-steps (megatron's default): drop "
                f"--microbatch-group-size-per-virtual-pipeline-stage {group_size}"
            )
        if args.dcp_calibration == "online" and not (args.dcp_metrics or args.save):
            problems.append(
                "online calibration keeps its micro-step records beside the step records or "
                "the checkpoints: give --dcp-metrics or --save"
            )
        planning_config(args)  # the --dcp-* values themselves
    if problems:
        raise ValueError(
            "DCP cannot run with these Megatron arguments:\n  - " + "\n  - ".join(problems)
        )
