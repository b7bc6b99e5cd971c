"""The load phase: what each GPU and each node's host RAM hold while the model is loaded, before the
first step (docs/estimate.md, "Loading"). planner/memory.py adds it to every estimate; a job whose
load does not fit does not fit.

    phase = load_phase(shape, w, "fsdp", resident=states["params"])   # LoadPhase (bytes)

How each family loads (models/ and parallel/ do the loading; this module counts it):
  fsdp, hsdp   sharded loading: the model is built on the meta device and `fully_shard`ed, then
               each rank copies only its own dim-0 rows of each tensor out of the safetensors files.
               GPU: its shard of the weights (1/N; hsdp: 1/S of its shard group) + one tensor's
               rows in transit. Host per rank: the pages of the open (memory-mapped) file it has
               touched, its rows of every tensor in that file, which stay mapped until the next
               file is opened (models/sharded.py keeps one file open): the largest shard file / N,
               or one tensor's rows where that is more.
               With a 4-bit base (QLoRA) each rank reads one whole 16-bit linear weight at a time,
               quantizes it and keeps its 1/N of the packed storage: GPU 1/N of the base + the
               largest linear whole in 16-bit; host per rank: the whole tensors it read, up to the
               largest shard file (or that weight where it is larger).
  fsdp1        built on meta; each FSDP unit (a decoder layer; the untied embeddings and lm_head
               are units of their own; the root: the final norm, and a tied embedding) is
               materialized whole, filled, then flattened and sharded: GPU 1/N of the weights + the
               largest unit whole; host per rank: the pages of the open file (every tensor read
               whole), the largest shard file, or the largest unit where that is more.
  single, ddp, zero2 (and zero2_offload)
               the whole model on every GPU (16-bit weights, or the 4-bit base). `from_pretrained`
               without a device map builds the model in host memory and the backend then moves it
               to the GPU: host per process = the whole model in --torch-dtype. A 4-bit base is
               loaded onto the GPU directly (transformers gives bitsandbytes the current device),
               one safetensors file at a time: host per process = the largest shard file. GPU
               transit: one tensor (the fp32 upcast of master weights, or one 16-bit linear being
               quantized).
  fsdp, hsdp, fsdp1 with sharded loading off (`--sharded-loading false`): as single, every rank
               holding the whole model before it is sharded.
  zero3, zero3pp, zero3_offload*
               `deepspeed.zero.Init` inside `from_pretrained`: each tensor is partitioned as it is
               created, so the GPU holds 1/N + one gathered tensor (offload: the partitions are in
               host memory, only the gathered tensor on the GPU); host per process = the largest
               shard file. A 4-bit base is partitioned like the rest (bnb_4bit_quant_storage = the
               compute dtype), with one 16-bit linear whole while it is quantized.
`resident` is what the rank holds once loaded: the params column of the estimate (its dtype and
sharding are the backend's: fp32 master shards under fsdp, the 16-bit module under ZeRO, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from swiftlite.planner.shape import ModelShape
from swiftlite.planner.states import _base_bytes, _ceil_div, _frozen_elem, _state_bytes_per_param

#: Largest safetensors file of a checkpoint whose files are unknown (a preset, a hub id): 5 GB, the
#: `max_shard_size` default of transformers 4.x's save_pretrained, which most hub checkpoints were
#: written with (transformers 5 raised its default to 50 GB; a local folder's real sizes are used
#: when known: `largest_shard_file`).
HF_SHARD_BYTES = 5 * 10**9

#: Bytes per element of a checkpoint file whose dtype is unknown: hub checkpoints are 16-bit.
FILE_ELEM_BYTES = 2

#: How each family loads, in the words the table prints (the module docstring says what each means).
METHODS = {
    "fsdp": "sharded reads", "hsdp": "sharded reads", "fsdp1": "unit by unit",
    "single": "whole model", "ddp": "whole model", "zero2": "whole model", "zero2_offload": "whole model",
    "zero3": "zero.Init", "zero3pp": "zero.Init", "zero3_offload": "zero.Init", "zero3_offload_optimizer": "zero.Init",
}

SHARDED_READS = ("fsdp", "hsdp")
WHOLE_MODEL = ("single", "ddp", "zero2", "zero2_offload")
ZERO_INIT = ("zero3", "zero3pp", "zero3_offload", "zero3_offload_optimizer")


@dataclass(frozen=True)
class LoadPhase:
    """Bytes while the model loads, per GPU rank and in host RAM.

    `gpu` excludes the CUDA overhead (memory.py adds it); `one_memory` is the same phase when the
    device is the host (a CPU run: the staged rows are what is copied into the shard, so staging
    and transit are one buffer, not two), which the CPU measurement (`load_peak`) compares with."""
    method: str
    resident: int          # the model as the rank holds it once loaded (on the GPU)
    transit: int           # the largest piece in flight on the GPU (a tensor's rows, a unit, a 16-bit linear)
    host_per_rank: int     # host RAM per process while loading (its resident set: private + shared pages)
    host_per_node: int     # processes per node x private + the file pages they all map, once
    host_copy: bool = True  # the host bytes are a copy beside the resident weights (False: the model
                            # built in host memory is what then moves to the GPU)

    @property
    def gpu(self) -> int:
        return self.resident + self.transit

    @property
    def one_memory(self) -> int:
        return self.resident + max(self.transit, self.host_per_rank if self.host_copy else 0)


def largest_shard_file(model: str | None) -> int | None:
    """Bytes of the largest *.safetensors file of a local model folder (stat only, nothing read), or
    None for a preset, a hub id or a folder without safetensors files."""
    if not model:
        return None
    path = Path(model).expanduser()
    if not path.is_dir():
        return None
    sizes = [f.stat().st_size for f in path.glob("*.safetensors") if f.is_file()]
    return max(sizes) if sizes else None


def _largest_linear(shape: ModelShape) -> int:
    return max((lin.in_features * lin.out_features for lin in shape.linears), default=0)


def _shard_file(shape: ModelShape, w: Any) -> int:
    """The largest file `from_pretrained` maps at once: the folder's real one, else HF's default
    shard size, or the whole checkpoint when it is smaller than that."""
    if w.shard_file_bytes is not None:
        return w.shard_file_bytes
    return min(HF_SHARD_BYTES, shape.n_params * FILE_ELEM_BYTES)


def _fsdp1_unit_bytes(shape: ModelShape, w: Any, family: str) -> tuple[int, int]:
    """(bytes on the GPU, bytes read from the file) of fsdp1's largest unit whole: the embedding or
    lm_head (units of their own when untied; with the final norm when tied; never quantized) or one
    decoder layer."""
    root = shape.vocab * shape.hidden + (shape.hidden if shape.tie else 0)
    layer = shape.n_layer_params
    read = max(root, layer) * w.elem
    if w.train_type == "full":
        per = _state_bytes_per_param(w, family)[0]
        return max(root, layer) * per, read
    elem = _frozen_elem(w, family)
    n_other = shape.n_layer_params - shape.n_layer_linear_params
    layer_bytes = _base_bytes(w, shape.n_layer_linear_params, n_other,
                              shape.linear_out_rows // max(1, shape.layers), elem)
    return max(root * elem, layer_bytes), read


def load_phase(shape: ModelShape, w: Any, family: str, resident: int, shard_ranks: int) -> LoadPhase:
    """The load phase of `family` (a memory family; the offload variants load as their base stage)
    for a rank that ends up holding `resident` bytes of weights on its GPU, with the weights split
    over `shard_ranks` ranks (N; hsdp's shard group S; 1 for the whole-model families)."""
    if family in (*SHARDED_READS, "fsdp1") and not w.sharded_loading:
        # the whole model on every rank first, then sharded: the weights as one process holds them
        return replace(load_phase(shape, w, "single", resident * shard_ranks, 1), method="whole, then sharded")
    e = w.elem                               # a tensor is read in the run's dtype (--torch-dtype)
    largest = shape.largest_module_params
    linear16 = _largest_linear(shape) * 2    # bitsandbytes quantizes from the 16-bit weight
    quant = w.quant_bits is not None
    per_node = int(w.gpus_per_node or w.world_size)
    # `host` is private to each process; `shared` are pages of the open file that every process of
    # the node maps (all of them read the same tensors whole): the page cache holds them once.
    shared = 0
    if family in SHARDED_READS:
        if quant:
            transit, host, shared = linear16, linear16, _shard_file(shape, w)
        else:
            # each rank touches its own rows of every tensor of the open file: distinct pages
            transit = _ceil_div(largest * e, shard_ranks)
            host = max(transit, _ceil_div(_shard_file(shape, w), shard_ranks))
    elif family == "fsdp1":
        transit, host = _fsdp1_unit_bytes(shape, w, family)
        shared = _shard_file(shape, w)
    elif family in WHOLE_MODEL:
        host = _shard_file(shape, w) if quant else shape.n_params * e
        # Master weights are upcast to fp32 one tensor at a time; a 4-bit base quantizes one 16-bit
        # linear at a time: either way one tensor beside the resident model.
        transit = linear16 if quant else largest * e
    elif family in ZERO_INIT:
        host = _shard_file(shape, w)
        transit = max(largest * e, linear16 if quant else 0)
    else:
        raise AssertionError(f"memory family {family!r} has no load formula")
    if family == "zero3_offload":
        # offload_param: the partitions are created in host memory, next to the mapped file
        host, resident = host + resident, 0
    return LoadPhase(method=METHODS[family], resident=resident, transit=transit, host_per_rank=host + shared,
                     host_per_node=host * per_node + shared, host_copy=not (family in WHOLE_MODEL and not quant))


__all__ = ["FILE_ELEM_BYTES", "HF_SHARD_BYTES", "LoadPhase", "METHODS", "largest_shard_file", "load_phase"]
