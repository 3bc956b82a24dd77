"""Atomic checkpoints: round trip, crashed saves never loaded, keep-K pruning, RNG restore."""

from __future__ import annotations

import json
import logging
import random
import shutil

import numpy as np
import pytest
import torch

from dcp import checkpoint as ckpt
from dcp.checkpoint import (
    CheckpointConfig,
    CheckpointState,
    capture_rng_state,
    find_latest,
    load_latest,
    restore_rng_state,
    save_checkpoint,
)
from tests.payload import plant_payload, rewrite_manifest


def _model_and_optimizer(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    return model, opt, sched


def _train_step(model, opt, sched):
    x = torch.randn(16, 4)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    return loss.item()


def _save(root, step, model, opt, sched, **kw):
    return save_checkpoint(
        root,
        step,
        CheckpointState(
            model_state=model.state_dict(),
            optimizer_state=opt.state_dict(),
            scheduler_state=sched.state_dict(),
            sampler_state={"epoch": 0, "batch_index": step},
            rng_state=capture_rng_state(),
            extra={"note": "unit"},
        ),
        rank=0,
        world_size=1,
        barrier_fn=lambda: None,
        **kw,
    )


def test_round_trip_resumes_with_identical_losses(tmp_path):
    model, opt, sched = _model_and_optimizer()
    for _ in range(3):
        _train_step(model, opt, sched)
    path = _save(tmp_path, 3, model, opt, sched)
    expected = [_train_step(model, opt, sched) for _ in range(3)]

    model2, opt2, sched2 = _model_and_optimizer(seed=123)  # different init, fresh optimizer
    loaded = load_latest(tmp_path, rank=0, world_size=1)
    assert loaded is not None and loaded.step == 3 and loaded.path == path
    model2.load_state_dict(loaded.model_state)
    opt2.load_state_dict(loaded.optimizer_state)
    sched2.load_state_dict(loaded.scheduler_state)
    restore_rng_state(loaded.rng_state)
    assert loaded.sampler_state == {"epoch": 0, "batch_index": 3}
    assert loaded.extra == {"note": "unit"}
    assert [_train_step(model2, opt2, sched2) for _ in range(3)] == expected
    assert (tmp_path / "latest").read_text().strip() == "step_000003"
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["step"] == 3 and "rng.rank00000.pt" in manifest["files"]


def test_crashed_save_is_never_loaded(tmp_path):
    model, opt, sched = _model_and_optimizer()
    _save(tmp_path, 1, model, opt, sched)
    _train_step(model, opt, sched)
    good = _save(tmp_path, 2, model, opt, sched)

    # Crash mid-save of step 3: temp dir with some files, no manifest.
    tmp = tmp_path / ".tmp-step_000003"
    tmp.mkdir()
    torch.save(model.state_dict(), tmp / "model.pt")
    # A step dir without its manifest (e.g. copied by hand, or an older tool) is skipped too.
    shutil.copytree(good, tmp_path / "step_000004")
    (tmp_path / "step_000004" / "manifest.json").unlink()
    # And one whose manifest lists a file that was truncated.
    shutil.copytree(good, tmp_path / "step_000005")
    with open(tmp_path / "step_000005" / "model.pt", "r+b") as f:
        f.truncate(10)
    (tmp_path / "latest").write_text("step_000005\n")  # pointer to a broken checkpoint

    assert find_latest(tmp_path) == good
    loaded = load_latest(tmp_path, rank=0)
    assert loaded.step == 2
    assert not ckpt.is_complete(tmp_path / "step_000005")
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        ckpt.load_checkpoint(tmp_path / "step_000004", rank=0)

    # The next save clears the crashed temp dir of the same step and succeeds.
    _save(tmp_path, 3, model, opt, sched)
    assert load_latest(tmp_path, rank=0).step == 3
    assert not tmp.exists()


@pytest.mark.parametrize(
    "pointer",
    [b"step_000001\n", b"step_999999\n", b"../../etc\n", b"\xff\xfe", b"x" * (1 << 20)],
)
def test_the_newest_complete_checkpoint_wins_whatever_latest_says(tmp_path, caplog, pointer):
    model, opt, sched = _model_and_optimizer()
    _save(tmp_path, 1, model, opt, sched)
    newest = _save(tmp_path, 2, model, opt, sched)
    (tmp_path / "latest").write_bytes(pointer)  # an older step, a missing one, garbage
    with caplog.at_level(logging.WARNING, logger="dcp.checkpoint"):
        assert find_latest(tmp_path) == newest
    assert "is not the newest complete checkpoint; using step_000002" in caplog.text


def test_empty_root_has_no_checkpoint(tmp_path):
    assert load_latest(tmp_path / "nothing", rank=0) is None
    assert find_latest(tmp_path) is None


def test_keep_last_prunes_old_checkpoints_and_leftovers(tmp_path):
    model, opt, sched = _model_and_optimizer()
    (tmp_path / ".tmp-step_000001").mkdir(parents=True)  # leftover of an earlier crash
    for step in range(1, 6):
        _save(tmp_path, step, model, opt, sched, keep_last=2)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["latest", "step_000004", "step_000005"]
    # keep_last=0 keeps everything; re-saving an existing step replaces it.
    _save(tmp_path, 5, model, opt, sched)
    _save(tmp_path, 6, model, opt, sched)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == [
        "step_000004",
        "step_000005",
        "step_000006",
    ]


def test_rng_restore_reproduces_random_numbers():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.standard_normal()  # leaves a cached gaussian in numpy's legacy state
    state = capture_rng_state()

    def draw():
        return (
            random.random(),
            random.gauss(0, 1),
            np.random.rand(3).tolist(),
            np.random.standard_normal(),
            torch.rand(4).tolist(),
            torch.randn(2).tolist(),
        )

    first = draw()
    draw()  # move every generator on
    restore_rng_state(state)
    assert draw() == first


def test_rng_state_survives_weights_only_load(tmp_path):
    state = capture_rng_state()
    torch.save(state, tmp_path / "rng.pt")
    expected = torch.rand(3)
    restore_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert torch.equal(torch.rand(3), expected)


def test_world_size_mismatch_and_bad_arguments(tmp_path):
    model, opt, sched = _model_and_optimizer()
    _save(tmp_path, 1, model, opt, sched)
    with pytest.raises(ValueError, match="written by 1 ranks"):
        load_latest(tmp_path, rank=0, world_size=2)
    with pytest.raises(ValueError, match="per_rank"):
        _save(tmp_path, 2, model, opt, sched, per_rank=("rng",))
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointConfig(keep_last=-1)
    with pytest.raises(ValueError, match="interval_steps"):
        CheckpointConfig(interval_steps=1.5)


@pytest.mark.parametrize("component", ckpt.COMPONENTS)
def test_a_pickle_payload_in_any_component_is_refused_naming_the_file(tmp_path, component):
    marker = tmp_path / "pwned"
    model, opt, sched = _model_and_optimizer()
    path = _save(tmp_path / "ckpt", 1, model, opt, sched)
    name = ckpt._file_name(component, 0 if component == "rng_state" else None)
    plant_payload(path, name, marker)
    assert ckpt.find_latest(tmp_path / "ckpt") == path
    with pytest.raises(ckpt.UnsafeCheckpointError, match=rf"{name}: refused to load"):
        load_latest(tmp_path / "ckpt", rank=0, world_size=1)
    if component != "rng_state":
        with pytest.raises(ckpt.UnsafeCheckpointError, match=name):
            ckpt.load_component(path, component)
    assert not marker.exists()


def test_a_file_that_is_not_a_torch_save_file_is_one_line(tmp_path):
    model, opt, sched = _model_and_optimizer()
    path = _save(tmp_path, 1, model, opt, sched)
    (path / "extra.pt").write_bytes(b"\x80\x04not really a pickle")
    rewrite_manifest(path)
    with pytest.raises(ckpt.UnsafeCheckpointError, match=r"extra\.pt") as info:
        ckpt.load_component(path, "extra")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "change",
    [
        {"files": {"../../etc/passwd": 1}},
        {"files": {"/etc/passwd": 1}},
        {"world_size": "2"},
        {"per_rank": ["rng_state", "../x"]},
        {"step": -1},
        {"files": {"model.pt": "big"}},
    ],
)
def test_a_manifest_naming_files_elsewhere_or_of_the_wrong_type_is_no_checkpoint(tmp_path, change):
    model, opt, sched = _model_and_optimizer()
    path = _save(tmp_path, 1, model, opt, sched)
    manifest = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps({**manifest, **change}))
    assert not ckpt.is_complete(path)
    assert ckpt.find_latest(tmp_path) is None


def test_a_linked_file_is_no_checkpoint_file(tmp_path):
    model, opt, sched = _model_and_optimizer()
    path = _save(tmp_path, 1, model, opt, sched)
    outside = tmp_path / "outside.pt"
    (path / "extra.pt").rename(outside)
    (path / "extra.pt").symlink_to(outside)
    assert not ckpt.is_complete(path)


def test_same_size_corruption_is_detected_and_the_previous_checkpoint_used(tmp_path, caplog):
    model, opt, sched = _model_and_optimizer()
    _save(tmp_path, 1, model, opt, sched)
    _train_step(model, opt, sched)
    newest = _save(tmp_path, 2, model, opt, sched)
    # Flip bytes in the middle of model.pt without changing its size: the size check passes.
    path = newest / "model.pt"
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 8] = bytes(b ^ 0xFF for b in data[middle : middle + 8])
    path.write_bytes(bytes(data))
    assert ckpt.is_complete(newest)
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"step_000002: model\.pt corrupt"):
        ckpt.verify_checksums(newest)
    with caplog.at_level("ERROR", logger="dcp.checkpoint"):
        loaded = load_latest(tmp_path, rank=0, world_size=1)
    assert loaded.step == 1
    assert "model.pt corrupt" in caplog.text and "falling back" in caplog.text


def test_version_1_manifests_without_checksums_still_load(tmp_path):
    model, opt, sched = _model_and_optimizer()
    path = _save(tmp_path, 3, model, opt, sched)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["format_version"] = 1
    del manifest["sha256"]
    (path / "manifest.json").write_text(json.dumps(manifest))
    assert load_latest(tmp_path, rank=0, world_size=1).step == 3
