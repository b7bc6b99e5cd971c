#!/usr/bin/env bash
# The GRPO demo: from a briefly fine-tuned tiny-llama (the SFT demo's reverse-string task, stopped
# early), GRPO with an exact-match reward (scripts/grpo_exact_reward.py, passed with --external_plugins
# as an ms-swift plugin is) on prompts of the same task, then the held-out exact-match accuracy
# (greedy, `swiftlite infer --metric exact_match` on demo_data/val.jsonl, 200 rows) before and after.
#
# The SFT checkpoint: SFT_CKPT, else one made here (SFT_STEPS=125 steps, batch 32, constant learning
# rate 2e-3 after 10 warm-up steps, one process): about a quarter of the held-out strings right, so
# that sampled groups of NUM_GEN completions often hold both right and wrong answers (an all-right or
# all-wrong group has no advantage, hence no gradient). GRPO: full fine-tuning, --beta 0 (no reference
# copy), temperature 0.7, lr 1e-4 constant, STEPS=60 steps of 32 completions (4 prompts x 8).
# Runs on a CPU; figures in docs/rlhf.md "The GRPO demo".
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${SWIFTLITE_NO_SETUP:-}" ]; then
  bash scripts/setup_env.sh
  # shellcheck disable=SC1091
  . "${SWIFTLITE_VENV:-.venv}/bin/activate"
fi
export TOKENIZERS_PARALLELISM=false
OUT=${OUT:-runs/quickstart_grpo}
STEPS=${STEPS:-60}
SFT_STEPS=${SFT_STEPS:-125}
NUM_GEN=${NUM_GEN:-8}

python scripts/make_demo_data.py demo_data
python -m swiftlite.rlhf.grpo_demo data demo_data

SFT_CKPT=${SFT_CKPT:-}
if [ -z "$SFT_CKPT" ]; then
  echo "== the SFT demo, stopped early (${SFT_STEPS} steps) =="
  swiftlite sft --model tiny-llama --dataset demo_data/train.jsonl --train-type full --parallelism single \
    --torch-dtype fp32 --per-device-train-batch-size 32 --learning-rate 2e-3 \
    --lr-scheduler constant_with_warmup --warmup-steps 10 --weight-decay 0.0 --max-steps "$SFT_STEPS" \
    --logging-steps 25 --save-strategy no --gradient-checkpointing false --seed 42 \
    --output-dir "${OUT}_sft" --overwrite-output-dir
  SFT_CKPT="${OUT}_sft/checkpoint-${SFT_STEPS}/model"
fi

echo "== before GRPO: ${SFT_CKPT} =="
swiftlite infer --model "$SFT_CKPT" --dataset demo_data/val.jsonl --metric exact_match 2>&1 | tail -1

echo "== GRPO: exact-match reward, ${NUM_GEN} completions per prompt =="
swiftlite rlhf --rlhf_type grpo --model "$SFT_CKPT" --dataset demo_data/grpo_train.jsonl \
  --external_plugins scripts/grpo_exact_reward.py --reward_funcs exact \
  --num_generations "$NUM_GEN" --per_device_train_batch_size 32 --max_completion_length 8 \
  --temperature "${TEMPERATURE:-0.7}" --beta 0 --train-type full --parallelism single --torch-dtype fp32 \
  --learning-rate "${LR:-1e-4}" --lr-scheduler-type constant --weight-decay 0.0 \
  --max-steps "$STEPS" --logging-steps 10 --save-steps "$STEPS" --gradient-checkpointing false \
  --log_completions true --seed 42 --output-dir "$OUT" --overwrite-output-dir

echo "== after GRPO =="
swiftlite infer --model "$OUT/checkpoint-$STEPS/model" --dataset demo_data/val.jsonl --metric exact_match 2>&1 | tail -1
echo "run folder: $OUT (logging.jsonl with reward, rewards/ExactMatch/mean; completions.jsonl; checkpoint-$STEPS/model)"
