"""Config plumbing: YAML + key.sub=value overrides, unknown keys and bad values name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from dcp.model import ModelConfig
from dcp.optim import OptimConfig, lr_at
from dcp.schema import apply_overrides, from_dict, load_config, to_dict
from dcp.train.config import PretrainConfig

REPO = Path(__file__).resolve().parents[3]


def test_tiny_cpu_yaml_loads_and_round_trips():
    cfg = load_config(PretrainConfig, REPO / "pretrain/configs/tiny_cpu.yaml")
    assert cfg.name == "demo" and cfg.planning.planner == "dcp"
    assert cfg.data.indexed.prefixes == ("data/stdlib",)
    assert from_dict(PretrainConfig, to_dict(cfg)) == cfg


def test_overrides_beat_yaml_and_parse_values():
    cfg = load_config(
        PretrainConfig,
        REPO / "pretrain/configs/tiny_cpu.yaml",
        ["train.steps=7", "planning.planner=static", "optim.lr=1e-3", "metrics.wandb_tags=[a, b]"],
    )
    assert cfg.train.steps == 7 and cfg.planning.planner == "static"
    assert cfg.optim.lr == pytest.approx(1e-3)
    assert cfg.metrics.wandb_tags == ("a", "b")


def test_the_old_dcp_section_is_read_as_planning_with_a_warning(tmp_path, caplog):
    """The ``planning:`` section was called ``dcp:``; the old name is read for one release."""
    old = tmp_path / "old.yaml"
    old.write_text("dcp:\n  planner: static\n  static_cp_size: 2\n")
    with caplog.at_level("WARNING", logger="dcp.schema"):
        cfg = load_config(PretrainConfig, old, ["dcp.spec=cpu-tiny", "resume.allow_changes=[dcp]"])
    assert cfg.planning.planner == "static" and cfg.planning.static_cp_size == 2
    assert cfg.planning.spec == "cpu-tiny"
    assert cfg.resume.allow_changes == ("planning",)
    assert "config section 'dcp' is now 'planning'" in caplog.text
    # Set under both names: once is fine, two different values are refused by name.
    assert load_config(PretrainConfig, old, ["planning.planner=static"]).planning.planner == (
        "static"
    )
    with pytest.raises(ValueError, match=r"dcp\.planner='static' and planning\.planner='dcp'"):
        load_config(PretrainConfig, old, ["planning.planner=dcp"])


def test_a_checkpoint_config_with_the_old_section_name_reads_as_the_new_one():
    from dcp.schema import rename_sections

    saved = {"name": "demo", "dcp": {"planner": "static"}}
    assert rename_sections(PretrainConfig, saved, warn=False) == {
        "name": "demo",
        "planning": {"planner": "static"},
    }
    assert from_dict(PretrainConfig, saved).planning.planner == "static"


@pytest.mark.parametrize(
    "override, match",
    [
        ("model.hiden_size=64", r"unknown config key model\.hiden_size"),
        ("trian.steps=3", r"unknown config key trian"),
        ("train.steps=0", r"train\.steps must be an integer >= 1, got 0"),
        ("model.num_query_groups=3", r"num_query_groups"),
        ("planning.planner=fast", r"planning\.planner must be one of .*got 'fast'"),
        ("planning.on_oversize=raise", r"planning\.on_oversize must be one of \('error', 'drop'\)"),
        ("planning.static_recompute=some", r"planning\.static_recompute must be one of"),
        ("optim.lr=abc", r"optim\.lr: expected a number"),
        ("metrics.wandb_mode=sometimes", r"metrics\.wandb_mode must be one of"),
        ("train.steps", r"must look like key\.sub=value"),
    ],
)
def test_bad_config_names_the_key(override, match):
    with pytest.raises(ValueError, match=match):
        load_config(PretrainConfig, REPO / "pretrain/configs/tiny_cpu.yaml", [override])


def test_missing_config_file_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_config(PretrainConfig, tmp_path / "nope.yaml")


def test_apply_overrides_does_not_mutate_input():
    data = {"a": {"b": 1}}
    out = apply_overrides(data, ["a.c=2"])
    assert data == {"a": {"b": 1}} and out == {"a": {"b": 1, "c": 2}}


def test_model_config_validation_and_param_count():
    with pytest.raises(ValueError, match="divisible by num_attention_heads"):
        ModelConfig(hidden_size=130, num_attention_heads=4)
    cfg = ModelConfig()
    h, f, v, kv = 128, 352, 257, 2 * 32
    expected = 4 * (h * (h + 2 * kv) + h * h + 3 * h * f + 2 * h) + 2 * v * h + h
    assert cfg.num_params() == expected


def test_lr_schedule_warmup_then_cosine_to_min():
    cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=4, decay_steps=14)
    assert [lr_at(s, cfg) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lr_at(9, cfg) == pytest.approx(0.55)
    assert lr_at(14, cfg) == pytest.approx(0.1) and lr_at(100, cfg) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="min_lr"):
        OptimConfig(lr=1.0, min_lr=2.0)


def test_h200_recipe_is_a_valid_config():
    cfg = load_config(PretrainConfig, REPO / "pretrain/configs/llama3_8b_h200.yaml")
    assert cfg.model.dtype == "bf16" and cfg.planning.spec == "h200x8+llama3-8b"


def test_70b_recipe_runs_tp8_on_256_h200s_and_its_spec_agrees():
    from dcp.costmodel import load_cost_model
    from dcp.mesh import Mesh

    cfg = load_config(PretrainConfig, REPO / "pretrain/configs/llama3_70b_h200.yaml")
    assert cfg.parallel.tensor_parallel_size == 8 and cfg.model.dtype == "bf16"
    spec = load_cost_model(cfg.planning.spec, mesh=Mesh(256, tensor_parallel_size=8))
    assert spec.num_ranks == 32  # one planner rank per node's TP group
    assert (spec.model.num_layers, spec.model.hidden_size) == (80, 8192)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (
            ["parallel.tensor_parallel_size=0"],
            r"parallel\.tensor_parallel_size must be an integer >= 1",
        ),
        (["parallel.tensor_parallel_size=3"], r"model\.num_attention_heads=4 must be divisible"),
        (
            ["parallel.tensor_parallel_size=2", "model.make_vocab_size_divisible_by=1"],
            r"padded vocabulary \(257 rows\) must be divisible .*make_vocab_size_divisible_by",
        ),
    ],
)
def test_tensor_parallel_size_must_split_the_model(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_config(PretrainConfig, REPO / "pretrain/configs/tiny_cpu.yaml", overrides)


def _hf_config_dir(path, **fields):
    import json

    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama", **fields}))
    return path


def test_context_extension_recipes_derive_the_model_from_config_json(tmp_path):
    llama3_8b = _hf_config_dir(
        tmp_path / "llama3-8b",
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
    )  # fmt: skip
    cfg = load_config(
        PretrainConfig,
        REPO / "pretrain/configs/extend_context_llama3_8b.yaml",
        [f"init.from_hf={llama3_8b}"],
    )
    assert (cfg.model.num_layers, cfg.model.num_query_groups, cfg.model.vocab_size) == (
        32, 8, 128256,
    )  # fmt: skip
    assert cfg.model.max_seq_len == 65536 and cfg.model.rotary_base == 8e6
    tiny = _hf_config_dir(
        tmp_path / "tiny",
        vocab_size=257, hidden_size=128, intermediate_size=352, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-5,
    )  # fmt: skip
    cfg = load_config(
        PretrainConfig, REPO / "pretrain/configs/extend_context_cpu.yaml", [f"init.from_hf={tiny}"]
    )
    assert cfg.model.hidden_size == 128 and cfg.model.rotary_base == 40000
    assert cfg.data.indexed.max_doc_len == 2048


def test_sft_cpu_yaml_reads_chat_data_and_every_chat_key_is_checked():
    cfg = load_config(PretrainConfig, REPO / "pretrain/configs/sft_cpu.yaml")
    assert cfg.data.source == "chat" and cfg.data.dataset_config is cfg.data.chat
    assert cfg.data.chat.path == "data/demo_chats.jsonl" and cfg.data.chat.tokenizer == "byte"
    assert from_dict(PretrainConfig, to_dict(cfg)) == cfg
    sft = REPO / "pretrain/configs/sft_cpu.yaml"
    for overrides, match in [
        (["data.chat=null"], "set data.chat.path when data.source=chat"),
        (["data.source=synthetic"], "data.source=synthetic reads no chat data"),
        (["data.synthetic.max_len=300"], "data.source=chat reads no synthetic data"),
        (["data.indexed={prefixes: [x]}"], "data.source=chat reads no indexed data"),
        (["data.chat.tokenizer=sentencepiece"], "data.chat.tokenizer='sentencepiece'"),
        (["data.chat.tokenizer=hf"], "tokenizer_path: required with tokenizer=hf"),
        (["data.chat.tokenizer_path=/tmp"], "not taken by tokenizer=byte"),
        (["data.chat.template=llama"], "template"),
    ]:
        with pytest.raises(ValueError, match=match):
            load_config(PretrainConfig, sft, overrides)
