"""DCP inside Megatron-LM's own training loop (``megatron.training.pretrain``).

A Megatron-LM script adds DCP's arguments to its parser, wraps ``pretrain`` in ``install``, gives
its layer spec DCP's attention, and takes DCP's dataset provider and forward step::

    args = dcp_mlm.parse_args()     # megatron's parse_and_validate_args + --dcp arguments
    spec = dcp_mlm.with_dcp_attention(spec)                  # in the model provider
    with dcp_mlm.install(args) as dcp_run:
        pretrain(cfg, train_valid_test_dataset_provider=dcp_run.datasets_provider,
                 model_type=..., forward_step_func=dcp_run.forward_step, model_provider=...)

``--dcp`` then runs every global batch as a DCP plan; without it the same documents run through
Megatron's own schedule (the static baseline). ``pretrain/pretrain_gpt_megatron.py`` is the
complete script; README's "From Megatron-LM" lists the lines.
"""

from dcp.integrations.megatron_lm.args import add_dcp_args, check_args, parse_args
from dcp.integrations.megatron_lm.install import MegatronLMRun, install, with_dcp_attention

__all__ = [
    "MegatronLMRun",
    "add_dcp_args",
    "check_args",
    "install",
    "parse_args",
    "with_dcp_attention",
]
