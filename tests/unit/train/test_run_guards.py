"""Guards around a run: the run-directory lock (atomic, held by the kernel), resume config
checks, run names, writable directories, and the data checks against the model (vocabulary,
max_seq_len)."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dcp.schema import load_config
from dcp.train.config import PretrainConfig
from dcp.train.lock import RunLock, RunLockedError
from dcp.train.resume import check_resume_config, config_changes
from dcp.train.trainer import _check_writable

REPO = Path(__file__).resolve().parents[3]


def test_second_holder_is_refused_naming_the_first(tmp_path):
    first = RunLock(tmp_path / "run")
    first.acquire()
    with pytest.raises(RunLockedError, match=rf"in use by pid {os.getpid()} on "):
        RunLock(tmp_path / "run").acquire()
    first.release()
    again = RunLock(tmp_path / "run")
    again.acquire()  # released: free again
    again.release()
    assert (tmp_path / "run" / ".lock").read_bytes() == b""  # nobody described as holding it


def _contend(root: str, rounds: int, barrier, results) -> None:
    """One of two processes starting ``rounds`` runs at the same instant as the other."""
    from dcp.train.lock import RunLock, RunLockedError

    held = []
    for i in range(rounds):
        lock = RunLock(Path(root) / f"run{i}")
        barrier.wait()
        try:
            lock.acquire()
        except RunLockedError:
            held.append(False)
        else:
            held.append(True)
        barrier.wait()  # both have decided before either lets go
        lock.release()
    results.put(held)


def test_of_two_simultaneous_starters_exactly_one_holds_the_lock(tmp_path):
    """200 rounds, each a fresh directory (its lock file does not exist yet) taken by two
    processes released from one barrier."""
    rounds = 200
    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(2, timeout=60), ctx.Queue()
    procs = [
        ctx.Process(target=_contend, args=(str(tmp_path), rounds, barrier, results))
        for _ in range(2)
    ]
    for proc in procs:
        proc.start()
    held = [results.get(timeout=120) for _ in procs]
    for proc in procs:
        proc.join(timeout=60)
    holders = [a + b for a, b in zip(*held, strict=True)]
    assert holders == [1] * rounds, f"rounds with 0 or 2 holders: {rounds - holders.count(1)}"


@pytest.mark.parametrize(
    "content",
    [
        {"pid": 0, "host": socket.gethostname()},  # kill(0, 0) succeeds: looked alive forever
        {"pid": -1, "host": socket.gethostname()},
        {"pid": "12", "host": socket.gethostname()},
        {"pid": 10**30, "host": socket.gethostname()},
        {"pid": os.getpid(), "host": socket.gethostname(), "since_unix_s": 1e300},
        {"host": "elsewhere"},
        [1, 2],
        "x" * 10_000,
    ],
)
def test_nothing_in_an_unheld_lock_file_blocks_or_breaks_a_start(tmp_path, content):
    run = tmp_path / "run"
    run.mkdir()
    (run / ".lock").write_text(json.dumps(content))
    lock = RunLock(run)
    lock.acquire()
    assert json.loads((run / ".lock").read_text())["pid"] == os.getpid()
    lock.release()


@pytest.mark.parametrize(
    "content", [b"", b"\xff\xfe", b'{"pid": 0}', b'{"pid": 1e999}', b"[" * 5000]
)
def test_a_held_lock_with_any_content_is_refused_in_one_line(tmp_path, content):
    holder = RunLock(tmp_path / "run")
    holder.acquire()
    (tmp_path / "run" / ".lock").write_bytes(content)  # what the holder wrote does not matter
    with pytest.raises(RunLockedError) as info:
        RunLock(tmp_path / "run").acquire()
    assert "in use by" in str(info.value) and "\n" not in str(info.value)
    holder.release()


def test_release_only_releases_its_own_lock(tmp_path):
    holder, other = RunLock(tmp_path / "run"), RunLock(tmp_path / "run")
    holder.acquire()
    with pytest.raises(RunLockedError):
        other.acquire()
    other.release()  # it never held the lock: nothing happens
    with pytest.raises(RunLockedError):
        RunLock(tmp_path / "run").acquire()
    holder.release()
    other.acquire()
    holder.release()  # released already: the new holder keeps the lock
    with pytest.raises(RunLockedError):
        RunLock(tmp_path / "run").acquire()
    other.release()


def test_the_lock_of_a_killed_process_is_free_at_once(tmp_path):
    script = (
        "import sys, time; from dcp.train.lock import RunLock; RunLock(sys.argv[1]).acquire(); "
        "print('held', flush=True); time.sleep(600)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path / "run")],
        cwd=Path(__file__).resolve().parents[3],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(RunLockedError, match=rf"in use by pid {proc.pid} on "):
            RunLock(tmp_path / "run").acquire()
    finally:
        proc.kill()
        proc.wait()
    RunLock(tmp_path / "run").acquire()


@pytest.mark.parametrize("kind", ["symlink", "directory"])
def test_a_lock_path_that_is_no_file_is_refused_and_left_alone(tmp_path, kind):
    run = tmp_path / "run"
    run.mkdir()
    target = tmp_path / "elsewhere"
    target.write_text("keep me")
    if kind == "symlink":
        (run / ".lock").symlink_to(target)
    else:
        (run / ".lock").mkdir()
    with pytest.raises(ValueError, match=r"\.lock"):
        RunLock(run).acquire()
    assert target.read_text() == "keep me"


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


def test_a_resume_on_chat_data_of_other_content_is_refused_unless_allowed():
    from dcp.train.resume import DATA_CONTENT_KEYS, check_data_content

    key = DATA_CONTENT_KEYS["chat"]
    check_data_content(["a1"], ["a1"], sources=["chats.jsonl"], key=key, path="ck", allow=())
    with pytest.raises(ValueError, match=r"content of chats\.jsonl differs.*data\.chat\.path"):
        check_data_content(["a1"], ["b2"], sources=["chats.jsonl"], key=key, path="ck", allow=())
    check_data_content(["a1"], ["b2"], sources=["chats.jsonl"], key=key, path="ck", allow=[key])
    # A checkpoint without a fingerprint (written before they were saved) is not checked.
    check_data_content(None, ["b2"], sources=["chats.jsonl"], key=key, path="ck", allow=())


def test_the_layout_is_no_trajectory_change_a_resume_refuses():
    """A checkpoint loads at any world size, TP size and optimizer sharding (dcp.checkpoint
    reshards), so a resume that changes them is accepted."""
    old = {"parallel": {"tensor_parallel_size": 2}, "optim": {"distributed": True, "lr": 0.1}}
    new = {"parallel": {"tensor_parallel_size": 1}, "optim": {"distributed": False, "lr": 0.1}}
    assert set(check_resume_config(old, new)) == {
        "parallel.tensor_parallel_size",
        "optim.distributed",
    }
    with pytest.raises(ValueError, match="optim.lr"):
        check_resume_config(old, {**new, "optim": {"distributed": False, "lr": 0.2}})


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
    from dcp.step.batches import build_dataset
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


def test_data_no_plan_can_hold_is_refused_at_start(tmp_path):
    """The longest document against the memory budget, before any step: one line naming the
    sequence, what it needs and the budget in readable units (no "0.0 GB"), instead of a failure
    at the step that draws it."""
    from dcp.costmodel.load import load_preset
    from dcp.mesh import Mesh
    from dcp.step.batches import BatchPlanner
    from dcp.train.trainer import check_longest_fits

    cfg = load_config(
        PretrainConfig, REPO / "pretrain/configs/tiny_cpu.yaml", ["model.max_seq_len=4096"]
    )
    spec = load_preset(cfg.planning.spec)
    planner = BatchPlanner(cfg.planning, mesh=Mesh(2), max_seq_len=4096, spec=spec)
    check_longest_fits(planner)  # the demo's budget holds its longest chunk
    spec["cluster"]["gpu_memory_gb"] -= 0.08  # a budget of about 26 MB: not 4096 tokens
    tight = tmp_path / "tight.json"
    tight.write_text(json.dumps(spec))
    planning = load_config(PretrainConfig, None, [f"planning.spec={tight}"]).planning
    planner = BatchPlanner(planning, mesh=Mesh(2), max_seq_len=4096)
    check_longest_fits(BatchPlanner(planning, mesh=Mesh(2), max_seq_len=64))  # a short one fits
    with pytest.raises(ValueError) as refused:
        check_longest_fits(planner)
    message = str(refused.value)
    assert message.startswith(
        "the data's longest sequence (4096 tokens) can never be trained within the memory "
        f"budget of planning.spec={tight}: sequence 0 (length 4096) fits no plan: even with "
        "full recompute on 2 ranks it needs "
    ), message
    assert " 0.0 GB" not in message and "\n" not in message
    drop = load_config(
        PretrainConfig, None, [f"planning.spec={tight}", "planning.on_oversize=drop"]
    )
    check_longest_fits(BatchPlanner(drop.planning, mesh=Mesh(2), max_seq_len=4096))


def _read_after_truncation(prefix: str, errors) -> None:
    """A forked child: open the corpus, truncate its .bin in place, read its last document."""
    from dcp.data import IndexedDataConfig, build_document_dataset

    dataset = build_document_dataset(IndexedDataConfig(prefixes=(prefix,)), vocab_size=257)
    dataset.get_tokens(0)
    os.truncate(prefix + ".bin", 0)
    try:
        dataset.get_tokens(len(dataset) - 1)
    except ValueError as exc:
        errors.put(str(exc))


def test_a_corpus_truncated_while_the_run_reads_it_is_one_line(tmp_path):
    """The .bin is memory-mapped: a read past the end of a file cut short after it was opened
    would kill the process with SIGBUS and no word (here a forked child, so that the test
    survives it). It is checked before each read."""
    prefix = _indexed(tmp_path, [list(range(1, 200))] * 40)
    ctx = multiprocessing.get_context("fork")
    errors = ctx.SimpleQueue()
    child = ctx.Process(target=_read_after_truncation, args=(prefix, errors))
    child.start()
    child.join(timeout=120)
    assert child.exitcode == 0, f"the reader died with exit code {child.exitcode}"
    assert errors.get() == (
        f"{prefix}.bin: truncated to 0 bytes while the run reads it (its index describes "
        f"{2 * 199 * 40} bytes); restore the corpus, then resume"
    )
