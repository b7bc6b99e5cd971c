#!/usr/bin/env python
"""Peak memory of `swiftlite export` on a DCP checkpoint of a few hundred MB.

Builds a random Llama checkpoint in the layout the torch backends write (run/args.json, run/latest,
run/checkpoint-1/dcp/ with {"model": ..., "optim": ...} through torch.distributed.checkpoint,
trainer_state.json, manifest.json; no model/ copy, so the export must read DCP), then runs
`python -m swiftlite export --max-shard-size S` in a subprocess with MALLOC_MMAP_THRESHOLD_=65536
(glibc otherwise keeps freed buffers and RSS never drops) and reports:

  stream growth   the export's own probe (SWIFTLITE_EXPORT_MEMLOG): peak RSS (VmHWM, reset with
                  /proc/self/clear_refs when streaming starts) minus RSS when streaming starts
  process peak    psutil polling of the whole process (imports included), for context

    python scripts/bench_export_memory.py                       # ~200M params, fp32 = ~800 MB, 100MB shards
    python scripts/bench_export_memory.py --layers 4 --hidden 512 --vocab 8000 --shard 20MB --json

The bound we claim (docs/export.md, tests/e2e/test_export_memory.py): stream growth < 2 x shard
size + 2 x the largest tensor in fp32 (DCP loads a tensor into a temporary, then copies it) + 32 MB.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def llama_config(hidden: int, layers: int, vocab: int, inter: int | None = None) -> dict:
    heads = max(1, hidden // 64)
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": hidden,
            "intermediate_size": inter or int(hidden * 2.75), "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": heads, "vocab_size": vocab,
            "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "tie_word_embeddings": False, "hidden_act": "silu", "eos_token_id": 258, "pad_token_id": 259,
            "bos_token_id": None}


def build_run(root: Path, conf: dict, *, optim: bool, seed: int = 0) -> tuple[Path, int, int]:
    """A run folder whose checkpoint-1 holds random weights in the trainer's DCP layout.
    Returns (run dir, total parameter bytes in fp32, largest tensor bytes)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoConfig, AutoModelForCausalLM

    from swiftlite import checkpoint as ckpt
    from swiftlite.config import build_config, save_args
    from swiftlite.models.presets import TINY_TOKENIZER

    base = root / "base"
    base.mkdir(parents=True)
    hf_conf = AutoConfig.for_model(**conf)
    hf_conf.save_pretrained(base)
    for f in TINY_TOKENIZER.iterdir():
        shutil.copy(f, base / f.name)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(hf_conf)
    shapes = {k: v.shape for k, v in meta.state_dict().items()}
    del meta
    g = torch.Generator().manual_seed(seed)
    model_sd = {}
    for k, shape in shapes.items():
        if k.endswith("norm.weight"):
            model_sd[k] = torch.ones(shape)
        else:
            model_sd[k] = torch.randn(shape, generator=g) * 0.02
    total = sum(t.numel() * 4 for t in model_sd.values())
    largest = max(t.numel() * 4 for t in model_sd.values())
    state = {"model": model_sd}
    if optim:  # what get_optimizer_state_dict gives for AdamW (FQN-keyed): the export must skip it
        state["optim"] = {"state": {k: {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(v),
                                        "exp_avg_sq": torch.zeros_like(v)} for k, v in model_sd.items()},
                          "param_groups": [{"lr": 1e-5, "params": list(model_sd)}]}
    run = root / "run"
    c = run / "checkpoint-1"
    (c / "dcp").mkdir(parents=True)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(c / "dcp"), no_dist=True)
    del state, model_sd
    cfg = build_config({"model": str(base), "torch_dtype": "fp32", "dataset": ["unused.jsonl"],
                        "output_dir": str(run), "save_hf_model": False})
    save_args(cfg, run / "args.json")
    (c / "trainer_state.json").write_text(json.dumps(
        {"global_step": 1, "backend": "fsdp", "world_size": 1, "train_type": "full", "model": str(base),
         "torch_dtype": "fp32"}) + "\n")
    ckpt.write_manifest(c)
    ckpt.write_latest(run, c.name)
    return run, total, largest


def run_export(run: Path, out: Path, shard: str, *, timeout: float = 900) -> dict:
    """Export in a subprocess; returns the probe's figures and the polled process peak."""
    import psutil
    memlog = out.parent / "memlog.json"
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", SWIFTLITE_EXPORT_MEMLOG=str(memlog),
               TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "swiftlite", "export", "--ckpt", str(run), "--output", str(out),
           "--max-shard-size", shard]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak = [0]

    def poll() -> None:
        try:
            p = psutil.Process(proc.pid)
            while proc.poll() is None:
                peak[0] = max(peak[0], p.memory_info().rss)
                time.sleep(0.01)
        except psutil.Error:
            pass

    th = threading.Thread(target=poll, daemon=True)
    th.start()
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    th.join()
    if proc.returncode != 0:
        raise RuntimeError(f"export failed ({proc.returncode}):\n{output}")
    probe = json.loads(memlog.read_text())
    return {"seconds": round(time.perf_counter() - t0, 1), "process_peak_rss_mb": round(peak[0] / 1e6, 1),
            "stream_start_rss_mb": round(probe["start_rss"] / 1e6, 1),
            "stream_peak_rss_mb": round(probe["peak_rss"] / 1e6, 1),
            "stream_growth_mb": round((probe["peak_rss"] - probe["start_rss"]) / 1e6, 1),
            "hwm_reset": probe.get("hwm_reset", False), "log": output}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--shard", default="100MB")
    ap.add_argument("--optim", action="store_true", help="also store AdamW state in the DCP (3x the disk)")
    ap.add_argument("--workdir", default=None, help="keep files here (default: a temp folder, removed)")
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    a = ap.parse_args()
    from swiftlite.hf_io import parse_size
    work = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="swiftlite-bench-export-"))
    try:
        t0 = time.perf_counter()
        run, total, largest = build_run(work, llama_config(a.hidden, a.layers, a.vocab), optim=a.optim)
        built = time.perf_counter() - t0
        res = run_export(run, work / "export", a.shard)
        shard = parse_size(a.shard)
        bound = 2 * shard + 2 * largest + 32 * 10**6
        res.update({"params_m": round(total / 4 / 1e6, 1), "checkpoint_fp32_mb": round(total / 1e6, 1),
                    "largest_tensor_fp32_mb": round(largest / 1e6, 1), "shard_mb": round(shard / 1e6, 1),
                    "bound_mb": round(bound / 1e6, 1), "build_seconds": round(built, 1),
                    "shards": len(list((work / "export").glob("*.safetensors")))})
        log = res.pop("log")
        if a.json:
            print(json.dumps(res))
        else:
            print(log.rstrip())
            for k, v in res.items():
                print(f"{k:>24}: {v}")
        return 0 if res["stream_growth_mb"] * 1e6 < bound else 1
    finally:
        if not a.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
