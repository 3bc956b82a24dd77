"""The one way to get a cost model: a spec string, a spec JSON path or a spec dict.

A spec string joins parts with ``+``, merged left to right, later parts winning key by key
inside each block (``parse_spec_string``): a preset (a JSON file of ``dcp/costmodel/profiles``:
``h200x32+llama3-8b`` is a cluster and a model), a spec JSON file (a part ending in ``.json`` or
naming an existing file) and ``key=value`` overrides (``pipeline_parallel_size=4``: a field of
the spec's ``options``, ``cluster`` or ``model`` block by its name, or ``block.key=value``;
values read as in ``key.sub=value`` config overrides). A GPU preset (``h100``, ``h200``,
``b200``: a datasheet without a GPU count, and the coefficients ``tools.costmodel_check`` chose
for that GPU) is named with its count, ``<gpu>x<N>``. With a ``mesh`` (``dcp.mesh.Mesh``: the
job's ranks, TP and PP sizes), the spec must describe that job; without one (a tool planning a
spec's own cluster) it is taken as it is.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from dcp.costmodel.formula import CostModel
from dcp.costmodel.spec import (
    ClusterSpec,
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
from dcp.schema import apply_overrides

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
    """The GPU preset a spec string names with its count (``h200x8+llama3-8b``: ``h200``), in
    any of its parts, else None."""
    for part in name.split("+"):
        match = _GPU_COUNT.fullmatch(part.strip())
        if match and match["gpu"] in gpu_presets():
            return match["gpu"]
    return None


def departures_from_gpu_preset(spec: dict, gpu: str) -> list[str]:
    """The keys of the GPU preset ``gpu`` (its datasheet in ``cluster``, its checked
    ``options``) that ``spec`` holds at another value, as ``block.key``, and ``calibration``
    when the spec has one (measured terms replace the checked ones). The GPU count and node
    size are the cluster's, not the GPU's: they may differ."""
    preset = load_json(PROFILES_DIR / f"{gpu}.json", what="cost-model preset")
    changed = [
        f"{block}.{key}"
        for block in ("cluster", "options")
        for key, value in preset.get(block, {}).items()
        if key not in ("num_gpus", "gpus_per_node") and spec.get(block, {}).get(key) != value
    ]
    return changed + (["calibration"] if spec.get("calibration") else [])


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


_BLOCKS = {"options": Options, "cluster": ClusterSpec, "model": ModelSpec}
"""The spec blocks a bare ``key=value`` override may name a field of (``calibration.<key>``
is named with its block)."""


def _override_key(key: str, text: str) -> tuple[str, str]:
    """(block, field) of an override's key: ``block.field``, or a field name of one block."""
    block, dot, name = key.partition(".")
    if dot:
        if block not in (*_BLOCKS, "calibration") or not name or "." in name:
            raise ValueError(
                f"override {key!r} in {text!r}: write block.key with block one of "
                f"{[*_BLOCKS, 'calibration']}, or a field name of the options, cluster or model "
                "block"
            )
        return block, name
    owners = [b for b, cls in _BLOCKS.items() if key in {f.name for f in dataclasses.fields(cls)}]
    if len(owners) != 1:
        known = sorted(f.name for f in dataclasses.fields(Options))
        raise ValueError(
            f"override {key!r} in {text!r} is not a field of the spec's options, cluster or "
            f"model block (options: {', '.join(known)}); spell other keys as block.key=value"
        )
    return owners[0], key


def _merge(spec: dict, part: dict) -> dict:
    """``part`` laid over ``spec``: blocks (dicts) merge key by key, other keys are replaced."""
    out = dict(spec)
    for key, value in part.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def _spec_file(path: Path) -> dict:
    """The JSON object of a spec file (``dcp.files``' rules: a problem is one line naming it)."""
    if not path.is_file():
        raise ValueError(f"no such cost-model spec file: {path}")
    spec = load_json(path, what="cost-model spec")
    if not isinstance(spec, dict):
        raise ValueError(f"cost-model spec {path} must hold a JSON object")
    return spec


def _is_path(part: str) -> bool:
    return part.endswith(".json") or Path(part).is_file()


def parse_spec_string(text: str) -> dict:
    """The spec dict of a spec string (module docstring): presets, spec files and overrides in
    any order, merged left to right. A ``tensor_parallel_size`` override that changes the TP
    size drops the calibration's TP-collective terms (``with_runtime_options``). The spec's
    name is the string (a single spec file keeps its own ``name``, else its stem)."""
    parts = [part.strip() for part in str(text).split("+")]
    if not all(parts):
        raise ValueError(f"empty part in cost-model spec {text!r}")
    spec: dict = {}
    for part in parts:
        if "=" in part and not Path(part).is_file():
            key, _, raw = part.partition("=")
            block, name = _override_key(key.strip(), text)
            value = apply_overrides({}, [f"value={raw}"])["value"]
            if block == "options":
                spec, _ = with_runtime_options(spec, {name: value})
            else:
                spec = _merge(spec, {block: {name: value}})
        elif _is_path(part):
            spec = _merge(spec, _spec_file(Path(part)))
        else:
            spec = _merge(spec, _preset_part(part, text))
    if len(parts) == 1 and _is_path(parts[0]):
        spec.setdefault("name", Path(parts[0]).stem)
    else:
        spec["name"] = str(text)
    return spec


def load_preset(name: str) -> dict:
    """The spec dict of presets only: ``"cpu-tiny"``, ``"<cluster>+<model>"`` or
    ``"<gpu>x<N>+<model>"`` (``parse_spec_string``, refusing files and overrides)."""
    for part in name.split("+"):
        if "=" in part or _is_path(part.strip()):
            raise ValueError(f"{part.strip()!r} in {name!r} is not a preset name")
    return parse_spec_string(name)


def load_spec(source: str | Path | dict) -> dict:
    """A spec dict from a spec string (``parse_spec_string``: presets, spec files, overrides) or
    a dict (a copy). A string with a spec file is checked whole here, so that what is built from
    it later never meets a wrong type: a single file's problems are one line naming the file,
    a combination's one line naming the string."""
    if isinstance(source, dict):
        return dict(source)
    text = str(source)
    spec = parse_spec_string(text)
    if _is_path(text):
        with reading(text, "cost-model spec"):
            CostModel.from_spec(spec)
    elif any(_is_path(part.strip()) for part in text.split("+")):
        try:
            CostModel.from_spec(spec)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"cost-model spec {text!r}: {exc}") from None
    return spec


# Calibrated terms that hold only at the TP size they were measured at, and those that hold
# only at the TP and EP sizes they were measured at (the MoE token exchange).
_TP_CALIBRATION_KEYS = ("tp_comm_s_per_token", "tp_latency_s")
_EP_CALIBRATION_KEYS = ("ep_comm_s_per_token", "ep_latency_s")


def with_runtime_options(spec: dict, options: dict) -> tuple[dict, dict]:
    """``spec`` with ``options`` laid over its ``options`` block (``spec.runtime_options``: what
    the training run itself fixes), and the keys whose value this changed, as ``{key: (old,
    new)}``, so callers can say what they overrode. A changed ``tensor_parallel_size`` drops
    the calibration's TP-collective terms (measured at the old size): they are analytic until
    measured again (``tools.profile``, online calibration); the fitted compute terms stay. A
    changed TP or ``expert_parallel_size`` drops the MoE token-exchange terms alike."""
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
    stale = ()
    if "tensor_parallel_size" in changed:
        stale = _TP_CALIBRATION_KEYS + _EP_CALIBRATION_KEYS
    elif "expert_parallel_size" in changed:
        stale = _EP_CALIBRATION_KEYS
    if stale and isinstance(spec.get("calibration"), dict):
        out["calibration"] = {k: v for k, v in spec["calibration"].items() if k not in stale}
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
    "ep_comm_s_per_token",
    "ep_latency_s",
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
    spec's ``options.tensor_parallel_size``, ``options.pipeline_parallel_size`` and
    ``options.virtual_pipeline_parallel_size`` must be the mesh's, and its ``cluster.num_gpus``
    (its planner ranks times its TP and PP sizes) the mesh's ``world_size``. Without a mesh the
    spec's own cluster is planned (``tools.plan``)."""
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
    spec_vp = model.virtual_pipeline_parallel_size
    if spec_vp != mesh.virtual_pipeline_parallel_size:
        raise ValueError(
            f"cost-model spec {model.name!r} plans with {spec_vp} virtual stage(s) per pipeline "
            f"stage (options.virtual_pipeline_parallel_size) but the run uses "
            f"{mesh.virtual_pipeline_parallel_size}; use a spec with that "
            "options.virtual_pipeline_parallel_size"
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
