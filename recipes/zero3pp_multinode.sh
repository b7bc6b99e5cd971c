#!/usr/bin/env bash
# DeepSpeed ZeRO++ across 2 nodes x 8 GPUs: ZeRO-3 plus hpZ, a secondary copy of the weights sharded
# within each node (zero_hpz_partition_size = the processes per node), so the backward all-gathers
# stay on the node's NVLink. QUANTIZED=1 adds ZeRO++'s qwZ and qgZ (int8 weight all-gathers, int4
# gradient reduction; DeepSpeed's CUDA kernels, refused on a CPU run).
# Run the same command on every node, with NODE_RANK set per node (0 on the master) and MASTER_ADDR
# pointing at node 0 (ms-swift's env vars are honoured):
#   NODE_RANK=0 MASTER_ADDR=10.0.0.1 recipes/zero3pp_multinode.sh
#   NODE_RANK=1 MASTER_ADDR=10.0.0.1 recipes/zero3pp_multinode.sh
# Add --dry-run to print the torchrun command each node would run.
set -euo pipefail
: "${NODE_RANK:?set NODE_RANK (0..NNODES-1)}"
: "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0}"
EXTRA=()
[ -n "${QUANTIZED:-}" ] && EXTRA+=(--zero-quantized-weights --zero-quantized-gradients)
exec swiftlite sft \
  --model "${MODEL:-llama-70b}" --dataset "${DATA:-data.jsonl}" --train-type full \
  --parallelism zero3pp --nnodes "${NNODES:-2}" --node-rank "$NODE_RANK" \
  --nproc-per-node "${NPROC_PER_NODE:-8}" --master-addr "$MASTER_ADDR" --master-port "${MASTER_PORT:-29500}" \
  --torch-dtype bf16 --gradient-checkpointing --max-length 4096 \
  --per-device-train-batch-size 1 --gradient-accumulation-steps 4 --learning-rate 1e-5 \
  --save-steps 200 --save-total-limit 2 --output-dir "${OUTPUT_DIR:-output/zero3pp_multinode}" "${EXTRA[@]}" "$@"
