"""The floor under a training step: the same step written as a bare PyTorch (+ peft) loop.

Used to decide whether a slow step is swiftlite's overhead or the kernels themselves (issue 7,
"against peers"): it builds the bench_vs_peers workload's model from a local folder, tokenizes the
data with swiftlite's own pipeline (so both see identical batches), and times N optimizer steps of
forward + summed cross-entropy + backward + clip + fused AdamW with nothing else around them. Compare its
ms/step with the swiftlite run's (tokens_per_s in logging.jsonl, or bench_vs_peers.sh's samples/s).

    python scripts/bench_step_floor.py --model /tmp/swiftlite_peers/model \
        --dataset /tmp/swiftlite_peers/data/train.jsonl --train-type lora --steps 100

Prints one JSON line: ms per step (median of the steps after 5 warm-up steps) and samples/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--train-type", choices=("lora", "full"), default="lora")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-length", type=int, default=128)
    ap.add_argument("--lora-dropout", type=float, default=0.05)
    a = ap.parse_args()

    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from swiftlite.data.collate import collate
    from swiftlite.data.pipeline import tokenize_specs
    torch.set_num_threads(1)
    torch.manual_seed(42)
    tok = AutoTokenizer.from_pretrained(a.model)
    data = tokenize_specs([a.dataset], tok, task="sft", max_length=a.max_length, packing=False,
                          skip_bad_rows=False, use_cache=False)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    model.config.use_cache = False
    if a.train_type == "lora":
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=32, lora_dropout=a.lora_dropout,
                                                 target_modules="all-linear", task_type="CAUSAL_LM"))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    model.train()
    times = []
    for step in range(a.steps):
        rows = [data.rows[(step * a.batch + i) % len(data.rows)] for i in range(a.batch)]
        batch = collate(rows, tok.pad_token_id)
        t = time.perf_counter()
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        labels = batch["labels"][:, 1:]
        loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.size(-1)), labels.reshape(-1),
                               ignore_index=-100, reduction="sum")
        n = int((labels != -100).sum())
        (loss / n).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t)
    ms = statistics.median(times[5:]) * 1000
    print(json.dumps({"train_type": a.train_type, "lora_dropout": a.lora_dropout, "steps": a.steps,
                      "ms_per_step": round(ms, 1), "samples_per_s": round(a.batch * 1000 / ms, 1)}))


if __name__ == "__main__":
    main()
