"""bf16 = fp32 master weights + bf16 compute (docs/backends.md, "Precision"): the flag, the rules, the
DeepSpeed switches, and the two torch pieces (upcast, autocast) on toy modules. Fast: the 2-process
runs are in tests/distributed/test_master_weights.py."""

from __future__ import annotations

import json

import pytest

from swiftlite.cli import parse_run_args
from swiftlite.config import RunConfig, field_specs, load_config
from swiftlite.errors import UserError
from swiftlite.parallel.ds_config import resolve_ds_config
from swiftlite.planner import choose_backend as resolve_backend

DATA = ["--dataset", "train.jsonl", "--model", "tiny-llama-2l"]


def cfg_from(argv, world=None):
    config_file, values = parse_run_args([*DATA, *argv])
    cfg = load_config(config_file, values, validate_paths=False)
    resolve_backend(cfg, world or (cfg.parallel.nproc_per_node or 1))
    return cfg


def test_flag_has_both_spellings_and_says_the_trade_off():
    spec = field_specs()["pure_bf16"]
    assert spec.section == "parallel" and spec.default is False
    assert {"--pure-bf16", "--pure_bf16"} <= set(spec.flags)
    assert "less memory" in spec.help.lower() and "lost" in spec.help
    assert cfg_from(["--pure_bf16", "--torch-dtype", "bf16"]).parallel.pure_bf16 is True


def test_master_weights_default_for_16_bit():
    from swiftlite.optim import master_weights, trainable_dtype
    assert master_weights(cfg_from(["--torch-dtype", "bf16"]))
    assert trainable_dtype(cfg_from(["--torch-dtype", "bf16"])) == "fp32"
    assert not master_weights(cfg_from(["--torch-dtype", "fp32"]))
    pure = cfg_from(["--torch-dtype", "bf16", "--pure-bf16"])
    assert not master_weights(pure) and trainable_dtype(pure) == "bf16"


ACCEPTED = [
    ["--torch-dtype", "bf16", "--parallelism", "fsdp", "--nproc-per-node", "2"],
    ["--torch-dtype", "bf16", "--parallelism", "fsdp", "--mixed-precision", "bf16"],
    ["--torch-dtype", "bf16", "--pure-bf16", "--parallelism", "fsdp", "--mixed-precision", "none"],
    ["--torch-dtype", "fp32", "--parallelism", "fsdp1", "--mixed-precision", "bf16"],
    ["--torch-dtype", "bf16", "--pure-bf16", "--parallelism", "ddp"],
    ["--torch-dtype", "bf16", "--pure-bf16", "--parallelism", "zero3"],
    ["--torch-dtype", "bf16", "--pure-bf16", "--parallelism", "zero2"],
    ["--torch-dtype", "bf16", "--qlora", "--parallelism", "fsdp"],
    ["--torch-dtype", "bf16", "--qlora", "--pure-bf16", "--parallelism", "fsdp1"],
    ["--torch-dtype", "bf16", "--lora", "--parallelism", "fsdp1"],
]


@pytest.mark.parametrize("argv", ACCEPTED, ids=lambda a: " ".join(a))
def test_accepted(argv):
    cfg_from(argv)


REJECTED = [
    (["--pure-bf16"], "--pure-bf16 trains bf16 parameters directly"),                    # fp32 default
    (["--pure-bf16", "--torch-dtype", "fp32", "--parallelism", "fsdp"], "add --torch-dtype bf16"),
    (["--pure-bf16", "--torch-dtype", "fp32", "--parallelism", "zero3"], "add --torch-dtype bf16"),
    (["--torch-dtype", "bf16", "--parallelism", "fsdp", "--mixed-precision", "none"], "compute in fp32 too"),
    (["--torch-dtype", "bf16", "--qlora", "--parallelism", "fsdp1"], "cannot keep fp32 master weights"),
    (["--torch-dtype", "bf16", "--pure-bf16", "--parallelism", "zero3_offload"], "its own CPU Adam"),
    (["--torch-dtype", "bf16", "--pure-bf16", "--parallelism", "zero2_offload"], "its own CPU Adam"),
]


@pytest.mark.parametrize("argv,msg", REJECTED, ids=lambda a: " ".join(a) if isinstance(a, list) else "")
def test_rejected_with_one_line(argv, msg):
    with pytest.raises(UserError) as e:
        cfg_from(argv)
    assert msg in str(e.value) and "\n" not in str(e.value)


def _ds_cfg(pure: bool, dtype: str = "bf16") -> RunConfig:
    cfg = RunConfig()
    cfg.model.torch_dtype = dtype
    cfg.parallel.pure_bf16 = pure
    cfg.train.gradient_accumulation_steps = 1   # what config loading resolves (ms-swift's rule) for a real run
    return cfg


@pytest.mark.parametrize("preset", ["zero2", "zero3"])
def test_deepspeed_pure_bf16_switches(preset):
    ds = resolve_ds_config(_ds_cfg(True), 2, 64, preset)
    assert ds["bf16"] == {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    ds = resolve_ds_config(_ds_cfg(False), 2, 64, preset)
    assert ds["bf16"] == {"enabled": True}  # DeepSpeed's default: fp32 master weights


def test_deepspeed_json_must_agree_with_the_flag(tmp_path):
    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"zero_optimization": {"stage": 2},
                             "bf16": {"enabled": "auto", "bf16_master_weights_and_grads": True,
                                      "bf16_optimizer_states": "auto"}}))
    with pytest.raises(UserError, match="bf16_master_weights_and_grads=true contradicts the run"):
        resolve_ds_config(_ds_cfg(False), 1, None, str(p))
    ds = resolve_ds_config(_ds_cfg(True), 1, None, str(p))
    assert ds["bf16"]["bf16_optimizer_states"] is True
    p.write_text(json.dumps({"bf16": {"enabled": "auto", "bf16_master_weights_and_grads": "auto"}}))
    with pytest.raises(UserError, match="need ZeRO stage 1-3"):
        resolve_ds_config(_ds_cfg(True), 1, None, str(p))


def test_upcast_trainable_leaves_frozen_weights():
    import torch

    from swiftlite.optim import upcast_trainable
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)).to(torch.bfloat16)
    m[0].requires_grad_(False)
    before = m[1].weight.detach().clone()
    assert upcast_trainable(m) == ["1.weight", "1.bias"]
    assert m[0].weight.dtype == torch.bfloat16 and m[1].weight.dtype == torch.float32
    assert torch.equal(m[1].weight.detach(), before.float())  # exact: the master starts at the bf16 weights


def test_autocast_forward_computes_in_bf16_with_fp32_gradients():
    import torch

    from swiftlite.distributed import World
    from swiftlite.parallel.torch_engine import autocast_forward
    m = torch.nn.Linear(8, 8)
    world = World(rank=0, local_rank=0, world_size=1, device="cpu")
    assert not autocast_forward(m, _ds_cfg(True), world)          # --pure-bf16: nothing marked
    assert autocast_forward(m, _ds_cfg(False), world)
    device_type, dtype = m._swiftlite_autocast                     # what TorchEngine.forward enters
    with torch.autocast(device_type=device_type, dtype=dtype):
        out = m(torch.randn(2, 8))
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert m.weight.grad.dtype == torch.float32 and m.weight.dtype == torch.float32
    assert "weight" in m.state_dict()  # the mark is not a module: names unchanged
