"""Supervised fine-tuning through DCP in a plain loop: chat conversations (JSONL, byte-level
tokens), the loss on the assistant's tokens only. Run with (or ``make demo-sft-engine``):
torchrun --nproc-per-node 2 -m pretrain.example_sft [--data chats.jsonl] [--steps N]
Without ``--data`` it writes and trains on a demo corpus (``dcp.data.sft.write_demo_chats``)."""

import argparse
import itertools
import sys

import torch
import torch.distributed as dist

import dcp
from dcp import console
from dcp.data.sft import chat_batches, read_chat_jsonl, write_demo_chats
from dcp.data.tokenizer import build_tokenizer
from dcp.files import FileContentError

DEMO_DATA = "runs/demo-sft/chats.jsonl"


def run(data: str, *, steps: int, tokens_per_batch: int = 4096) -> list[tuple[float, int]]:
    """The loop; per step its loss (the mean over the batch's assistant tokens) and how many
    tokens that mean is over."""
    losses = []
    # --- the ten lines ---------------------------------------------------------------------
    dcp.init()
    chats = read_chat_jsonl(data, tokenizer=build_tokenizer("byte"), max_tokens=1025)
    model = dcp.build_gpt_model(dcp.ModelConfig(num_layers=2, hidden_size=64, max_seq_len=1024))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    engine = dcp.DCPEngine(model, optimizer, spec="cpu-tiny", planner="dcp")
    batches = chat_batches(chats, tokens_per_batch=tokens_per_batch, seed=0)
    for batch in itertools.islice(batches, steps):
        tokens, masks = [c.tokens for c in batch], [c.loss_mask for c in batch]
        stats = engine.train_step(tokens, loss_masks=masks)  # assistant tokens only
        # ----------------------------------------------------------------------------------------
        losses.append((stats.loss, stats.loss_tokens))
        if dist.get_rank() == 0:
            print(
                f"step {len(losses)} loss {stats.loss:.4f} on {stats.loss_tokens} assistant "
                f"tokens of {sum(t.size - 1 for t in tokens)}, "
                f"{stats.num_micro_steps} micro-steps on rank 0"
            )
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help=f"chat JSONL (default: a demo corpus in {DEMO_DATA})")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    console.setup()  # rank-aware logging; megatron-core's known start-up notices filtered
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if args.data is None and dist.get_rank() == 0:
        write_demo_chats(DEMO_DATA, num_chats=512)
    dist.barrier()
    try:
        run(args.data or DEMO_DATA, steps=args.steps)
    except FileContentError as exc:  # every rank reads the same file, so every rank stops
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
