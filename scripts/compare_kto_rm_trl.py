"""swiftlite rlhf --rlhf_type kto|rm against TRL's KTOTrainer / RewardTrainer on the same job, per step.

    python scripts/compare_kto_rm_trl.py --out DIR [--method kto|rm] [--steps 10] [--tol 1e-5] \
        [--trl-python /path/to/trl-venv/bin/python]

The job is scripts/compare_dpo_trl.py's (the tiny 2-layer Llama written once as an HF folder both
read, its chat template ending assistant turns at the end token; full fine-tuning, fp32, one process,
batch 4, accumulation 1 and no gradient checkpointing on both sides, AdamW 0.9/0.95, eps 1e-8, no
weight decay, constant learning rate 1e-3, clipping 1.0), on
the built-in preference task:

- kto: the pairs unpaired (pair i gives its chosen answer with label true when i is even, its
  rejected one with label false when odd), TRL's prompt/completion/label form; beta 0.1, desirable
  weight 1.0, undesirable weight 1.5. TRL rotates the completions within each per-device batch for
  its KL estimate, swiftlite within the global batch: the same rows here (one process, batch 4).
- rm: the pairs (chosen/rejected) with a `margin` column (0.5 on every other pair); both train
  AutoModelForSequenceClassification(num_labels=1) from one folder (DIR/rm_model: the tiny model with a
  score head drawn once, seed 7, and the tokenizer's pad id in its config), TRL with RewardTrainer
  (center_rewards_coefficient off). Compared: loss and TRL's `margin` (mean r_chosen - r_rejected).

The rows are handed to TRL in the order swiftlite's data plan takes them, TRL reads them in that
order (a sequential sampler). Exit status 1 when a step's loss (kto: also kl and rewards/margins) differs by more
than --tol, or the tokenization differs. TRL runs in its own venv (--trl-python, else $TRL_PYTHON,
else compare_dpo_trl.DEFAULT_TRL_PYTHON: $SWIFTLITE_PEERS_DIR/trl/bin/python); this file is its entry
point too (`--trl-side`, importing nothing from swiftlite).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_dpo_trl import BATCH, DEFAULT_TRL_PYTHON, _prepare  # noqa: E402  (the model folder and the pairs, in plan order)

LR = 1e-3
KTO = {"beta": 0.1, "desirable_weight": 1.0, "undesirable_weight": 1.5}


def _rows(out: Path, steps: int, method: str) -> tuple[Path, Path, Path]:
    """The model folder, our rows and TRL's rows (the same rows, TRL's in plan order)."""
    from swiftlite.data.loader import BatchPlan
    model_dir, pairs, _ = _prepare(out, steps)
    if method == "rm":
        model_dir = _reward_model(model_dir, out / "rm_model")
    rows = [json.loads(line) for line in pairs.read_text().splitlines()]
    order = BatchPlan(len(rows), BATCH, 1, 1, seed=7).order(0)
    ours, theirs = out / f"{method}_rows.jsonl", out / f"{method}_rows_trl_order.jsonl"
    mine, trl = [], {}
    for i, r in enumerate(rows):
        prompt = r["messages"][:-1]
        if method == "kto":
            good = i % 2 == 0
            ans = r["messages"][-1]["content"] if good else r["rejected_response"]
            comp = [{"role": "assistant", "content": ans}]
            mine.append({"messages": prompt + comp, "label": good})
            trl[i] = {"prompt": prompt, "completion": comp, "label": good}
        else:
            margin = 0.5 if i % 2 else 0.0
            chosen, rejected = [r["messages"][-1]], [{"role": "assistant", "content": r["rejected_response"]}]
            mine.append({"prompt": prompt, "chosen": chosen, "rejected": rejected, "margin": margin})
            trl[i] = {"prompt": prompt, "chosen": chosen, "rejected": rejected, "margin": margin}
    ours.write_text("".join(json.dumps(r) + "\n" for r in mine))
    theirs.write_text("".join(json.dumps(trl[i]) + "\n" for i in order))
    return model_dir, ours, theirs


def _reward_model(lm: Path, dest: Path) -> Path:
    """The causal LM's folder with a score head drawn once (seed 7), saved: both trainers start from it."""
    if not (dest / "config.json").is_file():
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer
        tok = AutoTokenizer.from_pretrained(str(lm))
        torch.manual_seed(7)
        model = AutoModelForSequenceClassification.from_pretrained(str(lm), num_labels=1, dtype=torch.float32)
        model.config.pad_token_id = tok.pad_token_id
        model.save_pretrained(dest, safe_serialization=True)
        tok.save_pretrained(dest)
    return dest


def _swiftlite(out: Path, model_dir: Path, data: Path, method: str, steps: int) -> dict[int, dict]:
    run = out / f"swiftlite_{method}"
    args = [sys.executable, "-m", "swiftlite", "rlhf", "--rlhf-type", method, "--model", str(model_dir),
            "--dataset", str(data), "--full", "--torch-dtype", "fp32", "--parallelism", "single", "--seed", "7",
            "--per-device-train-batch-size", str(BATCH), "--gradient-accumulation-steps", "1",
            "--gradient-checkpointing", "false", "--max-steps", str(steps), "--logging-steps", "1",
            "--learning-rate", str(LR), "--lr-scheduler-type", "constant", "--warmup-ratio", "0",
            "--weight-decay", "0", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--max-grad-norm", "1.0",
            "--save-hf-model", "false", "--save-strategy", "no", "--output-dir", str(run)]
    if method == "kto":
        args += ["--beta", str(KTO["beta"]), "--desirable-weight", str(KTO["desirable_weight"]),
                 "--undesirable-weight", str(KTO["undesirable_weight"])]
    env = dict(os.environ, PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM="false")
    subprocess.run(args, check=True, env=env)
    recs = {}
    for line in (run / "logging.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "loss" in r:
            recs[r["step"]] = r
    return recs


def _swiftlite_tokens(model_dir: Path, data: Path, method: str) -> list:
    from transformers import AutoTokenizer

    from swiftlite.data.tokenize import IGNORE
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    items = [(json.loads(line), "") for line in data.read_text().splitlines()]
    if method == "kto":
        from swiftlite.rlhf.kto import encode_unpaired
        rows, _ = encode_unpaired(items, tok, 100000, "delete", False)
        return [(r["input_ids"][:r["start"]], r["input_ids"][r["start"]:]) for r in rows]
    from swiftlite.rlhf.data import encode_pairs
    rows, _ = encode_pairs(items, tok, 100000, "delete", False)
    return [(r["chosen_ids"], r["rejected_ids"]) for r in rows]


def trl_side(a: argparse.Namespace) -> int:
    """Runs in TRL's venv: train, then write the log history and the tokenized rows."""
    import torch
    from datasets import load_dataset
    from torch.utils.data import SequentialSampler
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(a.model)
    ds = load_dataset("json", data_files=a.data, split="train")
    common = dict(output_dir=a.out, per_device_train_batch_size=BATCH, gradient_accumulation_steps=1,
                  max_steps=a.steps, logging_steps=1, learning_rate=LR, lr_scheduler_type="constant",
                  warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8,
                  max_grad_norm=1.0, optim="adamw_torch", use_cpu=True, bf16=False, fp16=False,
                  gradient_checkpointing=False, save_strategy="no", report_to=[], seed=7, data_seed=7,
                  dataloader_drop_last=True, remove_unused_columns=False)
    if a.method == "kto":
        from trl import KTOConfig, KTOTrainer
        model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
        conf, cls = KTOConfig(max_length=4096, **KTO, **common), KTOTrainer
    else:
        from trl import RewardConfig, RewardTrainer
        model = AutoModelForSequenceClassification.from_pretrained(a.model, num_labels=1, dtype=torch.float32)
        conf, cls = RewardConfig(max_length=4096, center_rewards_coefficient=None, **common), RewardTrainer

    class InOrder(cls):  # the rows in the order they were written (swiftlite's plan order)
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

    trainer = InOrder(model=model, args=conf, train_dataset=ds, processing_class=tok)
    trainer.train()
    hist = [h for h in trainer.state.log_history if "loss" in h]
    Path(a.out, "trl_log.json").write_text(json.dumps(hist))
    toks = []
    for r in trainer.train_dataset:
        if a.method == "kto":
            toks.append((r["prompt_ids"], r["completion_ids"]))
        else:
            toks.append((r["chosen_ids"], r["rejected_ids"]))
    Path(a.out, "trl_tokens.json").write_text(json.dumps(toks))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--method", choices=("kto", "rm"), default="kto")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--tol", type=float, default=1e-5)
    ap.add_argument("--trl-python", default=DEFAULT_TRL_PYTHON,
                    help="TRL's python (default: $TRL_PYTHON, else $SWIFTLITE_PEERS_DIR/trl/bin/python)")
    ap.add_argument("--trl-side", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.trl_side:
        return trl_side(a)
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if not Path(a.trl_python).is_file():
        print(f"no TRL venv at {a.trl_python} (set TRL_PYTHON or --trl-python)", file=sys.stderr)
        return 2
    model_dir, ours, theirs = _rows(out, a.steps, a.method)
    trl_out = out / f"trl_{a.method}"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([a.trl_python, __file__, "--trl-side", "--method", a.method, "--steps", str(a.steps),
                    "--out", str(trl_out), "--model", str(model_dir), "--data", str(theirs)], check=True, env=env)
    trl_toks = [tuple(map(list, t)) for t in json.loads((trl_out / "trl_tokens.json").read_text())]
    our_toks = _swiftlite_tokens(model_dir, theirs, a.method)
    same = sum(1 for x, y in zip(trl_toks, our_toks) if tuple(x) == tuple(y))
    print(f"tokenization: {same}/{len(our_toks)} rows identical")
    ours_log = _swiftlite(out, model_dir, ours, a.method, a.steps)
    trl_log = {i + 1: h for i, h in enumerate(json.loads((trl_out / "trl_log.json").read_text()))}
    second = "rewards/margins" if a.method == "kto" else "margin"
    trl_second = second
    worst = 0.0
    print(f"{'step':>4} {'swiftlite loss':>15} {'TRL loss':>12} {'swiftlite ' + second:>26} {'TRL ' + second:>20}")
    for s in range(1, a.steps + 1):
        o, t = ours_log[s], trl_log[s]
        d = abs(o["loss"] - t["loss"])
        if a.method == "kto":
            d = max(d, abs(o["kl"] - t["kl"]))
        if second in o and trl_second in t:
            d = max(d, abs(o[second] - t[trl_second]))
        worst = max(worst, d)
        print(f"{s:>4} {o['loss']:>15.6f} {t['loss']:>12.6f} {o.get(second, float('nan')):>26.6f} "
              f"{t.get(trl_second, float('nan')):>20.6f}")
    print(f"max |difference| over {a.steps} steps: {worst:.2e} (tolerance {a.tol:g})")
    return 0 if worst <= a.tol and same == len(our_toks) else 1


if __name__ == "__main__":
    sys.exit(main())
