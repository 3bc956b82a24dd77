"""Published training throughput and the cost model's prediction of it (``tools.costmodel_check``).

A published row is one measured training configuration: a GPU, a model, a static parallel
layout (TP, PP, CP, VP, the rest data parallel), the global and micro batch, and the throughput
its authors measured. ``predict_row`` runs that exact configuration through the cost model:
every micro-batch holds ``mbs`` sequences of ``seq_len`` tokens and each data-parallel rank runs
m = ``gbs / (mbs · dp)`` of them. Without pipelining the step time is their sum; with it,
the pipeline's (``pipeline_step_s``: the slowest stage's micro-batches, the stage link's
transfers and the 1F1B fill and drain, interleaved over ``vp`` chunks per rank). Both add the
data-parallel gradient reduce-scatter and parameter all-gather that megatron's overlap leaves
exposed (``dp_reduction_s``); the optimizer step is not in it. Nothing is fitted per row:
the rows state what their recipes ran (recompute, TP communication overlap) and where each
came from. Pure Python, no torch.

Model TFLOP/s are counted as each source counts them (``attention_flops``, the two counts of
``dcp.costmodel.flops``: Megatron's ``causal``, NeMo's earlier ``full``). The check compares
tokens per second, converting a published TFLOP/s figure with the source's count; rows
publishing both must agree with the count.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dcp.costmodel.flops import ATTENTION_FLOPS, flops_per_token
from dcp.costmodel.formula import CostModel
from dcp.costmodel.load import gpu_presets, load_preset
from dcp.costmodel.pipeline import FORWARD_SHARE, PipelineCosts, part_param_count
from dcp.costmodel.spec import _DTYPE_BYTES, ModelSpec, runtime_options
from dcp.files import parse_json
from dcp.plan import RECOMPUTE_LEVELS, MicroStep, Recompute
from dcp.schema import check_range, from_dict

PRECISIONS = ("bf16", "fp8")
PUBLISHED_DIR = Path(__file__).parent / "published"
# A table is a few hundred lines at most; refuse anything far larger before reading it.
MAX_TABLE_BYTES = 4_000_000
MAX_ROWS = 10_000
GPUS_PER_NODE = 8
"""DGX / HGX systems: 8 GPUs per node, each on NVLink and its own InfiniBand NIC."""
CHECKED_ON = {"h100": "h100", "h200": "h100", "b200": "b200"}
"""The GPU whose published rows a GPU preset's checked coefficients stand on: no
configuration-complete H200 rows are published, so the ``h200`` preset takes the ``h100``
coefficients (the same GH100 compute; a test holds them equal)."""


@dataclass(kw_only=True, frozen=True)
class PublishedRow:
    """One line of a published-throughput table (JSON keys are these fields)."""

    gpu: str
    """A GPU preset of ``dcp/costmodel/profiles``: ``h100``, ``h200``, ``b200``."""
    num_gpus: int
    model: str | ModelSpec
    """A model preset name (``llama3-8b``: its ``model`` block; the row's ``tp`` applies, not the
    preset's) or the model's dimensions in megatron's names."""
    model_name: str | None = None
    """A label for a model given by its dimensions."""
    precision: str
    """``bf16`` or ``fp8`` (FP8 linear layers; attention and the LM head in bf16)."""
    seq_len: int
    tp: int
    pp: int
    cp: int
    vp: int | None = None
    """Virtual pipeline stages per rank (interleaved schedule); null: none."""
    ep: int = 1
    """Expert parallelism of a mixture-of-experts model (megatron's
    ``expert_model_parallel_size``): groups of this many consecutive ranks of a stage share each
    MoE layer's experts; 1 for a dense model."""
    gbs: int
    """Global batch, in sequences."""
    mbs: int | None = None
    """Micro-batch, in sequences; null: not published (the check takes 1)."""
    recompute: str | None = None
    """``none``, ``selective`` or ``full``; null: not published (the check takes the least level
    the cost model's memory rule fits)."""
    recompute_layers: int | None = None
    """With ``full``: only the first N layers recomputed (megatron's ``block`` method)."""
    tp_comm_overlap: bool | None = None
    """Megatron's TP communication overlap (Transformer Engine userbuffers): the
    sequence-parallel all-gathers and reduce-scatters run under the GEMMs they feed, so the
    check counts no TP communication time; null: not published (counted, as DCP runs it:
    userbuffers need one fixed sequence shape)."""
    tokens_per_s_per_gpu: float | None = None
    tflops_per_gpu: float | None = None
    """Model TFLOP/s per GPU, counted the source's way (``attention_flops``)."""
    attention_flops: str | None = None
    """How the source counts attention in its model FLOPs: ``causal`` or ``full``."""
    source: str
    """Repository, path, commit and table the row is from."""

    def __post_init__(self) -> None:
        if self.gpu not in gpu_presets():
            raise ValueError(f"gpu must be one of {gpu_presets()}, got {self.gpu!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {self.precision!r}")
        for name in ("num_gpus", "seq_len", "tp", "pp", "cp", "gbs", "ep"):
            check_range(getattr(self, name), name, ge=1, integer=True)
        for name in ("vp", "mbs", "recompute_layers"):
            if getattr(self, name) is not None:
                check_range(getattr(self, name), name, ge=1, integer=True)
        if self.num_gpus % (self.tp * self.pp * self.cp):
            raise ValueError(
                f"num_gpus={self.num_gpus} is not a multiple of tp*pp*cp="
                f"{self.tp * self.pp * self.cp}"
            )
        if self.gbs % (self.micro_batch * self.dp):
            raise ValueError(
                f"gbs={self.gbs} is not a multiple of mbs*dp={self.micro_batch * self.dp}"
            )
        if self.recompute is not None and self.recompute not in RECOMPUTE_LEVELS:
            raise ValueError(
                f"recompute must be one of {list(RECOMPUTE_LEVELS)} or null, got {self.recompute!r}"
            )
        if self.recompute_layers is not None and self.recompute != Recompute.FULL:
            raise ValueError("recompute_layers goes with recompute 'full'")
        if self.vp is not None and self.vp > 1 and self.pp == 1:
            raise ValueError("vp (virtual pipeline stages) needs pp > 1")
        if self.tp_comm_overlap and self.tp == 1:
            raise ValueError("tp_comm_overlap needs tp > 1")
        if self.tokens_per_s_per_gpu is None and self.tflops_per_gpu is None:
            raise ValueError("a row needs tokens_per_s_per_gpu or tflops_per_gpu")
        for name in ("tokens_per_s_per_gpu", "tflops_per_gpu"):
            if getattr(self, name) is not None:
                check_range(getattr(self, name), name, gt=0)
        if self.tflops_per_gpu is not None and self.attention_flops not in ATTENTION_FLOPS:
            raise ValueError(
                f"tflops_per_gpu needs attention_flops, one of {list(ATTENTION_FLOPS)}, got "
                f"{self.attention_flops!r}"
            )
        if not self.source.strip():
            raise ValueError("source must name where the row is published")
        if isinstance(self.model, str):
            model_spec(self.model)  # an unknown preset fails here, with the list of presets
        if self.ep > 1 and (not self.experts or (self.num_gpus // (self.tp * self.pp)) % self.ep):
            raise ValueError(
                f"ep={self.ep} needs a mixture-of-experts model and must divide the "
                f"num_gpus / (tp*pp) = {self.num_gpus // (self.tp * self.pp)} ranks of a stage"
            )

    @property
    def experts(self) -> bool:
        """Whether the row's model is a mixture of experts (``model.num_experts``)."""
        return model_spec(self.model).num_experts is not None

    @property
    def dp(self) -> int:
        return self.num_gpus // (self.tp * self.pp * self.cp)

    @property
    def micro_batch(self) -> int:
        return self.mbs or 1

    @property
    def micro_batches_per_rank(self) -> int:
        """Gradient-accumulation steps of each data-parallel rank."""
        return self.gbs // (self.micro_batch * self.dp)

    @property
    def label(self) -> str:
        model = self.model if isinstance(self.model, str) else self.model_name or "model"
        vp = f" vp{self.vp}" if self.vp else ""
        ep = f" ep{self.ep}" if self.ep > 1 else ""
        layout = f"tp{self.tp} pp{self.pp}{vp} cp{self.cp}{ep} dp{self.dp}"
        return f"{self.gpu}x{self.num_gpus} {model} {self.precision} {self.seq_len} {layout}"


def model_spec(model: str | ModelSpec) -> ModelSpec:
    """The model of a row: its dimensions, or a model preset's."""
    if isinstance(model, ModelSpec):
        return model
    block = load_preset(model).get("model")
    if not isinstance(block, dict):
        raise ValueError(f"preset {model!r} is not a model preset (it has no 'model' block)")
    return from_dict(ModelSpec, block, prefix=f"preset {model}.model")


def read_published(path: str | Path) -> list[PublishedRow]:
    """The rows of a JSONL table (one JSON object per line; blank lines skipped). Raises
    ``ValueError`` naming the file and line of the first bad row."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no such published-throughput table: {path}")
    size = path.stat().st_size
    if size > MAX_TABLE_BYTES:
        raise ValueError(
            f"{path} is {size:,} bytes; a published-throughput table is at most {MAX_TABLE_BYTES:,}"
        )
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        if len(rows) == MAX_ROWS:
            raise ValueError(f"{path} has more than {MAX_ROWS:,} rows")
        data = parse_json(line, source=f"{path}:{number}")
        if not isinstance(data, dict):
            raise ValueError(f"{path}:{number}: a row must be a JSON object")
        rows.append(from_dict(PublishedRow, data, prefix=f"{path}:{number}"))
    if not rows:
        raise ValueError(f"{path} holds no rows")
    return rows


PUBLISHED_RUN_RESERVED_GB = 3.0
"""Device memory outside the caching allocator in a published run, in GB (the row's
``options.memory_reserved_gb``): Megatron's own loop makes each communicator at its group's
first collective, so it holds those of the few groups it uses, not every group DCP warms at
start-up (``dcp.costmodel.communicators``). It is the one figure the presets reserved before the
reserve was split per communicator, so the recompute levels the check assumes, and the
coefficients fitted with them, stay those."""


def row_spec(row: PublishedRow) -> dict:
    """The cost-model spec of a row: its GPU preset (coefficients included) for its GPU count,
    its model, precision and TP size, and a published run's reserve
    (``PUBLISHED_RUN_RESERVED_GB``); nothing fitted to the row."""
    spec = load_preset(f"{row.gpu}x{row.num_gpus}")
    spec["cluster"]["gpus_per_node"] = min(GPUS_PER_NODE, row.num_gpus)
    spec["model"] = {k: v for k, v in vars(model_spec(row.model)).items() if v is not None}
    spec["options"] = {
        **spec.get("options", {}),
        **runtime_options(
            dtype="bf16",
            distributed_optimizer=True,
            fp8=row.precision == "fp8",
            tensor_parallel_size=row.tp,
            pipeline_parallel_size=row.pp,
            expert_parallel_size=row.ep,
        ),
        "memory_reserved_gb": PUBLISHED_RUN_RESERVED_GB,
    }
    spec["name"] = row.label
    return spec


def row_cost_model(
    row: PublishedRow, *, spec: dict | None = None, options: dict | None = None
) -> CostModel:
    """The ``CostModel`` of ``row_spec(row)`` (or of ``spec``), with ``options`` laid over the
    GPU preset's (what ``dcp.costmodel.throughput_fit`` varies)."""
    spec = spec or row_spec(row)
    if options:
        spec = {**spec, "options": {**spec["options"], **options}}
    cost_model = CostModel.from_spec(spec)
    if not row.tp_comm_overlap:
        return cost_model
    c = cost_model.coefficients
    hidden = dict.fromkeys(c.recompute_tp_frac, 0.0)
    coefficients = dataclasses.replace(
        c, tp_comm_s_per_token=0.0, tp_latency_s=0.0, recompute_tp_frac=hidden
    )
    return dataclasses.replace(cost_model, coefficients=coefficients)


def row_pipeline(row: PublishedRow, cost_model: CostModel) -> PipelineCosts:
    """The pipeline of a row with PP > 1: its stages and, with ``vp``, its interleaved
    chunks."""
    return PipelineCosts.of(cost_model, virtual_stages=row.vp or 1)


def row_recompute(row: PublishedRow, cost_model: CostModel) -> tuple[str, int | None, bool]:
    """(recompute level, layers, fits): the row's own, or the least the memory rule fits
    (under PP: on the fullest stage with its 1F1B micro-batches in flight, layers per model
    chunk)."""
    if row.pp > 1:
        cost_model = row_pipeline(row, cost_model).planning_model()
    lengths = [row.seq_len] * row.micro_batch
    if row.recompute is not None:
        fits = cost_model.fits(lengths, row.cp, row.recompute, row.recompute_layers)
        return row.recompute, row.recompute_layers, fits
    for level in (Recompute.NONE, Recompute.SELECTIVE):
        if cost_model.fits(lengths, row.cp, level):
            return level.value, None, True
    layers = cost_model.num_layers
    for n in range(1, layers + 1):
        if cost_model.fits(lengths, row.cp, Recompute.FULL, n):
            return Recompute.FULL.value, None if n == layers else n, True
    return Recompute.FULL.value, None, False


PipelineModel = Callable[[PublishedRow, CostModel], float]
"""Seconds of one training step of a pipeline-parallel row (a pipeline cost model)."""


def pipeline_step_s(row: PublishedRow, cost_model: CostModel) -> float:
    """Seconds of one training step of a row with PP > 1, its schedule as published (1F1B,
    interleaved over ``vp`` chunks per rank when given): each rank's micro-batch time is the
    sum of its layers' (``PipelineCosts.step_times``: the embedding on the first rank, the
    output layer and loss on the last, CP within each stage), the slowest rank's sets the pace,
    plus 2V activation and gradient transfers per micro-batch over the stage link, and the
    fill and drain (P - 1) / (V·m) of the m micro-batches
    (``PipelineCosts.schedule_time_s``)."""
    costs = row_pipeline(row, cost_model)
    step = row_micro_step(row, cost_model)
    times = costs.step_times(step, [row.seq_len] * row.micro_batch)
    slowest = max(forward + backward for forward, backward, _ in times)
    transfer = costs.p2p_time_s(row.micro_batch * row.seq_len / row.cp)
    return costs.schedule_time_s(
        slowest,
        row.micro_batches_per_rank,
        transfer_s=transfer,
        overlap_p2p=costs.virtual_stages > 1,
    )


def row_micro_step(row: PublishedRow, cost_model: CostModel) -> MicroStep:
    """One of ``row``'s micro-batches as a micro-step: its sequences over the row's CP group,
    at the recompute the row runs (``row_recompute``)."""
    level, layers, _ = row_recompute(row, cost_model)
    return MicroStep(
        ranks=tuple(range(row.cp)),
        seq_ids=tuple(range(row.micro_batch)),
        recompute=level,
        recompute_layers=layers,
    )


def dp_reduction_s(row: PublishedRow, cost_model: CostModel) -> float:
    """Exposed seconds of the distributed optimizer's data-parallel traffic over the DP × CP
    ranks of a stage: the reduce-scatter of the gradients and the all-gather of the updated
    parameters, each a ring over those ranks moving (n - 1) / n of a GPU's share in the
    model's dtype (megatron's default: gradients reduced in the parameters' dtype). Megatron
    (``overlap_grad_reduce``, ``overlap_param_gather``) reduces each model chunk's gradients
    as its last backward ends and gathers its parameters under its first forward, so the
    traffic left exposed is that of the chunk that finishes last and starts first, the first
    rank's first chunk (the whole stage without interleaving, the whole model without PP),
    beyond its one backward and one forward of a micro-batch."""
    n = cost_model.num_ranks
    if n == 1:
        return 0.0
    step = row_micro_step(row, cost_model)
    lengths = [row.seq_len] * row.micro_batch
    if row.pp > 1:
        costs = row_pipeline(row, cost_model)
        first = costs.chunks[0]
        params = part_param_count(cost_model, first.num_layers, first=True, last=False)
        forward_s, backward_s, _ = costs.chunk_step_times(step, lengths)[0]
    else:
        params = part_param_count(cost_model, cost_model.num_layers, first=True, last=True)
        micro_s = cost_model.step_time_s(
            lengths, row.cp, step.recompute, recompute_layers=step.recompute_layers
        )
        forward_s, backward_s = FORWARD_SHARE * micro_s, (1.0 - FORWARD_SHARE) * micro_s
    options = cost_model.options
    ring_bytes = params / options.tensor_parallel_size * _DTYPE_BYTES[options.dtype] * (n - 1) / n
    ring_s = ring_bytes / cost_model.bandwidth_bytes_per_s(n) + (n - 1) * options.link_latency_s
    return max(0.0, ring_s - backward_s) + max(0.0, ring_s - forward_s)


def predict_row(
    row: PublishedRow,
    *,
    pipeline: PipelineModel = pipeline_step_s,
    cost_model: CostModel | None = None,
) -> dict:
    """Predicted against published throughput of one row, as a JSON-ready dict
    (``pipeline``: the step time of a row with PP > 1). ``cost_model``: the row's
    (default ``row_cost_model(row)``)."""
    model = model_spec(row.model)
    published_tokens = row.tokens_per_s_per_gpu
    row_flops = None
    if row.attention_flops is not None:
        row_flops = flops_per_token(model, row.seq_len, attention=row.attention_flops)
        if published_tokens is None:
            published_tokens = row.tflops_per_gpu * 1e12 / row_flops
    out: dict = {
        "row": row.label,
        "source": row.source,
        "published_tokens_per_s_per_gpu": published_tokens,
        "published_tflops_per_gpu": row.tflops_per_gpu,
    }
    cost_model = cost_model or row_cost_model(row)
    level, layers, fits = row_recompute(row, cost_model)
    if row.pp > 1:
        step_s = pipeline(row, cost_model)
    else:
        micro_s = cost_model.step_time_s(
            [row.seq_len] * row.micro_batch, row.cp, level, recompute_layers=layers
        )
        step_s = micro_s * row.micro_batches_per_rank
    step_s += dp_reduction_s(row, cost_model)
    tokens = row.gbs * row.seq_len / (step_s * row.num_gpus)
    out.update(
        predicted_step_s=step_s,
        predicted_tokens_per_s_per_gpu=tokens,
        predicted_tflops_per_gpu=(None if row_flops is None else tokens * row_flops / 1e12),
        rel_error=tokens / published_tokens - 1.0,
        recompute=level if layers is None else f"{level}/{layers}",
        recompute_published=row.recompute is not None,
        fits_memory=fits,
    )
    return out


def summarize(per_row: list[dict]) -> dict:
    """Row counts and |relative error| statistics over ``per_row`` (every row is modelled)."""
    errors = [abs(r["rel_error"]) for r in per_row]
    return {
        "rows": len(per_row),
        "modelled": len(errors),
        "median_abs_rel_error": statistics.median(errors) if errors else None,
        "worst_abs_rel_error": max(errors) if errors else None,
    }


def check_published(rows: list[PublishedRow], *, pipeline: PipelineModel = pipeline_step_s) -> dict:
    """Every row predicted with its GPU preset; the summary ``tools.costmodel_check`` prints as
    its last line (``per_row`` in table order), with the dense and the mixture-of-experts rows
    also summarised apart (``dense``, ``experts``): the presets' coefficients are chosen on
    dense rows only, so the expert rows are out of sample."""
    per_row = [predict_row(row, pipeline=pipeline) for row in rows]
    parts = {
        name: summarize([r for row, r in zip(rows, per_row, strict=True) if row.experts == moe])
        for name, moe in (("dense", False), ("experts", True))
    }
    return {**summarize(per_row), **parts, "per_row": per_row}


def preset_check(gpu: str, tables: list[Path] | None = None) -> dict | None:
    """How closely the published rows a GPU preset's coefficients stand on (``CHECKED_ON``; the
    dense rows) are reproduced: ``summarize`` of those rows of ``tables`` (default: the shipped
    ones), with ``preset`` and ``checked_on``; None for a GPU without published rows."""
    checked_on = CHECKED_ON.get(gpu)
    paths = tables if tables is not None else sorted(PUBLISHED_DIR.glob("*.jsonl"))
    rows = [
        row
        for path in paths
        for row in read_published(path)
        if row.gpu == checked_on and not row.experts
    ]
    if not rows:
        return None
    per_row = [predict_row(row) for row in rows]
    return {"preset": gpu, "checked_on": checked_on, **summarize(per_row)}


def describe_check(check: dict | None, *, precision: str = "bf16") -> str:
    """One line for a simulation's output: which published rows the preset was checked on and
    how closely (``preset_check``), and what they leave unchecked."""
    if check is None:
        return "cost model: not checked against published throughput (no GPU preset's rows)"
    line = (
        f"cost model: the {check['preset']} preset, checked against {check['modelled']} "
        f"published {check['checked_on'].upper()} training rows (python -m "
        f"tools.costmodel_check): median |error| {100 * check['median_abs_rel_error']:.1f}%, "
        f"worst {100 * check['worst_abs_rel_error']:.1f}%"
    )
    if precision == "bf16":
        line += "; its bf16 linear layers are unchecked (every row in the check is FP8)"
    return line
