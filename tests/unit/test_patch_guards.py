"""The megatron patches refuse other megatron-core versions and their upstream targets exist.

If megatron-core moves any attribute a patch swaps, these tests fail loudly (rather than the
patch silently doing nothing).
"""

from __future__ import annotations

import inspect

import pytest

from megatron_patches import _version


def test_pinned_version_is_installed():
    assert _version.megatron_core_version() == _version.PINNED_MEGATRON_CORE


def test_other_versions_are_refused(monkeypatch):
    monkeypatch.setattr(_version, "megatron_core_version", lambda: "0.20.0")
    with pytest.raises(RuntimeError, match="targets megatron-core 0.19.2, found 0.20.0"):
        _version.require_pinned_megatron("cpu")


def test_parallel_state_globals_exist():
    from megatron.core import parallel_state as ps

    from megatron_patches.parallel_state import _GLOBALS

    for name in _GLOBALS:
        assert hasattr(ps, name), name


def test_recompute_targets_exist():
    from megatron.core.transformer import attention, transformer_block, transformer_layer

    assert "self.checkpoint_core_attention" in inspect.getsource(attention.Attention)
    layer_src = inspect.getsource(transformer_layer.TransformerLayer)
    for attr in ("self.recompute_mlp", "self.recompute_input_layernorm"):
        assert attr in layer_src, attr
    assert "recompute_granularity == 'full'" in inspect.getsource(
        transformer_block.TransformerBlock
    )


def test_cpu_shim_targets_exist():
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer import utils

    assert callable(mcore_random._get_cuda_rng_state)
    assert callable(mcore_random._set_cuda_rng_state)
    assert callable(utils.get_default_causal_mask)
    assert callable(fused_softmax.get_default_causal_mask)


def test_apply_is_explicit_and_idempotent():
    """The test session applied the patches at start-up (tests/conftest.py), as entry points do;
    applying again changes nothing."""
    import torch

    import megatron_patches

    first = torch.cuda.current_device
    assert megatron_patches.apply() == (not torch.cuda.is_available())
    assert megatron_patches.apply() == (not torch.cuda.is_available())
    assert torch.cuda.current_device is first
    assert megatron_patches.applied()


def test_runtime_refuses_to_start_without_the_patches(monkeypatch):
    import torch.distributed as dist

    import megatron_patches
    from dcp.runtime import runtime

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(megatron_patches, "applied", lambda: False)
    with pytest.raises(RuntimeError, match=r"call dcp.init\(\)"):
        runtime.init_megatron_parallel()
