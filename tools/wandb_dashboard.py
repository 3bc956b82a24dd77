"""Build a W&B workspace (and optionally a report) for a group of DCP runs.

    python -m tools.wandb_dashboard runs/bench-dcp runs/bench-static-cp1-none ...
    python -m tools.wandb_dashboard runs/megatron-lm/static.jsonl runs/megatron-lm/dcp.jsonl
    python -m tools.wandb_dashboard --group bench [--project dcp]
    python -m tools.wandb_dashboard RUN_DIRS... --online [--entity ENTITY] [--report]
    python -m tools.wandb_dashboard --publish runs/wandb_workspace.json [--entity ENTITY] [--report]

Sections: loss against step and wall-clock time; tokens/s, MFU and the host's load average; step
time predicted against measured and the cost model's calibration version; the plan (sequences
per CP degree, share of tokens recomputed, micro-steps per rank, imbalance); memory; padding.
A run is a DCP run directory or a Megatron-loop run's ``--dcp-metrics`` file (named after its
stem). Runs are grouped and coloured by planner in W&B. The project and group come from the
runs' resolved config (``runs/<name>/config.yaml``). Offline (the default) nothing touches the
network: the workspace is written as JSON beside the runs (``<runs dir>/wandb_workspace.json``,
or ``--out``) with the commands that publish it once the offline runs are synced, and next to
it a local preview (``wandb_workspace.preview.html`` and ``.png``): the same panels drawn from
the runs' metrics files, each run in its own colour and named with the configuration it ran,
to look at before publishing. ``--online`` saves it to W&B (needs an API key: ``wandb login``)
and prints its URL. See docs/operations.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from dcp import console
from dcp.files import load_json, reading
from dcp.observability.metrics import MetricsConfig


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tools.wandb_dashboard",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "runs", nargs="*", help="run directories (runs/<name>) or --dcp-metrics files"
    )
    parser.add_argument("--group", help="W&B group (default: the runs' own, if they share one)")
    parser.add_argument("--project", help="W&B project (default: the runs' metrics.wandb_project)")
    parser.add_argument("--entity", help="W&B entity (default online: your API key's default)")
    parser.add_argument("--name", help="workspace name (default: 'DCP: <group>')")
    parser.add_argument("--out", help="offline JSON (default: <runs dir>/wandb_workspace.json)")
    parser.add_argument("--online", action="store_true", help="save to W&B and print the URL")
    parser.add_argument("--publish", metavar="JSON", help="save a workspace written offline")
    parser.add_argument("--report", action="store_true", help="also save a report (online)")
    args = parser.parse_args(argv)
    if args.publish and (args.runs or args.group):
        parser.error("--publish takes the JSON file only, not runs or --group")
    if not args.publish and not args.runs and not args.group:
        parser.error("give run directories, --group, or --publish")
    return args


def _default_entity(entity: str | None) -> str:
    """``entity`` or the W&B API key's default entity (network)."""
    if entity:
        return entity
    import wandb

    found = wandb.Api().default_entity
    if not found:
        raise ValueError("no W&B entity: pass --entity (or run `wandb login`)")
    return found


def _save(workspace, *, report: bool) -> None:
    """Save ``workspace`` (and its report) to W&B and print where."""
    from dcp.observability.dashboard import build_report

    workspace.save()
    print(f"workspace: {workspace.url}")
    if report:
        saved = build_report(workspace).save()
        print(f"report: {saved.url}")


def _sync_command(runs) -> str:
    """The ``wandb sync`` command for the runs' offline W&B directories."""
    paths = [f"{r.offline_runs[-1].parent}/offline-run-*" for r in runs if r.offline_runs]
    return f"wandb sync {' '.join(paths)}" if paths else ""


def run(args: argparse.Namespace) -> int:
    from dcp.observability.dashboard import (
        WORKSPACE_FILENAME,
        build_workspace,
        default_output,
        read_run,
        workspace_from_json,
        workspace_to_json,
    )
    from dcp.observability.preview import write_preview

    if args.publish:
        data = load_json(args.publish, what="workspace JSON (tools.wandb_dashboard --out)")
        if not isinstance(data, dict) or not isinstance(data.get("entity"), str | None):
            raise ValueError(f"{args.publish}: not a workspace JSON (tools.wandb_dashboard --out)")
        entity = _default_entity(args.entity or data.get("entity"))
        with reading(args.publish, "workspace JSON"):
            workspace = workspace_from_json(data, entity=entity)
        _save(workspace, report=args.report)
        return 0
    runs = [read_run(path) for path in args.runs]
    projects = {r.project for r in runs}
    if not args.project and len(projects) > 1:
        raise ValueError(f"the runs log to several W&B projects {sorted(projects)}: pick --project")
    project = args.project or (projects.pop() if projects else MetricsConfig().wandb_project)
    entity = _default_entity(args.entity) if args.online else (args.entity or "")
    workspace, missing = build_workspace(
        runs, entity=entity, project=project, group=args.group, name=args.name
    )
    panels = sum(len(s.panels) for s in workspace.sections)
    for line in missing:
        print(f"not shown: {line}")
    if args.online:
        _save(workspace, report=args.report)
        return 0
    if args.out:
        out = Path(args.out)
    else:
        out = default_output(runs) if runs else Path(WORKSPACE_FILENAME)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(workspace_to_json(workspace), indent=1) + "\n", encoding="utf-8")
    print(f"wrote {out}: {len(workspace.sections)} sections, {panels} panels, {len(runs)} runs")
    files = [r for r in runs if r.path.is_file()]
    for r in files:
        print(
            f"note: {r.path} is a metrics file (a Megatron-loop run's --dcp-metrics): its W&B run "
            f"is Megatron's own, under --wandb-save-dir; sync it, and the workspace charts it if "
            f"its --wandb-exp-name is {r.name}"
        )
    silent = [str(r.path) for r in runs if not r.offline_runs and r not in files]
    if silent:
        print(
            f"note: no offline W&B run in {', '.join(silent)} (metrics.wandb_mode=disabled?): "
            "the workspace charts W&B runs only"
        )
    sync = _sync_command(runs)
    entity_arg = "" if entity else " --entity <your W&B entity>"
    report_arg = " --report" if args.report else ""
    publish = [
        *([sync] if sync else []),
        f"python -m tools.wandb_dashboard --publish {out}{entity_arg}{report_arg}",
    ]
    if runs:
        # Drawn from the file just written, so the preview shows what --publish will send.
        saved = workspace_from_json(json.loads(out.read_text(encoding="utf-8")))
        png, page = write_preview(
            saved, runs, workspace_json=out, left_out=missing, publish=publish
        )
        print(f"preview: {page} (and {png.name}): the panels drawn from the runs' metrics files")
    print("to publish it:")
    for command in publish:
        print(f"  {command}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    console.setup()
    args = parse_args(argv)
    try:
        return run(args)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - W&B API and network failures: one line, not a trace
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
