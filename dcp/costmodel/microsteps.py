"""Measured micro-steps of a training run: the record the trainer appends, one JSON line each.

``runs/<name>/microsteps.jsonl`` holds one object per executed micro-step. The record is a stable
contract (extended only compatibly; readers ignore keys they do not know)::

    {"step": int,             # global step (optimizer step) the micro-step belonged to
     "ranks": [int],          # its CP group: global ranks of the DP×CP domain, ascending
     "seq_lens": [int],       # training lengths of the sequences packed in it
     "recompute": str,        # one of dcp.plan.ALL_RECOMPUTE_LEVELS
     "time_s": float,         # forward + backward wall seconds (slowest rank of the group)
     "mem_bytes": int | null, # peak bytes on its ranks; optional (absent or null: not measured)
     "recompute_layers": int | null}  # with "full": layers recomputed; optional (absent or
                                      # null: all of them, as before the key existed)

``dcp.costmodel.online`` refits a cost model from these records. Readers stream the file (a bound
per line, ``dcp.files``) and keep only the steps they ask for, within a values budget
(``MAX_KEPT_VALUES``). Pure Python, no torch.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from dcp.files import SHAPE_ERRORS, FileContentError, check_tree, iter_lines, parse_json, publish
from dcp.plan import ALL_RECOMPUTE_LEVELS, Recompute, check_choice

_REQUIRED = ("step", "ranks", "seq_lens", "recompute", "time_s")

logger = logging.getLogger(__name__)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, kw_only=True)
class MicroStepRecord:
    """One executed micro-step, as measured by the trainer."""

    step: int
    """Global (optimizer) step the micro-step belonged to, >= 0."""
    ranks: tuple[int, ...]
    """The CP group: distinct non-negative global ranks, ascending."""
    seq_lens: tuple[int, ...]
    """Training lengths (tokens) of the sequences packed together, each >= 1."""
    recompute: str
    """Recompute level (``dcp.plan.ALL_RECOMPUTE_LEVELS``)."""
    time_s: float
    """Forward + backward wall seconds on the slowest rank of the group, > 0 and finite."""
    mem_bytes: int | None = None
    """Peak bytes on the group's ranks; ``None`` when not measured."""
    recompute_layers: int | None = None
    """With ``full``: the first N layers recomputed (``MicroStep.recompute_layers``); ``None``:
    all of them. A partial recompute timed as a full one would teach the refit that full
    recompute is cheap. Under pipeline parallelism: the layers recomputed over all stages."""
    pipeline_stages: int = 1
    """Under pipeline parallelism, the P stages whose times ``time_s`` sums (each stage's
    slowest rank of the group; the waits between stages not counted): the whole model's layers
    once, and the micro-step's fixed costs once per stage (``record_time_s``)."""

    def __post_init__(self) -> None:
        if not _is_int(self.step) or self.step < 0:
            raise ValueError(f"step must be an int >= 0, got {self.step!r}")
        ranks = tuple(self.ranks)
        if not ranks or not all(_is_int(r) and r >= 0 for r in ranks):
            raise ValueError(f"ranks must be a non-empty list of ints >= 0, got {list(ranks)}")
        if any(a >= b for a, b in zip(ranks, ranks[1:], strict=False)):
            raise ValueError(f"ranks must be distinct and ascending, got {list(ranks)}")
        lens = tuple(self.seq_lens)
        if not lens or not all(_is_int(x) and x >= 1 for x in lens):
            raise ValueError(f"seq_lens must be a non-empty list of ints >= 1, got {list(lens)}")
        check_choice(self.recompute, ALL_RECOMPUTE_LEVELS, "recompute")
        time_s = self.time_s
        if _is_int(time_s):
            time_s = float(time_s)
        if not isinstance(time_s, float) or not math.isfinite(time_s) or time_s <= 0:
            raise ValueError(f"time_s must be a finite number > 0, got {self.time_s!r}")
        if self.mem_bytes is not None and (not _is_int(self.mem_bytes) or self.mem_bytes < 0):
            raise ValueError(f"mem_bytes must be null or an int >= 0, got {self.mem_bytes!r}")
        if self.recompute_layers is not None and (
            self.recompute != Recompute.FULL
            or not _is_int(self.recompute_layers)
            or self.recompute_layers < 1
        ):
            raise ValueError(
                "recompute_layers must be null or an int >= 1 with recompute 'full', got "
                f"{self.recompute_layers!r} with {self.recompute!r}"
            )
        if not _is_int(self.pipeline_stages) or self.pipeline_stages < 1:
            raise ValueError(f"pipeline_stages must be an int >= 1, got {self.pipeline_stages!r}")
        object.__setattr__(self, "ranks", ranks)
        object.__setattr__(self, "seq_lens", lens)
        object.__setattr__(self, "time_s", time_s)

    @property
    def cp_size(self) -> int:
        """Size of the CP group the micro-step ran on."""
        return len(self.ranks)

    def to_dict(self) -> dict:
        """The JSON object of the contract (``mem_bytes`` is always present, null if unknown;
        ``recompute_layers`` only when set and ``pipeline_stages`` only above 1, so other
        records read as before)."""
        out = {
            "step": self.step,
            "ranks": list(self.ranks),
            "seq_lens": list(self.seq_lens),
            "recompute": self.recompute,
            "time_s": self.time_s,
            "mem_bytes": self.mem_bytes,
        }
        if self.recompute_layers is not None:
            out["recompute_layers"] = self.recompute_layers
        if self.pipeline_stages > 1:
            out["pipeline_stages"] = self.pipeline_stages
        return out

    @classmethod
    def from_dict(cls, data: object) -> MicroStepRecord:
        """Parse one contract object; unknown keys are ignored (the contract only grows).
        Raises ``ValueError`` naming the missing or invalid field."""
        if not isinstance(data, dict):
            raise ValueError(
                f"a micro-step record must be a JSON object, got {type(data).__name__}"
            )
        missing = [key for key in _REQUIRED if key not in data]
        if missing:
            raise ValueError(f"micro-step record is missing {missing}")
        for key in ("ranks", "seq_lens"):
            if not isinstance(data[key], list):
                raise ValueError(f"{key} must be a list of ints, got {data[key]!r}")
        return cls(
            step=data["step"],
            ranks=tuple(data["ranks"]),
            seq_lens=tuple(data["seq_lens"]),
            recompute=data["recompute"],
            time_s=data["time_s"],
            mem_bytes=data.get("mem_bytes"),
            recompute_layers=data.get("recompute_layers"),
            pipeline_stages=data.get("pipeline_stages", 1),
        )


MAX_KEPT_VALUES = 1 << 23
"""Values (numbers, strings, list elements: ``dcp.files.check_tree``) of the records one reader
keeps: memory grows with them (about 100 bytes each), not with the file's bytes. A record holds
about 15 plus its ranks and lengths: 8 M values are a 200-step refit window at ~2,000
micro-steps a step."""


def _stream(path: Path) -> Iterator[tuple[int, str, dict, MicroStepRecord]]:
    """``(1-based line, its text, its JSON object, record)`` of every record of ``path``, one line
    in memory at a time (each at most ``dcp.files.MAX_LINE_BYTES``). Blank lines are skipped; a
    truncated last line (what a crash or a full disk leaves: every complete line ends with a
    newline) is skipped with a warning; any other malformed record raises ``ValueError`` naming
    the file and its line."""
    for number, line in iter_lines(path, what="micro-step records file"):
        if not line.strip():
            continue
        try:
            data = parse_json(line, source="the line")
            record = MicroStepRecord.from_dict(data)
        except SHAPE_ERRORS as exc:
            if not line.endswith("\n"):
                logger.warning("%s:%d: skipping truncated last line (%s)", path, number, exc)
                continue
            raise ValueError(f"{path} line {number}: {' '.join(str(exc).split())}") from None
        yield number, line, data, record


class _Kept:
    """Records a reader keeps from ``path``, refused in one line once their values
    (``check_tree``: what keeping them costs) pass ``max_values``."""

    def __init__(self, path: Path, max_values: int | None) -> None:
        self.path = path
        self.max_values = MAX_KEPT_VALUES if max_values is None else max_values
        self.records: list[MicroStepRecord] = []
        self.values = 0

    def add(self, number: int, data: dict, record: MicroStepRecord) -> None:
        self.values += check_tree(data, source=self.path)
        if self.values > self.max_values:
            raise FileContentError(
                f"{self.path}: the records kept hold more than {self.max_values:,} values by "
                f"line {number:,}, more than a reader keeps; keep fewer steps "
                "(planning.refit_window_steps) or split the file by steps"
            )
        self.records.append(record)


def read_records(
    path: str | Path, *, since_step: int = 0, max_values: int | None = None
) -> list[MicroStepRecord]:
    """The records of steps ``since_step`` and later, in file order, streamed (``_stream``: a
    bound per line, a truncated last line skipped, a malformed one refused naming its line);
    more than ``max_values`` values kept (default ``MAX_KEPT_VALUES``) is refused naming the
    file."""
    path = Path(path)
    kept = _Kept(path, max_values)
    for number, _, data, record in _stream(path):
        if record.step >= since_step:
            kept.add(number, data, record)
    return kept.records


def truncate_records(
    path: str | Path, *, last_step: int, since_step: int, max_values: int | None = None
) -> list[MicroStepRecord]:
    """Rewrite ``path`` to hold only its records of steps up to ``last_step`` (a resumed run
    redoes the later ones; blank lines and a truncated last line go too), streamed through a
    temporary sibling that replaces it whole (``dcp.files.publish``); returns those of steps
    ``since_step`` and later, as ``read_records`` keeps them."""
    path = Path(path)
    kept = _Kept(path, max_values)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("w") as out:
            for number, line, data, record in _stream(path):
                if record.step > last_step:
                    continue
                out.write(line)  # a complete line: it ends with its newline
                if record.step >= since_step:
                    kept.add(number, data, record)
        publish(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return kept.records


def _line(record: MicroStepRecord) -> str:
    return json.dumps(record.to_dict(), separators=(",", ":")) + "\n"


def append_records(path: str | Path, records: Iterable[MicroStepRecord]) -> None:
    """Append ``records`` as JSON lines: one write and one flush per call, so a call's lines land
    together rather than line by line (parent directories are created)."""
    text = "".join(_line(r) for r in records)
    if not text:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        handle.write(text)
        handle.flush()
