#!/usr/bin/env bash
# GPU check: swiftlite's backends on one GPU with a ~1B Llama (random weights), bf16, seq 2048.
#
# Made for a single-H200 machine with no network (docs/benchmarks.md, "GPU check"): its python3
# has torch, transformers, peft, accelerate, typer, rich, matplotlib; it lacks deepspeed,
# bitsandbytes and datasets, and swiftlite itself runs from this working tree (PYTHONPATH).
# Whole run: under 8 minutes, install included. Results go to $OUT (bench.md, bench.json,
# bench.png, gpu_check.md, env.txt, gpu_check.log), ready to paste into docs/benchmarks.md.
#
#   bash scripts/gpu_check.sh                       # on the GPU machine
#   SWIFTLITE_GPU_CHECK_DRYRUN=1 bash scripts/gpu_check.sh   # CPU rehearsal: tiny model, 1 process
#   bash scripts/gpu_check.sh --fetch-wheels        # on a machine WITH PyPI: fill scripts/wheels/
#
# Wheels (the GPU machine cannot download): before the trip, on a machine with PyPI, run
#   bash scripts/gpu_check.sh --fetch-wheels
# which does, for CPython 3.12 / manylinux x86_64 (the GPU image's python):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#       -d scripts/wheels datasets dill multiprocess hjson pydantic pydantic-core annotated-types typing-inspection
#   pip wheel --no-deps -w scripts/wheels deepspeed==0.19.8   # PyPI has only its sdist: build a
#                                                             # pure-python wheel (no ops compiled)
#   (bitsandbytes too with SWIFTLITE_WHEELS_BNB=1: its wheel is large; the check needs no QLoRA)
# and keeps them out of git (.git/info/exclude). Copy the checkout with that folder to the GPU
# machine (no network needed there) and run `bash scripts/gpu_check.sh` in it.
# Here the script installs, with `pip install --no-index --no-deps --target`, only the wheels whose
# distribution is not already installed (so the image's torch/transformers are never replaced).
#
# Environment: OUT (results; default ./gpu_check_out), SWIFTLITE_WHEELS (wheel folder; default
# scripts/wheels), SWIFTLITE_GPU_CHECK_WORK (runs, model, data; default /tmp/swiftlite_gpu_check),
# SWIFTLITE_GPU_CHECK_BACKENDS (default ddp,fsdp,zero3,fsdp+compile; dry run ddp,fsdp,zero3), SWIFTLITE_GPU_CHECK_STEPS (12),
# SWIFTLITE_GPU_CHECK_BATCH (4), SWIFTLITE_GPU_CHECK_DEADLINE (seconds for the whole bench, 390).
# A backend that fails or times out is reported as such in the table; the others still run.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
WHEELS=${SWIFTLITE_WHEELS:-$HERE/wheels}
PY=${PYTHON:-python3}

# ------------------------------------------------------------------------------------------------
if [[ "${1:-}" == "--fetch-wheels" ]]; then
  mkdir -p "$WHEELS"
  plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
  common=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" -d "$WHEELS")
  # deepspeed's and datasets' needs that the GPU image lacks (pydantic pins pydantic-core exactly:
  # one resolver run for that pair; typing-extensions: pydantic needs a recent one)
  "$PY" -m pip download -q "${common[@]}" "datasets>=3,<6" "dill" "multiprocess" "hjson" "annotated-types" \
      "typing-inspection" "typing-extensions"
  "$PY" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
      -d "$WHEELS" "pydantic>=2" --no-deps
  core=$(unzip -p "$WHEELS"/pydantic-2*.whl '*/METADATA' | sed -n 's/^Requires-Dist: pydantic-core==\([0-9.]*\).*/\1/p' | tail -1)
  "$PY" -m pip download -q "${common[@]}" "pydantic-core${core:+==$core}"
  # --no-deps downloads can pull two versions of a name over repeated runs: keep the newest only.
  if [[ "${SWIFTLITE_WHEELS_BNB:-0}" == 1 ]]; then
    "$PY" -m pip download -q "${common[@]}" "bitsandbytes>=0.45"
  fi
  DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$WHEELS" "deepspeed==${SWIFTLITE_DS_VERSION:-0.19.8}" \
    || DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps -w "$WHEELS" "deepspeed==${SWIFTLITE_DS_VERSION:-0.19.8}"
  if git -C "$REPO" rev-parse --git-dir >/dev/null 2>&1; then
    rel=${WHEELS#"$REPO"/}
    ex="$(git -C "$REPO" rev-parse --git-dir)/info/exclude"
    if [[ "$rel" != "$WHEELS" ]] && ! grep -qx "/$rel/" "$ex" 2>/dev/null; then
      mkdir -p "$(dirname "$ex")"; echo "/$rel/" >> "$ex"
    fi
  fi
  ls -la "$WHEELS"; du -sh "$WHEELS"
  echo "copy ${WHEELS#"$REPO"/} with the checkout to the GPU machine, then run: bash scripts/gpu_check.sh"
  exit 0
fi

# ------------------------------------------------------------------------------------------------
DRYRUN=${SWIFTLITE_GPU_CHECK_DRYRUN:-0}
OUT=${OUT:-$REPO/gpu_check_out}
WORK=${SWIFTLITE_GPU_CHECK_WORK:-/tmp/swiftlite_gpu_check}
mkdir -p "$OUT" "$WORK"
LOG="$OUT/gpu_check.log"
: > "$LOG"
T0=$(date +%s)

say() { echo "[gpu_check $(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG"; }

# step NAME SECONDS CMD...: run with a time limit, log everything, never stop the script.
FAILED_FILE="$WORK/failed_steps.txt"
: > "$FAILED_FILE"
step() {
  local name=$1 limit=$2; shift 2
  say "== $name (limit ${limit}s)"
  local rc=0
  timeout --kill-after=20 "$limit" "$@" >>"$LOG" 2>&1 || rc=$?
  if (( rc != 0 )); then
    local why="exit $rc"
    [[ $rc == 124 || $rc == 137 ]] && why="timed out after ${limit}s"
    echo "$name ($why)" >> "$FAILED_FILE"
    say "!! $name failed: $why (see gpu_check.log)"
  fi
  return 0
}

# Helpers are written to files (a time limit needs a command, not a shell function).
H="$WORK/helpers"
mkdir -p "$H"

if [[ "$DRYRUN" == 1 ]]; then
  say "dry run: CPU, tiny model, fp32 (SWIFTLITE_GPU_CHECK_DRYRUN=1)"
  PRESET=tiny-llama; DTYPE=fp32; SEQ=128; BATCH=${SWIFTLITE_GPU_CHECK_BATCH:-4}
  STEPS=${SWIFTLITE_GPU_CHECK_STEPS:-8}; WARMUP=2; ROWS=3000; RUN_LIMIT=240
  DEADLINE=${SWIFTLITE_GPU_CHECK_DEADLINE:-900}
  export DS_ACCELERATOR=cpu
else
  PRESET=llama-1b; DTYPE=bf16; SEQ=2048; BATCH=${SWIFTLITE_GPU_CHECK_BATCH:-4}
  STEPS=${SWIFTLITE_GPU_CHECK_STEPS:-12}; WARMUP=3; ROWS=6000; RUN_LIMIT=170
  DEADLINE=${SWIFTLITE_GPU_CHECK_DEADLINE:-390}
fi
if [[ "$DRYRUN" == 1 ]]; then   # torch.compile on CPU builds C++ for minutes: opt in on CPU
  BACKENDS=${SWIFTLITE_GPU_CHECK_BACKENDS:-ddp,fsdp,zero3}
else
  BACKENDS=${SWIFTLITE_GPU_CHECK_BACKENDS:-ddp,fsdp,zero3,fsdp+compile}
fi
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export SWIFTLITE_CACHE="$WORK/cache"

# -- 1. install what is missing, from wheels only ------------------------------------------------
SITE="$WORK/site"
MODEL="$WORK/model-$PRESET"
cat > "$H/install_wheels.sh" <<'EOS'
#!/usr/bin/env bash
# install_wheels.sh PY WHEELS SITE: install the wheels whose distribution PY lacks (or has older).
set -euo pipefail
PY=$1 WHEELS=$2 SITE=$3
[[ -d "$WHEELS" ]] || { echo "no wheel folder $WHEELS: installing nothing"; exit 0; }
todo=()
for w in "$WHEELS"/*.whl; do
  [[ -e "$w" ]] || continue
  dist=$(basename "$w" | cut -d- -f1)      # wheel names: DIST-VERSION-...
  ver=$(basename "$w" | cut -d- -f2)
  if have=$("$PY" - "$dist" "$ver" 2>/dev/null <<'EOP'
import sys, importlib.metadata as m
have = m.version(sys.argv[1])          # not installed: exits non-zero
try:
    from packaging.version import Version
    ok = Version(have) >= Version(sys.argv[2])
except Exception:
    ok = True                          # cannot compare: keep what the image has
print(have)
sys.exit(0 if ok else 1)
EOP
  ); then
    echo "have $dist $have"
  else
    todo+=("$w")
  fi
done
if (( ${#todo[@]} )); then
  echo "installing ${todo[*]##*/}"
  pipi=("$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE")
  if ! "${pipi[@]}" "${todo[@]}"; then   # one unusable wheel must not block the others
    rc=0
    for w in "${todo[@]}"; do "${pipi[@]}" "$w" || { echo "could not install ${w##*/}"; rc=1; }; done
    exit $rc
  fi
fi
EOS
# swiftlite from this tree; $SITE holds only distributions the image lacks, so its order is moot.
export PYTHONPATH="$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}"
step install 150 bash "$H/install_wheels.sh" "$PY" "$WHEELS" "$SITE"
{
  echo "# environment"; date -u; uname -a
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || echo "no nvidia-smi"
  timeout 120 "$PY" - <<'EOF'
import importlib, sys
print("python", sys.version.split()[0], sys.executable)
for m in ("torch", "transformers", "peft", "accelerate", "deepspeed", "bitsandbytes", "datasets", "swiftlite"):
    try:
        mod = importlib.import_module(m)
        print(f"{m:14s} {getattr(mod, '__version__', 'ok')}  {getattr(mod, '__file__', '')}")
    except Exception as e:  # report, do not fail: the bench skips what cannot run
        print(f"{m:14s} MISSING ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
import torch
print("cuda", torch.cuda.is_available(), torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
EOF
} > "$OUT/env.txt" 2>&1 || true
cat "$OUT/env.txt" >> "$LOG"
if ! "$PY" -c "import swiftlite.cli" >>"$LOG" 2>&1; then
  say "swiftlite does not import from $REPO: nothing to check"; exit 1
fi
if [[ "$DRYRUN" != 1 ]] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  say "no CUDA device (set SWIFTLITE_GPU_CHECK_DRYRUN=1 for the CPU rehearsal)"; exit 1
fi
if ! "$PY" -c "import deepspeed" >>"$LOG" 2>&1; then
  say "deepspeed is not importable: zero backends left out (fill $WHEELS with --fetch-wheels)"
  echo "zero backends skipped (no deepspeed)" >> "$FAILED_FILE"
  BACKENDS=$(echo "$BACKENDS" | tr ',' '\n' | grep -v '^zero' | paste -sd, -)
fi

# -- 2. a local HF folder: the preset's architecture, random bf16 weights, swiftlite's tokenizer ----
cat > "$H/make_model.py" <<'EOF'
import sys, time, torch
from pathlib import Path
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from swiftlite.models.presets import TINY_TOKENIZER, get_preset
name, out, dtype = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
    print(f"model folder {out} exists"); sys.exit(0)
t = time.time()
tok = AutoTokenizer.from_pretrained(str(TINY_TOKENIZER))
conf = AutoConfig.for_model(**get_preset(name).config)
conf.bos_token_id, conf.eos_token_id, conf.pad_token_id = None, tok.eos_token_id, tok.pad_token_id
conf.use_cache = False
torch.manual_seed(0)
dev = "cuda" if torch.cuda.is_available() else "cpu"
with torch.device(dev):
    model = AutoModelForCausalLM.from_config(conf, dtype={"bf16": torch.bfloat16, "fp32": torch.float32}[dtype])
n = sum(p.numel() for p in model.parameters())
model.save_pretrained(str(out), safe_serialization=True)
tok.save_pretrained(str(out))
print(f"{name}: {n / 1e9:.3f}B params, random init on {dev}, saved to {out} in {time.time() - t:.1f} s")
EOF
step model 150 "$PY" "$H/make_model.py" "$PRESET" "$MODEL" "$DTYPE"

DATA="$WORK/data"
step data 60 "$PY" -c "from swiftlite.demo import write_demo_data; write_demo_data('$DATA', n_train=$ROWS, n_val=8)"

# -- 3. the estimate for this workload, then the bench -------------------------------------------
GPU_MEM=141GB
[[ "$DRYRUN" == 1 ]] && GPU_MEM=24GB
step estimate 60 bash -c "'$PY' -m swiftlite estimate --model '$MODEL' --gpus 1 --gpu-memory $GPU_MEM \
  --max-length $SEQ --batch-size $BATCH --no-gradient-checkpointing --dtype $DTYPE > '$OUT/estimate.txt' 2>&1"

step bench "$DEADLINE" "$PY" -m swiftlite bench --model "$MODEL" --parallelism "$BACKENDS" \
  --steps "$STEPS" --warmup-steps "$WARMUP" --profile-steps 1 --nproc-per-node 1 \
  --max-length "$SEQ" --per-device-train-batch-size "$BATCH" --packing --torch-dtype "$DTYPE" \
  --dataset "$DATA/train.jsonl" --output "$WORK/bench" --timeout "$RUN_LIMIT"

# -- 3b. memory at load: a full fine-tune and QLoRA of the same model, one step each ------------------
# (docs/backends.md "Loading at size": the allocator's peak when the model is built and after the
# first step, logs/cuda_memory_rank0.json; on the CPU rehearsal the RSS record, logs/memory_rank0.json)
for tt in full qlora; do
  step "load-$tt" "$RUN_LIMIT" "$PY" -m swiftlite sft --model "$MODEL" --train-type "$tt" --max-steps 1 --gradient-accumulation-steps 1 \
    --torch-dtype "$DTYPE" --max-length "$SEQ" --per-device-train-batch-size 1 --save-strategy no \
    --dataset "$DATA/train.jsonl" --output-dir "$WORK/load_$tt"
done

# -- 3b'. GKD (docs/rlhf.md "GKD"), LoRA distilling the model's own base (the adapter disabled), one dataset
# step and one sampled step (--seed 0: the draws 0.84, 0.13 against --lmbda 0.5), the --sft_alpha term on the first
step gkd "$RUN_LIMIT" "$PY" -m swiftlite rlhf --rlhf_type gkd --model "$MODEL" --teacher_model "$MODEL" --train-type lora \
  --lmbda 0.5 --sft_alpha 0.1 --seed 0 --max_completion_length 32 --max-steps 2 --gradient-accumulation-steps 1 \
  --torch-dtype "$DTYPE" --max-length "$SEQ" --per-device-train-batch-size 2 --save-strategy no --logging-steps 1 \
  --dataset "$DATA/train.jsonl" --output-dir "$WORK/gkd"

# -- 3c. GRPO with a colocated vLLM engine (--use_vllm true --vllm_mode colocate), 2 steps, LoRA and full ------
# (docs/rlhf.md "vLLM"); only where vllm is importable and a GPU is present (never installed here: it
# pulls its own CUDA torch). Its log lines (rewards, completion lengths) are in gpu_check.log.
if [[ "$DRYRUN" != 1 ]] && "$PY" -c "import vllm, torch; assert torch.cuda.is_available()" >/dev/null 2>&1; then
  step grpo-data 60 "$PY" -m swiftlite.rlhf.grpo_demo data "$WORK/grpo_data"
  for tt in lora full; do
    step "grpo-vllm-$tt" "$RUN_LIMIT" "$PY" -m swiftlite rlhf --rlhf_type grpo --model "$MODEL" --train-type "$tt" \
      --dataset "$WORK/grpo_data/grpo_train.jsonl" --external_plugins "$REPO/scripts/grpo_exact_reward.py" \
      --reward_funcs exact --num_generations 4 --per_device_train_batch_size 4 --max_completion_length 16 \
      --use_vllm true --vllm_mode colocate --vllm_gpu_memory_utilization 0.3 --vllm_max_model_len 1024 \
      --sleep_level 1 --torch-dtype "$DTYPE" --max-steps 2 --logging-steps 1 --save-strategy no \
      --log_completions true --log_rollout_offpolicy_metrics true --output-dir "$WORK/grpo_vllm_$tt"
  done
  # GKD's sampled steps on the same colocated engine (docs/rlhf.md "GKD"), LoRA distilling its own base
  step gkd-vllm "$RUN_LIMIT" "$PY" -m swiftlite rlhf --rlhf_type gkd --model "$MODEL" --teacher_model "$MODEL" \
    --train-type lora --lmbda 1 --sft_alpha 0.1 --dataset "$DATA/train.jsonl" --per_device_train_batch_size 4 \
    --max_completion_length 16 --use_vllm true --vllm_mode colocate --vllm_gpu_memory_utilization 0.3 \
    --vllm_max_model_len 1024 --sleep_level 1 --torch-dtype "$DTYPE" --max-steps 2 --logging-steps 1 \
    --save-strategy no --log_completions true --output-dir "$WORK/gkd_vllm"
  # multi-turn (docs/rlhf.md "Multi-turn rollouts"): the second turn on the same engine, without a re-sync
  if "$PY" -c "import math_verify" >/dev/null 2>&1; then
    step grpo-vllm-multi-turn "$RUN_LIMIT" "$PY" -m swiftlite rlhf --rlhf_type grpo --model "$MODEL" --train-type lora \
      --dataset "$WORK/grpo_data/grpo_train.jsonl" --external_plugins "$REPO/scripts/grpo_exact_reward.py" \
      --reward_funcs exact --num_generations 4 --per_device_train_batch_size 4 --max_completion_length 16 \
      --multi_turn_scheduler math_tip_trick --use_vllm true --vllm_mode colocate --vllm_gpu_memory_utilization 0.3 \
      --vllm_max_model_len 1024 --sleep_level 1 --torch-dtype "$DTYPE" --max-steps 2 --logging-steps 1 \
      --save-strategy no --log_completions true --output-dir "$WORK/grpo_vllm_multi_turn"
  fi
  # vLLM's processed log-probs against the training policy's (rollout_correction/*, in the log lines): on
  # the same weights in the run's dtype, the kl stays near 0 and ppl_ratio near 1
else
  say "grpo-vllm skipped: no vllm package or no CUDA GPU here"
fi

# -- 3d. GRPO against a rollout server (--use_vllm true --vllm_mode server, `swiftlite rollout`), 2 LoRA steps ----
# (docs/rlhf.md "Rollout server"): the server's engine is vLLM where vllm is importable on a GPU, else the
# transformers engine (on the GPU: the weight sync then crosses over NCCL; in the CPU rehearsal over gloo).
# Server and run share the one GPU. The server's log is rollout_server.log in $WORK.
RB=transformers RARGS=()
if [[ "$DRYRUN" != 1 ]] && "$PY" -c "import vllm, torch; assert torch.cuda.is_available()" >/dev/null 2>&1; then
  RB=vllm RARGS=(--vllm_gpu_memory_utilization 0.3 --vllm_max_model_len 1024)
fi
[[ -f "$WORK/grpo_data/grpo_train.jsonl" ]] || step grpo-data 60 "$PY" -m swiftlite.rlhf.grpo_demo data "$WORK/grpo_data"
RPORT=$("$PY" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
GPORT=$("$PY" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
"$PY" -m swiftlite rollout --model "$MODEL" --port "$RPORT" --host 127.0.0.1 --infer_backend "$RB" \
  "${RARGS[@]}" > "$WORK/rollout_server.log" 2>&1 &
RPID=$!
step "grpo-server-$RB" "$RUN_LIMIT" "$PY" -m swiftlite rlhf --rlhf_type grpo --model "$MODEL" --train-type lora \
  --dataset "$WORK/grpo_data/grpo_train.jsonl" --external_plugins "$REPO/scripts/grpo_exact_reward.py" \
  --reward_funcs exact --num_generations 4 --per_device_train_batch_size 4 --max_completion_length 16 \
  --use_vllm true --vllm_mode server --vllm_server_host 127.0.0.1 --vllm_server_port "$RPORT" \
  --vllm_server_group_port "$GPORT" --vllm_server_timeout 300 --torch-dtype "$DTYPE" --max-steps 2 \
  --logging-steps 1 --save-strategy no --log_completions true --output-dir "$WORK/grpo_server"
if "$PY" -c "import math_verify" >/dev/null 2>&1; then   # multi-turn: each turn a request to the server
  step "grpo-server-multi-turn-$RB" "$RUN_LIMIT" "$PY" -m swiftlite rlhf --rlhf_type grpo --model "$MODEL" \
    --train-type lora --dataset "$WORK/grpo_data/grpo_train.jsonl" --external_plugins "$REPO/scripts/grpo_exact_reward.py" \
    --reward_funcs exact --num_generations 4 --per_device_train_batch_size 4 --max_completion_length 16 \
    --multi_turn_scheduler math_tip_trick --use_vllm true --vllm_mode server --vllm_server_host 127.0.0.1 \
    --vllm_server_port "$RPORT" --vllm_server_group_port "$GPORT" --vllm_server_timeout 300 --torch-dtype "$DTYPE" \
    --max-steps 2 --logging-steps 1 --save-strategy no --log_completions true --output-dir "$WORK/grpo_server_mt"
fi
kill "$RPID" 2>/dev/null || true
wait "$RPID" 2>/dev/null || true
tail -5 "$WORK/rollout_server.log" >> "$LOG" 2>/dev/null || true

# -- 3e. MuonClip (--optimizer muonclip), 2 LoRA steps -------------------------------------------------
# (docs/lora.md "MuonClip"): the logit bound is kept on the GPU and the Newton-Schulz iterations run in bf16
# there; its step's lines (loss, grad norm) are in gpu_check.log
step muonclip "$RUN_LIMIT" "$PY" -m swiftlite sft --model "$MODEL" --train-type lora --optimizer muonclip \
  --optim_args qk_clip_tau=50 --max-steps 2 --gradient-accumulation-steps 1 --torch-dtype "$DTYPE" \
  --max-length "$SEQ" --per-device-train-batch-size 1 --logging-steps 1 --save-strategy no \
  --dataset "$DATA/train.jsonl" --output-dir "$WORK/muonclip"

# -- 3f. LongLoRA (--train_type longlora), 2 steps ------------------------------------------------------
# (docs/lora.md "LongLoRA"): S2-Attn in training on the GPU, with flash-attention as the model's own attention
# (eval) where flash_attn is importable, else sdpa; its loss lines are in gpu_check.log
ATTN=sdpa
if [[ "$DRYRUN" != 1 ]] && "$PY" -c "import flash_attn, torch; assert torch.cuda.is_available()" >/dev/null 2>&1; then
  ATTN=flash_attn
fi
step "longlora-$ATTN" "$RUN_LIMIT" "$PY" -m swiftlite sft --model "$MODEL" --train-type longlora --attn_impl "$ATTN" \
  --max-steps 2 --gradient-accumulation-steps 1 --torch-dtype "$DTYPE" --max-length "$SEQ" \
  --per-device-train-batch-size 2 --logging-steps 1 --save-strategy no --dataset "$DATA/train.jsonl" \
  --output-dir "$WORK/longlora"

# -- 4. results to $OUT ------------------------------------------------------------------------------
for f in bench.json bench.md bench.png; do
  [[ -f "$WORK/bench/$f" ]] && cp "$WORK/bench/$f" "$OUT/$f"
done
cat > "$H/summarize.py" <<'EOF'
import json, sys
from pathlib import Path
out, preset, dry = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
failed = [ln for ln in Path(sys.argv[4]).read_text().splitlines() if ln.strip()]
lines = [f"## GPU check{' (CPU dry run)' if dry else ''}", ""]
p = out / "bench.json"
if p.is_file():
    r = json.loads(p.read_text())
    d, s = r["device"], r["settings"]
    dev = d.get("device_name") or "CPU"
    n = s["params"] or 0
    size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
    tf = lambda x: f"{(x or 0) / 1e12:.3g}"
    lines += [f"{r['date']}, {dev}, torch {d.get('torch')}: {preset}-shaped model ({size} params, "
              f"random weights), {s['dtype']}, seq {s['max_length']} x batch {s['per_device_train_batch_size']} "
              f"(packed), {s['nproc_per_node']} process, {s['steps']} steps. MFU = 6 x params x tokens/s / "
              f"{tf(d.get('peak_flops_per_device'))} TFLOP/s ({d.get('peak_source')}; measured "
              f"{d.get('probe', 'matmul')}: {tf(d.get('measured_peak_flops'))} TFLOP/s).", "",
              f"| backend | ran as | status | step s | tokens/s | MFU | {'model states GiB' if dry else 'peak GiB (allocator)'} "
              "| estimate GiB | estimate / measured |",
              "|---|---|---|---|---|---|---|---|---|"]
    for b in r["results"]:
        peak = max(b["peak_gpu_gib"]) if b["peak_gpu_gib"] else None
        est = b["memory_estimate_gib"]
        if peak is None and b["state_bytes"]:  # CPU dry run: model states
            peak, est = max(b["state_bytes"]) / 2**30, (b["state_bytes_estimate"] or 0) / 2**30
        f = lambda v, spec, unit="": "-" if v is None else format(v, spec) + unit
        ratio = f"{est / peak:.2f}" if peak and est else "-"
        mfu = None if b["mfu"] is None else b["mfu"] * 100
        lines.append(f"| {b['label']} | {b['backend_resolved'] or '-'} | {b['status']} | {f(b['step_time_s'], '.3f')} | "
                     f"{f(b['tokens_per_s'], ',.0f')} | {f(mfu, '.1f', '%')} | {f(peak, '.2f')} | "
                     f"{f(est, '.2f')} | {ratio} |")
    errs = [f"- {b['label']}: {b['error']}" for b in r["results"] if b["error"]]
    if errs:
        lines += ["", *errs]
    if not r.get("complete", True):
        lines += ["", "(bench stopped before every backend ran: see gpu_check.log)"]
else:
    lines.append("no bench.json: the bench did not produce results (see gpu_check.log)")
if failed:
    lines += ["", "Steps that failed: " + "; ".join(failed)]
load_rows = []
for tt in ("full", "qlora"):
    logs = Path(sys.argv[5]) / f"load_{tt}" / "logs"
    cuda, rss = logs / "cuda_memory_rank0.json", logs / "memory_rank0.json"
    if cuda.is_file():
        c = json.loads(cuda.read_text())
        load_rows.append(f"| {tt} | {c['max_allocated_at_load'] / 2**30:.2f} | "
                         f"{(c['max_allocated_after_first_step'] or 0) / 2**30:.2f} | CUDA max_memory_allocated |")
    elif rss.is_file():
        m = json.loads(rss.read_text())
        load_rows.append(f"| {tt} | {m.get('load_peak', 0) / 2**30:.2f} | {m['training_peak'] / 2**30:.2f} | "
                         "RSS above the start (CPU) |")
    else:
        load_rows.append(f"| {tt} | - | - | no record (see gpu_check.log) |")
lines += ["", "Memory at load (GiB), one process:", "", "| train type | at load | after the first step | measured as |",
          "|---|---|---|---|", *load_rows]
est = out / "estimate.txt"
if est.is_file():
    lines += ["", "`swiftlite estimate` for the same workload:", "", "```", est.read_text().rstrip(), "```"]
(out / "gpu_check.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
step summary 60 "$PY" "$H/summarize.py" "$OUT" "$PRESET" "$DRYRUN" "$FAILED_FILE" "$WORK"
cat "$OUT/gpu_check.md" 2>/dev/null || true
rm -f "$OUT/estimate.txt"   # folded into gpu_check.md (at most 8 files come back)
say "done in $(( $(date +%s) - T0 )) s; results in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
if [[ -s "$FAILED_FILE" ]]; then
  say "failed steps: $(paste -sd';' "$FAILED_FILE")"
fi
exit 0
