"""--train_type boft, adalora and bone (peft's MiSS) end to end: `swiftlite sft` on a tiny preset, the
adapter peft reloads, the merged export that `--verify` checks against peft's model, 2 processes (gloo:
DDP for all, FSDP2, FSDP1 and ZeRO-2/3 for BOFT, FSDP2 and ZeRO-3 for Bone) giving the 1-process run's
losses and adapter (and AdaLoRA's rank pattern), resumes, and the backends AdaLoRA refuses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import read_losses, run_cli

BASE = ["--model", "tiny-llama-2l", "--torch_dtype", "fp32", "--per_device_train_batch_size", "1",
        "--gradient_accumulation_steps", "2", "--max_steps", "4", "--save_steps", "4", "--logging_steps", "1",
        "--learning_rate", "1e-2", "--seed", "7"]
# lora_dropout 0: dropout masks are drawn from each rank's generator, so 2 processes would not match 1
ADALORA = ["--lora_dropout", "0", "--train_type", "adalora", "--adalora_init_r", "4", "--adalora_target_r", "2",
           "--adalora_tinit", "1", "--adalora_tfinal", "1"]
BOFT = ["--train_type", "boft"]
BONE = ["--train_type", "bone"]   # ms-swift's defaults: --reft_rank 4, --init_weights true


def _sft(demo_data, out: Path, *extra: str) -> Path:
    run_cli(["sft", *BASE, "--dataset", demo_data[0], "--output_dir", out, *extra])
    return out / "checkpoint-4" / "adapter"


def _reload(adapter: Path):
    from peft import PeftModel

    from swiftlite.models.loading import load_model
    from swiftlite.config import load_config
    from swiftlite.cli import parse_run_args
    cf, values = parse_run_args(["--model", "tiny-llama-2l", "--dataset", "x.jsonl", "--torch_dtype", "fp32"])
    base = load_model(load_config(cf, values, validate_paths=False))
    from swiftlite.models.tuners import boft_layers
    with boft_layers(1, "x"):
        return PeftModel.from_pretrained(base, str(adapter))


def _export_verifies(ckpt: Path, tmp_path: Path) -> None:
    proc = run_cli(["export", "--ckpt", ckpt, "--merge_lora", "true", "--verify", "--output", tmp_path / "merged"])
    assert "verify: checks: passed" in proc.stdout + proc.stderr
    names = load_file(str(next((tmp_path / "merged").glob("*.safetensors")))).keys()
    assert not [n for n in names if "boft_" in n or "lora_" in n or "miss_" in n]


def test_boft_trains_saves_reloads_and_exports(demo_data, tmp_path):
    adapter = _sft(demo_data, tmp_path / "run", *BOFT)
    sd = load_file(str(adapter / "adapter_model.safetensors"))
    conf = json.loads((adapter / "adapter_config.json").read_text())
    assert conf["peft_type"] == "BOFT" and conf["boft_block_size"] == 4
    assert sd and all(k.endswith((".boft_R", ".boft_s")) for k in sd)
    # trained: peft starts boft_R at 0 (the identity rotation) and boft_s at 1
    assert any(k.endswith(".boft_R") and v.abs().max() > 0 for k, v in sd.items())
    assert any(k.endswith(".boft_s") and not torch.allclose(v, torch.ones_like(v)) for k, v in sd.items())
    m = _reload(adapter)
    live = {k: v for k, v in m.state_dict().items() if ".boft_R" in k or ".boft_s" in k}
    for k, v in sd.items():
        torch.testing.assert_close(live[k.replace(".boft_R", ".boft_R.default").replace(".boft_s", ".boft_s.default")], v)
    _export_verifies(tmp_path / "run" / "checkpoint-4", tmp_path)


def test_adalora_allocates_ranks_saves_reloads_and_exports(demo_data, tmp_path):
    adapter = _sft(demo_data, tmp_path / "run", *ADALORA)
    conf = json.loads((adapter / "adapter_config.json").read_text())
    assert conf["peft_type"] == "ADALORA" and conf["total_step"] == 4 and conf["init_r"] == 4
    pattern = conf["rank_pattern"]
    assert pattern, "update_and_allocate never ran: no rank pattern"
    kept = {k: sum(v) for k, v in pattern.items()}
    assert sum(kept.values()) == 2 * len(kept) and min(kept.values()) < 4   # target_r 2 on average, pruned
    sd = load_file(str(adapter / "adapter_model.safetensors"))
    for k, r in kept.items():   # peft saves each layer at its kept rank
        assert sd[f"base_model.model.{k}"].shape[0] == r
    m = _reload(adapter)
    layer = m.base_model.model.model.layers[0].self_attn.q_proj
    assert layer.lora_A["default"].shape[0] == kept["model.layers.0.self_attn.q_proj.lora_E"]
    _export_verifies(tmp_path / "run" / "checkpoint-4", tmp_path)


@pytest.mark.parametrize("init", ["true", "bat"])
def test_bone_trains_saves_reloads_and_exports(init, demo_data, tmp_path):
    """ms-swift's Bone as peft's MiSS: the adapter on every linear but lm_head, r = --reft_rank, trained
    away from its zero start; peft reloads it; the merged export passes --verify (peft's model)."""
    adapter = _sft(demo_data, tmp_path / "run", *BONE, "--init_weights", init)
    sd = load_file(str(adapter / "adapter_model.safetensors"))
    conf = json.loads((adapter / "adapter_config.json").read_text())
    assert conf["peft_type"] == "MISS" and conf["r"] == 4 and conf["init_weights"] == (True if init == "true" else init)
    assert len(sd) == 14 and all(k.endswith(".miss_block") for k in sd)   # 7 linears x 2 layers, no lm_head
    shape = (4, 64) if init == "true" else (16, 4, 4)   # q_proj of tiny-llama-2l: 64 x 64
    assert sd["base_model.model.model.layers.0.self_attn.q_proj.miss_block"].shape == shape
    assert all(v.abs().max() > 0 for v in sd.values())
    m = _reload(adapter)
    live = {k: v for k, v in m.state_dict().items() if ".miss_block" in k}
    for k, v in sd.items():
        torch.testing.assert_close(live[k + ".default"], v)
    _export_verifies(tmp_path / "run" / "checkpoint-4", tmp_path)


# The pairs marked long repeat a tuner on a backend family another pair already covers in CI.
_L = pytest.mark.long


# bone-bat on zero3: MiSS's bat forward reads the base weight outside the base layer's own forward, which
# ZeRO-3 gathers as an external parameter on access
@pytest.mark.parametrize("kind,parallelism", [pytest.param("bone", "ddp", marks=_L), ("bone", "fsdp"),
                                              pytest.param("bone", "zero3", marks=_L), ("bone-bat", "zero3"),
                                              pytest.param("boft", "ddp", marks=_L), pytest.param("boft", "fsdp", marks=_L),
                                              ("boft", "fsdp1"), pytest.param("boft", "zero2", marks=_L),
                                              ("boft", "zero3"), ("adalora", "ddp")])
def test_two_processes_match_one(kind, parallelism, demo_data, tmp_path):
    extra = {"boft": BOFT, "bone": BONE, "bone-bat": [*BONE, "--init_weights", "bat"]}.get(kind, ADALORA)
    one = _sft(demo_data, tmp_path / "one", *extra)
    two = _sft(demo_data, tmp_path / "two", *extra, "--nproc_per_node", "2", "--parallelism", parallelism,
               "--gradient_accumulation_steps", "1")
    l1, l2 = read_losses(tmp_path / "one"), read_losses(tmp_path / "two")
    assert sorted(l1) == sorted(l2) == [1, 2, 3, 4]
    for s in l1:
        assert l1[s] == pytest.approx(l2[s], rel=1e-4, abs=1e-5), (s, l1, l2)
    a, b = load_file(str(one / "adapter_model.safetensors")), load_file(str(two / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-3, atol=1e-4)
    if kind == "adalora":
        assert (json.loads((one / "adapter_config.json").read_text())["rank_pattern"]
                == json.loads((two / "adapter_config.json").read_text())["rank_pattern"])


@pytest.mark.parametrize("parallelism", ["fsdp", pytest.param("zero2", marks=_L), pytest.param("zero3", marks=_L)])
def test_adalora_refused_on_sharding_backends(parallelism, demo_data, tmp_path):
    out = tmp_path / "run"
    proc = run_cli(["sft", *BASE, *ADALORA, "--dataset", demo_data[0], "--output_dir", out, "--nproc_per_node", "2",
                    "--parallelism", parallelism], check=False)
    assert proc.returncode == 2, proc.stderr
    assert f"--train_type adalora with --parallelism {parallelism}: peft's rank allocation" in proc.stderr
    assert not out.exists()


def test_adalora_resumes_in_its_final_phase(demo_data, tmp_path):
    """A run stopped after step 4 of 6 with --adalora_tfinal 3 resumes in the phase where peft re-applies
    the final rank pattern each step: the pattern comes from the checkpoint's adapter/, and the resumed
    run ends with the uninterrupted run's rank pattern and masks."""
    args = ["sft", "--model", "tiny-llama-2l", "--torch_dtype", "fp32", "--per_device_train_batch_size", "1",
            "--gradient_accumulation_steps", "1", "--max_steps", "6", "--save_steps", "4", "--learning_rate", "1e-2",
            *ADALORA[:-2], "--adalora_tfinal", "3", "--dataset", demo_data[0]]
    run_cli([*args, "--output_dir", tmp_path / "whole"])
    from tests.conftest import cli_env
    stopped = run_cli([*args, "--output_dir", tmp_path / "cut"], check=False,
                      env=cli_env(SWIFTLITE_FAULT="step=5,kind=raise"))
    assert stopped.returncode != 0 and (tmp_path / "cut" / "checkpoint-4").is_dir()
    run_cli([*args, "--output_dir", tmp_path / "cut", "--resume", "true"])
    whole, cut = tmp_path / "whole" / "checkpoint-6" / "adapter", tmp_path / "cut" / "checkpoint-6" / "adapter"
    pattern = json.loads((whole / "adapter_config.json").read_text())["rank_pattern"]
    assert pattern and json.loads((cut / "adapter_config.json").read_text())["rank_pattern"] == pattern
    a, b = load_file(str(whole / "adapter_model.safetensors")), load_file(str(cut / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(a[k].shape == b[k].shape for k in a)


@pytest.mark.parametrize("kind", ["boft", "bone"])
def test_dpo_uses_the_adapter_off_as_reference(kind, tmp_path):
    """rlhf with BOFT or Bone: the reference is the base with the adapter disabled, so the first step's DPO
    loss is log 2 exactly (BOFT starts as the identity rotation, Bone's block at zero), and training moves
    the margins."""
    import math

    from swiftlite.rlhf.demo import write_preference_data
    train, _ = write_preference_data(tmp_path / "pairs", n_train=12, n_val=4)
    run = tmp_path / "dpo"
    proc = run_cli(["rlhf", "--rlhf_type", "dpo", "--model", "tiny-llama-2l", "--torch_dtype", "fp32",
                    "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1", "--logging_steps",
                    "1", "--train_type", kind, "--learning_rate", "1e-2", "--dataset", train, "--max_steps", "3",
                    "--output_dir", run])
    assert "reference: the base model with the adapter disabled" in proc.stdout
    steps = {r["step"]: r for r in map(json.loads, (run / "logging.jsonl").read_text().splitlines()) if "loss" in r}
    assert abs(steps[1]["loss"] - math.log(2)) <= 1e-6 and steps[1]["rewards/margins"] == 0.0
    assert steps[3]["rewards/margins"] != 0.0
    assert (run / "checkpoint-3" / "adapter" / "adapter_model.safetensors").is_file()


def test_bone_resumes_where_it_stopped(demo_data, tmp_path):
    """A bone run stopped after step 3 of 4 resumes from checkpoint-2 (adapter, optimizer, schedule) and
    ends with the uninterrupted run's losses and adapter; a resume with another --reft_rank is refused."""
    args = ["sft", "--model", "tiny-llama-2l", "--torch_dtype", "fp32", "--per_device_train_batch_size", "1",
            "--gradient_accumulation_steps", "1", "--max_steps", "4", "--save_steps", "2", "--logging_steps", "1",
            "--learning_rate", "1e-2", *BONE, "--init_weights", "bat", "--dataset", demo_data[0]]
    run_cli([*args, "--output_dir", tmp_path / "whole"])
    from tests.conftest import cli_env
    stopped = run_cli([*args, "--output_dir", tmp_path / "cut"], check=False,
                      env=cli_env(SWIFTLITE_FAULT="step=3,kind=raise"))
    assert stopped.returncode != 0 and (tmp_path / "cut" / "checkpoint-2").is_dir()
    other = run_cli([*args, "--reft_rank", "2", "--output_dir", tmp_path / "cut", "--resume", "true"], check=False)
    assert other.returncode != 0 and "reft_rank" in other.stderr
    run_cli([*args, "--output_dir", tmp_path / "cut", "--resume", "true"])
    l1, l2 = read_losses(tmp_path / "whole"), read_losses(tmp_path / "cut")
    assert [l2[s] for s in (3, 4)] == pytest.approx([l1[s] for s in (3, 4)], rel=1e-6)
    a = load_file(str(tmp_path / "whole" / "checkpoint-4" / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "cut" / "checkpoint-4" / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-7)
