#!/usr/bin/env bash
# The same fine-tuning job run by swiftlite, TRL's SFTTrainer and ms-swift's `swift sft`, timed
# alternately (A B C A B C ...) in one run on this machine. Facts and traps: shared/PEERS.md.
#
# Workload (fixed here, as in PEERS.md): a tiny Llama (256 hidden x 4 layers, 4 heads / 2 KV heads,
# vocab 260) built from swiftlite's `tiny-llama` config with random weights (seed 0), saved with
# swiftlite's tiny tokenizer (chat template included) as a local HF folder; 2000 demo chat rows
# (swiftlite.demo.write_demo_data); global batch 8 (per-device 8 on 1 process, 4 on 2), max length
# 128, 250 steps (one epoch), fp32, 1 thread per process; AdamW lr 1e-4, cosine, no warm-up, weight
# decay 0.1, betas (0.9, 0.95), clip 1.0, no gradient checkpointing, loss on the answer only, no
# evaluation, one save at the end; LoRA r 8 / alpha 32 / dropout 0.05 on all linear layers, or full.
# Two processes = DDP over gloo for everyone (swiftlite --parallelism ddp).
#
# Measured per run, from outside (the same way for every framework): wall time from launch to exit;
# time to first step (launch -> the line each one prints after optimizer step 1: logging_first_step);
# train samples/s ((steps - 1) x 8 / time between the step-1 and the last-step log lines); peak
# memory (sum of RSS over the process tree, sampled every 0.1 s, and the largest single process).
# Every run gets empty data caches (HF_DATASETS_CACHE, SWIFTLITE_CACHE): tokenization is timed.
#
#   bash scripts/bench_vs_peers.sh                     # install missing peers, then benchmark
#   bash scripts/bench_vs_peers.sh --install-only      # just the venvs (4-7 minutes each)
#   bash scripts/bench_vs_peers.sh --repeats 3 --jobs lora-1p,full-1p --peers trl --steps 100
# Options: --repeats N (2), --jobs (lora-1p,full-1p,lora-2p,full-2p), --peers (trl,ms-swift),
#   --steps N (250), --out DIR (bench_vs_peers/), --no-warmup (skip the untimed 3-step run of each),
#   --peer-padding-free (also run each peer with its own padding-free option, as a second variant in
#   the same rotation: TRL `SFTConfig(padding_free=True, max_length=None)` (TRL 1.16 refuses
#   padding_free with a max_length unless packing; every row of this job is <= 42 tokens, so nothing
#   is truncated either way), ms-swift `--padding_free true` (ms-swift 4.6 refuses it unless
#   --attn_impl is a flash-attention one: recorded as a failed run on CPU)). The ratios stay against
#   the peers at their defaults; a second ratio against every peer variant that ran is added.
# swiftlite runs at its own defaults (padding-free batches and the chunked loss; fp32 because the job
# is), with --train-type given explicitly. It is imported from this checkout (PYTHONPATH=<repo>); the
# driver prints swiftlite.__file__ as the runs see it. The peers run without that PYTHONPATH.
# Environment: SWIFTLITE_PEERS_DIR (venvs; ~/.cache/swiftlite/peers), SWIFTLITE_PEERS_WORK (model,
#   data, runs; /tmp/swiftlite_peers), SWIFTLITE_PYTHON (the python that runs swiftlite; default
#   .venv/bin/python of this checkout, else python3; a worktree without its own venv can use another
#   checkout's, e.g. another checkout's .venv/bin/python: swiftlite still comes from here).
# Output: <out>/peers.json (every run and the summary) and <out>/peers.md (tables for
# docs/benchmarks.md), also printed.
#
#   bash scripts/bench_vs_peers.sh --job big-vocab [--repeats N] [--out DIR]
# A different job, for memory: a Qwen2-shaped model with a real vocabulary size (151,936 tokens, 2
# layers, hidden 256, intermediate 1024, untied head, random weights; a byte-level BPE tokenizer of
# 151,936 entries built here), 64 chat rows of ~950 tokens, LoRA r8/alpha 32/dropout 0 on all linear
# layers, batch 4, max length 1024, fp32, 3 steps, 1 process, OMP_NUM_THREADS=2. Peak RSS of each run
# from `/usr/bin/time -f %M`. Runs, alternating per repeat: swiftlite and TRL's SFTTrainer at their
# defaults (TRL: prompt/completion rows, so loss on the completion as swiftlite's; its SFTConfig
# defaults, gradient checkpointing on), then two references: swiftlite --loss-impl plain and TRL
# without gradient checkpointing. Only the trl peer is installed. Output: <out>/big_vocab.json, .md.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
PEERS_DIR=${SWIFTLITE_PEERS_DIR:-$HOME/.cache/swiftlite/peers}
WORK=${SWIFTLITE_PEERS_WORK:-/tmp/swiftlite_peers}
SL_PY=${SWIFTLITE_PYTHON:-}
if [[ -z "$SL_PY" ]]; then
  if [[ -x "$REPO/.venv/bin/python" ]]; then SL_PY="$REPO/.venv/bin/python"; else SL_PY=python3; fi
fi
BASE_PY=${PYTHON:-python3}
TORCH_PIN=${SWIFTLITE_PEERS_TORCH:-torch==2.13.0}

INSTALL_ONLY=0
JOB=""
ARGS=()
while (( $# )); do
  case "$1" in
    --install-only) INSTALL_ONLY=1; shift ;;
    --job) JOB=${2:?--job needs a value (big-vocab)}; shift 2 ;;
    --job=*) JOB=${1#--job=}; shift ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
if [[ -n "$JOB" && "$JOB" != big-vocab ]]; then
  echo "--job $JOB: the only --job is big-vocab (the timing jobs are chosen with --jobs)" >&2; exit 2
fi

# -- peers, each in its own venv ---------------------------------------------------------------------
# name|pip requirements
PEER_SPECS=(
  "trl|trl==1.16.0 peft==0.21.2 accelerate $TORCH_PIN"
  "ms-swift|ms-swift==4.6.0 $TORCH_PIN"
)
install_peer() {
  local name=$1 reqs=$2 venv="$PEERS_DIR/$1"
  if [[ -f "$venv/.ok" ]] && "$venv/bin/python" -c "import torch" >/dev/null 2>&1; then
    echo "peers: $name ready in $venv"; return 0
  fi
  echo "peers: installing $name into $venv ($reqs; several minutes)"
  mkdir -p "$PEERS_DIR"
  "$BASE_PY" -m venv "$venv"
  # shellcheck disable=SC2086
  "$venv/bin/python" -m pip install -q $reqs > "$PEERS_DIR/$name.install.log" 2>&1 \
    || { echo "peers: $name install failed (see $PEERS_DIR/$name.install.log)"; return 1; }
  touch "$venv/.ok"
}
for spec in "${PEER_SPECS[@]}"; do
  if [[ "$JOB" == big-vocab && "${spec%%|*}" != trl ]]; then continue; fi
  install_peer "${spec%%|*}" "${spec#*|}" || true
done
if (( INSTALL_ONLY )); then exit 0; fi

mkdir -p "$WORK"

# -- --job big-vocab: peak memory on a real vocabulary (see the header) --------------------------------
if [[ "$JOB" == big-vocab ]]; then
cat > "$WORK/big_vocab_prep.py" <<'EOF'
"""Big-vocabulary workload: a Qwen2-shaped model (vocab 151,936, 2 layers, hidden 256, untied head,
random weights) with a word-level tokenizer of 151,936 entries, and 64 chat rows of ~950 tokens."""
import json, random, sys
from pathlib import Path
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

VOCAB = 151_936
out, data = Path(sys.argv[1]), Path(sys.argv[2])
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LETTERS = "abcdefghijklmnopqrst"


def byte_alphabet() -> list[str]:
    """GPT-2's bytes -> printable characters (the ByteLevel pre-tokenizer's alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + list(range(ord("\xae"), 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def words(n: int) -> list[str]:
    """n four-letter words (" abcd" as one token); their prefixes are tokens too (the BPE merge chain)."""
    out = []
    for a in LETTERS:
        for b in LETTERS:
            for c in LETTERS:
                for d in LETTERS:
                    out.append(a + b + c + d)
                    if len(out) == n:
                        return out
    raise ValueError(n)


if not (out / "model.safetensors").is_file():
    # A byte-level BPE (what Qwen2's tokenizer class rebuilds from tokenizer.json) of exactly VOCAB entries:
    # the 256 byte characters, then " x", " xy", " xyz" for 20 letters, then " xyzw" words, and the specials.
    base = byte_alphabet()
    prefixes = ["\u0120" + a for a in LETTERS] + ["\u0120" + a + b for a in LETTERS for b in LETTERS] + \
               ["\u0120" + a + b + c for a in LETTERS for b in LETTERS for c in LETTERS]
    n_words = VOCAB - len(base) - len(prefixes) - len(SPECIAL)
    toks = base + prefixes + ["\u0120" + w for w in words(n_words)]
    vocab = {t: i for i, t in enumerate(toks)}
    merges = [(t[:-1], t[-1]) for t in toks[len(base):]]
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                                  additional_special_tokens=SPECIAL[1:])
    tok.add_special_tokens({"additional_special_tokens": SPECIAL[1:]})
    tok.chat_template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
                         "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}"
                         "{{ '<|im_start|>assistant\\n' }}{% endif %}")
    assert len(tok) == VOCAB, len(tok)
    conf = Qwen2Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                       tie_word_embeddings=False, bos_token_id=None, eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id, use_cache=False)
    torch.manual_seed(0)
    Qwen2ForCausalLM(conf).to(torch.float32).save_pretrained(str(out))
    tok.save_pretrained(str(out))
data.mkdir(parents=True, exist_ok=True)
rng = random.Random(0)
vocab_words = words(VOCAB - 256 - 8420 - len(SPECIAL))
word = lambda: rng.choice(vocab_words)
with open(data / "train.jsonl", "w") as f, open(data / "train_prompt_completion.jsonl", "w") as g:
    for _ in range(64):
        q = " ".join(word() for _ in range(rng.randint(270, 370)))
        a = " ".join(word() for _ in range(rng.randint(580, 620)))
        msgs = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        f.write(json.dumps({"messages": msgs}) + "\n")
        g.write(json.dumps({"prompt": msgs[:1], "completion": msgs[1:]}) + "\n")
print("big-vocab workload ready:", out, data)
EOF

cat > "$WORK/trl_big_vocab.py" <<'EOF'
"""TRL SFTTrainer at its defaults on the big-vocabulary job: trl_big.py MODEL DATA OUT [key=value ...].
Set here only what the job fixes (LoRA r8/alpha 32/dropout 0 on all linear layers, batch 4, max length
1024, 3 steps, fp32 on CPU) and what a CPU run needs; extra key=value pairs override SFTConfig fields."""
import sys

import torch
from datasets import load_dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer

model_dir, data, out = sys.argv[1:4]
over = dict(kv.split("=", 1) for kv in sys.argv[4:])
over = {k: {"true": True, "false": False}.get(v.lower(), v) for k, v in over.items()}
tok = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
peft_config = LoraConfig(r=8, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
ds = load_dataset("json", data_files=data, split="train")   # prompt/completion: loss on the completion
cfg = SFTConfig(output_dir=out, per_device_train_batch_size=4, max_steps=3, max_length=1024, use_cpu=True,
                bf16=False, fp16=False, save_strategy="no", report_to="none", logging_steps=1,
                dataloader_num_workers=0, disable_tqdm=True, **over)
print("TRL SFTConfig:", {k: getattr(cfg, k) for k in ("gradient_checkpointing", "packing", "padding_free",
                                                      "loss_type", "completion_only_loss", "max_length")}, flush=True)
trainer = SFTTrainer(model=model, args=cfg, train_dataset=ds, processing_class=tok, peft_config=peft_config)
trainer.train()
EOF

cat > "$WORK/big_vocab.py" <<'EOF'
"""Run the big-vocab job alternately (swiftlite, TRL, then the two references) under /usr/bin/time."""
import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ap = argparse.ArgumentParser()
ap.add_argument("--repeats", type=int, default=1)
ap.add_argument("--out", default="bench_vs_peers")
ap.add_argument("--timeout", type=int, default=1800)
a, _ignored = ap.parse_known_args()
WORK, PEERS, REPO = Path(os.environ["BENCH_WORK"]), Path(os.environ["BENCH_PEERS_DIR"]), Path(os.environ["BENCH_REPO"])
SL_PY = os.environ["BENCH_SL_PY"]
OUT = Path(a.out).resolve()
OUT.mkdir(parents=True, exist_ok=True)
model, data = WORK / "big_vocab_model", WORK / "big_vocab_data"
prep = subprocess.run([SL_PY, str(WORK / "big_vocab_prep.py"), str(model), str(data)], capture_output=True,
                      text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
print((prep.stdout.strip().splitlines() or [prep.stderr[-2000:]])[-1])
if prep.returncode:
    sys.exit("big-vocab: workload preparation failed")
trl_py = PEERS / "trl" / "bin" / "python"
RUNS = {  # name -> command (run_dir appended where needed)
    "swiftlite": lambda d: [SL_PY, "-m", "swiftlite", "sft", "--model", str(model), "--dataset",
                            str(data / "train.jsonl"), "--lora", "--lora-rank", "8", "--lora-alpha", "32",
                            "--lora-dropout", "0", "--per-device-train-batch-size", "4", "--max-length", "1024",
                            "--gradient-accumulation-steps", "1", "--gradient-checkpointing", "false",
                            "--max-steps", "3", "--torch-dtype", "fp32", "--logging-steps", "1", "--output-dir", str(d)],
    "trl": lambda d: [str(trl_py), str(WORK / "trl_big_vocab.py"), str(model),
                      str(data / "train_prompt_completion.jsonl"), str(d)],
}
RUNS["swiftlite --loss-impl plain"] = lambda d: RUNS["swiftlite"](d) + ["--loss-impl", "plain"]
RUNS["trl gradient_checkpointing=False"] = lambda d: RUNS["trl"](d) + ["gradient_checkpointing=false"]
names = [n for n in RUNS if trl_py.exists() or not n.startswith("trl")]
if not trl_py.exists():
    print(f"peers: trl is not installed in {trl_py.parent.parent}: left out")


def run(name, tag):
    d = WORK / "runs" / f"big-vocab-{re.sub(r'[^a-z0-9]+', '-', name.lower())}-{tag}"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    caches = d / "_cache"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_"))}
    env.update({"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false",
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                "HF_DATASETS_CACHE": str(caches / "hf_datasets"), "SWIFTLITE_CACHE": str(caches / "swiftlite"),
                "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO)})
    cmd = RUNS[name](d)
    t0 = time.time()
    p = subprocess.run(["/usr/bin/time", "-f", "PEAK_RSS_KIB %M", *cmd], capture_output=True, text=True, env=env,
                       cwd=d, timeout=a.timeout)
    wall = time.time() - t0
    log = p.stdout + p.stderr
    (d.parent / f"{d.name}.log").write_text(log)
    shutil.rmtree(caches, ignore_errors=True)
    m = re.findall(r"PEAK_RSS_KIB (\d+)", log)
    rec = {"run": name, "tag": tag, "rc": p.returncode, "wall_s": round(wall, 1),
           "peak_rss_mib": round(int(m[-1]) / 1024) if m else None, "cmd": " ".join(cmd),
           "load": [round(x, 2) for x in os.getloadavg()]}
    if p.returncode:
        rec["error"] = log[-1500:]
    print(f"  {name:34s} {tag} rc={p.returncode} peak RSS {rec['peak_rss_mib']} MiB  wall {rec['wall_s']} s  "
          f"load {rec['load'][0]}", flush=True)
    return rec


results = []
for r in range(a.repeats):
    for name in names:
        results.append(run(name, f"r{r + 1}"))
        (OUT / "big_vocab.json").write_text(json.dumps({"runs": results}, indent=1))
best = {n: min([x["peak_rss_mib"] for x in results if x["run"] == n and x["rc"] == 0 and x["peak_rss_mib"]],
               default=None) for n in names}
ratio = round(best["swiftlite"] / best["trl"], 3) if best.get("swiftlite") and best.get("trl") else None
info = {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "python": platform.python_version(),
        "repeats": a.repeats, "swiftlite_vs_trl_peak_rss": ratio}
(OUT / "big_vocab.json").write_text(json.dumps({"info": info, "peak_rss_mib": best, "runs": results}, indent=1))
lines = [f"### Peak memory on a real vocabulary (--job big-vocab), {info['date']}", "",
         f"{info['cpus']}-core CPU, shared; Qwen2-shaped model, vocab 151,936, 2 layers, hidden 256, untied head; "
         "64 chat rows of ~950 tokens; LoRA r8, batch 4, max length 1024, fp32, 3 steps, 1 process, "
         f"OMP_NUM_THREADS=2; peak RSS from `/usr/bin/time -f %M` (lowest of {a.repeats} run(s)).", "",
         "| run | peak RSS MiB | wall s |", "|---|---|---|"]
for n in names:
    walls = [x["wall_s"] for x in results if x["run"] == n and x["rc"] == 0]
    lines.append(f"| {n} | {best[n] if best[n] is not None else 'failed'} | {min(walls) if walls else '-'} |")
lines += ["", f"swiftlite / TRL (both at their defaults): {ratio} (target <= 0.5)"]
(OUT / "big_vocab.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
print(f"wrote {OUT / 'big_vocab.json'} and {OUT / 'big_vocab.md'}")
EOF
export BENCH_WORK="$WORK" BENCH_PEERS_DIR="$PEERS_DIR" BENCH_REPO="$REPO" BENCH_SL_PY="$SL_PY"
exec env PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$SL_PY" "$WORK/big_vocab.py" "${ARGS[@]+"${ARGS[@]}"}"
fi

# -- the TRL job (run by the TRL venv's python, or under `accelerate launch`) --------------------------
cat > "$WORK/trl_sft.py" <<'EOF'
"""TRL SFTTrainer on the bench workload: trl_sft.py MODEL DATA OUT MODE PER_DEVICE STEPS LR MAX_LEN [pf].
With `pf`: SFTConfig(padding_free=True) (each micro-batch flattened into one row with position_ids, no
attention mask); TRL 1.16 requires max_length=None then (no packing), the rows here are all shorter."""
import sys
import time

import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import SFTConfig, SFTTrainer

model_dir, data, out, mode, bs, steps, lr, max_len = sys.argv[1:9]
bs, steps, lr, max_len = int(bs), int(steps), float(lr), int(max_len)
padding_free = sys.argv[9:10] == ["pf"]


class Marks(TrainerCallback):
    """Print a line after step 1 and the last step (the bench times them from outside)."""
    def on_step_end(self, args, state, control, **kw):
        if state.is_world_process_zero and state.global_step in (1, state.max_steps):
            print(f"BENCH_STEP {state.global_step} {time.time():.3f}", flush=True)


tok = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
peft_config = None
if mode == "lora":
    from peft import LoraConfig
    peft_config = LoraConfig(r=8, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear",
                             task_type="CAUSAL_LM")
ds = load_dataset("json", data_files=data, split="train")  # prompt/completion: loss on the completion
cfg = SFTConfig(
    output_dir=out, per_device_train_batch_size=bs, gradient_accumulation_steps=1, max_steps=steps,
    learning_rate=lr, lr_scheduler_type="cosine", warmup_steps=0, weight_decay=0.1, adam_beta1=0.9,
    adam_beta2=0.95, max_grad_norm=1.0, optim="adamw_torch", logging_steps=50, logging_first_step=True,
    save_strategy="no", report_to="none", use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
    max_length=None if padding_free else max_len, packing=False, padding_free=padding_free,
    dataloader_num_workers=0, dataset_num_proc=1, seed=42, disable_tqdm=True, completion_only_loss=True)
if int(__import__("os").environ.get("RANK", "0")) == 0:
    print("TRL SFTConfig:", {k: getattr(cfg, k) for k in ("padding_free", "packing", "max_length",
                                                          "gradient_checkpointing")}, flush=True)
trainer = SFTTrainer(model=model, args=cfg, train_dataset=ds, processing_class=tok, peft_config=peft_config,
                     callbacks=[Marks()])
trainer.train()
trainer.save_model(out)
EOF

# -- ms-swift: a training template equal to the tokenizer's chat template ------------------------------
cat > "$WORK/swift_plugin.py" <<'EOF'
"""Registers `swiftlite_tiny` for ms-swift: the tiny tokenizer's chat template, as a TemplateMeta
(ms-swift trains with Python-registered templates; the Jinja one is for inference only)."""
from swift.template import TemplateMeta, register_template

register_template(TemplateMeta(
    template_type="swiftlite_tiny",
    prefix=[],
    prompt=["<|im_start|>user\n{{QUERY}}<|im_end|>\n<|im_start|>assistant\n"],
    chat_sep=["<|im_end|>\n"],
    suffix=["<|im_end|>\n"],
    system_prefix=["<|im_start|>system\n{{SYSTEM}}<|im_end|>\n"],
), exist_ok=True)
EOF

cat > "$WORK/swift_check.py" <<'EOF'
"""The swiftlite_tiny template must give the ids apply_chat_template gives, on every row."""
import json, sys
sys.path.insert(0, sys.argv[3])
import swift_plugin  # noqa: F401  (registers the template)
from swift.model import get_processor
from swift.template import get_template
model_dir, data = sys.argv[1], sys.argv[2]
proc = get_processor(model_dir, model_type="llama")
tpl = get_template(proc, template_type="swiftlite_tiny", max_length=128)
tpl.set_mode("train")
bad = 0
rows = [json.loads(l) for l in open(data)]
for r in rows:
    ids = tpl.encode({"messages": r["messages"]})["input_ids"]
    ref = proc.apply_chat_template(r["messages"], tokenize=True)
    ref = ref["input_ids"] if isinstance(ref, dict) or hasattr(ref, "keys") else ref
    bad += list(ids) != list(ref)
print(f"swift template check: {len(rows) - bad}/{len(rows)} rows give the tokenizer's ids")
sys.exit(1 if bad else 0)
EOF

cat > "$WORK/driver.py" <<'EOF'
"""Prepare the workload, run every (job, framework) alternately, write peers.json and peers.md."""
import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

ap = argparse.ArgumentParser()
ap.add_argument("--repeats", type=int, default=2)
ap.add_argument("--jobs", default="lora-1p,full-1p,lora-2p,full-2p")
ap.add_argument("--peers", default="trl,ms-swift")
ap.add_argument("--steps", type=int, default=250)
ap.add_argument("--out", default="bench_vs_peers")
ap.add_argument("--no-warmup", action="store_true")
ap.add_argument("--peer-padding-free", action="store_true")
ap.add_argument("--timeout", type=int, default=900)
a = ap.parse_args()
WORK, PEERS, REPO = Path(os.environ["BENCH_WORK"]), Path(os.environ["BENCH_PEERS_DIR"]), Path(os.environ["BENCH_REPO"])
SL_PY = os.environ["BENCH_SL_PY"]
OUT = Path(a.out).resolve()
OUT.mkdir(parents=True, exist_ok=True)
GLOBAL_BATCH, MAX_LEN, LR = 8, 128, 1e-4
JOBS = {"lora-1p": ("lora", 1), "full-1p": ("full", 1), "lora-2p": ("lora", 2), "full-2p": ("full", 2)}
jobs = [j for j in a.jobs.split(",") if j]
for j in jobs:
    if j not in JOBS:
        sys.exit(f"unknown job {j} (known: {', '.join(JOBS)})")
frameworks = ["swiftlite"] + [p for p in a.peers.split(",") if p]
for p in frameworks[1:]:
    if not (PEERS / p / "bin" / "python").exists():
        print(f"peers: {p} is not installed in {PEERS / p}: left out")
frameworks = [f for f in frameworks if f == "swiftlite" or (PEERS / f / "bin" / "python").exists()]
if a.peer_padding_free:  # a second variant per peer: "<peer>+pf", its own padding-free option on
    frameworks += [f + "+pf" for f in frameworks[1:]]
LABEL = {"trl+pf": "trl padding_free=True", "ms-swift+pf": "ms-swift --padding_free true"}
label = lambda fw: LABEL.get(fw, fw)
who = subprocess.run([SL_PY, "-c", "import swiftlite, sys; print(swiftlite.__file__, sys.executable)"],
                     env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True)
SWIFTLITE_FILE = who.stdout.strip() or who.stderr.strip()[-300:]
print(f"swiftlite under test (PYTHONPATH={REPO} {SL_PY}): {SWIFTLITE_FILE}")

# -- workload ----------------------------------------------------------------------------------------
model_dir, data_dir = WORK / "model", WORK / "data"
prep = subprocess.run([SL_PY, "-c", f"""
import json, torch
from pathlib import Path
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from swiftlite.demo import write_demo_data
from swiftlite.models.presets import TINY_TOKENIZER, get_preset
out, data = Path({str(model_dir)!r}), Path({str(data_dir)!r})
if not (out / "model.safetensors").is_file():
    tok = AutoTokenizer.from_pretrained(str(TINY_TOKENIZER))
    conf = AutoConfig.for_model(**get_preset("tiny-llama").config)
    conf.bos_token_id, conf.eos_token_id, conf.pad_token_id = None, tok.eos_token_id, tok.pad_token_id
    conf.use_cache = False
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(conf, dtype=torch.float32).save_pretrained(str(out))
    tok.save_pretrained(str(out))
train, _ = write_demo_data(data, n_train=2000, n_val=8, seed=0)
rows = [json.loads(l) for l in train.read_text().splitlines()]
with open(data / "train_prompt_completion.jsonl", "w") as f:
    for r in rows:
        f.write(json.dumps({{"prompt": r["messages"][:1], "completion": r["messages"][1:]}}) + "\\n")
print("workload ready:", out, train)
"""], env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True)
print(prep.stdout.strip() or prep.stderr[-2000:])
if prep.returncode:
    sys.exit("workload preparation failed")
train = data_dir / "train.jsonl"
if "ms-swift" in frameworks:
    chk = subprocess.run([str(PEERS / "ms-swift" / "bin" / "python"), str(WORK / "swift_check.py"), str(model_dir),
                          str(train), str(WORK)], capture_output=True, text=True, timeout=600)
    print((chk.stdout.strip().splitlines() or [chk.stderr.strip()[-500:]])[-1])
    if chk.returncode:
        print("peers: ms-swift template check FAILED: its figures would not be the same job")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(fw, job, run_dir, steps):
    mode, nproc = JOBS[job]
    bs = GLOBAL_BATCH // nproc
    env = {}
    fw, pf = fw.split("+")[0], fw.endswith("+pf")
    if fw == "swiftlite":
        cmd = [SL_PY, "-m", "swiftlite", "sft", "--model", str(model_dir), "--dataset", str(train),
               "--train-type", mode, "--lora-rank", "8", "--lora-alpha", "32", "--lora-dropout", "0.05",
               "--target-modules", "all-linear", "--per-device-train-batch-size", str(bs),
               "--gradient-accumulation-steps", "1", "--gradient-checkpointing", "false",
               "--max-length", str(MAX_LEN), "--max-steps", str(steps), "--learning-rate", str(LR),
               "--lr-scheduler", "cosine", "--warmup-steps", "0", "--weight-decay", "0.1", "--adam-beta2", "0.95",
               "--max-grad-norm", "1.0", "--torch-dtype", "fp32", "--logging-steps", "50",
               "--output-dir", str(run_dir), "--overwrite-output-dir", "--seed", "42"]
        if nproc > 1:
            cmd += ["--nproc-per-node", str(nproc), "--parallelism", "ddp"]
        env["PYTHONPATH"] = str(REPO)
        first, last = re.compile(r"first step done"), re.compile(rf"\bstep={steps}\b")
    elif fw == "trl":
        py = PEERS / "trl" / "bin"
        script = [str(WORK / "trl_sft.py"), str(model_dir), str(data_dir / "train_prompt_completion.jsonl"),
                  str(run_dir), mode, str(bs), str(steps), str(LR), str(MAX_LEN)] + (["pf"] if pf else [])
        if nproc > 1:  # `accelerate launch --cpu --num_processes 2` would silently run ONE process
            cmd = [str(py / "accelerate"), "launch", "--multi_gpu", "--num_processes", str(nproc), "--num_machines",
                   "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
                   str(free_port()), *script]
        else:
            cmd = [str(py / "python"), *script]
        first, last = re.compile(r"BENCH_STEP 1 "), re.compile(rf"BENCH_STEP {steps} ")
    elif fw == "ms-swift":
        cmd = [str(PEERS / "ms-swift" / "bin" / "swift"), "sft", "--model", str(model_dir), "--model_type", "llama",
               "--template", "swiftlite_tiny", "--external_plugins", str(WORK / "swift_plugin.py"),
               "--dataset", str(train), "--split_dataset_ratio", "0", "--check_model", "false",
               "--torch_dtype", "float32", "--tuner_type", mode, "--lora_rank", "8", "--lora_alpha", "32",
               "--lora_dropout", "0.05", "--target_modules", "all-linear",
               "--per_device_train_batch_size", str(bs), "--gradient_accumulation_steps", "1",
               "--max_length", str(MAX_LEN), "--max_steps", str(steps), "--learning_rate", str(LR),
               "--lr_scheduler_type", "cosine", "--warmup_steps", "0", "--weight_decay", "0.1",
               "--adam_beta2", "0.95", "--max_grad_norm", "1.0", "--optim", "adamw_torch",
               "--gradient_checkpointing", "false", "--logging_steps", "50", "--logging_first_step", "true",
               "--save_strategy", "no", "--report_to", "none", "--dataloader_num_workers", "0",
               "--dataset_num_proc", "1", "--seed", "42", "--output_dir", str(run_dir), "--add_version", "false"]
        if pf:
            cmd += ["--padding_free", "true"]
        if nproc > 1:
            env.update({"NPROC_PER_NODE": str(nproc), "MASTER_PORT": str(free_port())})
        first = re.compile(r"'global_step/max_steps': '1/")
        last = re.compile(rf"'global_step/max_steps': '{steps}/")
    else:
        raise ValueError(fw)
    return cmd, env, first, last


def run(fw, job, tag, steps, timeout):
    run_dir = WORK / "runs" / f"{job}-{fw}-{tag}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    cmd, extra, first_re, last_re = command(fw, job, run_dir, steps)
    caches = run_dir / "_cache"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_"))
           and k not in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")}  # swiftlite's PYTHONPATH comes from command()
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(caches / "hf_datasets"),
                "SWIFTLITE_CACHE": str(caches / "swiftlite"), "MODELSCOPE_CACHE": str(caches / "modelscope"),
                "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""})
    env.update(extra)
    log_lines = []
    marks = {}
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=run_dir,
                            text=True, bufsize=1, start_new_session=True)
    peak = {"tree": 0, "single": 0}
    done = threading.Event()

    def sample():
        root = psutil.Process(proc.pid)
        while not done.is_set():
            try:
                ps = [root] + root.children(recursive=True)
                rss = []
                for p in ps:
                    try:
                        rss.append(p.memory_info().rss)
                    except psutil.Error:
                        pass
                peak["tree"] = max(peak["tree"], sum(rss))
                peak["single"] = max(peak["single"], max(rss, default=0))
            except psutil.Error:
                pass
            done.wait(0.1)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    killer = threading.Timer(timeout, lambda: os.killpg(proc.pid, 9))
    killer.start()
    for line in proc.stdout:
        now = time.time()
        log_lines.append(line)
        if "first" not in marks and first_re.search(line):
            marks["first"] = now
        if last_re.search(line):
            marks["last"] = now
    rc = proc.wait()
    wall = time.time() - t0
    killer.cancel()
    done.set()
    th.join()
    (run_dir.parent / f"{run_dir.name}.log").write_text("".join(log_lines))
    shutil.rmtree(caches, ignore_errors=True)
    rec = {"framework": fw, "job": job, "tag": tag, "rc": rc, "wall_s": round(wall, 2),
           "first_step_s": round(marks["first"] - t0, 2) if "first" in marks else None,
           "samples_per_s": (round((steps - 1) * GLOBAL_BATCH / (marks["last"] - marks["first"]), 1)
                             if "first" in marks and "last" in marks and marks["last"] > marks["first"] else None),
           "peak_rss_mib": round(peak["tree"] / 2**20), "peak_rss_single_mib": round(peak["single"] / 2**20),
           "load": [round(x, 2) for x in os.getloadavg()], "cmd": " ".join(cmd)}
    if rc != 0:
        rec["error"] = "".join(log_lines[-15:])[-1500:]
    if fw == "swiftlite":  # its "swiftlite: ..." line says how it ran (padding-free or padded, attention)
        rec["run_line"] = next((l.rstrip() for l in log_lines if l.startswith("swiftlite:")), None)
    print(f"  {job:8s} {fw:11s} {tag:6s} rc={rc} wall {rec['wall_s']:6.1f} s  first step {rec['first_step_s']} s  "
          f"{rec['samples_per_s']} samples/s  peak {rec['peak_rss_mib']} MiB  load {rec['load'][0]}", flush=True)
    return rec


results = []
if not a.no_warmup:  # untimed: fills the OS page cache and .pyc files for every framework
    print("warm-up (untimed, 3 steps each):")
    for fw in frameworks:
        run(fw, "lora-1p", "warmup", 3, 600)
print(f"timed: {a.repeats} repeat(s) x {len(jobs)} job(s) x {len(frameworks)} framework(s), alternating")
for job in jobs:
    for r in range(a.repeats):
        order = frameworks[r % len(frameworks):] + frameworks[:r % len(frameworks)]
        for fw in order:
            results.append(run(fw, job, f"r{r + 1}", a.steps, a.timeout))
            (OUT / "peers.json").write_text(json.dumps({"runs": results}, indent=1))


def med(vals):
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None


summary = {}
for job in jobs:
    for fw in frameworks:
        rs = [r for r in results if r["job"] == job and r["framework"] == fw and r["rc"] == 0]
        summary[f"{job}/{fw}"] = {
            "runs": len(rs), "wall_s": med([r["wall_s"] for r in rs]), "wall_best_s": min([r["wall_s"] for r in rs], default=None),
            "first_step_s": med([r["first_step_s"] for r in rs]),
            "first_step_best_s": min([r["first_step_s"] for r in rs if r["first_step_s"] is not None], default=None),
            "samples_per_s": med([r["samples_per_s"] for r in rs]), "peak_rss_mib": med([r["peak_rss_mib"] for r in rs])}
ratios = {}


def vs(me, peers, key):
    vals = [p[key] for p in peers if p[key]]
    return round(me[key] / min(vals), 3) if vals and me[key] else None


for job in jobs:
    me = summary[f"{job}/swiftlite"]
    default_peers = [summary[f"{job}/{p}"] for p in frameworks[1:] if "+" not in p]
    ratios[job] = {"wall_vs_faster_peer": vs(me, default_peers, "wall_s"),
                   "first_step_vs_faster_peer": vs(me, default_peers, "first_step_s")}
    if a.peer_padding_free:
        every = [summary[f"{job}/{p}"] for p in frameworks[1:]]
        ratios[job].update({"wall_vs_fastest_variant": vs(me, every, "wall_s"),
                            "first_step_vs_fastest_variant": vs(me, every, "first_step_s")})
load = [r["load"][0] for r in results]
import platform
info = {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1), "python": platform.python_version(),
        "steps": a.steps, "repeats": a.repeats, "load_1min": [min(load, default=0), max(load, default=0)],
        "swiftlite": SWIFTLITE_FILE, "peer_padding_free": a.peer_padding_free}
(OUT / "peers.json").write_text(json.dumps({"info": info, "summary": summary, "ratios": ratios, "runs": results}, indent=1))

f = lambda v, spec=".1f": "-" if v is None else format(v, spec)
lines = [f"### Against peers, {info['date']}", "",
         f"{info['cpus']}-core CPU, {info['memory_gib']} GiB, shared (1-min load {info['load_1min'][0]}-{info['load_1min'][1]} "
         f"during the runs); tiny Llama 256 x 4 layers, 2000 chat rows, global batch 8, max length 128, {a.steps} "
         f"steps, fp32, 1 thread per process; median of {a.repeats} alternating run(s) (best in brackets); "
         "first step = launch to the end of optimizer step 1; samples/s between the first and last step; "
         "peak = RSS summed over the job's processes.", "",
         "| job | framework | wall s | first step s | samples/s | peak RSS MiB |", "|---|---|---|---|---|---|"]
for job in jobs:
    for fw in frameworks:
        s = summary[f"{job}/{fw}"]
        lines.append(f"| {job} | {label(fw)} | {f(s['wall_s'])} ({f(s['wall_best_s'])}) | {f(s['first_step_s'])} "
                     f"({f(s['first_step_best_s'])}) | {f(s['samples_per_s'])} | {f(s['peak_rss_mib'], '.0f')} |")
lines += ["", "| job | swiftlite wall / faster peer (target <= 0.5) | swiftlite first step / faster peer (target <= 0.3) |"
          + (" wall / fastest peer variant | first step / fastest peer variant |" if a.peer_padding_free else ""),
          "|---|---|---|" + ("---|---|" if a.peer_padding_free else "")]
for job, r in ratios.items():
    lines.append(f"| {job} | {f(r['wall_vs_faster_peer'], '.2f')} | {f(r['first_step_vs_faster_peer'], '.2f')} |"
                 + (f" {f(r['wall_vs_fastest_variant'], '.2f')} | {f(r['first_step_vs_fastest_variant'], '.2f')} |"
                    if a.peer_padding_free else ""))
fails = [r for r in results if r["rc"] != 0]
if fails:
    lines += ["", "Failed runs: " + ", ".join(f"{r['job']}/{label(r['framework'])}/{r['tag']} (rc {r['rc']})" for r in fails)]
(OUT / "peers.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
print(f"wrote {OUT / 'peers.json'} and {OUT / 'peers.md'}")
EOF

export BENCH_WORK="$WORK" BENCH_PEERS_DIR="$PEERS_DIR" BENCH_REPO="$REPO" BENCH_SL_PY="$SL_PY"
exec env PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$SL_PY" "$WORK/driver.py" "${ARGS[@]+"${ARGS[@]}"}"
