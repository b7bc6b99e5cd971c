"""Helper for test_lora.py (not a test itself): several `swiftlite sft` runs in one job.

    python _lora_worker.py PLAN.json                                          # one process
    torchrun --standalone --nproc-per-node 2 _lora_worker.py PLAN.json        # two processes

PLAN.json is a list of {"name", "args"} where args is a `swiftlite` command line (without the
program name). Each run goes through the real CLI entry point (`swiftlite.cli.main`), one after the
other in the same process group, so the start-up cost (imports, torchrun, rendezvous) is paid once.

After the trainer writes the final checkpoint's adapter, a hook (on `trainer.export_weights`, every
rank) records, next to the run's logging.jsonl, in <output_dir>/lora_probe/:
  * logits.pt      the trained model's logits on a fixed probe batch (rank 0), computed by the
                   engine's own wrapped module, the way training runs it (train mode, no_grad);
  * bytes_rank<r>.json  bytes this rank holds of the 4-bit weights and of all frozen parameters,
                   counted from the tensors themselves (the local shard under FSDP/ZeRO-3).
Writes <PLAN.json>.rc.json: name -> exit code (rank 0).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

PROBE_SEQ = 24


def probe_batch() -> dict[str, torch.Tensor]:
    """Two fixed rows of byte tokens (the tiny tokenizer maps bytes to ids < 256)."""
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(3, 250, (2, PROBE_SEQ), generator=g)
    mask = torch.ones_like(ids)
    return {"input_ids": ids, "attention_mask": mask}


def _local_bytes(t: torch.Tensor) -> int:
    if hasattr(t, "ds_tensor"):  # ZeRO-3 partitioned parameter: this rank's partition
        t = t.ds_tensor
    elif hasattr(t, "to_local"):  # FSDP2 DTensor
        t = t.to_local()
    return t.numel() * t.element_size()


def base_bytes(module: torch.nn.Module) -> dict[str, int]:
    quant = frozen = 0
    seen: set[int] = set()
    for m in module.modules():
        for p in m.parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            if p.requires_grad:
                continue
            n = _local_bytes(p)
            frozen += n
            if type(m).__name__ in ("Linear4bit", "Linear8bitLt"):
                quant += n
    return {"quantized": quant, "frozen": frozen}


def install_probe() -> None:
    import swiftlite.checkpoint.state as trainer  # save_training_state calls export_weights from there

    original = trainer.export_weights

    def export_and_probe(engine, model, tokenizer, cfg, world, ckpt_dir):
        original(engine, model, tokenizer, cfg, world, ckpt_dir)
        if not cfg.is_peft or cfg.train.max_steps <= 0 or not str(ckpt_dir.name).endswith(
                f"checkpoint-{cfg.train.max_steps}"):
            return
        out = Path(cfg.train.output_dir) / "lora_probe"
        out.mkdir(parents=True, exist_ok=True)
        (out / f"bytes_rank{world.rank}.json").write_text(json.dumps(base_bytes(engine.module)))
        batch = {k: v.to(world.device) for k, v in probe_batch().items()}
        with torch.no_grad():  # train mode (dropout 0 in the tests): what the training forward computes
            logits = engine.module(**batch, use_cache=False).logits.float().cpu()
        if world.is_main:
            torch.save(logits, out / "logits.pt")

    trainer.export_weights = export_and_probe


def _forget_deepspeed() -> None:
    """A ZeRO-3 run registers its config with transformers for the life of the process (it is one
    run per process in real use); the next run of this job must not build its model under it."""
    if "swiftlite.parallel.deepspeed" not in sys.modules:
        return
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config
    unset_hf_deepspeed_config()
    sys.modules["swiftlite.parallel.deepspeed"]._HF_DS_CONFIG = None


def main() -> int:
    plan_path = Path(sys.argv[1])
    plan = json.loads(plan_path.read_text())
    install_probe()
    import swiftlite.distributed as distributed
    from swiftlite.cli import main as cli_main

    real_teardown = distributed.teardown
    distributed.teardown = lambda: None  # keep one process group for all runs of this job
    rcs = {}
    try:
        for run in plan:
            _forget_deepspeed()
            rcs[run["name"]] = cli_main([str(a) for a in run["args"]])
            if rcs[run["name"]] != 0:
                break
    finally:
        distributed.teardown = real_teardown
        real_teardown()
    if os.environ.get("RANK", "0") == "0":
        plan_path.with_suffix(".rc.json").write_text(json.dumps(rcs))
    return 0 if all(rc == 0 for rc in rcs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
