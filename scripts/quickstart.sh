#!/usr/bin/env bash
# The demo: set up the venv, build the demo data (reverse short strings), measure the untrained
# tiny-llama's accuracy, fine-tune it with FSDP2 on 2 processes, and measure it again.
# Runs on a CPU-only machine in a few minutes; everything stays local (no hub access).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# shellcheck disable=SC1091
. "${SWIFTLITE_VENV:-.venv}/bin/activate"
export TOKENIZERS_PARALLELISM=false
OUT=${OUT:-runs/quickstart}
STEPS=${STEPS:-250}
NPROC=${NPROC:-2}

python scripts/make_demo_data.py demo_data

echo "== accuracy before training (random tiny-llama) =="
swiftlite infer --model tiny-llama --seed 42 --dataset demo_data/val.jsonl --metric exact_match --limit 100

echo "== fine-tuning tiny-llama with FSDP2 on ${NPROC} processes =="
swiftlite sft --model tiny-llama --dataset demo_data/train.jsonl --val-dataset demo_data/val.jsonl \
  --train-type full --parallelism fsdp --nproc-per-node "$NPROC" --torch-dtype fp32 \
  --per-device-train-batch-size 16 --learning-rate 2e-3 --lr-scheduler cosine --warmup-ratio 0.05 \
  --weight-decay 0.0 --max-steps "$STEPS" --logging-steps 25 --eval-steps 125 --save-steps 125 \
  --gradient-checkpointing false --seed 42 --output-dir "$OUT" --overwrite-output-dir

echo "== accuracy after training =="
swiftlite infer --model "$OUT" --dataset demo_data/val.jsonl --metric exact_match --limit 100
echo "run folder: $OUT (logging.jsonl, images/train_loss.png, checkpoint-$STEPS/model)"
