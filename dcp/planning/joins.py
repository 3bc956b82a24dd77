"""Joining sequences and micro-steps (``DCPOptions.share_cp_groups``): a step's fixed costs
(overhead, kernel ramp-up, CP hop latency) are paid once for all it holds, at the price of
memory for their sum. ``_shared_jobs`` joins solo sequences before placement, ``_merge_same_block``
joins placed steps on the same ranks; ``_PackConfigs`` prices a step of several sequences. Part
of the DCP planner (``dcp.planning.dcp_planner``); docs/planner.md, 'How it decides', step 5.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dcp.costmodel import CostModel
from dcp.plan import RECOMPUTE_LEVELS, MicroStep, Plan, Recompute
from dcp.planning.simulator import simulate

# Joining micro-steps is tried only where it could save at least this share of their time.
_MIN_SAVING = 1e-3


@dataclass(frozen=True)
class _Job:
    """Sequences (rows of the kept lengths) run together in one solo micro-step: per CP size,
    its step time alone at the fastest feasible recompute (inf: none fits), that level's index
    and full recompute's N (0: all layers)."""

    rows: list[int]
    dur: np.ndarray
    rec: np.ndarray
    layers: np.ndarray

    def area(self, sizes: np.ndarray) -> float:
        return float((self.dur * sizes).min())


class _PackConfigs:
    """The fastest feasible (recompute, N) of one micro-step holding several sequences, per CP
    size: the choice ``dcp_planner._solo_table`` makes for one sequence, with memory counting
    the step's total tokens."""

    def __init__(
        self, cost_model: CostModel, sizes: list[int], levels: list[str], partial: bool
    ) -> None:
        self.cost_model = cost_model
        self.sizes = sizes
        self.levels = levels
        self.partial = partial
        c = cost_model.coefficients
        constant = max(cost_model.step_constant_s(level) for level in RECOMPUTE_LEVELS)
        # Rank-seconds a merge can save at each size at most: the formula is additive over
        # a step's sequences except for these per-step terms (and the overlap max, which is
        # subadditive), so merged area >= the parts' areas minus this.
        self.max_saving = np.array(
            [cp * (constant + (cp - 1) * c.cp_hop_latency_s) for cp in sizes]
        )
        if partial:
            none, full = (cost_model.mem_bytes_per_token(level) for level in ("none", "full"))
            self._none_per_token, self._saved_per_token = none, none - full
            self._free = cost_model.mem_budget_bytes - cost_model.static_mem_bytes

    def least_layers(self, tokens: int, cp: int) -> int | None:
        """``CostModel.min_recompute_layers`` for one step of ``tokens`` (``None``: not even
        all layers fit) in plain floats: numpy's per-call cost on one-element arrays made
        planning about 30% slower at 8K sequences on 1,024 GPUs. A unit test keeps the two
        equal."""
        cm, layers = self.cost_model, self.cost_model.num_layers
        if self._saved_per_token > 0:
            guess = layers * (self._none_per_token - self._free * cp / tokens)
            n = min(max(1, math.ceil(guess / self._saved_per_token)), layers + 1)
        else:
            n = 1
        while n > 1 and cm.fits([tokens], cp, "full", n - 1):
            n -= 1
        while n <= layers and not cm.fits([tokens], cp, "full", n):
            n += 1
        return n if n <= layers else None

    def worth_trying(self, k: int, area: float) -> bool:
        """Whether joining parts of ``area`` rank-seconds at CP ``sizes[k]`` could save at least
        0.1% (``max_saving``): smaller gains are not worth the planning time."""
        return self.max_saving[k] > _MIN_SAVING * area

    def best(self, lengths: list[int], k: int, ranks: tuple[int, ...] | None = None):
        """(seconds, level index, N or 0) of the step at CP ``sizes[k]``; seconds inf if no
        level fits."""
        cm, cp = self.cost_model, self.sizes[k]
        total = sum(lengths)
        best = (np.inf, 0, 0)
        for level in self.levels:
            n = None
            if level == Recompute.FULL and self.partial:
                n = self.least_layers(total, cp)  # fits by construction
                if n is None:
                    continue
            elif not cm.fits(lengths, cp, level):
                continue
            t = cm.step_time_s(lengths, cp, level, ranks, recompute_layers=n)
            if t < best[0]:
                kept_n = n if n is not None and n < cm.num_layers else 0
                best = (t, RECOMPUTE_LEVELS.index(level), kept_n)
        return best

    def table(self, lengths: list[int], max_k: int) -> tuple[np.ndarray, ...]:
        """``best`` at every CP size up to ``sizes[max_k]`` (larger sizes: inf)."""
        K = len(self.sizes)
        dur, rec, layers = np.full(K, np.inf), np.zeros(K, np.int64), np.zeros(K, np.int64)
        for k in range(min(max_k, K - 1) + 1):
            dur[k], rec[k], layers[k] = self.best(lengths, k)
        return dur, rec, layers


def _shared_jobs(
    kept: np.ndarray,
    rows: np.ndarray,
    dur: np.ndarray,
    rec: np.ndarray,
    layers: np.ndarray,
    pack: _PackConfigs,
) -> list[_Job]:
    """Greedily join neighbours (shortest first) among ``rows`` (sequences too long to pack at
    CP=1) while the joined micro-step has fewer rank-seconds at its cheapest CP size than its
    parts apart. A job holds at most the batch's longest sequence or a rank's even share of the
    batch's tokens, whichever is more, so it never gets harder to balance than the batch
    already is, and uses at most twice the CP size its largest part would. Returns the jobs
    with two or more members."""
    if rows.size < 2:
        return []
    sizes = np.asarray(pack.sizes, dtype=np.float64)
    areas = dur * sizes
    area, best_k = areas.min(axis=1), areas.argmin(axis=1)
    cap = max(float(kept.max()), float(kept.sum()) / pack.cost_model.num_ranks)
    out: list[_Job] = []
    cur: _Job | None = None
    cur_area = cur_k = 0
    for i in rows[np.argsort(kept[rows], kind="stable")]:
        i = int(i)
        if cur is not None:
            total = float(kept[cur.rows].sum() + kept[i])
            max_k = max(cur_k, int(best_k[i])) + 1
            worth = pack.worth_trying(min(max_k, len(pack.sizes) - 1), cur_area + area[i])
            if total <= cap and worth:
                lens = [int(x) for x in kept[cur.rows]] + [int(kept[i])]
                joined = _Job(cur.rows + [i], *pack.table(lens, max_k))
                joined_area = joined.area(sizes)
                if joined_area < cur_area + area[i]:
                    cur, cur_area = joined, joined_area
                    cur_k = int(np.argmin(joined.dur * sizes))
                    continue
            if len(cur.rows) > 1:
                out.append(cur)
        cur = _Job([i], dur[i], rec[i], layers[i])
        cur_area, cur_k = area[i], int(best_k[i])
    if cur is not None and len(cur.rows) > 1:
        out.append(cur)
    return out


def _merge_same_block(
    steps: list[MicroStep], lengths: np.ndarray, pack: _PackConfigs, makespan_s: float
) -> tuple[list[MicroStep], float] | None:
    """Join micro-steps that run on the same ranks when one step is cheaper than the parts
    (fixed costs paid once). A block's steps are contiguous in ``_to_steps``' order and no other
    rank waits on them, so joining only shortens that block; the simulator confirms it against
    ``makespan_s``, the steps' own. Returns the joined steps and their simulated makespan, or
    ``None`` if nothing joined."""
    lens = [int(x) for x in lengths]
    by_ranks: dict[tuple[int, ...], list[int]] = {}
    for index, step in enumerate(steps):
        by_ranks.setdefault(step.ranks, []).append(index)
    replaced: dict[int, MicroStep | None] = {}
    for ranks, indices in by_ranks.items():
        if len(indices) < 2 or len(ranks) not in pack.sizes:
            continue
        bins = _join_block(ranks, [steps[i] for i in indices], indices, lens, pack)
        if len(bins) == len(indices):
            continue
        replaced.update({index: None for index in indices})
        replaced.update(bins)
    if not replaced:
        return None
    joined = [step for i, s in enumerate(steps) if (step := replaced.get(i, s)) is not None]
    after = simulate(Plan(steps=tuple(joined)), lens, pack.cost_model).makespan_s
    return (joined, after) if after <= makespan_s else None


def _join_block(
    ranks: tuple[int, ...],
    steps: list[MicroStep],
    indices: list[int],
    lens: list[int],
    pack: _PackConfigs,
) -> dict[int, MicroStep]:
    """The steps of one block joined greedily (fewest tokens first, each into the step where
    joining saves the most): {position of the joined step's first part: step}."""
    cm, k = pack.cost_model, pack.sizes.index(len(ranks))
    bins: dict[int, tuple[MicroStep, float]] = {}
    order = sorted(range(len(steps)), key=lambda x: (sum(lens[s] for s in steps[x].seq_ids), x))
    for x in order:
        step = steps[x]
        seq = [lens[s] for s in step.seq_ids]
        t = cm.step_time_s(
            seq, step.cp_size, step.recompute, ranks, recompute_layers=step.recompute_layers
        )
        best = None
        if not pack.worth_trying(
            k, len(ranks) * (t + max((v[1] for v in bins.values()), default=0))
        ):
            bins[indices[x]] = (step, t)
            continue
        for first, (other, t_other) in bins.items():
            seq_ids = tuple(sorted(other.seq_ids + step.seq_ids))
            joined_t, r, n = pack.best([lens[s] for s in seq_ids], k, ranks)
            saving = t_other + t - joined_t
            if saving > 1e-12 * (t_other + t) and (best is None or saving > best[0]):
                joined = MicroStep(
                    ranks=ranks,
                    seq_ids=seq_ids,
                    recompute=RECOMPUTE_LEVELS[r],
                    recompute_layers=n or None,
                )
                best = (saving, first, joined, joined_t)
        if best is None:
            bins[indices[x]] = (step, t)
        else:
            _, first, joined, joined_t = best
            del bins[first]
            bins[min(first, indices[x])] = (joined, joined_t)
    return {first: step for first, (step, _) in bins.items()}
