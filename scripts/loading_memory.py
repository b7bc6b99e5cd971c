#!/usr/bin/env python
"""Memory per rank at load and at peak, per backend and world size, on a model folder of real size
for this machine (docs/backends.md "Loading at size", docs/benchmarks.md).

    python scripts/loading_memory.py --cases fsdp:4:lora,fsdp:4:full,zero3:2:lora --out mem.json

The model: a Llama-shaped causal LM of 157M parameters (768 hidden, 24 layers, 4,096-token vocabulary,
untied head), fp32, saved as 4 safetensors files (594 MiB in all, the largest 191 MiB); random weights
and the tokenizer shipped with swiftlite. Its proportions are a real LLM's (the embeddings and head are
4% of it, one decoder layer 1/25), which is what decides how much of the model a sharding backend
holds for a moment (one gathered layer, the head around the loss).

Each case trains `--steps` steps of LoRA or a full fine-tune with activation checkpointing, fp32,
one 64-token row per rank per step, with glibc's MALLOC_MMAP_THRESHOLD_ at 64 KiB so that freed tensors
leave the resident set at once. The trainer writes logs/memory_rank<r>.json: the RSS just before the
model is built (each rank's own start), `load_peak` (the peak above it just before the first step:
loading, sharding, building the optimizer) and `training_peak` (the peak above it over the steps).
Both are reported divided by the model's bytes (the safetensors files' sizes).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: the model's shape (see the module docstring)
SHAPE = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=24, num_attention_heads=12,
             num_key_value_heads=4, vocab_size=4096, max_position_embeddings=2048, tie_word_embeddings=False)
SHARD_SIZE = "200MB"   # 4 files


def build_model(out: Path) -> Path:
    """The 157M-parameter Llama folder (random weights from seed 0), once."""
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from swiftlite.models.presets import TINY_TOKENIZER
    tok = AutoTokenizer.from_pretrained(str(TINY_TOKENIZER))
    conf = LlamaConfig(**SHAPE, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        LlamaForCausalLM(conf).save_pretrained(out, max_shard_size=SHARD_SIZE)
    tok.save_pretrained(out)
    return out


def model_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def largest_file(folder: Path) -> int:
    return max(p.stat().st_size for p in folder.glob("*.safetensors"))


def run_case(model: Path, data: Path, backend: str, nproc: int, train_type: str, out: Path,
             steps: int = 1, extra: tuple[str, ...] = (), dtype: str = "fp32") -> dict:
    """Train one case and return its per-rank figures (ratios to the model's bytes)."""
    args = [sys.executable, "-m", "swiftlite", "sft", "--model", str(model), "--dataset", str(data),
            "--train-type", train_type, "--parallelism", backend, "--nproc-per-node", str(nproc),
            "--torch-dtype", dtype, "--max-length", "64", "--per-device-train-batch-size", "1",
            "--gradient-checkpointing", "true", "--gradient-accumulation-steps", "1", "--max-steps", str(steps),
            "--save-strategy", "no",
            "--output-dir", str(out), *extra]
    if backend == "hsdp" and nproc > 1:   # shard groups of 2: 1 x 2 on two processes, 2 x 2 on four
        args += ["--hsdp-shard-size", "2"]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"),
               TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=1200)
    if proc.returncode != 0:
        raise RuntimeError(f"{backend} x{nproc} {train_type} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    size = model_bytes(model)
    ranks = []
    from swiftlite.checkpoint import layout
    for f in sorted((out / layout.LOGS_DIR).glob(layout.rank_glob("memory"))):
        rec = json.loads(f.read_text())
        # the parameter bytes this rank holds, counted from its tensors (logs/state_rank<r>.json)
        state = json.loads((f.parent / layout.rank_file("state", layout.rank_of("memory", f))).read_text())
        ranks.append({"load": rec["load_peak"] / size, "peak": rec["training_peak"] / size,
                      "load_mib": rec["load_peak"] / 2**20, "peak_mib": rec["training_peak"] / 2**20,
                      "params_mib": state["params"] / 2**20})
    sharded = "sharded loading is off" not in proc.stdout
    return {"backend": backend, "nproc": nproc, "train_type": train_type, "ranks": ranks,
            "model_mib": size / 2**20, "largest_file_mib": largest_file(model) / 2**20, "sharded_loading": sharded}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="fsdp:1:lora,fsdp:2:lora,fsdp:4:lora,fsdp:2:full,fsdp:4:full",
                    help="comma-separated BACKEND:NPROC:TRAIN_TYPE[:whole] (whole: --sharded-loading false)")
    ap.add_argument("--model-dir", default=None, help="where the model folder is (built there if missing)")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--torch-dtype", default="fp32", help="the run's dtype (bf16: the fp32 files are converted "
                    "while loading, so the whole-model path holds real copies)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="swiftlite-loadmem-"))
    model = build_model(Path(a.model_dir) if a.model_dir else work / "model")
    from swiftlite.demo import write_demo_data
    data, _ = write_demo_data(work / "data", n_train=64, n_val=8)
    results = []
    print(f"model {model_bytes(model) / 2**20:.0f} MiB, largest file {largest_file(model) / 2**20:.0f} MiB")
    print("| backend | N | train | load / model (max rank) | peak / model (max rank) | peak MiB (max rank) "
          "| parameters MiB per rank |")
    print("|---|---|---|---|---|---|---|")
    for case in a.cases.split(","):
        backend, nproc, train_type, *how = case.split(":")   # a 4th field "whole": --sharded-loading false
        extra = ("--sharded-loading", "false") if how == ["whole"] else ()
        r = run_case(model, data, backend, int(nproc), train_type, work / re.sub(r"[^\w.-]", "_", case), a.steps, extra,
                     a.torch_dtype)
        r["loading"] = "whole" if extra else "default"
        results.append(r)
        worst = max(r["ranks"], key=lambda x: x["peak"])
        print(f"| {backend}{' (whole)' if extra else ''} | {nproc} | {train_type} | {max(x['load'] for x in r['ranks']):.2f} | "
              f"{worst['peak']:.2f} | {worst['peak_mib']:.0f} | {max(x['params_mib'] for x in r['ranks']):.0f} |",
              flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
