"""DeepSpeed JSON presets: loading, "auto" filling, and what is rejected (no torch, no deepspeed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from swiftlite.config import RunConfig
from swiftlite.errors import UserError
from swiftlite.parallel.ds_config import (PRESET_DIR, ds_stage, fill_auto, load_ds_config, offload_devices,
                                          preset_names, resolve_ds_config, validate_ds_config)

PRESETS = ["zero0", "zero1", "zero2", "zero2_offload", "zero3", "zero3pp", "zero3_offload", "zero3_offload_nvme"]
REPO = Path(__file__).resolve().parents[2]


def make_cfg(**kw) -> RunConfig:
    cfg = RunConfig()
    cfg.train.per_device_train_batch_size = kw.pop("micro", 2)
    cfg.train.gradient_accumulation_steps = kw.pop("gas", 4)
    cfg.optim.max_grad_norm = kw.pop("clip", 1.0)
    cfg.model.torch_dtype = kw.pop("dtype", "bf16")
    cfg.parallel.offload_dir = kw.pop("offload_dir", None)
    cfg.parallel.parallelism = kw.pop("parallelism", "zero3")
    assert not kw, kw
    return cfg


def write(tmp_path: Path, data, name="ds.json") -> str:
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else json.dumps(data, indent=2))
    return str(p)


def test_presets_shipped_and_symlinked():
    assert preset_names() == sorted(PRESETS)
    assert PRESET_DIR.parent.name == "swiftlite"   # inside the package, so an install has them
    top = REPO / "ds_configs"
    for name in PRESETS:
        assert (top / f"{name}.json").read_text() == (PRESET_DIR / f"{name}.json").read_text()


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_fills_completely(name):
    ds = fill_auto(load_ds_config(name), make_cfg(offload_dir="/nvme"), world_size=8, hidden_size=4096)
    validate_ds_config(ds, 8)
    assert "auto" not in json.dumps(ds)
    assert ds["train_micro_batch_size_per_gpu"] == 2
    assert ds["gradient_accumulation_steps"] == 4
    assert ds["train_batch_size"] == 2 * 4 * 8
    assert ds["gradient_clipping"] == 1.0
    assert ds["bf16"]["enabled"] is True and ds["fp16"]["enabled"] is False
    zo = ds["zero_optimization"]
    assert zo["reduce_bucket_size"] == 4096 * 4096
    if ds_stage(ds) == 3:
        assert zo["stage3_prefetch_bucket_size"] == int(0.9 * 4096 * 4096)
        assert zo["stage3_param_persistence_threshold"] == 10 * 4096
        assert zo["stage3_gather_16bit_weights_on_model_save"] is True


def test_preset_stages_and_offload():
    expect = {"zero2": (2, ("none", "none")), "zero2_offload": (2, ("cpu", "none")),
              "zero3": (3, ("none", "none")), "zero3_offload": (3, ("cpu", "cpu")),
              "zero3_offload_nvme": (3, ("nvme", "nvme"))}
    for name, (stage, devs) in expect.items():
        ds = load_ds_config(name)
        assert ds_stage(ds) == stage and offload_devices(ds) == devs, name
    assert load_ds_config("zero3.json") == load_ds_config("zero3")


def test_fp16_and_fp32_dtype():
    ds = fill_auto(load_ds_config("zero2"), make_cfg(dtype="fp16"), 1, 64)
    assert ds["fp16"]["enabled"] is True and ds["bf16"]["enabled"] is False
    ds = fill_auto(load_ds_config("zero2"), make_cfg(dtype="fp32"), 1, 64)
    assert ds["fp16"]["enabled"] is False and ds["bf16"]["enabled"] is False


def test_missing_precision_block_follows_dtype(tmp_path):
    ds = fill_auto({"zero_optimization": {"stage": 2}}, make_cfg(dtype="bf16"), 2, 64)
    assert ds["bf16"] == {"enabled": True} and "fp16" not in ds
    assert ds["train_micro_batch_size_per_gpu"] == 2 and ds["gradient_accumulation_steps"] == 4


def test_contradicting_micro_batch_names_both(tmp_path):
    d = load_ds_config("zero2")
    d["train_micro_batch_size_per_gpu"] = 4
    with pytest.raises(UserError) as e:
        fill_auto(d, make_cfg(micro=2), 1, 64)
    msg = str(e.value)
    assert "train_micro_batch_size_per_gpu=4" in msg and "--per-device-train-batch-size 2" in msg


@pytest.mark.parametrize("key,value,flag", [
    ("gradient_accumulation_steps", 8, "--gradient-accumulation-steps 4"),
    ("gradient_clipping", 0.5, "--max-grad-norm 1.0"),
])
def test_contradicting_scalars(key, value, flag):
    d = load_ds_config("zero3")
    d[key] = value
    with pytest.raises(UserError, match=flag):
        fill_auto(d, make_cfg(), 1, 64)


def test_explicit_value_that_agrees_is_kept():
    d = load_ds_config("zero2")
    d["train_micro_batch_size_per_gpu"] = 2
    d["gradient_clipping"] = 1.0
    ds = fill_auto(d, make_cfg(), 1, 64)
    assert ds["train_micro_batch_size_per_gpu"] == 2


def test_precision_contradiction():
    d = load_ds_config("zero2")
    d["bf16"]["enabled"] = True
    with pytest.raises(UserError, match=r"bf16.enabled=true contradicts --torch-dtype fp32"):
        fill_auto(d, make_cfg(dtype="fp32"), 1, 64)
    d = load_ds_config("zero2")
    d["fp16"]["enabled"] = False
    with pytest.raises(UserError, match="fp16.enabled=false contradicts --torch-dtype fp16"):
        fill_auto(d, make_cfg(dtype="fp16"), 1, 64)


def test_both_precisions_rejected():
    with pytest.raises(UserError, match="both true"):
        validate_ds_config({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, 1)


def test_batch_arithmetic():
    d = load_ds_config("zero2")
    d["train_batch_size"] = 32
    ds = fill_auto(d, make_cfg(micro=2, gas=4), world_size=2, hidden_size=64)
    with pytest.raises(UserError) as e:
        validate_ds_config(ds, 2)
    assert "train_batch_size=32" in str(e.value) and "2 x gradient_accumulation_steps 4 x world size 2 = 16" \
        in str(e.value)
    d["train_batch_size"] = 16
    validate_ds_config(fill_auto(d, make_cfg(micro=2, gas=4), 2, 64), 2)


def test_offload_param_with_stage2_rejected():
    d = load_ds_config("zero2_offload")
    d["zero_optimization"]["offload_param"] = {"device": "cpu"}
    ds = fill_auto(d, make_cfg(), 1, 64)
    with pytest.raises(UserError, match="offload_param .*needs ZeRO stage 3, got stage 2"):
        validate_ds_config(ds, 1)
    d["zero_optimization"]["offload_param"] = {"device": "none"}
    validate_ds_config(fill_auto(d, make_cfg(), 1, 64), 1)   # "none" is fine


def test_nvme_needs_offload_dir():
    with pytest.raises(UserError, match="--offload-dir"):
        fill_auto(load_ds_config("zero3_offload_nvme"), make_cfg(offload_dir=None), 1, 64)
    ds = fill_auto(load_ds_config("zero3_offload_nvme"), make_cfg(offload_dir="/mnt/nvme"), 1, 64)
    assert ds["zero_optimization"]["offload_param"]["nvme_path"] == "/mnt/nvme"
    assert ds["zero_optimization"]["offload_optimizer"]["nvme_path"] == "/mnt/nvme"


def test_nvme_explicit_path_vs_flag():
    d = load_ds_config("zero3_offload_nvme")
    d["zero_optimization"]["offload_param"]["nvme_path"] = "/a"
    d["zero_optimization"]["offload_optimizer"]["nvme_path"] = "/a"
    assert fill_auto(d, make_cfg(), 1, 64)["zero_optimization"]["offload_param"]["nvme_path"] == "/a"
    with pytest.raises(UserError, match="nvme_path=/a contradicts --offload-dir /b"):
        fill_auto(d, make_cfg(offload_dir="/b"), 1, 64)


def test_nvme_device_without_path_rejected():
    d = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}
    with pytest.raises(UserError, match="nvme_path"):
        validate_ds_config(fill_auto(d, make_cfg(), 1, 64), 1)


def test_malformed_json_has_line_and_col(tmp_path):
    path = write(tmp_path, '{\n  "train_batch_size": "auto",\n  "zero_optimization": {"stage": 3,}\n}\n')
    with pytest.raises(UserError) as e:
        load_ds_config(path)
    assert str(e.value).startswith(f"{path}:3:")
    assert "invalid JSON" in str(e.value)
    assert "\n" not in str(e.value)


def test_json_must_be_object(tmp_path):
    with pytest.raises(UserError, match="JSON object"):
        load_ds_config(write(tmp_path, "[1, 2]"))


def test_unknown_preset_lists_presets():
    with pytest.raises(UserError) as e:
        load_ds_config("zero4")
    for name in PRESETS:
        assert name in str(e.value)


def test_missing_file():
    with pytest.raises(UserError, match="file not found: /nope/ds.json"):
        load_ds_config("/nope/ds.json")


def test_user_file_is_used(tmp_path):
    d = load_ds_config("zero3")
    d["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    path = write(tmp_path, d)
    cfg = make_cfg(parallelism=path)
    ds = resolve_ds_config(cfg, 2, 64, path)
    assert ds["zero_optimization"]["stage3_param_persistence_threshold"] == 0  # explicit value kept
    assert ds["zero_optimization"]["reduce_bucket_size"] == 64 * 64


def test_unknown_hidden_size_drops_bucket_autos():
    ds = fill_auto(load_ds_config("zero3"), make_cfg(), 1, None)
    zo = ds["zero_optimization"]
    assert "reduce_bucket_size" not in zo and "stage3_prefetch_bucket_size" not in zo
    validate_ds_config(ds, 1)


def test_leftover_auto_rejected():
    d = load_ds_config("zero2")
    d["zero_optimization"]["allgather_bucket_size"] = "auto"
    ds = fill_auto(d, make_cfg(), 1, 64)
    with pytest.raises(UserError, match="zero_optimization.allgather_bucket_size is \"auto\""):
        validate_ds_config(ds, 1)


def test_optimizer_block_auto_dropped_and_contradiction_rejected():
    d = load_ds_config("zero2")
    d["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                  "weight_decay": "auto"}}
    d["scheduler"] = {"type": "WarmupDecayLR", "params": {"warmup_num_steps": "auto"}}
    ds = fill_auto(d, make_cfg(), 1, 64)
    assert "optimizer" not in ds and "scheduler" not in ds
    d["optimizer"]["params"]["lr"] = 0.5
    with pytest.raises(UserError, match="optimizer.params.lr=0.5 contradicts --learning-rate"):
        fill_auto(d, make_cfg(), 1, 64)
    d["optimizer"] = {"type": "Lamb"}
    with pytest.raises(UserError, match="AdamW"):
        fill_auto(d, make_cfg(), 1, 64)
    d = load_ds_config("zero2")
    d["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}
    with pytest.raises(UserError, match="--lr-scheduler"):
        fill_auto(d, make_cfg(), 1, 64)


def test_fill_does_not_mutate_input():
    d = load_ds_config("zero3")
    before = json.dumps(d, sort_keys=True)
    fill_auto(d, make_cfg(), 4, 64)
    assert json.dumps(d, sort_keys=True) == before


def test_ds_stage():
    assert ds_stage({}) == 0
    assert ds_stage({"zero_optimization": {"stage": 3}}) == 3
    with pytest.raises(UserError, match="stage"):
        ds_stage({"zero_optimization": {"stage": "x"}})


def test_stale_op_build_lock_is_named(tmp_path):
    from swiftlite.parallel.deepspeed import check_extension_locks, stale_extension_locks
    check_extension_locks(str(tmp_path))                       # empty cache: fine
    (tmp_path / "deepspeed_shm_comm").mkdir()
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    lock.write_text("")
    assert stale_extension_locks(str(tmp_path)) == [str(lock)]
    with pytest.raises(UserError, match=f"stale DeepSpeed op-build lock {lock}"):
        check_extension_locks(str(tmp_path))


def test_ds_env_defaults_single_process(monkeypatch, tmp_path):
    pytest.importorskip("torch")
    from swiftlite.parallel.deepspeed import ds_env_defaults
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "DS_ACCELERATOR",
              "TORCH_EXTENSIONS_DIR", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    import os
    import torch
    set_ = ds_env_defaults()
    assert os.environ["RANK"] == "0" and os.environ["WORLD_SIZE"] == "1"
    assert 0 < int(os.environ["MASTER_PORT"]) < 65536
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(tmp_path / ".cache/swiftlite/torch_extensions")
    if not torch.cuda.is_available():
        assert os.environ["DS_ACCELERATOR"] == "cpu"
    assert set(set_) >= {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCH_EXTENSIONS_DIR"}
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/custom")
    ds_env_defaults()
    assert os.environ["TORCH_EXTENSIONS_DIR"] == "/custom"      # a user's setting wins
