"""Per-sequence log-probs through the backend, and DPO's reference model.

`sequence_logps(engine, batch)` runs the backend's root module (the DDP/FSDP wrapper, the DeepSpeed
engine: FSDP2's root pre-forward and ZeRO-3's hooks gather the weights as they do for sft) and sums the
log-probability of every target token of each row, in fp32. Only the logits at target positions are
turned into log-probs.

The reference (`setup(run)`, the rlhf entry of train/tasks.py), chosen in this order:

- `--precompute_ref_log_probs`: one pass over every train and validation pair before the first step,
  through the policy itself (it holds the starting weights then; LoRA/QLoRA: the adapter disabled;
  `--ref_model`: a frozen copy of that model, dropped after the pass); the [pairs x 2] table is all-reduced,
  kept on every rank and written into each checkpoint (`ref_logps.safetensors`), and a resumed run
  reads it back instead of recomputing.
- LoRA/QLoRA: the base model with the adapter disabled (the tuner layers' disable flag, as peft's
  `disable_adapter()` sets it, on the policy itself, under no_grad): no second copy.
- a full fine-tune (or `--ref_model`): a frozen copy, loaded like the policy and wrapped by the same
  backend with no optimizer (rlhf/frozen.py).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F

from swiftlite.checkpoint import layout
from swiftlite.data.tokenize import IGNORE
from swiftlite.errors import UserError

#: The file of a checkpoint that holds the precomputed reference log-probs (named in checkpoint/layout.py).
REF_LOGPS_FILE = layout.REF_LOGPS_FILE


def root_module(engine: Any) -> tuple[Any, Any]:
    """(what to call, the autocast context) of an engine: `Engine.root()` (the DDP/FSDP wrapper, the
    DeepSpeed engine) under `Engine.autocast()` (single/DDP low-precision runs), as its own forward runs."""
    return engine.root(), engine.autocast()


def module_logps(module: Any, batch: dict[str, torch.Tensor], ctx: Any = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed target log-probs [rows], target counts [rows]) of a batch through `module`: padded
    (a row per sequence, an attention mask) or padding-free (rlhf/packing.py: one 1 x N sequence, no
    mask, a row per segment of position ids restarting at 0; the first label of each segment after
    the first is IGNORE, so every target is predicted from inside its own row)."""
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
    with ctx if ctx is not None else contextlib.nullcontext():
        out = module(**inputs, use_cache=False)
    logits = out.logits if hasattr(out, "logits") else out[0]
    labels = batch["labels"][:, 1:]
    keep = labels != IGNORE
    tok = -F.cross_entropy(logits[:, :-1][keep].float(), labels[keep], reduction="none")
    if "attention_mask" not in batch and "position_ids" in batch:   # padding-free: rows are segments
        seg = (batch["position_ids"][0] == 0).long().cumsum(0) - 1
        n = int(seg[-1]) + 1
        rows = seg[1:][keep[0]]
    else:
        n = labels.shape[0]
        rows = torch.arange(n, device=labels.device).unsqueeze(1).expand_as(labels)[keep]
    logps = torch.zeros(n, dtype=torch.float32, device=tok.device).index_add(0, rows, tok)
    return logps, torch.bincount(rows, minlength=n)


def sequence_logps(engine: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    module, ctx = root_module(engine)
    return module_logps(module, batch, ctx)


def peft_model(module: Any) -> Any:
    """The peft PeftModel inside an engine's module tree (through DDP/FSDP/DeepSpeed), or None."""
    from peft import PeftModel
    for m in module.modules():
        if isinstance(m, PeftModel):
            return m
    return None


class AdapterReference:
    """LoRA/QLoRA: the policy with its adapter disabled (peft's context), under no_grad."""
    kind = "the base model with the adapter disabled"

    def __init__(self, engine: Any):
        self.engine = engine
        self.peft = peft_model(engine.module)
        if self.peft is None:
            raise UserError("rlhf with LoRA: no peft adapter found in the model (internal: LoRA was not applied)")

    def logps(self, batch: dict[str, torch.Tensor], idx: list[int] | None = None, split: str = "train"
              ) -> torch.Tensor:
        with torch.no_grad(), adapters_disabled(self.peft):
            return sequence_logps(self.engine, batch)[0]


@contextlib.contextmanager
def adapters_disabled(model: Any):
    """peft's `disable_adapter()` without its side effect on `requires_grad`: peft's context turns the
    adapter weights' requires_grad off and back on, and under FSDP1 (flat parameters, use_orig_params)
    the following backward then trained a different adapter (2 processes left the 1-process curve at
    step 2, 8e-3 off). Setting the tuner layers' disable flag (what their forward reads, and what
    peft's context sets too) gives the same base-model forward and leaves the parameters alone."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    saved = [m._disable_adapters for m in layers]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m, v in zip(layers, saved):
            m._disable_adapters = v


class PolicyReference:
    """The policy itself under no_grad: the reference before the first step of a full fine-tune."""
    kind = "the starting weights"

    def __init__(self, engine: Any):
        self.engine = engine

    def logps(self, batch: dict[str, torch.Tensor], idx: list[int] | None = None, split: str = "train"
              ) -> torch.Tensor:
        with torch.no_grad():
            return sequence_logps(self.engine, batch)[0]


class ModuleReference:
    """A frozen copy (rlhf/frozen.py) called like the policy, under no_grad."""
    kind = "a frozen copy"

    def __init__(self, frozen: Any):
        self.frozen = frozen

    def logps(self, batch: dict[str, torch.Tensor], idx: list[int] | None = None, split: str = "train"
              ) -> torch.Tensor:
        with torch.no_grad():
            return module_logps(self.frozen.module, batch, self.frozen.autocast())[0]


class PrecomputedReference:
    """Reference log-probs looked up per pair: table[split] is [pairs, 2] (chosen, rejected)."""
    kind = "precomputed log-probs"

    def __init__(self, tables: dict[str, torch.Tensor], device: Any):
        self.tables = {k: v.to(device) for k, v in tables.items()}

    def logps(self, batch: dict[str, torch.Tensor], idx: list[int] | None = None, split: str = "train"
              ) -> torch.Tensor:
        t = self.tables[split][torch.as_tensor(idx, dtype=torch.long, device=self.tables[split].device)]
        return torch.cat([t[:, 0], t[:, 1]])


def precompute(reference: Any, rows: list[dict], pad_id: int, per_device: int, world: Any,
               padding_free: bool = False, units: list[list[int]] | None = None) -> torch.Tensor:
    """[pairs, 2] reference log-probs of `rows` with `reference` (every rank the same number of forwards,
    its share of the units: pairs, or under --packing the packs `units`; the table is summed over ranks)."""
    import math

    import torch.distributed as dist

    from swiftlite.rlhf.data import collate_pairs
    n = len(rows)
    units = units if units is not None else [[i] for i in range(n)]
    table = torch.zeros(n, 2, dtype=torch.float64, device=world.device)
    mine = list(range(world.rank, len(units), world.world_size))
    batches = math.ceil(math.ceil(len(units) / world.world_size) / per_device)
    for b in range(batches):
        idx = [p for u in mine[b * per_device:(b + 1) * per_device] for p in units[u]]
        use = idx or [0]               # a rank that ran out still joins every collective
        batch = {k: v.to(world.device)
                 for k, v in collate_pairs([rows[i] for i in use], pad_id, padding_free).items()}
        lp = reference.logps(batch).double()
        if idx:
            k = len(idx)
            table[idx, 0], table[idx, 1] = lp[:k], lp[k:]
    if world.world_size > 1 and dist.is_initialized():
        dist.all_reduce(table)
    return table.float()


def save_tables(path: str, tables: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file
    save_file({k: v.detach().cpu().contiguous() for k, v in tables.items()}, path)


def load_tables(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(path)


class RlhfEngine:
    """The backend's engine, plus the precomputed reference table written into every checkpoint (the
    file is in the checkpoint folder before its manifest is taken, so it is checksummed with the rest)."""

    def __init__(self, engine: Any, tables: dict[str, torch.Tensor], world: Any):
        self._engine, self._tables, self._world = engine, tables, world

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def save(self, path: str, *, model_only: bool = False) -> None:
        from pathlib import Path
        self._engine.save(path, model_only=model_only)
        if self._world.is_main:
            save_tables(str(Path(path) / REF_LOGPS_FILE), self._tables)


def setup(run: Any) -> Any:
    """Attach the reference to run.batches (train/tasks.py "setup"); returns the engine the loop drives."""
    from pathlib import Path
    m = run.batches.method
    if not m.needs_reference:
        return run.engine
    cfg, world, engine = run.cfg, run.world, run.engine
    r = cfg.rlhf
    if not r.precompute_ref_log_probs:
        if r.ref_model or not cfg.is_peft:
            from swiftlite.rlhf.frozen import build_frozen
            run.batches.reference = ModuleReference(build_frozen(run))
        else:
            run.batches.reference = AdapterReference(engine)
        return engine
    saved = _saved_tables(run)
    if saved is not None:
        tables = load_tables(str(saved))
        if world.is_main:
            print(f"reference log-probs: read from {saved.parent.name}/{saved.name} (not recomputed)", flush=True)
    else:
        if run.resume_path is not None and not cfg.checkpoint.resume_only_model:
            raise UserError(f"--precompute-ref-log-probs: {run.resume_path.name} has no {REF_LOGPS_FILE} (it was "
                            "trained without the flag); resume it without --precompute-ref-log-probs")
        # Before the first step the policy holds the starting weights: it is the reference itself
        # (the adapter disabled for LoRA), unless --ref_model names another model.
        if r.ref_model:
            from swiftlite.rlhf.frozen import build_frozen
            live = ModuleReference(build_frozen(run))
        else:
            live = AdapterReference(engine) if cfg.is_peft else PolicyReference(engine)
        from swiftlite.rlhf.packing import units
        pad, bs = run.batches.pad_id, cfg.train.per_device_train_batch_size
        free = run.batches.padding_free
        engine.eval()
        tables = {"train": precompute(live, run.batches.rows, pad, bs, world, free, units(run.train_data))}
        if run.val_data is not None:
            tables["val"] = precompute(live, run.val_data.rows, pad, cfg.train.per_device_eval_batch_size, world,
                                       free, units(run.val_data))
        engine.train()
        if world.is_main:
            print(f"reference log-probs: precomputed for {len(run.batches.rows)} pairs ({live.kind})", flush=True)
        del live
    run.batches.reference = PrecomputedReference(tables, world.device)
    return RlhfEngine(engine, tables, world)


def _saved_tables(run: Any) -> Any:
    if run.resume_path is None or run.cfg.checkpoint.resume_only_model:
        return None
    p = run.resume_path / REF_LOGPS_FILE
    return p if p.is_file() else None


__all__ = ["AdapterReference", "ModuleReference", "PrecomputedReference", "REF_LOGPS_FILE", "RlhfEngine",
           "module_logps", "precompute", "root_module", "sequence_logps", "setup"]
