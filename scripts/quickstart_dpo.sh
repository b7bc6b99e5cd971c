#!/usr/bin/env bash
# The preference demo: DPO from the SFT demo's checkpoint on the built-in preference task (reverse a
# short string: the chosen answer is the right reversal, the rejected one a checkable mistake: the
# string itself, two neighbouring characters swapped, or one dropped), full fine-tuning with FSDP2 on
# 2 processes, the reference a frozen copy of the start. Prints the held-out preference accuracy (the
# share of held-out pairs whose right answer the model finds more likely than the wrong one) before
# and after, DPO's own held-out metrics (eval_rewards/accuracies, eval_rewards/margins), then exports
# the result and loads it with transformers.
#
# The SFT checkpoint: SFT_CKPT, else an early one of the SFT demo made here (scripts/quickstart.sh's
# settings, SFT_STEPS=70 steps at a constant learning rate): the quickstart's finished run
# (runs/quickstart/checkpoint-250) already ranks every held-out pair right, leaving DPO nothing to
# show. Runs on a CPU in a few minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${SWIFTLITE_NO_SETUP:-}" ]; then
  bash scripts/setup_env.sh
  # shellcheck disable=SC1091
  . "${SWIFTLITE_VENV:-.venv}/bin/activate"
fi
export TOKENIZERS_PARALLELISM=false
OUT=${OUT:-runs/quickstart_dpo}
STEPS=${STEPS:-180}
NPROC=${NPROC:-2}
SFT_STEPS=${SFT_STEPS:-70}

python scripts/make_demo_data.py demo_data
python -m swiftlite.rlhf.demo data demo_data

SFT_CKPT=${SFT_CKPT:-}
if [ -z "$SFT_CKPT" ]; then
  echo "== the SFT demo, stopped early (${SFT_STEPS} steps) =="
  swiftlite sft --model tiny-llama --dataset demo_data/train.jsonl --train-type full --parallelism fsdp \
    --nproc-per-node "$NPROC" --torch-dtype fp32 --per-device-train-batch-size 16 --learning-rate 2e-3 \
    --lr-scheduler constant_with_warmup --warmup-ratio 0.05 --weight-decay 0.0 --max-steps "$SFT_STEPS" --logging-steps 35 \
    --save-strategy no --gradient-checkpointing false --seed 42 --output-dir "${OUT}_sft" --overwrite-output-dir
  SFT_CKPT="${OUT}_sft/checkpoint-${SFT_STEPS}/model"
fi

echo "== before DPO: ${SFT_CKPT} =="
python -m swiftlite.rlhf.demo accuracy "$SFT_CKPT" demo_data/pref_val.jsonl

echo "== DPO with FSDP2 on ${NPROC} processes =="
swiftlite rlhf --rlhf_type dpo --beta "${BETA:-0.1}" --model "$SFT_CKPT" \
  --dataset demo_data/pref_train.jsonl --val-dataset demo_data/pref_val.jsonl \
  --train-type full --parallelism fsdp --nproc-per-node "$NPROC" --torch-dtype fp32 \
  --per-device-train-batch-size 8 --learning-rate "${LR:-3e-4}" --lr-scheduler-type constant --weight-decay 0.0 \
  --max-steps "$STEPS" --logging-steps 20 --eval-steps "$STEPS" --save-strategy no \
  --seed 42 --output-dir "$OUT" --overwrite-output-dir

echo "== after DPO =="
python -m swiftlite.rlhf.demo accuracy "$OUT/checkpoint-$STEPS/model" demo_data/pref_val.jsonl
grep eval_rewards/accuracies "$OUT/logging.jsonl" | tail -1

echo "== export and reload with transformers =="
swiftlite export --ckpt "$OUT/checkpoint-$STEPS" --output "$OUT/exported"
python -c "import sys; from transformers import AutoModelForCausalLM; m = AutoModelForCausalLM.from_pretrained(sys.argv[1]); print('loaded', type(m).__name__, sum(p.numel() for p in m.parameters()), 'parameters')" "$OUT/exported"
echo "run folder: $OUT (logging.jsonl with rewards/*, logps/*; checkpoint-$STEPS/model; exported/)"
