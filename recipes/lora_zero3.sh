#!/usr/bin/env bash
# LoRA of an 8B model with DeepSpeed ZeRO-3 on one 8-GPU node: the bf16 base is partitioned over the
# GPUs (loaded under zero.Init), LoRA r=8 on every linear layer. The adapter is gathered from all
# ranks before it is written (checkpoint-N/adapter/, loadable with PeftModel.from_pretrained).
# For QLoRA add --train_type qlora (ZeRO-3 partitions the 4-bit base; not with zero3_offload).
# Extra arguments are passed through (e.g. --dry-run to print the plan, --max_steps 10 to try it).
set -euo pipefail
MODEL=${MODEL:-llama-8b}
DATA=${DATA:-data.jsonl}
exec swiftlite sft \
  --model "$MODEL" --dataset "$DATA" \
  --train_type lora --lora_rank 8 --lora_alpha 32 --lora_dropout 0.05 --target_modules all-linear \
  --deepspeed zero3 --nproc_per_node "${NPROC_PER_NODE:-8}" \
  --torch_dtype bf16 --gradient_checkpointing \
  --max_length 4096 --per_device_train_batch_size 1 --gradient_accumulation_steps 4 \
  --learning_rate 1e-4 --lr_scheduler_type cosine --warmup_ratio 0.03 --num_train_epochs 2 \
  --save_steps 500 --save_total_limit 3 --logging_steps 10 \
  --output_dir "${OUTPUT_DIR:-output/lora_zero3}" "$@"
