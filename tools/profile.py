"""Measure this machine and write a calibrated cost-model spec (``dcp/cost_model.py``).

    python -m tools.profile                          # measure, fit, print the spec JSON
    python -m tools.profile --write-preset           # ... and update dcp/profiles/cpu-tiny.json
    python -m tools.profile --out spec.json --measurements-out runs/profile/m.json
    python -m tools.profile --from-measurements runs/profile/m.json --write-preset   # re-fit only

Launches 2 gloo ranks (``torch.multiprocessing.spawn``), builds the model of ``--config``'s
``model`` section with ``Runtime.from_config`` and runs micro-steps through the real runtime
(``Runtime.forward_backward`` → ``run_plan``) over a grid: single documents and packs of short
documents, CP size 1 and 2, recompute none/selective/full. CP=1 points run on both ranks at once
(as in training) and pool both ranks' samples; a CP=2 step's time is the slower rank's. Each point:
``--warmup`` untimed steps, then ``--samples`` timed ones (CP=1: half on each rank); the median
is kept. Points run cheapest first; a point whose predicted cost no longer fits in ``--budget-s``
is skipped (and listed). The default grid takes about 4 minutes on 2 cores; it reaches 8K-token
documents because attention's L² term dominates long ones and should not be extrapolated.

Memory: peak bytes of live saved activations over one micro-step's forward + backward, per
recompute level (parameters excluded), and static bytes (parameters + gradient buffers +
optimizer state, after one real optimizer step). ``dcp.calibrate`` fits the coefficients; the
fit report (measured vs predicted per point, median and max |error|) goes to stderr.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

from dcp.calibrate import (
    MemoryPoint,
    TimePoint,
    calibration_block,
    error_summary,
    fit_memory,
    fit_report,
    fit_time,
    format_calibration,
    format_report,
    updated_preset,
)
from dcp.cost_model import PROFILES_DIR, CostModel, load_preset
from dcp.plan import RECOMPUTE_LEVELS
from tools.profile_ranks import Job, rank_main

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "pretrain/configs/tiny_cpu.yaml"
ATTENTION_FILE = REPO / "dcp/attention.py"
DEFAULT_SINGLES = "32,64,128,256,512,1024,2048,4096,8192"
# NxL: N documents of L tokens packed into one micro-step.
DEFAULT_PACKS = "8x32,32x32,16x64,8x128,64x32,16x128,4x512,128x32,8x512"
WORLD_SIZE = 2


# -- command line ------------------------------------------------------------------------------
def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise ValueError(f"values must be >= 1, got {text!r}")
    return values


def parse_shapes(singles: str, packs: str) -> list[tuple[int, ...]]:
    """``"32,64"`` and ``"8x32"`` → ``[(32,), (64,), (32,) * 8]``."""
    shapes = [(n,) for n in _int_list(singles)]
    for item in (x.strip() for x in packs.split(",") if x.strip()):
        count, sep, length = item.partition("x")
        if not sep:
            raise ValueError(f"--packs entries look like 16x128 (count x length), got {item!r}")
        (n,), (length_tokens,) = _int_list(count), _int_list(length)
        shapes.append((length_tokens,) * n)
    return shapes


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="YAML with a model section")
    p.add_argument("--spec", default=None, help="base spec: preset name or JSON (cpu-tiny)")
    p.add_argument("--out", default=None, help="write the calibrated spec here (default stdout)")
    p.add_argument("--write-preset", action="store_true", help="update dcp/profiles/<spec>.json")
    p.add_argument("--singles", default=DEFAULT_SINGLES, help="single-document lengths")
    p.add_argument("--packs", default=DEFAULT_PACKS, help="packs, NxL: N documents of L tokens")
    p.add_argument("--cp", default="1,2", help="CP sizes to measure (1 and/or 2)")
    p.add_argument("--recompute", default=",".join(RECOMPUTE_LEVELS), help="levels to measure")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per point")
    p.add_argument("--samples", type=int, default=6, help="timed micro-steps per point")
    p.add_argument("--budget-s", type=float, default=330.0, help="seconds for the timing grid")
    p.add_argument("--memory-ref-len", type=int, default=None, help="default: model.max_seq_len")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--measurements-out", default=None, help="save the raw measurements (JSON)")
    p.add_argument("--from-measurements", default=None, help="re-fit saved measurements only")
    return p


def _read_model_sections(config: str) -> tuple[dict, dict]:
    from dcp.config import load_yaml

    data = load_yaml(config)
    if not isinstance(data.get("model"), dict):
        raise ValueError(f"{config} has no model section")
    return data["model"], data.get("optim") or {}


def _base_spec(name_or_path: str) -> dict:
    path = Path(name_or_path)
    if path.is_file():
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"cannot read spec {path}: {exc}") from exc
    return load_preset(name_or_path)


def _check_same_model(spec: dict, model: dict, config: str) -> None:
    diff = {k: (v, model.get(k)) for k, v in spec["model"].items() if model.get(k) != v}
    if diff:
        raise ValueError(
            f"the spec's model differs from {config}'s model section (spec, config): {diff}; "
            "calibrate a spec that describes the model you measure"
        )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    start = time.perf_counter()
    try:
        if args.from_measurements:
            measurements = _load_measurements(args.from_measurements)
        else:
            measurements = measure(args)
        spec_name = args.spec or measurements.get("spec") or "cpu-tiny"
        base = _base_spec(spec_name)
        if "model" in measurements:
            _check_same_model(base, measurements["model"], measurements.get("config", "?"))
        try:
            spec, rows = calibrated_spec(base, measurements)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed measurements: {exc!r}") from exc
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # a rank failed
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(format_report(rows), file=sys.stderr)
    print(format_calibration(spec["calibration"]), file=sys.stderr)
    text = json.dumps(spec, indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    elif not args.write_preset:
        print(text)
    if args.write_preset:
        path = _write_preset(spec_name, spec)
        print(f"updated {path}", file=sys.stderr)
    print(f"tools.profile took {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return 0


# -- fitting -----------------------------------------------------------------------------------
def _load_measurements(path: str) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"cannot read measurements {path}: {exc}") from exc
    if not isinstance(data, dict) or not data.get("time_points"):
        raise ValueError(f"{path} holds no time_points (write it with --measurements-out)")
    return data


def calibrated_spec(base: dict, measurements: dict) -> tuple[dict, list]:
    """(base spec with a measured calibration block and description, fit report rows)."""
    analytic_spec = {k: v for k, v in base.items() if k != "calibration"}
    analytic = CostModel.from_spec(analytic_spec).coefficients
    points = [TimePoint.from_dict(p) for p in measurements["time_points"]]
    time_fit = fit_time(
        points, logits_per_linear=analytic.logits_s_per_token / analytic.linear_s_per_token
    )
    memory_fit = None
    if measurements.get("memory_points"):
        memory_fit = fit_memory(
            [MemoryPoint.from_dict(p) for p in measurements["memory_points"]],
            ref_len=int(measurements["memory_ref_len"]),
        )
    block = calibration_block(
        time_fit,
        memory_fit,
        cp_bytes_per_token=analytic.cp_bytes_per_token,
        static_mem_bytes=measurements.get("static_mem_bytes"),
    )
    spec = {**analytic_spec, "calibration": block}
    rows = fit_report(CostModel.from_spec(spec), points)
    median, worst = error_summary(rows)
    base_text = str(base.get("description", "")).split(" Analytic placeholder")[0]
    base_text = base_text.split(" Calibrated by tools/profile")[0]
    spec["description"] = (
        f"{base_text} Calibrated by tools/profile on {measurements.get('date', '?')} "
        f"({measurements.get('host', '?')}, {len(points)} points, median |error| {median:.0%}, "
        f"max {worst:.0%}; dcp/attention.py sha256 {measurements.get('attention_sha256', '?')}). "
        "Re-run `python -m tools.profile --write-preset` after changing the model or attention."
    ).strip()
    if memory_fit is not None:
        _print_memory(memory_fit, measurements)
    return spec, rows


def _print_memory(fit, measurements: dict) -> None:
    print(
        f"memory (CP=1, saved activations, ref_len {fit.ref_len}): logits "
        f"{fit.logits_bytes_per_token:.0f} B/token",
        file=sys.stderr,
    )
    for lv in RECOMPUTE_LEVELS:
        print(
            f"  {lv:>9}: {fit.const_bytes[lv] / 1e6:.2f} MB + {fit.per_token_bytes[lv]:.0f} B/token"
            f" + {fit.per_token2_bytes[lv]:.2f} B/token²",
            file=sys.stderr,
        )
    for rank, rss in enumerate(measurements.get("rss", [])):
        print(
            f"  rank {rank} RSS: {rss['after_build_bytes'] / 1e9:.2f} GB after build, peak "
            f"{rss['peak_bytes'] / 1e9:.2f} GB",
            file=sys.stderr,
        )


def _write_preset(spec_name: str, spec: dict) -> Path:
    path = PROFILES_DIR / f"{spec_name}.json"
    if "+" in spec_name or not path.is_file():
        raise ValueError(
            f"--write-preset needs a single preset name from dcp/profiles, got {spec_name!r}"
        )
    raw = json.loads(path.read_text())
    written = updated_preset(raw, spec["calibration"], description=spec["description"])
    path.write_text(json.dumps(written, indent=2) + "\n")
    return path


# -- measuring ---------------------------------------------------------------------------------
def measure(args) -> dict:
    """Spawn the ranks, run the grid, return the measurements (also saved if asked)."""
    import torch.multiprocessing as mp

    from dcp.model import ModelConfig

    model, optim = _read_model_sections(args.config)
    spec_name = args.spec or "cpu-tiny"
    spec = _base_spec(spec_name)
    _check_same_model(spec, model, args.config)
    shapes = parse_shapes(args.singles, args.packs)
    cp_sizes = tuple(sorted(set(_int_list(args.cp))))
    if not set(cp_sizes) <= {1, WORLD_SIZE}:
        raise ValueError(f"--cp sizes must be 1 or {WORLD_SIZE}, got {args.cp}")
    levels = tuple(x.strip() for x in args.recompute.split(",") if x.strip())
    if not levels or set(levels) - set(RECOMPUTE_LEVELS):
        raise ValueError(
            f"--recompute must list levels from {RECOMPUTE_LEVELS}, got {args.recompute}"
        )
    if args.warmup < 0 or args.samples < 1 or args.budget_s <= 0:
        raise ValueError("--warmup must be >= 0, --samples >= 1 and --budget-s > 0")
    ref_len = args.memory_ref_len or ModelConfig(**model).max_seq_len
    attention_bytes = ATTENTION_FILE.read_bytes()
    with tempfile.TemporaryDirectory(prefix="dcp_profile_") as tmp:
        job = Job(
            model={**model, "max_seq_len": max(model.get("max_seq_len", 1), *map(max, shapes))},
            optim=optim,
            shapes=tuple(shapes),
            cp_sizes=cp_sizes,
            levels=levels,
            warmup=args.warmup,
            samples=args.samples,
            budget_s=args.budget_s,
            spec={k: v for k, v in spec.items() if k != "name"},
            seed=args.seed,
            result_path=os.path.join(tmp, "result.json"),
            store_path=os.path.join(tmp, "store"),
        )
        os.environ["OMP_NUM_THREADS"] = "1"  # one core per rank; inherited by the ranks
        try:
            mp.spawn(rank_main, args=(WORLD_SIZE, job), nprocs=WORLD_SIZE, join=True)
        except Exception as exc:  # noqa: BLE001 - the rank's traceback is in the message
            raise RuntimeError(f"profiling ranks failed:\n{exc}") from exc
        result = json.loads(Path(job.result_path).read_text())
    result.update(
        spec=spec_name,
        config=str(args.config),
        model=model,
        memory_ref_len=ref_len,
        date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        host=f"{socket.gethostname()}, {os.cpu_count()} CPUs",
        attention_sha256=hashlib.sha256(attention_bytes).hexdigest()[:12],
        attention_changed_during_run=ATTENTION_FILE.read_bytes() != attention_bytes,
    )
    if result["attention_changed_during_run"]:
        print("warning: dcp/attention.py changed during the run; re-run", file=sys.stderr)
    if args.measurements_out:
        Path(args.measurements_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.measurements_out).write_text(json.dumps(result, indent=1) + "\n")
    skipped = result.get("skipped", [])
    if skipped:
        print(
            f"skipped {len(skipped)} points over the budget: "
            + ", ".join(f"{s['shape']} cp{s['cp_size']} {s['recompute']}" for s in skipped[:12])
            + (" ..." if len(skipped) > 12 else ""),
            file=sys.stderr,
        )
    return result


if __name__ == "__main__":
    raise SystemExit(main())
