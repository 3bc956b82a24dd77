"""Per-GPU memory of a training recipe, by the planner's own memory rule.

    python -m tools.memory_budget --config pretrain/configs/llama3_8b_h200.yaml [key=value ...]
    python -m tools.memory_budget --spec h200x256+llama3-70b-tp4pp8 --max-seq-len 131072

Prints the static bytes per GPU (weights, main grads, optimizer shard; split over TP) and, for
the recipe's longest training sequence (``model.max_seq_len``, or the data's document cap when
that is shorter; the line says which, and a ``model.max_seq_len=N`` override the data cap keeps
sequences from reaching is refused with the key to raise), the activation and total bytes at
every CP size (in planner ranks, one per TP group) and recompute level (each named by the
megatron-core settings it runs with) against the per-GPU budget of the recipe's
cost-model spec (``planning.spec``), for the recipe's model, dtype, TP size and optimizer
sharding laid over the spec as the trainer's planner does; then, at each CP size, the least
number of layers a partial full recompute must cover to fit (JSON ``partial``). ``--spec``
and ``--max-seq-len`` check a spec as it is, without a recipe.

With pipeline parallelism (the spec's ``options.pipeline_parallel_size``) the numbers are per GPU
of the tightest stage: each stage's layers and static bytes, and per cell the total with the
stage's in-flight micro-steps all as large (a static run's case) and with this one among small
ones (``alone``; ``fits`` says whether the longest sequence has a placement at all).
The last stdout line is a JSON object: ``fits`` (the longest sequence has a placement within the
budget), ``longest_seq_len`` and ``longest_seq_len_from`` (the setting that caps it),
``static_bytes_per_gpu``, ``budget_bytes_per_gpu``, the breakdown, every cell,
``tensor_parallel_size``, ``pipeline_parallel_size``, ``num_planner_ranks`` (per stage) and
``model_matches_spec`` (the spec was written for the recipe's model; when it was not, its
calibrated terms are scaled to it analytically).
Exit code 1 when the recipe cannot fit.
"""

from __future__ import annotations

import argparse
import json
import sys

from dcp import console
from dcp.costmodel import load_cost_model, load_spec, with_model, with_runtime_options
from dcp.costmodel.budget import memory_budget
from dcp.costmodel.spec import runtime_options
from dcp.plan import RECOMPUTE_LEVELS, Recompute
from dcp.runtime.dispatch import train_len
from dcp.schema import load_config
from dcp.train.config import PretrainConfig

GB = 1e9


def longest_seq_len(cfg: PretrainConfig) -> tuple[int, str]:
    """The longest sequence the recipe trains (the data's document cap, within the model's) and
    the setting that makes it so (``key=value``)."""
    data = cfg.data
    key, cap = None, None  # chat: a conversation may be as long as the model takes
    if data.source == "indexed":
        key, cap = "data.indexed.max_doc_len", data.indexed.max_doc_len
    elif data.source == "synthetic":
        key, cap = "data.synthetic.max_len", data.synthetic.max_len
    if cap is None or train_len(cap) >= cfg.model.max_seq_len:
        return cfg.model.max_seq_len, f"model.max_seq_len={cfg.model.max_seq_len}"
    return train_len(cap), f"{key}={cap}"


def check_asked_length(cfg: PretrainConfig, overrides: list[str]) -> None:
    """Refuse, naming the key to change, when the command line asks about a
    ``model.max_seq_len`` the recipe's data cap keeps its sequences from reaching (a document
    of n tokens trains n - 1, so a cap of exactly the model's length is the same question)."""
    if not any(o.split("=", 1)[0].strip() == "model.max_seq_len" for o in overrides):
        return
    asked = cfg.model.max_seq_len
    longest, source = longest_seq_len(cfg)
    if longest < asked - 1:
        key = source.split("=", 1)[0]
        raise ValueError(
            f"model.max_seq_len={asked} asks about {asked:,}-token sequences, but {source} caps "
            f"the recipe's longest at {longest:,}; to ask about {asked:,} tokens also set "
            f"{key}={asked + 1}"
        )


def main(argv: list[str] | None = None) -> int:
    console.setup()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="training recipe YAML")
    source.add_argument("--spec", help="a cost-model spec as it is (preset or JSON path)")
    parser.add_argument("--max-seq-len", type=int, help="with --spec: the longest sequence")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides of the YAML")
    args = parser.parse_args(argv)
    if args.spec and (not args.max_seq_len or args.overrides):
        parser.error("--spec takes --max-seq-len and no overrides")
    try:
        if args.spec:
            cost_model = load_cost_model(args.spec)
            longest, matches = args.max_seq_len, True
            source = f"--max-seq-len {args.max_seq_len}"
        else:
            cost_model, matches, longest, source = _recipe(args.config, args.overrides)
        budget = memory_budget(cost_model, longest)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    parts = ", ".join(f"{k} {v / GB:.1f} GB" for k, v in budget.static_parts.items())
    tp, pp = cost_model.tensor_parallel_size, cost_model.pipeline_parallel_size
    mesh = f"TP {tp}" if pp == 1 else f"TP {tp} x PP {pp}"
    print(f"spec {cost_model.name}: {cost_model.num_ranks} planner ranks x {mesh} = "
          f"{cost_model.num_ranks * tp * pp} GPUs, budget "
          f"{budget.budget_bytes_per_gpu / GB:.1f} GB per GPU")  # fmt: skip
    if pp > 1:
        stages = ", ".join(
            f"{n} ({b / GB:.1f} GB)"
            for n, b in zip(budget.stage_layers, budget.stage_static_bytes_per_gpu, strict=True)
        )
        print(f"stages: layers (static per GPU) {stages}; stage s holds {pp} - s micro-steps in "
              "flight (1F1B); a recompute's layer count is per stage")  # fmt: skip
    where = " on the tightest stage" if pp > 1 else ""
    print(f"static {budget.static_bytes_per_gpu / GB:.1f} GB per GPU{where} ({parts}"
          f"{'; calibrated total' if budget.static_calibrated else ''})")  # fmt: skip
    print(f"longest sequence {longest:,} tokens ({source}):")
    print("recompute levels, as megatron-core TransformerConfig settings:")
    for level in map(Recompute, RECOMPUTE_LEVELS):  # the levels of the table below
        print(f"  {level.value:<10} {level.megatron_settings}")
    if pp > 1:
        print(f"{'cp':>4} {'recompute':>10} {'in flight GB':>13} {'fits':>5} {'alone GB':>9}  fits")
        for c in budget.cells:
            print(f"{c.cp_size:>4} {c.recompute:>10} {c.total_bytes_per_gpu / GB:>13.1f} "
                  f"{'yes' if c.fits else 'no':>5} {c.total_bytes_alone_per_gpu / GB:>9.1f}  "
                  f"{'yes' if c.fits_alone else 'no'}")  # fmt: skip
    else:
        print(f"{'cp':>4} {'recompute':>10} {'activations GB':>15} {'total GB':>9}  fits")
        for c in budget.cells:
            print(f"{c.cp_size:>4} {c.recompute:>10} {c.activation_bytes_per_gpu / GB:>15.1f} "
                  f"{c.total_bytes_per_gpu / GB:>9.1f}  {'yes' if c.fits else 'no'}")  # fmt: skip
    if budget.partial:
        print(f"{'cp':>4} {'least full-recompute layers that fit':>37} {'total GB':>9}")
    for p in budget.partial:
        layers = (
            "none fit"
            if p.min_recompute_layers is None
            else (f"{p.min_recompute_layers} of {p.num_layers}")
        )
        total = "" if p.total_bytes_per_gpu is None else f"{p.total_bytes_per_gpu / GB:.1f}"
        print(f"{p.cp_size:>4} {layers:>37} {total:>9}")  # fmt: skip
    if not matches:
        print(f"note: spec {cost_model.name!r} was written for another model than the recipe's; "
              "these numbers are for the recipe's model, with any calibrated terms scaled to it "
              "analytically", file=sys.stderr)  # fmt: skip
    if not budget.fits:
        print("the longest sequence fits no CP size and recompute level: raise the GPU count, "
              "shorten data max_doc_len or shrink the model", file=sys.stderr)  # fmt: skip
    print(json.dumps({
        **budget.to_json(), "longest_seq_len_from": source,
        "spec": cost_model.name, "model_matches_spec": matches,
        "tensor_parallel_size": tp, "pipeline_parallel_size": pp,
        "num_planner_ranks": cost_model.num_ranks,
    }))  # fmt: skip
    return 0 if budget.fits else 1


def _recipe(config: str, overrides: list[str]):
    """(cost model, whether the spec was written for the recipe's model, longest sequence, the
    setting that caps it)."""
    cfg = load_config(PretrainConfig, config, overrides)
    # The recipe fixes the model, dtype, TP and optimizer sharding, as the trainer's planner
    # sees them.
    spec, retied = with_runtime_options(
        load_spec(cfg.planning.spec),
        runtime_options(
            dtype=cfg.model.dtype,
            distributed_optimizer=cfg.optim.distributed,
            fp8=cfg.model.fp8,
            tensor_parallel_size=cfg.parallel.tensor_parallel_size,
            tied_embeddings=cfg.model.tie_embeddings,
        ),
    )
    spec, reshaped = with_model(spec, cfg.model.shape)
    matches = not reshaped and "tied_embeddings" not in retied
    cost_model = load_cost_model(spec)  # its TP size is the recipe's, laid over above
    check_asked_length(cfg, overrides)
    return cost_model, matches, *longest_seq_len(cfg)


if __name__ == "__main__":
    raise SystemExit(main())
