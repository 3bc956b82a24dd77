"""Files someone else wrote, and failures on one rank, on real torchrun jobs (2 gloo ranks): no
code runs from a checkpoint, a failure on one rank stops every rank at once with one line, a
checkpoint directory has one writer, and non-finite values never reach the weights."""

from __future__ import annotations

import resource
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.e2e.test_pretrain import command, finish, launch, metrics, start
from tests.e2e.test_reliability import FAST, STEPS, _wait_for_steps, kill_job
from tests.payload import plant_payload


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished run with checkpoints every 2 steps, copied by each test that changes it."""
    tmp = tmp_path_factory.mktemp("runs")
    finish(launch(tmp, "done", *FAST))
    return tmp / "done"


def _copy(run: Path, tmp_path: Path) -> Path:
    shutil.copytree(run, tmp_path / run.name)
    return tmp_path / run.name


def _rerun(tmp_path: Path, name: str, *extra: str) -> tuple[int, str, float]:
    start = time.monotonic()
    proc = launch(tmp_path, name, *FAST[1:], f"train.steps={STEPS + 2}", *extra)
    out = proc.communicate(timeout=240)[0]
    return proc.returncode, out, time.monotonic() - start


def test_a_pickle_payload_in_the_resumed_checkpoint_runs_nothing(finished, tmp_path):
    run_dir = _copy(finished, tmp_path)
    marker = tmp_path / "pwned"
    newest = run_dir / "checkpoints" / f"step_{STEPS:06d}"
    plant_payload(newest, "shared.json", marker)
    code, out, elapsed = _rerun(tmp_path, "done")
    assert code != 0 and "exitcode  : 2" in out, out[-3000:]
    assert f"error: {newest / 'shared.json'}: not UTF-8 text" in out, out[-3000:]
    assert elapsed < 120, elapsed
    assert not marker.exists()


def test_a_pickle_in_place_of_a_rank_file_is_refused_and_an_older_checkpoint_used(
    finished, tmp_path
):
    """rank00001.safetensors holds slices other ranks read too: a file that is not what the
    index says is corrupt for every rank, which fall back together (the status exchange) to the
    checkpoint before it; nothing is unpickled."""
    run_dir = _copy(finished, tmp_path)
    marker = tmp_path / "pwned"
    newest = run_dir / "checkpoints" / f"step_{STEPS:06d}"
    plant_payload(newest, "rank00001.safetensors", marker)
    code, out, elapsed = _rerun(tmp_path, "done")
    assert code == 0, out[-3000:]
    assert f"{newest / 'rank00001.safetensors'}: declares a" in out, out[-3000:]
    assert f"(step {STEPS - 2})" in out and "falling back to an older one" in out
    assert not marker.exists()


def test_a_pickle_payload_in_init_from_checkpoint_runs_nothing(finished, tmp_path):
    source = _copy(finished, tmp_path)
    marker = tmp_path / "pwned"
    newest = source / "checkpoints" / f"step_{STEPS:06d}"
    plant_payload(newest, "rank00000.safetensors", marker)
    proc = launch(tmp_path, "fresh", *FAST, f"init.from_checkpoint={newest}")
    out = proc.communicate(timeout=240)[0]
    assert proc.returncode != 0, out[-3000:]
    assert "rank00000.safetensors: declares a" in out, out[-3000:]
    assert not marker.exists()


def test_a_failure_on_one_rank_at_start_up_stops_every_rank_at_once(finished, tmp_path):
    run_dir = _copy(finished, tmp_path)
    # A malformed record in the middle of microsteps.jsonl: rank 0 alone reads the file.
    lines = (run_dir / "microsteps.jsonl").read_text().splitlines()
    lines[1] = lines[1][:10]
    (run_dir / "microsteps.jsonl").write_text("\n".join(lines) + "\n")
    code, out, elapsed = _rerun(tmp_path, "done")
    assert code != 0 and "microsteps.jsonl line 2" in out, out[-3000:]
    assert "(rank 0, while reading microsteps.jsonl)" in out
    assert elapsed < 120, elapsed

    # A truncated last line (a crash or a full disk mid-write) is dropped, and the run resumes.
    (run_dir / "microsteps.jsonl").write_text("\n".join([*lines[:1], *lines[2:]]) + '\n{"st')
    code, out, _ = _rerun(tmp_path, "done")
    assert code == 0 and "skipping truncated last line" in out, out[-3000:]
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, STEPS + 3))


def _write_corpus(prefix: Path, docs: list) -> None:
    from dcp.data.indexed import megatron_indexed_dataset

    builder = megatron_indexed_dataset().IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for doc in docs:
        builder.add_document(np.asarray(doc, dtype=np.uint16), [len(doc)])
    builder.finalize(f"{prefix}.idx")


def test_a_resume_on_data_whose_tokens_changed_is_refused(tmp_path):
    rng = np.random.default_rng(0)
    lengths = rng.integers(16, 300, size=120)
    prefix = tmp_path / "corpus"
    _write_corpus(prefix, [rng.integers(0, 256, size=n) for n in lengths])
    # The launch's synthetic section cleared: another source's section is refused, not ignored.
    data = ["data.source=indexed", f"data.indexed={{prefixes: [{prefix}]}}", "data.synthetic={}"]
    finish(launch(tmp_path, "data", *FAST, "train.steps=2", *data))

    # The same document lengths, other tokens: the sampler's state alone cannot tell.
    _write_corpus(prefix, [rng.integers(0, 256, size=n) for n in lengths])
    proc = launch(tmp_path, "data", *FAST, "train.steps=4", *data)
    out = proc.communicate(timeout=240)[0]
    assert proc.returncode != 0 and "exitcode  : 2" in out, out[-3000:]
    line = next(x for x in out.splitlines() if "[rank0] error: the data changed since" in x)
    assert f"the content of {prefix} " in line and "data.indexed.prefixes" in line, line

    allowed = "resume.allow_changes=[data.indexed.prefixes]"
    out = finish(launch(tmp_path, "data", *FAST, "train.steps=4", *data, allowed))
    assert "resumed from" in out and "(step 2)" in out, out[-3000:]
    assert [r["step"] for r in metrics(tmp_path / "data")] == [1, 2, 3, 4]


def test_one_checkpoint_directory_has_one_writer(tmp_path):
    shared = f"checkpoint.root_dir={tmp_path / 'shared'}"
    first = launch(tmp_path, "first", *FAST, "train.steps=400", shared)
    try:
        _wait_for_steps(
            first, tmp_path / "first", 3, checkpoint=True, checkpoint_root=tmp_path / "shared"
        )
        proc = launch(tmp_path, "second", *FAST, shared)
        out = proc.communicate(timeout=180)[0]
        assert proc.returncode != 0, out[-3000:]
        assert f"checkpoint directory {tmp_path / 'shared'} is in use by pid" in out, out[-3000:]
    finally:
        kill_job(first)
    # The first run is gone (its lock is stale), but its checkpoints are still its own.
    proc = launch(tmp_path, "second", *FAST, shared)
    out = proc.communicate(timeout=180)[0]
    assert proc.returncode != 0 and "was written by run 'first'" in out, out[-3000:]
    assert "init.from_checkpoint=" in out


def test_nonfinite_gradients_never_reach_the_weights(tmp_path):
    # An absurd learning rate: step 1's update makes the weights huge, every later step is
    # non-finite. Skipping stops after max_consecutive_skips steps in a row, with an error.
    args = [
        *FAST,
        "optim.lr=1e15",  # near the bound of every config number (2**53)
        "optim.warmup_steps=0",
        "train.on_nonfinite=skip",
        "train.max_consecutive_skips=3",
        "checkpoint.interval_steps=1",
    ]
    proc = launch(tmp_path, "blowup", *args)
    out = proc.communicate(timeout=240)[0]
    assert proc.returncode != 0, out[-3000:]
    assert "3 steps in a row had non-finite loss or gradients" in out, out[-3000:]
    rows = metrics(tmp_path / "blowup")
    assert [r["skipped"] for r in rows][-3:] == [True, True, True]
    checkpoints = sorted((tmp_path / "blowup" / "checkpoints").glob("step_*"))
    assert checkpoints
    from dcp.checkpoint import open_checkpoint

    for path in checkpoints:
        ckpt = open_checkpoint(path)
        assert all(torch.isfinite(ckpt.whole(n)).all() for n in ckpt.names()), path


def test_a_failed_checkpoint_write_is_one_line_and_keeps_the_last_checkpoint(tmp_path):
    """Files may not grow past 64 KiB (RLIMIT_FSIZE): the checkpoint's model file fails to write
    like on a full disk, while the small metrics lines still fit."""

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))

    proc = start(command(tmp_path, "full", *FAST), preexec_fn=small_files)
    out = proc.communicate(timeout=240)[0]
    assert proc.returncode != 0, out[-3000:]
    line = next(x for x in out.splitlines() if "error: checkpoint save of step 2" in x)
    assert "File too large" in line and "the newest complete checkpoint is none" in line, line
    assert "exitcode  : 1" in out  # not a config error: a supervisor may retry
    assert "During handling of the above exception" not in out  # no worker traceback
    assert not list((tmp_path / "full" / "checkpoints").glob("step_*"))
