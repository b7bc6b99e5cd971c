#!/usr/bin/env bash
# QLoRA of a 70B model on 2 GPUs (80 GB) with FSDP2: the 4-bit base is sharded (each GPU holds
# half of it, ~19 GiB), LoRA r=16 on every linear layer, bf16 compute with activation checkpointing.
# The packed 4-bit weights are stored as bf16 (bnb_4bit_quant_storage = --torch_dtype), so FSDP
# shards them like any other bf16 parameter; --mixed_precision must then be bf16 or absent.
# Not with --cpu_offload or --compile (rejected: see docs/lora.md).
# Extra arguments are passed through (e.g. --dry-run to print the plan, --max_steps 10 to try it).
set -euo pipefail
MODEL=${MODEL:-llama-70b}
DATA=${DATA:-data.jsonl}
exec swiftlite sft \
  --model "$MODEL" --dataset "$DATA" \
  --train_type qlora --quant_bits 4 --bnb_4bit_quant_type nf4 --bnb_4bit_use_double_quant true \
  --lora_rank 16 --lora_alpha 32 --lora_dropout 0.05 --target_modules all-linear \
  --parallelism fsdp --nproc_per_node "${NPROC_PER_NODE:-2}" \
  --torch_dtype bf16 --gradient_checkpointing \
  --max_length 2048 --per_device_train_batch_size 1 --gradient_accumulation_steps 16 \
  --learning_rate 1e-4 --lr_scheduler_type cosine --warmup_ratio 0.03 --num_train_epochs 1 \
  --save_steps 200 --save_total_limit 2 --logging_steps 10 \
  --output_dir "${OUTPUT_DIR:-output/qlora_fsdp_2gpu}" "$@"
