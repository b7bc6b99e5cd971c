"""swiftlite rlhf against TRL on the same job: per-step loss and rewards/margins side by side.

    python scripts/compare_dpo_trl.py --out DIR [--method dpo|simpo|cpo|orpo] [--steps 10] \
        [--trl-python /path/to/trl-venv/bin/python]

The job: the tiny 2-layer Llama (seed 7, written once to DIR/model as an HF folder both read, its chat
template ending assistant turns at the end token: see CHAT_TEMPLATE), the
built-in preference task in TRL's conversational form (prompt / chosen / rejected messages), full
fine-tuning, fp32, one process, batch 4 pairs, gradient accumulation 1 and no gradient checkpointing on
both sides (pinned: swiftlite's defaults, ms-swift's, are ceil(16 / batch) and on), AdamW (betas
0.9/0.95, eps 1e-8, weight decay 0), a constant learning rate, no warm-up, gradient clipping at 1.0, no
dropout, --max-steps (one pass over the rows written). The pairs are handed to TRL
in the order swiftlite's data plan takes them, and TRL reads them in that order (a sequential sampler),
so both see the same pairs in every step. Before comparing, the script checks that TRL tokenized every
pair to the same prompt and answer tokens as swiftlite.

DPO runs TRL's DPOTrainer (sigmoid loss, beta 0.1, the reference a frozen copy of the start);
SimPO runs trl.experimental.cpo's CPOTrainer with loss_type "simpo" (beta 2, gamma 0.5, cpo_alpha 0);
CPO the same trainer with loss_type "sigmoid" (ms-swift's and TRL's defaults: beta 0.1, cpo_alpha 1.0);
ORPO trl.experimental.orpo's ORPOTrainer (beta 0.1).
Exit status 1 when a step differs by more than --tol (default 1e-3) in loss or rewards/margins.
TRL runs in its own virtual environment: --trl-python, else $TRL_PYTHON, else
$SWIFTLITE_PEERS_DIR/trl/bin/python (~/.cache/swiftlite/peers/trl, the venv scripts/bench_vs_peers.sh
installs; DEFAULT_TRL_PYTHON, shared by every compare_*_trl.py). This file is its entry point too
(`--trl-side`, importing nothing from swiftlite).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Where the compare_*_trl.py scripts look for TRL's python unless --trl-python or TRL_PYTHON says: the
#: `trl` venv under scripts/bench_vs_peers.sh's peers folder ($SWIFTLITE_PEERS_DIR, default
#: ~/.cache/swiftlite/peers; ../shared/PEERS.md, docs/rlhf.md).
PEERS_DIR = Path(os.environ.get("SWIFTLITE_PEERS_DIR") or Path.home() / ".cache" / "swiftlite" / "peers")
DEFAULT_TRL_PYTHON = os.environ.get("TRL_PYTHON") or str(PEERS_DIR / "trl" / "bin" / "python")
BATCH = 4
LR = {"dpo": 1e-3, "simpo": 1e-3, "cpo": 1e-3, "orpo": 1e-3}
SIMPO = {"beta": 2.0, "simpo_gamma": 0.5, "cpo_alpha": 0.0}
CPO = {"beta": 0.1, "cpo_alpha": 1.0}
#: The tiny model's chat template with nothing after an assistant turn's end token: CPOTrainer appends an
#: EOS to any answer that does not end in one (the shipped template ends turns with "<|im_end|>\n"),
#: which would give TRL one more answer token than swiftlite.
CHAT_TEMPLATE = ("{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + "
                 "'<|im_end|>' }}{%- if message['role'] != 'assistant' %}{{- '\n' }}{%- endif %}{%- endfor %}"
                 "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")


def _prepare(out: Path, steps: int) -> tuple[Path, Path, Path]:
    """The model folder, the pairs in swiftlite's format and (same pairs, in plan order) TRL's."""
    from swiftlite.config import build_config
    from swiftlite.data.loader import BatchPlan
    from swiftlite.models.loading import load_model, load_tokenizer
    from swiftlite.rlhf.demo import make_pairs
    model_dir = out / "model"
    if not (model_dir / "config.json").is_file():
        cfg = build_config({"model": "tiny-llama-2l", "dataset": ["x.jsonl"], "seed": 7, "torch_dtype": "fp32"},
                           task="rlhf")
        model = load_model(cfg)
        model.save_pretrained(model_dir, safe_serialization=True)
        tok = load_tokenizer(cfg)
        tok.chat_template = CHAT_TEMPLATE
        tok.save_pretrained(model_dir)
    n = steps * BATCH
    rows = make_pairs(n, seed=10)
    ours = out / "pairs.jsonl"
    ours.write_text("".join(json.dumps(r) + "\n" for r in rows))
    order = BatchPlan(n, BATCH, 1, 1, seed=7).order(0)
    theirs = out / "pairs_trl_order.jsonl"
    with theirs.open("w") as fh:
        for i in order:
            r = rows[i]
            fh.write(json.dumps({"prompt": r["messages"][:-1], "chosen": [r["messages"][-1]],
                                 "rejected": [{"role": "assistant", "content": r["rejected_response"]}]}) + "\n")
    return model_dir, ours, theirs


def _swiftlite(out: Path, model_dir: Path, data: Path, method: str, steps: int) -> dict[int, dict]:
    run = out / f"swiftlite_{method}"
    args = [sys.executable, "-m", "swiftlite", "rlhf", "--rlhf-type", method, "--model", str(model_dir),
            "--dataset", str(data), "--full", "--torch-dtype", "fp32", "--parallelism", "single", "--seed", "7",
            "--per-device-train-batch-size", str(BATCH), "--gradient-accumulation-steps", "1",
            "--gradient-checkpointing", "false", "--max-steps", str(steps), "--logging-steps", "1",
            "--learning-rate", str(LR[method]), "--lr-scheduler-type", "constant", "--warmup-ratio", "0",
            "--weight-decay", "0", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--max-grad-norm", "1.0",
            "--save-hf-model", "false", "--output-dir", str(run)]
    if method == "simpo":
        args += ["--beta", str(SIMPO["beta"]), "--simpo-gamma", str(SIMPO["simpo_gamma"]),
                 "--cpo-alpha", str(SIMPO["cpo_alpha"])]
    if method == "cpo":
        args += ["--beta", str(CPO["beta"]), "--cpo-alpha", str(CPO["cpo_alpha"])]
    env = dict(os.environ, PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM="false")
    subprocess.run(args, check=True, env=env)
    recs = {}
    for line in (run / "logging.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "loss" in r:
            recs[r["step"]] = r
    return recs


def _swiftlite_tokens(model_dir: Path, data: Path) -> list[tuple[list[int], list[int], list[int]]]:
    """(prompt, chosen answer, rejected answer) token ids of each pair as swiftlite builds them."""
    from transformers import AutoTokenizer

    from swiftlite.data.tokenize import IGNORE
    from swiftlite.rlhf.data import encode_pairs
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    items = [(json.loads(line), "") for line in data.read_text().splitlines()]
    items = [({"prompt": r["prompt"], "chosen": r["chosen"], "rejected": r["rejected"]}, w) for r, w in items]
    rows, _ = encode_pairs(items, tok, 100000, "delete", False)
    out = []
    for r in rows:
        start = next(i for i, x in enumerate(r["chosen_labels"]) if x != IGNORE)
        out.append((r["chosen_ids"][:start], r["chosen_ids"][start:], r["rejected_ids"][start:]))
    return out


def trl_side(a: argparse.Namespace) -> int:
    """Runs in TRL's venv: train, then write the log history and the tokenized pairs."""
    import torch
    from datasets import load_dataset
    from torch.utils.data import SequentialSampler
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(a.model)
    ds = load_dataset("json", data_files=a.data, split="train")
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    common = dict(output_dir=a.out, per_device_train_batch_size=BATCH, gradient_accumulation_steps=1,
                  max_steps=a.steps, logging_steps=1, learning_rate=LR[a.method], lr_scheduler_type="constant",
                  warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8,
                  max_grad_norm=1.0, optim="adamw_torch", use_cpu=True, bf16=False, fp16=False,
                  gradient_checkpointing=False, save_strategy="no", report_to=[], seed=7, data_seed=7,
                  dataloader_drop_last=True, remove_unused_columns=False)
    if a.method == "dpo":
        from trl import DPOConfig, DPOTrainer
        conf, cls = DPOConfig(beta=0.1, loss_type=["sigmoid"], max_length=None, **common), DPOTrainer
    elif a.method == "orpo":
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer
        conf, cls = ORPOConfig(beta=0.1, max_length=4096, **common), ORPOTrainer
    elif a.method == "cpo":
        from trl.experimental.cpo import CPOConfig, CPOTrainer
        conf = CPOConfig(loss_type="sigmoid", beta=CPO["beta"], cpo_alpha=CPO["cpo_alpha"], max_length=4096, **common)
        cls = CPOTrainer
    else:
        from trl.experimental.cpo import CPOConfig, CPOTrainer
        conf = CPOConfig(loss_type="simpo", beta=SIMPO["beta"], simpo_gamma=SIMPO["simpo_gamma"],
                         cpo_alpha=SIMPO["cpo_alpha"], max_length=4096, **common)
        cls = CPOTrainer

    class InOrder(cls):  # the pairs in the order they were written (swiftlite's plan order)
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

    trainer = InOrder(model=model, args=conf, train_dataset=ds, processing_class=tok)
    trainer.train()
    hist = [h for h in trainer.state.log_history if "loss" in h]
    Path(a.out, "trl_log.json").write_text(json.dumps(hist))
    td = trainer.train_dataset
    toks = []
    for r in td:
        if "prompt_ids" in r:        # DPOTrainer 1.x
            toks.append((r["prompt_ids"], r["chosen_ids"], r["rejected_ids"]))
        else:                         # CPOTrainer: prompt_input_ids, chosen_input_ids (prompt + answer)
            p = r["prompt_input_ids"]
            toks.append((p, r["chosen_input_ids"][len(p):], r["rejected_input_ids"][len(p):]))
    Path(a.out, "trl_tokens.json").write_text(json.dumps(toks))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--method", choices=("dpo", "simpo", "cpo", "orpo"), default="dpo")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--tol", type=float, default=1e-3)
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
    model_dir, ours, theirs = _prepare(out, a.steps)
    trl_out = out / f"trl_{a.method}"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([a.trl_python, __file__, "--trl-side", "--method", a.method, "--steps", str(a.steps),
                    "--out", str(trl_out), "--model", str(model_dir), "--data", str(theirs)], check=True, env=env)
    trl_toks = [tuple(map(list, t)) for t in json.loads((trl_out / "trl_tokens.json").read_text())]
    our_toks = _swiftlite_tokens(model_dir, theirs)
    same = sum(1 for x, y in zip(trl_toks, our_toks) if tuple(x) == tuple(y))
    print(f"tokenization: {same}/{len(our_toks)} pairs identical (prompt, chosen, rejected)")
    ours_log = _swiftlite(out, model_dir, ours, a.method, a.steps)
    trl_log = {i + 1: h for i, h in enumerate(json.loads((trl_out / "trl_log.json").read_text()))}
    worst = 0.0
    print(f"{'step':>4} {'swiftlite loss':>15} {'TRL loss':>12} {'swiftlite margin':>17} {'TRL margin':>12}")
    for s in range(1, a.steps + 1):
        o, t = ours_log[s], trl_log[s]
        d = max(abs(o["loss"] - t["loss"]), abs(o["rewards/margins"] - t["rewards/margins"]))
        worst = max(worst, d)
        print(f"{s:>4} {o['loss']:>15.6f} {t['loss']:>12.6f} {o['rewards/margins']:>17.6f} {t['rewards/margins']:>12.6f}")
    print(f"max |difference| over {a.steps} steps (loss, rewards/margins): {worst:.2e} (tolerance {a.tol:g})")
    return 0 if worst <= a.tol and same == len(our_toks) else 1


if __name__ == "__main__":
    sys.exit(main())
