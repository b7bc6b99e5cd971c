"""Bytes per GPU rank for a workload under a backend, split by component; docs/estimate.md has the
formulas and their limits.

    work = Workload(train_type="full", dtype="bf16", world_size=8, gpu_memory_bytes=80 * 10**9)
    est = estimate(shape, work, "fsdp")       # MemoryEstimate (bytes per GPU); a name or a Backend
    table = estimate_all(shape, work)         # {record name: MemoryEstimate}, the `estimate` table

Which formulas apply is the backend record's `memory_family` (parallel/base.py); what it shards is
its `shards`; whether it can train fp16 is its `loss_scaling`. The table's rows are the registered
records with `estimate` set and a family, so a backend registered at run time (an
`--external-plugins` file) is estimated with its family's numbers and no edit here.

Model-state accounting (Ψ = parameters, N = ranks sharing the states), what each backend holds:
  full, bf16/fp16 (fp32 master weights, 16-bit compute; docs/backends.md "Precision"):
    torch backends: fp32 params 4Ψ, fp32 grads 4Ψ (FSDP reduces in fp32; DDP's grads are the fp32
    params'), AdamW 8Ψ; DeepSpeed: 16-bit params 2Ψ, grads 2Ψ, optimizer 12Ψ (fp32 master + m + v)
  full, --pure-bf16: torch backends 2Ψ + 2Ψ + 4Ψ (bf16 m, v); DeepSpeed 2Ψ + 2Ψ + 6Ψ (its bf16
    "master" partition + bf16 m, v)
  full, fp32: params 4Ψ, grads 4Ψ, optimizer 8Ψ (exp_avg + exp_avg_sq; `step` scalars ignored);
    ZeRO adds its fp32 partition copy (optimizer 12Ψ)
  LoRA/QLoRA: frozen base in its storage form + adapters (params, grads, AdamW state); the adapters
    are fp32 except under DeepSpeed (16-bit + fp32 master) and fsdp1 --pure-bf16 (bf16); fsdp1 with
    master weights casts the frozen base to fp32 too (a unit flattens one dtype)
  each state is divided by N when the record's `shards` says so (zero2: grads + optimizer; zero3,
  fsdp, fsdp1: all three); the offload families move some of them to host memory (`_offload`:
  zero2_offload and zero3_offload_optimizer the gradients and the optimizer state, zero3_offload
  the weights too).
  Phases: the load phase (planner/load.py) and the transients of a step (planner/transients.py:
  DeepSpeed's gradient conversion in step(), autocast's weight copies) are in every estimate;
  `total` is the training peak, `peak` the larger of it and the load phase.
  Across nodes (see topology_state_bytes): hsdp is fsdp with N = its shard size (--hsdp-shard-size,
  default the GPUs per node); zero3pp is zero3 plus hpZ's secondary copy of the 16-bit weights,
  sharded over one node's P ranks (params / P more per rank; ZeRO++, Wang et al. 2023, section 3.1).
  Communication per link: planner/topology.py.

No torch at import time (the CLI imports this).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from swiftlite import dtypes
from swiftlite.models.tuners import WHOLE_MODEL_TUNERS
from swiftlite.config import TRAIN_TYPES
from swiftlite.errors import UserError
from swiftlite.parallel.loss import LOSS_IMPLS
from swiftlite.planner.backends import backend_record, table_backends
from swiftlite.planner.activations import (CHUNK_LOGIT_BYTES, LOGIT_BYTES,  # noqa: F401 (re-exported)
                                           activation_bytes, logit_bytes)
from swiftlite.planner.load import LoadPhase, load_phase
from swiftlite.planner.shape import ModelShape
from swiftlite.planner.states import (_base_bytes, _ceil_div, _frozen_elem,  # noqa: F401 (re-exported)
                                      _state_bytes_per_param, quantized_bytes, trainable_params,
                                      tuner_params)
from swiftlite.planner.transients import (autocast, autocast_copy_bytes, host_step_transient_bytes,
                                          step_transient_bytes)
from swiftlite.planner.topology import LinkBytes, hsdp_shard_size, split_by_link

if TYPE_CHECKING:
    from swiftlite.parallel.base import Backend

GiB = 2**30

#: ZeRO-3 prefetch bucket in units of h*h elements: ds_config.py fills DeepSpeed's "auto" sizes the
#: Hugging Face way (reduce_bucket_size = h*h, stage3_prefetch_bucket_size = 0.9*h*h). ZeRO-2's
#: allgather_bucket_size only chunks the gather into the existing 16-bit buffer: no extra memory.
ZERO3_PREFETCH_FACTOR = 0.9

#: ZeRO-3 keeps gathered parameters resident up to stage3_max_live_parameters (1e9 in
#: ds_configs/zero3*.json, DeepSpeed's default): measured on CPU (2 ranks, 24M-parameter Llama),
#: from the second step on a whole gathered copy of the model is alive at the memory peak, on top
#: of the partitions (torch.profiler memory events; it did not shrink with stage3_max_reuse_distance
#: or stage3_max_live_parameters set to 0 in that run, so the knob is modelled as the cap DeepSpeed
#: documents, not as a lever). For models above 1e9 parameters this is the usual ~2 GB in 16-bit.
ZERO3_MAX_LIVE_PARAMETERS = 10**9


# --------------------------------------------------------------------------------------------------
# Workload


def base_bits(train_type: str, quant_bits: int | None) -> int | None:
    """Bits of the bitsandbytes base: `quant_bits`, else 4 for qlora, else None.

    The rule RunConfig.quant_bits (config/schema.py) applies to run configs, repeated for Workloads built
    without one (the estimate command, bench, tests); workload_from_config passes the config's value.
    """
    if quant_bits is not None:
        return quant_bits
    return 4 if train_type == "qlora" else None


@dataclass(kw_only=True)
class Workload:
    """The run being planned: what is trained, how, and on which hardware.

    `gpu_memory_bytes` and `cpu_memory_bytes` (per node) may be None: estimates then carry no
    fits verdict, and CPU offload is not checked against RAM. Construction checks only what the
    formulas rely on (known train type and dtype, a 4/8-bit base only under LoRA, positive sizes);
    everything else about a run is config/rules.py's and the backend records' to check.
    """
    train_type: str = "full"
    dtype: str = "bf16"                  # --torch-dtype; bf16/fp16 mean 16-bit compute with fp32 master weights
    lora_rank: int = 8
    lora_targets: tuple[str, ...] = ("all-linear",)
    lora_dropout: float = 0.05           # > 0: peft keeps a dropped-out copy of every adapted input
    # BOFT's blocks, AdaLoRA's starting rank, Bone's rank (`adapter_params`): read for those train types only
    boft_block: tuple[int, int, int] = (4, 0, 1)   # --boft_block_size, --boft_block_num, --boft_n_butterfly_factor
    adalora_init_r: int = 12
    llamapro_blocks: int = 4             # --train_type llamapro: the inserted layers (the shape counts them)
    adapter_length: int = 128            # --train_type adapter: each Houlsby adapter's bottleneck width
    bone_rank: int = 4                             # --reft_rank
    quant_bits: int | None = None        # None, 4 (nf4) or 8 (LLM.int8); qlora implies 4; 1/2/3/4/8 with hqq
    double_quant: bool = True            # nf4 double quantization of the absmax constants
    quant_method: str = "bnb"            # bnb (bitsandbytes) or hqq: who quantizes the base (states.quantized_bytes)
    max_length: int = 2048
    micro_batch: int = 1
    sequence_parallel: int = 1           # --sequence_parallel_size: each rank holds 1/N of every sequence's
                                         # tokens (Ulysses, parallel/sequence.py); states are sharded as without
    gradient_checkpointing: bool = False
    flash_attention: bool = True         # SDPA/flash: no seq x seq attention matrix is kept
    world_size: int = 1
    gpus_per_node: int | None = None     # default: world_size (one node)
    gpu_memory_bytes: int | None = None
    cpu_memory_bytes: int | None = None  # per node
    overhead_bytes: int = GiB            # CUDA context + allocator slack; 0 when measuring tensors on CPU
    cpu: bool = False                    # tensors on CPU: dropout keeps a noise tensor in the compute
                                         # dtype (CUDA's fused dropout keeps a 1-byte mask)
    usable_fraction: float = 0.9         # a GPU "fits" when the total stays under this share of memory
    fsdp2_available: bool = True         # torch >= 2.4 (fully_shard)
    pure_bf16: bool = False              # --pure-bf16: bf16 params and optimizer state, no fp32 master
    loss_impl: str = "chunked"           # --loss-impl: chunked (no full logits), liger, cce or plain
    plain_logit_bytes: int = 0           # plain logits' bytes per token x vocab entry (0: LOGIT_BYTES; GKD's)
    loss_chunk_tokens: int = 0           # --loss-chunk-tokens (0: auto)
    tokens_per_micro_batch: int | None = None  # real tokens a padding-free micro-batch computes (None: the
                                               # max_length x micro_batch bound, what padded batches compute)
    hsdp_shard_size: int | None = None   # --hsdp-shard-size (None: gpus_per_node)
    sharded_loading: bool = True         # --sharded-loading: fsdp/hsdp/fsdp1 fill each rank's shards
    shard_file_bytes: int | None = None  # largest safetensors file of the checkpoint (None: unknown,
                                         # planner/load.py HF_SHARD_BYTES)
    reference: str = "none"              # rlhf DPO: "copy" (a frozen reference copy) or "none"
    teacher_params: int = 0              # GRPO/GKD --teacher_model's frozen copy (0: none, or the LoRA base)
    teacher_partitioned: bool = False    # --teacher_deepspeed of stage 3: the teacher sharded over all ranks
    reward_model_params: int = 0         # GRPO --reward_model: frozen, whole on every rank (rlhf/reward_model.py)
    judge_kv_elems: int = 0              # GRPO genrm judges: one scoring call's KV cache, in elements
    generation_length: int = 0           # GRPO: prompt + completion tokens a generated sequence reaches
                                         # (0: no generation); micro_batch sequences are generated at once
    whole_matrices: str = ""              # the flag of an optimizer that needs each matrix whole (--optim muon,
                                          # GaLore, ...): no sharding backend runs it
    side_batch: tuple[int, int] = (0, 0)  # another forward/backward of its own in each step, as (sequences,
                                          # tokens each): GRPO CHORD's expert SFT micro-batch; (0, 0): none

    def __post_init__(self) -> None:
        if dtypes.normalize(self.dtype) in dtypes.NAMES:
            self.dtype = dtypes.normalize(self.dtype)   # bfloat16 -> bf16; anything else is reported as given
        self.quant_bits = base_bits(self.train_type, self.quant_bits)
        if self.train_type in WHOLE_MODEL_TUNERS:   # llamapro copies loaded layers: FSDP's ranks load it whole
            self.sharded_loading = False
        if self.gpus_per_node is None:
            self.gpus_per_node = self.world_size
        problem = self._problem()
        if problem:
            raise UserError(problem)

    def _problem(self) -> str | None:
        if self.train_type not in TRAIN_TYPES:
            return f"--train-type {self.train_type!r}: choose from {', '.join(TRAIN_TYPES)}"
        if self.dtype not in dtypes.NAMES:
            return f"--torch-dtype {self.dtype!r}: choose from {', '.join(dtypes.NAMES)}"
        if self.quant_method == "hqq":
            if self.quant_bits not in (None, 1, 2, 3, 4, 8):
                return f"--quant-bits with --quant-method hqq must be 1, 2, 3, 4 or 8, got {self.quant_bits}"
        elif self.quant_bits not in (None, 4, 8):
            return f"--quant-bits must be 4 or 8, got {self.quant_bits}"
        if self.train_type == "full" and self.quant_bits is not None:
            return "--quant-bits needs --train-type lora/qlora (a quantized base cannot be trained in full)"
        for flag, v in (("--lora-rank", self.lora_rank), ("--max-length", self.max_length),
                        ("--batch-size", self.micro_batch), ("--gpus", self.world_size),
                        ("--sequence-parallel-size", self.sequence_parallel)):
            if not isinstance(v, int) or v <= 0:
                return f"{flag} must be a positive integer, got {v!r}"
        if self.world_size % self.sequence_parallel:
            return f"--sequence-parallel-size {self.sequence_parallel} does not divide a world of {self.world_size}"
        if self.gpus_per_node <= 0 or self.world_size % self.gpus_per_node:
            return f"--gpus {self.gpus_per_node} per node does not divide a world of {self.world_size}"
        for flag, v in (("--gpu-memory", self.gpu_memory_bytes), ("--cpu-memory", self.cpu_memory_bytes)):
            if v is not None and v <= 0:
                return f"{flag} must be > 0, got {v}"
        if self.shard_file_bytes is not None and self.shard_file_bytes <= 0:
            return f"shard_file_bytes must be > 0, got {self.shard_file_bytes}"
        if not 0 < self.usable_fraction <= 1:
            return f"usable_fraction must be in (0, 1], got {self.usable_fraction}"
        if self.loss_impl not in LOSS_IMPLS:
            return f"--loss-impl {self.loss_impl!r}: choose from {', '.join(LOSS_IMPLS)}"
        if not isinstance(self.loss_chunk_tokens, int) or self.loss_chunk_tokens < 0:
            return f"--loss-chunk-tokens must be >= 0 (0 = auto), got {self.loss_chunk_tokens!r}"
        return None

    @property
    def nnodes(self) -> int:
        """Nodes of the job: world_size / gpus_per_node."""
        return self.world_size // (self.gpus_per_node or self.world_size)

    @property
    def mixed(self) -> bool:
        """16-bit compute (bf16/fp16), with fp32 master weights unless `pure_bf16`."""
        return self.dtype in dtypes.HALF

    @property
    def master_weights(self) -> bool:
        """fp32 master weights and optimizer state next to 16-bit compute (optim.master_weights)."""
        return self.mixed and not self.pure_bf16

    @property
    def elem(self) -> int:
        """Bytes per element of params/grads/activations in the compute dtype."""
        return dtypes.BYTES[self.dtype]

    @property
    def peft(self) -> bool:
        from swiftlite.config.tuner_options import PEFT_TYPES
        return self.train_type in PEFT_TYPES

    def adapter_params(self, shape: ModelShape) -> int:
        """Trainable parameters of a tuner on a frozen base, per train type (planner/states.tuner_params)."""
        return tuner_params(shape, self)

    def trained_shape(self, shape: ModelShape) -> ModelShape:
        """The model this workload trains: `shape` itself, or for llamapro with its inserted layers."""
        return shape.expanded(self.llamapro_blocks) if self.train_type == "llamapro" else shape


# --------------------------------------------------------------------------------------------------
# Memory estimate


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU rank for one backend, by component and by phase.

    `total` is the training peak: the states, the reference copy and the overhead plus the larger
    of the forward/backward's activations + buffers and the optimizer step's transient (+ the
    reduce bucket). `load_*` is the load phase (planner/load.py); `peak` = max(total, load_gpu);
    `fits` needs the peak under the usable share of the GPU and, when --cpu-memory is known, the
    host RAM of loading and of offload under that share of the node's memory."""
    backend: str
    params: int
    grads: int
    optimizer: int
    activations: int
    temp_buffers: int       # all-gather / reduce-scatter / bucket memory the backend adds
    overhead: int           # CUDA context and allocator slack
    cpu_offloaded: int      # per rank, in CPU memory (zero3_offload)
    cpu_per_node: int       # cpu_offloaded * GPUs per node
    total: int
    fits: bool | None       # None when the GPU memory is unknown
    comm_bytes_per_step: int  # per rank, per micro-step (no gradient accumulation)
    gpu_memory_bytes: int | None
    available: bool = True
    note: str = ""          # why the backend cannot run this workload, when it cannot
    comm_intra_node_bytes: int = 0  # of comm_bytes_per_step: collectives inside one node (planner/topology.py)
    comm_inter_node_bytes: int = 0  # of comm_bytes_per_step: collectives whose group spans nodes
    reference: int = 0      # rlhf: the frozen reference copy (reference_bytes), in `total`
    generation: int = 0     # GRPO's generation round (generation_bytes: KV cache + gathered weights), in `total`
    step_transient: int = 0  # DeepSpeed's gradient conversion inside step() (planner/transients.py)
    load_method: str = ""   # how the weights are loaded (planner/load.py METHODS)
    load_gpu: int = 0       # per GPU while loading, overhead included
    load_host_per_rank: int = 0   # host RAM per process while loading
    load_host_per_node: int = 0   # host RAM per node while loading
    load_one_memory: int = 0      # the load phase when the device is the host (a CPU run, no overhead)
    peak: int = 0           # max(total, load_gpu)

    @property
    def used_fraction(self) -> float | None:
        """Share of the GPU's memory the estimate uses (None when the GPU is unknown)."""
        return self.peak / self.gpu_memory_bytes if self.gpu_memory_bytes else None


def model_state_bytes(shape: ModelShape, workload: Workload, backend: str | Backend) -> dict[str, int]:
    """Params, grads and optimizer state bytes per rank, before any CPU offload.

    With dtype fp32 these are exactly what torch holds (FSDP2 DTensor shards, DDP replicas, AdamW
    exp_avg/exp_avg_sq; `step` scalars ignored) when each sharded tensor splits evenly over N.
    Sharded values are rounded up (DeepSpeed pads partitions; FSDP gives low ranks the extra row).
    """
    rec = backend_record(backend)
    w = workload
    n = 1 if rec.memory_family == "single" else w.world_size
    if rec.memory_family == "hsdp":
        n = _sharding_ranks(w, rec.memory_family)
    shard_p, shard_g, shard_o = rec.shards
    p_b, g_b, o_b = _state_bytes_per_param(w, rec.memory_family)
    trainable = trainable_params(shape, w)
    frozen = 0
    if w.peft or w.train_type == "adapter":   # the whole base frozen (adapter: its modules are extra)
        n_other = shape.n_params - shape.n_linear_params
        frozen = _base_bytes(w, shape.n_linear_params, n_other, shape.linear_out_rows,
                             _frozen_elem(w, rec.memory_family))
    elif w.train_type == "llamapro":   # the base layers, embeddings and head stay frozen in --torch-dtype
        frozen = (shape.n_params - trainable) * _frozen_elem(w, rec.memory_family)

    def part(nbytes: int, sharded: bool) -> int:
        return _ceil_div(nbytes, n) if sharded else nbytes

    params = part(frozen + trainable * p_b, shard_p)
    if rec.memory_family == "zero3pp":
        params += _hpz_secondary_bytes(frozen + trainable * p_b, w)
    return {"params": params,
            "grads": part(trainable * g_b, shard_g),
            "optimizer": part(trainable * o_b, shard_o)}


# --- across nodes: hsdp and zero3pp (the families built on fsdp's and zero3's formulas) --------------

#: The family whose buffer and communication formulas another family uses (hsdp gathers per layer
#: as fsdp does; zero3pp gathers per module as zero3 does; the optimizer-only offload families keep
#: their stage's buckets and collectives, only the optimizer moves to the host).
OFFLOAD_STAGE = {"zero2_offload": "zero2", "zero3_offload_optimizer": "zero3"}
BASE_FAMILY = {"hsdp": "fsdp", "zero3pp": "zero3", **OFFLOAD_STAGE}


def _sharding_ranks(w: Workload, family: str) -> int:
    """Ranks sharing one copy of the states: hsdp's shard group (--hsdp-shard-size, default the GPUs
    per node; the copies are replicated across the world / shard-size groups)."""
    return hsdp_shard_size(w) if family == "hsdp" else w.world_size


def _hpz_secondary_bytes(param_bytes: int, w: Workload) -> int:
    """ZeRO++ hpZ's secondary partition: the 16-bit weights again, sharded over one node's ranks
    (zero_hpz_partition_size = GPUs per node), so the backward gathers stay inside the node. On one
    node DeepSpeed builds no secondary partition (it would equal the primary)."""
    per_node = int(w.gpus_per_node or w.world_size)
    if per_node >= w.world_size:
        return 0
    return _ceil_div(param_bytes, per_node)


def topology_problem(w: Workload, family: str) -> str:
    """Why a multi-node family cannot run this layout, or ""."""
    if family == "hsdp":
        shard = hsdp_shard_size(w)
        if shard < 1 or w.world_size % shard:
            return f"--hsdp-shard-size {shard} does not divide the {w.world_size} GPUs"
    return ""


def _gathered_layer_bytes(shape: ModelShape, w: Workload) -> int:
    """One decoder layer unsharded in its compute/storage form (what an all-gather materialises)."""
    n_other = shape.n_layer_params - shape.n_layer_linear_params
    base = _base_bytes(w, shape.n_layer_linear_params, n_other,
                       shape.linear_out_rows // max(1, shape.layers))
    tuned = w.peft or w.train_type == "adapter"   # (an adapter is a submodule of its layer's MLP)
    adapters = _ceil_div(w.adapter_params(shape), shape.layers) * w.elem if tuned else 0
    return base + adapters


def temp_buffer_bytes(shape: ModelShape, w: Workload, backend: str | Backend) -> int:
    """Communication buffers a backend adds on top of the model states (bytes per GPU), by family.

    ddp: no bucket copy: swiftlite's DDP uses gradient_as_bucket_view=True, so the gradients are
         views into DDP's buckets; with fp32 master weights, autocast's cached 16-bit weight copies
         (planner/transients.py autocast_copy_bytes). single: the same copies where they exceed the
         gradients, which do not exist yet during the forward.
    zero2: the reduce bucket (reduce_bucket_size = h*h elements, 16-bit); updated params are
         all-gathered into the existing 16-bit buffer.
    zero3 / zero3_offload: the gathered parameters DeepSpeed keeps live (the whole model in the
         compute dtype, up to stage3_max_live_parameters; see ZERO3_MAX_LIVE_PARAMETERS), or for a
         bitsandbytes base (never partitioned) the largest module gathered; + the prefetch bucket
         (0.9*h*h) + the reduce bucket (h*h).
    fsdp / fsdp1 (wrapped per decoder layer, then the root): the root unit (embeddings, final norm,
         lm_head) is one all-gather that stays unsharded for the whole backward (lm_head is used
         first, the embedding last), with its unsharded gradients for a full fine-tune; two decoder
         layers are unsharded at a time (current + prefetched), plus one layer's unsharded gradients.
    """
    family = backend_record(backend).memory_family
    family = BASE_FAMILY.get(family, family)
    e = w.elem
    trainable = trainable_params(shape, w)
    h2 = shape.hidden * shape.hidden
    if family in ("single", "ddp"):
        return autocast_copy_bytes(shape, w, family, model_state_bytes(shape, w, backend)["grads"])
    if family == "zero2":
        return min(h2, trainable) * e
    if family in ("zero3", "zero3_offload"):
        if w.quant_bits is not None:
            largest_linear = max((lin.in_features * lin.out_features for lin in shape.linears), default=0)
            gathered = max(shape.vocab * shape.hidden * e, quantized_bytes(largest_linear, w))
        else:
            gathered = max(shape.largest_module_params, min(shape.n_params, ZERO3_MAX_LIVE_PARAMETERS)) * e
        return gathered + int(ZERO3_PREFETCH_FACTOR * h2) * e + min(h2, trainable) * e
    if family in ("fsdp", "fsdp1"):
        root = shape.n_nonlayer_params * e
        root_grads = root if w.train_type == "full" else 0
        layer_grads = (shape.n_layer_params if w.train_type == "full"
                       else _ceil_div(w.adapter_params(shape), shape.layers)) * e
        return root + root_grads + 2 * _gathered_layer_bytes(shape, w) + layer_grads
    raise AssertionError(f"memory family {family!r} has no buffer formula")  # FAMILIES lists each


def comm_volumes(shape: ModelShape, w: Workload, family: str) -> tuple[float, float]:
    """(Ψ_g, Ψ_r) of planner/topology.py: bytes all-gathered per step (a full fine-tune: the parameters
    in the compute dtype; LoRA: the frozen base in its storage form + the adapters) and gradient
    bytes reduced (the trainable parameters in the dtype the backend reduces in: the torch backends'
    gradient dtype, fp32 under master weights; DeepSpeed's 16-bit model dtype)."""
    trainable = trainable_params(shape, w)
    if w.train_type in ("full", "llamapro"):   # llamapro's trained blocks are part of shape.n_params
        gathered = shape.n_params * w.elem
    else:
        gathered = (_base_bytes(w, shape.n_linear_params, shape.n_params - shape.n_linear_params,
                                shape.linear_out_rows) + trainable * w.elem)
    grad = w.elem if family.startswith("zero") else _state_bytes_per_param(w, family)[1]
    return float(gathered), float(trainable * grad)


def comm_per_link(shape: ModelShape, w: Workload, backend: str | Backend) -> LinkBytes:
    """Intra- and inter-node bytes each rank moves per optimizer step under `backend` (a record or a
    name): planner/topology.py's ring terms over this workload's volumes."""
    family = backend_record(backend).memory_family
    family = OFFLOAD_STAGE.get(family, family)   # their collectives are their stage's
    return split_by_link(family, w, *comm_volumes(shape, w, family))


def comm_bytes_per_step(shape: ModelShape, w: Workload, backend: str | Backend) -> int:
    """Bytes each rank moves per optimizer step in ring terms, both links together (the formulas, by
    family: planner/topology.py)."""
    return comm_per_link(shape, w, backend).total


def unavailable_reason(w: Workload, backend: str | Backend) -> str:
    """Why `backend` cannot run this workload, or "" when it can: fp16 without the record's
    `loss_scaling`, a bitsandbytes base under offload, FSDP2 without `fully_shard`. (The same rules
    the resolver and the records' checks apply to a run config.)"""
    rec = backend_record(backend)
    if w.train_type == "llamapro" and rec.memory_family not in ("single", "ddp", "fsdp", "hsdp"):
        return "--train_type llamapro runs on single, ddp, fsdp and hsdp (models/llamapro.backend_problem)"
    if w.train_type == "adapter" and rec.memory_family == "fsdp1":
        return "--train_type adapter runs on every backend but fsdp1 (models/adapter.backend_problem)"
    if w.dtype == "fp16" and not rec.loss_scaling:
        return "fp16 needs loss scaling, which only the DeepSpeed backends provide"
    if w.quant_bits is not None and w.quant_method == "hqq" and rec.shards[0]:
        return "an HQQ-quantized base runs on backends that keep parameters whole: single, ddp, zero1/zero2 (models/hqq.py)"
    if w.quant_bits is not None and rec.memory_family == "zero3_offload":
        return "DeepSpeed offload cannot move bitsandbytes-quantized weights"
    if w.whole_matrices and any(rec.shards):
        return f"{w.whole_matrices} needs each weight matrix whole: single or ddp (optim.optim_problem)"
    if rec.memory_family in ("fsdp", "hsdp") and not w.fsdp2_available:
        return "FSDP2 (fully_shard) needs torch >= 2.4"
    return topology_problem(w, rec.memory_family)


def _offload(states: dict[str, int], w: Workload, family: str) -> tuple[dict[str, int], int]:
    """(the states left on the GPU, bytes per rank in host memory) for the offload families.

    Measured from the tensors DeepSpeed 0.19 holds (tests/distributed/test_estimator_terms.py): its
    host-side Adam works on fp32 gradient partitions (4 bytes per parameter / N in host memory
    whatever the compute dtype), next to the fp32 master, m and v. ZeRO-2 with offload_optimizer
    keeps no gradient partition on the GPU (the 16-bit weights, 2Ψ, stay: DeepSpeed's estimator
    too). ZeRO-3's offload families also keep the 16-bit gradient partition buffer in host memory
    (`grad_partitions_flat_buffer` on the offload device: +2 bytes / N); zero3_offload moves the
    16-bit weight partitions there as well."""
    if family not in ("zero2_offload", "zero3_offload_optimizer", "zero3_offload"):
        return states, 0
    fp32_grads = states["grads"] * 4 // w.elem if w.mixed else states["grads"]
    cpu = fp32_grads + states["optimizer"]
    if family != "zero2_offload":
        cpu += states["grads"]   # the gradient partition buffer, in the compute dtype
    gpu_params = states["params"]
    if family == "zero3_offload":
        cpu, gpu_params = cpu + states["params"], 0
    return {"params": gpu_params, "grads": 0, "optimizer": 0}, cpu


def estimate(shape: ModelShape, workload: Workload, backend: str | Backend) -> MemoryEstimate:
    """Memory per GPU (and per node in CPU memory) for `backend` (a record, a name the registry
    knows, or a DeepSpeed .json file), by phase (load, forward/backward, optimizer step), with comm
    volume and a verdict; labelled with the record's name."""
    w = workload
    rec = backend_record(backend)
    family = rec.memory_family
    states, cpu = _offload(model_state_bytes(shape, w, rec), w, family)
    cpu += host_step_transient_bytes(shape, w, family)
    acts = activation_bytes(shape, w, autocast=autocast(w, family))
    if w.side_batch[0]:
        # a separate backward (CHORD's expert micro-batch, rlhf/grpo_step.py) frees the policy's
        # activations before it runs: the larger of the two is the peak
        side = dataclasses.replace(w, micro_batch=w.side_batch[0], max_length=w.side_batch[1],
                                   tokens_per_micro_batch=None, side_batch=(0, 0))
        acts = max(acts, activation_bytes(shape, side, autocast=autocast(w, family)))
    temp = temp_buffer_bytes(shape, w, rec)
    ref = reference_bytes(shape, w, rec)
    step = step_transient_bytes(shape, w, family)
    # The step runs after the backward has freed the activations and the gathered parameters; the
    # reduce bucket (h*h elements) stays allocated through it.
    bucket = min(shape.hidden * shape.hidden, trainable_params(shape, w)) * w.elem if step else 0
    gen = max(generation_bytes(shape, w, rec), w.judge_kv_elems * w.elem)   # a judge answers after the round
    base = sum(states.values()) + ref + w.overhead_bytes
    # GRPO's generation round runs before the round's forward/backward passes: its KV cache and
    # gathered weights are one more phase next to the backward's activations and the optimizer step
    total = base + max(acts + temp, step + bucket, gen)
    per_node = w.gpus_per_node or w.world_size
    cpu_node = cpu * per_node
    ranks = 1 if family in ("single", "ddp", "zero2", "zero2_offload") else _sharding_ranks(w, family)
    loading: LoadPhase = load_phase(shape, w, family, states["params"] if family != "zero3_offload"
                                    else model_state_bytes(shape, w, rec)["params"], ranks)
    load_gpu = loading.gpu + w.overhead_bytes
    peak = max(total, load_gpu)
    fits: bool | None = None
    if w.gpu_memory_bytes is not None:
        fits = peak <= w.usable_fraction * w.gpu_memory_bytes
        if w.cpu_memory_bytes is not None:
            fits = fits and max(cpu_node, loading.host_per_node) <= w.usable_fraction * w.cpu_memory_bytes
    note = unavailable_reason(w, rec)
    links = None if topology_problem(w, family) else comm_per_link(shape, w, rec)
    if rec.max_processes is not None and w.world_size > rec.max_processes:
        note = ("one process cannot use several GPUs" if rec.max_processes == 1
                else f"{rec.name} runs at most {rec.max_processes} processes")
    return MemoryEstimate(
        backend=rec.name, params=states["params"], grads=states["grads"], optimizer=states["optimizer"],
        activations=acts, temp_buffers=temp, overhead=w.overhead_bytes, cpu_offloaded=cpu,
        cpu_per_node=cpu_node, total=total, fits=fits if not note else False,
        comm_bytes_per_step=links.total if links else 0, gpu_memory_bytes=w.gpu_memory_bytes,
        available=not note, note=note, comm_intra_node_bytes=links.intra if links else 0,
        comm_inter_node_bytes=links.inter if links else 0, reference=ref, generation=gen, step_transient=step,
        load_method=loading.method, load_gpu=load_gpu, load_host_per_rank=loading.host_per_rank,
        load_host_per_node=loading.host_per_node, load_one_memory=loading.one_memory, peak=peak)


def reference_bytes(shape: ModelShape, w: Workload, backend: str | Backend) -> int:
    """DPO's frozen reference copy per rank (rlhf/frozen.py; 0 unless w.reference == "copy"), plus GRPO's
    frozen teacher (w.teacher_params): the weights in the compute dtype, no grads or optimizer state,
    laid out like the policy's parameters (sharded under fsdp/fsdp1/zero3, over a shard group under
    hsdp; a replica under single/ddp/ZeRO-1/2), and GRPO's reward models (w.reward_model_params), whole
    on every rank whatever the backend."""
    rec = backend_record(backend)
    n = 1 if rec.memory_family == "single" else _sharding_ranks(w, rec.memory_family)
    nbytes = shape.n_params * w.elem if w.reference == "copy" else 0
    ref = _ceil_div(nbytes, n) if rec.shards[0] else nbytes
    # GRPO's teacher (rlhf/teacher.py): a frozen copy of its own size, laid out the same way, or by a
    # --teacher_deepspeed of stage 3 partitioned over every rank
    teacher = w.teacher_params * w.elem
    if w.teacher_partitioned:
        teacher = _ceil_div(teacher, max(1, w.world_size))
    elif rec.shards[0]:
        teacher = _ceil_div(teacher, n)
    return ref + teacher + w.reward_model_params * w.elem


def kv_cache_bytes(shape: ModelShape, w: Workload) -> int:
    """GRPO's generation KV cache per rank (rlhf/generate.py: one `generate` call per micro-batch, the
    cache of transformers' DynamicCache): keys and values of every layer, 2 x layers x kv_heads x
    head_dim x (prompt + completion tokens) x micro_batch sequences x the compute dtype's bytes."""
    if not w.generation_length:
        return 0
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * w.generation_length * w.micro_batch * w.elem


def generation_bytes(shape: ModelShape, w: Workload, backend: str | Backend) -> int:
    """GRPO's generation round per rank: the KV cache plus what the backend gathers for the round
    (parallel/gather.py), in the compute dtype (a quantized base stays quantized): the whole weights on
    fsdp/hsdp/zero3 (the all-gather's output is a buffer of its own, next to the rank's shard), FSDP1's
    root unit and one decoder layer at a time on fsdp1; nothing on single/ddp/ZeRO-1/2 (whole weights
    already). 0 when w.generation_length is 0."""
    if not w.generation_length:
        return 0
    rec = backend_record(backend)
    family = BASE_FAMILY.get(rec.memory_family, rec.memory_family)
    gathered = 0
    if rec.shards[0] and family != "single":
        lin = shape.n_linear_params if w.quant_bits else 0
        whole = (quantized_bytes(lin, w) if lin else 0) + (shape.n_params - lin) * w.elem
        gathered = whole if family != "fsdp1" else \
            _ceil_div(whole * (shape.n_nonlayer_params + shape.n_layer_params), max(1, shape.n_params))
    return kv_cache_bytes(shape, w) + gathered


def estimate_all(shape: ModelShape, workload: Workload) -> dict[str, MemoryEstimate]:
    """Estimates for every row of the table (`table_backends`: the registered records with `estimate`
    set and a memory family; "single" stands in for "ddp" on a one-GPU world), by record name."""
    return {rec.name: estimate(shape, workload, rec) for rec in table_backends(workload.world_size)}


__all__ = ["CHUNK_LOGIT_BYTES", "GiB", "LOGIT_BYTES", "LOSS_IMPLS", "MemoryEstimate", "Workload", "activation_bytes",
           "base_bits", "logit_bytes",
           "BASE_FAMILY", "LinkBytes", "comm_bytes_per_step", "comm_per_link", "comm_volumes", "estimate",
           "estimate_all", "generation_bytes", "kv_cache_bytes", "model_state_bytes", "quantized_bytes", "reference_bytes",
           "temp_buffer_bytes", "topology_problem", "trainable_params", "unavailable_reason"]

