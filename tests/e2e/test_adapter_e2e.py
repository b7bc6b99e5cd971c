"""--train_type adapter end to end on the 2-layer preset (Houlsby adapters of width 8 after both MLPs): only
the adapters change, the checkpoint keeps them in dcp/ (no model/ folder transformers would load without
them), `swiftlite infer` rebuilds the trained model from it, resume gives the uninterrupted run, 2 DDP and
FSDP2 processes and 2 ZeRO-2/ZeRO-3 processes give the 1-process run (a ZeRO-3 checkpoint resumes under
fsdp), export is refused in one line (the backends it cannot run on: tests/bad_inputs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import cli_env, read_losses, run_cli

BASE = ["--model", "tiny-llama-2l", "--torch_dtype", "fp32", "--per_device_train_batch_size", "1",
        "--gradient_accumulation_steps", "2", "--logging_steps", "1", "--learning_rate", "1e-2", "--seed", "7",
        "--train_type", "adapter", "--adapter_length", "8"]
ADAPTER = ".mlp.adapter_default."


def _sft(demo_data, out: Path, steps: int = 4, *extra: str, **kw):
    return run_cli(["sft", *BASE, "--dataset", demo_data[0], "--output_dir", out, "--max_steps", steps,
                    "--save_steps", 4, *extra], **kw)


def _cfg():
    from swiftlite.cli import parse_run_args
    from swiftlite.config import load_config
    cf, values = parse_run_args(["--model", "tiny-llama-2l", "--dataset", "x.jsonl", *BASE[2:]])
    return load_config(cf, values, validate_paths=False)


def _built() -> torch.nn.Module:
    """The model the run starts from: the preset's seeded weights with the seeded adapters."""
    from swiftlite.models.adapter import attach
    from swiftlite.models.loading import load_model
    return attach(load_model(_cfg()), _cfg()).eval()


def _dcp_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    from swiftlite.checkpoint.readers import DCPReader
    reader = DCPReader(ckpt / "dcp")
    return reader.read(reader.names())


def _weights(ckpt: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's weights, dcp/ or (DeepSpeed) ds/ with the frozen ones."""
    if (ckpt / "dcp").is_dir():
        return _dcp_weights(ckpt)
    from swiftlite.checkpoint.readers import ZeroReader
    reader = ZeroReader(ckpt, exclude_frozen=False)
    return {k: v.float() for k, v in reader.read(reader.names()).items()}


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.arange(3, 40).reshape(1, -1) % model.config.vocab_size
    with torch.no_grad():
        return model(ids).logits.float()


def test_trains_only_the_adapters_and_infer_rebuilds_the_model(demo_data, tmp_path):
    proc = _sft(demo_data, tmp_path / "run")
    assert "adapter: Houlsby adapters after the MLP of each of 2 decoder layers (64 -> 8 -> 64, gelu)" in proc.stdout
    ckpt = tmp_path / "run" / "checkpoint-4"
    assert not (ckpt / "model").exists() and not (ckpt / "adapter").exists()
    trained = _dcp_weights(ckpt)
    start = _built().state_dict()
    # dcp/ holds the adapters alone (the frozen base is the base model's, as for LoRA), each one trained
    assert set(trained) == {k for k, p in _built().named_parameters() if p.requires_grad}
    assert len(trained) == 2 * 4 and all(ADAPTER in k for k in trained)   # 2 layers x 2 linears x (w, b)
    assert all(not torch.equal(trained[k], start[k]) for k in trained)
    # infer's model (export/reference.py, the run folder) is the base with the trained adapters
    from swiftlite.export.reference import load_reference
    ref = load_reference(str(tmp_path / "run"), lambda _m: None)
    by_hand = _built()
    by_hand.load_state_dict(trained, strict=False)
    torch.testing.assert_close(_logits(ref.model), _logits(by_hand), rtol=1e-5, atol=1e-5)
    assert (_logits(ref.model) - _logits(_built())).abs().max() > 1e-3   # not the untrained adapters
    out = run_cli(["infer", "--model", tmp_path / "run", "--prompt", "2+2=", "--max-new-tokens", "4"])
    assert out.returncode == 0 and "error" not in out.stderr   # the CLI loads it (a random model's few tokens)


def test_export_refused(demo_data, tmp_path):
    _sft(demo_data, tmp_path / "run", 2, "--save_steps", 2)
    for argv in (["export", "--ckpt", tmp_path / "run", "--output", tmp_path / "out"],
                 ["export", "--adapters", tmp_path / "run" / "checkpoint-2", "--merge_lora", "true"]):
        proc = run_cli(argv, check=False)
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "a --train_type adapter checkpoint cannot be exported" in lines[0], lines
        assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()
    assert not list(tmp_path.glob("run/checkpoint-2-*"))   # no <checkpoint>-merged either


def test_resume_gives_the_uninterrupted_run(demo_data, tmp_path):
    _sft(demo_data, tmp_path / "whole", 6)
    cut = _sft(demo_data, tmp_path / "cut", 6, check=False, env=cli_env(SWIFTLITE_FAULT="step=5,kind=raise"))
    assert cut.returncode != 0 and (tmp_path / "cut" / "checkpoint-4").is_dir()
    _sft(demo_data, tmp_path / "cut", 6, "--resume", "true", "--save_steps", 6)
    whole, resumed = read_losses(tmp_path / "whole"), read_losses(tmp_path / "cut")
    assert sorted(resumed) == sorted(whole) == [1, 2, 3, 4, 5, 6]
    for s in (5, 6):
        assert resumed[s] == pytest.approx(whole[s], rel=1e-6, abs=1e-7), (s, whole, resumed)
    a, b = _dcp_weights(tmp_path / "whole" / "checkpoint-6"), _dcp_weights(tmp_path / "cut" / "checkpoint-6")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
    # the weights alone (--resume_only_model): a new run from step 0 on the trained adapters
    _sft(demo_data, tmp_path / "only", 1, "--resume_from_checkpoint", tmp_path / "whole" / "checkpoint-4",
         "--resume_only_model", "true")
    assert read_losses(tmp_path / "only")[1] < whole[1] - 0.05   # not the seeded adapters' first loss
    # another width is another run: refused, naming it
    proc = run_cli(["sft", *BASE[:-1], "16", "--dataset", demo_data[0], "--output_dir", tmp_path / "cut",
                    "--max_steps", 8, "--resume", "true"], check=False)
    assert proc.returncode != 0 and "shape.adapter_length (8 -> 16)" in proc.stderr + proc.stdout


def test_bf16_keeps_fp32_adapters(demo_data, tmp_path):
    """Under --torch_dtype bf16 the adapters train as fp32 master weights next to the bf16 frozen base."""
    _sft(demo_data, tmp_path / "run", 2, "--torch_dtype", "bf16", "--save_steps", 2, "--gradient_checkpointing",
         "true")
    losses = read_losses(tmp_path / "run")
    assert sorted(losses) == [1, 2] and all(v == v for v in losses.values())
    sd = _dcp_weights(tmp_path / "run" / "checkpoint-2")
    assert len(sd) == 8 and {sd[k].dtype for k in sd if ADAPTER in k} == {torch.float32}
    from swiftlite.export.reference import load_reference
    ref = load_reference(str(tmp_path / "run"), lambda _m: None).model   # the base as trained: bf16
    assert ref.model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
    assert torch.isfinite(_logits(ref)).all()


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp", "zero2", "zero3"])
def test_two_processes_match_one(parallelism, demo_data, tmp_path):
    _sft(demo_data, tmp_path / "one")
    proc = _sft(demo_data, tmp_path / "two", 4, "--nproc_per_node", "2", "--gradient_accumulation_steps", "1",
                "--parallelism", parallelism)
    assert "sharded loading is off" not in proc.stdout + proc.stderr   # fsdp: each rank fills its rows of the base
    state = json.loads((tmp_path / "two" / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["backend"] == ("deepspeed" if parallelism.startswith("zero") else parallelism)
    l1, l2 = read_losses(tmp_path / "one"), read_losses(tmp_path / "two")
    assert sorted(l1) == sorted(l2) == [1, 2, 3, 4]
    for s in l1:
        assert l1[s] == pytest.approx(l2[s], rel=1e-4, abs=1e-5), (s, l1, l2)
    a, b = _dcp_weights(tmp_path / "one" / "checkpoint-4"), _weights(tmp_path / "two" / "checkpoint-4")
    assert set(a) == {k for k in b if ADAPTER in k} and len(a) == 8
    start = _built().state_dict()
    for k in b:
        if ADAPTER in k:
            torch.testing.assert_close(a[k], b[k], rtol=1e-3, atol=1e-4)
            assert not torch.equal(b[k], start[k]), k
        else:   # ds/ holds the frozen base too: never touched
            assert torch.equal(b[k], start[k]), k


def test_zero3_checkpoint_resumes_under_fsdp_and_infer_reads_it(demo_data, tmp_path):
    """A ZeRO-3 checkpoint holds the adapters in ds/: infer rebuilds the same model from it as from the FSDP2
    run's dcp/, and a resume under fsdp (through DeepSpeed's universal format) continues the same run."""
    _sft(demo_data, tmp_path / "z3", 6, "--nproc_per_node", "2", "--gradient_accumulation_steps", "1",
         "--parallelism", "zero3")
    _sft(demo_data, tmp_path / "fsdp", 6, "--nproc_per_node", "2", "--gradient_accumulation_steps", "1",
         "--parallelism", "fsdp", "--resume_from_checkpoint", tmp_path / "z3" / "checkpoint-4")
    z3, fs = read_losses(tmp_path / "z3"), read_losses(tmp_path / "fsdp")
    for s in (5, 6):
        assert fs[s] == pytest.approx(z3[s], rel=1e-4, abs=1e-5), (s, z3, fs)
    from swiftlite.export.reference import load_reference
    a = load_reference(str(tmp_path / "z3" / "checkpoint-4"), lambda _m: None).model
    by_hand = _built()
    by_hand.load_state_dict(_weights(tmp_path / "z3" / "checkpoint-4"), strict=False)
    torch.testing.assert_close(_logits(a), _logits(by_hand), rtol=1e-5, atol=1e-5)
    assert (_logits(a) - _logits(_built())).abs().max() > 1e-3
