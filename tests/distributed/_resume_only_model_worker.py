"""Helper for tests/e2e/test_resume_only_model.py (not a test itself).

    python _resume_only_model_worker.py CONFIG.json OUT.json                               # 1 process
    torchrun --standalone --nproc-per-node 2 _resume_only_model_worker.py CONFIG.json OUT.json

Builds a run exactly as the trainer does (`train.run.build_run`: run folder, data, model, engine,
then the resume) from the flat config values in CONFIG.json (usually naming a checkpoint with `resume_from` and
setting `resume_only_model`) and stops before the first step; CONFIG.json's extra key
`compare_with` names the checkpoint whose weights the model is compared with. Rank 0 writes to
OUT.json what the resume left: the start step, the largest difference of every weight from the
checkpoint's own HF copy (checkpoint-N/model/), the optimizer's state, the scheduler's step and lr.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def optimizer_state(engine) -> dict:
    """Entries of the optimizer state and the largest |exp_avg| in them (0 for a fresh optimizer;
    ZeRO creates zero-filled states at start-up)."""
    import torch
    opt = engine.optimizer
    inner = getattr(opt, "optimizer", opt)          # DeepSpeed's ZeRO optimizer wraps a torch one
    entries, biggest = 0, 0.0
    for st in inner.state.values():
        entries += 1
        m = st.get("exp_avg")
        if isinstance(m, torch.Tensor) and m.numel():
            local = m.to_local() if hasattr(m, "to_local") else m
            biggest = max(biggest, float(local.abs().max()))
    return {"entries": entries, "max_exp_avg": biggest}


def main(config: str, out: str) -> None:
    from safetensors.torch import load_file

    from swiftlite.config import build_config
    from swiftlite.train.run import build_run
    values = json.loads(Path(config).read_text())
    compare_with = Path(values.pop("compare_with"))
    cfg = build_config(values, source=config)
    run, _ = build_run(cfg)
    try:
        sd = run.engine.full_state_dict()              # every rank takes part; the tensors land on rank 0
        st = optimizer_state(run.engine)
        sched = run.engine.scheduler
        result = {"start_step": run.start_step, "optimizer": st, "scheduler_step": sched.last_epoch,
                  "lr": run.engine.lr(), "backend": run.choice.key, "world_size": run.world.world_size}
        if run.world.is_main:
            ref: dict = {}
            for f in sorted((compare_with / "model").glob("*.safetensors")):
                ref.update(load_file(str(f)))
            diffs = {k: float((v.float() - ref[k].float()).abs().max()) for k, v in sd.items() if k in ref}
            result.update(n_weights=len(sd), n_compared=len(diffs), missing=sorted(set(ref) - set(sd))[:5],
                          max_diff=max(diffs.values()), max_weight=max(float(v.abs().max()) for v in ref.values()))
            Path(out).write_text(json.dumps(result))
    finally:
        if run.lock is not None:
            run.lock.release()
        # Free the engine (FSDP2 modules, DTensors, pending gloo work) while the process group still
        # exists: left to interpreter shutdown, gloo's worker threads may free tensors without the GIL
        # and abort the process ("terminate called without an active exception").
        del run
        import gc
        gc.collect()
        import torch.distributed as dist
        if dist.is_initialized():   # every rank waits for rank 0's comparison, then a clean gloo shutdown
            dist.barrier()
            dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
