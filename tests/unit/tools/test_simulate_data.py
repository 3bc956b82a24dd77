"""``python -m tools.simulate --data``: the planners on batches drawn from a user's own corpus."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from dcp.data.indexed import megatron_indexed_dataset
from dcp.data.lengths import corpus_doc_lengths
from tools import simulate as simulate_cli

REPO = Path(__file__).resolve().parents[3]


def _run(tmp_path, data, *extra) -> dict:
    out = tmp_path / "out"
    code = simulate_cli.main(
        ["--data", str(data), "--spec", "cpu-tiny", "--out-dir", str(out), *extra]
    )
    assert code == 0
    return json.loads((out / "data_results.json").read_text())


def test_jsonl_lengths_are_sampled_planned_and_bounded(tmp_path, capsys):
    rng = np.random.default_rng(3)
    lengths = rng.integers(50, 1500, size=300)
    data = tmp_path / "lengths.jsonl"
    data.write_text(
        "".join(f"{n}\n" if i % 2 else f'{{"length": {n}}}\n' for i, n in enumerate(lengths))
    )
    got = _run(tmp_path, data, "--batch-tokens", "4000", "--batches", "3", "--max-seq-len", "1000")
    assert got["simulated"] is True and got["calibrated"] is True and got["spec"] == "cpu-tiny"
    assert len(got["batch_tokens"]) == 3 and all(t <= 4000 for t in got["batch_tokens"])
    for planner in ("dcp", "static", "megatron", "static-oracle"):
        times = got[planner]["step_time_s"]
        assert len(times) == 3
        assert all(t >= lb * (1 - 1e-9) for t, lb in zip(times, got["lower_bound_s"], strict=True))
    assert sum(got["dcp"]["mix"].values()) == sum(got["batch_lengths"])
    table = capsys.readouterr().out
    assert "SIMULATED on the calibrated cost model of cpu-tiny" in table
    assert "DCP vs megatron" in table and "DCP's sequences by CP size/recompute" in table


def test_a_gpu_preset_says_which_published_rows_checked_it(tmp_path, capsys):
    """On a GPU preset the output says which published rows its coefficients were checked on
    (the H200's stand on the H100's rows); on the CPU preset nothing is claimed."""
    data = tmp_path / "lengths.jsonl"
    data.write_text("".join(f"{n}\n" for n in [4096, 8192, 300, 20000] * 20))
    out = tmp_path / "out"
    argv = ["--data", str(data), "--batch-tokens", "65536", "--batches", "1", "--out-dir", str(out)]
    argv += ["--planners", "dcp,static"]
    assert simulate_cli.main([*argv, "--spec", "h200x8+llama3-8b"]) == 0
    check = json.loads((out / "data_results.json").read_text())["cost_model_check"]
    assert check["preset"] == "h200" and check["checked_on"] == "h100"
    assert check["modelled"] >= 10 and check["worst_abs_rel_error"] <= 0.30
    line = capsys.readouterr().out.splitlines()[1]
    assert line.startswith("cost model: the h200 preset, checked against ")
    assert "published H100 training rows" in line and "bf16 linear layers are unchecked" in line
    assert simulate_cli.main([*argv, "--spec", "cpu-tiny"]) == 0
    assert "cost_model_check" not in json.loads((out / "data_results.json").read_text())
    assert "cost model:" not in capsys.readouterr().out


def test_an_indexed_dataset_is_read_from_its_index_and_chunked_like_the_trainer(tmp_path):
    prefix = tmp_path / "corpus"
    builder = megatron_indexed_dataset().IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for n in (30, 700, 2500, 90):
        builder.add_document(np.arange(n) % 200, [n])
    builder.finalize(f"{prefix}.idx")
    # 2500 tokens at max_doc_len 1001: chunks of 1001, 1001 and 500 (one boundary token shared).
    assert sorted(corpus_doc_lengths(prefix, max_doc_len=1001)) == [30, 90, 500, 700, 1001, 1001]
    got = _run(
        tmp_path, prefix, "--batch-tokens", "3000", "--batches", "2", "--max-seq-len", "1000"
    )
    assert got["data"] == str(prefix) and len(got["dcp"]["step_time_s"]) == 2


@pytest.mark.parametrize(
    "content, extra, message",
    [
        (
            '{"length": 10}\n"ten"\n',
            ["--batch-tokens", "100"],
            r"lengths.jsonl:2: expected a length",
        ),
        ("10\n", [], "--data needs --spec and --batch-tokens"),
        ("5000\n", ["--batch-tokens", "100"], "raise --batch-tokens or split long documents"),
    ],
)
def test_bad_input_is_one_error_line(tmp_path, capsys, content, extra, message):
    data = tmp_path / "lengths.jsonl"
    data.write_text(content)
    args = ["--data", str(data), "--out-dir", str(tmp_path / "o"), *extra]
    if extra:
        args += ["--spec", "cpu-tiny"]
    assert simulate_cli.main(args) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: ") and message.replace("\\", "") in last, last


def test_every_plan_made_is_reported_to_the_progress_display():
    from dcp.costmodel import load_cost_model
    from dcp.planning.sweep import simulate_batches

    rng = np.random.default_rng(5)
    batches = [rng.integers(50, 1500, size=20).tolist() for _ in range(3)]
    made = []
    row = simulate_batches(
        load_cost_model("cpu-tiny"),
        batches,
        label="progress",
        max_seq_len=1500,
        on_plan=lambda: made.append(1),
    )
    plans = sum(len(v["plan_ms"]) for v in row.values() if isinstance(v, dict) and "plan_ms" in v)
    assert len(made) == plans >= 4 * len(batches)  # dcp, three-level, static, oracle, megatron


def test_help_names_folders_that_exist(capsys):
    """``--help`` named dcp/profiles, a folder that does not exist."""
    with pytest.raises(SystemExit):
        simulate_cli.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    folders = re.findall(r"\bdcp/[\w/]+", text)
    assert folders and all((REPO / f).is_dir() for f in folders), folders
