"""What configuration a run ran, in one short phrase, for the legends of the comparison plots.

Two runs of one planner (three DCP runs at different TP sizes, two static runs at different CP
sizes) are told apart by what they ran, not by their directory or file names. A DCP-trainer run
directory says it in its ``config.yaml``; a Megatron-loop ``--dcp-metrics`` file has no config
beside it, so the phrase comes from its records (``planner`` and, under ``--dcp``, the plan's
CP histogram and recompute share).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from dcp.observability.metrics import METRICS_FILENAME
from dcp.observability.run_info import CONFIG_FILENAME, read_run_config

CP_HIST_PREFIX = "plan/cp_hist/"
RECOMPUTE_KEY = "plan/recompute_fraction"
DESCRIBED = ("planner", RECOMPUTE_KEY)
"""The record keys ``describe_run`` reads, with those under ``CP_HIST_PREFIX``."""


def run_config_of(metrics_path: str | Path) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """``(config, run_info)`` of the run directory a metrics path belongs to (the directory, or
    its ``metrics.jsonl``); ``None`` for any other metrics file or a directory without a
    ``config.yaml`` (a Megatron-loop run's ``--dcp-metrics`` file)."""
    p = Path(metrics_path)
    run_dir = p if p.is_dir() else (p.parent if p.name == METRICS_FILENAME else None)
    if run_dir is None or not (run_dir / CONFIG_FILENAME).is_file():
        return None
    return read_run_config(run_dir)


def describe_run(
    records: Iterable[Mapping[str, Any]],
    config: tuple[Mapping[str, Any], Mapping[str, Any]] | None,
) -> str:
    """``planner dcp, CP 1/2, recompute 58%, TP 1 PP 1, 2 ranks``: the planner, the CP sizes
    the plans used (a static run's configured size), the mean share of tokens recomputed (a
    static run's configured level), the TP and PP sizes and the world size, each where the
    run's config or records say it. ``config``: ``run_config_of``'s result."""
    cfg, info = config or ({}, {})
    planning = _mapping(cfg.get("planning"))
    parallel = _mapping(cfg.get("parallel"))
    planner = planning.get("planner")
    cp_sizes: set[int] = set()
    recompute: list[float] = []
    for record in records:
        planner = planner or record.get("planner")
        cp_sizes.update(
            int(k[len(CP_HIST_PREFIX) :])
            for k, v in record.items()
            if k.startswith(CP_HIST_PREFIX) and k[len(CP_HIST_PREFIX) :].isdigit() and v
        )
        share = record.get(RECOMPUTE_KEY)
        if isinstance(share, int | float) and not isinstance(share, bool) and math.isfinite(share):
            recompute.append(float(share))
    parts = [f"planner {planner}"] if isinstance(planner, str) else []
    # The static planners' fixed choices; other planners ignore these keys.
    fixed = planning if isinstance(planner, str) and planner.startswith("static") else {}
    static_cp = fixed.get("static_cp_size")
    if isinstance(static_cp, int):
        parts.append(f"CP {static_cp}")
    elif cp_sizes:
        parts.append("CP " + "/".join(str(s) for s in sorted(cp_sizes)))
    if isinstance(fixed.get("static_recompute"), str):
        parts.append(f"recompute {fixed['static_recompute']}")
    elif recompute:
        parts.append(f"recompute {sum(recompute) / len(recompute):.0%}")
    tp, pp = parallel.get("tensor_parallel_size"), parallel.get("pipeline_parallel_size")
    if isinstance(tp, int) and isinstance(pp, int):
        parts.append(f"TP {tp} PP {pp}")
    world = info.get("world_size")
    if isinstance(world, int):
        parts.append(f"{world} rank{'' if world == 1 else 's'}")
    return ", ".join(parts)


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}
