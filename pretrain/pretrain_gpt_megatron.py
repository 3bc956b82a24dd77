"""Pretrain a GPT in Megatron-LM's own loop (``megatron.training.pretrain``), with or without DCP.

A Megatron-LM ``pretrain_gpt.py`` with the DCP lines marked ``# DCP``. Megatron's arguments as
usual, plus ``--dcp`` and ``--dcp-*`` (``python -m pretrain.pretrain_gpt_megatron --help``)::

    torchrun --nproc-per-node 2 -m pretrain.pretrain_gpt_megatron \\
        $(cat pretrain/configs/megatron_lm_cpu.args) --dcp --dcp-spec cpu-tiny

Without ``--dcp`` the same documents run through Megatron's own schedule at the fixed
``--context-parallel-size``: the static baseline. README, "From Megatron-LM".

megatron-core warns as its modules load (no Apex, no Transformer Engine, ...): ``main`` sets up
DCP's console (``dcp.console``: those known notices filtered) before anything imports it, so
megatron is imported inside the functions below rather than at the top.
"""

from __future__ import annotations

import os
import sys
import warnings

from dcp import console  # DCP
from dcp.train.launcher import die_with_launcher, rendezvous_failure  # DCP
from dcp.versions import require_supported_versions  # DCP


def model_provider(
    pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None
):
    """Megatron's GPT from its arguments, with DCP's attention."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.training import get_args
    from megatron.training.argument_utils import core_transformer_config_from_args

    from dcp.integrations import megatron_lm as dcp_mlm  # DCP

    args = get_args()
    config = config or core_transformer_config_from_args(args)
    # Experts in every layer (--num-experts; dcp_mlm.check_args refuses --moe-layer-freq).
    experts = dict(num_experts=args.num_experts, moe_grouped_gemm=args.moe_grouped_gemm)
    if args.transformer_impl == "transformer_engine":
        spec = get_gpt_layer_with_transformer_engine_spec(**experts, qk_layernorm=args.qk_layernorm)
    else:
        spec = get_gpt_layer_local_spec(
            **experts, normalization=args.normalization, qk_layernorm=args.qk_layernorm
        )
    spec = dcp_mlm.with_dcp_attention(spec)  # DCP
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base,
        pg_collection=pg_collection,
        vp_stage=vp_stage,  # which model chunk under virtual stages: its layers' offset
    )


def main() -> int:
    console.setup()  # DCP: first, so megatron's known import-time notices are filtered
    die_with_launcher()  # DCP: a launcher killed with -9 takes its workers along
    try:
        require_supported_versions()  # DCP: a torch outside DCP's range, in one line
        train()
    except ValueError as exc:  # a bad argument or data file: the same on every rank
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # DCP: a busy MASTER_PORT, a rank left alone, in one line
        message = rendezvous_failure(
            exc, timeout_s=_timeout_s(), timeout_key="--distributed-timeout-minutes"
        )
        if message is None:
            raise
        print(f"[rank{os.environ.get('RANK', '0')}] error: {message}", file=sys.stderr)
        return 2
    return 0


def _timeout_s() -> float:
    """Megatron's process-group timeout (``--distributed-timeout-minutes``), in seconds."""
    from megatron.training import get_args

    return 60.0 * get_args().distributed_timeout_minutes


def train() -> None:
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import pretrain_cfg_container_from_args

    from dcp.integrations import megatron_lm as dcp_mlm  # DCP

    args = dcp_mlm.parse_args()  # DCP: megatron's parse_and_validate_args + --dcp arguments
    with warnings.catch_warnings():
        # megatron recommends a ModelConfig over a model provider; this script is the
        # provider-style pretrain_gpt.py most Megatron-LM users have.
        warnings.filterwarnings("ignore", message=r"\s*It is recommended to use a ModelConfig")
        cfg = pretrain_cfg_container_from_args(args)
    with dcp_mlm.install(args) as dcp_run:  # DCP
        # By keyword: megatron-core 0.18 takes model_provider third, 0.19 fifth.
        pretrain(
            cfg,
            train_valid_test_dataset_provider=dcp_run.datasets_provider,  # DCP
            model_type=ModelType.encoder_or_decoder,
            forward_step_func=dcp_run.forward_step,  # DCP
            model_provider=model_provider,
        )


if __name__ == "__main__":
    sys.exit(main())
