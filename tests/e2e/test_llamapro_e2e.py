"""--train_type llamapro end to end on the 2-layer preset with 2 new blocks (4 layers: [0, copy of 0, 1,
copy of 1]): only the new blocks change, the checkpoint and the export are standard HF folders of the
expanded model that transformers loads with the trained weights, resume gives the uninterrupted run, 2 DDP,
FSDP2 and HSDP processes give the 1-process run, and the backends it cannot run on are refused before launch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import cli_env, read_losses, run_cli

BASE = ["--model", "tiny-llama-2l", "--torch_dtype", "fp32", "--per_device_train_batch_size", "1",
        "--gradient_accumulation_steps", "2", "--logging_steps", "1", "--learning_rate", "1e-2", "--seed", "7",
        "--train_type", "llamapro", "--llamapro_num_new_blocks", "2"]
#: expanded layer -> the base layer it is (a copy of); the copies are 1 and 3
ORIGIN = {0: 0, 1: 0, 2: 1, 3: 1}
NEW = (1, 3)


def _sft(demo_data, out: Path, steps: int = 4, *extra: str, **kw):
    return run_cli(["sft", *BASE, "--dataset", demo_data[0], "--output_dir", out, "--max_steps", steps,
                    "--save_steps", 4, *extra], **kw)


def _base_state() -> dict[str, torch.Tensor]:
    """The preset's weights as the run built them (seeded by --seed)."""
    from swiftlite.cli import parse_run_args
    from swiftlite.config import load_config
    from swiftlite.models.loading import load_model
    cf, values = parse_run_args(["--model", "tiny-llama-2l", "--dataset", "x.jsonl", "--torch_dtype", "fp32",
                                 "--seed", "7"])
    return load_model(load_config(cf, values, validate_paths=False)).state_dict()


def _base_config():
    from swiftlite.models.source import resolve_model
    return resolve_model("tiny-llama-2l").config(False, None)


def _dcp_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    from swiftlite.checkpoint.readers import DCPReader
    reader = DCPReader(ckpt / "dcp")
    return reader.read(reader.names())


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.arange(3, 40).reshape(1, -1) % model.config.vocab_size
    with torch.no_grad():
        return model(ids).logits.float()


def test_trains_only_new_blocks_and_exports_an_hf_model(demo_data, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    _sft(demo_data, tmp_path / "run")
    ckpt = tmp_path / "run" / "checkpoint-4"
    trained = _dcp_weights(ckpt)
    base = _base_state()
    for name, value in base.items():
        if not name.startswith("model.layers."):
            assert torch.equal(trained[name], value), name   # embeddings, norm, lm_head: frozen
            continue
        i, rest = int(name.split(".")[2]), ".".join(name.split(".")[3:])
        old = {0: 0, 1: 2}[i]   # base layer i sits at expanded position 0 or 2
        assert torch.equal(trained[f"model.layers.{old}.{rest}"], value), name
        for new in NEW:   # the copies left their starting point (output projections: no longer zero)
            if ORIGIN[new] == i and rest.endswith(("o_proj.weight", "down_proj.weight")):
                assert trained[f"model.layers.{new}.{rest}"].abs().max() > 0, (new, rest)
            elif ORIGIN[new] == i and rest.endswith("q_proj.weight"):
                assert not torch.equal(trained[f"model.layers.{new}.{rest}"], value), (new, rest)
    # the checkpoint's own HF folder and the export: the expanded config, the trained weights
    model_dir = json.loads((ckpt / "model" / "config.json").read_text())
    assert model_dir["num_hidden_layers"] == 4
    out = tmp_path / "export"
    run_cli(["export", "--ckpt", ckpt, "--output", out, "--verify"])
    conf = json.loads((out / "config.json").read_text())
    assert conf["num_hidden_layers"] == 4 and conf["torch_dtype" if "torch_dtype" in conf else "dtype"] == "bfloat16"
    names = set().union(*(load_file(str(f)).keys() for f in out.glob("*.safetensors")))
    assert "model.layers.3.mlp.down_proj.weight" in names and not any(".layers.4." in n for n in names)
    exported = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert exported.config.num_hidden_layers == 4 and len(exported.model.layers) == 4
    reference = AutoModelForCausalLM.from_config(exported.config, dtype=torch.float32).eval()
    missing, unexpected = reference.load_state_dict(trained, strict=False)
    assert not unexpected and all("rotary" in k or k == "lm_head.weight" for k in missing), (missing, unexpected)
    torch.testing.assert_close(_logits(exported), _logits(reference), rtol=0.05, atol=0.05)   # a bf16 export
    # and not the base model's logits (which the expanded model computed before training)
    base_model = AutoModelForCausalLM.from_config(_base_config(), dtype=torch.float32).eval()
    base_model.load_state_dict(base)
    assert (_logits(exported) - _logits(base_model)).abs().max() > 0.05


def test_resume_gives_the_uninterrupted_run(demo_data, tmp_path):
    _sft(demo_data, tmp_path / "whole", 6, "--save_hf_model", "false")
    cut = _sft(demo_data, tmp_path / "cut", 6, check=False, env=cli_env(SWIFTLITE_FAULT="step=5,kind=raise"))
    assert cut.returncode != 0 and (tmp_path / "cut" / "checkpoint-4").is_dir()
    _sft(demo_data, tmp_path / "cut", 6, "--resume", "true", "--save_steps", 6)
    whole, resumed = read_losses(tmp_path / "whole"), read_losses(tmp_path / "cut")
    assert sorted(resumed) == sorted(whole) == [1, 2, 3, 4, 5, 6]
    for s in (5, 6):
        assert resumed[s] == pytest.approx(whole[s], rel=1e-6, abs=1e-7), (s, whole, resumed)
    # a checkpoint without its model/ folder exports from dcp/ with the expanded config built from the base
    from transformers import AutoModelForCausalLM
    ckpt = max((tmp_path / "whole").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    assert not (ckpt / "model").exists()
    run_cli(["export", "--ckpt", ckpt, "--output", tmp_path / "export", "--verify"])
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "export"))
    assert exported.config.num_hidden_layers == 4 and len(exported.model.layers) == 4


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp", pytest.param("hsdp", marks=pytest.mark.long)])
def test_two_processes_match_one(parallelism, demo_data, tmp_path):
    _sft(demo_data, tmp_path / "one")
    extra = ["--hsdp_shard_size", "1"] if parallelism == "hsdp" else []   # two replicas of one shard each
    proc = _sft(demo_data, tmp_path / "two", 4, "--nproc_per_node", "2", "--gradient_accumulation_steps", "1",
                "--parallelism", parallelism, *extra)
    assert "sharded loading is off" in proc.stdout + proc.stderr or parallelism == "ddp"
    assert json.loads((tmp_path / "two" / "checkpoint-4" / "trainer_state.json").read_text())["backend"] == parallelism
    l1, l2 = read_losses(tmp_path / "one"), read_losses(tmp_path / "two")
    assert sorted(l1) == sorted(l2) == [1, 2, 3, 4]
    for s in l1:
        assert l1[s] == pytest.approx(l2[s], rel=1e-4, abs=1e-5), (s, l1, l2)
    a, b = _dcp_weights(tmp_path / "one" / "checkpoint-4"), _dcp_weights(tmp_path / "two" / "checkpoint-4")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-3, atol=1e-4)
        if not k.startswith(tuple(f"model.layers.{i}." for i in NEW)):
            assert torch.equal(a[k], b[k]), k   # frozen on every backend: never touched


@pytest.mark.parametrize("parallelism", ["fsdp1", pytest.param("zero2", marks=pytest.mark.long)])
def test_sharding_backends_refused_before_launch(parallelism, demo_data, tmp_path):
    out = tmp_path / "run"
    proc = _sft(demo_data, out, 4, "--nproc_per_node", "2", "--parallelism", parallelism, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"error: --train_type llamapro with --parallelism {parallelism}:")
    assert "Traceback" not in proc.stderr and not out.exists()


def test_layer_count_refused_before_launch(demo_data, tmp_path):
    out = tmp_path / "run"
    proc = _sft(demo_data, out, 4, "--llamapro_num_groups", "3", "--lr_scheduler_type", "greedy", check=False)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert any(l.startswith("error: --llamapro_num_groups 3: the model's 2 layers are not divisible") for l in lines)
    assert any("greedy" in l for l in lines) and len(lines) == 2   # every refusal, one line each
    assert "Traceback" not in proc.stderr and not out.exists()
