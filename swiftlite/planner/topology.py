"""Communication per optimizer step, split by link: within a node (NVLink, PCIe, shared memory) and
across nodes (InfiniBand, Ethernet), for each backend family; docs/backends.md "Across nodes".

    comm = comm_per_link(shape, work, "hsdp")    # planner/memory.py: LinkBytes(intra=..., inter=...)
    comm.total                                  # what MemoryEstimate.comm_bytes_per_step reports
    split_by_link("hsdp", work, gathered, reduced)   # here: the same from the two volumes

memory.py's `comm_per_link` works out the volumes (Ψ_g, Ψ_r below) from the model's shape and the
workload's precision and calls `split_by_link`; this module knows only the topology and the ring
terms, and imports nothing of the planner (memory.py imports it).

A job is `nnodes` x `P` ranks (Workload.world_size, Workload.gpus_per_node), numbered node-major
(rank // P is the node, as torchrun assigns them). Every collective runs in a process group; its
bytes per rank are ring terms over the G ranks of that group:

    all-gather      (G-1)/G x the gathered (output) bytes
    reduce-scatter  (G-1)/G x the reduced (input) bytes
    all-reduce      2(G-1)/G x the buffer bytes

A collective counts as inter-node when its group's ranks sit on more than one node: a ring is as
fast as its slowest hop, so all of its bytes move at the inter-node link's pace; a group inside one
node is intra-node. (These are the bytes each rank's collectives move, not the bytes on one wire:
the figures price a step as intra / intra-bandwidth + inter / inter-bandwidth.) bench/groups.py
counts the same two figures from a run's recorded collectives and their process groups.

Ψ_g = bytes gathered per step (a full fine-tune: the parameters in the compute dtype; LoRA: the
frozen base in its storage form + the adapters), Ψ_r = gradient bytes reduced (the trainable
parameters in the dtype the backend reduces in: fp32 for the torch backends under master weights,
the 16-bit dtype for DeepSpeed), W = world size, P = ranks per node, S = --hsdp-shard-size
(default P), R = W / S replicas. Per rank, per optimizer step (no gradient accumulation):

  ddp      all-reduce of the gradients over W:                    2(W-1)/W Ψ_r
  zero2    reduce-scatter of the gradients + all-gather of the
           updated 16-bit parameters over W:                      2(W-1)/W Ψ_r
  fsdp, fsdp1, zero3, zero3_offload
           all-gather forward + all-gather backward + reduce-
           scatter of the gradients, all over W:                  (W-1)/W (2Ψ_g + Ψ_r)
  hsdp     the same gathers and reduce-scatter within the shard
           group (S ranks), then an all-reduce of each gradient
           shard across the R replicas:                           (S-1)/S (2Ψ_g + Ψ_r) + 2(R-1)/R Ψ_r/S
  zero3pp  ZeRO++ hpZ: the forward all-gather from the global
           partition (W), the backward all-gathers from the
           secondary partition inside the node (P), the gradient
           reduce-scatter over W:                                 (W-1)/W (Ψ_g + Ψ_r) + (P-1)/P Ψ_g

On one node everything is intra-node (hsdp is then fsdp, zero3pp zero3). hsdp's shard group is
intra-node when S <= P (node-major ranks), its replica groups cross nodes whenever nnodes > 1;
zero3pp's secondary partition is one node's ranks. Not modelled: FSDP with reshard_after_forward
off (no backward gather), DeepSpeed keeping gathered parameters alive up to
stage3_max_live_parameters (a small model then skips the backward gathers: 2 terms, not 3), ZeRO++
qwZ/qgZ quantized communication, and the scalars of the loss and gradient-norm all-reduces.

No torch at import time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LinkBytes:
    """Bytes per rank per optimizer step, by the link the collective runs at."""
    intra: int
    inter: int

    @property
    def total(self) -> int:
        return self.intra + self.inter


def _ring(g: int) -> float:
    return (g - 1) / g if g > 1 else 0.0


def hsdp_shard_size(w: Any) -> int:
    """Ranks per hsdp shard group: Workload.hsdp_shard_size, else the GPUs per node (parallel/hsdp.py's rule)."""
    return int(w.hsdp_shard_size or w.gpus_per_node or w.world_size)


def group_crosses(ranks: "list[int] | tuple[int, ...]", per_node: int) -> bool:
    """Whether a process group with these global ranks spans more than one node (node = rank // per_node)."""
    return len({r // per_node for r in ranks}) > 1


def split_by_link(family: str, w: Any, gathered: float, reduced: float) -> LinkBytes:
    """Intra- and inter-node bytes per rank per optimizer step for a memory family, given the bytes
    gathered (Ψ_g) and the gradient bytes reduced (Ψ_r) per step; `w` is a planner Workload (its
    world_size, gpus_per_node and hsdp_shard_size are read)."""
    world = 1 if family == "single" else w.world_size
    if world == 1:
        return LinkBytes(0, 0)
    per_node = int(w.gpus_per_node or world)
    multi = world > per_node
    intra = inter = 0.0

    def add(nbytes: float, crosses: bool) -> None:
        nonlocal intra, inter
        if crosses:
            inter += nbytes
        else:
            intra += nbytes

    if family in ("ddp", "zero2"):
        # ddp: one all-reduce of the gradients; zero2: gradients reduce-scattered and the updated
        # 16-bit parameters all-gathered, the same bytes twice
        add(2 * _ring(world) * reduced, multi)
    elif family == "hsdp":
        shard = hsdp_shard_size(w)
        replicas = world // shard
        add(_ring(shard) * (2 * gathered + reduced), shard > per_node)
        add(2 * _ring(replicas) * reduced / shard, multi and replicas > 1)
    elif family == "zero3pp":
        hpz = per_node  # zero_hpz_partition_size: one node's processes (parallel/ds_config.py)
        add(_ring(world) * (gathered + reduced), multi)
        add(_ring(hpz) * gathered, False)
    else:  # fsdp, fsdp1, zero3, zero3_offload: everything over the whole world
        add(_ring(world) * (2 * gathered + reduced), multi)
    return LinkBytes(int(intra), int(inter))


__all__ = ["LinkBytes", "group_crosses", "hsdp_shard_size", "split_by_link"]
