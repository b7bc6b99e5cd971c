"""The Engine shared by the torch backends (single, DDP, FSDP2, FSDP1).

They differ only in how the model is wrapped and how the gradient norm is computed; state handling
goes through torch.distributed.checkpoint's state_dict API, which speaks all of them: sharded
saves (DCP) with the model's own parameter names, and full state dicts gathered to rank 0.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import re
from pathlib import Path
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from swiftlite.checkpoint.layout import DCP_DIR, SCHEDULER
from swiftlite.optim import build_optimizer, build_scheduler
from swiftlite.parallel.base import World, tensor_bytes
from swiftlite.parallel.loss import token_loss_sum


#: Optimizer options that belong to the engine that runs, not to a checkpoint (torch picks its kernel).
_ENGINE_OPTIONS = {"params", "foreach", "fused", "capturable", "differentiable"}
#: The attribute `autocast_forward` sets on a module (read by `autocast_context` only).
_AUTOCAST = "_swiftlite_autocast"


#: `<leaf>._fsdp_wrapped_module.<param>`: a leaf module that is an FSDP1 unit of its own
_UNIT_LEAF = re.compile(r"\._fsdp_wrapped_module\.(?=[^.]+$)")


class TorchEngine:
    """Model + AdamW + LambdaLR behind the Engine interface."""

    skips_nonfinite = True  # step() leaves the weights unchanged on a nan/inf gradient norm

    def __init__(self, module: torch.nn.Module, cfg: Any, world: World, total_steps: int,
                 *, inner: torch.nn.Module | None = None,
                 clip: Callable[[float], torch.Tensor] | None = None,
                 no_sync: Callable[[bool], Any] | None = None):
        self.module = module              # what forward runs (possibly a wrapper)
        self.inner = inner or module      # the model with HF names (for state dicts)
        self.cfg = cfg
        self.world = world
        # Trap 2: the optimizer is built right after wrapping, before any forward.
        self.optimizer = build_optimizer(self.module, cfg)
        self.scheduler = build_scheduler(self.optimizer, cfg, total_steps)
        self._clip = clip
        self._no_sync = no_sync
        self.max_grad_norm = cfg.optim.max_grad_norm

    # -- step loop -------------------------------------------------------------------------------
    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Summed next-token CE in fp32 (parallel/loss.py, --loss-impl), through the root module, so
        that FSDP's root unit has lm_head unsharded for the loss once per micro-batch."""
        from swiftlite.parallel.loss import loss_options
        with self.autocast():
            return token_loss_sum(self.module, batch, loss_options(self.cfg))

    def autocast(self) -> Any:
        """torch.autocast where `autocast_forward` marked the model (single/DDP under master weights)."""
        return autocast_context(self.inner)

    def root(self) -> torch.nn.Module:
        """The wrapper (DDP, FSDP2's root, FSDP1's root unit) or the plain model."""
        return self.module

    def micro_batch(self, last: bool) -> Any:
        """Context for one micro-batch: gradients are synchronised only on the last one of an
        accumulation window (DDP no_sync / FSDP2 requires_gradient_sync); the math is unchanged."""
        if self._no_sync is None:
            return contextlib.nullcontext()
        return self._no_sync(last)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> float:
        max_norm = self.max_grad_norm if self.max_grad_norm > 0 else float("inf")
        if self._clip is not None:
            norm = self._clip(max_norm)
        else:
            params = [p for p in self.module.parameters() if p.grad is not None]
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        norm = float(norm)
        if math.isfinite(norm):
            self.optimizer.step()
        # else: a nan/inf gradient is never applied (the weights stay as they were; train/guard.py
        # decides whether the run stops or goes on); the schedule still follows the global step.
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def after_update(self, fn: Callable[[], None]) -> None:
        """torch's post-step hook: it runs inside `optimizer.step()`, so only for an applied update,
        and before `step()` clears the gradients."""
        self.optimizer.register_step_post_hook(lambda _opt, _args, _kwargs: fn())

    def lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    def train(self) -> None:
        self.module.train()

    def eval(self) -> None:
        self.module.eval()

    # -- state -----------------------------------------------------------------------------------
    def _opts(self, **kw: Any) -> StateDictOptions:
        return StateDictOptions(**kw)

    def _trainable_state(self) -> dict[str, torch.Tensor] | None:
        """The model part of a checkpoint for LoRA on an 8-bit (LLM.int8) or HQQ base: the trainable
        parameters by name, as the tensors themselves (DCP saves from and loads into them).

        torch's get_model_state_dict walks every key of `module.state_dict()`, and bitsandbytes'
        8-bit layers add SCB/weight_format keys that are not module attributes (HQQ layers: their
        metadata, nbits, shape, scale, ...), so it fails even with ignore_frozen_params. The frozen
        base is reloaded from the model at resume anyway. None for every other model (torch's own
        state-dict functions)."""
        if not (self._frozen_ok and self._has_int8):
            return None
        return {name: p.detach() for name, p in self.inner.named_parameters() if p.requires_grad}

    @functools.cached_property
    def _has_int8(self) -> bool:
        """Layers whose state_dict keys are not attributes: bitsandbytes' 8-bit ones, HQQ's."""
        return any(type(m).__name__ in ("Linear8bitLt", "HQQLinear") for m in self.inner.modules())

    def save(self, path: str, *, model_only: bool = False) -> None:
        """Sharded save with DCP: each rank writes its own shards; names are the model's own.
        model_only (--save_only_model): the model entries alone, no optimizer or scheduler state
        (what `load(path, model_only=True)` reads)."""
        import torch.distributed.checkpoint as dcp
        model_state = self._trainable_state()
        if model_state is None:
            model_state = get_model_state_dict(self.inner, options=self._opts(ignore_frozen_params=self._frozen_ok))
        state = {"model": model_state}
        if not model_only:
            state["optim"] = get_optimizer_state_dict(self.inner, self.optimizer)
        dcp.save(state, checkpoint_id=str(Path(path) / DCP_DIR))
        if self.world.is_main and not model_only:
            (Path(path) / SCHEDULER).write_text(json.dumps(self.scheduler.state_dict()))

    def load(self, path: str, *, model_only: bool = False) -> bool:
        """Restore model, optimizer and scheduler from path/dcp/ (any world size: DCP reshards, no
        conversion, so this returns False). model_only (--resume_only_model): the model entries alone;
        optimizer and scheduler stay fresh."""
        import torch.distributed.checkpoint as dcp
        from swiftlite.checkpoint.safety import check_dcp_metadata
        check_dcp_metadata(Path(path) / DCP_DIR)
        opts = self._opts(ignore_frozen_params=self._frozen_ok)
        in_place = self._trainable_state()
        state = {"model": in_place if in_place is not None else get_model_state_dict(self.inner, options=opts)}
        if not model_only:
            state["optim"] = get_optimizer_state_dict(self.inner, self.optimizer)
        dcp.load(state, checkpoint_id=str(Path(path) / DCP_DIR))
        if in_place is None:  # the in-place tensors are the parameters themselves: already loaded
            set_model_state_dict(self.inner, state["model"], options=self._opts(strict=False))
        if model_only:
            return False
        set_optimizer_state_dict(self.inner, self.optimizer, state["optim"])
        sched = json.loads((Path(path) / SCHEDULER).read_text())
        self.scheduler.load_state_dict(sched)
        return False

    def load_universal(self, folder: Path, *, model_only: bool = False) -> None:
        """Load a universal folder (a ZeRO checkpoint converted once, checkpoint/universal.py): the fp32
        weights of every trainable parameter and, unless model_only, the AdamW moments and step of each,
        the checkpoint's optimizer hyper-parameters per group (lr included) and the LR schedule. Every
        rank reads the full tensors and torch's state-dict API (full_state_dict=True) keeps its own shards."""
        from swiftlite.checkpoint.universal import UniversalState, check_groups
        from swiftlite.errors import UserError
        uni = UniversalState(folder)
        current = get_model_state_dict(self.inner, options=self._opts(ignore_frozen_params=self._frozen_ok))
        shapes = {k: tuple(v.size()) for k, v in current.items()}  # global shapes (Tensor, DTensor, ShardedTensor)
        missing = [k for k in shapes if not uni.has(k)]
        if missing:
            raise UserError(f"--resume: {folder} holds no fp32 weights for {len(missing)} tensors of this model "
                            f"({', '.join(missing[:3])}); it was written for another model or train type")
        if not model_only:  # checked before anything is loaded
            from swiftlite.config.galore_options import uses_galore
            if uses_galore(self.cfg):
                raise UserError(f"--resume: {folder} holds AdamW moments of whole matrices, and GaLore's are "
                                "projected (--use_galore); add --resume_only_model true (fresh optimizer state)")
            fresh = get_optimizer_state_dict(self.inner, self.optimizer, options=self._opts(full_state_dict=True))
            saved = uni.param_groups
            check_groups(folder, len(saved), len(fresh["param_groups"]))
        model_sd = {k: uni.tensor(k, "fp32", s) for k, s in shapes.items()}
        set_model_state_dict(self.inner, model_sd, options=self._opts(full_state_dict=True, strict=False))
        del model_sd
        if model_only:
            return
        groups = [{**g, **{k: v for k, v in own.items() if k not in _ENGINE_OPTIONS}}
                  for g, own in zip(fresh["param_groups"], saved)]
        state = {}
        for g in groups:
            for name in g["params"]:
                state[name] = {"step": uni.step(name), "exp_avg": uni.tensor(name, "exp_avg", shapes[name]),
                               "exp_avg_sq": uni.tensor(name, "exp_avg_sq", shapes[name])}
        set_optimizer_state_dict(self.inner, self.optimizer, {"state": state, "param_groups": groups},
                                 options=self._opts(full_state_dict=True))
        self.scheduler.load_state_dict(uni.scheduler)

    @property
    def _frozen_ok(self) -> bool:
        # LoRA, Houlsby adapters: the frozen base comes from the base model at resume; only trainable state
        # is saved.
        return bool(getattr(self.cfg, "is_peft", False)) or getattr(self.cfg.train, "train_type", None) == "adapter"

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer with HF names, full tensors on CPU, on rank 0 ({} elsewhere)."""
        # cpu_offload copies to CPU on rank 0 only; on a CPU run that copy is pointless, and with
        # FSDP1 on gloo it crashes (SIGSEGV in the rank-0 offload): gather plainly instead.
        offload = self.world.device != "cpu"
        sd = get_model_state_dict(self.inner, options=self._opts(full_state_dict=True, cpu_offload=offload))
        return sd if self.world.is_main else {}

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """peft adapter tensors (peft's own naming), full, on CPU, on rank 0 ({} elsewhere). Every rank
        must call it (sharded backends gather).

        Only the trainable parameters are gathered, never the frozen (possibly 4-bit) base:
        * FSDP2: each trainable DTensor's `full_tensor()` (trap 3: never peft.save on DTensors);
        * FSDP1: one unit at a time under `summon_full_params(unit, recurse=False)` (peak memory: one
          unit); its full state dict would unshard and clone the 4-bit base too, which crashes
          (SIGSEGV) on gloo. Trap 3: peft matches keys against the wrapped module names, so the keys
          keep FSDP1's inner `_fsdp_wrapped_module.` parts until peft has picked the adapter's;
        * single / DDP: the plain parameters.
        """
        from peft import get_peft_model_state_dict
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp._common_utils import clean_tensor_name

        main = self.world.is_main
        trainable: dict[str, torch.Tensor] = {}

        root = self.inner
        peft_model = root.module if isinstance(root, FSDP) else root

        def take(name: str, p: torch.Tensor) -> None:
            t = p.full_tensor() if hasattr(p, "full_tensor") else p  # a collective for DTensors
            if main:  # names as peft_model.named_modules() spells them (nested wrappers included) ...
                name = name.removeprefix("_fsdp_wrapped_module.") if peft_model is not root else name
                # ... but an adapter matrix that is an FSDP1 unit of its own (parallel/fsdp1.py) keeps
                # its parameter name after the wrapper, where peft looks for `<adapter>.weight`
                trainable[_UNIT_LEAF.sub(".", name)] = t.detach().to("cpu", copy=True)

        def own_params(mod: torch.nn.Module, prefix: str):
            """(name, param) of `mod` and its submodules, stopping at nested FSDP units."""
            for n, p in mod.named_parameters(recurse=False):
                yield prefix + n, p
            for n, child in mod.named_children():
                if not isinstance(child, FSDP):
                    yield from own_params(child, prefix + n + ".")

        if any(isinstance(m, FSDP) for m in root.modules()):
            for prefix, unit in root.named_modules():  # same order on every rank
                if isinstance(unit, FSDP):
                    with FSDP.summon_full_params(unit, recurse=False, writeback=False):
                        for name, p in own_params(unit, prefix + "." if prefix else ""):
                            if p.requires_grad:
                                take(name, p)
        else:
            for name, p in root.named_parameters():
                if p.requires_grad:
                    take(name, p)
        if not main:
            return {}
        # peft selects adapter keys by walking peft_model's modules, whose names keep FSDP1's nested
        # `_fsdp_wrapped_module.` parts: select with those names, then clean them to peft's own.
        # save_embedding_layers=False: peft would add the frozen base embeddings of a vocabulary grown by
        # --new_special_tokens; the trained rows are the modules_to_save copies that rule requires
        sd = get_peft_model_state_dict(peft_model, state_dict=trainable, save_embedding_layers=False)
        return {clean_tensor_name(k): v for k, v in sd.items()}

    def state_bytes(self) -> dict[str, int]:
        """Bytes of model state this rank holds, counted from the tensors themselves."""
        params = sum(tensor_bytes(p) for p in self.module.parameters())
        grads = sum(tensor_bytes(p.grad) for p in self.module.parameters() if p.grad is not None)
        optim = 0
        for st in self.optimizer.state.values():
            for k, v in st.items():
                if torch.is_tensor(v) and k != "step":
                    optim += tensor_bytes(v)
        return {"params": params, "grads": grads, "optimizer": optim}


def autocast_forward(module: torch.nn.Module, cfg: Any, world: World) -> bool:
    """Master weights without FSDP (single, DDP): mark `module` so that the engine runs its forward
    under `torch.autocast(device, 16-bit)` (TorchEngine.forward: training and validation alike), so
    matmuls compute in bf16 from the fp32 parameters and the backward runs that graph (gradients land
    in fp32, the parameters' dtype). A context around the engine's call, not a wrapper of the
    module's forward: the loss (parallel/loss.py) replaces the CausalLM's forward with its own, which
    would drop a wrapper. Returns whether it marked (False: fp32 or --pure-bf16 runs). With gradient
    checkpointing, torch's checkpoint replays the autocast state in the recompute."""
    from swiftlite import dtypes
    from swiftlite.optim import master_weights
    if not master_weights(cfg):
        return False
    device_type = world.device_type
    object.__setattr__(module, _AUTOCAST, (device_type, dtypes.torch_dtype(cfg.model.torch_dtype)))
    return True


def autocast_context(module: torch.nn.Module) -> Any:
    """The autocast `autocast_forward` asked for on `module`, or a null context."""
    spec = module.__dict__.get(_AUTOCAST)
    return torch.autocast(device_type=spec[0], dtype=spec[1]) if spec else contextlib.nullcontext()
