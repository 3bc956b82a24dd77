"""Rank bodies for the runtime parity tests (top-level so spawned ranks can unpickle them).

The reference is deliberately independent of DCP's attention and layout code: one process,
megatron-core's own ``DotProductAttention`` (``core_attention="megatron_local"``), each sequence
forwarded on its own as a plain ``[1, L]`` batch, loss = sum of token losses / total tokens.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from dcp.model import ModelConfig, build_gpt_model
from dcp.optim import OptimConfig, build_adamw, lr_at, set_lr

TINY = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=64,
    vocab_size=61,
    max_seq_len=512,
)
OPTIM = OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=1, decay_steps=4, clip_grad=1.0)
SEED = 11


def make_docs(lengths: list[int], seed: int) -> list[np.ndarray]:
    """Random documents: sequence length L → L + 1 tokens."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, TINY["vocab_size"], size=n + 1) for n in lengths]


def _cleanup() -> None:
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()


def _to_numpy(named) -> dict[str, np.ndarray]:
    return {n: t.detach().cpu().double().numpy().copy() for n, t in named}


def reference(docs: list[np.ndarray], *, train_steps: int = 0) -> dict:
    """Single process: loss and grads of the whole batch (and weights after ``train_steps``)."""
    from dcp.runtime import init_megatron_parallel

    assert dist.get_world_size() == 1
    init_megatron_parallel()
    try:
        model = build_gpt_model(ModelConfig(**TINY, core_attention="megatron_local"), seed=SEED)
        optimizer = build_adamw(model, OPTIM)
        total = sum(len(d) - 1 for d in docs)

        def loss_and_grads():
            model.zero_grad(set_to_none=True)
            loss_sum = torch.zeros((), dtype=torch.float64)
            for doc in docs:
                tokens = torch.as_tensor(doc, dtype=torch.long)
                inputs, labels = tokens[:-1].unsqueeze(0), tokens[1:].unsqueeze(0)
                pos = torch.arange(inputs.size(1)).unsqueeze(0)
                token_loss = model(inputs, pos, None, labels=labels)
                part = token_loss.float().sum()
                (part / total).backward()
                loss_sum += part.detach().double()
            return float(loss_sum) / total

        loss = loss_and_grads()
        out = {"loss": loss, "grads": _to_numpy((n, p.grad) for n, p in model.named_parameters())}
        params = [p for p in model.parameters() if p.requires_grad]
        losses = []
        for step in range(train_steps):
            if step > 0:
                losses.append(loss_and_grads())
            torch.nn.utils.clip_grad_norm_(params, OPTIM.clip_grad, foreach=False)
            set_lr(optimizer, lr_at(step, OPTIM))
            optimizer.step()
        if train_steps:
            out["losses"] = [loss, *losses]
            out["weights"] = _to_numpy(model.named_parameters())
        return out
    finally:
        _cleanup()


def dcp_run(docs: list[np.ndarray], plans: list[dict], *, train_steps: int = 0) -> dict | None:
    """DCP runtime on this rank: grads for ``plans[0]``; optionally ``train_steps`` optimizer
    steps, step i executing ``plans[i % len(plans)]``. Rank 0 returns the results."""
    from dcp.dispatch import InMemorySource
    from dcp.plan import Plan
    from dcp.runtime import Runtime

    try:
        runtime = Runtime.from_config(ModelConfig(**TINY, core_attention="dcp"), OPTIM, seed=SEED)
        source = InMemorySource(docs)
        first = Plan.from_dict(plans[0])
        result = runtime.forward_backward(first, source)
        loss_sum = torch.tensor([result.loss_sum], dtype=torch.float64)
        dist.all_reduce(loss_sum)
        out = {
            "loss": float(loss_sum) / result.global_loss_tokens,
            "grads": _to_numpy(runtime.grads().items()),
        }
        if train_steps:
            losses = []
            for step in range(train_steps):
                plan = Plan.from_dict(plans[step % len(plans)])
                losses.append(runtime.train_step(plan, source).loss)
            out["losses"] = losses
            out["weights"] = _to_numpy(runtime.named_parameters())
        return out if dist.get_rank() == 0 else None
    finally:
        _cleanup()


def mismatched_plans(docs: list[np.ndarray], plans: list[dict]) -> str:
    """Each rank executes ``plans[rank]``; returns the error message it raised."""
    from dcp.dispatch import InMemorySource
    from dcp.plan import Plan
    from dcp.runtime import Runtime

    try:
        runtime = Runtime.from_config(ModelConfig(**TINY), OPTIM, seed=SEED)
        plan = Plan.from_dict(plans[dist.get_rank()])
        try:
            runtime.forward_backward(plan, InMemorySource(docs))
        except RuntimeError as exc:
            return str(exc)
        raise AssertionError("a mismatched plan did not raise")
    finally:
        _cleanup()


def nonfinite_loss(docs: list[np.ndarray], plan: dict) -> dict:
    """A NaN in the output layer: ``skip`` leaves the weights alone, the default raises."""
    from dcp.dispatch import InMemorySource
    from dcp.plan import Plan
    from dcp.runtime import Runtime

    try:
        runtime = Runtime.from_config(ModelConfig(**TINY), OPTIM, seed=SEED)
        source, parsed = InMemorySource(docs), Plan.from_dict(plan)
        inner = runtime.model.module
        with torch.no_grad():
            inner.output_layer.weight[0, 0] = float("nan")
        before = {n: p.detach().clone() for n, p in inner.named_parameters()}
        stats = runtime.train_step(parsed, source, skip_nonfinite=True)
        unchanged = all(  # NaN compares unequal to itself: compare with NaNs zeroed
            torch.equal(torch.nan_to_num(p), torch.nan_to_num(before[n]))
            for n, p in inner.named_parameters()
        )
        try:
            runtime.train_step(parsed, source)
            raised = ""
        except FloatingPointError as exc:
            raised = str(exc)
        return {
            "skipped": stats.skipped,
            "loss": stats.loss,
            "unchanged": unchanged,
            "step_after": runtime.step,
            "raised": raised,
        }
    finally:
        _cleanup()
