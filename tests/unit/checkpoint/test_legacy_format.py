"""Checkpoints of the earlier ``torch.save`` format still load: their weights at any layout,
their other state where it was written; every file tensors and plain data only, its checksum
checked when it is read."""

from __future__ import annotations

import json

import pytest
import torch

from dcp.checkpoint import CorruptCheckpointError, find_latest, is_complete, open_checkpoint
from dcp.checkpoint.legacy import LegacyCheckpoint, UnsafeCheckpointError
from dcp.checkpoint.load import weights_for
from dcp.mesh import Mesh
from tests.legacy_checkpoint import COMPONENTS, file_name, write_legacy
from tests.payload import plant_payload, rewrite_manifest


def _state(module: torch.nn.Module, world: int = 1) -> list[dict]:
    return [
        {
            "model_state": module.state_dict(),
            "optimizer_state": {"state": {}, "param_groups": [{"lr": 0.1, "params": []}]},
            "scheduler_state": {"step": 2},
            "sampler_state": {"epoch": 0, "cursor": 4},
            "rng_state": {"torch_cpu": torch.get_rng_state()},
            "extra": {"config": {"parallel": {"tensor_parallel_size": 1}}, "note": "old"},
        }
        for _ in range(world)
    ]


def _module(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


@pytest.mark.parametrize("version", [1, 2])
def test_an_earlier_checkpoint_opens_and_its_weights_load(tmp_path, version):
    module = _module(0)
    path = write_legacy(tmp_path, 2, _state(module), version=version)
    assert find_latest(tmp_path) == path
    ckpt = open_checkpoint(path)
    assert isinstance(ckpt, LegacyCheckpoint) and ckpt.step == 2 and ckpt.mesh == Mesh(1)
    assert ckpt.shared()["sampler"] == {"epoch": 0, "cursor": 4}
    assert ckpt.shared()["extra"]["note"] == "old"
    fresh = _module(1)
    weights_for(fresh, ckpt)
    for a, b in zip(module.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("component", COMPONENTS)
def test_a_pickle_payload_in_any_component_is_refused_naming_the_file(tmp_path, component):
    marker = tmp_path / "pwned"
    path = write_legacy(tmp_path / "ckpt", 1, _state(_module(0)))
    name = file_name(component, 0 if component == "rng_state" else None)
    plant_payload(path, name, marker)
    with pytest.raises(UnsafeCheckpointError, match=rf"{name}: refused to load"):
        ckpt = open_checkpoint(path)
        ckpt.shared()
        ckpt.read(_module(1), None, rank=0, mesh=Mesh(1))
    assert not marker.exists()


def test_same_size_corruption_is_caught_when_the_file_is_read(tmp_path):
    path = write_legacy(tmp_path, 2, _state(_module(0)))
    data = bytearray((path / "model.pt").read_bytes())
    middle = len(data) // 2
    data[middle : middle + 8] = bytes(b ^ 0xFF for b in data[middle : middle + 8])
    (path / "model.pt").write_bytes(bytes(data))
    assert is_complete(path)
    with pytest.raises(CorruptCheckpointError, match=r"model\.pt: corrupt"):
        open_checkpoint(path).canonical_state()


def test_a_file_that_is_not_a_torch_save_file_is_one_line(tmp_path):
    path = write_legacy(tmp_path, 1, _state(_module(0)))
    (path / "sampler.pt").write_bytes(b"\x80\x04not really a pickle")
    rewrite_manifest(path)
    with pytest.raises(UnsafeCheckpointError, match=r"sampler\.pt") as info:
        open_checkpoint(path).shared()
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "change",
    [
        {"files": {"../../etc/passwd": 1}},
        {"files": {"/etc/passwd": 1}},
        {"step": -1},
        {"files": {"model.pt": "big"}},
    ],
)
def test_a_manifest_naming_files_elsewhere_or_of_the_wrong_type_is_no_checkpoint(tmp_path, change):
    path = write_legacy(tmp_path, 1, _state(_module(0)))
    manifest = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps({**manifest, **change}))
    assert not is_complete(path)
    assert find_latest(tmp_path) is None


def test_a_linked_file_is_no_checkpoint_file(tmp_path):
    path = write_legacy(tmp_path, 1, _state(_module(0)))
    outside = tmp_path / "outside.pt"
    (path / "extra.pt").rename(outside)
    (path / "extra.pt").symlink_to(outside)
    assert not is_complete(path)


def test_per_rank_optimizer_state_needs_the_layout_it_was_written_at(tmp_path):
    module = _module(0)
    path = write_legacy(
        tmp_path, 3, _state(module, world=2), per_rank=("rng_state", "optimizer_state")
    )
    with pytest.raises(ValueError, match="written by 2 ranks .* Resume with 2 ranks once"):
        open_checkpoint(path).read(module, None, rank=0, mesh=Mesh(4))


def _laughs(levels: int, width: int = 10) -> dict:
    """A mapping of ``width**levels`` leaves built from ``levels`` objects: pickle writes each
    once and refers back to it (its memo), so the file stays a few KiB."""
    node: dict = {f"k{i}": "lol" for i in range(width)}
    for _ in range(levels - 1):
        node = {f"k{i}": node for i in range(width)}
    return node


def test_shared_references_expanding_past_the_bound_are_refused_before_any_walk(tmp_path):
    """A "billion laughs" of pickle memo references in ``extra.pt`` (10^9 leaves in 2 KiB) is
    refused when the file is read, in one line, before the resume check flattens the config."""
    states = _state(_module(0))
    states[0]["extra"] = {"config": {"name": "run", "model": _laughs(9)}}
    path = write_legacy(tmp_path, 1, states)
    assert (path / "extra.pt").stat().st_size < 4096
    with pytest.raises(UnsafeCheckpointError, match=r"extra\.pt: expands to more than") as info:
        open_checkpoint(path).shared()
    assert "\n" not in str(info.value)


def test_shared_references_within_the_bound_still_load(tmp_path):
    states = _state(_module(0))
    states[0]["extra"] = {**states[0]["extra"], "shared": _laughs(3)}
    path = write_legacy(tmp_path, 1, states)
    assert open_checkpoint(path).shared()["extra"]["shared"] == _laughs(3)
