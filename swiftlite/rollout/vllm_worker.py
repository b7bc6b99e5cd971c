"""The worker extension of a `swiftlite rollout --infer_backend vllm` engine (vllm.LLM's
`worker_extension_cls`): methods vLLM mixes into each of its workers and the server calls on all of
them with `collective_rpc`, as TRL's and ms-swift's rollout servers receive weights.

Each worker joins the weight-sync group (rlhf/weight_group.py) as its rank in vLLM's world (0 .. W-1,
one per tensor-parallel shard; plus the first rank of its data-parallel copy, rollout/replicas.py), receives every tensor the run broadcasts into a buffer on its device
(or on the CPU over gloo, then moved), and hands it to the model's own `load_weights`, which maps the
model class's parameter names onto vLLM's fused layers and keeps its shard of each.

Imported inside vLLM's worker processes only (vLLM imports it by name); nothing of it runs on a CPU.
"""

from __future__ import annotations

from typing import Any


class WeightReceiver:
    """Mixed into vLLM's GPU worker: `self.device` and `self.model_runner` are the worker's."""

    swiftlite_group: Any = None

    def swiftlite_join(self, host: str, port: int, world_size: int, backend: str, timeout_s: float,
                       first_rank: int = 0) -> None:
        from vllm.distributed.parallel_state import get_world_group

        from swiftlite.rlhf.weight_group import join
        self.swiftlite_leave()
        if backend == "nccl":
            import torch
            torch.cuda.set_device(self.device)
        self.swiftlite_group = join(host, port, first_rank + get_world_group().rank, world_size, backend=backend,
                                    timeout_s=timeout_s)

    def swiftlite_receive(self, name: str, dtype: str, shape: list[int]) -> None:
        import torch

        from swiftlite.rlhf.weight_group import dtype_of
        g = self.swiftlite_group
        if g is None:
            raise RuntimeError("a weight arrived before the run joined the weight-sync group")
        buf = torch.empty(shape, dtype=dtype_of(dtype), device=self.device if g.backend == "nccl" else "cpu")
        g.broadcast(buf)
        self.model_runner.model.load_weights(weights=[(name, buf.to(self.device))])

    def swiftlite_leave(self) -> None:
        if self.swiftlite_group is not None:
            self.swiftlite_group.close()
            self.swiftlite_group = None


__all__ = ["WeightReceiver"]
