"""`swiftlite rollout --data_parallel_size N` (ms-swift's `--vllm_data_parallel_size`): N copies of the
engine, each in a process of its own on its own devices, behind the one server; what ms-swift's rollout
does with its data-parallel workers.

- Devices: copy i takes the visible GPUs [i x tp, (i + 1) x tp) (CUDA_VISIBLE_DEVICES set for its process
  before it starts, as ms-swift's _set_visible_devices_for_dp_rank), so N x tp GPUs must be visible; on a
  machine without GPUs (the transformers engine) each copy takes its share of the CPU threads.
- Weight sync: every copy's workers are members of the run's weight-sync group, copy i's as ranks
  i x W_copy .. (i + 1) x W_copy - 1 (ms-swift's rank + dp_rank x tp); /get_world_size/ answers their sum,
  so the run, the last rank, broadcasts each tensor once to all of them.
- Generation: an /infer/ request's groups (the run's micro-batches) are dealt to the copies in contiguous
  shares and the answers joined in order. Every completion carries its own seed and a group is never split,
  so the completions are those one engine gives (tests/e2e/test_rollout_server.py).

The copies are this package's own processes talking over multiprocessing pipes (the server's calls and
their answers, nothing read from outside). The engine calls of rollout/engines.py are made on every copy
at once, and each copy's error is reported naming the copy.
"""

from __future__ import annotations

import os
from typing import Any

from swiftlite.errors import UserError


def _visible_gpus() -> list[str]:
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d for d in env.split(",") if d.strip()]
    import torch
    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def _copy_main(conn: Any, build: Any, o: Any, threads: int | None) -> None:
    """One copy's process: build the engine (`build(o)`: the server's build_engine, passed by name), then
    answer the server's calls until told to stop."""
    try:
        if threads:
            import torch
            torch.set_num_threads(threads)
        backend = build(o)
    except BaseException as e:      # said to the server, which stops with it
        conn.send(("error", _why(e)))
        return
    conn.send(("ready", None))
    while True:
        try:
            method, args = conn.recv()
        except (EOFError, KeyboardInterrupt):
            method, args = "stop", ()
        if method == "stop":
            backend.close()
            return
        try:
            conn.send(("ok", getattr(backend, method)(*args)))
        except BaseException as e:   # the call's answer; the copy goes on
            conn.send(("error", _why(e)))


def _why(e: BaseException) -> str:
    return str(e) if isinstance(e, UserError) else f"{type(e).__name__}: {e}"


class ReplicatedEngine:
    """The engine calls of rollout/engines.py, made on every copy (module docstring)."""

    def __init__(self, o: Any, build: Any):
        import multiprocessing as mp
        from dataclasses import replace
        copies, tp = o.vllm_data_parallel_size, o.vllm_tensor_parallel_size
        gpus = _visible_gpus()
        if o.infer_backend == "vllm" and len(gpus) < copies * tp:
            raise UserError(f"--vllm_data_parallel_size {copies} x --vllm_tensor_parallel_size {tp}: vLLM needs "
                            f"{copies * tp} CUDA GPUs, {len(gpus)} visible (CUDA_VISIBLE_DEVICES); --infer_backend "
                            "transformers serves on CPUs")
        if o.infer_backend == "transformers" and gpus and len(gpus) < copies:
            raise UserError(f"--vllm_data_parallel_size {copies}: one GPU per copy, {len(gpus)} visible")
        per = tp if o.infer_backend == "vllm" else 1
        threads = None if gpus else max(1, (os.cpu_count() or 1) // copies)
        ctx = mp.get_context("spawn")     # a fresh interpreter per copy: CUDA is set up after its devices are
        one = replace(o, vllm_data_parallel_size=1)
        self.conns, self.procs = [], []
        saved = os.environ.get("CUDA_VISIBLE_DEVICES")
        try:
            for i in range(copies):
                if gpus:
                    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[i * per:(i + 1) * per])
                parent, child = ctx.Pipe()
                # not daemonic: vLLM starts processes of its own (its engine core, tensor-parallel workers),
                # which a daemonic process may not; a copy ends when its pipe closes (the server's exit)
                p = ctx.Process(target=_copy_main, args=(child, build, one, threads), name=f"swiftlite-rollout-copy-{i}")
                p.start()
                child.close()
                self.conns.append(parent)
                self.procs.append(p)
        finally:
            if saved is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved
        try:
            self._answers([self._recv(i) for i in range(copies)])
        except BaseException:
            self.shutdown()
            raise
        self.name, self.copies = o.infer_backend, copies
        self.sizes: list[int] | None = None

    def _recv(self, i: int) -> tuple[str, Any]:
        try:
            return self.conns[i].recv()
        except EOFError:
            return "error", f"its process ended (exit code {self.procs[i].exitcode})"

    def _answers(self, got: list[tuple[str, Any]]) -> list[Any]:
        bad = [f"copy {i}: {v}" for i, (kind, v) in enumerate(got) if kind == "error"]
        if bad:
            raise UserError("rollout engine " + "; ".join(bad))
        return [v for _, v in got]

    def _all(self, method: str, per_copy: list[tuple] | None = None) -> list[Any]:
        """`method` on every copy at once (each with its own arguments when given), their answers in order."""
        for i, c in enumerate(self.conns):
            c.send((method, per_copy[i] if per_copy is not None else ()))
        return self._answers([self._recv(i) for i in range(len(self.conns))])

    def info(self) -> dict[str, Any]:
        infos = self._all("info")
        self.sizes = [int(x["world_size"]) for x in infos]
        return {**infos[0], "world_size": sum(self.sizes), "data_parallel_size": len(infos)}

    def join(self, host: str, port: int, world_size: int, backend: str, timeout_s: float) -> None:
        if self.sizes is None:
            self.info()
        firsts = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        self._all("join", [(host, port, world_size, backend, timeout_s, f) for f in firsts])

    def receive(self, name: str, dtype: str, shape: list[int]) -> None:
        self._all("receive", [(name, dtype, shape)] * len(self.conns))

    def after_sync(self) -> None:
        self._all("after_sync")

    def _deal(self, method: str, items: list, *per_item: list, rest: tuple = ()) -> list:
        """`method` on contiguous shares of `items` (and of the lists aligned with them), one share per copy,
        the answers concatenated in order; `rest` goes to every copy as is."""
        n = len(self.conns)
        cuts = [len(items) * i // n for i in range(n + 1)]
        busy = [i for i in range(n) if cuts[i + 1] > cuts[i]]
        for i in busy:
            a, b = cuts[i], cuts[i + 1]
            self.conns[i].send((method, (items[a:b], *(x[a:b] for x in per_item), *rest)))
        out: list = []
        for part in self._answers([self._recv(i) for i in busy]):
            out.extend(part)
        return out

    def generate(self, groups: list[list[list[int]]], seeds: list[list[int]], s: Any) -> list[list[list[int]]]:
        return self._deal("generate", groups, seeds, rest=(s,))     # whole groups to a copy

    def prompt_logprobs(self, prompts: list[list[int]], k: int) -> list:
        return self._deal("prompt_logprobs", prompts, rest=(k,))

    def close(self) -> None:
        """Every copy leaves the weight-sync group (/close_communicator/)."""
        self._all("close")

    def shutdown(self) -> None:
        """The copies' processes stop (the server's exit)."""
        for c in self.conns:
            try:
                c.send(("stop", ()))
            except (BrokenPipeError, OSError):   # that copy has already ended
                pass
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
        self.conns, self.procs = [], []


__all__ = ["ReplicatedEngine"]
