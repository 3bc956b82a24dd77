"""Per-step metrics: ``runs/<name>/metrics.jsonl`` always, W&B and a progress bar on rank 0.

Record format (one JSON object per line, one line per optimizer step)
    ``{"step": 12, "loss": 3.21, "tokens": 8192, "step_time_s": 0.41, "tokens_per_s": 19980.5,
    ...}``. ``step`` counts optimizer steps completed, including this one (the first step is 1),
    so a checkpoint taken after step k resumes at ``start_step=k``. Nested dicts in a record are
    flattened with ``"/"`` (``{"plan": {"cp_hist": {"2": 5}}}`` -> ``"plan/cp_hist/2": 5``), so
    the JSONL file and W&B carry the same key names; lists are kept as JSON lists in the file
    and expanded to ``key/<index>`` for W&B, which cannot chart lists.

Non-finite numbers
    JSON has no NaN/Infinity. A non-finite float is written as ``null`` and its key is listed in
    ``"nonfinite": {"loss": "nan", "plan/x/3": "inf"}`` (list elements as ``key/<index>``), so
    every line is strict JSON and ``read_metrics`` restores the original ``float("nan")`` etc.
    W&B receives the original non-finite floats (it charts them as gaps).

Keys the trainer logs (compare_runs understands these names)
    ``loss``, ``tokens``, ``step_time_s``, ``tokens_per_s``, ``predicted_step_time_s``,
    ``prediction_error``, ``calibration_version``, ``mfu``, ``lr``, ``grad_norm``,
    ``peak_mem_bytes`` and plan stats under ``plan/``:
    ``plan/cp_hist/<degree>`` (sequences per CP degree), ``plan/recompute_fraction``,
    ``plan/micro_steps_per_rank`` (list), ``plan/predicted_imbalance``.

W&B runs offline by default (files under ``<wandb_dir>/wandb/offline-run-*``, upload later with
``wandb sync``); ``wandb_mode: disabled`` turns it off, and a failed ``import wandb`` or
``wandb.init`` logs a warning and the run continues with JSONL only.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from dcp.files import check_tree, iter_lines, parse_json, write_atomic
from dcp.observability.run_info import to_plain
from dcp.schema import check_range

logger = logging.getLogger(__name__)

METRICS_FILENAME = "metrics.jsonl"
NONFINITE_KEY = "nonfinite"
MAX_LINE_BYTES = 1 << 20
"""Longest metrics line read back: a record holds per-rank values (optimizer state, micro-step
counts), about 50 bytes a rank, so 1 MiB holds 20,000 ranks."""
MAX_FILE_VALUES = 1 << 23
"""Values (numbers, strings, list elements) one metrics file may hold for a reader: what a
report keeps in memory grows with them (about 100 bytes each), not with the file's bytes.
8 M values: 200,000 steps of 40 scalars, or 4,000 steps of a 1,000-rank run's per-rank lists."""
WANDB_MODES = ("offline", "online", "disabled")


@dataclasses.dataclass(kw_only=True, frozen=True)
class MetricsConfig:
    """Where and how per-step metrics are reported (JSONL is always written on rank 0)."""

    wandb_mode: str = "offline"
    """"offline" (default: local files, no network), "online", or "disabled" (no W&B at all)."""
    wandb_project: str = "dcp"
    """W&B project name."""
    wandb_group: str | None = None
    """W&B group; give DCP/static/Megatron runs of one comparison the same group to overlay."""
    wandb_run_name: str | None = None
    """W&B run name; defaults to the run directory's name."""
    wandb_tags: tuple[str, ...] = ()
    """W&B tags (e.g. the planner name)."""
    wandb_dir: str | None = None
    """Directory W&B writes into (it adds ``wandb/``); defaults to the run directory."""
    progress_bar: bool = True
    """Show a tqdm progress bar on rank 0; when off, a log line every ``log_interval_steps``."""
    log_interval_steps: int = 1
    """Steps between W&B logs and progress-bar/log-line updates (>= 1; JSONL gets every
    step)."""

    def __post_init__(self) -> None:
        if self.wandb_mode not in WANDB_MODES:
            raise ValueError(
                f"metrics.wandb_mode must be one of {', '.join(WANDB_MODES)}; "
                f"got {self.wandb_mode!r}"
            )
        if not isinstance(self.wandb_project, str) or not self.wandb_project:
            raise ValueError(
                f"metrics.wandb_project must be a non-empty string, got {self.wandb_project!r}"
            )
        for name in ("wandb_group", "wandb_run_name", "wandb_dir"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(
                    f"metrics.{name} must be a non-empty string or null, got {value!r}"
                )
        if isinstance(self.wandb_tags, str) or not all(
            isinstance(t, str) and t for t in self.wandb_tags
        ):
            raise ValueError(
                f"metrics.wandb_tags must be a list of non-empty strings, got {self.wandb_tags!r}"
            )
        # YAML gives lists; keep the frozen config hashable.
        object.__setattr__(self, "wandb_tags", tuple(self.wandb_tags))
        if not isinstance(self.progress_bar, bool):
            raise ValueError(
                f"metrics.progress_bar must be true or false, got {self.progress_bar!r}"
            )
        check_range(self.log_interval_steps, "metrics.log_interval_steps", ge=1, integer=True)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> MetricsConfig:
        """Build from a YAML section; an unknown key raises ``ValueError`` naming it."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"unknown key(s) in metrics config: {', '.join(unknown)}; "
                f"allowed: {', '.join(sorted(known))}"
            )
        return cls(**values)


def flatten(record: Mapping[str, Any], *, sep: str = "/", expand_lists: bool = False) -> dict:
    """Nested dicts to one level with ``sep``-joined keys; lists too if ``expand_lists``."""
    flat: dict[str, Any] = {}

    def visit(prefix: str, value: Any) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                visit(f"{prefix}{sep}{k}" if prefix else str(k), v)
        elif expand_lists and isinstance(value, list | tuple):
            for i, v in enumerate(value):
                visit(f"{prefix}{sep}{i}", v)
        else:
            if prefix in flat:
                raise ValueError(f"metrics key {prefix!r} appears twice after flattening")
            flat[prefix] = value

    visit("", record)
    return flat


def _nonfinite_name(x: float) -> str:
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def encode_record(step: int, record: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """``(json_line, flat_record)`` for one step; see the module docstring for the format."""
    if NONFINITE_KEY in record:
        raise ValueError(f"metrics key {NONFINITE_KEY!r} is reserved for non-finite markers")
    flat = {k: to_plain(v) for k, v in flatten(record).items()}
    if "step" in flat and flat["step"] != step:
        raise ValueError(f"record has step={flat['step']!r} but was logged as step {step}")
    flat = {"step": int(step), **{k: v for k, v in flat.items() if k != "step"}}
    nonfinite: dict[str, str] = {}

    def scrub(key: str, value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            nonfinite[key] = _nonfinite_name(value)
            return None
        if isinstance(value, list):
            return [scrub(f"{key}/{i}", v) for i, v in enumerate(value)]
        if isinstance(value, dict):  # a dict inside a list: flatten() leaves it nested
            return {k: scrub(f"{key}/{k}", v) for k, v in value.items()}
        return value

    line_obj = {k: scrub(k, v) for k, v in flat.items()}
    if nonfinite:
        line_obj[NONFINITE_KEY] = nonfinite
    return json.dumps(line_obj, allow_nan=False, separators=(",", ":")), flat


def _restore_nonfinite(obj: dict[str, Any]) -> None:
    markers = obj.pop(NONFINITE_KEY, None) or {}
    for key, name in markers.items():
        value = float(name)
        if key in obj:
            obj[key] = value
            continue
        # A list element: walk "key/i/j" back from the right to the longest existing key.
        parts = key.split("/")
        for cut in range(len(parts) - 1, 0, -1):
            head = "/".join(parts[:cut])
            if head in obj:
                container: Any = obj[head]
                for p in parts[cut:-1]:
                    container = container[int(p)] if isinstance(container, list) else container[p]
                last = parts[-1]
                container[int(last) if isinstance(container, list) else last] = value
                break


def iter_metrics(
    path: str | os.PathLike[str],
    *,
    restore_nonfinite: bool = True,
    max_values: int | None = None,
) -> Iterator[dict]:
    """The records of a ``metrics.jsonl`` (or of the run directory holding one), in file order,
    one at a time: memory holds one line (at most ``MAX_LINE_BYTES``), and a file whose records
    together hold more than ``max_values`` values (default ``MAX_FILE_VALUES``) is refused
    naming it, so a reader that keeps them keeps a bounded amount.

    A truncated last line (a run killed mid-write) is skipped with a warning; a malformed line
    anywhere else raises ``ValueError`` naming the file and line. With ``restore_nonfinite``
    the ``nonfinite`` markers are turned back into ``float("nan")``/``float("inf")`` values.
    """
    file = Path(path)
    if file.is_dir():
        file = file / METRICS_FILENAME
    if not file.is_file():
        raise FileNotFoundError(f"no metrics file at {file}")
    max_values = MAX_FILE_VALUES if max_values is None else max_values
    total = 0
    for lineno, line in iter_lines(file, what="metrics file", max_line_bytes=MAX_LINE_BYTES):
        if not line.strip():
            continue
        try:
            obj = parse_json(line, source="the line")
            if not isinstance(obj, dict):
                raise ValueError("not a JSON object")
        except ValueError as exc:
            # Every complete line ends with a newline; only the last piece can lack one.
            if not line.endswith("\n"):
                logger.warning("%s:%d: skipping truncated last line (%s)", file, lineno, exc)
                continue
            message = " ".join(str(exc).split())
            raise ValueError(f"{file}:{lineno}: malformed metrics line: {message}") from None
        total += check_tree(obj, source=file)
        if total > max_values:
            raise ValueError(
                f"{file}: its records hold more than {max_values:,} values by line {lineno:,}, "
                "more than a metrics reader keeps for one run; split the file by steps"
            )
        if restore_nonfinite:
            _restore_nonfinite(obj)
        yield obj


def read_metrics(path: str | os.PathLike[str], *, restore_nonfinite: bool = True) -> list[dict]:
    """Every record of ``iter_metrics``, as a list (the file's values budget bounds it)."""
    return list(iter_metrics(path, restore_nonfinite=restore_nonfinite))


class MetricsLogger:
    """Writes each step's record to JSONL, W&B and the progress bar; rank 0 only.

    Every other rank gets a logger whose methods do nothing, so the trainer calls it
    unconditionally. Use as a context manager or call ``close()``; W&B is finished with a
    non-zero exit code when the ``with`` block raised.

    ``start_step`` is the number of steps already completed (0 for a fresh run, the checkpoint's
    step on resume). A fresh run truncates ``metrics.jsonl``; a resumed one keeps the records up
    to ``start_step`` and drops later ones, which the crashed run logged after its last
    checkpoint and which this run will produce again. With ``wandb_id`` (the id a checkpoint
    recorded, ``wandb_id`` property of the earlier logger) the W&B run of the earlier attempt
    continues instead of a new one starting.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        config: MetricsConfig,
        *,
        rank: int,
        total_steps: int,
        run_config: Mapping[str, Any],
        start_step: int = 0,
        wandb_id: str | None = None,
    ) -> None:
        if total_steps < 0 or start_step < 0:
            raise ValueError(
                f"total_steps and start_step must be >= 0, got {total_steps} and {start_step}"
            )
        self.run_dir = Path(run_dir)
        self.config = config
        self.rank = rank
        self.total_steps = total_steps
        self.metrics_path = self.run_dir / METRICS_FILENAME
        self._file = None
        self._bar = None
        self._wandb_run = None
        self._closed = False
        if rank != 0:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._open_jsonl(start_step)
        if config.wandb_mode != "disabled":
            self._wandb_run = self._init_wandb(run_config, wandb_id)
        if config.progress_bar:
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=total_steps or None,
                initial=start_step,
                desc=self.run_dir.name,
                unit="step",
                dynamic_ncols=True,
            )

    @property
    def wandb_id(self) -> str | None:
        """The W&B run's id (rank 0, while W&B is on): what a checkpoint records."""
        return getattr(self._wandb_run, "id", None)

    def note(self, text: str) -> None:
        """Print a line on rank 0 without breaking the progress bar."""
        if self.rank != 0:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            logger.info("%s", text)

    @property
    def wandb_active(self) -> bool:
        """Whether records currently go to W&B."""
        return self._wandb_run is not None

    def _open_jsonl(self, start_step: int) -> None:
        if start_step > 0 and self.metrics_path.exists():
            lines = iter_lines(
                self.metrics_path, what="metrics file", max_line_bytes=MAX_LINE_BYTES
            )
            kept = [
                ln.rstrip("\n")
                for _, ln in lines
                if (st := _line_step(ln)) is not None and st <= start_step
            ]
            write_atomic(self.metrics_path, "".join(f"{line}\n" for line in kept))
            self._file = open(self.metrics_path, "a", encoding="utf-8")
        else:
            self._file = open(self.metrics_path, "w", encoding="utf-8")

    def _init_wandb(self, run_config: Mapping[str, Any], wandb_id: str | None) -> Any:
        try:
            import wandb
        except Exception as exc:  # noqa: BLE001 - any import failure must not stop training
            logger.warning(
                "W&B logging is OFF for this run: `import wandb` failed (%s: %s). "
                "metrics.jsonl is still written. Install wandb, or set "
                "metrics.wandb_mode: disabled to silence this warning.",
                type(exc).__name__,
                exc,
            )
            return None
        cfg = self.config
        wandb_dir = Path(cfg.wandb_dir) if cfg.wandb_dir else self.run_dir
        wandb_dir.mkdir(parents=True, exist_ok=True)
        try:
            return wandb.init(
                project=cfg.wandb_project,
                group=cfg.wandb_group,
                name=cfg.wandb_run_name or self.run_dir.name,
                tags=list(cfg.wandb_tags),
                dir=str(wandb_dir),
                mode=cfg.wandb_mode,
                config=to_plain(dict(run_config)),
                reinit="create_new",
                # A resumed run continues its W&B run: same id; steps it redoes are not new.
                id=wandb_id,
                resume="allow" if wandb_id else None,
                # console="off": W&B's stdout capture would fight the progress bar.
                settings=wandb.Settings(console="off", silent=True),
            )
        except Exception as exc:  # noqa: BLE001 - a dashboard problem must not stop training
            logger.warning(
                "W&B logging is OFF for this run: wandb.init(mode=%r) failed (%s: %s). "
                "metrics.jsonl is still written. For online mode run `wandb login` first, "
                "or use metrics.wandb_mode: offline.",
                cfg.wandb_mode,
                type(exc).__name__,
                exc,
            )
            return None

    def log(self, step: int, record: Mapping[str, Any]) -> None:
        """Record step ``step`` (1-based count of completed steps); a no-op off rank 0."""
        if self.rank != 0:
            return
        if self._closed:
            raise RuntimeError("MetricsLogger.log() called after close()")
        line, flat = encode_record(step, record)
        self._file.write(line + "\n")
        # Flush per line so a killed run keeps every completed step.
        self._file.flush()
        on_interval = step % self.config.log_interval_steps == 0 or step == self.total_steps
        if self._wandb_run is not None and on_interval:
            self._log_wandb(step, record)
        if self._bar is not None:
            if on_interval:  # before update() so this step's refresh shows it
                self._bar.set_postfix_str(_summary(flat), refresh=False)
            self._bar.update(1)
        elif on_interval:
            logger.info("step %d/%d %s", step, self.total_steps, _summary(flat))

    def _log_wandb(self, step: int, record: Mapping[str, Any]) -> None:
        payload = flatten({k: to_plain(v) for k, v in record.items()}, expand_lists=True)
        payload.pop("step", None)
        try:
            self._wandb_run.log(payload, step=step)
        except Exception as exc:  # noqa: BLE001 - keep training; say once why W&B stopped
            logger.warning("W&B logging stopped at step %d: %s: %s", step, type(exc).__name__, exc)
            self._finish_wandb(exit_code=1)

    def _finish_wandb(self, *, exit_code: int) -> None:
        run, self._wandb_run = self._wandb_run, None
        if run is not None:
            try:
                run.finish(exit_code=exit_code)
            except Exception as exc:  # noqa: BLE001
                logger.warning("W&B finish failed: %s: %s", type(exc).__name__, exc)

    # -- a step observer (dcp.step.observers) --------------------------------------------------
    def contribute(self, step: int, scalars) -> None:
        """Nothing: the record is built from the step's own reduced values."""

    def after_step(self, outcome) -> None:
        """Log the step's record (a ``StepRecord``) and its plan line."""
        record = outcome.record
        self.log(outcome.step, record.to_dict())
        self.note(f"step {outcome.step}: {record.plan.summary()}")

    def close(self, *, exit_code: int = 0) -> None:
        """Flush and close the JSONL file, finish W&B and the progress bar (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        self._finish_wandb(exit_code=exit_code)
        if self._file is not None:
            self._file.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(exit_code=0 if exc_type is None else 1)


def _line_step(line: str) -> int | None:
    try:
        step = parse_json(line, source="the line").get("step")
    except (ValueError, AttributeError):
        return None  # a truncated tail line of the crashed run, or not a record
    return step if isinstance(step, int) else None


def _summary(flat: Mapping[str, Any]) -> str:
    parts = []
    loss = flat.get("loss")
    if isinstance(loss, int | float):
        parts.append(f"loss={loss:.4g}")
    tps = flat.get("tokens_per_s")
    if isinstance(tps, int | float):
        parts.append(f"tok/s={tps:,.0f}" if math.isfinite(tps) else f"tok/s={tps}")
    step_time = flat.get("step_time_s")
    if isinstance(step_time, int | float):
        parts.append(f"step={step_time:.3g}s")
    expert_load = flat.get("expert_load")
    if isinstance(expert_load, int | float):
        parts.append(f"expert_load={expert_load:.3g}")
    return " ".join(parts)
