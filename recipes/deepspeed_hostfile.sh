#!/usr/bin/env bash
# Multi-node training through the DeepSpeed launcher (pdsh-style), for clusters set up for it.
# HOSTFILE lists "hostname slots=N" per node; run this once, on the first host:
#   HOSTFILE=/job/hostfile MASTER_ADDR=node1 recipes/deepspeed_hostfile.sh [--dry-run]
set -euo pipefail
: "${HOSTFILE:?set HOSTFILE to a DeepSpeed hostfile (hostname slots=N per line)}"
exec swiftlite sft \
  --model "${MODEL:-llama-8b}" --dataset "${DATA:-data.jsonl}" --train-type full \
  --parallelism zero3 --launcher deepspeed --hostfile "$HOSTFILE" \
  --nproc-per-node "${NPROC_PER_NODE:-8}" --master-addr "${MASTER_ADDR:-127.0.0.1}" \
  --master-port "${MASTER_PORT:-29500}" \
  --torch-dtype bf16 --gradient-checkpointing --max-length 4096 \
  --per-device-train-batch-size 1 --gradient-accumulation-steps 4 --learning-rate 1e-5 \
  --output-dir "${OUTPUT_DIR:-output/deepspeed_hostfile}" "$@"
