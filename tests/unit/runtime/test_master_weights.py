"""bf16 parameters with a plain torch optimizer: the optimizer steps fp32 master copies, fed the
fp32 gradients, exactly as an fp32 model would be stepped, and the model gets the result."""

from __future__ import annotations

import pytest
import torch

from dcp.optim import MasterWeights


def _grads(step: int, shape) -> torch.Tensor:
    return torch.sin(torch.arange(shape.numel(), dtype=torch.float32) + step).reshape(shape) * 1e-2


def test_masters_step_as_fp32_does_and_write_back():
    torch.manual_seed(0)
    reference = torch.nn.Linear(16, 8, bias=True)  # fp32
    model = torch.nn.Linear(16, 8, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        for p, r in zip(model.parameters(), reference.parameters(), strict=True):
            r.copy_(p.float())  # the same starting point, exactly representable in bf16
    initial = {n: t.detach().clone() for n, t in model.named_parameters()}
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    masters = MasterWeights(list(model.parameters()), opt)
    assert masters and all(
        p.dtype == torch.float32 for group in opt.param_groups for p in group["params"]
    )
    for step in range(10):
        for p, r in zip(model.parameters(), reference.parameters(), strict=True):
            r.grad = _grads(step, r.shape)
            masters.master(p).grad = _grads(step, r.shape)  # megatron's fp32 main_grad
        ref_opt.step()
        opt.step()
        masters.write_back()
    for p, r in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(masters.master(p), r.detach())  # fp32 updates, bit for bit
        assert torch.equal(p, r.detach().to(torch.bfloat16))  # the model holds them rounded
    # Updates of 1e-4 on weights of ~0.1 are mostly below bf16's resolution: an optimizer
    # stepping the bf16 weights themselves loses them, which is why the masters exist.
    direct = torch.nn.Linear(16, 8, bias=True).to(torch.bfloat16)
    direct.load_state_dict(initial)
    direct_opt = torch.optim.AdamW(direct.parameters(), lr=1e-4)
    for step in range(10):
        for d in direct.parameters():
            d.grad = _grads(step, d.shape).to(torch.bfloat16)
        direct_opt.step()
    assert not torch.equal(direct.weight, reference.weight.detach().to(torch.bfloat16))


def test_fp32_models_keep_their_parameters():
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    masters = MasterWeights(list(model.parameters()), opt)
    assert not masters
    assert opt.param_groups[0]["params"] == list(model.parameters())


def test_an_optimizer_that_already_stepped_is_refused():
    model = torch.nn.Linear(4, 4).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    with pytest.raises(ValueError, match="before its first step"):
        MasterWeights(list(model.parameters()), opt)
