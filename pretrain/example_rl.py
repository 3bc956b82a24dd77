"""An RL-style step through DCP in a plain loop: the old policy's per-token log-probs of a batch
of rollouts (a forward-only plan), then a PPO-clipped step on the response tokens only. Run with:
torchrun --nproc-per-node 2 -m pretrain.example_rl"""

import numpy as np
import torch
import torch.distributed as dist

import dcp
from dcp import console


def my_rollouts(num_batches: int, seed: int = 0):
    """Stand-in for your rollout workers: (documents, response masks, per-token advantages)."""
    rng = np.random.default_rng(seed)  # same seed on every rank → same rollouts
    for _ in range(num_batches):
        documents, masks, advantages = [], [], []
        for _ in range(8):
            prompt = int(rng.integers(4, 64))
            response = min(int(rng.lognormal(np.log(48), 1.0)) + 2, 900)
            documents.append(rng.integers(0, 250, size=prompt + response))
            masks.append(np.arange(prompt + response - 1) >= prompt - 1)  # the response's labels
            reward = rng.choice([-1.0, 1.0])  # one reward per rollout, on each of its tokens
            advantages.append(np.full(prompt + response - 1, reward))
        yield documents, masks, advantages


def clipped(logprobs, values, eps=0.2):
    """PPO's clipped surrogate, per token (DCP sums the response tokens of the whole batch)."""
    ratio = torch.exp(logprobs - values["old_logprobs"])
    adv = values["advantages"]
    return -torch.minimum(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv)


def gain(old, new, masks, advantages) -> float:
    """Mean over response tokens of advantage x (new - old log-prob): > 0 when a step moved the
    policy toward the rewarded rollouts."""
    terms = [
        (torch.as_tensor(a) * (n - o))[torch.as_tensor(m)]
        for o, n, m, a in zip(old, new, masks, advantages, strict=True)
    ]
    return float(torch.cat(terms).mean())


def run(num_steps: int = 4) -> list[tuple[float, float]]:
    """The loop; per step: its clipped loss and its ``gain``."""
    out = []
    # --- the ten lines ---------------------------------------------------------------------
    dcp.init()
    policy = dcp.build_gpt_model(dcp.ModelConfig(num_layers=2, hidden_size=64, max_seq_len=1024))
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    engine = dcp.DCPEngine(policy, optimizer, spec="cpu-tiny", planner="dcp")
    for documents, masks, advantages in my_rollouts(num_steps):
        old = engine.logprobs(documents)  # forward-only plan: per-token log-probs per document
        values = {"advantages": advantages, "old_logprobs": old}
        stats = engine.train_step(documents, loss_masks=masks, token_values=values, loss_fn=clipped)
        # ----------------------------------------------------------------------------------------
        out.append((stats.loss, gain(old, engine.logprobs(documents), masks, advantages)))
    return out


def main() -> None:
    console.setup()  # rank-aware logging; megatron-core's known start-up notices filtered
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    for step, (loss, moved) in enumerate(run()):
        if dist.get_rank() == 0:
            print(
                f"step {step} clipped loss {loss:.4f} advantage-weighted log-prob gain {moved:.2e}"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
