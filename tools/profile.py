"""Measure this machine and write a calibrated cost-model spec.

    python -m tools.profile                          # measure, fit, print the spec JSON
    python -m tools.profile --write-preset           # ... and update the cpu-tiny preset
    python -m tools.profile --out spec.json --measurements-out runs/profile/m.json
    python -m tools.profile --from-measurements runs/profile/m.json --write-preset   # re-fit only

Runs micro-steps of ``--config``'s model on 2 gloo ranks through the real runtime
(``dcp.bench.measure``: the grid, the memory probes) and fits the cost model to them
(``dcp.costmodel.offline``). With a spec whose ``options.tensor_parallel_size`` is TP > 1
(``--spec cpu-tiny+cpu-tp2``) it runs 2 planner ranks of TP ranks each and also times the TP
collectives on their own, which the fit keeps as the cost model's TP term. Besides the three
recompute levels it times a full recompute of only the first ``--partial-layers`` layers (half
the model's by default); the fit reads those points in the full-recompute columns scaled by N/L,
as the cost model evaluates a partial recompute. The default grid
takes about 4 minutes on 2 cores; it reaches 8K-token documents because attention's L² term
dominates long ones and should not be extrapolated. The fit report (measured vs predicted per
point) goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from dcp import console
from dcp.costmodel import load_spec
from dcp.costmodel.load import write_preset_calibration
from dcp.costmodel.offline import calibrated_spec
from dcp.costmodel.report import format_calibration, format_memory, format_report
from dcp.files import load_json, reading
from dcp.plan import RECOMPUTE_LEVELS
from dcp.schema import load_yaml

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "pretrain/configs/tiny_cpu.yaml"
DEFAULT_SINGLES = "32,64,128,256,512,1024,2048,4096,8192"
# NxL: N documents of L tokens packed into one micro-step.
DEFAULT_PACKS = "8x32,32x32,16x64,8x128,64x32,16x128,4x512,128x32,8x512"


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
    p.add_argument("--write-preset", action="store_true", help="update the --spec preset file")
    p.add_argument("--singles", default=DEFAULT_SINGLES, help="single-document lengths")
    p.add_argument("--packs", default=DEFAULT_PACKS, help="packs, NxL: N documents of L tokens")
    p.add_argument("--cp", default="1,2", help="CP sizes to measure (1 and/or 2)")
    p.add_argument("--recompute", default=",".join(RECOMPUTE_LEVELS), help="levels to measure")
    p.add_argument(
        "--partial-layers",
        type=int,
        default=None,
        help="also time full recompute of only the first N layers (default: half the model's "
        "layers when it has 2 or more; 0: not measured)",
    )
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per point")
    p.add_argument("--samples", type=int, default=6, help="timed micro-steps per point")
    p.add_argument("--budget-s", type=float, default=330.0, help="seconds for the timing grid")
    p.add_argument("--memory-ref-len", type=int, default=None, help="default: model.max_seq_len")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--measurements-out", default=None, help="save the raw measurements (JSON)")
    p.add_argument("--from-measurements", default=None, help="re-fit saved measurements only")
    return p


def _partial_layers(requested: int | None, num_layers: int) -> int | None:
    """``--partial-layers``: the N to time (None: none); by default half the layers."""
    if requested is None:
        return num_layers // 2 if num_layers >= 2 else None
    return requested or None


def _measure(args) -> dict:
    from dcp.bench.measure import measure
    from dcp.model import ModelConfig

    data = load_yaml(args.config)
    if not isinstance(data.get("model"), dict):
        raise ValueError(f"{args.config} has no model section")
    model = data["model"]
    spec_name = args.spec or "cpu-tiny"
    result = measure(
        model=model,
        optim=data.get("optim") or {},
        spec=load_spec(spec_name),
        shapes=parse_shapes(args.singles, args.packs),
        cp_sizes=_int_list(args.cp),
        levels=[x.strip() for x in args.recompute.split(",") if x.strip()],
        warmup=args.warmup,
        samples=args.samples,
        budget_s=args.budget_s,
        memory_ref_len=args.memory_ref_len or ModelConfig(**model).max_seq_len,
        seed=args.seed,
        partial_layers=_partial_layers(args.partial_layers, ModelConfig(**model).num_layers),
    )
    result.update(spec=spec_name, config=str(args.config))
    if result["attention_changed_during_run"]:
        print("warning: dcp/attention changed during the run; re-run", file=sys.stderr)
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


def _load_measurements(path: str) -> dict:
    data = load_json(path, what="measurements file (--measurements-out)")
    if (
        not isinstance(data, dict)
        or not isinstance(data.get("time_points"), list)
        or not data["time_points"]
        or not all(isinstance(point, dict) for point in data["time_points"])
    ):
        raise ValueError(f"{path} holds no time_points (write it with --measurements-out)")
    rss = data.get("rss", [])
    numbers = ("after_build_bytes", "peak_bytes")
    if not isinstance(data.get("spec", ""), str) or not (
        isinstance(rss, list)
        and all(isinstance(r, dict) and all(_is_number(r.get(k)) for k in numbers) for r in rss)
    ):
        raise ValueError(f"{path}: spec must be a preset name and rss a list of byte counts")
    return data


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def main(argv: list[str] | None = None) -> int:
    console.setup()
    args = _parser().parse_args(argv)
    start = time.perf_counter()
    try:
        if args.from_measurements:
            measurements = _load_measurements(args.from_measurements)
        else:
            measurements = _measure(args)
        spec_name = args.spec or measurements.get("spec") or "cpu-tiny"
        base = load_spec(spec_name)
        source = args.from_measurements or "the measurements"
        with reading(source, "measurements file"):  # a file's wrong shapes name the file
            if "model" in measurements:
                from dcp.bench.measure import check_same_model

                check_same_model(base, measurements["model"])
            calibration = calibrated_spec(base, measurements)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # a rank failed
        print(f"error: {exc}", file=sys.stderr)
        return 1
    spec = calibration.spec
    print(format_report(calibration.rows), file=sys.stderr)
    if calibration.memory_fit is not None:
        print(format_memory(calibration.memory_fit), file=sys.stderr)
    for rank, rss in enumerate(measurements.get("rss", [])):
        print(
            f"  rank {rank} RSS: {rss['after_build_bytes'] / 1e9:.2f} GB after build, peak "
            f"{rss['peak_bytes'] / 1e9:.2f} GB",
            file=sys.stderr,
        )
    print(format_calibration(spec["calibration"]), file=sys.stderr)
    text = json.dumps(spec, indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    elif not args.write_preset:
        print(text)
    if args.write_preset:
        try:
            path = write_preset_calibration(
                spec_name, spec["calibration"], description=spec["description"]
            )
        except ValueError as exc:
            print(f"error: --write-preset: {exc}", file=sys.stderr)
            return 2
        print(f"updated {path}", file=sys.stderr)
    print(f"tools.profile took {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
