"""A Megatron-LM checkpoint given to ``tools.convert_checkpoint dcp-to-hf`` is recognised and
refused in one line naming its format and the command that exports it, reading nothing but
Megatron's plain-text tracker and JSON metadata (every format Megatron writes holds pickles)."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed.checkpoint as dist_cp
from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config

from tools import convert_checkpoint

ITERATION = 5


def megatron_torch_dist(root):
    """A ``--save`` root as Megatron-LM's loop writes it under ``--ckpt-format torch_dist``
    (as a 2-rank ``--dcp --save`` run of megatron_lm_cpu.args wrote it: ``iter_0000004`` with
    ``.metadata``, ``__0_0.distcp``, ``__1_0.distcp``, ``metadata.json``, and the tracker):
    ``iter_0000005`` holding torch's distributed-checkpoint files and megatron's
    ``metadata.json``, and the tracker. Written by the same writers, in this process (torch's
    ``save`` without a process group, megatron's ``save_config``)."""
    iteration = root / f"iter_{ITERATION:07d}"
    state = {
        "embedding.word_embeddings.weight": torch.randn(16, 8),
        "decoder.layers.self_attention.linear_qkv.weight": torch.randn(2, 16, 8),
    }
    dist_cp.save(state, storage_writer=dist_cp.FileSystemWriter(str(iteration)), no_dist=True)
    save_config(CheckpointingConfig("torch_dist"), str(iteration))
    (root / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    return root


@pytest.fixture
def nothing_unpickled(monkeypatch):
    """Any unpickling while the test runs fails it."""

    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint file was unpickled")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "load", refuse)


def test_a_torch_dist_checkpoint_is_named_with_the_command_that_exports_it(
    tmp_path, capsys, nothing_unpickled
):
    root = megatron_torch_dist(tmp_path / "ckpt")
    assert {p.name for p in (root / "iter_0000005").iterdir()} >= {".metadata", "metadata.json"}
    out = tmp_path / "hf"
    for given in (root, root / "iter_0000005"):  # the --save root, or one iteration
        assert convert_checkpoint.main(["dcp-to-hf", str(given), str(out)]) == 2
        (err,) = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
        assert err.startswith(f"error: {given}: a Megatron-LM checkpoint")
        assert "(iteration 5, --ckpt-format torch_dist: torch.distributed.checkpoint" in err
        assert "DCP never unpickles a checkpoint" in err
        assert (
            f"convert_checkpoints.py export --hf-model <a HF model of its architecture> "
            f"--megatron-path {root / 'iter_0000005'} --hf-path {out}"
        ) in err
    assert not out.exists()


def test_a_legacy_torch_format_checkpoint_is_named_too(tmp_path, capsys, nothing_unpickled):
    """``--ckpt-format torch``: one ``torch.save`` file per model-parallel rank."""
    rank_dir = tmp_path / "ckpt" / "iter_0000003" / "mp_rank_00"
    rank_dir.mkdir(parents=True)
    (rank_dir / "model_optim_rng.pt").write_bytes(b"not read")
    assert convert_checkpoint.main(["dcp-to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "a Megatron-LM checkpoint (iteration 3, --ckpt-format torch: one torch.save" in err


def test_a_directory_of_neither_kind_keeps_the_plain_error(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert convert_checkpoint.main(["dcp-to-hf", str(tmp_path / "empty"), str(tmp_path / "h")]) == 2
    assert "no complete checkpoint at or under" in capsys.readouterr().err
