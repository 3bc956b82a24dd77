"""The checkpoint format on one process: a round trip, what counts as complete, pruning,
digests, and everything a checkpoint someone else wrote may do wrong."""

from __future__ import annotations

import json
import random
import shutil

import numpy as np
import pytest
import torch

from dcp.checkpoint import (
    CheckpointIndexError,
    CheckpointSaver,
    CorruptCheckpointError,
    TensorFileError,
    capture_rng_state,
    find_latest,
    is_complete,
    open_checkpoint,
    restore_rng_state,
)
from dcp.checkpoint.directory import MANIFEST_DIGEST, manifest_digest
from dcp.checkpoint.load import weights_for
from dcp.checkpoint.state import LocalTensor, ep_rank, writers
from dcp.checkpoint.tensorfile import TensorFile, TensorFileWriter
from dcp.mesh import Mesh
from dcp.weights.canonical import canonical_name
from dcp.weights.tensor_parallel import cut, join
from tests.payload import plant_payload


def _module(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _save(root, step: int, module: torch.nn.Module, *, keep_last: int = 0, **shared):
    saver = CheckpointSaver(root, mesh=Mesh(1), rank=0, keep_last=keep_last)
    saver.save(
        step,
        weights_finite=True,
        asynchronous=False,
        tensors=[LocalTensor(n, t.detach(), None) for n, t in module.state_dict().items()],
        pieces=None,
        optimizer_kind=None,
        optimizer_groups=None,
        rng=capture_rng_state(),
        shared={"sampler": {"step": step}, "scheduler": {"step": step}, "extra": shared},
    )
    return saver.last_saved


def test_round_trip_of_weights_shared_state_and_rng(tmp_path):
    module = _module(0)
    path = _save(tmp_path, 3, module, note="unit")
    random.random(), np.random.rand(), torch.rand(1)  # draws the restored state must undo
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    ckpt = open_checkpoint(path)
    assert ckpt.step == 3 and ckpt.mesh == Mesh(1)
    assert ckpt.shared() == {
        "sampler": {"step": 3},
        "scheduler": {"step": 3},
        "extra": {"note": "unit"},
    }
    fresh = _module(1)
    weights_for(fresh, ckpt)
    for (name, a), b in zip(module.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    restore_rng_state(ckpt.rng(0, Mesh(1)))
    random.random(), np.random.rand(), torch.rand(1)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected
    assert (tmp_path / "latest").read_text().strip() == "step_000003"
    assert sorted(p.name for p in path.iterdir()) == [
        "manifest.json",
        "rank00000.safetensors",
        "shared.json",
    ]


def test_the_files_are_safetensors_any_reader_opens(tmp_path):
    from safetensors import safe_open

    module = _module(0)
    path = _save(tmp_path, 1, module)
    with safe_open(str(path / "rank00000.safetensors"), framework="pt") as f:
        assert torch.equal(f.get_tensor("model/0.weight"), module.state_dict()["0.weight"])


def test_a_crashed_save_is_never_loaded_and_the_newest_complete_wins(tmp_path, caplog):
    _save(tmp_path, 2, _module(0))
    _save(tmp_path, 4, _module(0))
    # A save that died before its manifest: files, no manifest.
    crashed = tmp_path / ".tmp-step_000006"
    shutil.copytree(tmp_path / "step_000004", crashed)
    (crashed / "manifest.json").unlink()
    # A step directory missing a file the manifest lists is no checkpoint either.
    shutil.copytree(tmp_path / "step_000004", tmp_path / "step_000005")
    (tmp_path / "step_000005" / "shared.json").unlink()
    assert not is_complete(tmp_path / "step_000005")
    (tmp_path / "latest").write_text("step_000002\n")
    with caplog.at_level("WARNING"):
        assert find_latest(tmp_path) == tmp_path / "step_000004"
    assert "is not the newest complete checkpoint" in caplog.text


def test_keep_last_prunes_older_checkpoints_and_dead_saves(tmp_path):
    (tmp_path / ".tmp-step_000001").mkdir(parents=True)
    for step in (2, 4, 6):
        _save(tmp_path, step, _module(0), keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000004", "step_000006"]


def test_same_size_corruption_of_a_tensor_is_caught_when_it_is_read(tmp_path):
    path = _save(tmp_path, 1, _module(0))
    file = path / "rank00000.safetensors"
    _, _, begin, _ = TensorFile(file).entries["model/0.weight"]
    data = bytearray(file.read_bytes())
    data[begin + 3] ^= 0xFF  # a byte of one weight
    file.write_bytes(bytes(data))
    assert is_complete(path)  # sizes still match: the digests catch it
    ckpt = open_checkpoint(path)
    with pytest.raises(CorruptCheckpointError, match="bytes differ"):
        [ckpt.whole(name) for name in ckpt.names()]


def _manifest(path):
    return json.loads((path / "manifest.json").read_text())


def _rewrite(path, manifest):
    """A manifest as a hostile writer makes it: consistent with its own digest."""
    manifest[MANIFEST_DIGEST] = manifest_digest(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))


def _flip_same_size(file, old: bytes, new: bytes) -> None:
    """Replace the first ``old`` in ``file`` by ``new`` (of the same length): a damage the
    sizes in the manifest cannot see."""
    data = file.read_bytes()
    assert len(old) == len(new) and old in data, (old, file)
    file.write_bytes(data.replace(old, new, 1))


def _flip_tensor_byte(file, key: str) -> None:
    _, _, begin, _ = TensorFile(file).entries[key]
    data = bytearray(file.read_bytes())
    data[begin] ^= 0x01
    file.write_bytes(bytes(data))


def _damage_rng_numbers(path) -> None:
    """Change the last digit of the NumPy generator's position in the RNG metadata (the plain
    numbers, in the tensor file's JSON header)."""
    file = path / "rank00000.safetensors"
    pos = str(json.loads(TensorFile(file).metadata["rng"])["numpy"][1])
    prefix = b'\\"numpy\\": [\\"MT19937\\", '
    other = pos[:-1] + str((int(pos[-1]) + 1) % 10)
    _flip_same_size(file, prefix + pos.encode(), prefix + other.encode())


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (
            lambda p: _flip_tensor_byte(p / "rank00000.safetensors", "rng/torch_cpu"),
            "rng/torch_cpu: bytes differ from the checkpoint's index",
        ),
        (_damage_rng_numbers, "its RNG metadata differs from the checkpoint's digest"),
        (
            lambda p: _flip_same_size(p / "shared.json", b'"step": 1', b'"step": 7'),
            "shared.json: its content differs from the checkpoint's digest",
        ),
        (
            lambda p: _flip_same_size(p / "manifest.json", b'"step":1', b'"step":7'),
            "manifest.json: its content differs from its digest",
        ),
    ],
    ids=["rng-tensor", "rng-numbers", "shared-state", "manifest"],
)
def test_every_part_of_a_checkpoint_is_checked_against_a_digest(tmp_path, damage, message):
    """The RNG state, the shared state and the manifest itself carry digests too: a flipped
    byte there is corruption (which a resume falls back from), never resumed silently."""
    path = _save(tmp_path, 1, _module(0))
    damage(path)
    assert is_complete(path)  # sizes still match: the digests catch it
    with pytest.raises((CorruptCheckpointError, CheckpointIndexError), match=message):
        ckpt = open_checkpoint(path)
        ckpt.shared()
        ckpt.rng(0, Mesh(1))


def test_a_checkpoint_written_before_the_rng_and_manifest_digests_still_loads(tmp_path):
    path = _save(tmp_path, 1, _module(0))
    expected = capture_rng_state()
    manifest = _manifest(path)
    del manifest[MANIFEST_DIGEST], manifest["shared_sha256"]
    manifest["rng"] = {"0": "rank00000.safetensors"}  # the earlier form: the file alone
    (path / "manifest.json").write_text(json.dumps(manifest))
    ckpt = open_checkpoint(path)
    assert ckpt.shared()["sampler"] == {"step": 1}
    assert torch.equal(ckpt.rng(0, Mesh(1))["torch_cpu"], expected["torch_cpu"])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda m: m["model"]["0.weight"]["shards"][0].update(file="../shared.json"), "plain name"),
        (
            lambda m: m["model"]["0.weight"]["shards"][0].update(file="other.safetensors"),
            "not among the manifest's files",
        ),
        (lambda m: m["model"]["0.weight"].update(shards=[]), "a hole"),
        (
            lambda m: m["model"]["0.weight"]["shards"].append(
                dict(m["model"]["0.weight"]["shards"][0])
            ),
            "overlap",
        ),
        (
            lambda m: (
                m["model"]["0.weight"].update(split=[0, 1])
                or m["layout"].update(tensor_parallel_size=3, world_size=3)
            ),
            "does not split",
        ),
        (lambda m: m["model"]["0.weight"].update(dtype="PICKLE"), "unknown dtype"),
        (lambda m: m["model"]["0.weight"].update(shape=[1] * 9), "not a list of sizes"),
    ],
)
def test_an_index_that_points_outside_overlaps_or_leaves_holes_is_refused(
    tmp_path, change, message
):
    path = _save(tmp_path, 1, _module(0))
    manifest = _manifest(path)
    change(manifest)
    _rewrite(path, manifest)
    with pytest.raises(CheckpointIndexError, match=message):
        open_checkpoint(path)


def test_optimizer_ranges_that_overlap_or_leave_holes_are_refused(tmp_path):
    path = _save(tmp_path, 1, _module(0))
    manifest = _manifest(path)
    piece = {
        "tp_rank": 0,
        "file": "rank00000.safetensors",
        "sha256": {s: "0" * 64 for s in ("param", "exp_avg", "exp_avg_sq")},
    }
    manifest["optimizer"] = {
        "kind": "distributed",
        "groups": [],
        "params": {
            "0.weight": {
                "split": None,
                "local_shape": [8, 4],
                "pieces": [{**piece, "start": 0, "end": 20}, {**piece, "start": 16, "end": 32}],
            }
        },
    }
    _rewrite(path, manifest)
    with pytest.raises(CheckpointIndexError, match="an overlap at element 20"):
        open_checkpoint(path)
    manifest["optimizer"]["params"]["0.weight"]["pieces"][1]["start"] = 24
    _rewrite(path, manifest)
    with pytest.raises(CheckpointIndexError, match="a hole at element 20"):
        open_checkpoint(path)


def test_a_shape_that_disagrees_with_the_model_is_refused_before_reading(tmp_path):
    path = _save(tmp_path, 1, _module(0))
    wider = torch.nn.Sequential(torch.nn.Linear(4, 9), torch.nn.ReLU(), torch.nn.Linear(9, 2))
    with pytest.raises(
        ValueError, match=r"0.bias has shape \[8\], the model's is \[9\]; a checkpoint of another"
    ):
        open_checkpoint(path).read_model(wider)


def test_a_huge_declared_size_is_refused_before_anything_is_allocated(tmp_path):
    path = _save(tmp_path, 1, _module(0))
    manifest = _manifest(path)
    manifest["model"]["0.weight"]["shape"] = [2**40, 2**20]  # 8 EiB of fp32
    _rewrite(path, manifest)
    ckpt = open_checkpoint(path)
    with pytest.raises(CorruptCheckpointError, match=r"has shape \[8, 4\], the index says"):
        ckpt.whole("0.weight")


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (b"\xff" * 8, "declares a"),
        (b"\x05\x00\x00\x00\x00\x00\x00\x00{nope", "not JSON"),
        (
            json.dumps({"t": {"dtype": "OBJ", "shape": [1], "data_offsets": [0, 1]}}),
            "unknown dtype",
        ),
        (
            json.dumps({"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}),
            "needs 16 bytes",
        ),
        (
            json.dumps({"t": {"dtype": "F32", "shape": [1000], "data_offsets": [0, 4000]}}),
            "outside the data",
        ),
        (
            json.dumps(
                {
                    "a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                    "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]},
                }
            ),
            "share bytes",
        ),
    ],
)
def test_a_tensor_file_is_checked_before_it_is_mapped(tmp_path, header, message):
    file = tmp_path / "x.safetensors"
    if isinstance(header, str):
        raw = header.encode()
        header = len(raw).to_bytes(8, "little") + raw
    file.write_bytes(header + b"\0" * 16)
    with pytest.raises(TensorFileError, match=message):
        TensorFile(file)


def test_a_pickle_in_place_of_a_tensor_file_runs_nothing(tmp_path):
    path = _save(tmp_path, 1, _module(0))
    marker = tmp_path / "pwned"
    plant_payload(path, "rank00000.safetensors", marker)
    with pytest.raises((CorruptCheckpointError, ValueError)):
        ckpt = open_checkpoint(path)
        ckpt.whole("0.weight")
    assert not marker.exists()


def test_tensor_files_round_trip_every_dtype_with_their_digests(tmp_path):
    tensors = {
        str(dtype): (torch.arange(6) % 2).to(dtype).reshape(2, 3)
        for dtype in (
            torch.float64,
            torch.float32,
            torch.bfloat16,
            torch.float16,
            torch.int64,
            torch.int32,
            torch.uint8,
            torch.bool,
        )
    }
    writer = TensorFileWriter(tmp_path / "t.safetensors", tensors, metadata={"k": "v"})
    writer.write()
    f = TensorFile(tmp_path / "t.safetensors")
    assert f.metadata == {"k": "v"}
    for name, t in tensors.items():
        assert torch.equal(f.read(name, sha256=writer.digests[name]), t)
    assert writer.size == (tmp_path / "t.safetensors").stat().st_size


def _resident_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(not hasattr(__import__("mmap"), "MADV_DONTNEED"), reason="no madvise here")
def test_a_released_tensor_leaves_the_process_and_reads_the_same_again(tmp_path):
    """A load keeps views of the file: hashing maps every page, ``release`` unmaps them (the
    resident size drops by the tensor's size) and the view still reads the same bytes."""
    tensor = torch.arange(16 << 20, dtype=torch.float32)  # 64 MiB
    writer = TensorFileWriter(tmp_path / "t.safetensors", {"t": tensor})
    writer.write()
    f = TensorFile(tmp_path / "t.safetensors")
    view = f.read("t")
    before = _resident_kib()
    assert float(view.sum()) == float(tensor.sum())  # maps every page
    mapped = _resident_kib()
    f.release("t")
    released = _resident_kib()
    assert mapped - before > 48 << 10 and mapped - released > 48 << 10
    assert torch.equal(view, tensor)
    f.read("t", sha256=writer.digests["t"])  # hashes, then releases its pages itself
    assert _resident_kib() - released < 16 << 10


def test_every_slice_has_one_writer_and_the_bytes_are_spread():
    mesh = Mesh(8, tensor_parallel_size=2)
    tensors = [LocalTensor(f"w{i}", torch.empty(64 * (i + 1), 4), (0, 1)) for i in range(12)]
    tensors += [LocalTensor(f"norm{i}", torch.empty(4), None) for i in range(5)]
    owner = writers(tensors, mesh)
    assert set(owner) == {(t.name, r) for t in tensors[:12] for r in (0, 1)} | {
        (f"norm{i}", 0) for i in range(5)
    }
    assert all(mesh.tp_rank(rank) == r for (name, r), rank in owner.items() if "w" in name)
    given = [0] * 8
    for (name, _), rank in owner.items():
        t = next(x for x in tensors if x.name == name)
        given[rank] += t.tensor.numel()
    assert max(given) <= 1.3 * sum(given) / 8
    assert owner == writers(list(reversed(tensors)), mesh)  # the same answer on every rank


def _expert_tensors(first: int) -> list[LocalTensor]:
    """One rank's tensors of an MoE layer with 2 of its 4 routed experts, from ``first``."""
    layer = "decoder.layers.0.mlp."
    out = [LocalTensor(layer + "router.weight", torch.empty(4, 8), None)]
    for g in (first, first + 1):
        expert = f"{layer}experts.local_experts.{g}."
        out.append(LocalTensor(expert + "linear_fc1.weight", torch.empty(16, 8), (0, 2)))
        out.append(LocalTensor(expert + "linear_fc2.weight", torch.empty(8, 4), (1, 1)))
    return out


def test_each_routed_expert_is_written_once_by_a_rank_of_its_ep_rank():
    # 8 ranks at TP 2, EP 2: planner ranks 0 and 2 hold experts 0-1, planner ranks 1 and 3
    # experts 2-3 (each expert has two data-parallel replicas): whichever EP rank computes the
    # writers, the answer is the same, and each expert's slice goes to one of its holders.
    mesh = Mesh(8, tensor_parallel_size=2, expert_parallel_size=2)
    owner = writers(_expert_tensors(0), mesh)
    assert owner == writers(_expert_tensors(2), mesh)
    experts = {(n, r): rank for (n, r), rank in owner.items() if ".local_experts." in n}
    assert len(experts) == 4 * 2 * 2  # 4 experts x 2 tensors x 2 TP slices
    for (name, tp_rank), rank in experts.items():
        index = int(name.split(".local_experts.")[1].split(".")[0])
        assert mesh.tp_rank(rank) == tp_rank
        assert ep_rank(mesh, rank) == index // 2, (name, rank)
    assert len(set(experts.values())) == 8  # spread over every rank


def test_experts_are_named_by_their_index_in_the_layer():
    # Local expert j of the rank whose first expert is 2, in the local spec and in TE's grouped
    # GEMM, is expert 2 + j; under a pipeline stage the layer is renumbered as well.
    local = "module.decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight"
    grouped = "module.decoder.layers.0.mlp.experts.linear_fc1.weight1"
    assert canonical_name(local, first_expert=2) == (
        "decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight"
    )
    assert canonical_name(grouped, {0: 5}, first_expert=2) == (
        "decoder.layers.5.mlp.experts.local_experts.3.linear_fc1.weight"
    )
    router = "decoder.layers.0.mlp.router.weight"
    shared = "decoder.layers.0.mlp.shared_experts.linear_fc1.weight"
    assert canonical_name(router, first_expert=2) == router
    assert canonical_name(shared, first_expert=2) == shared


@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_cut_and_join_are_inverses(stride, tp):
    whole = torch.arange(16 * 6).reshape(16, 6)
    for dim in (0, 1) if stride == 1 else (0,):
        if whole.shape[dim] % (tp * stride):
            continue
        slices = [cut(whole, dim=dim, stride=stride, tp_rank=r, tp_size=tp) for r in range(tp)]
        assert torch.equal(join(slices, dim=dim, stride=stride), whole)


def test_only_exact_step_directory_names_count(tmp_path):
    """A name with a trailing newline is not ``step_<n>``: ``re``'s ``$`` would let it pass and
    shadow the real directory of that step."""
    from dcp.checkpoint.directory import step_dirs

    for name in ("step_5", "step_6\n", "step_7x", "xstep_8"):
        (tmp_path / name).mkdir()
    assert step_dirs(tmp_path) == [(5, tmp_path / "step_5")]


def test_keep_last_counts_only_checkpoints_whose_manifest_and_shared_state_verify(tmp_path, caplog):
    """A checkpoint damaged in place (its sizes intact, so ``is_complete``) is no fallback: it
    takes no kept slot, so ``keep_last`` good ones remain; it is left for inspection, named."""
    for step in (2, 4):
        _save(tmp_path, step, _module(0), keep_last=2)
    _flip_same_size(tmp_path / "step_000004" / "manifest.json", b'"step":4', b'"step":5')
    _save(tmp_path, 6, _module(0), keep_last=2)
    _flip_same_size(tmp_path / "step_000006" / "shared.json", b'"step": 6', b'"step": 7')
    with caplog.at_level("WARNING"):
        _save(tmp_path, 8, _module(0), keep_last=2)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["latest", "step_000002", "step_000004", "step_000006", "step_000008"]
    assert "step_000004 is damaged (manifest.json: its content differs from its digest" in (
        caplog.text
    )
    assert "step_000006 is damaged (shared.json: its content differs" in caplog.text
    _save(tmp_path, 10, _module(0), keep_last=2)  # now two good ones are newer than step 2
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["latest", "step_000004", "step_000006", "step_000008", "step_000010"]
