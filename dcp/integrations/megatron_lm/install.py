"""Wire DCP into ``megatron.training.pretrain``: ``with install(args) as dcp_run: pretrain(...)``.

Inside the block:

- on a machine without a GPU, megatron's loop runs on CPU with gloo
  (``megatron_patches.megatron_training``);
- ``dcp_run.datasets_provider`` is a ``train_valid_test_datasets_provider`` whose "datasets"
  are DCP's batch iterators over the documents of ``--data-path``, divided by ``--split``
  (``--dataloader-type external``): whole global batches under ``--dcp``, this rank's packed
  micro-batches otherwise;
- ``dcp_run.forward_step`` is the ``forward_step_func`` for those packed micro-batches (runs
  without ``--dcp`` go through Megatron's own schedule with it);
- under ``--dcp``, ``megatron.training.training.get_forward_backward_func`` returns
  ``DCPForwardBackward``: Megatron's ``train_step`` then runs DCP's plan in place of its schedule
  and keeps everything else (optimizer step, grad clipping, LR schedule, logging, timers,
  checkpoints, W&B), and Megatron's ``evaluate`` runs each validation batch's plan forward only;
- with ``--dcp-metrics`` every ``train_step`` is timed and recorded;
- under ``--dcp`` rank 0 names, one line each, the Megatron settings DCP's plans replace
  (``overridden_flags``), and the last rank prints each step's plan at ``--log-interval``.

Everything is restored on exit. The model must use an attention that follows per-micro-step CP
groups: ``with_dcp_attention(layer_spec)``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from dcp.integrations.megatron_lm.args import check_args, overridden_flags, planning_config
from dcp.integrations.megatron_lm.data import (
    SPLIT_NAMES,
    DocumentBatches,
    document_dataset,
    split_documents,
)
from dcp.integrations.megatron_lm.recorder import LoopRecorder, microsteps_path
from dcp.integrations.megatron_lm.steps import (
    DCPForwardBackward,
    PackedMicroBatches,
    packed_forward_step,
)
from dcp.mesh import Mesh
from dcp.step.calibration import RECORDS_FILENAME
from megatron_patches.megatron_training import training_on_cpu

logger = logging.getLogger(__name__)


def with_dcp_attention(layer_spec):
    """``layer_spec`` (megatron's GPT layer ``ModuleSpec``, local or Transformer Engine) with its
    core attention replaced by one that follows DCP's per-micro-step CP groups and packed
    documents: DCP's torch attention for megatron's local ``DotProductAttention``, DCP's TE
    subclass for TE's. Any other core attention is refused."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from dcp.attention import DCPCoreAttention

    attn = layer_spec.submodules.self_attention
    core = attn.submodules.core_attention
    if core is DotProductAttention or core is DCPCoreAttention:
        replacement = DCPCoreAttention
    elif getattr(core, "__name__", "") == "TEDotProductAttention" or hasattr(
        core, "set_context_parallel_group"
    ):
        from megatron_patches.te_attention import te_core_attention

        replacement = te_core_attention()
    else:
        raise ValueError(
            f"DCP cannot run core attention {core!r}: use megatron's local or Transformer "
            "Engine GPT layer spec"
        )
    spec = dataclasses.replace(layer_spec, submodules=dataclasses.replace(layer_spec.submodules))
    spec.submodules.self_attention = dataclasses.replace(
        attn, submodules=dataclasses.replace(attn.submodules, core_attention=replacement)
    )
    return spec


def _model_spec(args: argparse.Namespace):
    """The cost model's view of Megatron's model arguments."""
    from dcp.costmodel.spec import ModelSpec

    return ModelSpec(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups
        if args.group_query_attention
        else args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size,
        vocab_size=args.padded_vocab_size,
        kv_channels=args.kv_channels,
        # Megatron's experts (every layer: check_args refuses --moe-layer-freq).
        num_experts=args.num_experts,
        moe_router_topk=args.moe_router_topk if args.num_experts else None,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size if args.num_experts else None,
        moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
    )


def megatron_mesh(args: argparse.Namespace) -> Mesh:
    """The run's mesh, from Megatron-LM's arguments: ``--tensor-model-parallel-size``,
    ``--pipeline-model-parallel-size``, the virtual stages megatron's validation derives
    (``virtual_pipeline_model_parallel_size``) and ``--expert-model-parallel-size`` over its
    ``world_size`` ranks. Megatron initialises its parallel state from the same arguments, in
    the rank order the mesh numbers, and builds chunk v of stage s as virtual stage v x PP + s,
    as the mesh does."""
    return Mesh(
        args.world_size,
        tensor_parallel_size=args.tensor_model_parallel_size,
        pipeline_parallel_size=args.pipeline_model_parallel_size,
        expert_parallel_size=args.expert_model_parallel_size,
        virtual_pipeline_parallel_size=getattr(args, "virtual_pipeline_model_parallel_size", None)
        or 1,
    )


class MegatronLMRun:
    """DCP's pieces for one Megatron-LM run (built by ``install``)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.recorder = LoopRecorder(
            args.dcp_metrics,
            planner=args.dcp_planner if args.dcp else "static",
            log_interval=args.log_interval,
        )
        self._dataset = None
        self._forward_backward: DCPForwardBackward | None = None

    @property
    def records_path(self) -> Path:
        """Where online calibration appends its micro-step records: beside ``--dcp-metrics``,
        named after it (``microsteps_path``), else ``microsteps.jsonl`` in ``--save``."""
        if self.args.dcp_metrics:
            return microsteps_path(self.args.dcp_metrics)
        return Path(self.args.save) / RECORDS_FILENAME

    @property
    def dataset(self):
        if self._dataset is None:
            self._dataset = document_dataset(self.args)
        return self._dataset

    def _batches(self, doc_ids, *, num_bins: int, skip: int) -> DocumentBatches:
        batches = DocumentBatches(
            self.dataset,
            num_bins=num_bins,
            bin_tokens=self.args.seq_length,
            seed=self.args.seed,
            doc_ids=doc_ids,
        )
        batches.skip(skip)
        return batches

    def datasets_provider(self, train_val_test_num_samples, vp_stage=None):
        """Megatron's ``train_valid_test_datasets_provider``: batch iterators over the
        training, validation and test documents of ``--split`` (validation and test only with
        ``--eval-iters``; test ``None`` when its share holds no document). Under virtual stages
        megatron asks once per model chunk (``vp_stage``): the static run's chunks each get
        their own iterators over the same batches, which only chunk 0's report to the
        recorder; ``--dcp`` plans whole batches from chunk 0's and the other chunks get none."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        args = self.args
        first_chunk = vp_stage in (None, 0)
        if args.dcp and not first_chunk:
            return None, None, None
        parts = split_documents(self.dataset, args)
        if dist.get_rank() == 0 and first_chunk:
            sizes = zip(SPLIT_NAMES, parts, strict=True)
            counts = ", ".join(f"{ids.size} {name}" for name, ids in sizes)
            print(f"DCP documents of --data-path by --split {args.split}: {counts}", flush=True)
        # Megatron restores args.iteration and consumed_valid_samples from --load before it
        # builds the data iterators; a validation batch is --eval-global-batch-size samples.
        train = self._batches(parts[0], num_bins=args.global_batch_size, skip=args.iteration)
        evaluated = [None, None]
        if args.eval_iters:
            eval_bins = args.eval_global_batch_size
            done = args.consumed_valid_samples // eval_bins
            evaluated = [
                self._batches(ids, num_bins=eval_bins, skip=skip) if ids.size else None
                for ids, skip in ((parts[1], done), (parts[2], 0))
            ]
        if args.dcp:
            return _Recording(train, self.recorder.on_batch), *evaluated

        def packed(batches, on_batch):
            return PackedMicroBatches(
                batches,
                dp_rank=ps.get_data_parallel_rank(),
                dp_size=ps.get_data_parallel_world_size(),
                on_batch=on_batch,
            )

        on_batch = self.recorder.on_batch if first_chunk else (lambda batch: None)
        return packed(train, on_batch), *(
            None if b is None else packed(b, lambda batch: None) for b in evaluated
        )

    datasets_provider.is_distributed = True  # every rank builds its own iterator

    def forward_step(self, data_iterator, model):
        """Megatron's ``forward_step_func`` for the packed micro-batches of a run without
        ``--dcp``."""
        return packed_forward_step(data_iterator, model)

    def get_forward_backward_func(self, *args, **kwargs) -> DCPForwardBackward:
        """Replaces megatron's ``get_forward_backward_func`` under ``--dcp``."""
        if self._forward_backward is None:
            self._forward_backward = self._build_forward_backward()
        return self._forward_backward

    def _build_forward_backward(self) -> DCPForwardBackward:
        from megatron.training import get_args

        from dcp.costmodel.spec import runtime_options
        from dcp.runtime.groups import start_groups
        from dcp.runtime.setup import check_expert_groups
        from dcp.step.batches import BatchPlanner
        from dcp.step.planned import PlannedSteps

        args = get_args()
        mesh = megatron_mesh(args)
        check_expert_groups(mesh)  # megatron made them; plans keep them whole
        planner = BatchPlanner(
            planning_config(args),
            mesh=mesh,
            max_seq_len=args.seq_length,
            runtime_options=runtime_options(
                dtype="bf16" if args.bf16 else "fp32",
                distributed_optimizer=args.use_distributed_optimizer,
                fp8=bool(args.fp8),
                tensor_parallel_size=mesh.tensor_parallel_size,
                tied_embeddings=not args.untie_embeddings_and_output_weights,
                pipeline_parallel_size=mesh.pipeline_parallel_size,
                expert_parallel_size=mesh.expert_parallel_size,
                virtual_pipeline_parallel_size=mesh.virtual_pipeline_parallel_size,
            ),
            model=_model_spec(args),
        )
        logger.info(
            "DCP plans every global batch with planner %s on spec %s (%d planner ranks)",
            args.dcp_planner,
            args.dcp_spec,
            planner.num_planner_ranks,
        )
        # A resumed run refits from the spec again; with fixed calibration nothing is written.
        online = args.dcp_calibration == "online"
        steps = PlannedSteps.start(planner, records_path=self.records_path if online else None)
        return DCPForwardBackward(
            steps,
            # Megatron has built the model by now; the groups' communicators are still made
            # before the first micro-step needs one (start_groups).
            registry=start_groups(mesh),
            dataset=self.dataset,
            observers=[self.recorder],
            first_step=args.iteration + 1,
        )


class _Recording:
    """Passes batches through, telling the recorder which batch the step trains on."""

    def __init__(self, batches: DocumentBatches, on_batch) -> None:
        self.batches = batches
        self.on_batch = on_batch

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self.batches)
        self.on_batch(batch)
        return batch


@contextlib.contextmanager
def install(args: argparse.Namespace) -> Iterator[MegatronLMRun]:
    """Check Megatron's ``args`` against what DCP supports, then patch Megatron's loop for DCP
    (module docstring) until the block exits."""
    from megatron.training import training

    check_args(args)
    if os.environ.get("RANK", "0") == "0":  # before torch.distributed is initialised
        for line in overridden_flags(args):
            print(f"DCP overrides {line}", flush=True)
    run = MegatronLMRun(args)
    saved = [
        (training, "train_step", training.train_step),
        (training, "get_forward_backward_func", training.get_forward_backward_func),
    ]
    training.train_step = run.recorder.wrap(training.train_step)
    if args.dcp:
        training.get_forward_backward_func = run.get_forward_backward_func
    try:
        with training_on_cpu():
            yield run
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
        run.recorder.close()
