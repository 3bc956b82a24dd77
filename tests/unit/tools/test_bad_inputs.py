"""Bad inputs to the CLIs, given as an operator or an attacker would: each is one line on stderr
and exit code 2, never a traceback (a directory where a file is expected, JSON nested past the
readers' bound, a YAML key given twice, a run name ending in a newline)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dcp.schema import load_config
from dcp.train.config import PretrainConfig
from tools import costmodel_check, memory_budget, plan, wandb_dashboard

DEEP = "[" * 5000 + "]" * 5000
"""JSON nested far past ``dcp.files.MAX_NESTING`` (and past Python's recursion limit)."""


def _one_error_line(capsys, *parts: str) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    for part in parts:
        assert part in lines[0], (part, lines[0])
    return lines[0]


@pytest.fixture()
def lengths(tmp_path) -> Path:
    path = tmp_path / "lengths.json"
    path.write_text(json.dumps([100, 200]))
    return path


@pytest.mark.parametrize(
    "argv",
    [
        lambda d, lengths: (plan, ["--lengths", str(d), "--spec", "cpu-tiny"]),
        lambda d, lengths: (memory_budget, ["--config", str(d)]),
        lambda d, lengths: (wandb_dashboard, ["--publish", str(d), "--entity", "e"]),
    ],
    ids=["plan --lengths", "memory_budget --config", "wandb_dashboard --publish"],
)
def test_a_directory_where_a_file_is_expected_is_one_line(tmp_path, lengths, capsys, argv):
    tool, args = argv(tmp_path, lengths)
    assert tool.main(args) == 2
    _one_error_line(capsys, f"{tmp_path}: a directory (expected a")


def test_a_directory_as_the_run_config_is_one_line(tmp_path):
    """What ``pretrain_gpt --config DIR`` reports on every rank."""
    with pytest.raises(ValueError, match=rf"^config file {tmp_path}: a directory \(expected") as e:
        load_config(PretrainConfig, tmp_path)
    assert "\n" not in str(e.value)


def test_deeply_nested_json_in_a_planner_option_is_one_line(lengths, capsys):
    assert plan.main(["--lengths", str(lengths), "--spec", "cpu-tiny", f"--option=x={DEEP}"]) == 2
    _one_error_line(capsys, "--option x: nested deeper than")


def test_planner_options_still_take_plain_words_and_json(lengths, capsys):
    assert plan.parse_options(["recompute=full", "limit=3", "xs=[1, 2]"]) == {
        "recompute": "full",
        "limit": 3,
        "xs": [1, 2],
    }
    assert plan.main(["--lengths", str(lengths), "--spec", "cpu-tiny", "--option=x=[1,"]) == 2
    _one_error_line(capsys, "--option x: not valid JSON")


def test_deeply_nested_json_in_a_published_table_is_one_line(tmp_path, capsys):
    table = tmp_path / "table.jsonl"
    table.write_text(DEEP + "\n")
    assert costmodel_check.main(["--published", str(table)]) == 2
    _one_error_line(capsys, f"{table}:1: nested deeper than")


def test_a_yaml_key_given_twice_is_refused_naming_it(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("train:\n  steps: 3\nname: a\ntrain:\n  steps: 5\n")
    assert memory_budget.main(["--config", str(config)]) == 2
    _one_error_line(capsys, str(config), "found the key 'train' a second time at line 4")


def test_a_run_name_ending_in_a_newline_is_refused(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text('name: "run\\n"\n')
    with pytest.raises(ValueError, match="name must be letters, digits"):
        load_config(PretrainConfig, config)


def test_a_legacy_checkpoint_of_shared_references_is_one_line_at_start(tmp_path, capsys):
    """``init.from_checkpoint`` reads the checkpoint's config while the run config loads (here
    through ``tools.memory_budget``): the legacy ``extra.pt`` of 10^9 leaves is refused there."""
    import torch

    from tests.legacy_checkpoint import write_legacy

    node: dict = {f"k{i}": "lol" for i in range(10)}
    for _ in range(8):
        node = {f"k{i}": node for i in range(10)}
    state = {
        "model_state": torch.nn.Linear(2, 2).state_dict(),
        "rng_state": {},
        "extra": {"config": {"name": "old", "model": node}},
    }
    path = write_legacy(tmp_path / "ckpt", 1, [state])
    config = Path(__file__).resolve().parents[3] / "pretrain/configs/tiny_cpu.yaml"
    assert memory_budget.main(["--config", str(config), f"init.from_checkpoint={path}"]) == 2
    _one_error_line(capsys, f"{path / 'extra.pt'}: expands to more than")
