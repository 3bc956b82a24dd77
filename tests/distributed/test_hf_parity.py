"""Imported Hugging Face models through DCP's runtime equal ``transformers`` on real text.

Each supported architecture (tests/hf_models.py) is created locally, imported with
``dcp.load_hf_model`` on 2 gloo ranks, and run as packed documents at CP = 1 (each rank alone)
and CP = 2 (both ranks, zig-zag shards, DCP's attention exchange); the logits must equal the
HF model's, one document at a time, to 1e-5 relative in fp32. The mixtures of experts (Mixtral,
Qwen3-MoE) run in one launch, each at EP 1 and at EP 2 (each rank loading its half of the
experts by their index in the layer, tokens routed to the peer's experts and back).
"""

from __future__ import annotations

import inspect
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from dcp.checkpoint.hf import dcp_to_hf
from tests.distributed.harness import run_on_ranks
from tests.distributed.tiny import cleanup
from tests.hf_models import ARCH_CONFIGS, MIXTURES_OF_EXPERTS, hf_logits, make_hf_model

DOC_LENS = (2, 9, 130, 301)  # tokens; 2: a single next-token pair, 301: past llama31's 64


def real_text_docs() -> list[torch.Tensor]:
    """Byte-tokenized Python source (real text, ids < 257 fit every test vocabulary)."""
    raw = np.frombuffer(inspect.getsource(json.decoder).encode(), dtype=np.uint8)
    out, start = [], 0
    for n in DOC_LENS:
        out.append(torch.from_numpy(raw[start : start + n].astype(np.int64)))
        start += n
    return out


def dcp_logits(
    hf_dir: str, docs: list[np.ndarray], vocab: int, ep: int = 1, save_to: str | None = None
) -> dict:
    import torch.distributed as dist

    import dcp
    from dcp.mesh import Mesh
    from dcp.runtime.evaluate import packed_logits
    from dcp.runtime.groups import GroupRegistry
    from dcp.weights.canonical import local_experts

    dcp.init(expert_parallel_size=ep)
    try:
        # Padding the vocabulary to 64 rows exercises the padding mask on every architecture.
        model = dcp.load_hf_model(hf_dir, make_vocab_size_divisible_by=64)
        registry = GroupRegistry(Mesh(dist.get_world_size(), expert_parallel_size=ep))
        rank = dist.get_rank()
        out = {}
        for name, ranks in (("cp1", (rank,)), ("cp2", (0, 1))):
            logits = packed_logits(model, docs, ranks=ranks, registry=registry)
            # Padding rows score -inf: softmax over the padded row is the real vocabulary's.
            assert all(torch.isneginf(t[:, vocab:]).all() for t in logits)
            out[name] = [t[:, :vocab].numpy().copy() for t in logits]
        experts = local_experts(model)
        out["experts"] = None if experts is None else list(experts[0])
        if save_to is not None:
            save_weights(model, hf_dir, save_to, registry.mesh)
        return out
    finally:
        cleanup()


def save_weights(model, hf_dir: str, root: str, mesh) -> None:
    """A weights-only checkpoint of ``model`` (imported from ``hf_dir``) written by every rank
    of ``mesh``, its config recorded as ``hf_to_dcp`` records it."""
    import torch.distributed as dist

    from dcp.checkpoint import CheckpointSaver
    from dcp.checkpoint.state import local_tensors
    from dcp.schema import to_dict
    from dcp.weights.hf_config import model_type, read_hf_config, read_model_config

    rank = dist.get_rank()
    cfg = read_model_config(hf_dir, make_vocab_size_divisible_by=64)
    extra = {"config": {"model": to_dict(cfg)}, "hf_model_type": model_type(read_hf_config(hf_dir))}
    CheckpointSaver(root, mesh=mesh, rank=rank).save(
        0,
        weights_finite=True,
        asynchronous=False,
        tensors=local_tensors(model),
        pieces=None,
        optimizer_kind=None,
        optimizer_groups=None,
        rng=None,
        shared={"sampler": None, "scheduler": {"step": 0}, "extra": extra} if rank == 0 else None,
    )


def _assert_match(results: list[dict], reference: list[np.ndarray], what: str) -> None:
    for rank, out in enumerate(results):
        for mode in ("cp1", "cp2"):
            for i, (got, ref) in enumerate(zip(out[mode], reference, strict=True)):
                assert got.shape == ref.shape, (what, mode, i)
                rel = np.abs(got - ref).max() / np.abs(ref).max()
                assert rel <= 1e-5, f"{what} rank {rank} {mode} doc {i}: rel error {rel:.2e}"


@pytest.mark.parametrize("arch", sorted(set(ARCH_CONFIGS) - set(MIXTURES_OF_EXPERTS)))
def test_hf_import_logits_match_transformers(arch, tmp_path):
    hf_dir = make_hf_model(arch, tmp_path / arch)
    docs = real_text_docs()
    # HF sees the inputs doc[:-1]; DCP's packed forward does too (labels are doc[1:]).
    reference = [r.numpy() for r in hf_logits(hf_dir, [d[:-1] for d in docs])]
    vocab = reference[0].shape[-1]
    results = run_on_ranks(2, dcp_logits, str(hf_dir), [d.numpy() for d in docs], vocab)
    _assert_match(results, reference, arch)


def moe_logits(runs: list[tuple[str, int, int]], docs: list[np.ndarray]) -> list[dict]:
    """``dcp_logits`` of each (HF directory, vocabulary, EP size) in turn, in one launch; at
    EP 2 the imported weights are saved to ``<HF directory>-ep2``."""
    return [
        dcp_logits(hf_dir, docs, vocab, ep, save_to=f"{hf_dir}-ep{ep}" if ep > 1 else None)
        for hf_dir, vocab, ep in runs
    ]


def test_hf_import_of_mixtures_of_experts_matches_transformers_at_ep1_and_ep2(tmp_path):
    # Router semantics included: the top 2 of 4 experts per token and their renormalised
    # weights must be transformers' for every token, or the logits differ.
    docs = real_text_docs()
    references, runs = {}, []
    for arch in MIXTURES_OF_EXPERTS:
        hf_dir = make_hf_model(arch, tmp_path / arch)
        references[arch] = [r.numpy() for r in hf_logits(hf_dir, [d[:-1] for d in docs])]
        vocab = references[arch][0].shape[-1]
        runs += [(str(hf_dir), vocab, 1), (str(hf_dir), vocab, 2)]
    results = run_on_ranks(2, moe_logits, runs, [d.numpy() for d in docs], timeout_s=300)
    for k, (hf_dir, _, ep) in enumerate(runs):
        arch = hf_dir.rsplit("/", 1)[1]
        _assert_match([r[k] for r in results], references[arch], f"{arch} at EP {ep}")
        # Each rank held its own share of the experts.
        assert [r[k]["experts"] for r in results] == (
            [[0, 1], [2, 3]] if ep == 2 else [[0, 1, 2, 3]] * 2
        )
        if ep == 2:  # saved at EP 2, exported: the source's tensors, bit for bit
            exported = dcp_to_hf(f"{hf_dir}-ep2", tmp_path / f"{arch}-export")
            source = load_file(f"{hf_dir}/model.safetensors")
            back = load_file(exported / "model.safetensors")
            assert sorted(back) == sorted(source), arch
            assert all(torch.equal(back[n], t) for n, t in source.items()), arch
