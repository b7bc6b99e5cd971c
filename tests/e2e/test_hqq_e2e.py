"""--quant_method hqq end to end (ms-swift's examples/train/qlora/hqq.sh): LoRA trains on an HQQ base and
resumes from a checkpoint with the uninterrupted run's losses; the export merges the adapter into the
dequantized base and passes --verify; 2 DDP processes give the 1-process losses. (The refusals, FSDP's
among them: tests/bad_inputs/bad_input_cases.py.)"""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from tests.conftest import read_losses, run_cli

pytest.importorskip("hqq")

BASE = ["sft", "--model", "tiny-llama-2l", "--torch_dtype", "fp32", "--tuner_type", "lora", "--quant_method", "hqq",
        "--quant_bits", "4", "--per_device_train_batch_size", "1", "--max_steps", "4", "--save_steps", "2",
        "--logging_steps", "1", "--learning_rate", "1e-3", "--seed", "7"]


def test_resume_and_merged_export(demo_data, tmp_path):
    args = [*BASE, "--gradient_accumulation_steps", "1", "--dataset", demo_data[0]]
    whole = tmp_path / "whole"
    run_cli([*args, "--output_dir", whole])
    resumed = tmp_path / "resumed"
    run_cli([*args, "--output_dir", resumed, "--resume_from_checkpoint", whole / "checkpoint-2"])
    a, b = read_losses(whole), read_losses(resumed)
    assert sorted(a) == [1, 2, 3, 4] and sorted(b) == [3, 4]
    assert all(a[s] == b[s] for s in b), (a, b)
    ad_a = load_file(str(whole / "checkpoint-4" / "adapter" / "adapter_model.safetensors"))
    ad_b = load_file(str(resumed / "checkpoint-4" / "adapter" / "adapter_model.safetensors"))
    assert ad_a.keys() == ad_b.keys() and all((ad_a[k] == ad_b[k]).all() for k in ad_a)
    assert len([k for k in ad_a if "lora_A" in k]) == 14          # every decoder linear, by name
    args_json = json.loads((whole / "args.json").read_text())
    quant = {k: v for sec in args_json.values() if isinstance(sec, dict) for k, v in sec.items()}
    assert quant["quant_method"] == "hqq" and quant["quant_bits"] == 4
    proc = run_cli(["export", "--ckpt", whole / "checkpoint-4", "--merge_lora", "true", "--verify"])
    text = proc.stdout + proc.stderr
    assert "checks: passed" in text and "quantized with HQQ to 4 bits" in text, text[-3000:]
    merged = load_file(str(whole / "checkpoint-4-merged" / "model.safetensors"))
    assert "model.layers.0.self_attn.q_proj.weight" in merged and not any("W_q" in k for k in merged)


def test_two_ddp_processes_match_one(demo_data, tmp_path):
    # no LoRA dropout: its masks come from each process's own random stream
    args = [*BASE, "--lora_dropout", "0", "--save_steps", "4", "--dataset", demo_data[0]]
    run_cli([*args, "--gradient_accumulation_steps", "2", "--output_dir", tmp_path / "one"])
    run_cli([*args, "--gradient_accumulation_steps", "1", "--output_dir", tmp_path / "two", "--nproc_per_node", "2",
             "--parallelism", "ddp"])
    l1, l2 = read_losses(tmp_path / "one"), read_losses(tmp_path / "two")
    assert sorted(l1) == sorted(l2) == [1, 2, 3, 4]
    for s in l1:
        assert l1[s] == pytest.approx(l2[s], rel=1e-4, abs=1e-5), (s, l1, l2)
