"""Process set-up for the DCP runtime: megatron's patches and parallel state.

The mesh (``dcp.mesh.Mesh``) is world = PP × (DP·CP) × TP: megatron's parallel_state is
initialised with the run's TP and PP sizes and CP = 1, so its TP groups are consecutive ranks,
its pipeline stages are blocks of world / PP consecutive ranks, and DDP reduces over the fixed
DP×CP group of each TP rank of a stage (the stage's planner ranks). DCP regroups planner ranks
into CP groups per micro-step (``dcp.runtime.groups``).
"""

from __future__ import annotations

import math
import os
import warnings

import torch
import torch.distributed as dist

import megatron_patches
from dcp.mesh import Mesh
from dcp.versions import require_supported_versions


def init(
    *,
    timeout_s: float | None = None,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    virtual_pipeline_parallel_size: int = 1,
    expert_parallel_size: int = 1,
) -> None:
    """Prepare this process for DCP (idempotent): on a GPU machine select the device of
    ``LOCAL_RANK`` (torchrun's; otherwise every rank would land on cuda:0), install the
    megatron patches this machine needs (the CPU shim when there is no GPU) and initialise
    megatron's parallel state with ``tensor_parallel_size``, ``pipeline_parallel_size``,
    ``virtual_pipeline_parallel_size`` and ``expert_parallel_size``, its groups created with
    ``timeout_s`` (default: torch's). A torch outside the supported range raises
    ``dcp.versions.UnsupportedVersion`` first."""
    require_supported_versions()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # megatron's distributed optimizer calls these every step; torch 2.14 marks them deprecated
    # in favour of *_single, which megatron-core 0.19.2 does not use yet.
    warnings.filterwarnings(
        "ignore",
        message=r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is depr",
        category=FutureWarning,
    )
    # With fp32 weights the distributed optimizer's main params are views of the parameters;
    # megatron reads their .grad while stepping, which torch flags for non-leaf tensors.
    warnings.filterwarnings(
        "ignore",
        message=r"The \.grad attribute of a Tensor that is not a leaf",
        category=UserWarning,
    )
    megatron_patches.apply()
    init_megatron_parallel(
        timeout_s=timeout_s,
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
        virtual_pipeline_parallel_size=virtual_pipeline_parallel_size,
        expert_parallel_size=expert_parallel_size,
    )


def init_megatron_parallel(
    *,
    timeout_s: float | None = None,
    tensor_parallel_size: int | None = None,
    pipeline_parallel_size: int | None = None,
    virtual_pipeline_parallel_size: int | None = None,
    expert_parallel_size: int | None = None,
) -> int:
    """Initialise megatron's parallel_state with ``tensor_parallel_size``,
    ``pipeline_parallel_size``, ``virtual_pipeline_parallel_size`` and ``expert_parallel_size``
    (default 1 each) and CP = 1 (idempotent; a second call asking for other sizes raises).
    Returns the TP size in effect."""
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialised before the DCP runtime")
    if not megatron_patches.applied():
        raise RuntimeError(
            "megatron-core needs its CPU patches on a machine without CUDA: call dcp.init() "
            "(or megatron_patches.apply()) once at start-up"
        )
    if ps.model_parallel_is_initialized():
        current = ps.get_tensor_model_parallel_world_size()
        stages = ps.get_pipeline_model_parallel_world_size()
        if tensor_parallel_size is not None and tensor_parallel_size != current:
            raise ValueError(
                f"megatron's parallel state is already initialised with TP = {current}, not "
                f"{tensor_parallel_size}"
            )
        if pipeline_parallel_size is not None and pipeline_parallel_size != stages:
            raise ValueError(
                f"megatron's parallel state is already initialised with PP = {stages}, not "
                f"{pipeline_parallel_size}"
            )
        chunks = ps.get_virtual_pipeline_model_parallel_world_size() or 1
        if virtual_pipeline_parallel_size is not None and virtual_pipeline_parallel_size != chunks:
            raise ValueError(
                f"megatron's parallel state is already initialised with VP = {chunks}, not "
                f"{virtual_pipeline_parallel_size}"
            )
        experts = ps.get_expert_model_parallel_world_size()
        if expert_parallel_size is not None and expert_parallel_size != experts:
            raise ValueError(
                f"megatron's parallel state is already initialised with EP = {experts}, not "
                f"{expert_parallel_size}"
            )
        return current
    tp = 1 if tensor_parallel_size is None else tensor_parallel_size
    pp = 1 if pipeline_parallel_size is None else pipeline_parallel_size
    vp = 1 if virtual_pipeline_parallel_size is None else virtual_pipeline_parallel_size
    ep = 1 if expert_parallel_size is None else expert_parallel_size
    # The world must split into TP groups and stages, the planner ranks into EP groups.
    mesh = Mesh(
        dist.get_world_size(),
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        virtual_pipeline_parallel_size=vp,
        expert_parallel_size=ep,
    )
    extra = {}
    if timeout_s is not None:
        extra["distributed_timeout_minutes"] = max(1, math.ceil(timeout_s / 60))
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp if vp > 1 else None,
        context_parallel_size=1,
        expert_model_parallel_size=ep,
        # A gloo twin of every data-parallel group serves only megatron's dp-zero checkpoint
        # formats, which DCP does not use: at 1,024 ranks each is start-up time and sockets.
        create_gloo_process_groups=False,
        **extra,
    )
    # dcp.mesh numbers planner ranks by TP groups of consecutive ranks and stages by blocks of
    # world / PP ranks, megatron's default order ("tp-cp-ep-dp-pp": TP innermost, PP outermost).
    assert ps.get_tensor_model_parallel_rank() == mesh.tp_rank(dist.get_rank())
    assert ps.get_pipeline_model_parallel_rank() == mesh.stage(dist.get_rank())
    check_expert_groups(mesh)
    return tp


def check_expert_groups(mesh: Mesh) -> None:
    """Raise unless megatron's expert-parallel group of this rank is the mesh's: the TP rank's
    ranks on the planner ranks of ``Mesh.expert_block`` (megatron's "tp-ep-dp-pp" order with
    expert TP = TP), so that a plan step on whole blocks holds whole EP groups."""
    from megatron.core import parallel_state as ps

    rank = dist.get_rank()
    block = mesh.expert_block(mesh.planner_rank(rank))
    expected = mesh.cp_ranks(block, mesh.tp_rank(rank), mesh.stage(rank))
    found = tuple(dist.get_process_group_ranks(ps.get_expert_model_parallel_group()))
    if found != expected:
        raise RuntimeError(
            f"rank {rank}: megatron's expert-parallel group is {list(found)}, DCP's mesh "
            f"expects {list(expected)} (planner ranks {list(block)})"
        )


def init_megatron_mesh(mesh: Mesh) -> None:
    """Megatron's parallel state at ``mesh``: initialised with its TP and PP sizes (CP = 1) when
    it is not yet, else checked once against it. A ``ValueError`` says which size disagrees."""
    if mesh.world_size != dist.get_world_size():
        raise ValueError(
            f"the mesh has world_size={mesh.world_size} but torch.distributed has "
            f"{dist.get_world_size()} ranks"
        )
    try:
        init_megatron_parallel(
            tensor_parallel_size=mesh.tensor_parallel_size,
            pipeline_parallel_size=mesh.pipeline_parallel_size,
            virtual_pipeline_parallel_size=mesh.virtual_pipeline_parallel_size,
            expert_parallel_size=mesh.expert_parallel_size,
        )
    except ValueError as exc:
        raise ValueError(
            f"the run's mesh ({mesh.describe()} on {mesh.world_size} ranks) disagrees with "
            f"megatron's parallel state: {exc}"
        ) from None


def model_mesh(model) -> Mesh:
    """The mesh a megatron-core model was built for: its config's TP, PP, VP and EP sizes
    (``tensor_model_parallel_size``, ``pipeline_model_parallel_size``,
    ``virtual_pipeline_model_parallel_size``, ``expert_model_parallel_size``) over this job's
    ranks."""
    config = model.config
    return Mesh(
        dist.get_world_size(),
        tensor_parallel_size=config.tensor_model_parallel_size,
        pipeline_parallel_size=config.pipeline_model_parallel_size,
        virtual_pipeline_parallel_size=config.virtual_pipeline_model_parallel_size or 1,
        expert_parallel_size=config.expert_model_parallel_size,
    )
