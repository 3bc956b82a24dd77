"""Hugging Face ↔ DCP conversion without processes: config mapping, round trips, sharding."""

from __future__ import annotations

import json
import logging
import stat

import pytest
import torch
from safetensors.torch import load_file

from dcp.checkpoint.hf import dcp_to_hf, hf_to_dcp
from dcp.weights.convert import SAFETENSORS_INDEX, hf_shards
from dcp.weights.hf_config import hf_config_from_model, model_config_from_hf, read_hf_config
from tests.hf_models import ARCH_CONFIGS, MIXTURES_OF_EXPERTS, make_hf_model
from tests.payload import rewrite_manifest


def _tensors(hf_dir) -> dict[str, torch.Tensor]:
    out = {}
    for file in hf_shards(hf_dir):
        out.update(load_file(hf_dir / file))
    return out


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {arch: make_hf_model(arch, root / arch) for arch in ARCH_CONFIGS}


@pytest.mark.parametrize("arch", sorted(ARCH_CONFIGS))
def test_hf_dcp_hf_round_trip_is_bit_identical_and_loads_cleanly(arch, hf_dirs, tmp_path):
    import transformers

    source = hf_dirs[arch]
    ckpt = hf_to_dcp(source, tmp_path / "dcp", make_vocab_size_divisible_by=128)
    first = dcp_to_hf(ckpt, tmp_path / "hf1")
    # Every tensor of the source comes back bit for bit (a tied lm_head is not stored).
    original, exported = _tensors(source), _tensors(first)
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    # export → import → export: identical files.
    second = dcp_to_hf(hf_to_dcp(first, tmp_path / "dcp2"), tmp_path / "hf2")
    assert (first / "model.safetensors").read_bytes() == (second / "model.safetensors").read_bytes()
    # transformers reads the export with no missing, unexpected or mismatched keys, and the
    # same config as the source for every field that shapes the forward pass.
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        first, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    src_cfg = transformers.AutoConfig.from_pretrained(source)
    fields = ["rope_parameters", "head_dim", "tie_word_embeddings", "num_key_value_heads"]
    if arch in MIXTURES_OF_EXPERTS:
        fields += ["num_local_experts", "num_experts_per_tok", "intermediate_size"]
        fields += ["moe_intermediate_size", "norm_topk_prob"] if arch == "qwen3_moe" else []
    for field in fields:
        if hasattr(src_cfg, field):  # Qwen2's config has no head_dim
            # Mixtral's config leaves head_dim None for hidden / heads, which DCP writes out.
            expected = getattr(src_cfg, field)
            if field == "head_dim" and expected is None:
                expected = src_cfg.hidden_size // src_cfg.num_attention_heads
            assert getattr(model.config, field) == expected, field
    # The round trip's loss is the source's (the same weights, the same routing).
    tokens = torch.arange(40).reshape(1, 40) * 7 % 300
    source_model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    with torch.no_grad():
        before = source_model(tokens, labels=tokens).loss
        after = model(tokens, labels=tokens).loss
    assert torch.equal(before, after), (before, after)


def test_vocab_padding_rows_are_zero_in_dcp_and_dropped_on_export(hf_dirs, tmp_path):
    from dcp.checkpoint import open_checkpoint

    ckpt = hf_to_dcp(hf_dirs["llama"], tmp_path / "dcp", make_vocab_size_divisible_by=128)
    emb = open_checkpoint(ckpt).whole("embedding.word_embeddings.weight")
    assert emb.shape[0] == 384  # 300 rounded up to 128s
    assert torch.count_nonzero(emb[300:]) == 0
    assert torch.count_nonzero(emb[:300]) > 0
    out = dcp_to_hf(ckpt, tmp_path / "hf")
    assert _tensors(out)["model.embed_tokens.weight"].shape[0] == 300
    mode = stat.S_IMODE((out / "model.safetensors").stat().st_mode)
    assert mode == stat.S_IMODE((out / "config.json").stat().st_mode)  # safetensors: 0600


def test_export_shards_and_reimports(hf_dirs, tmp_path):
    ckpt = hf_to_dcp(hf_dirs["qwen2"], tmp_path / "dcp")
    out = dcp_to_hf(ckpt, tmp_path / "hf", max_shard_bytes=20_000)
    index = json.loads((out / SAFETENSORS_INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    # Readable as config.json is (safetensors itself writes 0600).
    modes = {stat.S_IMODE((out / name).stat().st_mode) for name in [*shards, "config.json"]}
    assert modes == {stat.S_IMODE((out / "config.json").stat().st_mode)}, modes
    assert _tensors(out).keys() == _tensors(hf_dirs["qwen2"]).keys()
    again = dcp_to_hf(hf_to_dcp(out, tmp_path / "dcp2"), tmp_path / "hf2")
    for name, tensor in _tensors(again).items():
        assert torch.equal(tensor, _tensors(hf_dirs["qwen2"])[name]), name


def test_progress_reports_every_tensor(hf_dirs, tmp_path):
    seen = []
    hf_to_dcp(hf_dirs["qwen3"], tmp_path / "dcp", progress=lambda d, t, n: seen.append((d, t)))
    total = len(_tensors(hf_dirs["qwen3"]))
    assert seen[-1] == (total, total) and len(seen) == total


def test_tied_checkpoint_with_a_different_lm_head_is_refused(hf_dirs, tmp_path):
    from safetensors.torch import save_file

    source = hf_dirs["qwen2"]  # tied
    tensors = _tensors(source)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"] + 1
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((source / "config.json").read_text())
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match="lm_head.weight differs"):
        hf_to_dcp(bad, tmp_path / "dcp")


def test_missing_tensor_is_named_before_any_tensor_is_read(hf_dirs, tmp_path, monkeypatch):
    from safetensors.torch import save_file

    from dcp.weights import convert

    tensors = _tensors(hf_dirs["llama"])
    del tensors["model.layers.1.mlp.up_proj.weight"]
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((hf_dirs["llama"] / "config.json").read_text())
    save_file(tensors, str(bad / "model.safetensors"))
    monkeypatch.setattr(convert, "iter_hf_tensors", None)  # the headers name what is missing
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        hf_to_dcp(bad, tmp_path / "dcp")


# -- config.json ----------------------------------------------------------------------------
def _cfg(hf_dirs, arch: str) -> dict:
    return read_hf_config(hf_dirs[arch])


@pytest.mark.parametrize(
    ("arch", "field", "value"),
    [
        ("mistral", "sliding_window", 4096),
        ("qwen2", "use_sliding_window", True),
        ("llama", "hidden_act", "gelu"),
        ("llama", "attention_bias", True),
        ("llama", "mlp_bias", True),
        ("llama", "model_type", "gpt2"),
        ("llama", "rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}),
        # Routers and experts DCP's model cannot reproduce (docs/design.md, 'Weights').
        ("mixtral", "router_jitter_noise", 0.01),
        ("mixtral", "output_router_logits", True),
        ("mixtral", "num_experts_per_tok", 1),
        ("mixtral", "num_local_experts", 0),
        ("mixtral", "sliding_window", 4096),
        ("qwen3_moe", "norm_topk_prob", False),
        ("qwen3_moe", "mlp_only_layers", [1]),
        ("qwen3_moe", "decoder_sparse_step", 2),
        ("qwen3_moe", "moe_intermediate_size", 1.5),
    ],
)
def test_unsupported_config_fields_are_named(hf_dirs, arch, field, value):
    hf = dict(_cfg(hf_dirs, arch), **{field: value})
    with pytest.raises(ValueError, match=field if field != "rope_parameters" else "yarn"):
        model_config_from_hf(hf)


def test_old_style_rope_fields_and_unknown_fields(hf_dirs, caplog):
    hf = _cfg(hf_dirs, "llama31")
    params = hf.pop("rope_parameters")
    old = dict(hf, rope_theta=params.pop("rope_theta"), rope_scaling=params, brand_new_field=1)
    with caplog.at_level(logging.WARNING):
        old_cfg = model_config_from_hf(old)
    assert "brand_new_field" in caplog.text
    assert old_cfg == model_config_from_hf(_cfg(hf_dirs, "llama31"))
    assert old_cfg.rope_scaling.type == "llama3" and old_cfg.rotary_base == 500000.0


def test_derived_model_configs(hf_dirs):
    qwen3 = model_config_from_hf(_cfg(hf_dirs, "qwen3"), max_seq_len=4096)
    assert qwen3.qk_layernorm and qwen3.kv_channels == 16 and qwen3.max_seq_len == 4096
    qwen2 = model_config_from_hf(_cfg(hf_dirs, "qwen2"))
    assert qwen2.add_qkv_bias and qwen2.tie_embeddings and qwen2.kv_channels is None
    with pytest.raises(ValueError, match="cannot be written as llama"):
        hf_config_from_model(qwen2, kind="llama")


def test_derived_mixture_of_experts_configs(hf_dirs, caplog):
    with caplog.at_level(logging.WARNING):
        mixtral = model_config_from_hf(_cfg(hf_dirs, "mixtral"))
        qwen3_moe = model_config_from_hf(_cfg(hf_dirs, "qwen3_moe"))
    assert "not used" not in caplog.text  # every expert field is read or checked
    assert (mixtral.num_experts, mixtral.moe_router_topk, mixtral.moe_ffn_hidden_size) == (
        4,
        2,
        None,
    )
    assert not mixtral.qk_layernorm and mixtral.ffn_hidden_size == 72
    assert (qwen3_moe.num_experts, qwen3_moe.moe_ffn_hidden_size) == (4, 24)
    assert qwen3_moe.qk_layernorm and qwen3_moe.kv_channels == 16
    # Older Qwen3-MoE files name the expert count num_experts (transformers 5 writes the other).
    older = dict(_cfg(hf_dirs, "qwen3_moe"))
    older["num_experts"] = older.pop("num_local_experts")
    assert model_config_from_hf(older) == qwen3_moe
    # Expert fields in a dense architecture's file are reported, not silently dropped.
    with caplog.at_level(logging.WARNING):
        model_config_from_hf(dict(_cfg(hf_dirs, "llama"), num_local_experts=8))
    assert "num_local_experts" in caplog.text


def test_export_copies_the_runs_hf_tokenizer(hf_dirs, tmp_path):
    import shutil

    tok = tmp_path / "tokenizer"
    tok.mkdir()
    (tok / "tokenizer.json").write_text('{"model": {}}')
    (tok / "tokenizer_config.json").write_text("{}")
    prefix = tmp_path / "corpus"
    (tmp_path / "corpus.meta.json").write_text(json.dumps({"tokenizer": f"hf:{tok}"}))
    converted = hf_to_dcp(hf_dirs["llama"], tmp_path / "dcp")
    # The run that trained on the tokenized corpus records it in its shared state.
    ckpt = tmp_path / "run" / "step_000005"
    shutil.copytree(converted, ckpt)
    shared = json.loads((ckpt / "shared.json").read_text())
    shared["extra"]["config"]["data"] = {"indexed": {"prefixes": [str(prefix)]}}
    (ckpt / "shared.json").write_text(json.dumps(shared))
    rewrite_manifest(ckpt)
    out = dcp_to_hf(ckpt.parent, tmp_path / "hf")
    assert (out / "tokenizer.json").read_text() == '{"model": {}}'
    assert (out / "tokenizer_config.json").is_file()
    with pytest.raises(ValueError, match="not empty"):
        dcp_to_hf(ckpt, out)


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 256},
    ],
)  # fmt: skip
def test_rope_frequencies_equal_transformers(hf_dirs, scaling):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from dcp.model import rope_inv_freq

    hf = dict(_cfg(hf_dirs, "llama"), rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    if scaling is not None:
        hf["rope_parameters"] = dict(scaling, rope_theta=5e5)
    ours = rope_inv_freq(model_config_from_hf(hf))
    config = transformers.LlamaConfig(**{k: v for k, v in hf.items() if k != "model_type"})
    kind = hf["rope_parameters"]["rope_type"]
    if kind == "default":
        ref = 1.0 / (5e5 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
    else:
        ref, _ = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
    assert torch.allclose(ours, ref.float(), rtol=1e-6, atol=0), (ours, ref)


def test_repad_vocab_keeps_the_real_rows_and_zeroes_the_padding():
    import torch

    from dcp.weights.canonical import repad_vocab

    real = torch.arange(5 * 3, dtype=torch.float32).reshape(5, 3)
    padded = torch.cat([real, torch.full((3, 3), 7.0)])  # another run's padding rows
    out = repad_vocab(padded, 6, vocab_size=5, name="w")
    assert torch.equal(out[:5], real) and torch.equal(out[5:], torch.zeros(1, 3))
    assert repad_vocab(real, 5, vocab_size=5, name="w") is real
    assert torch.equal(repad_vocab(real, 8, vocab_size=5, name="w")[:5], real)
    with pytest.raises(ValueError, match="cannot hold the 5-token vocabulary"):
        repad_vocab(real[:4], 8, vocab_size=5, name="w")


@pytest.mark.parametrize(
    ("source", "model", "message"),
    [
        ("llama", {"num_experts": 4}, r"num_experts=4\) cannot be written as llama; use mixtral$"),
        (
            "mixtral",
            {"moe_shared_expert_intermediate_size": 16},
            r"moe_shared_expert_intermediate_size=16: mixtral has no shared expert",
        ),
        (
            "mixtral",
            {"moe_router_score_function": "sigmoid"},
            r"moe_router_score_function=sigmoid, moe_router_expert_bias=False: mixtral routes by "
            r"a softmax without an expert bias",
        ),
        (
            "mixtral",
            {"moe_router_num_groups": 2, "moe_router_group_topk": 1},
            r"moe_router_num_groups=2, moe_router_group_topk=1: mixtral routes every token "
            r"among all experts",
        ),
    ],
)
def test_export_of_what_the_architecture_cannot_hold_is_refused(
    hf_dirs, tmp_path, source, model, message
):
    # One line before anything is written: experts exported as a dense architecture, a shared
    # expert or a sigmoid router (and its expert bias), which neither Mixtral nor Qwen3-MoE has.
    import shutil

    ckpt = tmp_path / "run" / "step_000001"
    shutil.copytree(hf_to_dcp(hf_dirs[source], tmp_path / "dcp"), ckpt)
    shared = json.loads((ckpt / "shared.json").read_text())
    shared["extra"]["config"]["model"].update(model)
    (ckpt / "shared.json").write_text(json.dumps(shared))
    rewrite_manifest(ckpt)
    with pytest.raises(ValueError, match=message):
        dcp_to_hf(ckpt, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
