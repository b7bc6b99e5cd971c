"""checkpoint/universal.py without training: what a ZeRO folder's file names say, when a universal
conversion is reused or redone, and which cross-format resumes are refused before anything is
converted (the resumes themselves: tests/e2e/test_resume_world_size.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from swiftlite.checkpoint import universal
from swiftlite.checkpoint.safety import check_checkpoint_safe
from swiftlite.checkpoint.state import load_training_state
from swiftlite.checkpoint.store import write_manifest
from swiftlite.config import build_config
from swiftlite.errors import UserError


class Evil:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _touch(d: Path, *names: str) -> None:
    d.mkdir(parents=True, exist_ok=True)
    for n in names:
        (d / n).write_bytes(b"")


def test_zero_layout_from_file_names(tmp_path):
    ckpt = tmp_path / "checkpoint-4"
    _touch(ckpt / "dcp", ".metadata")
    assert universal.zero_layout(ckpt) is None                      # a torch backend's checkpoint
    ds = ckpt / "ds"
    _touch(ds, "mp_rank_00_model_states.pt", *(f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(2)))
    assert universal.zero_layout(ckpt) == universal.ZeroLayout(stage3=False, world_size=2)
    _touch(ds, *(f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(2)))
    assert universal.zero_layout(ckpt) == universal.ZeroLayout(stage3=True, world_size=2)
    _touch(ds, "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt")     # ZeRO-1 with bf16 names them so
    assert universal.zero_layout(ckpt).world_size == 3


def _converted(ckpt: Path, payload) -> Path:
    zero = ckpt / "ds_universal" / "ds" / "zero" / "w"
    zero.mkdir(parents=True)
    torch.save(payload, zero / "fp32.pt")
    write_manifest(ckpt / "ds_universal")
    return zero / "fp32.pt"


def test_a_conversion_is_reused_only_while_intact(tmp_path):
    ckpt = tmp_path / "checkpoint-4"
    f = _converted(ckpt, {"param": torch.ones(3), "cat_dim": 0})
    assert universal.is_converted(ckpt)
    data = bytearray(f.read_bytes())
    data[-30] ^= 0xFF
    f.write_bytes(bytes(data))
    assert not universal.is_converted(ckpt)                        # fails its manifest: converted again


def test_a_planted_conversion_is_never_loaded(tmp_path):
    """The checkpoint-wide pickle check leaves ds_universal/ (and a conversion in progress) to
    universal.py, which refuses to reuse one that holds code, even with a matching manifest."""
    ckpt = tmp_path / "checkpoint-4"
    marker = tmp_path / "ran"
    _converted(ckpt, Evil(marker))
    tmp = ckpt / ".tmp-ds_universal"
    tmp.mkdir()
    (tmp / "optimizer_state.pt").write_bytes(b"PK\x03\x04 truncated by a kill")
    check_checkpoint_safe(ckpt)                                      # neither folder is read from here
    assert not universal.is_converted(ckpt)
    assert not marker.exists()


def _state(ckpt: Path, backend: str, world_size: int = 1) -> None:
    ckpt.mkdir(parents=True, exist_ok=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 4, "backend": backend,
                                                         "world_size": world_size, "train_type": "full"}))


def test_cross_format_refusals_come_before_any_conversion(tmp_path):
    ckpt = tmp_path / "checkpoint-4"
    _state(ckpt, "single")
    _touch(ckpt / "dcp", ".metadata")
    zero3 = SimpleNamespace(key="deepspeed", is_deepspeed=True, name="zero3")
    ds_engine = SimpleNamespace(ds=object(), stage=3, load=lambda *a, **k: None)
    world = SimpleNamespace(world_size=1, rank=0, is_main=True)
    with pytest.raises(UserError, match="--resume_only_model: .* is a torch backend's checkpoint"):
        load_training_state(ds_engine, ckpt, world, build_config({"train_type": "full", "resume_only_model": True}),
                            zero3)
    # an engine from --external-plugins has neither a DeepSpeed engine nor torch's state-dict target
    toy = SimpleNamespace(load=lambda *a, **k: None)
    with pytest.raises(UserError, match="holds a single checkpoint; resume it with a torch backend"):
        load_training_state(toy, ckpt, world, build_config({"train_type": "full"}), zero3)
    _state(ckpt, "deepspeed", 2)
    with pytest.raises(UserError, match="holds a deepspeed checkpoint; resume it with a DeepSpeed backend"):
        load_training_state(toy, ckpt, world, build_config({"train_type": "full"}),
                            SimpleNamespace(key="toy", is_deepspeed=False, name="toy"))
    assert not any(p.name.endswith("ds_universal") for p in ckpt.iterdir())
