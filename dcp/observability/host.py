"""How busy the host was while a run measured its steps, and what that means for comparisons.

Every step record carries ``host`` (``HostStats``: the 1-minute load average and the CPU count
of the host of the rank that writes the record, and whether the run computes on CPU or a GPU).
Step times measured on a shared machine move with whatever else runs there (docs/operations.md,
"Comparing runs"). ``load_warnings`` says, for runs about to be compared, which ran on a busy
host or under different loads; ``tools.compare_runs`` and the benchmarks print it next to their
ratios.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

BUSY_LOAD_PER_CPU = 1.25
"""A host is busy when its median 1-minute load average exceeds this many runnable tasks per
CPU: the run's own ranks then share cores with other work (or with each other)."""
DIFFERENT_CONTENTION = 0.25
"""Two runs ran under different loads when one's contention (``RunLoad.contention``: runnable
tasks per CPU, at least 1) exceeds the other's by more than this fraction."""
LOAD_KEY = "host/load_1m"
CPUS_KEY = "host/cpus"
DEVICE_KEY = "host/device"
"""The flat ``metrics.jsonl`` keys of ``HostStats`` (records are flattened with ``/``)."""


@dataclass(frozen=True, kw_only=True)
class HostStats:
    """The host of the recording rank at the end of one step (logged under ``host/``)."""

    load_1m: float | None
    """1-minute load average (``os.getloadavg``; ``None`` where the OS has none). It counts the
    run's own busy ranks too: a 2-rank CPU run on a quiet 2-core host sits near 2."""
    cpus: int
    """CPUs of the host (``os.cpu_count``)."""
    device: str
    """``"cpu"`` or ``"cuda"``: where the run computes."""

    @classmethod
    def now(cls, *, device: str) -> HostStats:
        try:
            load: float | None = os.getloadavg()[0]
        except OSError:
            load = None
        return cls(load_1m=load, cpus=os.cpu_count() or 1, device=device)


@dataclass(frozen=True)
class RunLoad:
    """One run's host load over its steps."""

    label: str
    median_load_1m: float | None
    """``None``: the run's records carry no load (written before records had one)."""
    cpus: int | None

    @classmethod
    def of(cls, label: str, records: Sequence[Mapping[str, Any]]) -> RunLoad:
        """From flat ``metrics.jsonl`` records (``read_metrics``)."""
        loads = [r[LOAD_KEY] for r in records if isinstance(r.get(LOAD_KEY), int | float)]
        cpus = [r[CPUS_KEY] for r in records if isinstance(r.get(CPUS_KEY), int)]
        return cls(
            label=label,
            median_load_1m=float(statistics.median(loads)) if loads else None,
            cpus=max(cpus) if cpus else None,
        )

    @property
    def contention(self) -> float | None:
        """How many runnable tasks shared each CPU (at least 1: a host with spare CPUs slows no
        one down); a rough factor by which waiting for cores stretched the run's step times."""
        if self.median_load_1m is None or not self.cpus:
            return None
        return max(1.0, self.median_load_1m / self.cpus)

    @property
    def busy(self) -> bool:
        if self.median_load_1m is None or not self.cpus:
            return False
        return self.median_load_1m > BUSY_LOAD_PER_CPU * self.cpus


def load_warnings(runs: Sequence[RunLoad]) -> list[str]:
    """One line per reason the runs' step times may not be comparable: a run measured on a
    busy host, runs measured under different loads, a run whose records carry no load."""
    lines = []
    for run in runs:
        if run.busy:
            lines.append(
                f"warning: {run.label} ran on a busy host (median load average "
                f"{run.median_load_1m:.1f} on {run.cpus} CPUs): its step times include waiting "
                "for other work; rerun on a quieter machine before trusting a ratio"
            )
    measured = [r for r in runs if r.contention is not None]
    if len(measured) > 1:
        low = min(measured, key=lambda r: r.contention)
        high = max(measured, key=lambda r: r.contention)
        if high.contention > (1 + DIFFERENT_CONTENTION) * low.contention:
            lines.append(
                f"warning: the runs ran under different host loads ({low.label} "
                f"{low.median_load_1m:.1f} on {low.cpus} CPUs, {high.label} "
                f"{high.median_load_1m:.1f} on {high.cpus}): their step-time ratio mixes the "
                "planners' difference with the machine's"
            )
    unknown = [r.label for r in runs if r.median_load_1m is None]
    if unknown and len(runs) > 1:
        lines.append(
            f"note: no host load recorded for {', '.join(unknown)} (records written before "
            "DCP logged host/load_1m): whether the host was busy is unknown"
        )
    return lines
