"""Config values: every numeric field refuses what no run can use (in one line naming the key and
the range), string fields keep overrides as typed, bad YAML is one line, a model that cannot fit
is refused before it is built."""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from pathlib import Path

import pytest

import dcp.model
from dcp.model import ModelConfig, check_model_fits, model_state_bytes
from dcp.schema import config_keys, load_config
from dcp.train.config import PretrainConfig

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "pretrain/configs/tiny_cpu.yaml"


def _load(*overrides: str) -> PretrainConfig:
    return load_config(PretrainConfig, TINY, list(overrides))


def _refused(*overrides: str) -> str:
    """The one-line message ``overrides`` are refused with."""
    with pytest.raises(ValueError) as info:
        _load(*overrides)
    message = str(info.value)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize(
    "override, match",
    [
        ("optim.lr=inf", r"^optim\.lr must be a finite number > 0, got inf"),
        ("optim.eps=0", r"^optim\.eps must be a finite number > 0, got 0\.0"),
        ("optim.eps=-1", r"^optim\.eps must be a finite number > 0"),
        ("optim.eps=nan", r"^optim\.eps must be a finite number > 0, got nan"),
        ("optim.clip_grad=nan", r"^optim\.clip_grad must be a finite number >= 0"),
        ("optim.weight_decay=nan", r"^optim\.weight_decay must be a finite number >= 0"),
        ("optim.weight_decay=inf", r"^optim\.weight_decay must be a finite number >= 0, got inf"),
        ("model.init_std=inf", r"^model\.init_std must be a finite number > 0, got inf"),
        ("model.norm_eps=-1", r"^model\.norm_eps must be a finite number > 0, got -1\.0"),
        ("model.norm_eps=nan", r"^model\.norm_eps must be a finite number > 0"),
        ("model.rotary_base=inf", r"^model\.rotary_base must be a finite number > 0"),
        (
            "distributed.timeout_s=inf",
            r"^distributed\.timeout_s must be a finite number > 0 and <= 8\.64e\+13",
        ),
        ("distributed.startup_timeout_s=1e300", r"^distributed\.startup_timeout_s must be"),
        (
            "train.seed=-1",
            r"^train\.seed must be an integer >= 0 and <= 9223372036854775807, got -1",
        ),
        ("runs_dir=", r"^runs_dir must be a non-empty path"),
        ("resume.allow_changes=[not_a_key]", r"^resume\.allow_changes: 'not_a_key' is not"),
        ("resume.allow_changes=[optim.lrr]", r"did you mean 'optim\.lr'"),
        # An integer 10**20: every global batch would have been the whole corpus.
        (
            "data.sampler.max_tokens_per_batch=100000000000000000000",
            r"^data\.sampler\.max_tokens_per_batch must be an integer >= 1 and <= 1099511627776",
        ),
        ("data.sampler.max_seqs_per_batch=2000000000000", r"max_seqs_per_batch must be"),
        ("model.moe_router_topk=1", r"^model\.moe_router_topk is set but num_experts is not"),
        ("model.moe_ffn_hidden_size=64", r"^model\.moe_ffn_hidden_size is set but num_experts"),
        (
            "model.num_experts=4 model.moe_router_topk=5",
            r"^model\.moe_router_topk must be an integer >= 1 and <= 4, got 5",
        ),
        ("parallel.expert_parallel_size=2", r"needs model\.num_experts divisible by it"),
        (
            "model.num_experts=3 parallel.expert_parallel_size=2",
            r"needs model\.num_experts divisible by it .* got 3",
        ),
        (
            "model.num_experts=4 parallel.expert_parallel_size=2 checkpoint.interval_steps=0 "
            "planning.planner=static planning.static_cp_size=1",
            r"^planning\.static_cp_size=1 would split expert-parallel groups",
        ),
        (
            "model.num_experts=4 model.dtype=bf16 model.fp8=true model.core_attention=te",
            r"^model\.fp8 is not supported with num_experts",
        ),
        ("model.moe_router_expert_bias=true", r"^model\.moe_router_expert_bias is set but num_"),
        (
            "model.num_experts=4 model.moe_router_expert_bias=true",
            r"^model\.moe_router_expert_bias needs moe_router_score_function=sigmoid",
        ),
        (
            "model.num_experts=4 model.moe_router_score_function=sqrtsoftplus",
            r"^model\.moe_router_score_function: 'sqrtsoftplus' is not one of \['softmax', 'sig",
        ),
        (
            "model.num_experts=4 model.moe_router_score_function=sigmoid "
            "model.moe_router_expert_bias=true model.moe_router_bias_update_rate=0",
            r"^model\.moe_router_bias_update_rate must be .*> 0",
        ),
        ("model.moe_router_num_groups=2", r"^model\.moe_router_num_groups is set but num_exp"),
        (
            "model.moe_router_bias_update_rate=0.02",
            r"^model\.moe_router_bias_update_rate is set but num_experts",
        ),
        (
            "model.num_experts=4 model.moe_router_bias_update_rate=0.02",
            r"^model\.moe_router_bias_update_rate=0\.02 is set but moe_router_expert_bias is not",
        ),
        (
            "model.num_experts=4 model.moe_router_num_groups=2",
            r"^model\.moe_router_num_groups and moe_router_group_topk go together",
        ),
        (
            "model.num_experts=6 model.moe_router_num_groups=4 model.moe_router_group_topk=1",
            r"^model\.moe_router_num_groups \(4\) must divide num_experts \(6\)",
        ),
        (
            "model.num_experts=4 model.moe_router_num_groups=2 model.moe_router_group_topk=3",
            r"^model\.moe_router_group_topk must be an integer >= 1 and <= 2, got 3",
        ),
        (
            "model.num_experts=8 model.moe_router_topk=4 model.moe_router_num_groups=8 "
            "model.moe_router_group_topk=2",
            r"^model\.moe_router_topk \(4\) exceeds the experts of the moe_router_group_topk=2",
        ),
        (
            "model.num_experts=4 model.moe_router_topk_scaling_factor=0",
            r"^model\.moe_router_topk_scaling_factor must be .*> 0",
        ),
    ],
)
def test_unusable_values_are_refused_naming_key_and_range(override, match):
    message = _refused(*override.split())
    assert re.search(match, message), message


@pytest.mark.parametrize("planner", ["megatron", "megatron-dev", "static_per_batch"])
def test_every_planner_is_accepted_at_expert_parallelism(planner):
    """``plan_batch`` keeps every planner's steps on whole EP groups
    (tests/unit/planning/test_experts.py plans with each through the run's ``BatchPlanner``)."""
    cfg = _load(
        "model.num_experts=4",
        "parallel.expert_parallel_size=2",
        "checkpoint.interval_steps=0",
        f"planning.planner={planner}",
    )
    assert cfg.planning.planner == planner and cfg.parallel.expert_parallel_size == 2


def test_virtual_stages_need_a_pipeline_that_splits_the_layers():
    pp2 = "parallel.pipeline_parallel_size=2"
    assert _load(pp2, "parallel.virtual_pipeline_parallel_size=2").parallel.mesh(4).describe() == (
        "TP 1 x PP 2 x VP 2"
    )
    message = _refused("parallel.virtual_pipeline_parallel_size=2")
    assert message.startswith("parallel.virtual_pipeline_parallel_size=2 needs parallel."), message
    message = _refused(pp2, "parallel.virtual_pipeline_parallel_size=3")  # 4 layers over 6
    assert message.startswith("model.num_layers=4 must be a multiple of parallel."), message


def test_experts_train_with_pipeline_stages():
    """Experts with pipeline and virtual stages, at EP 1 and EP 2 (parity:
    tests/distributed/test_partial_recompute.py); an EP size that does not divide a stage's
    planner ranks is the mesh's to refuse."""
    experts = ["model.num_experts=4", "checkpoint.interval_steps=0"]
    pp2 = ["parallel.pipeline_parallel_size=2", "parallel.virtual_pipeline_parallel_size=2"]
    assert _load(*experts, *pp2).parallel.mesh(4).describe() == "TP 1 x PP 2 x VP 2"
    cfg = _load(*experts, *pp2, "parallel.expert_parallel_size=2")
    assert cfg.parallel.mesh(4).expert_parallel_size == 2
    with pytest.raises(ValueError, match="expert_parallel_size=2 must be a power of two"):
        cfg.parallel.mesh(2)  # PP 2 on 2 ranks: one planner rank per stage


@pytest.mark.parametrize("allowed", [["optim.lr"], ["optim"], ["model.rope_scaling.factor"]])
def test_allow_changes_takes_keys_and_sections(allowed):
    assert _load(f"resume.allow_changes=[{','.join(allowed)}]").resume.allow_changes == tuple(
        allowed
    )


def test_nested_sections_are_named_by_their_dotted_path():
    assert _refused("data.sampler.seed=-1").startswith("data.sampler.seed must be")
    assert _refused("model.rope_scaling={type: linear, factor: 0}").startswith(
        "model.rope_scaling.factor must be a finite number > 0"
    )


def _numeric_fields(cls: type, prefix: str = "") -> list[tuple[str, type]]:
    """(dotted key, int or float) of every numeric field under ``cls``, lists of numbers and
    optional ones included."""
    out = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        tp = typing.get_type_hints(cls)[f.name]
        union = typing.get_origin(tp) in (typing.Union, types.UnionType)
        for arg in typing.get_args(tp) if union else (tp,):
            if dataclasses.is_dataclass(arg):
                out += _numeric_fields(arg, f"{key}.")
            elif arg in (int, float):
                out.append((key, arg))
            elif typing.get_origin(arg) is tuple and typing.get_args(arg)[0] in (int, float):
                out.append((key + "[]", typing.get_args(arg)[0]))
    return out


# Overrides that make a field matter (its check runs only in that setting).
_CONTEXT = {
    "model.rope_scaling": ["model.rope_scaling.type=llama3", "model.rope_scaling.factor=8"],
    "model.moe_": ["model.num_experts=4"],
    "data.indexed.blend_num_tokens": ["data.indexed.weights=[1.0]"],
    "data.synthetic.length_choices": ["data.synthetic.length_dist=choice"],
    "data.synthetic.length_weights": [
        "data.synthetic.length_dist=choice",
        "data.synthetic.length_choices=[64]",
    ],
}
_BAD = {int: ["-1", str(2**63)], float: ["nan", "inf", "-inf", str(2**63)]}
"""Values every numeric key refuses: 2**63 by the schema's one bound (``dcp.schema.MAX_NUMBER``;
a seed may take 2**63 - 1), the others by its class's own range."""
NUMERIC_CASES = [(key, bad) for key, tp in _numeric_fields(PretrainConfig) for bad in _BAD[tp]]


def test_the_walk_finds_every_section():
    keys = {key for key, _ in NUMERIC_CASES}
    assert {"optim.eps", "model.rope_scaling.factor", "data.indexed.weights[]"} <= keys
    assert {"data.synthetic.sigma", "metrics.log_interval_steps", "checkpoint.keep_last"} <= keys


@pytest.mark.parametrize("key, bad", NUMERIC_CASES)
def test_every_numeric_field_refuses_non_finite_negative_and_huge_values(key, bad):
    field = key.removesuffix("[]")
    context = [o for prefix, extra in _CONTEXT.items() if field.startswith(prefix) for o in extra]
    value = f"[{bad}]" if key.endswith("[]") else bad
    message = _refused(*context, f"{field}={value}")
    # 2**63 may first break a rule between keys (heads dividing the width): refused all the same.
    section = field.rpartition(".")[0] if bad == str(2**63) else field
    assert message.startswith(section), message


@pytest.mark.parametrize(
    "override, expected",
    [
        ("name=nan", "nan"),
        ("name=2024", "2024"),
        ("name=true", "true"),
        ("name=1e-3", "1e-3"),
        ("name=0x10", "0x10"),
        ("name=2024-01-01", "2024-01-01"),
        ("name=null", "null"),
        ("runs_dir=123", "123"),
        ("planning.spec=1.5", "1.5"),
        ("checkpoint.root_dir=2024", "2024"),
    ],
)
def test_string_fields_keep_the_override_as_typed(override, expected):
    key, _ = override.split("=", 1)
    node = _load(override)
    for part in key.split("."):
        node = getattr(node, part)
    assert node == expected


def test_a_path_read_before_the_config_is_built_keeps_the_text():
    with pytest.raises(ValueError, match="2024 is not a Hugging Face model directory"):
        _load("init.from_hf=2024")


def test_typed_fields_still_parse_overrides():
    cfg = _load("metrics.wandb_group=null", "metrics.wandb_tags=[a, b]", "optim.lr=1e-3")
    assert cfg.metrics.wandb_group is None and cfg.metrics.wandb_tags == ("a", "b")
    assert cfg.optim.lr == pytest.approx(1e-3)
    with pytest.raises(ValueError, match=r"metrics\.wandb_tags\[1\]: expected a string"):
        _load("metrics.wandb_tags=[a, 2]")


def test_only_the_last_override_of_a_key_gives_its_text():
    assert _load("planning={spec: cpu-tiny}", "planning.spec=2024").planning.spec == "2024"
    # A section given as a YAML mapping is read as YAML, also where an earlier override of one
    # of its keys gave text.
    message = _refused("planning.spec=2024", "planning={spec: 2024}")
    assert message == "planning.spec: expected a string, got 2024", message


def test_yaml_file_values_are_not_reread_as_text(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("name: 2024\n")
    with pytest.raises(ValueError, match="name: expected a string, got 2024"):
        load_config(PretrainConfig, path)


@pytest.mark.parametrize(
    "override", ["name=[unclosed", "train.steps={", "metrics.wandb_tags=[a, b", "name='x"]
)
def test_override_that_is_not_yaml_is_one_line(override):
    message = _refused(override)
    assert message.startswith(f"override {override!r}: not valid YAML ("), message


@pytest.mark.parametrize(
    "content",
    [
        b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR",  # not UTF-8
        b"\x00\x01\x02 binary",  # UTF-8 but not printable
        b'"""A module."""\n\nimport os\n\n\ndef main():\n    return os.getcwd()\n',  # Python
        b"model: {hidden_size: 64\n",
        b"- a\n- b\n",  # YAML, but not a mapping
    ],
)
def test_config_file_that_is_not_yaml_is_one_line(tmp_path, content):
    path = tmp_path / "run.yaml"
    path.write_bytes(content)
    with pytest.raises(ValueError) as info:
        load_config(PretrainConfig, path)
    message = str(info.value)
    assert message.startswith(f"config file {path}") and "\n" not in message, message


# Nine levels of nine aliases: a few hundred bytes that expand to 9**9 (387 million) strings.
BILLION_LAUGHS = "\n".join(
    [f"a0: &a0 [{', '.join(['lol'] * 9)}]"]
    + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
)
_PROBE = """
import json, resource, sys, time
from dcp.data.sampler import SamplerConfig
from dcp.schema import load_config
before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.monotonic()
try:
    load_config(SamplerConfig, sys.argv[1])
    error = None
except ValueError as exc:
    error = str(exc)
seconds = time.monotonic() - start
grew_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before_kib
print(json.dumps({"error": error, "seconds": seconds, "peak_kib": before_kib + grew_kib,
                  "grew_kib": grew_kib}))
"""


def test_a_billion_laughs_config_is_refused_at_once_with_bounded_memory(tmp_path):
    """In a child process capped at 1 GiB of address space (the probe must not endanger the
    machine when the loader regresses): refused before anything is expanded."""
    import json
    import resource
    import subprocess
    import sys

    path = tmp_path / "laughs.yaml"
    path.write_text(BILLION_LAUGHS)

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, str(path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=cap,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    assert result["error"].startswith(f"config file {path}: expands to more than"), result
    assert "\n" not in result["error"]
    assert result["seconds"] < 10, result
    assert result["grew_kib"] < 16 << 10, result  # 16 MiB: nothing was expanded


def test_config_keys_lists_fields_and_sections():
    keys = config_keys(PretrainConfig)
    assert {"name", "optim", "optim.lr", "model.rope_scaling.factor", "data.sampler.seed"} <= keys
    assert "optim.lrr" not in keys


GIB = 2**30


@pytest.fixture
def free_memory(monkeypatch):
    """Set the memory this process may use (bytes)."""

    def set_free(num_bytes: int) -> None:
        monkeypatch.setattr(dcp.model, "available_memory_bytes", lambda: num_bytes)

    return set_free


def test_a_model_that_fits_passes(free_memory):
    free_memory(1 * GIB)
    check_model_fits(_load().model, tensor_parallel_size=1)


def test_a_model_too_large_for_memory_is_refused_with_the_numbers(free_memory):
    free_memory(64 * GIB)
    cfg = _load("model.hidden_size=100000").model
    with pytest.raises(ValueError) as info:
        check_model_fits(cfg, tensor_parallel_size=1)
    message = str(info.value)
    assert "\n" not in message
    assert f"{cfg.num_params():,} parameters" in message and "64.0 GiB" in message
    assert "model.hidden_size" in message and "parallel.tensor_parallel_size" in message


@pytest.mark.parametrize(
    "dtype, tp, shards, per_param",
    [
        ("fp32", 1, 1, 4 + 4 + 8),  # fp32 weights are Adam's master copy
        ("bf16", 1, 1, 2 + 4 + 12),  # bf16 weights, fp32 grads, fp32 master + moments
        ("fp32", 2, 1, (4 + 4 + 8) / 2),
        ("bf16", 1, 4, 2 + 4 + 12 / 4),  # distributed optimizer: state sharded
    ],
)
def test_model_state_bytes_per_rank(dtype, tp, shards, per_param):
    cfg = ModelConfig(dtype=dtype)
    need = model_state_bytes(cfg, tensor_parallel_size=tp, optimizer_shards=shards)
    assert need == pytest.approx(cfg.num_params() * per_param)


def test_a_rank_holds_its_share_of_the_experts():
    cfg = ModelConfig(num_experts=8, moe_ffn_hidden_size=64)
    experts = cfg.shape.param_counts().expert
    dense = cfg.num_params() - experts
    assert experts > dense > 0
    # EP 4 without the distributed optimizer: a quarter of the experts, weights and state.
    assert model_state_bytes(cfg, tensor_parallel_size=1, expert_parallel_size=4) == (
        pytest.approx((dense + experts / 4) * (4 + 4 + 8))
    )
    # EP 4 over 8 optimizer shards: the experts' state is sharded over the 2 ranks per expert.
    need = model_state_bytes(
        cfg, tensor_parallel_size=1, expert_parallel_size=4, optimizer_shards=8
    )
    assert need == pytest.approx(dense * (8 + 8 / 8) + experts / 4 * 8 + experts * 8 / 8)


def test_the_limit_is_the_per_rank_need(free_memory):
    cfg = ModelConfig()
    need = model_state_bytes(cfg, tensor_parallel_size=1)
    free_memory(int(need))
    check_model_fits(cfg, tensor_parallel_size=1)
    free_memory(int(need) - 1)
    with pytest.raises(ValueError, match="optim.distributed"):
        check_model_fits(cfg, tensor_parallel_size=1)


def test_cpu_memory_is_shared_by_the_local_ranks(monkeypatch, tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  16000000 kB\nMemAvailable:  8000000 kB\n")
    monkeypatch.setattr(dcp.model, "MEMINFO_PATH", meminfo)
    monkeypatch.setattr(dcp.model.torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert dcp.model.available_memory_bytes() == 8000000 * 1024 // 4


def test_gpu_memory_is_the_free_memory_of_the_ranks_own_gpu(monkeypatch):
    monkeypatch.setattr(dcp.model.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dcp.model.torch.cuda, "mem_get_info", lambda: (5 * GIB, 80 * GIB))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert dcp.model.available_memory_bytes() == 5 * GIB


def test_a_synthetic_corpus_is_bounded_before_it_allocates():
    """10**10 documents asked numpy for 74.5 GiB per rank; the bound refuses it first."""
    from dcp.data.synthetic import MAX_DOCS

    message = _refused(f"data.synthetic.num_docs={10**10}")
    assert message.startswith("data.synthetic.num_docs must be an integer >= 1 and <= "), message
    assert str(MAX_DOCS) in message
    load_config(PretrainConfig, None, [f"data.synthetic.num_docs={MAX_DOCS}"])


def test_seeds_keep_their_64_bit_range():
    seed = 2**63 - 1
    cfg = _load(
        f"train.seed={seed}",
        "data.sampler.max_tokens_per_batch=8192",
        f"data.sampler.seed={seed}",
        "data.source=synthetic",
        "data.indexed=null",
        f"data.synthetic.seed={seed}",
    )
    assert cfg.train.seed == cfg.data.sampler.seed == cfg.data.synthetic.seed == seed


def test_every_router_setting_reaches_megatrons_config():
    """What the model section says of the router is what megatron builds (a key dropped on the
    way would still pass every parity test: routing is per token under any plan)."""
    from dcp.model import transformer_config

    cfg = _load(
        "model.num_experts=4",
        "model.moe_router_score_function=sigmoid",
        "model.moe_router_expert_bias=true",
        "model.moe_router_bias_update_rate=0.02",
        "model.moe_router_num_groups=2",
        "model.moe_router_group_topk=1",
        "model.moe_router_topk_scaling_factor=2.5",
        "model.core_attention=dcp",
        "checkpoint.interval_steps=0",
    )
    config = transformer_config(cfg.model)
    assert config.moe_router_score_function == "sigmoid"
    assert config.moe_router_enable_expert_bias is True
    assert config.moe_router_bias_update_rate == 0.02
    assert (config.moe_router_num_groups, config.moe_router_group_topk) == (2, 1)
    assert config.moe_router_topk_scaling_factor == 2.5
    assert config.moe_router_load_balancing_type == "none" and config.moe_aux_loss_coeff == 0


def test_a_checkpoint_from_before_a_weight_field_existed_holds_its_default(monkeypatch):
    from dcp.train import config as train_config

    source = ("init.from_checkpoint (old)", {"num_experts": 4})  # no moe_router_expert_bias
    monkeypatch.setattr(train_config, "source_model_config", lambda init: source)
    data = {"init": {"from_checkpoint": "old"}, "model": {"moe_router_expert_bias": False}}
    assert train_config.model_from_init(data)["model"]["moe_router_expert_bias"] is False
    data["model"]["moe_router_expert_bias"] = True
    with pytest.raises(ValueError, match=r"contradicts init\.from_checkpoint \(old\): False;"):
        train_config.model_from_init(data)
