"""The one way to get a cost model: a preset name, a spec JSON path or a spec dict.

Presets are the JSON files in ``dcp/costmodel/profiles``; ``a+b`` merges several left to right
(``h200x32+llama3-8b``: a cluster and a model). A GPU preset (``h100``, ``h200``, ``b200``: a
datasheet without a GPU count, and the coefficients ``tools.costmodel_check`` chose for that
GPU) is named with its count, ``<gpu>x<N>``. A name ending in ``.json`` or naming an existing
file is a path. With a ``mesh`` (``dcp.mesh.Mesh``: the job's ranks, TP and PP sizes), the spec must
describe that job; without one (a tool planning a spec's own cluster) it is taken as it is.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from dcp.costmodel.formula import CostModel
from dcp.costmodel.spec import (
    ModelSpec,
    Options,
    _build,
    analytic_coefficients,
    monotone_activations,
    parse_spec,
)
from dcp.files import load_json, reading
from dcp.mesh import Mesh
from dcp.plan import RECOMPUTE_LEVELS

PROFILES_DIR = Path(__file__).parent / "profiles"
# ``h200x32``: the GPU preset ``h200`` with 32 GPUs.
_GPU_COUNT = re.compile(r"(?P<gpu>[a-z0-9-]+)x(?P<num_gpus>[1-9][0-9]*)")


def available_presets() -> list[str]:
    """Names of the JSON files in ``dcp/costmodel/profiles`` (combine with ``+``; a GPU preset
    takes its count as ``<gpu>x<N>``)."""
    return sorted(p.stem for p in PROFILES_DIR.glob("*.json"))


def gpu_presets() -> list[str]:
    """The presets that describe one GPU model: a datasheet (``peak_tflops``) without a GPU
    count (``num_gpus``); overlays carry neither."""
    names = []
    for name in available_presets():
        cluster = json.loads((PROFILES_DIR / f"{name}.json").read_text()).get("cluster")
        if isinstance(cluster, dict) and "peak_tflops" in cluster and "num_gpus" not in cluster:
            names.append(name)
    return names


def gpu_preset_of(name: str) -> str | None:
    """The GPU preset a preset name starts with (``h200x8+llama3-8b``: ``h200``), else None."""
    match = _GPU_COUNT.fullmatch(name.split("+")[0].strip())
    return match["gpu"] if match and match["gpu"] in gpu_presets() else None


def _preset_part(part: str, name: str) -> dict:
    """One ``+``-separated part of a preset name, as its JSON object."""
    path = PROFILES_DIR / f"{part}.json"
    if path.is_file():
        return load_json(path, what="cost-model preset")
    match = _GPU_COUNT.fullmatch(part)
    if match and match["gpu"] in gpu_presets():
        data = load_json(PROFILES_DIR / f"{match['gpu']}.json", what="cost-model preset")
        data["cluster"] = {**data["cluster"], "num_gpus": int(match["num_gpus"])}
        return data
    raise ValueError(
        f"unknown preset {part!r} in {name!r}; available: {', '.join(available_presets())} "
        f"(a GPU preset with its count: {', '.join(f'{g}x<N>' for g in gpu_presets())})"
    )


def load_preset(name: str) -> dict:
    """The spec dict of a preset: ``"cpu-tiny"``, ``"<cluster>+<model>"`` or
    ``"<gpu>x<N>+<model>"``.

    Parts are merged left to right (``options`` and ``calibration`` merge key by key, later parts
    win).
    """
    spec: dict = {}
    for part in name.split("+"):
        for key, value in _preset_part(part.strip(), name).items():
            if isinstance(value, dict) and isinstance(spec.get(key), dict):
                spec[key] = {**spec[key], **value}
            else:
                spec[key] = value
    spec.setdefault("name", name)
    return spec


def load_spec(source: str | Path | dict) -> dict:
    """A spec dict from a preset name, a spec JSON path (read and checked under
    ``dcp.files``' rules: any problem is one line naming the file), or a dict (a copy)."""
    if isinstance(source, dict):
        return dict(source)
    path = Path(source)
    if path.suffix == ".json" or path.is_file():
        if not path.is_file():
            raise ValueError(f"no such cost-model spec file: {path}")
        spec = load_json(path, what="cost-model spec")
        if not isinstance(spec, dict):
            raise ValueError(f"cost-model spec {path} must hold a JSON object")
        spec.setdefault("name", path.stem)
        # Checked whole here, so what is built from it later never meets a wrong type.
        with reading(path, "cost-model spec"):
            CostModel.from_spec(spec)
        return spec
    return load_preset(str(source))


# Calibrated terms that hold only at the TP size they were measured at.
_TP_CALIBRATION_KEYS = ("tp_comm_s_per_token", "tp_latency_s")


def with_runtime_options(spec: dict, options: dict) -> tuple[dict, dict]:
    """``spec`` with ``options`` laid over its ``options`` block (``spec.runtime_options``: what
    the training run itself fixes), and the keys whose value this changed, as ``{key: (old,
    new)}``, so callers can say what they overrode. A changed ``tensor_parallel_size`` drops
    the calibration's TP-collective terms (measured at the old size): they are analytic until
    measured again (``tools.profile``, online calibration); the fitted compute terms stay."""
    current = spec.get("options", {})
    merged = {**current, **options}
    # Compare effective values (defaults and derived ones included), not the raw dicts.
    before = _build(Options, current, "options")
    after = _build(Options, merged, "options")
    changed = {
        k: (getattr(before, k), getattr(after, k))
        for k in options
        if getattr(before, k) != getattr(after, k)
    }
    out = {**spec, "options": merged}
    if "tensor_parallel_size" in changed and isinstance(spec.get("calibration"), dict):
        out["calibration"] = {
            k: v for k, v in spec["calibration"].items() if k not in _TP_CALIBRATION_KEYS
        }
    return out, changed


# Calibrated terms that follow the model's shape (absolute per-token seconds and bytes, the
# static memory); the rest (overheads, link speeds, overlap, recompute fractions) describe the
# hardware and the runtime and carry over to another model as measured.
_MODEL_SCALED_KEYS = (
    "linear_s_per_token",
    "attention_s_per_token2",
    "logits_s_per_token",
    "tp_comm_s_per_token",
    "tp_latency_s",
    "cp_bytes_per_token",
    "cp_hop_latency_s",
    "static_mem_bytes",
    "activation_bytes_per_token",
    "logits_bytes_per_token",
)


def with_model(spec: dict, model: ModelSpec) -> tuple[dict, dict]:
    """``spec`` for the run's ``model`` (its ``"model"`` block replaced), and what changed as
    ``{"model.<key>": (old, new)}``. A calibration fitted on the spec's own model keeps its
    hardware terms; its shape-dependent terms (``_MODEL_SCALED_KEYS``) are scaled by the ratio
    of the analytic values for the two models, until measured on this model (online
    calibration, ``tools.profile``). The same model returns ``spec`` unchanged."""
    new_block = {k: v for k, v in dataclasses.asdict(model).items() if v is not None}
    old_block = dict(spec.get("model", {}))
    changed = {
        f"model.{k}": (old_block.get(k), new_block.get(k))
        for k in sorted(set(old_block) | set(new_block))
        if old_block.get(k) != new_block.get(k)
    }
    if not changed:
        return spec, {}
    out = {**spec, "model": new_block}
    calibration = spec.get("calibration")
    if isinstance(calibration, dict) and calibration:
        before = _analytic(spec)
        after = _analytic(out)
        scaled = dict(calibration)
        for key in _MODEL_SCALED_KEYS:
            if key in calibration:
                scaled[key] = _scale(calibration[key], getattr(before, key), getattr(after, key))
        if isinstance(scaled.get("activation_bytes_per_token"), dict):
            # Each level scales by its own ratio, which may reorder them on a very different
            # shape; the memory rule needs them ordered (each level at least the next one's).
            levels = scaled["activation_bytes_per_token"]
            if set(levels) == set(RECOMPUTE_LEVELS):
                scaled["activation_bytes_per_token"] = monotone_activations(levels)
        out["calibration"] = scaled
    return out, changed


def _analytic(spec: dict):
    cluster, model, options, _ = parse_spec(spec)
    num_ranks = max(
        1, cluster.num_gpus // (options.tensor_parallel_size * options.pipeline_parallel_size)
    )
    return analytic_coefficients(cluster, model, options, num_ranks=num_ranks)


def _scale(measured, old, new):
    """``measured`` × new / old, per recompute level for dicts; kept where old is 0."""
    if isinstance(measured, dict):
        return {k: _scale(v, old.get(k, 0.0), new.get(k, 0.0)) for k, v in measured.items()}
    return measured * new / old if old else measured


def with_launch(
    spec: dict, *, world_size: int, ranks_per_node: int | None = None
) -> tuple[dict, dict]:
    """``spec`` with its cluster sized to the launch, and what changed as ``{key: (old, new)}``:
    ``cluster.num_gpus`` the launched ranks (one per GPU) and, when known, ``cluster.gpus_per_node``
    the ranks per node. The spec describes the hardware (links, memory, calibration); how many
    GPUs a run uses is the launch's to say."""
    cluster = dict(spec.get("cluster", {}))
    wanted = {"num_gpus": world_size}
    if ranks_per_node:
        wanted["gpus_per_node"] = min(ranks_per_node, world_size)
    changed = {
        f"cluster.{k}": (cluster.get(k), v) for k, v in wanted.items() if cluster.get(k) != v
    }
    return {**spec, "cluster": {**cluster, **wanted}}, changed


def load_cost_model(
    source: str | Path | dict | CostModel, *, mesh: Mesh | None = None
) -> CostModel:
    """A ``CostModel`` from any spec source, checked against the job's ``mesh`` when given: the
    spec's ``options.tensor_parallel_size`` and ``options.pipeline_parallel_size`` must be the
    mesh's, and its ``cluster.num_gpus`` (its planner ranks times its TP and PP sizes) the
    mesh's ``world_size``. Without a mesh the spec's own cluster is planned (``tools.plan``)."""
    model = source if isinstance(source, CostModel) else CostModel.from_spec(load_spec(source))
    if mesh is None:
        return model
    spec_tp = model.tensor_parallel_size
    if spec_tp != mesh.tensor_parallel_size:
        raise ValueError(
            f"cost-model spec {model.name!r} plans with tensor parallelism {spec_tp} "
            f"(options.tensor_parallel_size) but the run uses parallel.tensor_parallel_size="
            f"{mesh.tensor_parallel_size}; use a spec for that TP size (its "
            "options.tensor_parallel_size and cluster.num_gpus; the CPU presets have the overlay "
            "'+cpu-tp2' for TP = 2 on 4 ranks)"
        )
    spec_pp = model.pipeline_parallel_size
    if spec_pp != mesh.pipeline_parallel_size:
        raise ValueError(
            f"cost-model spec {model.name!r} plans with pipeline parallelism {spec_pp} "
            f"(options.pipeline_parallel_size) but the run uses {mesh.pipeline_parallel_size} "
            "pipeline stage(s); use a spec with that options.pipeline_parallel_size"
        )
    gpus = model.num_ranks * spec_tp * spec_pp
    if gpus != mesh.world_size:
        pp = f" x PP {spec_pp}" if spec_pp > 1 else ""
        raise ValueError(
            f"cost-model spec {model.name!r} describes {gpus} GPUs "
            f"({model.num_ranks} planner ranks x TP {spec_tp}{pp}) but the job has "
            f"{mesh.world_size} ranks; use a spec whose cluster.num_gpus matches the launch"
        )
    return model


def write_preset_calibration(
    name: str, calibration: dict, *, description: str, profiles_dir: Path = PROFILES_DIR
) -> Path:
    """Replace the calibration block and description of the single preset ``name`` (a file in
    ``profiles_dir``); every other key is kept, in order."""
    path = Path(profiles_dir) / f"{name}.json"
    if "+" in name or not path.is_file():
        raise ValueError(f"a calibration is written to one preset of {profiles_dir}, got {name!r}")
    raw = json.loads(path.read_text())
    raw["description"] = description
    raw["calibration"] = dict(calibration)
    path.write_text(json.dumps(raw, indent=2) + "\n")
    return path
