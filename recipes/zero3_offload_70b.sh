#!/usr/bin/env bash
# Full fine-tuning of a 70B model with DeepSpeed ZeRO-3 + CPU offload of parameters and optimizer
# state + activation checkpointing: the combination for 100B-class full fine-tuning when sharding
# alone does not fit (see `swiftlite estimate --model llama-70b --gpus 8 --gpu-memory 80GB`).
# The model is loaded under zero.Init, so no rank ever holds all 70B parameters.
# Extra arguments pass through (--dry-run prints the plan).
set -euo pipefail
exec swiftlite sft \
  --model "${MODEL:-llama-70b}" --dataset "${DATA:-data.jsonl}" --train-type full \
  --parallelism zero3_offload --nproc-per-node "${NPROC_PER_NODE:-8}" \
  --torch-dtype bf16 --gradient-checkpointing --max-length 4096 \
  --per-device-train-batch-size 1 --gradient-accumulation-steps 16 \
  --learning-rate 1e-5 --warmup-ratio 0.03 --num-train-epochs 1 \
  --save-steps 100 --save-total-limit 2 --logging-steps 5 \
  --output-dir "${OUTPUT_DIR:-output/zero3_offload_70b}" "$@"
