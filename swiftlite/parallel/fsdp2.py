"""FSDP2: `fully_shard` on the embeddings, each decoder layer and lm_head, then the root (torchtitan's order).

Parameters become DTensors sharded on dim 0, so each rank holds 1/N of parameters, gradients and
AdamW state. With --torch-dtype bf16 the sharded parameters, their gradients and the AdamW state are
fp32 (master weights: the trainable parameters are upcast before sharding) and `MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)` all-gathers them in bf16 for compute and reduce-scatters gradients in fp32
(torchtitan's setup). --pure-bf16 shards the bf16 parameters themselves (docs/backends.md, "Precision").

The knobs for scale (docs/backends.md, "FSDP2 knobs for scale"), shared with hsdp (parallel/hsdp.py):
--reshard-after-forward true/false or a group size (fully_shard's own int: partial resharding),
--forward-prefetch / --backward-prefetch (explicit prefetch depth, torchtitan's wiring) and
--cpu-offload (CPUOffloadPolicy, GPU runs only). Each is refused where it would be ignored.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from swiftlite import dtypes
from swiftlite.errors import UserError
from swiftlite.parallel.base import Backend, FrozenModel, register_backend

if TYPE_CHECKING:
    import torch

    from swiftlite.distributed import World
    from swiftlite.parallel.torch_engine import TorchEngine

#: What FSDP1 and FSDP2 both honour; FSDP2 (fsdp, hsdp) adds partial resharding and prefetch depth.
FSDP_OPTIONS = frozenset({"mixed_precision", "cpu_offload", "reshard_after_forward"})
FSDP2_OPTIONS = FSDP_OPTIONS | {"forward_prefetch", "backward_prefetch"}


def reshard_after_forward(cfg: Any) -> bool | int:
    """--reshard-after-forward as fully_shard takes it: True (the default), False, or a group size."""
    value = cfg.parallel.reshard_after_forward
    if value is None or value == "true":
        return True
    if value == "false":
        return False
    return int(value)


def check_reshard_size(cfg: Any, shard_group: int, *, backend: str) -> str | None:
    """An int --reshard-after-forward must be a divisor of the shard group strictly between 1 and its
    size: FSDP2 would quietly turn 1 into false and the group size into true (_get_post_forward_mesh_info)."""
    n = reshard_after_forward(cfg)
    if isinstance(n, bool):
        return None
    if n >= shard_group or shard_group % n:
        sizes = [d for d in range(2, shard_group) if shard_group % d == 0]
        some = (f"give one of {', '.join(map(str, sizes))}" if sizes
                else f"{shard_group} ranks have no such group")
        return (f"--reshard-after-forward {n}: with --parallelism {backend} each parameter is sharded over "
                f"{shard_group} ranks, and a partial reshard group must divide that and be smaller; {some}, or "
                "use true (reshard over all of them) / false (keep gathered)")
    return None


#: FSDP-only options that a one-process run (which runs as `single`, unwrapped) would ignore.
ONE_PROCESS_IGNORED = ("reshard_after_forward", "forward_prefetch", "backward_prefetch", "cpu_offload",
                       "hsdp_shard_size")


def check_one_process(cfg: Any, world_size: int, *, backend: str) -> str | None:
    """On one process fsdp/hsdp/fsdp1 run as `single` (nothing to shard): an FSDP knob would be
    accepted and ignored there, so it is refused."""
    if world_size != 1:
        return None
    from swiftlite.parallel.base import OPTION_FLAGS
    for key in ONE_PROCESS_IGNORED:
        if getattr(cfg.parallel, key, None) not in (None, False):
            return (f"{OPTION_FLAGS[key]}: --parallelism {backend} on one process runs as single (nothing to "
                    f"shard), which does not use it; drop it, or start 2 or more processes (--nproc-per-node)")
    return None


def _check_fsdp2_knobs(cfg: Any, world_size: int, choice: Any = None) -> str | None:
    return check_one_process(cfg, world_size, backend="fsdp") or check_reshard_size(cfg, world_size, backend="fsdp")


def compute_precision(cfg: Any) -> str:
    """FSDP's compute dtype: --mixed-precision, default the 16-bit --torch-dtype ("none" for fp32)."""
    mp = cfg.parallel.mixed_precision
    if mp is None:
        mp = cfg.model.torch_dtype if cfg.model.torch_dtype in dtypes.HALF else "none"
    return mp


def mixed_precision_dtypes(cfg: Any) -> "tuple[torch.dtype, torch.dtype] | None":
    """(param_dtype, reduce_dtype) for FSDP mixed precision, or None for none (compute in the
    parameters' own dtype)."""
    import torch
    mp = compute_precision(cfg)
    if mp == "none":
        return None
    return (dtypes.torch_dtype(mp), torch.float32)


def check_precision(cfg: Any, world_size: int, choice: Any = None) -> str | None:
    """--pure-bf16 needs bf16; --mixed-precision none next to fp32 master weights would compute in fp32."""
    from swiftlite.optim import master_weights, precision_problem
    problem = precision_problem(cfg)
    if problem:
        return problem
    if cfg.parallel.mixed_precision == "none" and master_weights(cfg):
        return (f"--mixed-precision none with --torch-dtype {cfg.model.torch_dtype}: the parameters are fp32 master "
                "weights, so FSDP would compute in fp32 too; use --torch-dtype fp32 for fp32 training, or add "
                "--pure-bf16 to train bf16 parameters with bf16 gradient reduction")
    return None


def refuse_cpu_offload_without_gpu(cfg: Any, world: "World") -> None:
    """Shared by fsdp and fsdp1: offload moves parameters off a GPU; on a CPU run it would be a no-op."""
    if cfg.parallel.cpu_offload and world.device_type != "cuda":
        raise UserError("--cpu-offload moves parameters from the GPU to the CPU; this run has no GPU "
                        "(everything is on the CPU already): drop --cpu-offload")


def check_cpu_offload(cfg: Any, world_size: int, choice: Any = None, *, cuda: bool | None = None) -> str | None:
    """Before launch: --cpu-offload (FSDP2's CPUOffloadPolicy, FSDP1's CPUOffload) needs a GPU to
    offload from; the factories refuse it again in the rank (refuse_cpu_offload_without_gpu)."""
    if not cfg.parallel.cpu_offload:
        return None
    if cuda is None:
        import torch
        cuda = torch.cuda.is_available()
    if cuda:
        return None
    return ("--cpu-offload moves parameters from the GPU to the CPU; this run has no GPU (everything is on the "
            "CPU already): drop --cpu-offload")


def check_quantized_base(cfg: Any, world_size: int, choice: Any = None) -> str | None:
    """FSDP (both versions) and a bitsandbytes base."""
    bits = cfg.quant_bits
    shown = cfg.parallel.parallelism
    if bits == 8:
        return (f"--quant-bits 8 with --parallelism {shown}: FSDP re-wraps every parameter as a "
                "plain tensor and the 8-bit (LLM.int8) weights lose their scales (CB/SCB); use --qlora (4-bit) "
                "with FSDP, or 8-bit with zero2/zero3")
    mp = cfg.parallel.mixed_precision
    if bits == 4 and mp not in (None, "none") and mp != cfg.model.torch_dtype:
        return (f"--mixed-precision {mp} with a 4-bit base stored as {cfg.model.torch_dtype}: FSDP would cast the "
                f"packed 4-bit weights to {mp} and scramble them (their storage dtype follows --torch-dtype); "
                f"use --torch-dtype {mp} without --mixed-precision")
    return None


def apply_fsdp2(model: "torch.nn.Module", mesh: Any, *, mp: tuple | None, reshard_after_forward: bool | int,
                cpu_offload: bool, forward_prefetch: int | None = None,
                backward_prefetch: int | None = None) -> "torch.nn.Module":
    """Shard each decoder layer, then the root module (embeddings, norm, head). A 2-D mesh
    (replicate, shard) makes it HSDP. `reshard_after_forward` as an int reshards each layer to groups
    of that many ranks after forward (FSDP2 builds that smaller mesh itself). The prefetch depths set
    explicit all-gather prefetching N layers ahead, as torchtitan does; None keeps FSDP2's implicit
    one-layer overlap."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    from swiftlite.models.loading import decoder_layers
    kw: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp is not None:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=mp[0], reduce_dtype=mp[1])
    if cpu_offload:
        kw["offload_policy"] = CPUOffloadPolicy()
    layers = list(decoder_layers(model))
    # Untied embeddings and lm_head are units of their own (torchtitan's layout): the embedding is
    # gathered for its forward only, and lm_head only around the loss, instead of both for the whole
    # forward as parts of the root. lm_head stays gathered after its forward: backward needs it
    # first. Tied ones share one parameter, which must live in one unit: the root.
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = emb is None or head is None or getattr(emb, "weight", None) is getattr(head, "weight", None)
    if not tied:
        fully_shard(emb, **(kw | {"reshard_after_forward": bool(reshard_after_forward)}))
    for layer in layers:
        fully_shard(layer, **kw)
    if not tied:
        fully_shard(head, **(kw | {"reshard_after_forward": False}))
    # The root keeps what is left (the final norm, tied embeddings), which backward needs first:
    # resharding it to a sub-group would only add an all-gather, so an int applies to the decoder
    # layers alone.
    fully_shard(model, **(kw | {"reshard_after_forward": bool(reshard_after_forward)}))
    set_prefetch(model, layers, forward=forward_prefetch, backward=backward_prefetch)
    return model


def set_prefetch(root: Any, layers: list, *, forward: int | None, backward: int | None) -> None:
    """Explicit prefetching, N layers deep: in forward each layer (the root for the first) starts the
    all-gathers of the next N; in backward, of the N before it in reverse order."""
    if forward:
        if layers:
            root.set_modules_to_forward_prefetch(layers[:forward])
        for i, layer in enumerate(layers):
            ahead = layers[i + 1:i + 1 + forward]
            if ahead:
                layer.set_modules_to_forward_prefetch(ahead)
    if backward:
        for i, layer in enumerate(layers):
            behind = layers[max(0, i - backward):i][::-1]
            if behind:
                layer.set_modules_to_backward_prefetch(behind)


def fsdp2_kwargs(cfg: Any) -> dict[str, Any]:
    """apply_fsdp2's keyword arguments from the run config (fsdp and hsdp alike)."""
    p = cfg.parallel
    return {"mp": mixed_precision_dtypes(cfg), "reshard_after_forward": reshard_after_forward(cfg),
            "cpu_offload": p.cpu_offload, "forward_prefetch": p.forward_prefetch,
            "backward_prefetch": p.backward_prefetch}


def fsdp2_engine(model: "torch.nn.Module", cfg: Any, world: "World", total_steps: int,
                 mesh_shape: tuple[int, ...], mesh_dim_names: tuple[str, ...] | None = None) -> "TorchEngine":
    """Upcast the trainable parameters (master weights), shard the model on a device mesh of
    `mesh_shape` (1-D: fsdp; 2-D (replicate, shard): hsdp) and wrap it in the torch engine."""
    from torch.distributed.device_mesh import init_device_mesh

    from swiftlite.models.sharded import deferred, materialize
    from swiftlite.optim import master_weights, upcast_trainable
    from swiftlite.parallel.torch_engine import TorchEngine
    refuse_cpu_offload_without_gpu(cfg, world)
    if master_weights(cfg):
        upcast_trainable(model)  # fp32 shards of every trainable parameter (frozen ones keep their dtype)
    device_type = world.device_type
    skeleton = deferred(model) is not None   # sharded loading: the weights arrive after fully_shard
    if not cfg.parallel.cpu_offload and not skeleton:
        model = model.to(world.device)
    mesh = init_device_mesh(device_type, mesh_shape, mesh_dim_names=mesh_dim_names)
    apply_fsdp2(model, mesh, **fsdp2_kwargs(cfg))
    if skeleton:
        # each rank fills only its own shards (CPUOffloadPolicy keeps them on the CPU)
        materialize(model, "cpu" if cfg.parallel.cpu_offload else world.device)

    def sync(last: bool):
        # Reduce-scatter (and, on a 2-D mesh, the all-reduce across replicas) only at the end of an
        # accumulation window (grads accumulate unsharded in between, as with DDP's no_sync).
        model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()
    return TorchEngine(model, cfg, world, total_steps, no_sync=sync)


def fsdp2(model: "torch.nn.Module", cfg: Any, world: "World", total_steps: int, choice: Any = None) -> "TorchEngine":
    return fsdp2_engine(model, cfg, world, total_steps, (world.world_size,))


def policy_mesh(root: Any) -> Any:
    """The device mesh FSDP2 sharded the policy on (every sharded parameter is a DTensor on it)."""
    for p in root.parameters():
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None:
            return mesh
    raise UserError("rlhf: the policy is an FSDP2 module without sharded parameters (internal)")


def frozen_on_mesh(model: "torch.nn.Module", cfg: Any, world: "World", mesh: Any) -> FrozenModel:
    """A frozen copy sharded as `apply_fsdp2` shards the policy, on `mesh` (fsdp's 1-D, hsdp's 2-D),
    resharded after forward; no optimizer, no gradient sync."""
    if not cfg.parallel.cpu_offload:
        model = model.to(world.device)
    apply_fsdp2(model, mesh, mp=mixed_precision_dtypes(cfg), reshard_after_forward=True,
                cpu_offload=cfg.parallel.cpu_offload)
    return FrozenModel(model, contextlib.nullcontext, layout=f"FSDP2 on the policy's {mesh.ndim}-D device mesh")


def frozen_fsdp2(model: "torch.nn.Module", cfg: Any, world: "World", engine: Any, choice: Any = None) -> FrozenModel:
    """DPO's frozen reference copy (`Backend.frozen_copy`): fully_shard per decoder layer and the root
    on the policy's own mesh."""
    return frozen_on_mesh(model, cfg, world, policy_mesh(engine.root()))


register_backend(Backend(
    name="fsdp", engine="fsdp", factory=fsdp2, aliases=("fsdp2",), one_process="single",
    shards=(True, True, True), memory_family="fsdp", options=FSDP2_OPTIONS, loading="sharded",
    frozen_copy=frozen_fsdp2,
    checks=(check_quantized_base, check_precision, _check_fsdp2_knobs, check_cpu_offload),
    summary="FSDP2 (fully_shard per decoder layer): params, grads and optimizer state sharded"))
