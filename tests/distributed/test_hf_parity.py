"""Imported Hugging Face models through DCP's runtime equal ``transformers`` on real text.

Each supported architecture (tests/hf_models.py) is created locally, imported with
``dcp.load_hf_model`` on 2 gloo ranks, and run as packed documents at CP = 1 (each rank alone)
and CP = 2 (both ranks, zig-zag shards, DCP's attention exchange); the logits must equal the
HF model's, one document at a time, to 1e-5 relative in fp32.
"""

from __future__ import annotations

import inspect
import json

import numpy as np
import pytest
import torch

from tests.distributed.harness import run_on_ranks
from tests.distributed.tiny import cleanup
from tests.hf_models import ARCH_CONFIGS, hf_logits, make_hf_model

DOC_LENS = (2, 9, 130, 301)  # tokens; 2: a single next-token pair, 301: past llama31's 64


def real_text_docs() -> list[torch.Tensor]:
    """Byte-tokenized Python source (real text, ids < 257 fit every test vocabulary)."""
    raw = np.frombuffer(inspect.getsource(json.decoder).encode(), dtype=np.uint8)
    out, start = [], 0
    for n in DOC_LENS:
        out.append(torch.from_numpy(raw[start : start + n].astype(np.int64)))
        start += n
    return out


def dcp_logits(hf_dir: str, docs: list[np.ndarray], vocab: int) -> dict:
    import torch.distributed as dist

    import dcp
    from dcp.mesh import Mesh
    from dcp.runtime.evaluate import packed_logits
    from dcp.runtime.groups import GroupRegistry

    dcp.init()
    try:
        # Padding the vocabulary to 64 rows exercises the padding mask on every architecture.
        model = dcp.load_hf_model(hf_dir, make_vocab_size_divisible_by=64)
        registry = GroupRegistry(Mesh(dist.get_world_size()))
        rank = dist.get_rank()
        out = {}
        for name, ranks in (("cp1", (rank,)), ("cp2", (0, 1))):
            logits = packed_logits(model, docs, ranks=ranks, registry=registry)
            # Padding rows score -inf: softmax over the padded row is the real vocabulary's.
            assert all(torch.isneginf(t[:, vocab:]).all() for t in logits)
            out[name] = [t[:, :vocab].numpy().copy() for t in logits]
        return out
    finally:
        cleanup()


@pytest.mark.parametrize("arch", sorted(ARCH_CONFIGS))
def test_hf_import_logits_match_transformers(arch, tmp_path):
    hf_dir = make_hf_model(arch, tmp_path / arch)
    docs = real_text_docs()
    # HF sees the inputs doc[:-1]; DCP's packed forward does too (labels are doc[1:]).
    reference = [r.numpy() for r in hf_logits(hf_dir, [d[:-1] for d in docs])]
    vocab = reference[0].shape[-1]
    results = run_on_ranks(2, dcp_logits, str(hf_dir), [d.numpy() for d in docs], vocab)
    for rank, out in enumerate(results):
        for mode in ("cp1", "cp2"):
            for i, (got, ref) in enumerate(zip(out[mode], reference, strict=True)):
                assert got.shape == ref.shape, (mode, i)
                rel = np.abs(got - ref).max() / np.abs(ref).max()
                assert rel <= 1e-5, f"{arch} rank {rank} {mode} doc {i}: rel error {rel:.2e}"
