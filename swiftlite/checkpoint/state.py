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


def save_training_state(engine: Any, model: Any, tokenizer: Any, cfg: "RunConfig", world: Any,
                        run_dir: Path, step: int, backend: str) -> Path:
    """Write checkpoint-<step> atomically (temp folder, manifest, rename, then `latest`)."""
    from swiftlite import faults
    from swiftlite.distributed import barrier
    name = layout.checkpoint_name(step)
    tmp = run_dir / f"{layout.TMP_PREFIX}{name}"
    final = run_dir / name
    if world.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    engine.save(str(tmp))
    save_rng(tmp / layout.RNG_DIR, world.rank)
    if cfg.checkpoint.save_hf_model:
        export_weights(engine, model, tokenizer, cfg, world, tmp)
    faults.maybe_inject(step, "checkpoint")
    barrier()
    if world.is_main:
        state = {"global_step": step, "backend": backend, "world_size": world.world_size,
                 "train_type": cfg.train.train_type, "model": cfg.model.model,
                 "torch_dtype": cfg.model.torch_dtype}
        (tmp / layout.TRAINER_STATE).write_text(json.dumps(state, indent=2) + "\n")
        store.write_manifest(tmp)
        store.publish(tmp, final, run_dir)  # swap by rename, then move `latest`
        store.prune(run_dir, cfg.checkpoint.save_total_limit, keep=final)
    barrier()
    return final


def export_weights(engine: Any, model: Any, tokenizer: Any, cfg: "RunConfig", world: Any, ckpt_dir: Path) -> None:
    """model/ (an HF folder of the full weights) or adapter/ (peft format) inside a checkpoint.

    The full weights are written in --torch-dtype (16-bit for a bf16 run): under fp32 master weights
    the engine's state dict is fp32 and `write_model_folder` casts every floating tensor to the run's
    dtype, so the HF copy is what the model computes with (tests/distributed/test_master_weights.py).
    The adapter is saved as the module holds it (fp32 on the torch backends, DeepSpeed's bf16 copy
    under DeepSpeed), as peft saves it."""
    from swiftlite.hf_io import write_adapter, write_model_folder
    if cfg.is_peft:
        sd = engine.adapter_state_dict()
        if world.is_main:
            write_adapter(model, sd, ckpt_dir / layout.ADAPTER_DIR)
        return
    sd = engine.full_state_dict()
    if world.is_main:
        write_model_folder(model, sd, tokenizer, ckpt_dir / layout.MODEL_DIR, cfg.model.torch_dtype)


def load_training_state(engine: Any, path: Path, world: Any, cfg: "RunConfig", choice: Any) -> dict:
    """Restore model, optimizer, scheduler and RNG from a checkpoint; returns trainer_state."""
    state = json.loads((path / layout.TRAINER_STATE).read_text())
    if state.get("train_type") != cfg.train.train_type:
        raise UserError(f"--resume: {path} was trained with --train-type {state.get('train_type')}, "
                        f"this run uses {cfg.train.train_type}")
    backend = state.get("backend")
    if (backend == "deepspeed") != (choice.key == "deepspeed"):
        raise UserError(f"--resume: {path} holds a {backend} checkpoint; resume it with a "
                        f"{'DeepSpeed' if backend == 'deepspeed' else 'torch'} backend")
    if backend == "deepspeed" and state.get("world_size") != world.world_size:
        raise UserError(f"--resume: {path} is a DeepSpeed checkpoint of {state.get('world_size')} processes; "
                        f"ZeRO checkpoints resume only with the same world size (this run: {world.world_size})")
    engine.load(str(path))
    if state.get("world_size") == world.world_size:
        load_rng(path / layout.RNG_DIR, world.rank)
    return state
