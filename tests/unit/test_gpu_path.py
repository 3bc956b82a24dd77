"""The GPU production path's pieces that are pure or CPU-checkable: model-config rules for TE and
FP8, the TE attention's THD boundaries, token alignment, the optimizer's CUDA redirect, and the
one source of optimizer-state bytes shared by the cost model and the runtime. The GPU itself is
exercised by ``tools/gpu_check.py`` (tests marked ``gpu``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from dcp.attention.layout import ShardLayout
from dcp.costmodel import load_spec, with_runtime_options
from dcp.costmodel.spec import Options, optimizer_bytes_per_param, runtime_options
from dcp.model import (
    ModelConfig,
    check_device_support,
    layer_spec,
    resolved_attention,
    token_multiple,
)
from megatron_patches.cpu_optimizer import cuda_on_cpu

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")


def test_fp8_delayed_scaling_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="delayed.*deadlocks"):
        ModelConfig(dtype="bf16", fp8=True, fp8_recipe="delayed")
    with pytest.raises(ValueError, match="fp8_recipe must be one of"):
        ModelConfig(fp8_recipe="mxfp8")


def test_fp8_needs_bf16_and_the_te_spec():
    with pytest.raises(ValueError, match="fp8 needs model.dtype=bf16"):
        ModelConfig(fp8=True)
    with pytest.raises(ValueError, match="fp8 needs"):
        ModelConfig(dtype="bf16", fp8=True, core_attention="dcp")
    cfg = ModelConfig(dtype="bf16", fp8=True, fp8_recipe="blockwise", core_attention="te")
    assert cfg.fp8_recipe == "blockwise"


def test_token_alignment_for_te_fp8_and_sequence_parallelism():
    assert token_multiple(te=True, fp8=True) == 16 and token_multiple(te=True, fp8=False) == 8
    assert token_multiple(te=False, fp8=False) == 1
    # Sequence parallelism splits a rank's tokens over TP; each slice keeps TE's alignment.
    assert token_multiple(te=True, fp8=True, tensor_parallel_size=2) == 32
    assert token_multiple(te=False, fp8=False, tensor_parallel_size=4) == 4


@no_cuda
def test_auto_attention_is_the_torch_path_without_a_gpu():
    cfg = ModelConfig()
    assert resolved_attention(cfg) == "dcp"
    from dcp.attention import DCPCoreAttention

    core = layer_spec(cfg).submodules.self_attention.submodules.core_attention
    assert core is DCPCoreAttention


@pytest.mark.parametrize("te_imports", [True, False])
def test_auto_picks_te_only_when_it_imports(monkeypatch, te_imports):
    """A Transformer Engine that is found but fails to import (e.g. the core wheel alone) counts
    as absent, so ``auto`` builds DCP's torch attention. The device is stood in for: the rule
    under test is the import check."""
    import importlib.machinery
    import sys
    import types

    from dcp.attention import module

    te = types.ModuleType("transformer_engine")
    te.__spec__ = importlib.machinery.ModuleSpec("transformer_engine", None)
    te.__path__ = []
    pytorch = types.ModuleType("transformer_engine.pytorch") if te_imports else None
    monkeypatch.setitem(sys.modules, "transformer_engine", te)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", pytorch)  # None: ImportError
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    module.transformer_engine_usable.cache_clear()
    try:
        assert module.transformer_engine_usable() is te_imports
        assert resolved_attention(ModelConfig()) == ("te" if te_imports else "dcp")
    finally:
        module.transformer_engine_usable.cache_clear()


@no_cuda
def test_te_spec_without_te_or_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match="core_attention=te needs Transformer Engine"):
        check_device_support(ModelConfig(core_attention="te", dtype="bf16"))


def test_te_attention_sees_padding_as_real_tokens():
    """TE ≤ 2.17 misses padding on the last document; DCP passes padded boundaries as real, and
    says there is no padding between sequences."""
    from megatron_patches.te_attention import padded_as_real

    layout = ShardLayout(doc_lens=(5, 3), cp_size=2)  # padded to 8 and 4
    params = padded_as_real(layout.packed_seq_params())
    assert params.cu_seqlens_q.tolist() == [0, 8, 12]
    assert params.cu_seqlens_kv.tolist() == [0, 8, 12]
    assert params.cu_seqlens_q_padded.tolist() == [0, 8, 12]
    assert params.max_seqlen_q == 8
    # No padding between sequences is left, and TE is told so: it would otherwise compare the
    # padded and unpadded boundaries on the device (a host sync per attention call). megatron-core
    # 0.18's PackedSeqParams has no such field to tell it with.
    if "pad_between_seqs" in PackedSeqParams.__dataclass_fields__:  # megatron-core >= 0.19
        assert params.pad_between_seqs is False
    assert padded_as_real(None) is None


@pytest.mark.parametrize("cp_size", [1, 2, 4])
@pytest.mark.parametrize("multiple", [1, 8, 16])
def test_aligned_layout_pads_only_the_last_document(cp_size, multiple):
    lens = [37, 1, 5, 64, 3]
    base = ShardLayout(doc_lens=lens, cp_size=cp_size)
    aligned = ShardLayout.aligned(lens, cp_size=cp_size, local_token_multiple=multiple)
    assert aligned.local_num_tokens % multiple == 0
    assert aligned.padded_lens[:-1] == base.padded_lens[:-1]
    assert 0 <= aligned.padded_lens[-1] - base.padded_lens[-1] < multiple * cp_size
    assert aligned.num_real_tokens == base.num_real_tokens
    assert np.array_equal(aligned.real_mask[: base.num_padded_tokens], base.real_mask)
    assert not aligned.real_mask[base.num_padded_tokens :].any()


@no_cuda
def test_cuda_on_cpu_redirects_only_inside_the_block():
    with cuda_on_cpu():
        t = torch.zeros(2, device="cuda")
        assert t.device.type == "cpu"
        assert t.cuda() is t
        assert t.type() == "torch.cuda.FloatTensor"
        assert torch.tensor([1], dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert torch.zeros(1).type() == "torch.FloatTensor"
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(1, device="cuda")  # outside the block CUDA is still absent


def test_optimizer_bytes_have_one_source():
    assert optimizer_bytes_per_param("fp32") == 8.0
    assert optimizer_bytes_per_param("bf16") == 12.0
    assert Options(dtype="fp32").optimizer_bytes_per_param == 8.0
    assert Options(dtype="bf16").optimizer_bytes_per_param == 12.0
    spec = load_spec("cpu-tiny")
    aligned, changed = with_runtime_options(
        spec, runtime_options(dtype="bf16", distributed_optimizer=True)
    )
    assert aligned["options"]["optimizer_bytes_per_param"] == 12.0
    assert changed["dtype"] == ("fp32", "bf16")
    assert changed["distributed_optimizer"] == (False, True)
    assert spec["options"]["dtype"] == "fp32"  # the loaded spec is not mutated


def test_fp8_speeds_up_only_the_linear_layers_in_the_cost_model():
    from dcp.costmodel import load_cost_model

    spec = load_spec("h200x8+llama3-8b")
    bf16 = load_cost_model(spec).coefficients
    fp8_spec, _ = with_runtime_options(
        spec, runtime_options(dtype="bf16", distributed_optimizer=True, fp8=True)
    )
    fp8_model = load_cost_model(fp8_spec)
    fp8, options = fp8_model.coefficients, fp8_model.options
    # FP8 linear layers run at the preset's share of the FP8 peak, bf16 ones of the bf16 peak.
    cluster = spec["cluster"]
    speedup = (cluster["peak_fp8_tflops"] * options.fp8_linear_efficiency) / (
        cluster["peak_tflops"] * options.linear_efficiency
    )
    assert fp8.linear_s_per_token == pytest.approx(bf16.linear_s_per_token / speedup)
    assert fp8.logits_s_per_token == bf16.logits_s_per_token
    assert fp8.attention_s_per_token2 == bf16.attention_s_per_token2


def test_an_unknown_core_attention_is_refused():
    with pytest.raises(ValueError, match=r"core_attention must be one of .*got 'bogus'"):
        ModelConfig(core_attention="bogus")


@pytest.mark.parametrize("apex", [True, False])
def test_te_spec_asks_for_weight_gradient_fusion_only_with_apex(monkeypatch, apex):
    """TE without apex: megatron's output layer (a plain ColumnParallelLinear) refuses
    ``gradient_accumulation_fusion``, so the TE spec sets it only when apex's kernel is there."""
    from megatron.core.tensor_parallel import layers

    from dcp.model import transformer_config

    monkeypatch.setattr(layers, "_grad_accum_fusion_available", apex)
    cfg = ModelConfig(core_attention="te", dtype="bf16")
    # TE's RoPE and SwiGLU fusions cannot be validated without TE; they are not under test.
    tf = transformer_config(cfg, apply_rope_fusion=False, bias_activation_fusion=False)
    assert tf.gradient_accumulation_fusion is apex


def test_the_local_spec_keeps_a_torch_final_norm_when_te_imports(monkeypatch):
    """megatron makes ``LayerNormImpl`` TE's norm whenever TE imports; the local spec must not
    inherit it (it would not run on a machine where TE cannot)."""
    from megatron.core.transformer import transformer_block
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from dcp.model import RMSNorm, block_spec

    class TENormStandIn:
        pass

    monkeypatch.setattr(transformer_block, "LayerNormImpl", TENormStandIn)
    assert block_spec(ModelConfig(core_attention="megatron_local")).layer_norm is WrappedTorchNorm
    assert block_spec(ModelConfig(core_attention="dcp")).layer_norm is RMSNorm


def test_every_te_attention_layer_shares_one_cp_stream(monkeypatch):
    """TE's ``DotProductAttention`` keeps an instance ``cp_stream`` (None at CP = 1) that
    shadows megatron's class-level one: the CP switch must use (and create once) the class's."""
    from megatron_patches.parallel_state import shared_cp_stream

    made = []
    monkeypatch.setattr(torch.cuda, "Stream", lambda: made.append(object()) or made[-1])

    class MegatronTEAttention:  # megatron's TEDotProductAttention keeps the class attribute
        cp_stream = None

        def __init__(self):
            self.cp_stream = None  # what TE's __init__ does at CP = 1

    class DCPSubclass(MegatronTEAttention):
        pass

    layers = [DCPSubclass() for _ in range(3)]
    streams = {id(shared_cp_stream(m)) for m in layers}
    assert len(made) == 1 and streams == {id(made[0])}
    assert MegatronTEAttention.cp_stream is made[0]


def test_the_gpu_tests_use_only_what_runtime_has():
    """``tests/gpu`` cannot run here: every ``runtime.<name>`` it reads must at least exist on
    ``Runtime`` (a method, a property, or an attribute its methods set), or the first GPU run
    stops there."""
    import ast
    from pathlib import Path

    from dcp.runtime import runtime as runtime_module

    source = Path(runtime_module.__file__).read_text()
    (cls,) = [
        n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "Runtime"
    ]
    known = {n.name for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    known |= {
        node.attr
        for node in ast.walk(cls)
        if isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Store)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    }
    gpu_tests = Path(__file__).resolve().parents[1] / "gpu"
    used = {
        (path.name, node.attr)
        for path in sorted(gpu_tests.glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "runtime"
    }
    assert used, "no runtime.<name> found in tests/gpu"
    missing = sorted((name, attr) for name, attr in used if attr not in known)
    assert not missing, f"tests/gpu reads what Runtime does not have: {missing}"
