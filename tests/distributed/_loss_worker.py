"""Helper for test_loss_parity.py (not a test itself): several `swiftlite sft` runs in one job.

    python _loss_worker.py PLAN.json                                   # one process
    torchrun --standalone --nproc-per-node 2 _loss_worker.py PLAN.json # two processes

PLAN.json is a list of {"name", "args", "out"}; each run goes through the real CLI entry point, one
after the other in the same process group (as _lora_worker.py does). A probe wraps the loss that
runs as lm_head's forward (swiftlite/parallel/loss.py `_head_forward`) and records per rank, in
<out>/loss_probe_rank<r>.json: how many times it ran, the weight shapes it saw (full [vocab, hidden]
means the backend had gathered lm_head: FSDP's root unit, ZeRO-3's module hook), and, read in the
trainer's `before_optimizer` window, which trainable parameters had a gradient on that rank
(torch backends).
Writes <PLAN.json>.rc.json: name -> exit code (rank 0).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

PROBE: dict = {}


def install_probe() -> None:
    import swiftlite.parallel.loss as loss
    import swiftlite.train.step as step

    original = loss._head_forward

    def head_forward(self, hidden, **kw):
        if kw.get("swiftlite_targets") is not None:
            PROBE["calls"] = PROBE.get("calls", 0) + 1
            PROBE.setdefault("weight_shapes", set()).add(tuple(self.weight.shape))
            PROBE.setdefault("impls", set()).add(kw.get("swiftlite_impl"))
        return original(self, hidden, **kw)

    loss._head_forward = head_forward  # _install binds the module-level name when it patches lm_head

    real_step = step.train_step

    def train_step(engine, batches, k, **kw):
        before = kw.pop("before_optimizer", None)

        def look(eng):
            # DeepSpeed keeps gradients in its own partitions, not in .grad: not recorded there (its
            # runs are checked by the loss and the gradient norm against the plain run instead)
            if "grads" not in PROBE and not hasattr(eng, "ds"):
                PROBE["grads"] = sorted(n for n, p in eng.module.named_parameters()
                                        if p.requires_grad and p.grad is not None)
                PROBE["trainable"] = sorted(n for n, p in eng.module.named_parameters() if p.requires_grad)
            if before is not None:
                before(eng)
        return real_step(engine, batches, k, before_optimizer=look, **kw)

    step.train_step = train_step  # train/loop.py imports it at call time


def _forget_deepspeed() -> None:
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
    distributed.teardown = lambda: None
    rank = int(os.environ.get("RANK", "0"))
    rcs = {}
    try:
        for run in plan:
            _forget_deepspeed()
            PROBE.clear()
            rcs[run["name"]] = cli_main([str(a) for a in run["args"]])
            probe = {k: sorted(map(list, v)) if k == "weight_shapes" else sorted(v) if isinstance(v, set) else v
                     for k, v in PROBE.items()}
            Path(run["out"]).mkdir(parents=True, exist_ok=True)
            (Path(run["out"]) / f"loss_probe_rank{rank}.json").write_text(json.dumps(probe))
            if rcs[run["name"]] != 0:
                break
    finally:
        distributed.teardown = real_teardown
        real_teardown()
    if rank == 0:
        plan_path.with_suffix(".rc.json").write_text(json.dumps(rcs))
    return 0 if all(rc == 0 for rc in rcs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
