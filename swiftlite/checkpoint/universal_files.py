"""The files of a universal folder that DeepSpeed's converter does not write: one layout that both
of DeepSpeed's universal loaders read (ZeRO-1/2 and ZeRO-3), and a DCP checkpoint in that layout.

DeepSpeed 0.19.8's `ds_to_universal` writes each source stage in the form its own loader expects,
and the two loaders disagree:

    zero/<param>/fp32.pt ...   ZeRO-1/2: {"param": tensor, "cat_dim": 0} + step.pt;  ZeRO-3: a flat tensor
    zero/optimizer_state.pt     ZeRO-1/2 loader needs "ds_version";  ZeRO-3 loader needs
                                "optimizer_state_dict"["state"][0]["step"]
    <model-states file>         ZeRO-1/2 loader globs mp_rank_*_model_states.pt;  ZeRO-3 loader
                                zero_pp_rank_0_mp_rank_*_model_states.pt

`normalize` gives every conversion all of these (a ZeRO-3 checkpoint then resumes under ZeRO-2 and
the other way round), and `from_dcp` writes a torch backend's DCP checkpoint (model + AdamW state +
LR schedule) as the same files, so that DeepSpeed's loader re-partitions it for a ZeRO run. Every
file read here goes through the allow-list loaders of safety.py.
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from typing import Any

import swiftlite.checkpoint.layout as layout
from swiftlite.checkpoint.safety import one_line, safe_torch_load
from swiftlite.errors import UserError

ZERO2_MODEL_STATES = "mp_rank_00_model_states.pt"
ZERO3_MODEL_STATES = "zero_pp_rank_0_mp_rank_00_model_states.pt"
OPTIMIZER_STATE = "optimizer_state.pt"


def load(path: Path) -> Any:
    """A file of a DeepSpeed checkpoint or conversion: weights-only, DeepSpeed's few data classes
    allowed (safety.DEEPSPEED_SAFE_GLOBALS), memory-mapped."""
    import torch
    with safe_torch_load():
        return torch.load(str(path), map_location="cpu", weights_only=True)


def _save(obj: Any, path: Path) -> None:
    """torch.save through a new file and a rename: `_load` memory-maps, and writing over a mapped file
    in place would pull the pages from under tensors still in use (SIGBUS)."""
    import os

    import torch
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    torch.save(obj, str(tmp))
    os.replace(tmp, path)


def _deepspeed_version() -> str:
    import deepspeed
    return str(deepspeed.__version__)


def normalize(ds_dir: Path, stage3: bool) -> None:
    """Make DeepSpeed's conversion of a ZeRO-1/2 (stage3=False) or ZeRO-3 checkpoint readable by
    both universal loaders (module docstring)."""
    zero = ds_dir / "zero"
    optim = load(zero / OPTIMIZER_STATE)
    if stage3:
        model_states = ds_dir / ZERO3_MODEL_STATES
        shapes = {k: v for group in load(model_states)["param_shapes"] for k, v in group.items()}
        step = optim["optimizer_state_dict"]["state"][0]["step"]
        for name, shape in shapes.items():
            for key in ("fp32", "exp_avg", "exp_avg_sq"):
                f = zero / name / f"{key}.pt"
                t = load(f)
                if not isinstance(t, dict):
                    _save({"param": t.reshape(shape).clone(), "cat_dim": 0}, f)
            _save(step, zero / name / "step.pt")
        optim.pop("fp32_flat_groups", None)  # rank 0's own partition: read by neither loader
        optim.setdefault("ds_version", _deepspeed_version())
        shutil.copy2(model_states, ds_dir / ZERO2_MODEL_STATES)
    else:
        steps = sorted(zero.glob("*/step.pt"))
        if not steps:
            raise UserError(f"{ds_dir}: the conversion holds no optimizer step")
        optim["optimizer_state_dict"] = {"state": {0: {"step": load(steps[0])}},
                                         "param_groups": optim["param_groups"]}
        shutil.copy2(ds_dir / ZERO2_MODEL_STATES, ds_dir / ZERO3_MODEL_STATES)
    _save(optim, zero / OPTIMIZER_STATE)


def _dcp_bytes(dcp_dir: Path, md: Any, key: str) -> Any:
    """A non-tensor DCP item (an optimizer hyper-parameter), read as check_dcp_metadata reads it:
    torch's weights-only loader on its bytes."""
    import torch
    for index, info in (md.storage_data or {}).items():
        if getattr(index, "fqn", None) == key:
            with (dcp_dir / info.relative_path).open("rb") as fh:
                fh.seek(int(info.offset))
                blob = fh.read(int(info.length))
            return torch.load(io.BytesIO(blob), weights_only=True, map_location="cpu")
    raise KeyError(key)


def from_dcp(ckpt: Path, ds_dir: Path) -> None:
    """Write the DCP checkpoint `ckpt/dcp/` (+ scheduler.json, trainer_state.json) as a universal
    folder `ds_dir`: per parameter its fp32 weight, exp_avg, exp_avg_sq and step, the optimizer's
    parameter groups, and a model-states file with the LR schedule and the step counters."""
    import torch

    from swiftlite.checkpoint.readers.dcp import DCPReader
    from swiftlite.checkpoint.safety import load_dcp_metadata
    dcp_dir = ckpt / layout.DCP_DIR
    model = DCPReader(dcp_dir, prefix="model.")          # checks every pickle first
    optim = DCPReader(dcp_dir, prefix="optim.state.")
    md = load_dcp_metadata(dcp_dir)
    groups: list[dict] = []
    prefixes = sorted({k.split(".")[2] for k in md.state_dict_metadata if k.startswith("optim.param_groups.")}, key=int)
    for i in prefixes:
        head = f"optim.param_groups.{i}."
        groups.append({k[len(head):]: _dcp_bytes(dcp_dir, md, k) for k in md.state_dict_metadata if k.startswith(head)})
    names = [n for g in groups for n in g.get("params", [])]
    missing = [n for n in names if n not in model.info or f"{n}.exp_avg" not in optim.info]
    if not groups or missing:
        raise UserError(f"--resume: {dcp_dir} holds no AdamW state for {', '.join(missing[:3]) or 'any parameter'}; "
                        "it cannot be resumed under DeepSpeed (--resume_only_model loads its weights only)")
    zero = ds_dir / "zero"
    step = None
    for name in names:
        w = model.read([name])[name]
        st = optim.read([f"{name}.{k}" for k in ("exp_avg", "exp_avg_sq", "step")])
        for key, t in (("fp32", w), ("exp_avg", st[f"{name}.exp_avg"]), ("exp_avg_sq", st[f"{name}.exp_avg_sq"])):
            _save({"param": t.float().contiguous(), "cat_dim": 0}, zero / name / f"{key}.pt")
        step = torch.as_tensor(st[f"{name}.step"], dtype=torch.float32)
        _save(step, zero / name / "step.pt")
    flat_groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(range(len(g["params"])))}
                   for g in groups]
    _save({"ds_version": _deepspeed_version(), "param_groups": flat_groups,
           "optimizer_state_dict": {"state": {0: {"step": step}}, "param_groups": flat_groups}},
          zero / OPTIMIZER_STATE)
    try:
        sched = json.loads((ckpt / layout.SCHEDULER).read_text())
        trainer = json.loads((ckpt / layout.TRAINER_STATE).read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"--resume: {ckpt}: unreadable LR schedule or trainer state ({one_line(e)})") from None
    steps = int(trainer["global_step"])
    states = {"module": {}, "buffer_names": [], "optimizer": None, "lr_scheduler": sched, "skipped_steps": 0,
              "global_steps": steps, "dp_world_size": int(trainer.get("world_size", 1)), "mp_world_size": 1,
              "ds_version": _deepspeed_version()}
    _save(states, ds_dir / ZERO2_MODEL_STATES)
    _save(states, ds_dir / ZERO3_MODEL_STATES)
