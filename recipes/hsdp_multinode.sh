#!/usr/bin/env bash
# HSDP (FSDP2 on a 2-D mesh) across 2 nodes x 8 GPUs: each node holds one fully sharded copy of the
# model (parameter all-gathers and gradient reduce-scatters stay on the node's NVLink), and the
# copies are replicas (each rank all-reduces only its 1/8 shard of the gradients across the
# network, once per step). The shard
# size defaults to the processes per node; HSDP_SHARD_SIZE overrides it (a divisor of the world).
# Run the same command on every node, with NODE_RANK set per node (0 on the master) and MASTER_ADDR
# pointing at node 0 (ms-swift's env vars are honoured):
#   NODE_RANK=0 MASTER_ADDR=10.0.0.1 recipes/hsdp_multinode.sh
#   NODE_RANK=1 MASTER_ADDR=10.0.0.1 recipes/hsdp_multinode.sh
# Add --dry-run to print the torchrun command each node would run. Other FSDP2 knobs pass through:
# --forward-prefetch 2 --backward-prefetch 2, --reshard-after-forward false (keep layers gathered
# between forward and backward), --cpu-offload.
set -euo pipefail
: "${NODE_RANK:?set NODE_RANK (0..NNODES-1)}"
: "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0}"
EXTRA=()
[ -n "${HSDP_SHARD_SIZE:-}" ] && EXTRA+=(--hsdp-shard-size "$HSDP_SHARD_SIZE")
exec swiftlite sft \
  --model "${MODEL:-llama-70b}" --dataset "${DATA:-data.jsonl}" --train-type full \
  --parallelism hsdp --nnodes "${NNODES:-2}" --node-rank "$NODE_RANK" \
  --nproc-per-node "${NPROC_PER_NODE:-8}" --master-addr "$MASTER_ADDR" --master-port "${MASTER_PORT:-29500}" \
  --torch-dtype bf16 --gradient-checkpointing --max-length 4096 \
  --per-device-train-batch-size 1 --gradient-accumulation-steps 4 --learning-rate 1e-5 \
  --save-steps 200 --save-total-limit 2 --output-dir "${OUTPUT_DIR:-output/hsdp_multinode}" "${EXTRA[@]}" "$@"
