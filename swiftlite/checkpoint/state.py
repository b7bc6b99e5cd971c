"""The whole training state in and out of a checkpoint: engine shards, RNG, trainer_state.json, and the
HF copy (model/ or adapter/) saved next to them for use without swiftlite.

The engine writes its own part (dcp/ + scheduler.json for the torch backends, ds/ for DeepSpeed);
this module adds the rest and publishes the folder through `store` (temp folder, manifest, rename,
then `latest`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import swiftlite.checkpoint.layout as layout
import swiftlite.checkpoint.store as store
from swiftlite.checkpoint.safety import one_line
from swiftlite.errors import UserError

if TYPE_CHECKING:
    from swiftlite.config import RunConfig


def save_rng(path: Path, rank: int) -> None:
    """Torch RNG states (dropout draws); training uses no Python/NumPy randomness."""
    import torch
    path.mkdir(parents=True, exist_ok=True)
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    torch.save(state, path / layout.rng_file(rank))


def load_rng(path: Path, rank: int) -> None:
    import torch
    f = path / layout.rng_file(rank)
    if not f.is_file():
        return  # another world size: RNG restarts from the seed, which changes only dropout draws
    try:
        state = torch.load(f, weights_only=True)
        torch.set_rng_state(state["torch"])
    except Exception as e:
        raise UserError(f"{f}: refused, not a plain RNG state ({one_line(e)})") from None
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def run_facts(cfg: "RunConfig", train_data: Any, global_batch: int) -> dict[str, Any]:
    """What a checkpoint must agree with to be resumed as the same run: the tokenized training set
    (rows, tokens, a hash of every token and label) and the run-shaping options (the data order is a
    function of the global batch and the seed; the model's trainable shape of the LoRA options)."""
    import hashlib

    import numpy as np
    h = hashlib.sha256()
    tokens = 0
    for r in train_data.rows:
        ids = np.asarray(r["input_ids"], dtype=np.int64)
        h.update(ids.tobytes())
        h.update(np.asarray(r["labels"], dtype=np.int64).tobytes())
        tokens += ids.size
    shape = {"global_batch": global_batch, "seed": cfg.train.seed, "max_length": cfg.data.max_length,
             "dataset": list(cfg.data.dataset), "packing": cfg.data.packing, "train_type": cfg.train.train_type}
    if cfg.data.cached_dataset:   # recorded only when given, as below
        shape["cached_dataset"] = list(cfg.data.cached_dataset)
    if cfg.is_peft:
        shape.update(lora_rank=cfg.lora.lora_rank, lora_alpha=cfg.lora.lora_alpha,
                     target_modules=list(cfg.lora.target_modules), quant_bits=cfg.quant_bits)
    # Recorded only when not the default, so checkpoints written before these options resume as before.
    for key, default in (("optim", "adamw_torch_fused"), ("use_dora", False), ("lora_bias", "none"),
                         ("init_weights", "true")):
        value = cfg.flat()[key] if key != "optim" else (cfg.optim.optimizer or cfg.optim.optim)
        if value != default and (key == "optim" or cfg.is_peft):
            shape[key] = value
    # The run's BOFT/AdaLoRA/Bone/LLaMA-Pro/Houlsby options off their default: they shape the adapter (blocks, ranks),
    # AdaLoRA's schedule or the expanded layers, so a resume with others is a different run; LISA's (a full
    # run) decide which layers each step trains and which have optimizer state.
    from swiftlite.config import field_specs
    from swiftlite.config.rules_tuners import (ADALORA_KEYS, ADAPTER_KEYS, BOFT_KEYS, BONE_KEYS, LISA_KEYS,
                                               LLAMAPRO_KEYS)
    specs, flat = field_specs(), cfg.flat()
    for key in {"boft": BOFT_KEYS, "adalora": ADALORA_KEYS, "bone": BONE_KEYS, "llamapro": LLAMAPRO_KEYS,
                "adapter": ADAPTER_KEYS, "full": LISA_KEYS}.get(cfg.train.train_type, ()):
        if flat[key] != specs[key].default:
            shape[key] = flat[key]
    # GRPO's teacher and CHORD's expert rows and schedule shape every step's loss: recorded only when given
    from swiftlite.config.chord_options import CHORD_KEYS
    if cfg.rlhf.chord_sft_dataset:
        shape.update({k: flat[k] for k in CHORD_KEYS})
    if cfg.rlhf.teacher_model:
        shape.update(teacher_model=cfg.rlhf.teacher_model, teacher_kl_coef=cfg.rlhf.teacher_kl_coef)
    if cfg.rlhf.multi_turn_scheduler:   # the turns decide every round's completions
        from swiftlite.config.multi_turn_options import MULTI_TURN_KEYS
        shape.update({k: flat[k] for k in MULTI_TURN_KEYS})
    return {"data": {"rows": len(train_data.rows), "tokens": tokens, "sha256": h.hexdigest()[:32]},
            "shape": shape}


def compare_run_facts(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The names that differ between a checkpoint's run facts and this run's ("data.rows", "shape.max_length")."""
    diff = []
    for group in ("data", "shape"):
        a, b = saved.get(group) or {}, now.get(group) or {}
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                diff.append(f"{group}.{key} ({a.get(key)!r} -> {b.get(key)!r})" if group == "shape"
                            else f"{group}.{key}")
    return diff


def check_finite(engine: Any, step: int) -> None:
    """No checkpoint ever holds non-finite weights: every rank looks at its own shards of the trainable
    parameters (frozen ones cannot change; a packed 4-bit base stored as bf16 is bits, not numbers),
    one all-reduce of a flag per save."""
    import torch

    from swiftlite.distributed import all_reduce_sum
    from swiftlite.distributed import local_values
    bad = 0.0
    with torch.no_grad():
        for p in engine.module.parameters():
            if not p.requires_grad:
                continue
            local = local_values(p)   # a ZeRO-3 partition's padding is uninitialised memory: left out
            if local.is_floating_point() and local.numel() and not bool(torch.isfinite(local).all()):
                bad = 1.0
                break
    if all_reduce_sum([bad])[0] > 0:
        raise UserError(f"checkpoint-{step}: the weights hold nan/inf; nothing was saved (the last checkpoint "
                        "stays the newest good one)")


def expected_size(run_dir: Path, engine: Any) -> int:
    """Bytes the next checkpoint will take: the newest existing one's size, else the engine's
    model-state bytes (parameters + optimizer state, over every rank: an estimate for the first save)."""
    ckpts = store.list_checkpoints(run_dir)
    if ckpts:
        newest = ckpts[-1]  # its universal conversion (if a resume made one) is not part of a save
        return sum(f.stat().st_size for f in newest.rglob("*")
                   if f.is_file() and f.relative_to(newest).parts[0] != layout.DS_UNIVERSAL)
    from swiftlite.distributed import all_reduce_sum
    sb = engine.state_bytes()
    return int(all_reduce_sum([float(sb.get("params", 0) + sb.get("optimizer", 0))])[0])


def check_disk_space(run_dir: Path, step: int, need: int) -> None:
    """Refuse a save that cannot fit (every rank decides alike: the smallest free space counts)."""
    from swiftlite.distributed import all_reduce_sum
    free = shutil.disk_usage(run_dir).free
    short = all_reduce_sum([1.0 if free < need else 0.0])[0]
    if short > 0:
        raise UserError(f"--output-dir {run_dir}: {free:,} bytes free, checkpoint-{step} needs about {need:,} "
                        f"({need - free:,} missing); free some space or lower --save-total-limit")


def save_training_state(engine: Any, model: Any, tokenizer: Any, cfg: "RunConfig", world: Any,
                        run_dir: Path, step: int, backend: str, facts: dict | None = None, *,
                        fmt: layout.CheckpointFormat = layout.CheckpointFormat.DCP) -> Path:
    """Write checkpoint-<step> atomically (temp folder, manifest, rename, then `latest`). Before writing:
    the weights are finite and the disk has room for it (the size of the previous checkpoint); a write
    that runs out of space anyway (ENOSPC) removes its partial folder, keeps every earlier checkpoint
    and `latest`, and stops with the path and the bytes. Older checkpoints are pruned only after the
    new one is published. `backend` is the engine key and `fmt` the record's checkpoint format
    (`Backend.checkpoint_format`), both written into trainer_state.json."""
    import errno
    check_finite(engine, step)
    check_disk_space(run_dir, step, expected_size(run_dir, engine))
    try:
        return _save(engine, model, tokenizer, cfg, world, run_dir, step, backend, facts, fmt)
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        tmp = run_dir / f"{layout.TMP_PREFIX}{layout.checkpoint_name(step)}"
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"--output-dir {run_dir}: no space left writing checkpoint-{step} "
                        f"({e.filename or tmp}); the partial folder was removed, the newest complete checkpoint "
                        f"is still `latest`") from None


def _save(engine: Any, model: Any, tokenizer: Any, cfg: "RunConfig", world: Any, run_dir: Path, step: int,
          backend: str, facts: dict | None, fmt: layout.CheckpointFormat) -> Path:
    from swiftlite import faults
    from swiftlite.distributed import barrier
    name = layout.checkpoint_name(step)
    tmp = run_dir / f"{layout.TMP_PREFIX}{name}"
    final = run_dir / name
    if world.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    weights_only = bool(cfg.checkpoint.save_only_model)
    if weights_only:  # --save_only_model: the weights' shards only; no optimizer, schedule or RNG states
        engine.save(str(tmp), model_only=True)
    else:
        engine.save(str(tmp))
        save_rng(tmp / layout.RNG_DIR, world.rank)
    if cfg.checkpoint.save_hf_model:
        export_weights(engine, model, tokenizer, cfg, world, tmp)
    faults.maybe_inject(step, "checkpoint")
    barrier()
    if world.is_main:
        state = {"global_step": step, "backend": backend, "format": str(fmt), "world_size": world.world_size,
                 "train_type": cfg.train.train_type, "model": cfg.model.model,
                 "torch_dtype": cfg.model.torch_dtype, **(facts or {}),
                 **({"save_only_model": True} if weights_only else {})}
        (tmp / layout.TRAINER_STATE).write_text(json.dumps(state, indent=2) + "\n")
        store.write_manifest(tmp)
        store.publish(tmp, final, run_dir)  # swap by rename, then move `latest`
        store.prune(run_dir, cfg.checkpoint.save_total_limit, keep=final)
    barrier()
    return final


def export_weights(engine: Any, model: Any, tokenizer: Any, cfg: "RunConfig", world: Any, ckpt_dir: Path) -> None:
    """model/ (an HF folder of the full weights) or adapter/ (peft format) inside a checkpoint; nothing
    for --train_type adapter (its weights are in the engine's own state only).

    The full weights are written in --torch-dtype (16-bit for a bf16 run): under fp32 master weights
    the engine's state dict is fp32 and `write_model_folder` casts every floating tensor to the run's
    dtype, so the HF copy is what the model computes with (tests/distributed/test_master_weights.py).
    The adapter is saved as the module holds it (fp32 on the torch backends, DeepSpeed's bf16 copy
    under DeepSpeed), as peft saves it."""
    from swiftlite.hf_io import write_adapter, write_model_folder
    if cfg.train.train_type == "adapter":
        # Houlsby adapters (models/adapter.py): no HF or peft form holds them, and transformers would drop
        # their keys from a model/ folder without a word; dcp/ or ds/ keeps them
        return
    if cfg.is_peft:
        sd = engine.adapter_state_dict()
        if world.is_main:
            write_adapter(model, sd, ckpt_dir / layout.ADAPTER_DIR)
        return
    sd = engine.full_state_dict()
    if world.is_main:
        write_model_folder(model, sd, tokenizer, ckpt_dir / layout.MODEL_DIR, cfg.model.torch_dtype)


#: Run facts that change the shape of the saved weights: a model-only resume must agree on these.
WEIGHT_SHAPE = ("train_type", "lora_rank", "target_modules", "quant_bits", "llamapro_num_new_blocks",
                "llamapro_num_groups", "adapter_length")


def load_training_state(engine: Any, path: Path, world: Any, cfg: "RunConfig", choice: Any,
                        facts: dict | None = None, log=print) -> dict:
    """Restore model, optimizer, scheduler and RNG from a checkpoint; returns trainer_state. With
    `facts` (this run's `run_facts`), a checkpoint of another dataset or run shape is refused, naming
    what changed, unless --ignore-data-skip says to go on (the data order then restarts).

    --resume_only_model (ms-swift's meaning): the model weights only. The optimizer, the LR schedule,
    the RNG and the data order stay as built for a new run, the returned state says step 0 (its
    `resumed_from_step` keeps the checkpoint's), and the run-facts check is skipped: only what
    changes the weights' shapes (train type, LoRA rank and targets, quantization) must agree."""
    state = json.loads((path / layout.TRAINER_STATE).read_text())
    model_only = bool(getattr(cfg.checkpoint, "resume_only_model", False))
    if model_only:
        if facts is not None and "shape" in state:
            diff = [d for d in compare_run_facts({"shape": state["shape"]}, {"shape": facts.get("shape", {})})
                    if d.split(" ")[0].removeprefix("shape.") in WEIGHT_SHAPE]
            if diff:
                raise UserError(f"--resume_only_model: the weights of {path.name} have another shape than this "
                                f"run's model: {', '.join(diff)}")
    elif facts is not None and "data" in state:
        diff = compare_run_facts(state, facts)
        if diff and not cfg.train.ignore_data_skip:
            raise UserError(f"--resume: {path.name} was trained on other data or another run shape: "
                            f"{', '.join(diff)}; pass --ignore-data-skip to continue anyway (the data order "
                            "restarts), --resume_only_model to load its weights only, or start a new run")
        if diff:
            log(f"notice: resuming {path.name} with changed {', '.join(diff)} (--ignore-data-skip)")
    if state.get("train_type") != cfg.train.train_type:
        raise UserError(f"--resume: {path} was trained with --train-type {state.get('train_type')}, "
                        f"this run uses {cfg.train.train_type}")
    saved, here = saved_format(state), _format_of(choice)
    cross = saved != here   # DCP <-> ZeRO: through the checkpoint's universal conversion (made once)
    if cross and model_only and saved is layout.CheckpointFormat.DCP:  # refused before anything is converted
        raise UserError(f"--resume_only_model: {path} is a torch backend's checkpoint; under DeepSpeed it resumes "
                        "whole (without --resume_only_model), or its model/ folder starts a new run (--model)")
    if cross and getattr(engine, "load_universal", None) is None:  # an engine of the older Protocol
        raise UserError(f"--resume: {path} holds a {state.get('backend')} checkpoint; resume it with a "
                        f"{'DeepSpeed' if saved is layout.CheckpointFormat.DS else 'torch'} backend")
    why = weights_only_problem(path, cfg, choice, state) if state.get("save_only_model") else None
    if why:
        raise UserError(why)
    if state.get("save_only_model") and not model_only:
        # --save_only_model checkpoint: the weights and the position (step, data order) are there; the
        # optimizer, schedule and RNG states are not (ms-swift/HF resume such a checkpoint likewise)
        _load_engine(engine, path, world, state, cross, model_only=True, log=log, choice=choice)
        log(f"notice: {path.name} was saved with --save_only_model: restored the weights and the data position "
            f"(step {state.get('global_step')}); not restored: the optimizer state (AdamW moments start at zero), "
            "the LR schedule (starts again from its first step, warm-up included) and the RNG states (from --seed)")
        return state
    if model_only:
        _load_engine(engine, path, world, state, cross, model_only=True, log=log, choice=choice)
        log(f"notice: --resume_only_model: loaded the model weights of {path.name} (step "
            f"{state.get('global_step')}); optimizer, LR schedule and data order start fresh at step 0, and the "
            "data/run-shape check was skipped")
        return {**state, "global_step": 0, "resumed_from_step": state.get("global_step")}
    same_world = state.get("world_size") == world.world_size
    if (cross or (saved is layout.CheckpointFormat.DS and not same_world)) and not (cfg.optim.optimizer or cfg.optim.optim).startswith("adamw"):
        raise UserError(f"--resume: {path.name} resumes here through DeepSpeed's universal checkpoint, which "
                        f"carries AdamW's state only, and this run trains with --optim {cfg.optim.optim}; resume "
                        "it on the backend and world size that wrote it, or with --resume_only_model")
    via_universal = _load_engine(engine, path, world, state, cross, model_only=False, log=log, choice=choice)
    if same_world:
        load_rng(path / layout.RNG_DIR, world.rank)
    if cross or not same_world or via_universal:
        log(resume_notice(path, state, world, choice, cross, rng=same_world))
    return state


def weights_only_problem(path: Path | None, cfg: "RunConfig", choice: Any, state: dict | None = None) -> str | None:
    """Why this run cannot resume `path`, a --save_only_model checkpoint (None when it can, or when
    `path` is no such checkpoint): across formats the weights are read only through the universal
    conversion, which needs the optimizer state. Preflight asks before launch; the rank again."""
    if path is None:
        return None
    if state is None:
        f = path / layout.TRAINER_STATE
        state = json.loads(f.read_text()) if f.is_file() else {}
    if not state.get("save_only_model"):
        return None
    saved = saved_format(state)
    from swiftlite.config.tuner_options import PEFT_TYPES
    folder = layout.ADAPTER_DIR if state.get("train_type") in PEFT_TYPES else layout.MODEL_DIR
    if saved is layout.CheckpointFormat.DS:   # parallel/deepspeed.py: its weights are the HF folder alone
        return (f"--resume: {path.name} was saved with --save_only_model under DeepSpeed: it holds the weights "
                f"only as its {folder}/ folder, no ZeRO state to resume from (weights, optimizer, schedule); "
                f"start a new run from {path / folder}, or resume a checkpoint saved without --save_only_model")
    if getattr(cfg.checkpoint, "resume_only_model", False):
        return None
    if saved == _format_of(choice):
        return None
    return (f"--resume: {path.name} holds only the weights (--save_only_model), in a "
            f"{'DeepSpeed' if saved is layout.CheckpointFormat.DS else 'torch backend'}'s format, which this backend reads only "
            f"through a conversion that needs the optimizer state; resume it with the backend that wrote it "
            f"({state.get('backend')})" + ("; its Houlsby adapters have no HF folder to start a new run from"
                                           if cfg.train.train_type == "adapter" else
                                           f", or start a new run from its "
                                           f"{layout.ADAPTER_DIR if cfg.is_peft else layout.MODEL_DIR}/ folder"))


def saved_format(state: dict) -> layout.CheckpointFormat:
    """The format of a checkpoint's sharded state (checkpoint/layout.CheckpointFormat.of_state)."""
    return layout.CheckpointFormat.of_state(state)


def _format_of(choice: Any) -> str:
    """The checkpoint format of the backend that runs now (`BackendChoice.is_deepspeed` reads its record)."""
    return layout.CheckpointFormat.DS if getattr(choice, "is_deepspeed", False) else layout.CheckpointFormat.DCP


def _load_engine(engine: Any, path: Path, world: Any, state: dict, cross: bool, *, model_only: bool,
                 log, choice: Any) -> bool:
    """The engine's own load, or across formats its `load_universal` of the checkpoint's universal
    conversion (made once, checkpoint/universal.py). Returns whether the load went through a universal
    conversion (the engine's own load says so for another world size or ZeRO stage)."""
    if not cross:
        try:
            return bool(engine.load(str(path), model_only=True) if model_only else engine.load(str(path)))
        except TypeError as e:
            if model_only and "model_only" in str(e):  # an --external-plugins engine of the older Protocol
                raise UserError(f"--resume_only_model: the {getattr(choice, 'name', choice.key)} backend's engine "
                                "cannot load the model weights alone (its load() takes no model_only argument)") from None
            raise
    import swiftlite.checkpoint.universal as universal
    folder = universal.ensure_universal(path, world, int(state.get("global_step", -1)), log=log)
    engine.load_universal(folder, model_only=model_only)
    return True


def resume_notice(path: Path, state: dict, world: Any, choice: Any, cross: bool, rng: bool) -> str:
    """One line saying what a resume at another world size or in another format carried over."""
    how = "through DeepSpeed's universal format" if cross or saved_format(state) is layout.CheckpointFormat.DS else "through DCP"
    carried = ("the fp32 weights, the AdamW moments and step, the LR schedule, the data position (step "
               f"{state.get('global_step')})" + (" and the RNG states" if rng else ""))
    dropped = ("nothing" if rng else
               "the RNG states (another world size: they restart from the seed, which changes only dropout draws)")
    return (f"notice: resumed {path.name} ({state.get('backend')}, {state.get('world_size')} process(es)) as "
            f"{getattr(choice, 'name', choice.key)} x {world.world_size} {how}: carried over {carried}; "
            f"not carried: {dropped}")
