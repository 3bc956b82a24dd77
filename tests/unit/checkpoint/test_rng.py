"""The CUDA part of a rank's RNG state: its own device's generator only, saved and restored
whatever number of GPUs the process sees (CUDA's calls stubbed: this machine has none)."""

from __future__ import annotations

import pytest
import torch

from dcp.checkpoint.rng import capture_rng_state, from_tensors, restore_rng_state, rng_tensors


class FakeCuda:
    """``devices`` GPUs, the process's current one ``current``; each generator's state is a
    distinct byte tensor."""

    def __init__(self, monkeypatch, *, devices: int, current: int = 0) -> None:
        self.states = [torch.full((16,), i, dtype=torch.uint8) for i in range(devices)]
        self.current = current
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "is_available", lambda: True)
        monkeypatch.setattr(cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(cuda, "device_count", lambda: devices)
        monkeypatch.setattr(cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(cuda, "get_rng_state", self.get)
        monkeypatch.setattr(cuda, "set_rng_state", self.set)
        monkeypatch.setattr(cuda, "get_rng_state_all", lambda: [s.clone() for s in self.states])
        monkeypatch.setattr(cuda, "set_rng_state_all", self.set_all)

    def _index(self, device) -> int:
        return self.current if device in ("cuda", None) else torch.device(device).index

    def get(self, device="cuda"):
        return self.states[self._index(device)].clone()

    def set(self, new_state, device="cuda"):
        self.states[self._index(device)] = new_state.clone()

    def set_all(self, new_states):
        if len(new_states) != len(self.states):
            raise RuntimeError("set_rng_state_all: one state per device")
        self.states = [s.clone() for s in new_states]


def _through_file(state: dict) -> dict:
    tensors, scalars = rng_tensors(state)
    return from_tensors(tensors.__getitem__, scalars)


def test_a_rank_saves_its_own_devices_generator_only(monkeypatch):
    FakeCuda(monkeypatch, devices=8, current=3)
    state = capture_rng_state()
    assert [s.tolist() for s in state["torch_cuda"]] == [[3] * 16]


@pytest.mark.parametrize("resumed_devices", [1, 8])
def test_a_resume_with_another_gpu_count_restores_the_current_device(monkeypatch, resumed_devices):
    """Saved with 8 visible GPUs (device 3), resumed with one GPU per task (SLURM) or with 8."""
    FakeCuda(monkeypatch, devices=8, current=3)
    saved = _through_file(capture_rng_state())
    current = 0 if resumed_devices == 1 else 5
    resumed = FakeCuda(monkeypatch, devices=resumed_devices, current=current)
    restore_rng_state(saved)
    assert resumed.states[current].tolist() == [3] * 16
    others = [s.tolist() for i, s in enumerate(resumed.states) if i != current]
    assert others == [[i] * 16 for i in range(resumed_devices) if i != current]


def _earlier_checkpoint(devices: int) -> dict:
    """The RNG state earlier versions saved: every visible device's generator, in order."""
    state = capture_rng_state()
    state["torch_cuda"] = [torch.full((16,), 10 + i, dtype=torch.uint8) for i in range(devices)]
    return _through_file(state)


def test_an_earlier_checkpoint_gives_this_ranks_device_its_state(monkeypatch):
    saved = _earlier_checkpoint(8)
    resumed = FakeCuda(monkeypatch, devices=8, current=6)
    restore_rng_state(saved)
    assert resumed.states[6].tolist() == [16] * 16
    assert resumed.states[0].tolist() == [0] * 16  # another device's generator is not touched


def test_an_earlier_checkpoint_at_another_gpu_count_says_why_not(monkeypatch):
    saved = _earlier_checkpoint(8)
    FakeCuda(monkeypatch, devices=1)
    with pytest.raises(RuntimeError, match=r"8 devices.*not which.*sees 1.*8 visible GPUs"):
        restore_rng_state(saved)
