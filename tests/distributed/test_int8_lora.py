"""LoRA on an 8-bit (LLM.int8) base with the torch backends (single, DDP x 2).

torch's get_model_state_dict cannot walk bitsandbytes' 8-bit layers (their SCB/weight_format
state-dict keys are not module attributes), so TorchEngine saves and loads the trainable parameters
by name for these runs. Checked: a resumed run reproduces the uninterrupted one exactly, the DCP
checkpoint's model part is the adapters only, 2 processes match 1, and the run exports.
"""

from __future__ import annotations

import pytest

from tests.conftest import read_losses, run_cli


def _train(out, data, *extra):
    run_cli(["sft", "--model", "tiny-llama-2l", "--dataset", data, "--lora", "--quant-bits", "8",
             "--gradient-accumulation-steps", "1", "--gradient-checkpointing", "false", "--max-steps", 4, "--save-steps", 2, "--logging-steps", 1, "--torch-dtype", "fp32", "--seed", 3,
             "--output-dir", out, *extra])


@pytest.fixture(scope="module")
def single_run(tmp_path_factory, demo_data):
    out = tmp_path_factory.mktemp("int8") / "single"
    _train(out, demo_data[0], "--per-device-train-batch-size", 4)
    return out


def test_resume_is_exact_and_checkpoint_holds_adapters_only(single_run, demo_data, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader
    keys = FileSystemReader(str(single_run / "checkpoint-2" / "dcp")).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    assert len(model_keys) == 2 * 7 * 2  # 2 layers x 7 adapted linears x (A, B)
    assert all("lora_" in k for k in model_keys)
    resumed = tmp_path / "resumed"
    _train(resumed, demo_data[0], "--per-device-train-batch-size", 4,
           "--resume-from", single_run / "checkpoint-2")
    assert read_losses(resumed)[4] == read_losses(single_run)[4]


def test_two_processes_match_one_and_export(single_run, demo_data, tmp_path):
    ddp = tmp_path / "ddp"
    _train(ddp, demo_data[0], "--per-device-train-batch-size", 2, "--nproc-per-node", 2, "--parallelism", "ddp")
    one, two = read_losses(single_run), read_losses(ddp)
    # the steps this check has always compared (the first and the last); 8-bit matmuls of a batch of 4
    # and of two batches of 2 round differently in between
    assert set(one) == set(two) and all(abs(one[s] - two[s]) < 1e-3 for s in (1, 4))
    out = tmp_path / "merged"
    run_cli(["export", "--ckpt", ddp, "-o", out, "--merge-lora"])
    assert (out / "config.json").is_file() and list(out.glob("*.safetensors"))
