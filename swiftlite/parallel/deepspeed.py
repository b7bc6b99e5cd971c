"""DeepSpeed backend (ZeRO-1/2/3, CPU/NVMe offload) behind the swiftlite `Engine` interface.

    engine = build_engine(model, cfg, world, total_steps, choice)   # zero2, zero3, ... or a JSON file

How the numerics are made to equal the torch backends (verified on deepspeed 0.19.8):

* Optimizer and schedule: swiftlite's own `build_optimizer` (torch AdamW, foreach=False) and
  `build_scheduler` (LambdaLR) are passed to `deepspeed.initialize` as client objects, so no DeepSpeed
  op (fused_adam, cpu_adam) is compiled and every backend runs the same update. torch AdamW is on
  ZeRO's tested list; `zero_force_ds_cpu_optimizer: false` lets it run with offload_optimizer too
  (slower than DeepSpeedCPUAdam, identical maths). A DeepSpeed "optimizer"/"scheduler" block in a
  user JSON is dropped by `ds_config.fill_auto` after checking it agrees with the flags.
* Gradient accumulation: the trainer calls forward/backward once per micro-batch and `step()` once
  per optimizer step. We run DeepSpeed with `"managed_gradient_accumulation": false` (new in 0.19):
  `engine.backward` then only accumulates (ZeRO-2/3 still reduce-scatter each micro-batch into the
  rank's gradient partition, which is what bounds their memory), and `engine.step()` is *the*
  accumulation boundary: it finalises the partitions, clips, steps the optimizer and the scheduler
  and zeroes the gradients. `gradient_accumulation_steps` in the config keeps its real value
  (DeepSpeed checks train_batch_size = micro * gas * world with it) but drives nothing.
* Loss scaling: DeepSpeed divides the loss by gradient_accumulation_steps inside `backward` (and in
  a hook on the module outputs when `tensor.backward()` is used directly). The trainer has already
  scaled the loss (base.py's gradient contract), so we call `engine.backward(loss,
  scale_wrt_gas=False)`, which also marks the graph so the output hook leaves it alone. ZeRO
  averages gradients over the data-parallel ranks like DDP/FSDP.
* Clipping: DeepSpeed clips with `gradient_clipping` (= --max-grad-norm) on the global norm of the
  averaged gradients, as torch's clip_grad_norm_ does (DeepSpeed divides by (norm+1e-6)/max where
  torch multiplies by max/(norm+1e-6): the last bit can differ). `step()` returns the pre-clip norm.
* Precision: bf16/fp16 follow --torch-dtype; DeepSpeed casts the module's parameters to 16-bit
  (buffers such as the rotary inv_freq stay fp32) and its ZeRO optimizer keeps fp32 master
  partitions and fp32 AdamW moments, which `save` writes (ds/*optim_states.pt): the same mixed
  precision as the torch backends (docs/backends.md, "Precision"). --pure-bf16 turns on DeepSpeed's
  own `bf16_master_weights_and_grads` + `bf16_optimizer_states` (ds_config.py). fp32 runs match the
  torch backends.

No op is compiled on the default path: DeepSpeed's CPU accelerator builds the `shm_comm` op when the
communication backend starts, only for `inference_all_reduce`, which training never calls; we skip
that build (2-3 minutes the first time). NVMe offload needs the async_io op (compiled on first use,
cached in TORCH_EXTENSIONS_DIR, needs libaio-dev). See docs/deepspeed.md.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from swiftlite.checkpoint.layout import DS_TAG, CheckpointFormat, step_of
from swiftlite.distributed import World
from swiftlite.errors import UserError
from swiftlite.parallel.base import Backend, BackendChoice, FrozenModel, register_backend
from swiftlite.parallel.ds_config import (ds_stage, load_ds_config, offload_devices,  # noqa: F401
                                          quantized_comm_problem, resolve_ds_config)
from swiftlite.parallel.ds_env import (DEFAULT_EXT_DIR, _prepare_deepspeed, check_extension_locks,  # noqa: F401
                                       ds_env_defaults, stale_extension_locks)
from swiftlite.parallel.resolve import ds_source

if TYPE_CHECKING:
    import torch

    from swiftlite.config import RunConfig

CKPT_TAG = DS_TAG  # checkpoint-N/ds/

# Keeps the transformers ZeRO-3 marker alive for the whole run (transformers holds only a weakref).
_HF_DS_CONFIG: Any = None


# --------------------------------------------------------------------------------------------------
# Config for this run

def engine_ds_config(cfg: "RunConfig", world_size: int, hidden_size: int | None,
                     choice: BackendChoice | None = None) -> dict[str, Any]:
    """The filled, validated JSON plus the settings the engine relies on (see module docstring)."""
    ds = resolve_ds_config(cfg, world_size, hidden_size, ds_source(cfg, choice))
    ds["managed_gradient_accumulation"] = False
    ds["zero_allow_untested_optimizer"] = True
    ds["zero_force_ds_cpu_optimizer"] = False
    ds.setdefault("steps_per_print", 10 ** 9)
    ds.setdefault("wall_clock_breakdown", False)
    if "nvme" in offload_devices(ds):
        _check_libaio()
    return ds


def _check_libaio() -> None:
    import ctypes.util
    if ctypes.util.find_library("aio") is None:
        raise UserError("NVMe offload (zero3_offload_nvme) needs libaio: install it (Debian/Ubuntu: "
                        "apt-get install libaio-dev) or use zero3_offload")


def _hidden_size(model: "torch.nn.Module") -> int | None:
    conf = getattr(model, "config", None)
    for attr in ("hidden_size", "d_model", "n_embd"):
        v = getattr(conf, attr, None) if conf is not None else None
        if isinstance(v, int):
            return v
    base = getattr(model, "base_model", None)
    if base is not None and base is not model:
        return _hidden_size(base)
    return None


class _HfZero3Marker:
    """What transformers asks of its HfDeepSpeedConfig (`is_zero3()` and `.config`), without the
    `accelerate` dependency that transformers' own class requires."""

    def __init__(self, config: dict[str, Any]):
        self.config = config

    def is_zero3(self) -> bool:
        return ds_stage(self.config) == 3


def _set_hf_ds_config(ds: dict[str, Any]) -> None:
    global _HF_DS_CONFIG
    from transformers.integrations import deepspeed as hf_ds
    try:
        obj: Any = hf_ds.HfDeepSpeedConfig(ds)
    except Exception:  # accelerate missing (transformers' class needs it): same contract, no dependency
        obj = _HfZero3Marker(ds)
        hf_ds.set_hf_deepspeed_config(obj)
    _HF_DS_CONFIG = obj


@contextlib.contextmanager
def zero_init_context(cfg: "RunConfig", world: World, hidden_size: int | None,
                      choice: BackendChoice | None = None) -> Iterator[None]:
    """Build or load the model inside this so that a ZeRO-3 rank never holds the whole model.

        with zero_init_context(cfg, world, model_config.hidden_size):
            model = AutoModelForCausalLM.from_pretrained(...)   # or from_config / Model(config)

    ZeRO-3: registers the config with transformers (kept alive for the run, so from_pretrained
    loads shard by shard and resize/generation gather) and enters `deepspeed.zero.Init`, so even a
    model built directly (`LlamaForCausalLM(config)`) is partitioned module by module as it is
    constructed. Other stages: a no-op. Measured: `from_pretrained` inside it gives exactly the
    checkpoint's weights; a model *initialised* inside it (from_config, built-in seeded model) is
    properly initialised (std = initializer_range) but not bit-identical to the same seed built
    without ZeRO-3 (different RNG consumption). Seed every rank alike before building.
    """
    ds = engine_ds_config(cfg, world.world_size, hidden_size, choice)
    if ds_stage(ds) != 3:
        yield
        return
    # transformers imports torch._dynamo lazily; doing that inside zero.Init (which patches
    # Tensor.__new__) fails with "Signature mismatch ... tensor_pynew": import it first.
    import torch._dynamo  # noqa: F401
    deepspeed = _prepare_deepspeed(world, cfg.parallel.ddp_timeout)
    _set_hf_ds_config(ds)
    with deepspeed.zero.Init(config_dict_or_path=ds):
        yield


# --------------------------------------------------------------------------------------------------
# The engine

class DeepSpeedEngine:
    """swiftlite's Engine over a `deepspeed.DeepSpeedEngine` (see the module docstring)."""

    #: DeepSpeed's `step()` applies the update before the gradient norm is known: a nan/inf step
    #: cannot be skipped afterwards (train/guard.py stops the run instead).
    skips_nonfinite = False

    def __init__(self, model: "torch.nn.Module", cfg: "RunConfig", world: World, total_steps: int,
                 choice: BackendChoice | None = None):
        from swiftlite.models.sharded import deferred
        from swiftlite.optim import build_optimizer, build_scheduler

        deepspeed = _prepare_deepspeed(world, cfg.parallel.ddp_timeout)
        self.cfg, self.world = cfg, world
        self.ds_config = engine_ds_config(cfg, world.world_size, _hidden_size(model), choice)
        self.stage = ds_stage(self.ds_config)
        if self.stage == 3:
            _set_hf_ds_config(self.ds_config)
        if deferred(model) is not None:   # a 4-bit skeleton (models/sharded.py): filled here
            fill_partitioned(model, self.ds_config if self.stage == 3 else None, world, deepspeed)
        optimizer = build_optimizer(model, cfg)          # right after wrapping, before any forward
        scheduler = build_scheduler(optimizer, cfg, total_steps)
        self.ds, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=self.ds_config,
            dist_init_required=None)
        self.module = self.ds.module
        self.device = self.ds.device
        if self.stage == 0 and not (self.ds.fp16_enabled() or self.ds.bfloat16_enabled()):
            _keep_fp32_norm(self.ds)

    # -- training ---------------------------------------------------------------------------------
    def forward(self, batch: dict[str, "torch.Tensor"]) -> "torch.Tensor":
        """Summed next-token CE in fp32 (swiftlite.parallel.loss, --loss-impl, shared with the torch
        backends), run through DeepSpeed's forward: ZeRO-3 fetches the shards there, lm_head's once
        per micro-batch because the loss is lm_head's own forward."""
        from swiftlite.parallel.loss import loss_options, token_loss_sum
        return token_loss_sum(self.ds, {k: v.to(self.device) for k, v in batch.items()}, loss_options(self.cfg))

    def micro_batch(self, last: bool) -> contextlib.AbstractContextManager:
        """ZeRO reduces gradients in its own buckets during backward; nothing to switch here."""
        return contextlib.nullcontext()

    def backward(self, loss: "torch.Tensor") -> None:
        self.ds.backward(loss, scale_wrt_gas=False)

    def step(self) -> float:
        self.ds.step()
        norm = self.ds.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def after_update(self, fn: Any) -> None:
        raise UserError("this DeepSpeed engine cannot run code between its optimizer update and clearing the "
                        "gradients (both happen inside DeepSpeed's step, on its own gradient partitions); use "
                        "--parallelism single or ddp")

    def lr(self) -> float:
        return float(self.ds.get_lr()[0])

    def train(self) -> None:
        self.ds.train()

    def eval(self) -> None:
        self.ds.eval()

    def autocast(self) -> contextlib.AbstractContextManager:
        """DeepSpeed casts the module itself (bf16/fp16 configs): nothing to enter."""
        return contextlib.nullcontext()

    def root(self) -> Any:
        """The DeepSpeed engine: its forward runs ZeRO-3's gathering hooks."""
        return self.ds

    # -- checkpoints -----------------------------------------------------------------------------
    def save(self, path: str, *, model_only: bool = False) -> None:
        """Sharded training state (module, ZeRO optimizer partitions, scheduler) under path/ds/.
        model_only (--save_only_model): nothing here. ZeRO keeps the fp32 weights inside the optimizer's
        partitions, so DeepSpeed has no weights-only form of its own; the checkpoint's weights are its
        model/ or adapter/ folder (checkpoint/state.export_weights, gathered from the partitions), which
        is what ms-swift's save_only_model keeps under DeepSpeed too."""
        if not model_only:
            self.ds.save_checkpoint(path, tag=CKPT_TAG)

    def load(self, path: str, *, model_only: bool = False) -> bool:
        """Restore the training state from path/ds/. model_only (--resume_only_model): DeepSpeed's
        `load_module_only` without optimizer or scheduler states (ZeRO-1/2 read the module file and
        copy it into fresh fp32 masters; ZeRO-3 rebuilds the fp32 weights from the partitions), at any
        world size. A full resume of a checkpoint written by another world size or ZeRO stage goes
        through its one-time universal conversion (checkpoint/universal.py)."""
        import swiftlite.checkpoint.universal as universal
        saved = universal.zero_layout(path)
        if not model_only and saved is not None and (saved.world_size, saved.stage3) != (self.world.world_size,
                                                                                         self.stage == 3):
            # another world size or ZeRO stage: through DeepSpeed's universal format (converted once)
            folder = universal.ensure_universal(path, self.world, step_of(Path(path)),
                                                log=print if self.world.is_main else (lambda *_: None))
            self.load_universal(folder)
            return True  # checkpoint/state.py then says what carried over
        load_path, _ = self.ds.load_checkpoint(path, tag=CKPT_TAG, load_optimizer_states=not model_only,
                                               load_lr_scheduler_states=not model_only,
                                               load_module_only=model_only)
        if load_path is None:
            raise UserError(f"{path}: no DeepSpeed checkpoint (expected {os.path.join(path, CKPT_TAG)}/)")
        return False

    def load_universal(self, folder: Path, *, model_only: bool = False) -> None:
        """Load a universal folder with DeepSpeed's universal loader: fp32 master partitions, AdamW
        moments and step, LR schedule, DeepSpeed's step counters. A torch backend's checkpoint resumes
        whole here; its weights alone (model_only) start a new run from its model/ folder instead.

        `checkpoint.load_universal` is read by DeepSpeed only inside load_checkpoint (deepspeed 0.19.8:
        engine.load_universal_checkpoint()), and the resume point is known only after the engine is
        built, so it is switched on for this one call instead of in the run's JSON."""
        import torch

        import swiftlite.checkpoint.universal as universal
        from swiftlite.checkpoint.universal_files import OPTIMIZER_STATE
        from swiftlite.checkpoint.universal_files import load as load_file
        folder = Path(folder)
        if model_only:
            raise UserError(f"--resume_only_model: {folder.parent} is a torch backend's checkpoint; under DeepSpeed "
                            "it resumes whole (without --resume_only_model), or its model/ folder starts a new run "
                            "(--model)")
        ds = self.ds
        if ds.zero_nvme_offload_optimizer():
            # DeepSpeed then copies `offloaded_tensors/` of the tag folder, which a universal folder lacks
            raise UserError(f"--resume: {folder.parent.name} must be loaded from DeepSpeed's universal format, which "
                            "its loader cannot do with the optimizer state on NVMe; resume with zero3_offload or "
                            "zero3 (or with the world size and backend that wrote it)")
        inner = ds.optimizer.optimizer
        saved = load_file(folder / CKPT_TAG / "zero" / OPTIMIZER_STATE)["param_groups"]
        universal.check_groups(folder, len(saved), len(inner.param_groups))
        config = ds._config
        before = config.load_universal_checkpoint
        config.load_universal_checkpoint = True
        try:
            load_path, _ = ds.load_checkpoint(str(folder), tag=CKPT_TAG, load_optimizer_states=True,
                                              load_lr_scheduler_states=True)
        finally:
            config.load_universal_checkpoint = before
        if load_path is None:
            raise UserError(f"{folder}: DeepSpeed found no universal checkpoint in it")
        # ZeRO-3's universal loader gives every sub-group's state the *same* `step` tensor (the one read
        # from optimizer_state.pt); torch's fused and foreach AdamW increment `step` in place, so each
        # group's step would advance once per group and every step after the resume would use the wrong
        # bias correction (measured: 1e-3 loss drift by the third step). One tensor per state, as saved.
        for st in inner.state.values():
            if torch.is_tensor(st.get("step")):
                st["step"] = st["step"].clone()
        if self.stage == 3:
            # ZeRO-3's universal loader copies the hyper-parameters of param_groups[0] into every group
            # (stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3), so swiftlite's no-decay group
            # (norms, biases) would inherit weight_decay from the decay group. Restore each group's own.
            for group, own in zip(inner.param_groups, saved):
                group.update({k: v for k, v in own.items() if k != "params"})

    # -- gathering --------------------------------------------------------------------------------
    def _gathered(self, keep) -> dict[str, "torch.Tensor"]:
        """state_dict-named CPU copies on rank 0 of the parameters (and buffers) selected by
        keep(name, tensor); ZeRO-3 params are gathered one module at a time on every rank."""
        import deepspeed
        import torch

        module = self.module
        names_of: dict[int, list[str]] = {}
        sd = module.state_dict(keep_vars=True)
        for k, v in sd.items():
            names_of.setdefault(id(v), []).append(k)
        out: dict[str, torch.Tensor] = {}
        main = self.world.rank == 0
        done: set[int] = set()
        for _mname, sub in module.named_modules():
            params = [p for _n, p in sub.named_parameters(recurse=False)
                      if id(p) not in done and id(p) in names_of and keep(names_of[id(p)][0], p)]
            if not params:
                continue
            done.update(id(p) for p in params)
            ctx = (deepspeed.zero.GatheredParameters(params, modifier_rank=None)
                   if self.stage == 3 else contextlib.nullcontext())
            with ctx:
                if main:
                    for p in params:
                        t = p.detach().to("cpu", copy=True)
                        for name in names_of[id(p)]:
                            out[name] = t
        if main:
            for k, v in sd.items():
                if k not in out and not isinstance(v, torch.nn.Parameter) and keep(k, v):
                    out[k] = v.detach().to("cpu", copy=True)  # buffers are never partitioned
        return out

    def full_state_dict(self) -> dict[str, "torch.Tensor"]:
        """Every weight with its state_dict (HF) name, CPU, on rank 0; {} on other ranks. All ranks
        must call it (ZeRO-3 gathers). The caller writes safetensors (never save_16bit_model)."""
        return self._gathered(lambda _n, _t: True)

    def adapter_state_dict(self) -> dict[str, "torch.Tensor"]:
        """peft adapter weights with peft's names, on rank 0; {} elsewhere. All ranks must call it:
        under ZeRO-3 the trainable params are gathered first (else peft saves shape-(0,) tensors)."""
        import torch
        trainable = self._gathered(lambda _n, t: isinstance(t, torch.nn.Parameter) and t.requires_grad)
        if self.world.rank != 0:
            return {}
        from peft import get_peft_model_state_dict
        # save_embedding_layers=False: as torch_engine.adapter_state_dict (--new_special_tokens)
        return dict(get_peft_model_state_dict(self.module, state_dict=trainable, save_embedding_layers=False))

    # -- memory -----------------------------------------------------------------------------------
    def state_bytes(self) -> dict[str, int]:
        """Bytes of model state this rank holds, from the tensors themselves.

        params: module parameters (ZeRO-3: the rank's partition `ds_tensor`, plus persistent params);
        grads: the rank's gradient partition buffers plus any `.grad` on module params;
        optimizer: the fp32 master partition ZeRO keeps plus the AdamW moments."""
        import torch

        def nbytes(t: Any) -> int:
            return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0

        params = grads = 0
        seen: set[int] = set()
        for p in self.module.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            if hasattr(p, "ds_tensor"):
                params += nbytes(p.ds_tensor)
                # ZeRO++ hpZ: the secondary partition (this rank's share of one node's copy) is
                # resident between forward and the optimizer step.
                params += nbytes(getattr(p, "ds_secondary_tensor", None))
                if getattr(p, "ds_persist", False):
                    params += p.ds_numel * p.ds_tensor.element_size()
            else:
                params += nbytes(p)
            grads += nbytes(p.grad)
        opt = self.optimizer
        for attr in ("grads_in_partition", "grad_partitions_flat_buffer"):
            buf = getattr(opt, attr, None)
            grads += sum(nbytes(b) for b in buf) if isinstance(buf, (list, tuple)) else nbytes(buf)
        # ZeRO-1/2 keep the reduced partition per param group in `averaged_gradients` (a flat
        # partition buffer, or a list of tensors) when the contiguous buffer is not in use.
        # With DeepSpeed's managed accumulation off, ZeRO-1/2 hold this rank's partition of the
        # gradients in `all_grad_tensors` until the step; else in `averaged_gradients`.
        if self.stage < 3:  # ZeRO-3 keeps the same tensors in its partition buffers (counted above)
            for group in (getattr(opt, "all_grad_tensors", None) or {}).values():
                grads += sum(nbytes(t) for t in group) if isinstance(group, (list, tuple)) else nbytes(group)
        avg = getattr(opt, "averaged_gradients", None) if self.stage < 3 else None
        if isinstance(avg, dict) and not nbytes(getattr(opt, "grads_in_partition", None)):
            for group in avg.values():
                flat = getattr(group, "flat_partition", None)
                if flat is not None:
                    grads += nbytes(flat)
                elif isinstance(group, (list, tuple)):
                    grads += sum(nbytes(t) for t in group)
        masters: list = []
        for attr in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
            masters += list(getattr(opt, attr, None) or [])
        optim = sum(nbytes(m) for m in masters)
        base = getattr(opt, "optimizer", opt)
        for state in getattr(base, "state", {}).values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.numel() > 1:
                    optim += nbytes(v)
        return {"params": params, "grads": grads, "optimizer": optim}


def _keep_fp32_norm(ds: Any) -> None:
    """ZeRO stage 0 in fp32 (--deepspeed zero0 on a CPU): DeepSpeed clips with its own clip_grad_norm_ and drops
    the norm it returns (engine.clip_fp32_gradients), so get_global_grad_norm() would be None; keep it where
    the other stages keep theirs."""
    from deepspeed.runtime.utils import clip_grad_norm_

    def clip() -> None:
        ds._global_grad_norm = clip_grad_norm_(parameters=ds.module.parameters(), max_norm=ds.gradient_clipping(),
                                               mpu=ds.mpu)
    ds.clip_fp32_gradients = clip


#: Modules `deepspeed.initialize` imports on its own the first time a ZeRO engine is built
#: (deepspeed 0.19, runtime/zero/utils.py `is_zero_supported_optimizer`: its Muon optimizer, kept out
#: of `import deepspeed` because its module-level torch.compile decorator loads dynamo and inductor).
#: Optional: DeepSpeed itself carries on without them.
LAZY_MODULES = ("deepspeed.runtime.zero.muon.muon_optimizer",)


def load_libraries(cfg: "RunConfig", world: World) -> None:
    """Import DeepSpeed (its environment and process group first, `_prepare_deepspeed`) and the modules
    its engine imports lazily, now rather than while the model and engine are built. Library code
    (~70 MiB of host memory on CPU for deepspeed 0.19 with torch 2.13) is then loaded before the
    trainer's training-memory window opens (train/run.py), as torch's own modules are."""
    import importlib

    _prepare_deepspeed(world, cfg.parallel.ddp_timeout)
    for name in LAZY_MODULES:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


def model_init_context(cfg: "RunConfig", world: World, model_config: Any, choice: BackendChoice) -> Any:
    """The record's init context: ZeRO-3's partitioned init for a model loaded from weights. A
    quantized base is never partitioned (bitsandbytes packs the weights itself), and a built-in
    preset is built whole and then partitioned by `deepspeed.initialize`. Called before the model is
    built: DeepSpeed's libraries are loaded here (`load_libraries`)."""
    load_libraries(cfg, world)
    if cfg.quant_bits is not None:
        return None
    hidden = getattr(model_config(), "hidden_size", None)
    return zero_init_context(cfg, world, hidden, choice)


def frozen_copy(model: "torch.nn.Module", cfg: "RunConfig", world: World, engine: DeepSpeedEngine,
                choice: BackendChoice | None = None, *, own_config: dict[str, Any] | None = None,
                replica: bool = False) -> FrozenModel:
    """DPO's frozen reference copy (`Backend.frozen_copy`): `deepspeed.initialize` without optimizer on
    the policy's JSON. ZeRO-3 partitions it like the policy; ZeRO-1/2, which shard optimizer state only,
    keep a replica (stage 0). `own_config`: the copy's own ZeRO-3 JSON instead (GRPO's
    --teacher_deepspeed, `teacher_ds_config`), whatever the policy's stage; `replica`: a replica
    (stage 0) whatever the policy's stage (a --teacher_deepspeed of stage 0-2)."""
    import copy

    import deepspeed
    conf = copy.deepcopy(own_config if own_config is not None else engine.ds_config)
    for k in ("optimizer", "scheduler"):
        conf.pop(k, None)
    zero = dict(conf.get("zero_optimization") or {})
    if zero.get("stage", 0) != 3 or replica:
        zero = {"stage": 0}
    zero.pop("offload_optimizer", None)
    conf["zero_optimization"] = zero
    ds, *_ = deepspeed.initialize(model=model, config=conf, dist_init_required=None)
    ds.eval()
    return FrozenModel(ds, contextlib.nullcontext,
                       layout="ZeRO-3 partitions" if zero["stage"] == 3 else "a DeepSpeed replica (stage 0)")


def fill_partitioned(model: "torch.nn.Module", ds_config: dict[str, Any] | None, world: World,
                     deepspeed: Any) -> None:
    """Fill a 4-bit skeleton (models/sharded.py) one unit at a time, each decoder layer and then the
    rest, and under ZeRO-3 (`ds_config` given) partition each unit as soon as it is filled
    (`deepspeed.zero.Init(module=unit)`, as if it had been built inside zero.Init): a rank holds its
    partitions plus one unit whole, never the whole 4-bit base. Without ZeRO-3 it is filled whole."""
    from swiftlite.models.loading import decoder_layers
    from swiftlite.models.sharded import finish, unit_initializer
    device = "cpu" if world.device == "cpu" else world.device
    init = unit_initializer(model, device)

    def fill(unit: "torch.nn.Module") -> None:
        for m in unit.modules():
            if any(t is not None and t.device.type == "meta"
                   for t in list(m._parameters.values()) + list(m._buffers.values())):
                init(m)
        if ds_config is not None:
            deepspeed.zero.Init(module=unit, config_dict_or_path=ds_config)
    for layer in decoder_layers(model):
        fill(layer)
    fill(model)
    finish(model)


def build_deepspeed_engine(model: "torch.nn.Module", cfg: "RunConfig", world: World, total_steps: int,
                           choice: BackendChoice | None = None) -> DeepSpeedEngine:
    return DeepSpeedEngine(model, cfg, world, total_steps, choice)


# --------------------------------------------------------------------------------------------------
# Records and their checks

def check_config(cfg: "RunConfig", world_size: int, choice: BackendChoice) -> str | None:
    """The DeepSpeed JSON (preset or file) reads, fills and validates for this world; a quantized
    base is never offloaded; fp16 needs an accelerator that has it."""
    from swiftlite.optim import precision_problem
    problem = precision_problem(cfg)
    if problem:
        return problem
    if cfg.checkpoint.save_only_model and not cfg.checkpoint.save_hf_model:
        return ("--save_only_model with --save-hf-model false: under DeepSpeed a weights-only checkpoint is its "
                "model/ or adapter/ folder (the ZeRO partitions hold the optimizer state with the weights), so "
                "nothing would be saved; drop --save-hf-model false")
    src = ds_source(cfg, choice)
    param_dev = offload_devices(load_ds_config(src))[1]
    if cfg.quant_bits is not None and param_dev != "none":
        return (f"--parallelism {src}: DeepSpeed offload cannot move bitsandbytes-quantized weights "
                f"(offload_param to {param_dev} pages the packed weights without their quantization state); use "
                "zero3, or zero2_offload (optimizer offload only), with --qlora/--quant-bits")
    ds = resolve_ds_config(cfg, world_size, None, src)
    problem = quantized_comm_problem(ds, cfg)
    if problem:
        return problem
    if cfg.model.torch_dtype == "fp16" and not fp16_available():
        return ("--torch-dtype fp16: this machine has no GPU, and DeepSpeed's CPU accelerator supports fp16 only "
                "on CPUs with AVX512-FP16 (this one lacks it); use bf16 or fp32")
    return None


def fp16_available() -> bool:
    """Whether DeepSpeed can train fp16 here: any CUDA device, or a CPU whose oneDNN has fp16."""
    import torch
    if torch.cuda.is_available():
        return True
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except Exception:  # noqa: BLE001 - an older torch without the probe: DeepSpeed says no too
        return False


def _needs_source(cfg: "RunConfig", world_size: int, choice: BackendChoice) -> str | None:
    if not choice.deepspeed_source:
        return "--parallelism deepspeed needs a config: --deepspeed FILE, a .json value, or a preset (zero2, zero3, ...)"
    return None


def _record(name: str, summary: str, family: str | None, shards: tuple[bool, bool, bool], *,
            estimate: bool = True, options: frozenset[str] = frozenset()) -> Backend:
    return Backend(name=name, engine="deepspeed", factory=build_deepspeed_engine, summary=summary,
                   shards=shards, memory_family=family, estimate=estimate, loss_scaling=True, options=options,
                   checks=(_needs_source, check_config) if name == "deepspeed" else (check_config,),
                   init_context=model_init_context, checkpoint_format=CheckpointFormat.DS, frozen_copy=frozen_copy,
                   ds_preset=None if name == "deepspeed" else name, needs=("deepspeed",),
                   # ZeRO-3 presets: zero.Init for 16-bit models, and a 4-bit skeleton partitioned
                   # layer by layer as it is filled (DeepSpeedEngine, fill_partitioned); a JSON of the
                   # user's too (its stage decides there: stage 1-2 fill the skeleton whole)
                   loading="partitioned" if name.startswith("zero3") or name == "deepspeed" else "whole")


register_backend(_record("zero2", "DeepSpeed ZeRO-2: grads and optimizer state sharded", "zero2",
                         (False, True, True)))
register_backend(_record("zero2_offload", "ZeRO-2 with the optimizer state in CPU memory", "zero2",
                         (False, True, True), estimate=False))
register_backend(_record("zero3", "DeepSpeed ZeRO-3: params, grads and optimizer state sharded", "zero3",
                         (True, True, True)))
register_backend(_record("zero3pp", "DeepSpeed ZeRO++ (ZeRO-3 + hpZ: a secondary copy of the weights "
                         "sharded within each node)", "zero3pp", (True, True, True), estimate=True,
                         options=frozenset({"zero_quantized_weights", "zero_quantized_gradients"})))
register_backend(_record("zero3_offload", "ZeRO-3 with params, grads and optimizer state in CPU memory",
                         "zero3_offload", (True, True, True)))
register_backend(_record("zero3_offload_nvme", "ZeRO-3 with params and optimizer state on NVMe (--offload-dir)",
                         "zero3_offload", (True, True, True), estimate=False))
register_backend(_record("deepspeed", "a DeepSpeed JSON of your own (--deepspeed FILE or --parallelism FILE.json)",
                         None, (True, True, True), estimate=False))
