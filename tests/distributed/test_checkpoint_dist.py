"""Sharded checkpoints on live gloo ranks: every rank writes its own file, and a checkpoint
written at one layout continues training at another with the same losses and weights as the
uninterrupted run (model, fp32 main parameters and Adam's moments resharded), for the
distributed optimizer and the replicated one; an asynchronous save publishes only once every
rank's writer finished. Under pipeline parallelism each stage writes its own layers and a load
at another PP size (or none) reads the layers it holds. Under expert parallelism each routed
expert is written once under its index in the layer, and a load at another EP size reads the
experts each rank holds.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.distributed.harness import run_on_ranks
from tests.distributed.tiny import OPTIM, SEED, TINY, cleanup, make_docs, to_numpy

LENGTHS = [90, 17, 200, 33, 5, 140, 61, 8]
DOCS = make_docs(LENGTHS, seed=3)
STEPS_BEFORE, STEPS_AFTER = 2, 2


def _plan(num_planner_ranks: int, min_cp: int = 1):
    """Sequence i on block i mod (P / ``min_cp``) of ``min_cp`` planner ranks (uneven counts),
    the longest on two such blocks (one if there is one)."""
    from dcp.plan import MicroStep, Plan, Recompute

    blocks = num_planner_ranks // min_cp
    steps = [
        MicroStep(
            ranks=tuple(range(i % blocks * min_cp, (i % blocks + 1) * min_cp)),
            seq_ids=(i,),
            recompute=Recompute.NONE,
        )
        for i in range(len(LENGTHS))
        if i != 2
    ]
    longest = tuple(range(min(2 * min_cp, num_planner_ranks)))
    steps.append(MicroStep(ranks=longest, seq_ids=(2,), recompute=Recompute.FULL))
    return Plan(steps=tuple(steps), planner="test")


def _mesh(tp: int, pp: int = 1, ep: int = 1):
    from dcp.mesh import Mesh

    return Mesh(
        dist.get_world_size(),
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        expert_parallel_size=ep,
    )


def _runtime(tp: int, distributed: bool, pp: int = 1, model: dict | None = None, ep: int = 1):
    import dataclasses

    from dcp.model import ModelConfig
    from dcp.runtime.runtime import Runtime

    optim = dataclasses.replace(OPTIM, distributed=distributed, decay_steps=8)
    return Runtime.from_config(
        ModelConfig(**{**TINY, "make_vocab_size_divisible_by": 8, **(model or {})}),
        optim,
        seed=SEED,
        mesh=_mesh(tp, pp, ep),
    )


def _steps(runtime, tp: int, n: int, pp: int = 1) -> list[float]:
    from dcp.runtime.dispatch import InMemorySource

    min_cp = 2 if (runtime.model.config.num_moe_experts or 0) else 1  # whole EP groups at EP 2
    plan = _plan(dist.get_world_size() // (tp * pp), min_cp)
    return [runtime.train_step(plan, InMemorySource(DOCS)).loss for _ in range(n)]


def _weights(runtime) -> dict:
    """Every stage's whole weights and routers' expert biases by canonical name (each stage's
    planner ranks of the first EP group send: together they hold every expert)."""
    from dcp.collectives import all_gather_object
    from dcp.weights.canonical import state_names

    names = state_names(runtime.model.module)
    biases = [(n, b) for n, b in runtime.model.module.named_buffers() if n.endswith("expert_bias")]
    mine = {names[n]: w for n, w in to_numpy([*runtime.weights().items(), *biases]).items()}
    sends = runtime.registry.planner_rank < runtime.registry.mesh.expert_parallel_size
    merged: dict = {}
    for part in all_gather_object(mine if sends else {}):
        merged.update(part)
    return merged


def train_save_continue(
    root: str,
    tp: int,
    distributed: bool,
    asynchronous: bool,
    pp: int = 1,
    model: dict | None = None,
    ep: int = 1,
) -> dict:
    """``STEPS_BEFORE`` steps, a checkpoint, ``STEPS_AFTER`` more: losses and final weights."""
    from dcp.checkpoint import CheckpointSaver
    from dcp.checkpoint.state import runtime_parts

    try:
        runtime = _runtime(tp, distributed, pp, model, ep)
        with torch.no_grad():
            for name, bias in runtime.model.module.named_buffers():
                if name.endswith("expert_bias"):  # as if trained a while: 0.05 does not divide it
                    bias.copy_(torch.tensor([0.03, -0.01, 0.02, -0.04]))
        before = _steps(runtime, tp, STEPS_BEFORE, pp)
        saver = CheckpointSaver(Path(root), mesh=_mesh(tp, pp, ep), rank=dist.get_rank())
        shared = {"sampler": None, "scheduler": {"step": STEPS_BEFORE}, "extra": {}}
        saver.save(
            STEPS_BEFORE,
            weights_finite=True,
            asynchronous=asynchronous,
            **runtime_parts(
                runtime.model.module,
                runtime.optimizer,
                shared=shared if dist.get_rank() == 0 else None,
            ),
        )
        published_early = (Path(root) / "step_000002").exists()
        after = _steps(runtime, tp, STEPS_AFTER, pp)  # the writers work meanwhile
        saver.wait()
        files = sorted(p.name for p in (Path(root) / "step_000002").iterdir())
        return {
            "before": before,
            "after": after,
            "weights": _weights(runtime),
            "published_early": published_early,
            "files": files,
        }
    finally:
        cleanup()


def resume_and_continue(
    root: str, tp: int, distributed: bool, pp: int = 1, model: dict | None = None, ep: int = 1
) -> dict:
    """A fresh runtime at (this world, ``tp``, ``pp``, ``ep``) resumed from the checkpoint: the
    next losses."""
    from dcp.checkpoint import apply, open_checkpoint, resolve_checkpoint

    try:
        runtime = _runtime(tp, distributed, pp, model, ep)
        ckpt = open_checkpoint(resolve_checkpoint(root))
        mesh = _mesh(tp, pp, ep)
        state = ckpt.read(runtime.model.module, runtime.optimizer, rank=dist.get_rank(), mesh=mesh)
        apply(state, runtime.model.module, runtime.optimizer)
        runtime.step = ckpt.step
        return {
            "after": _steps(runtime, tp, STEPS_AFTER, pp),
            "weights": _weights(runtime),
            "rng_carried": state.rng is not None,
            "saved_layout": (
                ckpt.mesh.world_size,
                ckpt.mesh.tensor_parallel_size,
                ckpt.mesh.pipeline_parallel_size,
            ),
            "saved_ep": ckpt.mesh.expert_parallel_size,
        }
    finally:
        cleanup()


def _assert_same_weights(reference: dict, resumed: dict, where: str) -> None:
    for name, value in reference["weights"].items():
        np.testing.assert_allclose(
            resumed["weights"][name], value, rtol=1e-5, atol=1e-7, err_msg=f"{name} {where}"
        )


def _close(a: list[float], b: list[float]) -> bool:
    return all(abs(x - y) <= 1e-5 * abs(x) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("distributed", [True, False], ids=["distributed", "replicated"])
def test_a_checkpoint_at_tp2_on_4_ranks_continues_at_other_layouts(tmp_path, distributed):
    saved = run_on_ranks(4, train_save_continue, str(tmp_path), 2, distributed, True, timeout_s=300)
    reference = saved[0]
    assert not reference["published_early"]  # published only after every writer finished
    assert reference["files"] == [
        "manifest.json",
        *(f"rank{r:05d}.safetensors" for r in range(4)),
        "shared.json",
    ]
    # The same layout, then TP 1 on 4 ranks and on 2 ranks, and TP 2 on 2 ranks.
    for world, tp in ((4, 2), (4, 1), (2, 1), (2, 2)):
        resumed = run_on_ranks(
            world, resume_and_continue, str(tmp_path), tp, distributed, timeout_s=300
        )[0]
        assert resumed["saved_layout"] == (4, 2, 1)
        assert resumed["rng_carried"] == ((world, tp) == (4, 2))
        assert _close(reference["after"], resumed["after"]), (world, tp, reference, resumed)
        _assert_same_weights(reference, resumed, f"{world} ranks, TP {tp}")


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied_embeddings"])
def test_a_checkpoint_at_pp2_continues_at_other_pipeline_sizes(tmp_path, tied):
    """4 ranks at PP 2 (2 planner ranks) save; PP 2 on 4 and 2 ranks and no pipeline on 4 and 2
    ranks continue with the uninterrupted losses and weights. Tied: only the first stage writes
    the embedding, and the last stage's copy is filled from it on load."""
    model = {"tie_embeddings": True} if tied else None
    saved = run_on_ranks(
        4, train_save_continue, str(tmp_path), 1, True, True, 2, model, timeout_s=300
    )
    reference = saved[0]
    for world, pp in ((4, 2), (2, 2), (4, 1), (2, 1)):
        resumed = run_on_ranks(
            world, resume_and_continue, str(tmp_path), 1, True, pp, model, timeout_s=300
        )[0]
        assert resumed["saved_layout"] == (4, 1, 2)
        assert resumed["rng_carried"] == ((world, pp) == (4, 2))
        assert _close(reference["after"], resumed["after"]), (world, pp, reference, resumed)
        assert set(resumed["weights"]) == set(reference["weights"])
        _assert_same_weights(reference, resumed, f"{world} ranks, PP {pp}")


EXPERTS = {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 48}
# With the expert bias, which every step moves by 0.05 (routing after the first step follows it).
EXPERTS_SHARED = {
    **EXPERTS,
    "moe_shared_expert_intermediate_size": 32,
    "moe_router_score_function": "sigmoid",
    "moe_router_expert_bias": True,
    "moe_router_bias_update_rate": 0.05,
}


def expert_checkpoints(root: str, model: dict) -> dict:
    """One launch of 4 ranks: EP 2 saves and continues, then resumes at EP 2 and at EP 1; EP 1
    saves and continues, then resumes at EP 2 (each run's parallel state torn down before the
    next)."""
    return {
        "ep2": train_save_continue(f"{root}/ep2", 1, True, True, model=model, ep=2),
        "ep2 at ep2": resume_and_continue(f"{root}/ep2", 1, True, model=model, ep=2),
        "ep2 at ep1": resume_and_continue(f"{root}/ep2", 1, True, model=model, ep=1),
        "ep1": train_save_continue(f"{root}/ep1", 1, True, True, model=model, ep=1),
        "ep1 at ep2": resume_and_continue(f"{root}/ep1", 1, True, model=model, ep=2),
        "unknown expert": read_an_expert_beyond_the_layer(f"{root}/ep2", model),
    }


def read_an_expert_beyond_the_layer(root: str, model: dict) -> str:
    """The EP 2 checkpoint with expert 3 of layer 0 renamed expert 4 (manifest and digests
    rewritten to match): what ``read_model`` at EP 2 says, before any tensor is read."""
    import json

    from dcp.checkpoint import open_checkpoint, resolve_checkpoint
    from tests.payload import rewrite_manifest

    path = resolve_checkpoint(root)
    dist.barrier()  # every rank has read the manifest before rank 0 rewrites it
    if dist.get_rank() == 0:
        manifest = json.loads((path / "manifest.json").read_text())
        for name in [n for n in manifest["model"] if ".0.mlp.experts.local_experts.3." in n]:
            manifest["model"][name.replace(".local_experts.3.", ".local_experts.4.")] = manifest[
                "model"
            ].pop(name)
        (path / "manifest.json").write_text(json.dumps(manifest))
        rewrite_manifest(path)
    dist.barrier()
    try:
        runtime = _runtime(1, True, model=model, ep=2)
        try:
            open_checkpoint(path).read_model(runtime.model.module)
        except ValueError as exc:
            return str(exc)
        return "read"
    finally:
        cleanup()


def test_a_checkpoint_at_ep2_continues_at_ep1_and_back(tmp_path):
    """Each routed expert is written once, by one rank holding it (a second writer would give
    its canonical name two shards, which the manifest refuses), under its index in the layer:
    EP 2 → EP 2, EP 2 → EP 1 and EP 1 → EP 2 continue with the uninterrupted losses and
    weights, every expert, the router (its expert bias too) and the shared expert included."""
    out = run_on_ranks(4, expert_checkpoints, str(tmp_path), EXPERTS_SHARED, timeout_s=300)[0]
    for saved, resumed_as, ep in (
        ("ep2", "ep2 at ep2", 2),
        ("ep2", "ep2 at ep1", 2),
        ("ep1", "ep1 at ep2", 1),
    ):
        reference, resumed = out[saved], out[resumed_as]
        assert resumed["saved_ep"] == ep
        assert resumed["rng_carried"] == (resumed_as == "ep2 at ep2")
        assert _close(reference["after"], resumed["after"]), (resumed_as, reference, resumed)
        experts = {n for n in reference["weights"] if ".local_experts." in n}
        assert {int(n.split(".local_experts.")[1].split(".")[0]) for n in experts} == {0, 1, 2, 3}
        assert any(".shared_experts." in n for n in reference["weights"]), resumed_as
        biases = [n for n in reference["weights"] if n.endswith(".router.expert_bias")]
        # The saved biases started away from 0 (a resume that dropped them would start at 0).
        biases = [n for n in reference["weights"] if n.endswith(".router.expert_bias")]
        assert biases and all(reference["weights"][n].all() for n in biases), resumed_as
        assert set(resumed["weights"]) == set(reference["weights"])
        _assert_same_weights(reference, resumed, resumed_as)
    # An expert index no layer has is named, in one line, before anything is read.
    message = out["unknown expert"]
    assert "\n" not in message and "not in the model" in message, message
    assert "decoder.layers.0.mlp.experts.local_experts.4.linear_fc1.weight" in message, message
