#!/usr/bin/env bash
# Multi-node launch with torchrun (run once per node). Example, 4 nodes × 8 H200:
#   NNODES=4 NODE_RANK=$i MASTER_ADDR=node0 ./docker/launch_torchrun.sh \
#       --config pretrain/configs/llama3_8b_h200.yaml planning.spec=h200x32+llama3-8b
set -euo pipefail
: "${NNODES:=1}" "${NODE_RANK:=0}" "${MASTER_ADDR:=127.0.0.1}" "${MASTER_PORT:=29500}"
: "${GPUS_PER_NODE:=8}" "${RDZV_ID:=dcp}"
# Micro-step shapes vary: let the CUDA allocator grow segments (docs/gpu.md; also the image's).
: "${PYTORCH_CUDA_ALLOC_CONF:=expandable_segments:True}"
export PYTORCH_CUDA_ALLOC_CONF
# torchrun's c10d rendezvous: the nodes may start in any order (within its 600 s join timeout).
# NODE_RANK 0 hosts its store at MASTER_ADDR:MASTER_PORT (torchrun would otherwise guess the
# host from the node's names). Global ranks are torchrun's choice (nodes sorted by host name and
# process id), not NODE_RANK's.
is_host=0
if [[ "$NODE_RANK" == 0 ]]; then is_host=1; fi
exec torchrun \
  --nnodes "${NNODES}" --nproc-per-node "${GPUS_PER_NODE}" \
  --rdzv-backend c10d --rdzv-endpoint "${MASTER_ADDR}:${MASTER_PORT}" --rdzv-id "${RDZV_ID}" \
  --rdzv-conf "is_host=${is_host}" \
  -m pretrain.pretrain_gpt "$@"
