"""`swiftlite sft --streaming true --packing true` (ms-swift's examples/train/full/qwen2_5_32b.sh and
pretrain/train.sh use both) end to end: the CLI in a subprocess on the tiny model exits 0, trains the
steps asked for on packs, and args.json records both flags."""

from __future__ import annotations

import json

from swiftlite.checkpoint import layout
from tests.conftest import read_losses, run_cli


def test_sft_streaming_packing_trains_and_records_both_flags(demo_data, tmp_path):
    out = tmp_path / "run"
    proc = run_cli(["sft", "--model", "tiny-llama-2l", "--tuner_type", "full", "--dataset", demo_data[0],
                    "--streaming", "true", "--packing", "true", "--max_steps", "2", "--max_length", "128",
                    "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "2",
                    "--dataloader_num_workers", "4", "--logging_steps", "1", "--save_only_model", "true",
                    "--gradient_checkpointing", "false", "--output_dir", out])
    assert proc.returncode == 0
    args = json.loads((out / layout.ARGS).read_text())
    assert args["data"]["streaming"] is True and args["data"]["packing"] is True
    assert "packed to 128 tokens" in proc.stdout + proc.stderr
    assert "streamed train packs of rows" in proc.stdout    # the samples are packs, said as such
    assert sorted(read_losses(out)) == [1, 2]


def test_two_processes_stream_packs_and_resume_exactly(demo_data, tmp_path):
    """NPROC_PER_NODE=2 (each rank reads the stream and takes its own packs of a step): 3 steps, then
    the run resumed from checkpoint-2 gives step 3's loss bit for bit (the stream re-read to step 2's packs)."""
    import os
    import shutil

    from tests.conftest import cli_env
    out = tmp_path / "run2"
    argv = ["sft", "--model", "tiny-llama-2l", "--tuner_type", "full", "--dataset", demo_data[0],
            "--streaming", "true", "--packing", "true", "--max_steps", "3", "--max_length", "128",
            "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "2", "--logging_steps", "1",
            "--save_steps", "2", "--gradient_checkpointing", "false", "--output_dir", out]
    env = cli_env(NPROC_PER_NODE="2", SWIFTLITE_CACHE=os.environ["SWIFTLITE_CACHE"])
    run_cli(argv, env=env)
    whole = read_losses(out)
    assert sorted(whole) == [1, 2, 3]
    shutil.rmtree(out / layout.checkpoint_name(3))
    (out / "latest").write_text(layout.checkpoint_name(2))
    proc = run_cli(argv + ["--resume", "true"], env=env)
    assert "re-reading the stream to step 2 (8 packs)" in proc.stdout + proc.stderr
    lines = [json.loads(x) for x in (out / "logging.jsonl").read_text().splitlines()]
    resumed = [r["loss"] for r in lines if r.get("step") == 3 and "loss" in r]
    assert len(resumed) == 2 and resumed[0] == resumed[1] == whole[3]
