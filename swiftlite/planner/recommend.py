"""Which backend to use: an ordered rule table over the memory estimates, and `--parallelism auto`.

    decision = recommend(shape, workload)        # Decision(backend, reason, table, shape, workload)
    decision = resolve_auto(cfg, world_size, gpu_memory_bytes)   # what `--parallelism auto` runs

`Decision.backend` is a record name of the backend registry (parallel/base.py), or "none" when
nothing fits; parallel/resolve.py maps it to the record. The rules name the built-in records; a
record registered at run time is estimated (it appears in `Decision.table`) but is chosen only by a
rule that names it. docs/estimate.md lists the rules.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from swiftlite.errors import UserError
from swiftlite.models.source import resolve_model
from swiftlite.planner.activations import GKD_LOGIT_BYTES
from swiftlite.planner.load import largest_shard_file
from swiftlite.planner.memory import GiB, MemoryEstimate, Workload, estimate_all
from swiftlite.planner.shape import ModelShape

if TYPE_CHECKING:
    from swiftlite.config import RunConfig


def fmt_gb(nbytes: float) -> str:
    """Bytes as GiB with one decimal (the unit `estimate` prints)."""
    return f"{nbytes / GiB:.1f} GiB"


@dataclass(frozen=True)
class Decision:
    """The backend to use (or "none"), why, and the per-backend estimates behind it."""
    backend: str
    reason: str
    table: dict[str, MemoryEstimate] = field(default_factory=dict)
    shape: ModelShape | None = None
    workload: Workload | None = None
    named: bool = False     # the user named the backend (estimate --parallelism): a verdict, not a choice

    def to_dict(self) -> dict:
        """Plain data (for --json output and logs)."""
        return asdict(self)


@dataclass(frozen=True)
class Rule:
    """One line of the decision table: pick `backend` when it applies and its total stays under
    `limit` of the GPU's memory. `reason` is formatted with the estimate's numbers."""
    backend: str
    applies: Callable[[Workload], bool]
    limit: float | None     # share of GPU memory; None: the workload's usable_fraction
    reason: str


#: Ordered: the first rule whose backend is available, applies and fits wins. Cheaper communication
#: first; sharding only when needed (across nodes: within a node first); offload (slow: PCIe every
#: step) only when nothing else fits.
ROOM = 0.8
RULES: tuple[Rule, ...] = (
    Rule("single", lambda w: w.world_size == 1, None,
         "one GPU holds the whole run ({used} of {gpu}); no communication"),
    Rule("ddp", lambda w: w.world_size > 1, ROOM,
         "fits on every GPU with room ({used} of {gpu}); no sharding communication, only a gradient "
         "all-reduce ({comm}/step)"),
    # fp16 rules out the torch backends (no loss scaling); ZeRO-2 is DeepSpeed's closest to DDP.
    Rule("zero2", lambda w: w.dtype == "fp16", ROOM,
         "fits on every GPU with room ({used} of {gpu}); fp16 needs DeepSpeed's loss scaling, and ZeRO-2 "
         "only shards grads and optimizer state"),
    # Across nodes, when one node's shards hold the model: HSDP keeps the parameter gathers and
    # reduce-scatters inside the node and sends only an all-reduce of 1/P of the gradients across
    # (planner/topology.py); ZeRO++'s hpZ keeps the backward gathers inside the node.
    Rule("hsdp", lambda w: w.nnodes > 1, None,
         "across {nodes} nodes one node's {per_node} GPUs hold the sharded states ({used} of {gpu}); HSDP "
         "keeps the gathers and reduce-scatters inside the node: {inter}/step crosses nodes ({inter_fsdp} "
         "with fsdp), {intra}/step within"),
    Rule("zero3pp", lambda w: w.nnodes > 1, None,
         "{hsdp_status}; ZeRO++ (hpZ) shards over all {n} GPUs and keeps a secondary copy of the weights "
         "per node ({used} of {gpu}): {inter}/step crosses nodes ({inter_zero3} with zero3), {intra}/step within"),
    Rule("fsdp", lambda w: w.world_size > 1, None,
         "a full replica does not fit with room (on the GPU, or in host RAM while every process loads "
         "it); FSDP2 shards params, grads and optimizer state over {n} GPUs ({used} of {gpu}; {comm}/step)"),
    # Reached when FSDP2 is unavailable (fp16, old torch) or its larger gather units (two layers
    # plus the unsharded root) do not fit: ZeRO-3 shards the same states in smaller pieces.
    Rule("zero3", lambda w: w.world_size > 1, None,
         "{fsdp_status}; DeepSpeed ZeRO-3 shards params, grads and optimizer state over {n} GPUs and "
         "gathers one module at a time ({used} of {gpu}; {comm}/step)"),
    Rule("zero3_offload", lambda w: True, None,
         "only offload fits: params, grads and optimizer state move to CPU memory ({cpu}/node{cpu_check}); "
         "GPUs hold {used} of {gpu}; expect PCIe-bound steps"),
)


def _reason(rule: Rule, est: MemoryEstimate, w: Workload, table: dict[str, MemoryEstimate]) -> str:
    cpu_check = "" if w.cpu_memory_bytes is not None else ", not checked: pass --cpu-memory"
    fsdp = table.get("fsdp")
    if fsdp is None or not fsdp.available:
        fsdp_status = f"fsdp is out ({fsdp.note if fsdp else 'not estimated'})"
    else:
        fsdp_status = f"fsdp does not fit ({fmt_gb(fsdp.peak)} with its root and two layers unsharded)"
    hsdp = table.get("hsdp")
    if hsdp is None or not hsdp.available:
        hsdp_status = f"hsdp is out ({hsdp.note if hsdp else 'not estimated'})"
    else:
        hsdp_status = f"hsdp does not fit ({fmt_gb(hsdp.peak)}: states sharded over one node only)"

    def inter(name: str) -> str:
        other = table.get(name)
        return fmt_gb(other.comm_inter_node_bytes) if other is not None else "?"
    return f"{est.backend}: " + rule.reason.format(
        used=fmt_gb(est.peak), gpu=fmt_gb(est.gpu_memory_bytes or 0), n=w.world_size,
        comm=fmt_gb(est.comm_bytes_per_step), cpu=fmt_gb(est.cpu_per_node), cpu_check=cpu_check,
        fsdp_status=fsdp_status, hsdp_status=hsdp_status, nodes=w.nnodes, per_node=w.gpus_per_node,
        inter=fmt_gb(est.comm_inter_node_bytes), intra=fmt_gb(est.comm_intra_node_bytes),
        inter_fsdp=inter("fsdp"), inter_zero3=inter("zero3"))


def recommend(shape: ModelShape, workload: Workload, rules: tuple[Rule, ...] = RULES) -> Decision:
    """The first rule of `rules` whose backend fits; "none" with the smallest requirement otherwise."""
    w = workload
    if w.gpu_memory_bytes is None:
        raise UserError("--gpu-memory is needed to recommend a backend")
    table = estimate_all(shape, w)
    for rule in rules:
        est = table.get(rule.backend)
        if est is None or not est.available or not rule.applies(w):
            continue
        # est.fits covers the usable share of the GPU and, for offload, the CPU memory per node.
        limit = w.usable_fraction if rule.limit is None else rule.limit
        # The peak is the larger of training and loading: a job that fails at load does not fit.
        if est.fits and est.peak <= limit * w.gpu_memory_bytes:
            return Decision(rule.backend, _reason(rule, est, w, table), table, shape, w)
    return Decision("none", _nothing_fits(table, w), table, shape, w)


def assess(shape: ModelShape, workload: Workload, backend: str) -> Decision:
    """The verdict for one backend the user named (`estimate --parallelism NAME`: a record name or
    alias, or a DeepSpeed .json file): its estimate as the only row, `backend` its name when it fits,
    "none" otherwise, with the phase that does not fit in the reason."""
    from swiftlite.planner.memory import estimate
    w = workload
    if w.gpu_memory_bytes is None:
        raise UserError("--gpu-memory is needed to say whether a backend fits")
    est = estimate(shape, w, backend)
    table = {est.backend: est}
    gpu = fmt_gb(w.gpu_memory_bytes)
    if not est.available:
        return Decision("none", f"{est.backend} cannot run this: {est.note}", table, shape, w, named=True)
    phases = f"load {fmt_gb(est.load_gpu)}, training {fmt_gb(est.total)} per GPU"
    if est.fits:
        return Decision(est.backend, f"{est.backend} fits: {phases} of {gpu}", table, shape, w, named=True)
    usable = w.usable_fraction * w.gpu_memory_bytes
    if est.peak > usable:
        where = "while loading" if est.load_gpu > est.total else "while training"
        why = f"needs {fmt_gb(est.peak)} per GPU {where} ({phases}; {fmt_gb(usable)} usable of {gpu})"
    else:
        host = max(est.cpu_per_node, est.load_host_per_node)
        why = (f"needs {fmt_gb(host)} of CPU memory per node (have {fmt_gb(w.cpu_memory_bytes or 0)}; "
               f"{fmt_gb(est.load_host_per_node)} while loading, {fmt_gb(est.cpu_per_node)} offloaded)")
    return Decision("none", f"{est.backend} does not fit: {why}", table, shape, w, named=True)


def _nothing_fits(table: dict[str, MemoryEstimate], w: Workload) -> str:
    usable = w.usable_fraction * (w.gpu_memory_bytes or 0)
    candidates = [e for e in table.values() if e.available]
    best = min(candidates, key=lambda e: e.peak)
    need = f"{best.backend}'s {fmt_gb(best.peak)} per GPU"
    if best.load_gpu > best.total:
        need += " while loading the model"
    host = max(best.cpu_per_node, best.load_host_per_node)
    if best.peak <= usable and w.cpu_memory_bytes is not None and host > w.usable_fraction * w.cpu_memory_bytes:
        need += f" and {fmt_gb(host)} of CPU memory per node (have {fmt_gb(w.cpu_memory_bytes)})"
    elif best.peak <= usable and best.cpu_per_node:
        need += f" and {fmt_gb(best.cpu_per_node)} of CPU memory per node (have {fmt_gb(w.cpu_memory_bytes or 0)})"
    hints = ["more GPUs"]
    if not w.gradient_checkpointing:
        hints.append("--gradient-checkpointing")
    if w.micro_batch > 1:
        hints.append("a smaller --batch-size")
    hints.append("a shorter --max-length")
    if w.train_type == "full":
        hints.append("--train-type lora/qlora")
    elif w.quant_bits is None:
        hints.append("--train-type qlora")
    return (f"no backend fits in {fmt_gb(w.gpu_memory_bytes or 0)} per GPU "
            f"({fmt_gb(usable)} usable): the smallest requirement is {need}; try {', '.join(hints)}")


# --------------------------------------------------------------------------------------------------
# --parallelism auto


def workload_from_config(cfg: "RunConfig", world_size: int, gpu_memory_bytes: int | None,
                         gpus_per_node: int | None = None) -> Workload:
    """The Workload a RunConfig describes on `world_size` ranks. rlhf: a micro-batch of n pairs is 2n
    sequences with full logits at the answer tokens, plus DPO's (and KTO's) frozen reference copy where there
    is one. A reward model (rm) is counted as its causal LM: its one-output score head is smaller than lm_head
    and its logits, so the estimate is an upper bound there."""
    from swiftlite.config.tasks import task_spec
    from swiftlite.models.llamapro import groups as llamapro_groups
    spec = task_spec(cfg.task)
    rlhf = spec.own_options == "rlhf"   # preference training: pairs, a reference, plain logits
    r = cfg.rlhf
    copy = rlhf and r.rlhf_type in ("dpo", "kto") and not r.precompute_ref_log_probs and (r.ref_model or not cfg.is_peft)
    # GRPO: a sequence is a prompt (--max-length) plus its completion, one per sample; the reference is a
    # frozen copy unless --beta 0 or LoRA (adapter off); the generation round (KV cache of a micro-batch,
    # the weights the backend gathers) is a phase of its own (planner/memory.generation_bytes).
    grpo = rlhf and r.rlhf_type == "grpo"
    copy = copy or (grpo and r.beta != 0 and bool(r.ref_model or not cfg.is_peft))
    # multi-turn rounds (--multi_turn_scheduler): every turn may add --max_completion_length tokens (per_round)
    # (thinking_tips_scheduler: each turn a row of the micro-batch of its own, rows_per_completion)
    from swiftlite.config.multi_turn_options import completion_tokens, rows_per_completion
    seq_len = cfg.data.max_length + completion_tokens(r) if grpo and cfg.data.max_length else cfg.data.max_length
    # GKD (rlhf/gkd.py): a row, or (--lmbda > 0) its prompt with a sampled completion, generated like GRPO's;
    # the teacher as GRPO's; both models' full logits and the divergence's tensors (GKD_LOGIT_BYTES)
    gkd = rlhf and r.rlhf_type == "gkd"
    sampled = gkd and r.lmbda > 0 and bool(cfg.data.max_length)
    if sampled:
        seq_len = cfg.data.max_length + completion_tokens(r)
    return Workload(
        train_type=cfg.train.train_type, dtype=cfg.model.torch_dtype, lora_rank=cfg.lora.lora_rank,
        lora_targets=tuple(cfg.lora.target_modules) or ("all-linear",),
        # BOFT's dropout drops blocks; ms-swift's Bone has none
        lora_dropout=0.0 if cfg.train.train_type in ("boft", "bone") else cfg.lora.lora_dropout,
        boft_block=(cfg.lora.boft_block_size, cfg.lora.boft_block_num, cfg.lora.boft_n_butterfly_factor),
        adalora_init_r=cfg.lora.adalora_init_r, bone_rank=cfg.lora.reft_rank, llamapro_blocks=llamapro_groups(cfg),
        adapter_length=cfg.lora.adapter_length,
        quant_bits=cfg.quant_bits, double_quant=cfg.quant.bnb_4bit_use_double_quant,
        quant_method=cfg.quant_method or "bnb",
        max_length=seq_len, sequence_parallel=cfg.parallel.sequence_parallel_size,
        micro_batch=cfg.train.per_device_train_batch_size * (rows_per_completion(r) if grpo else
                                                             1 if gkd else spec.sequences_per_sample),
        reference="copy" if copy else "none", generation_length=seq_len if (grpo or sampled) and seq_len else 0,
        teacher_params=_teacher_params(cfg) if grpo or gkd else 0,
        teacher_partitioned=(grpo or gkd) and (r.teacher_deepspeed or "").startswith("zero3"),
        reward_model_params=_reward_model_params(r.reward_model) if grpo else 0,
        judge_kv_elems=_judge_kv_elems(r.reward_model, r.reward_model_plugin) if grpo else 0,
        whole_matrices=whole_matrix_optimizer(cfg),
        # CHORD's expert rows: sft rows of at most --max_length, a micro-batch of their own per step
        side_batch=((r.chord_sft_per_device_train_batch_size or 0, cfg.data.max_length or 0)
                    if grpo and r.chord_sft_dataset and cfg.data.max_length else (0, 0)),
        gradient_checkpointing=cfg.train.gradient_checkpointing, world_size=world_size,
        gpus_per_node=gpus_per_node or cfg.parallel.nproc_per_node or world_size,
        gpu_memory_bytes=gpu_memory_bytes, fsdp2_available=_has_fsdp2(),
        loss_impl="plain" if rlhf else cfg.train.loss_impl, loss_chunk_tokens=cfg.train.loss_chunk_tokens,
        plain_logit_bytes=GKD_LOGIT_BYTES if gkd else 0,
        pure_bf16=cfg.parallel.pure_bf16, hsdp_shard_size=cfg.parallel.hsdp_shard_size,
        shard_file_bytes=largest_shard_file(cfg.model.model),
        sharded_loading=bool(getattr(cfg.parallel, "sharded_loading", True)))


def whole_matrix_optimizer(cfg: "RunConfig") -> str:
    """The flag of an optimizer that reads each weight matrix whole (optim.WHOLE_MATRIX, GaLore), which
    no sharding backend can run, or ""."""
    from swiftlite.config.galore_options import uses_galore
    from swiftlite.optim import WHOLE_MATRIX, optim_name
    if uses_galore(cfg):
        return "--use_galore"
    name = optim_name(cfg)
    if name in WHOLE_MATRIX:
        return f"--optimizer {name}" if cfg.optim.optimizer == name else f"--optim {name}"
    return ""


def _reward_model_params(paths: list[str] | None) -> int:
    """GRPO's reward models (rlhf/reward_model.py): a sequence classifier is the causal LM's config without
    lm_head, with a one-output score head; a causal LM (a genrm judge) is whole; 0 for a hub id whose config
    is not here."""
    total = 0
    for path in paths or []:
        try:
            src = resolve_model(path)
            shape = src.shape()
        except UserError:
            continue
        conf = src.config_dict() if src.kind == "folder" else None
        classifier = (((conf or {}).get("architectures") or [""])[0]).endswith("ForSequenceClassification")
        total += shape.n_params - (0 if shape.tie else shape.vocab * shape.hidden) + shape.hidden if classifier \
            else shape.n_params
    return total


def _judge_kv_elems(paths: list[str] | None, plugins: list[str] | None) -> int:
    """GRPO's genrm judges (msswift_api/engine.py): the largest KV cache of one scoring call, BATCH rows
    answered up to the judge's max length (its max_position_embeddings, the engine's 8192 without one), 2 x
    layers x kv_heads x head_dim elements a token; a plugin file's class may judge too, and is not counted."""
    from swiftlite.msswift_api.engine import DEFAULT_MAX_MODEL_LEN
    from swiftlite.rlhf.reward_model import BATCH
    most = 0
    for path, plugin in zip(paths or [], plugins or []):
        if plugin != "genrm":
            continue
        try:
            src = resolve_model(path)
            shape = src.shape()
        except UserError:
            continue
        conf = (src.config_dict() if src.kind == "folder" else None) or {}
        tokens = conf.get("max_position_embeddings") or DEFAULT_MAX_MODEL_LEN
        most = max(most, 2 * shape.layers * shape.kv_heads * shape.head_dim * tokens * BATCH)
    return most


def _teacher_params(cfg: "RunConfig") -> int:
    """GRPO's and GKD's frozen teacher's parameter count (rlhf/teacher.py): 0 without --teacher_model, or when the
    teacher is the policy's own base with the adapter disabled (no copy)."""
    from swiftlite.config.rules_teacher import same_model
    if cfg.rlhf.teacher_model is None or (same_model(cfg) and cfg.is_peft):
        return 0
    return resolve_model(cfg.rlhf.teacher_model).shape().n_params


def _has_fsdp2() -> bool:
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return False
    return True


def choose_backend(cfg: "RunConfig", world_size: int, gpu_memory: Any = None, *, shape: Any = None,
                   gpus_per_node: int | None = None) -> Any:
    """The backend a run uses: parallel/resolve.resolve_backend (the only reader of --parallelism) with
    this module's `resolve_auto` as its decision for `auto`. The callers that resolve a run (job.py,
    bench) come through here, so parallel/ never imports the planner."""
    from swiftlite.parallel.resolve import resolve_backend
    return resolve_backend(cfg, world_size, gpu_memory, shape=shape, gpus_per_node=gpus_per_node, auto=resolve_auto)


def resolve_auto(cfg: "RunConfig", world_size: int, gpu_memory_bytes: int | None, *,
                 shape: ModelShape | None = None, gpus_per_node: int | None = None) -> Decision:
    """The backend `--parallelism auto` runs with.

    On CPU (`gpu_memory_bytes` None) memory is not the constraint: one process runs "single", several
    run "fsdp", several nodes "hsdp" (fp16 runs go to DeepSpeed ZeRO-2, the only backend with loss
    scaling; an HQQ base, which no sharding backend takes, and an optimizer that needs whole matrices,
    to DDP). On GPU the
    memory model decides (`recommend`); pass `shape` when the model is a hub id (this reads only
    presets and local folders). A run that fits nowhere is a UserError naming the smallest need.
    """
    if gpu_memory_bytes is None:
        if cfg.model.torch_dtype == "fp16":
            return Decision("zero2", "fp16 needs loss scaling, which only the DeepSpeed backends provide")
        if world_size == 1:
            return Decision("single", "one process on CPU: no parallelism needed")
        if cfg.quant_method == "hqq":
            return Decision("ddp", f"{world_size} CPU processes with an HQQ base, whose layers FSDP cannot shard "
                            "(models/hqq.py): DDP replicates it")
        whole = whole_matrix_optimizer(cfg)
        if whole:
            return Decision("ddp", f"{world_size} CPU processes with {whole}, which needs each weight matrix whole "
                            "(optim.optim_problem): DDP replicates them")
        nnodes = cfg.parallel.nnodes or 1
        if nnodes > 1:
            return Decision("hsdp", f"{nnodes} nodes of CPU processes: HSDP shards within each node and "
                            "replicates across, so only gradient shards cross nodes (memory is not estimated "
                            "on CPU)")
        return Decision("fsdp", f"{world_size} CPU processes: FSDP2 shards params, grads and optimizer "
                        "state (memory is not estimated on CPU)")
    workload = workload_from_config(cfg, world_size, gpu_memory_bytes, gpus_per_node)
    shape = workload.trained_shape(shape or resolve_model(cfg.model.model).shape())
    decision = recommend(shape, workload)
    if decision.backend == "none":
        raise UserError(f"--parallelism auto: {decision.reason}; or pick --parallelism explicitly")
    _refuse_offload_for_master_weights(cfg, shape, workload, decision)
    return decision


def _refuse_offload_for_master_weights(cfg: "RunConfig", shape: ModelShape, workload: Workload,
                                       decision: Decision) -> None:
    """`auto` never turns a bf16 job into an offload job only because of swiftlite's fp32 master weights
    (16 bytes/param of model state): when the same job with --pure-bf16 (ms-swift's own bf16 training:
    bf16 weights, gradients and AdamW state, 8 bytes/param) fits without offload, the user chooses
    between the two in one line. docs/estimate.md lists this rule."""
    if "offload" not in decision.backend or cfg.model.torch_dtype != "bf16" or cfg.parallel.pure_bf16:
        return
    import dataclasses
    pure = recommend(shape, dataclasses.replace(workload, pure_bf16=True))
    if pure.backend == "none" or "offload" in pure.backend:
        return
    used = pure.table[pure.backend].peak
    raise UserError(
        f"--parallelism auto: this bf16 run fits only with CPU offload ({decision.backend}) because its fp32 "
        f"master weights and AdamW state take 16 bytes/param; with --pure-bf16 (bf16 weights, gradients and "
        f"optimizer state, 8 bytes/param: ms-swift's bf16 training) it runs on {pure.backend} "
        f"({fmt_gb(used)} of {fmt_gb(workload.gpu_memory_bytes or 0)}): pass --pure-bf16, or "
        f"--parallelism {decision.backend} to keep fp32 master weights")


__all__ = ["Decision", "ROOM", "RULES", "Rule", "assess", "fmt_gb", "recommend", "resolve_auto", "workload_from_config"]
