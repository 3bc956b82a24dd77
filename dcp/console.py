"""What an entry point prints: rank-aware logging, and known third-party noise filtered out.

Every entry point (``pretrain/*.py``, ``tools/*.py``) calls ``setup()`` first thing in
``main()``, so that its own output comes first. megatron-core warns while its modules import, and
a warning filter only catches what is emitted after it is installed: ``setup()`` must run before
anything imports megatron-core or ``torch.utils.cpp_extension`` (the entry-point modules import
neither; ``tests/unit/test_quiet_entry_points.py`` checks both that and the output).

Only the messages in ``KNOWN_NOISE`` are dropped, each matched by its text and the module that
emits it; every other warning still shows. ``DCP_VERBOSE=1`` (or ``verbose=True``) drops nothing
and logs at DEBUG on rank 0.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from dataclasses import dataclass

VERBOSE_ENV = "DCP_VERBOSE"
"""Environment variable: set to anything but ``""``/``0`` to see every warning and log line."""


@dataclass(kw_only=True, frozen=True)
class Noise:
    """A message a third-party package prints on every run that asks nothing of the user."""

    module: str
    """Who emits it: for a warning, a regular expression its module's name must match from the
    start; for a log record, the name of the logger (the emitting module's name)."""
    message: str
    """The message's first words, literally."""
    category: type[Warning] | None = None
    """The warning's class; ``None`` for a log record."""


KNOWN_NOISE: tuple[Noise, ...] = (
    # megatron-core (optimizer, clip_grads, megatron_fsdp, megatron.training's utilities) on
    # importing, without TE and apex: it falls back to torch's optimizers and its own
    # multi-tensor helpers, as DCP expects on CPU.
    Noise(
        module=r"megatron\.",
        message="Transformer Engine and Apex are not installed",
        category=UserWarning,
    ),
    # megatron-core (models.backends, gpt_layer_specs) on importing, without apex: torch's norm.
    Noise(
        module=r"megatron\.core\.",
        message="Apex is not installed. Falling back to Torch Norm",
        category=UserWarning,
    ),
    # megatron.core.hyper_comm_grid on importing, without absl: it logs through `logging`.
    Noise(
        module=r"megatron\.core\.hyper_comm_grid",
        message="absl.logging is not installed",
        category=UserWarning,
    ),
    # megatron.core.transformer.transformer_config on every TransformerConfig: the default
    # cuda_graph_modules="full" is the deprecated spelling (CUDA graphs are off in DCP).
    Noise(
        module=r"megatron\.core\.transformer\.transformer_config",
        message="full scope is deprecated",
        category=UserWarning,
    ),
    # megatron.core.models.mimo.config.base_configs on importing (the class body warns); DCP
    # builds no MIMO model.
    Noise(
        module=r"megatron\.core\.models\.mimo\.",
        message="MimoModelConfig is experimental",
        category=UserWarning,
    ),
    # megatron.core.inference.contexts on importing (shown under -W default and pytest).
    Noise(
        module=r"megatron\.core\.inference\.contexts",
        message="The following imports from `dynamic_context.py` will be removed",
        category=DeprecationWarning,
    ),
    # torch's rms_norm in a bf16 model built from megatron's local spec: megatron builds torch's
    # RMSNorm with fp32 weights (default dtype), so a bf16 activation meets an fp32 weight and
    # ATen takes the unfused path (layer_norm.cpp). TE's spec on a GPU fuses the norm into the
    # next linear instead. Seen since README's example trains in bf16 on CPU.
    Noise(
        module=r"torch\.nn\.functional",
        message="Mismatch dtype between input and weight",
        category=UserWarning,
    ),
    # torch.utils.cpp_extension on importing (megatron-core imports it), on a machine with a
    # CUDA toolkit but no GPU.
    Noise(module="torch.utils.cpp_extension", message="No CUDA runtime is found"),
    # megatron.core.extensions.transformer_engine_spec_provider on importing, without TE (its
    # version reads 0.0.0): megatron's local linear layers, as DCP expects on CPU.
    Noise(
        module=r"megatron\.core\.extensions\.transformer_engine_spec_provider",
        message="Only transformer-engine>=1.7.0 supports MoE experts",
        category=UserWarning,
    ),
    # torch 2.14 on every call megatron-core 0.19.2's distributed optimizer and DDP make: the
    # *_single collectives it recommends are not used by that megatron-core yet.
    *(
        Noise(
            module=r"torch\.distributed\.",
            message=f"`torch.distributed.{name}` is deprecated",
            category=FutureWarning,
        )
        for name in ("all_gather_into_tensor", "reduce_scatter_tensor")
    ),
    # megatron-core's rerun state machine, WARNING on rank 0, around every evaluation of
    # Megatron-LM's loop: it switches result validation off and back on for the forward passes.
    Noise(module="megatron.core.rerun_state_machine", message="Setting RerunStateMachine mode"),
    # torch.compile of megatron's fused bias-dropout-add on CPU: the CPU shim's TorchFunctionMode
    # (megatron_patches.cpu_optimizer) changes a guard each call, so after 8 recompiles the
    # function runs eagerly, as it does on CPU anyway. No shim, no recompiles on a GPU.
    Noise(
        module="torch._dynamo.convert_frame",
        message="torch._dynamo hit config.recompile_limit",
    ),
    # megatron-core's GPTModel constructor, WARNING on rank 0: megatron steers new code to
    # HybridModel; DCP builds GPTModel on purpose.
    Noise(module="megatron.core.models.gpt.gpt_model", message="GPTModel IS DEPRECATED"),
    # megatron-core's DistributedDataParallel with the distributed optimizer, WARNING on rank 0:
    # it computes the parameter layout itself when the caller passes none, as DCP's wrap_ddp does.
    Noise(
        module="megatron.core.distributed.distributed_data_parallel",
        message="DistributedDataParallel: full_param_layout not provided",
    ),
)

QUIET_LOGGERS: dict[str, int] = {
    # megatron-core lists every parameter and bucket at INFO while building DDP and optimizer.
    "megatron": logging.WARNING,
}


class _DropMessages(logging.Filter):
    """Drops a logger's records whose message starts with one of ``messages``."""

    def __init__(self, messages: list[str]) -> None:
        super().__init__()
        self.messages = tuple(messages)

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.messages)


def verbose_requested() -> bool:
    """Whether ``DCP_VERBOSE`` asks for every warning and log line."""
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def setup(rank: int | None = None, *, verbose: bool = False, level: int = logging.INFO) -> None:
    """Configure logging and filter ``KNOWN_NOISE`` for this process; call it first in ``main()``.

    ``rank``: this process's rank (default: ``RANK`` from torchrun, if set). Log lines read
    ``[rank{r}] time logger: message`` under a launcher, ``time logger: message`` otherwise;
    rank 0 logs at ``level``, other ranks at WARNING. ``verbose`` (or ``DCP_VERBOSE=1``) keeps
    every warning and third-party log line and logs DEBUG on rank 0. Calling it again adds no
    second filter; an already configured root logger (a test's) is left as it is.
    """
    if rank is None and "RANK" in os.environ:
        rank = int(os.environ["RANK"])
    verbose = verbose or verbose_requested()
    prefix = "" if rank is None else f"[rank{rank}] "
    if rank in (None, 0):
        root_level = logging.DEBUG if verbose else level
    else:
        root_level = logging.WARNING
    logging.basicConfig(level=root_level, format=f"{prefix}%(asctime)s %(name)s: %(message)s")
    if verbose:
        return
    for name, logger_level in QUIET_LOGGERS.items():
        logging.getLogger(name).setLevel(logger_level)
    by_logger: dict[str, list[str]] = {}
    for noise in KNOWN_NOISE:
        if noise.category is None:
            by_logger.setdefault(noise.module, []).append(noise.message)
        else:
            warnings.filterwarnings(
                "ignore",
                message=re.escape(noise.message),
                category=noise.category,
                module=noise.module,
            )
    for name, messages in by_logger.items():
        logger = logging.getLogger(name)
        for old in [f for f in logger.filters if isinstance(f, _DropMessages)]:
            logger.removeFilter(old)
        logger.addFilter(_DropMessages(messages))
