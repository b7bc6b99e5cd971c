"""Which generator a run's sampling uses under --use_vllm true (GRPO's rounds, GKD's sampled steps): the client
of `swiftlite rollout` server(s) (rlhf/rollout_client.py, --vllm_mode server) or the colocated vLLM engine
(rlhf/vllm_gen.py, --vllm_mode colocate). A module of its own because each of those two imports the other's
helpers: the choice between them sits above both."""

from __future__ import annotations

from typing import Any


def build_generator(run: Any, *, per_device: int, steps_per_generation: int) -> Any:
    """The run's vLLM generator (--use_vllm true: GRPO, GKD), or None: a `swiftlite rollout` server's client
    (rlhf/rollout_client.ServerGenerator, --vllm_mode server) or a colocated engine (VllmGenerator, sized for
    `per_device` sequences per micro-batch x `steps_per_generation` micro-batches per call)."""
    from swiftlite.errors import UserError
    cfg, engine = run.cfg, run.engine
    o = cfg.rlhf
    if not o.use_vllm:
        return None
    if o.vllm_mode == "server":
        from swiftlite.rlhf.rollout_client import ServerGenerator
        return ServerGenerator(o, world=run.world)
    from swiftlite.models.loading import torch_dtype
    from swiftlite.rlhf.vllm_gen import VllmGenerator
    if o.offload_model:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
        if any(isinstance(m, (FSDPModule, FullyShardedDataParallel)) for m in engine.root().modules()):
            raise UserError("--offload_model: this run shards the policy with FSDP, whose parameters swiftlite "
                            "does not move to CPU; use --parallelism ddp or --deepspeed, or drop the flag")
    return VllmGenerator(o, dtype=str(torch_dtype(cfg.model.torch_dtype)).removeprefix("torch."), world=run.world,
                         per_device=per_device, steps_per_generation=steps_per_generation)


__all__ = ["build_generator"]
