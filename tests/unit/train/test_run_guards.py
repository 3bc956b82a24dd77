"""Guards around a run: the run-directory lock, resume config checks, run names, writable
directories, and the data checks against the model (vocabulary, max_seq_len)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from dcp.schema import load_config
from dcp.train.config import PretrainConfig
from dcp.train.lock import RunLock, RunLockedError
from dcp.train.resume import check_resume_config, check_resume_parallelism, config_changes
from dcp.train.trainer import _check_writable


def test_second_holder_is_refused_naming_the_first(tmp_path):
    first = RunLock(tmp_path / "run")
    first.acquire()
    with pytest.raises(RunLockedError, match=rf"in use by pid {os.getpid()} on "):
        RunLock(tmp_path / "run").acquire()
    first.release()
    again = RunLock(tmp_path / "run")
    again.acquire()  # released: free again
    again.release()
    assert not (tmp_path / "run" / ".lock").exists()


def test_stale_lock_of_a_dead_process_is_taken_over(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    run = tmp_path / "run"
    run.mkdir()
    holder = {"pid": dead.pid, "host": socket.gethostname(), "since_unix_s": 0.0}
    (run / ".lock").write_text(json.dumps(holder))
    lock = RunLock(run)
    lock.acquire()
    assert json.loads((run / ".lock").read_text())["pid"] == os.getpid()
    lock.release()


def test_lock_with_a_recycled_pid_is_stale(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    # This process's pid, but another start time: the process that wrote it is gone.
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "start_ticks": -1}
    (run / ".lock").write_text(json.dumps({**holder, "since_unix_s": 0.0}))
    RunLock(run).acquire()


def test_resume_refuses_trajectory_changes_unless_allowed():
    old = {"optim": {"lr": 0.0024, "min_lr": 0.0}, "train": {"steps": 10, "seed": 1}}
    new = {"optim": {"lr": 0.1, "min_lr": 0.0}, "train": {"steps": 20, "seed": 1}}
    assert config_changes(old, new) == {"optim.lr": (0.0024, 0.1), "train.steps": (10, 20)}
    with pytest.raises(ValueError, match=r"optim\.lr: 0\.0024 -> 0\.1.*resume\.allow_changes"):
        check_resume_config(old, new)
    assert "optim.lr" in check_resume_config(old, new, allow=["optim.lr"])
    assert "optim.lr" in check_resume_config(old, new, allow=["optim"])  # a whole section
    # Steps, logging and the planner are free to change.
    free = {**old, "train": {"steps": 99, "seed": 1}, "planning": {"planner": "static"}}
    check_resume_config({**old, "planning": {"planner": "dcp"}}, free)


def test_resume_refuses_another_tp_size_and_names_the_way_to_keep_the_weights():
    tp2 = {"parallel": {"tensor_parallel_size": 2}}
    check_resume_parallelism(tp2, tp2, path="ckpt/step_000010")  # same TP: fine
    check_resume_parallelism({}, {"parallel": {"tensor_parallel_size": 1}}, path="p")  # old file
    with pytest.raises(ValueError, match="parallel.tensor_parallel_size=2, this run has 1") as err:
        check_resume_parallelism(tp2, {}, path="ckpt/step_000010")
    assert "init.from_checkpoint=ckpt/step_000010" in str(err.value)


@pytest.mark.parametrize("name", ["..", ".", "a/b", "", ".hidden", "x y"])
def test_run_names_cannot_escape_the_runs_directory(name):
    with pytest.raises(ValueError, match="name must be letters"):
        load_config(PretrainConfig, None, [f"name={name}"])


def test_unwritable_directory_is_reported_before_any_work(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")  # a file where the checkpoint directory should go
    with pytest.raises(ValueError, match=r"checkpoint\.root_dir\) is not writable"):
        _check_writable(blocker / "ckpt", "checkpoint.root_dir")
    _check_writable(tmp_path / "fine", "runs_dir/name")
    assert list((tmp_path / "fine").iterdir()) == []  # the probe file is gone


def _indexed(tmp_path, docs, vocab_size=257):
    from dcp.data.indexed import megatron_indexed_dataset

    indexed_dataset = megatron_indexed_dataset()
    prefix = str(tmp_path / "corpus")
    builder = indexed_dataset.IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for doc in docs:
        builder.add_document(np.asarray(doc, dtype=np.uint16), [len(doc)])
    builder.finalize(prefix + ".idx")
    return prefix


def test_token_ids_outside_the_vocabulary_name_file_and_document(tmp_path):
    from dcp.data import IndexedDataConfig, build_document_dataset

    prefix = _indexed(tmp_path, [[1, 2, 3], [4, 5, 6, 7], [8, 300, 9]])
    config = IndexedDataConfig(prefixes=(prefix,))
    build_document_dataset(config, vocab_size=301)  # fits
    with pytest.raises(ValueError, match=r"corpus\.bin: document 2 holds token id 300"):
        build_document_dataset(config, vocab_size=257)


def test_documents_longer_than_the_model_are_refused():
    from dcp.train.batches import build_dataset
    from dcp.train.config import DataConfig

    cfg = load_config(
        DataConfig,
        None,
        [
            "synthetic.max_len=600",
            "synthetic.min_len=500",
            "synthetic.median_len=550",
            "synthetic.num_docs=8",
        ],
    )
    build_dataset(cfg, vocab_size=257, max_seq_len=599)
    with pytest.raises(ValueError, match=r"599-token sequence but model\.max_seq_len=512"):
        build_dataset(cfg, vocab_size=257, max_seq_len=512)
