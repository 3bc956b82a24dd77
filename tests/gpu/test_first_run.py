"""What the first GPU run needed that only a GPU can show (``tools.gpu_check`` rows):

- communicators made at start-up: ``start_groups`` warms every group a rank is in, on every GPU
  of the machine; the device memory that took is recorded with the count, and per communicator
  with a peer in GB (the figure ``options.memory_per_communicator_gb`` assumes);
- host syncs per step on the TE path: every synchronising CUDA call of a training step,
  counted with torch's sync debug mode (not only DCP's own), and none from TE's padding check
  (``pad_between_seqs`` is given);
- a resume with megatron's fused Adam (TE's or apex's ``FusedAdam``, which keep Adam's step per
  parameter group): the resumed run continues the uninterrupted run's losses.

Each value goes to the JUnit report as a property; the tests assert behaviour, never a speed.
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import torch

from tests.distributed.harness import run_on_ranks
from tests.gpu.common import GPU_ONLY, SMALL

pytestmark = GPU_ONLY

MODEL = dict(SMALL, max_seq_len=4096, dtype="bf16", core_attention="te")


def _docs(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, SMALL["vocab_size"], size=n + 1) for n in (1000, 7, 300, 2500, 130)]


def _plan(recompute: str):
    from dcp.plan import Plan

    return Plan.from_dict(
        {
            "planner": "gpu_check",
            "predicted_step_time_s": 0.0,
            "steps": [
                {"ranks": [0], "seq_ids": [0, 1, 2], "recompute": recompute},
                {"ranks": [0], "seq_ids": [3, 4], "recompute": "none"},
            ],
        }
    )


def communicators_at_start_up() -> dict:
    """Device memory in use after ``dcp.init`` (the CUDA context: ``memory_fixed_gb``'s
    measured part) and what ``start_groups`` then took, on every GPU of the machine, with the
    count of communicators and of those with a peer (what ``memory_per_communicator_gb``
    covers, ``dcp.costmodel.communicators``)."""
    import torch.distributed as dist

    import dcp
    from dcp.costmodel.communicators import peer_communicators
    from dcp.mesh import Mesh
    from dcp.runtime.groups import start_groups
    from tests.distributed.tiny import cleanup

    os.environ["LOCAL_RANK"] = str(dist.get_rank())  # one node: dcp.init's device
    try:
        dcp.init()
        torch.cuda.synchronize()
        free_before, total = torch.cuda.mem_get_info()
        mesh = Mesh(dist.get_world_size())
        registry = start_groups(mesh)
        torch.cuda.synchronize()
        free_after, _ = torch.cuda.mem_get_info()
        return {
            "groups": registry.num_run_groups,
            "peer_groups": peer_communicators(mesh),
            "context_bytes": total - free_before,
            "bytes": free_before - free_after,
        }
    finally:
        cleanup()


def test_communicators_are_made_at_start_up(record_property):
    """On every GPU of the machine (one rank each): the per-communicator figure in the unit the
    spec option takes (``options.memory_per_communicator_gb``), the measured value to replace
    the assumed one with (docs/gpu.md); on one GPU every group has one rank and no peer."""
    out = run_on_ranks(torch.cuda.device_count(), communicators_at_start_up, timeout_s=300)[0]
    record_property("communicators.groups", out["groups"])
    record_property("communicators.peer_groups", out["peer_groups"])
    record_property("communicators.device_bytes", out["bytes"])
    record_property("communicators.context_gb", round(out["context_bytes"] / 1e9, 3))
    if out["peer_groups"]:
        per_peer = out["bytes"] / 1e9 / out["peer_groups"]
        record_property("communicators.memory_per_communicator_gb", round(per_peer, 3))
    assert out["groups"] >= 2, out


def syncs_per_step(steps: int) -> dict:
    """Synchronising CUDA calls of each training step on the TE spec (torch's sync debug mode
    warns once per call), and where the ones from inside Transformer Engine came from."""
    from dcp.model import ModelConfig
    from dcp.optim import OptimConfig
    from dcp.runtime.dispatch import InMemorySource
    from dcp.runtime.runtime import Runtime
    from tests.distributed.tiny import cleanup

    try:
        runtime = Runtime.from_config(ModelConfig(**MODEL), OptimConfig(), seed=3)
        source = InMemorySource(_docs())
        runtime.train_step(_plan("full"), source)  # warm-up: kernels, allocator, TE's caches
        counts, te_sites = [], set()
        for _ in range(steps):
            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    runtime.train_step(_plan("full"), source)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            syncs = [w for w in caught if "synchroniz" in str(w.message)]
            counts.append(len(syncs))
            te_sites |= {w.filename for w in syncs if "transformer_engine" in w.filename}
        return {"syncs": counts, "te_sites": sorted(te_sites)}
    finally:
        cleanup()


def test_host_syncs_per_step_on_the_te_path(record_property):
    out = run_on_ranks(1, syncs_per_step, 3, timeout_s=600)[0]
    record_property("syncs_per_step", out["syncs"])
    record_property("syncs_from_transformer_engine", out["te_sites"])
    # TE would compare cu_seqlens on the device per attention call without pad_between_seqs.
    assert not any("dot_product_attention" in site for site in out["te_sites"]), out


def fused_adam_resume(root: str) -> dict:
    """Four steps straight against two steps, a checkpoint, a fresh runtime restored, two more:
    megatron's optimizer on a GPU is TE's (or apex's) FusedAdam, whose step is per group."""
    import torch.distributed as dist

    from dcp.checkpoint import CheckpointSaver, apply, open_checkpoint, resolve_checkpoint
    from dcp.checkpoint.state import runtime_parts
    from dcp.mesh import Mesh
    from dcp.model import ModelConfig
    from dcp.optim import OptimConfig
    from dcp.runtime.dispatch import InMemorySource
    from dcp.runtime.runtime import Runtime
    from megatron_patches.optimizer_state import inner_optimizers
    from tests.distributed.tiny import cleanup

    cfg = ModelConfig(**MODEL)
    source = InMemorySource(_docs())
    recompute = ["none", "selective", "full", "none"]

    def train(runtime, steps):
        return [runtime.train_step(_plan(recompute[i]), source).loss for i in steps]

    try:
        straight = Runtime.from_config(cfg, OptimConfig(), seed=5)
        inner = inner_optimizers(straight.optimizer)[0]
        optimizer = type(getattr(inner, "optimizer", inner)).__module__
        losses = train(straight, range(4))
        first = Runtime.from_config(cfg, OptimConfig(), seed=5)
        train(first, range(2))
        parts = runtime_parts(
            first.model.module,
            first.optimizer,
            shared={"sampler": None, "scheduler": {"step": 2}, "extra": {}},
        )
        mesh = Mesh(dist.get_world_size())
        saver = CheckpointSaver(root, mesh=mesh, rank=dist.get_rank())
        saver.save(2, weights_finite=True, asynchronous=False, **parts)
        resumed = Runtime.from_config(cfg, OptimConfig(), seed=6)
        ckpt = open_checkpoint(resolve_checkpoint(root))
        state = ckpt.read(resumed.model.module, resumed.optimizer, rank=dist.get_rank(), mesh=mesh)
        apply(state, resumed.model.module, resumed.optimizer)
        resumed.step = ckpt.step
        return {
            "optimizer": optimizer,
            "losses": losses,
            "resumed": train(resumed, range(2, 4)),
        }
    finally:
        cleanup()


def test_a_resume_with_the_fused_optimizer_continues_the_run(record_property, tmp_path):
    out = run_on_ranks(1, fused_adam_resume, str(tmp_path / "ckpt"), timeout_s=600)[0]
    record_property("fused_resume.optimizer", out["optimizer"])
    record_property("fused_resume.losses", out["losses"])
    record_property("fused_resume.resumed", out["resumed"])
    np.testing.assert_allclose(out["resumed"], out["losses"][2:], rtol=1e-6)
