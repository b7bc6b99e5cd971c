#!/usr/bin/env bash
# Full fine-tuning of an 8B model with FSDP2 on one 8-GPU node: bf16 compute with fp32 gradient
# reduction, activation checkpointing, per-layer torch.compile.
# Extra arguments are passed through (e.g. --dry-run to print the plan, --max-steps 10 to try it).
set -euo pipefail
MODEL=${MODEL:-llama-8b}
DATA=${DATA:-data.jsonl}
exec swiftlite sft \
  --model "$MODEL" --dataset "$DATA" --train-type full \
  --parallelism fsdp --nproc-per-node "${NPROC_PER_NODE:-8}" \
  --torch-dtype bf16 --mixed-precision bf16 --gradient-checkpointing --compile \
  --max-length 4096 --per-device-train-batch-size 1 --gradient-accumulation-steps 8 \
  --learning-rate 1e-5 --lr-scheduler cosine --warmup-ratio 0.03 --num-train-epochs 2 \
  --save-steps 500 --save-total-limit 3 --logging-steps 10 \
  --output-dir "${OUTPUT_DIR:-output/fsdp2_full_8gpu}" "$@"
