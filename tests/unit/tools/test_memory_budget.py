"""tools.memory_budget: the planner's memory rule, broken down per GPU for a recipe."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dcp.costmodel import load_cost_model
from dcp.costmodel.budget import memory_budget
from dcp.costmodel.pipeline import PipelineCosts
from tools import memory_budget as tool

REPO = Path(__file__).resolve().parents[3]


def test_every_cell_agrees_with_the_planners_fits():
    cost_model = load_cost_model("h200x8+llama3-8b")
    budget = memory_budget(cost_model, 131071)
    assert [c.cp_size for c in budget.cells[::3]] == [1, 2, 4, 8]
    for cell in budget.cells:
        assert cell.fits == cost_model.fits([131071], cell.cp_size, cell.recompute)
    assert sum(budget.static_parts.values()) == pytest.approx(cost_model.static_mem_bytes)
    assert not budget.static_calibrated
    # 8.03B params: bf16 weights 2 B + fp32 main grads 4 B, optimizer 12 B sharded over 8.
    params = 8.03e9
    assert budget.static_parts["weights"] == pytest.approx(2 * params, rel=0.01)
    assert budget.static_parts["optimizer"] == pytest.approx(12 * params / 8, rel=0.01)


def test_llama3_8b_recipe_fits_on_h200(capsys):
    assert tool.main(["--config", str(REPO / "pretrain/configs/llama3_8b_h200.yaml")]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["fits"] and out["model_matches_spec"]
    assert out["longest_seq_len"] == 131071
    assert out["static_bytes_per_gpu"] < out["budget_bytes_per_gpu"] < 141e9
    # The longest sequence needs CP: on one GPU it fits at no recompute level.
    assert not any(c["fits"] for c in out["cells"] if c["cp_size"] == 1)


def test_llama3_70b_recipe_fits_at_tp8_on_256_h200s(capsys):
    assert tool.main(["--config", str(REPO / "pretrain/configs/llama3_70b_h200.yaml")]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["fits"] and out["model_matches_spec"]
    assert (out["tensor_parallel_size"], out["num_planner_ranks"]) == (8, 32)
    # 70.6B params, 1/8 per GPU: bf16 weights 2 B, optimizer 12 B sharded over 32 DP x CP ranks.
    params = 70.55e9 / 8
    assert out["static_parts"]["weights"] == pytest.approx(2 * params, rel=0.01)
    assert out["static_parts"]["optimizer"] == pytest.approx(12 * params / 32, rel=0.01)
    assert out["static_bytes_per_gpu"] < out["budget_bytes_per_gpu"]
    # CP sizes are in planner ranks (up to 32); 131K tokens on one TP group fit only with full
    # recompute.
    cp1 = {c["recompute"]: c["fits"] for c in out["cells"] if c["cp_size"] == 1}
    assert cp1 == {"none": False, "selective": False, "full": True}
    assert max(c["cp_size"] for c in out["cells"]) == 32


def test_the_recipes_tp_size_is_the_one_the_budget_uses(capsys):
    """The run config says the TP size, not the spec: the 70B recipe at TP = 4 on the same 256
    GPUs has 64 planner ranks and twice the static bytes per GPU (more than the budget left
    beside the communicators TP = 4 holds: it fits nothing)."""
    config = str(REPO / "pretrain/configs/llama3_70b_h200.yaml")
    assert tool.main(["--config", config]) == 0
    tp8 = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert tool.main(["--config", config, "parallel.tensor_parallel_size=4"]) == 1
    tp4 = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (tp8["tensor_parallel_size"], tp4["tensor_parallel_size"]) == (8, 4)
    assert (tp8["num_planner_ranks"], tp4["num_planner_ranks"]) == (32, 64)
    assert tp4["static_parts"]["weights"] == 2 * tp8["static_parts"]["weights"]


def test_a_recipe_that_cannot_fit_exits_1(capsys):
    code = tool.main([
        "--config", str(REPO / "pretrain/configs/tiny_cpu.yaml"),
        "planning.spec=cpu-tiny+cpu-mem-tight", "model.max_seq_len=400000",
        "data.indexed.max_doc_len=400001",
    ])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 1 and "fits no CP size" in captured.err
    assert json.loads(captured.out.strip().splitlines()[-1])["fits"] is False


def test_the_length_asked_is_answered_or_refused_with_the_key_to_change(capsys):
    """model.max_seq_len=262144 on the 8B recipe used to answer for the data cap's 131,071
    tokens without saying so."""
    config = str(REPO / "pretrain/configs/llama3_8b_h200.yaml")
    assert tool.main(["--config", config, "model.max_seq_len=262144"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "error: model.max_seq_len=262144 asks about 262,144-token sequences, but "
        "data.indexed.max_doc_len=131072 caps the recipe's longest at 131,071; to ask about "
        "262,144 tokens also set data.indexed.max_doc_len=262145"
    )
    longer = ["model.max_seq_len=262144", "data.indexed.max_doc_len=262145"]
    assert tool.main(["--config", config, *longer]) == 0
    printed = capsys.readouterr().out
    out = json.loads(printed.strip().splitlines()[-1])
    assert out["longest_seq_len"] == 262144
    assert out["longest_seq_len_from"] == "model.max_seq_len=262144"
    assert "longest sequence 262,144 tokens (model.max_seq_len=262144):" in printed
    # Without the override the recipe's own cap answers, and the line names it.
    assert tool.main(["--config", config]) == 0
    printed = capsys.readouterr().out
    assert "longest sequence 131,071 tokens (data.indexed.max_doc_len=131072):" in printed
    # The model's own length with the recipe's cap is the same question (n tokens train n - 1).
    assert tool.main(["--config", config, "model.max_seq_len=131072"]) == 0
    capsys.readouterr()


def test_recompute_levels_are_named_by_their_megatron_settings(capsys):
    from dcp.plan import SELECTIVE_RECOMPUTE_MODULES, Recompute
    from megatron_patches.recompute import SELECTIVE_MODULES

    assert SELECTIVE_MODULES == SELECTIVE_RECOMPUTE_MODULES  # what runs is what is said
    assert tool.main(["--config", str(REPO / "pretrain/configs/llama3_8b_h200.yaml")]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = lines.index("recompute levels, as megatron-core TransformerConfig settings:")
    legend = lines[header + 1 : header + 4]
    assert [line.split()[0] for line in legend] == ["none", "selective", "full"]
    assert "recompute_modules=['core_attn', 'mlp']" in legend[1]
    assert "megatron's default modules are ['core_attn'] alone" in legend[1]
    assert legend[2].endswith(Recompute.FULL.megatron_settings)
    assert lines[header + 4].split()[:2] == ["cp", "recompute"]


def test_a_pipeline_spec_is_checked_per_stage(capsys):
    """Llama-3-70B at TP 4, PP 8 on 256 H200s (NVIDIA's recipe's TP and PP): every number is per
    GPU of the tightest stage, with its in-flight micro-steps."""
    spec = "h200x256+llama3-70b-tp4pp8"
    argv = ["--spec", spec, "--max-seq-len", "131072"]
    assert tool.main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (out["pipeline_parallel_size"], out["num_planner_ranks"]) == (8, 8)
    assert out["stage_layers"] == [10] * 8
    costs = PipelineCosts.of(load_cost_model(spec))
    view = costs.planning_model()
    assert out["static_bytes_per_gpu"] == max(out["stage_static_bytes_per_gpu"])
    # The first and last stages hold the embedding and the output layer.
    first, middle, last = (out["stage_static_bytes_per_gpu"][s] for s in (0, 3, 7))
    assert first > middle < last
    for cell in out["cells"]:
        # The planners' own rule for a micro-step with its stage's in-flight company ...
        assert cell["fits"] == view.fits([131072], cell["cp_size"], cell["recompute"])
        # ... and, among small micro-steps, far less.
        assert cell["total_bytes_alone_per_gpu"] < cell["total_bytes_per_gpu"]
    cells = {(c["cp_size"], c["recompute"]): c for c in out["cells"]}
    assert not cells[1, "none"]["fits"] and cells[8, "none"]["fits"]
    assert cells[1, "selective"]["fits_alone"]


def test_spec_mode_needs_the_longest_sequence():
    with pytest.raises(SystemExit) as exc:
        tool.main(["--spec", "h200x256+llama3-70b-tp4pp8"])
    assert exc.value.code == 2


def test_a_chat_recipes_longest_sequence_is_the_models():
    from dcp.schema import load_config
    from dcp.train.config import PretrainConfig

    # Chat data has no document cap of its own: a conversation is as long as the model takes.
    sft = REPO / "pretrain/configs/sft_cpu.yaml"
    cfg = load_config(PretrainConfig, sft, ["model.max_seq_len=1536"])
    assert tool.longest_seq_len(cfg) == (1536, "model.max_seq_len=1536")
