"""The megatron patches refuse other megatron-core versions and their upstream targets exist.

If megatron-core moves any attribute a patch swaps, these tests fail loudly (rather than the
patch silently doing nothing).
"""

from __future__ import annotations

import inspect

import pytest

from megatron_patches import _version


def test_the_installed_megatron_core_is_supported():
    assert _version.megatron_core_supported(), _version.megatron_core_version()


@pytest.mark.parametrize("found", ["0.17.1", "0.20.0", "1.0.0"])
def test_other_versions_are_refused(monkeypatch, found):
    monkeypatch.setattr(_version, "megatron_core_version", lambda: found)
    with pytest.raises(RuntimeError, match=f"megatron-core>=0.18.0,<0.20, found {found}"):
        _version.require_supported_megatron("cpu")


@pytest.mark.parametrize("found", ["0.18.0", "0.18.2", "0.19.0", "0.19.2"])
def test_both_supported_series_pass(found):
    assert _version.megatron_core_supported(found)


def test_the_range_is_pyprojects():
    import tomllib
    from pathlib import Path

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    dependencies = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    assert _version.MEGATRON_CORE_REQUIREMENT in dependencies


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
    from dcp.runtime import setup

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(megatron_patches, "applied", lambda: False)
    with pytest.raises(RuntimeError, match=r"call dcp.init\(\)"):
        setup.init_megatron_parallel()


def test_ddp_bucket_layout_exists():
    """``megatron_patches.ddp_buckets`` cuts each buffer's ``grad_data`` by bucket ``offset`` and
    by the buffer's ``param_index_map``."""
    from megatron.core.distributed import distributed_data_parallel, param_and_grad_buffer

    ddp_src = inspect.getsource(distributed_data_parallel.DistributedDataParallel)
    for attr in ("self.buffers", "self.expert_parallel_buffers"):
        assert attr in ddp_src, attr
    buffer_src = inspect.getsource(param_and_grad_buffer._ParamAndGradBuffer)
    for attr in ("self.buckets", "self.param_index_map", "self.grad_data", "data_parallel_group"):
        assert attr in buffer_src, attr
    bucket_src = inspect.getsource(param_and_grad_buffer._ParamAndGradBucket)
    for attr in ("self.offset", "self.grad_data"):
        assert attr in bucket_src, attr


def test_distributed_optimizer_state_repairs_are_still_needed():
    """Each repair in ``megatron_patches.optimizer_state`` answers a line of megatron-core: when
    one of these changes upstream, the repair must be re-checked (and may go)."""
    from megatron.core.optimizer import distrib_optimizer, optimizer

    dist_opt = distrib_optimizer.DistributedOptimizer
    load_src = inspect.getsource(dist_opt.load_parameter_state_from_dp_reshardable)
    save_src = inspect.getsource(dist_opt.get_parameter_state_dp_reshardable)
    assert "['padding']" in load_src  # the loader filters on a key ...
    assert "padding" not in save_src  # ... that the saver does not write
    assert "param_group_identifier_keys" in inspect.getsource(distrib_optimizer)
    assert "chained_optimizers" in inspect.getsource(optimizer.ChainedOptimizer)


def test_process_group_list_is_kept_by_create_group():
    from megatron.core import parallel_state as ps

    assert hasattr(ps, "_global_process_group_list")
    assert "_global_process_group_list.append(group)" in inspect.getsource(ps.create_group)


def test_rope_frequencies_are_a_plain_attribute_read_by_forward():
    from megatron.core.models.common.embeddings import rotary_pos_embedding as rope

    src = inspect.getsource(rope.RotaryEmbedding)
    assert "self.inv_freq = " in src
    assert "register_buffer" not in src  # a buffer would need load/copy, not assignment
    assert "self.inv_freq" in inspect.getsource(rope.RotaryEmbedding.get_freqs_non_repeated)


def test_rope_tables_are_cached_per_length_and_cp_group():
    """``megatron_patches.rope.one_rope_table`` exists because upstream caches a table per
    (length, CP group) and asks for the packed micro-step's longest sequence."""
    from megatron.core.models.common.embeddings import rotary_pos_embedding as rope
    from megatron.core.models.gpt import gpt_model

    assert hasattr(rope.RotaryEmbedding.forward, "cache_info")  # functools.lru_cache
    params = inspect.signature(rope.RotaryEmbedding.forward).parameters
    assert list(params) == ["self", "max_seq_len", "offset", "packed_seq", "cp_group"]
    assert list(inspect.signature(rope.RotaryEmbedding.get_emb).parameters) == [
        "self",
        "max_seq_len",
        "offset",
    ]
    src = inspect.getsource(rope.RotaryEmbedding.get_rotary_seq_len)
    assert "max(packed_seq_params.max_seqlen_q, packed_seq_params.max_seqlen_kv)" in src
    assert "cp_group=packed_seq_params.cp_group" in inspect.getsource(gpt_model.GPTModel)


def test_te_attention_makes_its_cp_stream_only_at_cp_above_one():
    """``megatron_patches.te_attention`` exists because upstream creates the CP stream only for a
    model built with CP > 1. Read as text: the module imports Transformer Engine."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("megatron.core.extensions.transformer_engine")
    src = Path(spec.origin).read_text()
    guard = src.index("if self.config.context_parallel_size > 1:")
    made = src.index("TEDotProductAttention.cp_stream = torch.cuda.Stream()")
    assert 0 < made - guard < 600


def test_wgrad_fusion_flag_is_what_column_parallel_linear_checks():
    from megatron.core.tensor_parallel import layers

    assert isinstance(layers._grad_accum_fusion_available, bool)
    src = inspect.getsource(layers.ColumnParallelLinear.__init__)
    assert "config.gradient_accumulation_fusion and not _grad_accum_fusion_available" in src


def test_megatron_training_cpu_targets_are_what_the_patch_says():
    """``megatron_patches.megatron_training`` answers these upstream lines: pretrain calls
    initialize_megatron without allow_no_cuda, the parallel state and the RNG tracker are only
    set up when a CUDA device is counted, and the jit warm-up and helper build are separate
    functions it can skip."""
    from megatron.training import initialize, training

    from megatron_patches.megatron_training import training_on_cpu

    assert "allow_no_cuda" not in inspect.getsource(training.pretrain)
    init_src = inspect.getsource(initialize._initialize_distributed)
    # 0.19 added the skip flag; 0.18 gates on the device count alone.
    assert (
        "if device_count > 0 and not skip_model_parallel_init:" in init_src
        or "if device_count > 0:" in init_src
    )
    assert "if torch.cuda.device_count() > 0:" in inspect.getsource(initialize._set_random_seed)
    assert "compile_helpers()" in inspect.getsource(initialize._compile_dependencies)
    assert "_warmup_jit_function" in inspect.getsource(initialize.set_jit_fusion_options)
    assert training.set_jit_fusion_options is initialize.set_jit_fusion_options
    originals = (
        initialize._initialize_distributed,
        training.initialize_megatron,
        training.set_jit_fusion_options,
    )
    with training_on_cpu():
        assert training.initialize_megatron.keywords == {"allow_no_cuda": True}
        assert initialize._initialize_distributed is not originals[0]
    # Restored on exit: the patch is scoped to the block.
    assert (
        initialize._initialize_distributed,
        training.initialize_megatron,
        training.set_jit_fusion_options,
    ) == originals


def test_megatrons_argument_list_prints_only_when_asked(capsys):
    """``argument_dump_if`` swaps the function ``validate_args`` calls last; the list of every
    argument prints only under the flag, and megatron's own function is back after the block."""
    import argparse

    from megatron.training import arguments

    from megatron_patches.argument_dump import argument_dump_if

    assert '_print_args("arguments", args)' in inspect.getsource(arguments.validate_args)
    original = arguments._print_args
    with argument_dump_if("dcp_print_args"):
        arguments._print_args("arguments", argparse.Namespace(dcp_print_args=False, lr=0.1))
        assert capsys.readouterr().out == ""
        arguments._print_args("arguments", argparse.Namespace(dcp_print_args=True, lr=0.1))
        assert "  lr ...." in capsys.readouterr().out
    assert arguments._print_args is original


def test_the_alltoall_dispatcher_still_makes_its_stream_once_per_class():
    # megatron_patches.cpu presets the class attribute so __init__ never calls torch.cuda.Stream.
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    init = inspect.getsource(MoEAlltoAllTokenDispatcher.__init__)
    assert "if MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is None:" in init
    assert hasattr(MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream")
    # ... and moves its split sizes to the host through this module-level name.
    from megatron.core.transformer.moe import token_dispatcher

    source = inspect.getsource(MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize)
    assert "self.input_splits = maybe_move_tensor_to_cpu(" in source
    assert hasattr(token_dispatcher, "maybe_move_tensor_to_cpu")


def test_routers_still_mask_their_expert_bias_counts_as_megatron_expert_bias_replaces():
    # megatron_patches.expert_bias replaces this per router: megatron's mask is [tokens] against
    # a [tokens, experts] routing map. When upstream fixes the broadcast, drop the patch.
    from megatron.core.transformer.moe.router import TopKRouter

    assert "routing_map & (~padding_mask)" in inspect.getsource(TopKRouter._apply_expert_bias)
    routing = inspect.getsource(TopKRouter.routing)
    assert "padding_mask = padding_mask.reshape(-1)" in routing
    assert "self._apply_expert_bias(routing_map, padding_mask=padding_mask)" in routing
