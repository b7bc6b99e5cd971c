"""The ranks of a one-node job, forked from the launching process.

They inherit what the preflight already paid for: the imported torch / transformers / peft (3-5 s
per interpreter on a small machine), the tokenizer and the tokenized data. torchrun would start a
fresh interpreter per rank and import all of it again, all ranks at once. A failed rank stops the
others; the launcher names it in one line (`launch/diagnostics.py`).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from swiftlite import env
from swiftlite.config import RunConfig
from swiftlite.errors import UserError
from swiftlite.launch.diagnostics import clear_rank_logs, explain_failure
from swiftlite.launch.plan import LaunchPlan
from swiftlite.launch.preflight import resolve_for_launch
from swiftlite.launch.run import run_rank

if TYPE_CHECKING:
    from swiftlite.job import Resolved
    from swiftlite.parallel.base import BackendChoice

#: What every rank imports; paid once before forking instead of once per rank.
WARM_MODULES = ("torch", "torch.distributed", "swiftlite.train.loop", "swiftlite.data.collate",
                "swiftlite.data.loader", "swiftlite.metrics", "transformers.modeling_utils")


def warm_imports(cfg: RunConfig, choice: "BackendChoice") -> None:
    """Import, before forking, what every rank imports: paid once here instead of once per rank.
    Best effort: a module that fails to import here fails in the rank with its real error."""
    import importlib
    for name in WARM_MODULES:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - see the docstring
            pass
    try:  # the engine's module (the torch backends share torch_engine; DeepSpeed is left to the ranks)
        if not choice.is_deepspeed:
            importlib.import_module("swiftlite.parallel.torch_engine")
    except Exception:  # noqa: BLE001
        pass
    try:  # the model's modeling module (modeling_llama, ...): looking its class up imports it
        from swiftlite.models.loading import model_config, resolve_model
        source = resolve_model(cfg.model.model)
        if source.kind in ("preset", "folder"):  # never the network here: a hub config is the ranks' job
            from transformers import MODEL_FOR_CAUSAL_LM_MAPPING
            MODEL_FOR_CAUSAL_LM_MAPPING[type(model_config(cfg, source))]
    except Exception:  # noqa: BLE001
        pass
    if cfg.is_peft:
        try:
            from swiftlite.models.quant import peft_without_bnb
            with peft_without_bnb(quantized=cfg.quant.quant_bits is not None):
                pass
        except Exception:  # noqa: BLE001
            pass


def rank_vars(plan: LaunchPlan, local_rank: int, facts: "Resolved | None" = None) -> dict[str, str]:
    """The environment torchrun would give rank `local_rank` of this one-node job, and the job's
    facts this process resolved (swiftlite/job.py)."""
    out = {"RANK": str(local_rank), "LOCAL_RANK": str(local_rank), "GROUP_RANK": "0",
           "WORLD_SIZE": str(plan.world_size), "LOCAL_WORLD_SIZE": str(plan.nproc_per_node),
           "MASTER_ADDR": plan.master_addr, "MASTER_PORT": str(plan.master_port),
           env.PREFLIGHT_DONE: "1"}
    if facts is not None:
        out[env.JOB_FACTS] = facts.to_json()
    return out


def _forked_rank(local_rank: int, cfg: RunConfig, plan: LaunchPlan, threads: int,
                 facts: "Resolved | None" = None) -> None:
    """Entry point of a forked rank: the environment torchrun would have given it, then the rank."""
    env.update(rank_vars(plan, local_rank, facts))
    import torch
    torch.set_num_threads(threads)  # the parent's torch chose its thread count before OMP_NUM_THREADS
    try:
        run_rank(cfg)
    except UserError:
        sys.exit(2)  # the one-line message is in logs/rank<r>.err; the parent prints it
    except BaseException:
        sys.exit(1)


def run_forked(plan: LaunchPlan, cfg: RunConfig, facts: "Resolved | None" = None) -> int:
    """Fork the ranks of a one-node job from this process and wait for them; on failure, stop the
    others (STOP_SIGNAL: a hung rank dumps its stack) and name the rank that caused it. Preemption
    signals are forwarded to the ranks, which save and end (train/preempt.py)."""
    import gc
    import logging
    import time

    import torch.multiprocessing as tmp
    facts = facts or resolve_for_launch(cfg, plan.world_size)
    warm_imports(cfg, facts.choice)
    logs = clear_rank_logs(cfg)
    env.set_default("OMP_NUM_THREADS", "1")
    # Forked children must not share the tokenizer's Rust thread pool; saying so up front also
    # silences the warning tokenizers prints in each child otherwise.
    env.set_default("TOKENIZERS_PARALLELISM", "false")
    omp = env.get("OMP_NUM_THREADS") or ""
    threads = max(1, int(omp)) if omp.isdigit() else 1
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)  # "Terminating process ..."
    print(f"launching: {plan.nproc_per_node} processes forked from this one "
          f"(master {plan.master_addr}:{plan.master_port})", flush=True)
    sys.stderr.flush()
    t0 = time.monotonic()
    # Everything imported so far moves to the collector's permanent generation: the ranks' garbage
    # collections then skip the millions of inherited objects (modules, tokenizer) instead of
    # walking them, and leave their pages shared (Python's gc.freeze recipe for fork).
    gc.freeze()
    ctx = tmp.start_processes(_forked_rank, args=(cfg, plan, threads, facts), nprocs=plan.nproc_per_node,
                              join=False, start_method="fork")
    procs = ctx.processes
    forwarding = _forward_signals(procs) if cfg.checkpoint.save_on_signal else None
    try:
        failed = _wait(procs)
    except KeyboardInterrupt:  # only without --save-on-signal (else SIGINT is forwarded)
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        return 130
    finally:
        if forwarding is not None:
            forwarding.restore()
    if not failed:
        return 0
    _stop(procs)
    codes = {r: proc.exitcode for r, proc in enumerate(procs) if proc.exitcode not in (None, 0)}
    msg, code = explain_failure(logs, plan.world_size, "", cfg.parallel.ddp_timeout, time.monotonic() - t0,
                                codes=codes)
    print(f"error: {msg}", file=sys.stderr)
    return code if code else 1


def _wait(procs: list) -> bool:
    """Wait until every rank has ended (False) or one has failed (True)."""
    from multiprocessing.connection import wait
    while True:
        alive = [p.sentinel for p in procs if p.exitcode is None]
        if alive:
            wait(alive, timeout=1.0)
        codes = [p.exitcode for p in procs]
        if any(c not in (None, 0) for c in codes):
            return True
        if all(c == 0 for c in codes):
            return False


def _stop(procs: list, grace_s: float = 30.0) -> None:
    """Stop the ranks still running after another failed: STOP_SIGNAL (each dumps its stack and dies,
    even when blocked in a collective), then SIGKILL for any still alive after `grace_s`."""
    import os
    import time

    from swiftlite.launch.diagnostics import STOP_SIGNAL
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, STOP_SIGNAL)
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


class _Forwarding:
    """This launcher's handlers for the preemption signals: each one is passed on to every rank
    (SIGUSR1 sent to the launcher alone reaches the ranks), none stops the launcher itself: it
    waits for the ranks to save and end."""

    def __init__(self, procs: list):
        import signal

        from swiftlite.train.preempt import SIGNALS
        self.procs = procs
        self.previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}

    def _handle(self, signum: int, frame: object) -> None:
        import os
        for p in self.procs:
            if p.exitcode is None:
                try:
                    os.kill(p.pid, signum)
                except ProcessLookupError:
                    pass

    def restore(self) -> None:
        import signal
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def _forward_signals(procs: list) -> _Forwarding:
    return _Forwarding(procs)
