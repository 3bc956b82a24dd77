"""Global batches as the trainer sees them: the dataset they come from, the plan each gets, and
the ``SequenceSource`` the runtime reads this rank's shards through.

A dataset document of n tokens (EOD included) is a training sequence of length n - 1 (inputs
tokens[0:n-1], labels tokens[1:n]); see ``dcp.runtime.dispatch.train_len``.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from dcp.costmodel import (
    load_cost_model,
    load_spec,
    with_launch,
    with_model,
    with_runtime_options,
)
from dcp.costmodel.spec import ModelSpec
from dcp.data import build_document_dataset
from dcp.data.base import MaskedDocumentDataset
from dcp.data.sampler import GlobalBatch
from dcp.mesh import Mesh
from dcp.plan import MEGATRON_DEV, STATIC_PER_BATCH, Plan
from dcp.planning import (
    DCPOptions,
    MegatronDevOptions,
    MegatronOptions,
    PlannerOptions,
    StaticOptions,
    fixed_static_config,
    plan_batch,
    simulate,
)
from dcp.planning.dcp_planner import pin_label
from dcp.planning.experts import check_expert_lockstep, min_cp_size
from dcp.runtime.dispatch import train_len

logger = logging.getLogger(__name__)

STATIC_CHOICE_BATCHES = 16
"""How many of the run's first global batches ``planner=static`` chooses its one configuration
over (``with_fixed_static_config``)."""


def build_dataset(data_cfg, *, vocab_size: int, max_seq_len: int | None = None):
    """The document dataset a ``DataConfig`` names, checked against the model: its vocabulary
    and, with ``max_seq_len``, the longest training sequence the model was built for (a chat
    conversation longer is refused naming its line)."""
    dataset = build_document_dataset(
        data_cfg.dataset_config,
        vocab_size=vocab_size,
        max_tokens=None if max_seq_len is None else max_seq_len + 1,
    )
    longest = longest_seq_len(dataset)
    if max_seq_len is not None and longest > max_seq_len:
        where = (
            "data.indexed.max_doc_len" if data_cfg.source == "indexed" else "data.synthetic.max_len"
        )
        raise ValueError(
            f"the dataset's longest document trains a {longest}-token sequence but "
            f"model.max_seq_len={max_seq_len}; raise model.max_seq_len or cap documents with "
            f"{where} (<= {max_seq_len + 1} tokens)"
        )
    return dataset


class DatasetSource:
    """``LabelledSource`` over the documents of one ``GlobalBatch`` (seq id = index in batch):
    the loss masks are the dataset's where its documents carry them
    (``dcp.data.base.MaskedDocumentDataset``: SFT's chat conversations), else every label
    counts; no per-label values."""

    def __init__(self, dataset, batch: GlobalBatch) -> None:
        self._dataset = dataset
        self._batch = batch
        self._masked = isinstance(dataset, MaskedDocumentDataset)

    def seq_len(self, seq_id: int) -> int:
        return train_len(self._batch.lengths[seq_id])

    def read(self, seq_id: int, start: int, stop: int) -> np.ndarray:
        doc = self._batch.doc_ids[seq_id]
        return np.asarray(self._dataset.get_tokens(doc, start, stop - start), dtype=np.int64)

    def label_mask(self, seq_id: int, start: int, stop: int) -> np.ndarray:
        if not self._masked:
            return np.ones(stop - start, dtype=np.float32)
        doc = self._batch.doc_ids[seq_id]
        return np.asarray(self._dataset.label_mask(doc, start, stop - start), dtype=np.float32)

    def label_values(self, seq_id: int, start: int, stop: int) -> dict[str, np.ndarray]:
        return {}

    def num_counted(self, seq_id: int) -> int:
        if not self._masked:
            return self.seq_len(seq_id)
        return self._dataset.num_counted(self._batch.doc_ids[seq_id])


def launch_ranks_per_node() -> int | None:
    """The launcher's ranks per node (torchrun's ``LOCAL_WORLD_SIZE``), if it says."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def seq_lengths(batch: GlobalBatch) -> list[int]:
    """The planner's input: training length of each sequence of the batch."""
    return [train_len(n) for n in batch.lengths]


def longest_seq_len(dataset) -> int:
    """The run's longest training sequence (what a static configuration must be sized for)."""
    return train_len(dataset.doc_lengths.max())


@dataclass(frozen=True)
class PlannedBatch:
    plan: Plan
    lengths: list[int]
    predicted_step_time_s: float
    predicted_imbalance: float
    """Max over ranks of busy time / mean busy time (1.0 = perfectly balanced)."""
    dropped: tuple[int, ...]
    calibration_version: int
    """The cost-model version that made the plan."""
    exploration: str | None = None
    """``"cp<c>/<recompute>"`` (``"cp<c>/full<N>"``: N layers) when online calibration pinned
    the longest sequence (``dcp.planning.dcp_planner.pin_label``)."""
    plan_time_s: float = 0.0
    """Seconds the planning took (the planner's, the simulation's and the checks')."""


class BatchPlanner:
    """Deterministic planning of global batches (identical on every rank)."""

    def __init__(
        self,
        dcp_cfg,
        *,
        mesh: Mesh,
        max_seq_len: int | None = None,
        runtime_options: dict | None = None,
        ranks_per_node: int | None = None,
        model: ModelSpec | None = None,
        spec: dict | None = None,
    ) -> None:
        """``mesh``: the launched ranks (GPUs) and their TP and PP sizes; plans are over its
        ``num_planner_ranks``, and the cost model is checked against it. ``max_seq_len``: the
        run's longest sequence; the static baseline is sized for it (as a static Megatron run
        must be), not for each batch's longest. ``runtime_options``
        (``dcp.costmodel.spec.runtime_options``) replace the spec's options the run fixes; with
        them, the spec's cluster is also sized to the launch (``mesh.world_size``,
        ``ranks_per_node``): the run and its launch are the truth for the mesh, the spec for the
        hardware. ``model`` (the run's ``ModelConfig.shape``) replaces the spec's model
        (``dcp.costmodel.with_model``). ``spec``: a spec dict to plan with in place of the one
        ``dcp_cfg.spec`` names (an API caller's own)."""
        self.cfg = dcp_cfg
        self.mesh = mesh
        self.max_seq_len = max_seq_len
        self._runtime_options = runtime_options
        self._ranks_per_node = ranks_per_node
        self._model = model
        self.spec = self.lay(load_spec(dcp_cfg.spec if spec is None else spec))
        self.version = 0
        self._static_config: tuple[int, str] | None = None
        self.cost_model = self._load(self.spec)
        self.peak_tflops_per_gpu = float(self.spec["cluster"]["peak_tflops"])

    @classmethod
    def for_run(cls, cfg, *, mesh: Mesh, dataset) -> BatchPlanner:
        """The planner a training run ``cfg`` (a ``PretrainConfig``) uses on ``mesh`` (built
        from ``cfg.parallel``) over ``dataset``: the run's parallelism, dtype, optimizer, model
        and launch laid over its spec (the trainer's, and the benchmark's for its static
        candidates)."""
        from dcp.costmodel.spec import runtime_options

        return cls(
            cfg.planning,
            mesh=mesh,
            max_seq_len=longest_seq_len(dataset),
            runtime_options=runtime_options(
                dtype=cfg.model.dtype,
                distributed_optimizer=cfg.optim.distributed,
                fp8=cfg.model.fp8,
                tensor_parallel_size=mesh.tensor_parallel_size,
                tied_embeddings=cfg.model.tie_embeddings,
                pipeline_parallel_size=mesh.pipeline_parallel_size,
                expert_parallel_size=mesh.expert_parallel_size,
                virtual_pipeline_parallel_size=mesh.virtual_pipeline_parallel_size,
            ),
            ranks_per_node=launch_ranks_per_node(),
            model=cfg.model.shape,
        )

    def lay(self, spec: dict) -> dict:
        """``spec`` with this run's options, launch and model laid over it (what every spec the
        planner uses gets: the configured one, and a refitted one carried from a checkpoint
        written at another layout)."""
        calibrated = "calibration" in spec
        # The EP size goes on after the run's model: a spec written for a dense model refuses
        # an EP size above 1 (its experts are the run's).
        options = dict(self._runtime_options or {})
        experts = {k: options.pop(k) for k in ("expert_parallel_size",) if k in options}
        if options:
            spec, changed = with_runtime_options(spec, options)
            spec, resized = with_launch(
                spec, world_size=self.mesh.world_size, ranks_per_node=self._ranks_per_node
            )
            for key, (old, new) in {**changed, **resized}.items():
                where = key if key.startswith("cluster.") else f"options.{key}"
                logger.info("cost-model spec %s: %s -> %s (the run's setting)", where, old, new)
            if calibrated and "tensor_parallel_size" in changed:
                old_tp, new_tp = changed["tensor_parallel_size"]
                logger.info(
                    "the spec was calibrated at TP = %d: at TP = %d its fitted compute terms "
                    "are kept and the TP collectives are analytic until measured (online "
                    "calibration, or tools.profile at this TP size)",
                    old_tp,
                    new_tp,
                )
        if self._model is not None:
            spec, reshaped = with_model(spec, self._model)
            for key, (old, new) in reshaped.items():
                logger.info("cost-model spec %s: %s -> %s (the run's model)", key, old, new)
            if reshaped and calibrated:
                logger.info(
                    "the spec was calibrated on another model: its measured per-token terms are "
                    "scaled to this model analytically until measured (online calibration, or "
                    "tools.profile with this model)"
                )
        if experts:
            spec, changed = with_runtime_options(spec, experts)
            for key, (old, new) in changed.items():
                logger.info(
                    "cost-model spec options.%s: %s -> %s (the run's setting)", key, old, new
                )
        return spec

    def _load(self, spec: dict):
        return load_cost_model(spec, mesh=self.mesh)

    @property
    def num_planner_ranks(self) -> int:
        return self.cost_model.num_ranks

    def set_spec(self, spec: dict, *, version: int) -> None:
        """Plan with ``spec`` (model version ``version``: an online refit) from now on."""
        self.cost_model = self._load(spec)
        self.spec = spec
        self.version = version

    def planner_options(
        self, lengths: list[int], *, pinned: dict[int, tuple] | None = None
    ) -> PlannerOptions:
        """The configured planner's options for a batch of ``lengths``."""
        cfg = self.cfg
        if pinned and cfg.planner != "dcp":
            raise ValueError(f"pinned sequences are a dcp planner option, not {cfg.planner!r}'s")
        if cfg.planner == "dcp":
            return DCPOptions(
                on_oversize=cfg.on_oversize,
                pinned=pinned or None,
                partial_recompute=cfg.partial_recompute,
                share_cp_groups=cfg.share_cp_groups,
            )
        if cfg.planner in ("static", STATIC_PER_BATCH):
            # Sized for the run's longest sequence, as a static Megatron run must be.
            longest = None if self.max_seq_len is None else max(self.max_seq_len, max(lengths))
            cp_size, recompute = cfg.static_cp_size, cfg.static_recompute
            if cfg.planner == "static" and (cp_size is None or recompute is None):
                cp_size, recompute = self._fixed_static(lengths, longest or max(lengths))
            return StaticOptions(
                cp_size=cp_size,
                recompute=recompute,
                max_seq_len=longest,
                on_oversize=cfg.on_oversize,
            )
        if cfg.planner == MEGATRON_DEV:
            return MegatronDevOptions(on_oversize=cfg.on_oversize)
        assert cfg.planner == "megatron", cfg.planner
        return MegatronOptions(on_oversize=cfg.on_oversize)

    def _fixed_static(self, lengths: list[int], max_seq_len: int) -> tuple[int, str]:
        """planner=static's one configuration, chosen on the first batch planned when the
        config leaves it open (a trainer fixes it beforehand over the run's first batches:
        ``with_fixed_static_config``)."""
        if self._static_config is None:
            self._static_config = fixed_static_config(
                [lengths],
                cost_model=self.cost_model,
                max_seq_len=max_seq_len,
                cp_size=self.cfg.static_cp_size,
                recompute=self.cfg.static_recompute,
                min_cp_size=min_cp_size(self.mesh.expert_parallel_size),
                on_oversize=self.cfg.on_oversize,
            )
        return self._static_config

    def plan(
        self,
        batch: GlobalBatch,
        *,
        pinned: dict[int, tuple] | None = None,
        forward_only: bool = False,
    ) -> PlannedBatch:
        """Plan ``batch`` (``plan_lengths`` of its training lengths)."""
        return self.plan_lengths(seq_lengths(batch), pinned=pinned, forward_only=forward_only)

    def plan_lengths(
        self,
        lengths: list[int],
        *,
        pinned: dict[int, tuple] | None = None,
        forward_only: bool = False,
    ) -> PlannedBatch:
        """Plan a global batch of training ``lengths``, checked against the batch and the
        planner ranks before any rank runs it; ``pinned`` (the dcp planner's option) fixes some
        sequences' configuration. ``forward_only`` (log-probs, evaluation): planned with the
        memory of a forward-only micro-step (``CostModel.forward_only``), so smaller CP groups
        fit, and returned as ``Plan.forward_only`` (no recompute)."""
        start = time.perf_counter()
        cost_model, version = self.cost_model, self.version  # one model for the whole plan
        if forward_only:
            cost_model = cost_model.forward_only()
        options = self.planner_options(lengths, pinned=pinned)
        plan = plan_batch(lengths, cost_model=cost_model, planner=self.cfg.planner, options=options)
        plan.validate(num_sequences=len(lengths), num_ranks=self.num_planner_ranks)
        check_expert_lockstep(plan, self.mesh)
        if forward_only:
            plan = plan.forward_only()
        sim = simulate(plan, lengths, cost_model)
        mean_busy = sum(sim.busy_s) / len(sim.busy_s)
        imbalance = max(sim.busy_s) / mean_busy if mean_busy > 0 else 1.0
        return PlannedBatch(
            plan=plan,
            lengths=lengths,
            predicted_step_time_s=float(plan.predicted_step_time_s or sim.makespan_s),
            predicted_imbalance=float(imbalance),
            dropped=plan.dropped,
            calibration_version=version,
            exploration=(
                ", ".join(pin_label(config) for config in pinned.values()) if pinned else None
            ),
            plan_time_s=time.perf_counter() - start,
        )


def with_fixed_static_config(planner: BatchPlanner, batches: Iterable[GlobalBatch]):
    """``planner``'s planning config with ``planner=static``'s one (CP size, recompute) filled
    in, as a static Megatron run fixes it before it starts: ``fixed_static_config`` over the
    first ``STATIC_CHOICE_BATCHES`` of ``batches`` (the run's own, from its start, so a resumed
    run chooses the same), sized for the run's longest sequence. Any other planner's config, or
    one that already fixes both, is returned as it is."""
    cfg = planner.cfg
    if cfg.planner != "static" or None not in (cfg.static_cp_size, cfg.static_recompute):
        return cfg
    sample = [seq_lengths(b) for b in itertools.islice(batches, STATIC_CHOICE_BATCHES)]
    longest = max(max(lengths) for lengths in sample)
    cp_size, recompute = fixed_static_config(
        sample,
        cost_model=planner.cost_model,
        max_seq_len=longest if planner.max_seq_len is None else max(planner.max_seq_len, longest),
        cp_size=cfg.static_cp_size,
        recompute=cfg.static_recompute,
        min_cp_size=min_cp_size(planner.mesh.expert_parallel_size),
        on_oversize=cfg.on_oversize,
    )
    logger.info(
        "planner=static: the run's configuration is CP %d, recompute %s (the fastest predicted "
        "over its first %d batches)",
        cp_size,
        recompute,
        len(sample),
    )
    return dataclasses.replace(cfg, static_cp_size=cp_size, static_recompute=recompute)
