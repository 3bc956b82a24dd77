"""Runs that start from existing weights: ``init.from_hf`` and ``init.from_checkpoint``.

A tiny Llama made locally through ``transformers`` starts a 2-rank torchrun run; its first
logged loss (the forward before any update) must equal the HF model's own loss on the same
global batch (with the vocabulary padded, so the padding mask is on the training path), and a
run started from the ``hf-to-dcp`` conversion must log the same loss. A tiny Mixtral does the
same at expert parallelism 2.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
import yaml

from dcp.data.sampler import GlobalBatchSampler
from dcp.schema import load_config
from dcp.step.batches import build_dataset
from dcp.train.config import PretrainConfig
from tests.e2e.test_pretrain import OVERRIDES, REPO, command, finish, metrics, start
from tests.hf_models import make_hf_model

# The shape the e2e overrides give the model (tests/e2e/test_pretrain.py) and tiny_cpu's vocab.
SHAPE = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=257,
)


def hf_batch_loss(hf_dir, cfg: PretrainConfig) -> float:
    """The HF model's mean next-token loss over the run's first global batch."""
    import transformers

    dataset = build_dataset(cfg.data, vocab_size=cfg.model.vocab_size)
    batch = next(GlobalBatchSampler(dataset.doc_lengths, cfg.data.sampler))
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    total, tokens = 0.0, 0
    with torch.no_grad():
        for doc, length in zip(batch.doc_ids, batch.lengths, strict=True):
            ids = torch.as_tensor(np.asarray(dataset.get_tokens(doc, 0, length), dtype=np.int64))
            logits = model(ids[:-1].unsqueeze(0)).logits[0].double()
            total += float(torch.nn.functional.cross_entropy(logits, ids[1:], reduction="sum"))
            tokens += length - 1
    return total / tokens


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_hf_model("llama", tmp_path_factory.mktemp("hf") / "llama", **SHAPE)


def test_init_from_hf_starts_at_the_hf_models_loss(hf_dir, tmp_path):
    # A padded vocabulary (257 -> 320 rows): its masked logits must leave the loss unchanged.
    extra = (f"init.from_hf={hf_dir}", "train.steps=3", "model.make_vocab_size_divisible_by=64")
    out = finish(start(command(tmp_path, "from-hf", *extra)))
    assert "initial weights from" in out
    losses = [m["loss"] for m in metrics(tmp_path / "from-hf") if "loss" in m]
    cfg = load_config(
        PretrainConfig,
        REPO / "pretrain/configs/tiny_cpu.yaml",
        ["name=x", f"runs_dir={tmp_path}", *OVERRIDES, *extra],
    )
    expected = hf_batch_loss(hf_dir, cfg)
    assert losses[0] == pytest.approx(expected, rel=1e-5)
    # The resolved config records the model derived from config.json.
    resolved = yaml.safe_load((tmp_path / "from-hf" / "config.yaml").read_text())
    assert resolved["config"]["model"]["norm_eps"] == 1e-6
    assert resolved["config"]["model"]["rotary_base"] == 500000.0

    # The same weights through hf-to-dcp and init.from_checkpoint: the same first loss.
    subprocess.run(
        [sys.executable, "-m", "tools.convert_checkpoint", "hf-to-dcp", str(hf_dir),
         str(tmp_path / "converted")],
        cwd=REPO, check=True, capture_output=True,
    )  # fmt: skip
    out = finish(
        start(
            command(
                tmp_path, "from-ckpt", f"init.from_checkpoint={tmp_path / 'converted'}",
                "train.steps=1",
            )
        )
    )  # fmt: skip
    first = [m["loss"] for m in metrics(tmp_path / "from-ckpt") if "loss" in m][0]
    assert first == pytest.approx(losses[0], rel=1e-6)


def test_init_from_hf_of_a_mixture_of_experts_at_ep2_starts_at_the_hf_models_loss(tmp_path):
    # A tiny Mixtral (4 experts, top-2) on 2 ranks at EP 2: each rank loads its two experts by
    # their index in the layer, and the first loss is transformers' on the same batch.
    hf_moe = make_hf_model("mixtral", tmp_path / "mixtral", **SHAPE)
    extra = (f"init.from_hf={hf_moe}", "train.steps=1", "parallel.expert_parallel_size=2")
    finish(start(command(tmp_path, "from-hf-moe", *extra)))
    first = [m["loss"] for m in metrics(tmp_path / "from-hf-moe") if "loss" in m][0]
    cfg = load_config(
        PretrainConfig,
        REPO / "pretrain/configs/tiny_cpu.yaml",
        ["name=x", f"runs_dir={tmp_path}", *OVERRIDES, *extra],
    )
    assert cfg.model.num_experts == 4 and cfg.model.moe_router_topk == 2
    assert first == pytest.approx(hf_batch_loss(hf_moe, cfg), rel=1e-5)


def test_model_keys_that_contradict_the_source_are_refused(hf_dir):
    with pytest.raises(ValueError, match="model.hidden_size=64 contradicts init.from_hf"):
        load_config(PretrainConfig, None, [f"init.from_hf={hf_dir}", "model.hidden_size=64"])
    cfg = load_config(PretrainConfig, None, [f"init.from_hf={hf_dir}", "model.max_seq_len=64"])
    assert cfg.model.max_seq_len == 64 and cfg.model.hidden_size == 32
