"""DCP in a plain training loop (README's ten-line example). Run with:
torchrun --nproc-per-node 2 -m pretrain.example_engine"""

import numpy as np
import torch
import torch.distributed as dist

import dcp
from dcp import console


def my_batches(num_batches: int, seed: int = 0):
    """Stand-in for your data loader: global batches of variable-length token documents."""
    rng = np.random.default_rng(seed)  # same seed on every rank → same batches
    for _ in range(num_batches):
        lengths = np.minimum(rng.lognormal(np.log(96), 1.0, size=16).astype(int) + 2, 1024)
        yield [np.arange(n) * rng.integers(1, 4) % 250 for n in lengths]


def main() -> None:
    console.setup()  # rank-aware logging; megatron-core's known start-up notices filtered
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    # --- the ten lines ---------------------------------------------------------------------
    dcp.init()  # megatron patches this machine needs (CPU shim) + parallel state
    model = dcp.build_gpt_model(  # bf16 weights; DCP keeps fp32 master weights for AdamW
        dcp.ModelConfig(num_layers=2, hidden_size=64, max_seq_len=1024, dtype="bf16")
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    engine = dcp.DCPEngine(model, optimizer, spec="cpu-tiny", planner="dcp")
    for step, documents in enumerate(my_batches(8)):
        stats = engine.train_step(documents)
        if dist.get_rank() == 0:
            print(f"step {step} loss {stats.loss:.4f} micro-steps {stats.num_micro_steps}")
    # ----------------------------------------------------------------------------------------
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
