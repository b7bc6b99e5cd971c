#!/usr/bin/env bash
# DPO with LoRA on one 8-GPU node, FSDP2: the bf16 base is sharded over the GPUs, LoRA r=16 on every
# linear layer, and the reference model is that same base with the adapter disabled (no second copy).
# Data: pairs in ms-swift's form (messages + rejected_response) or TRL's (prompt/chosen/rejected), see
# docs/rlhf.md. Step 1 logs loss ln 2 = 0.6931 and rewards 0 (the adapter starts as the identity).
# For a full fine-tune use --train_type full (the reference is then a frozen copy, sharded like the
# policy) or add --precompute_ref_log_probs (one pass before training, no copy). For QLoRA add
# --train_type qlora. Extra arguments are passed through (--dry-run prints the plan, --max_steps 10).
set -euo pipefail
MODEL=${MODEL:-llama-8b}
DATA=${DATA:-pairs.jsonl}
exec swiftlite rlhf --rlhf_type dpo --beta 0.1 --loss_type sigmoid \
  --model "$MODEL" --dataset "$DATA" \
  --train_type lora --lora_rank 16 --lora_alpha 32 --lora_dropout 0.05 --target_modules all-linear \
  --parallelism fsdp --nproc_per_node "${NPROC_PER_NODE:-8}" \
  --torch_dtype bf16 --gradient_checkpointing \
  --max_length 2048 --truncation_strategy delete \
  --per_device_train_batch_size 1 --gradient_accumulation_steps 8 \
  --learning_rate 5e-6 --lr_scheduler_type cosine --warmup_ratio 0.1 --num_train_epochs 1 \
  --save_steps 200 --save_total_limit 2 --logging_steps 5 \
  --output_dir "${OUTPUT_DIR:-output/dpo_lora_fsdp}" "$@"
