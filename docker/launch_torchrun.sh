#!/usr/bin/env bash
# Multi-node launch with torchrun (run once per node). Example, 4 nodes × 8 H200:
#   NNODES=4 NODE_RANK=$i MASTER_ADDR=node0 ./docker/launch_torchrun.sh \
#       --config pretrain/configs/llama3_8b_h200.yaml planning.spec=h200x32+llama3-8b
set -euo pipefail
: "${NNODES:=1}" "${NODE_RANK:=0}" "${MASTER_ADDR:=127.0.0.1}" "${MASTER_PORT:=29500}"
: "${GPUS_PER_NODE:=8}"
exec torchrun \
  --nnodes "${NNODES}" --node-rank "${NODE_RANK}" --nproc-per-node "${GPUS_PER_NODE}" \
  --master-addr "${MASTER_ADDR}" --master-port "${MASTER_PORT}" \
  -m pretrain.pretrain_gpt "$@"
