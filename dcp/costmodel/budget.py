"""Per-GPU memory of a run, by the same rule the planner plans with.

``memory_budget`` breaks a cost model's memory down for the longest sequence a run trains:
static bytes (weights, main grads, optimizer shard) and activation bytes at every CP size and
recompute level, each total compared with the per-GPU budget, and at every CP size the least
number of layers a partial full recompute must cover to fit (``MicroStep.recompute_layers``).
Every total is
``CostModel.solo_mem_bytes``, the function the planners call, so a cell that fits here is a
placement the planner may choose and one that does not is one it never will.

Under pipeline parallelism (``options.pipeline_parallel_size``) every number is per GPU of the
tightest stage (``dcp.costmodel.pipeline``): a cell's total holds the P - s micro-steps stage s
has in flight under 1F1B, all as large as this one (what a static run sized for the longest
sequence needs, and the rule the planners size micro-steps with), and its ``alone`` total this
micro-step among small ones (the least any plan needs).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dcp.costmodel.formula import CostModel
from dcp.costmodel.pipeline import PipelineCosts
from dcp.costmodel.spec import static_memory_parts
from dcp.plan import RECOMPUTE_LEVELS


@dataclass(frozen=True)
class BudgetCell:
    """One (CP size, recompute level) placement of the longest sequence."""

    cp_size: int
    recompute: str
    activation_bytes_per_gpu: float
    total_bytes_per_gpu: float
    fits: bool
    total_bytes_alone_per_gpu: float | None = None
    """With pipeline parallelism: the bytes of this micro-step among small ones (else None)."""
    fits_alone: bool | None = None


@dataclass(frozen=True)
class PartialCell:
    """The least partial full recompute that holds the longest sequence at one CP size."""

    cp_size: int
    min_recompute_layers: int | None
    """Least N of the model's ``num_layers`` whose full recompute fits (``None``: not even all
    layers fit); any larger N fits too."""
    num_layers: int
    total_bytes_per_gpu: float | None
    """Bytes per GPU at that N (``None`` where nothing fits)."""


@dataclass(frozen=True)
class MemoryBudget:
    """Where a run's per-GPU memory goes and whether its longest sequence fits anywhere."""

    longest_seq_len: int
    budget_bytes_per_gpu: float
    static_bytes_per_gpu: float
    """What the planner uses: the spec's calibrated value when it has one, else the parts'
    sum."""
    static_parts: dict[str, float]
    """Analytic ``weights`` / ``grads`` / ``optimizer`` bytes per GPU."""
    static_calibrated: bool
    """Whether the spec's calibration replaced the analytic static bytes."""
    cells: tuple[BudgetCell, ...]
    partial: tuple[PartialCell, ...] = ()
    """Per CP size, the least layers a full recompute must cover (empty without a model)."""
    pipeline_parallel_size: int = 1
    stage_layers: tuple[int, ...] = ()
    """With pipeline parallelism: transformer layers per stage (a recompute's layer count is per
    stage)."""
    stage_static_bytes_per_gpu: tuple[float, ...] = ()

    @property
    def fits(self) -> bool:
        """The longest sequence has at least one placement within the budget (with pipeline
        parallelism: among small micro-steps)."""
        return any(c.fits or bool(c.fits_alone) for c in self.cells)

    def to_json(self) -> dict:
        out = asdict(self)
        out["fits"] = self.fits
        return out


def cp_sizes(num_ranks: int) -> list[int]:
    """The CP sizes a plan can use: powers of two up to the number of planner ranks."""
    sizes, size = [], 1
    while size <= num_ranks:
        sizes.append(size)
        size *= 2
    return sizes


def memory_budget(cost_model: CostModel, longest_seq_len: int) -> MemoryBudget:
    """The memory breakdown of ``cost_model`` for a sequence of ``longest_seq_len`` tokens."""
    if longest_seq_len < 1:
        raise ValueError(f"longest_seq_len must be >= 1, got {longest_seq_len}")
    parts = static_memory_parts(
        cost_model.model, cost_model.options, num_ranks=cost_model.num_ranks
    )
    rule, alone, pipeline = cost_model, None, None
    if cost_model.pipeline_parallel_size > 1:
        pipeline = PipelineCosts.of(cost_model)
        rule = pipeline.planning_model()
        alone = pipeline.planning_model(in_flight=False)
        # The tightest stage's share of the whole model's weights, grads and optimizer.
        share = rule.static_mem_bytes / cost_model.static_mem_bytes
        parts = {k: v * share for k, v in parts.items()}
    cells = []
    for cp_size in cp_sizes(rule.num_ranks):
        for recompute in RECOMPUTE_LEVELS:
            total = float(rule.solo_mem_bytes([longest_seq_len], cp_size, recompute)[0])
            single = (
                None
                if alone is None
                else float(alone.solo_mem_bytes([longest_seq_len], cp_size, recompute)[0])
            )
            cells.append(
                BudgetCell(
                    cp_size=cp_size,
                    recompute=recompute,
                    activation_bytes_per_gpu=total - rule.static_mem_bytes,
                    total_bytes_per_gpu=total,
                    fits=total <= rule.mem_budget_bytes,
                    total_bytes_alone_per_gpu=single,
                    fits_alone=None if single is None else single <= rule.mem_budget_bytes,
                )
            )
    partial = []
    layers = rule.num_layers
    for cp_size in cp_sizes(rule.num_ranks) if layers is not None else ():
        n = int(rule.min_recompute_layers([longest_seq_len], cp_size)[0])
        fits = n <= layers
        total = rule.solo_mem_bytes([longest_seq_len], cp_size, "full", n)[0] if fits else None
        partial.append(
            PartialCell(
                cp_size=cp_size,
                min_recompute_layers=n if fits else None,
                num_layers=layers,
                total_bytes_per_gpu=None if total is None else float(total),
            )
        )
    return MemoryBudget(
        longest_seq_len=int(longest_seq_len),
        budget_bytes_per_gpu=rule.mem_budget_bytes,
        static_bytes_per_gpu=rule.static_mem_bytes,
        static_parts=parts,
        static_calibrated=abs(sum(parts.values()) - rule.static_mem_bytes)
        > 1e-6 * rule.static_mem_bytes,
        cells=tuple(cells),
        partial=tuple(partial),
        pipeline_parallel_size=cost_model.pipeline_parallel_size,
        stage_layers=() if pipeline is None else pipeline.layer_counts,
        stage_static_bytes_per_gpu=()
        if pipeline is None
        else tuple(stage.static_mem_bytes for stage in pipeline.stages),
    )
