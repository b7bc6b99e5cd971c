"""--save_only_model: checkpoints without optimizer/schedule/RNG state; --resume of one restores the
weights and the data position and says what it does not restore, or refuses with the reason."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest

from swiftlite.checkpoint import layout
from swiftlite.config import load_config
from swiftlite.errors import UserError


def _cfg(tmp_path, data, name, **extra):
    values = {"model": "tiny-llama-2l", "train_type": "full", "dataset": [f"{data}#48"], "max_steps": 4,
              "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "logging_steps": 1,
              "output_dir": str(tmp_path / name), "save_steps": 2, "seed": 5, "dataloader_num_workers": 0,
              "warmup_steps": 2, "gradient_checkpointing": False}
    values.update(extra)
    return load_config(None, values, task="sft")


def _dcp_keys(ckpt) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader
    return set(FileSystemReader(str(ckpt / "dcp")).read_metadata().state_dict_metadata)


def test_weights_only_checkpoint_and_its_resume(tmp_path, demo_data, capsys):
    from swiftlite.train.loop import train
    data = demo_data[0]
    whole = train(_cfg(tmp_path, data, "full_state")).losses
    assert any(k.startswith("optim") for k in _dcp_keys(tmp_path / "full_state" / "checkpoint-2"))
    run = tmp_path / "w"
    assert train(_cfg(tmp_path, data, "w", save_only_model=True)).losses == whole   # training is unchanged
    ck = run / "checkpoint-2"
    keys = _dcp_keys(ck)
    assert keys and all(k.startswith("model") for k in keys)                     # no optimizer entries
    assert not (ck / layout.RNG_DIR).exists() and (ck / layout.MODEL_DIR).is_dir()
    assert json.loads((ck / layout.TRAINER_STATE).read_text())["save_only_model"] is True
    shutil.rmtree(run / layout.checkpoint_name(4))
    (run / "latest").write_text(layout.checkpoint_name(2))
    capsys.readouterr()
    resumed = train(_cfg(tmp_path, data, "w", save_only_model=True, resume="true")).losses
    out = capsys.readouterr().out
    assert "checkpoint-2 was saved with --save_only_model: restored the weights and the data position (step 2)" in out
    assert "not restored: the optimizer state" in out
    assert len(resumed) == 2
    assert resumed[0] == pytest.approx(whole[2], abs=1e-6)    # step 3's loss: the weights after step 2
    assert resumed[1] != pytest.approx(whole[3], abs=1e-6)    # step 4: fresh AdamW moments and schedule
    # under DeepSpeed the weights of a torch backend's weights-only checkpoint cannot be read: refused
    # before launch (preflight), one line, exit 2
    from tests.conftest import run_cli
    proc = run_cli(["sft", "--model", "tiny-llama-2l", "--train_type", "full", "--dataset", f"{data}#48",
                    "--max_steps", "4", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
                    "--output_dir", run, "--resume", "true", "--deepspeed", "zero2", "--torch_dtype", "fp32",
                    "--dry-run"], check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--resume: checkpoint-4 holds only the weights (--save_only_model), in a torch backend's format" \
        in proc.stderr and "Traceback" not in proc.stderr


def test_resume_refused_where_the_weights_need_the_optimizer_state(tmp_path):
    from swiftlite.checkpoint.state import load_training_state
    c = tmp_path / "checkpoint-3"
    c.mkdir()
    (c / layout.TRAINER_STATE).write_text(json.dumps({"global_step": 3, "backend": "single", "format": "dcp",
                                                      "world_size": 1, "train_type": "lora",
                                                      "save_only_model": True}))
    cfg = load_config(None, {"dataset": ["d.jsonl"], "resume": "true"}, task="sft", validate_paths=False)
    engine = SimpleNamespace(load=lambda *a, **k: pytest.fail("nothing may be loaded"),
                             load_universal=lambda *a, **k: pytest.fail("nothing may be loaded"))
    zero2 = SimpleNamespace(key="deepspeed", name="zero2", is_deepspeed=True)
    with pytest.raises(UserError, match=r"checkpoint-3 holds only the weights \(--save_only_model\), in a torch "
                                        r"backend's format.*resume it with the backend that wrote it \(single\)"):
        load_training_state(engine, c, SimpleNamespace(world_size=1, rank=0), cfg, zero2, None)


def test_deepspeed_refuses_save_only_model_only_without_its_model_folder():
    from swiftlite.parallel.deepspeed import check_config
    choice = SimpleNamespace(key="deepspeed", name="zero2", deepspeed_source="zero2")
    cfg = load_config(None, {"dataset": ["d.jsonl"], "save_only_model": True, "torch_dtype": "fp32",
                             "save_hf_model": False}, task="sft", validate_paths=False)
    assert check_config(cfg, 1, choice).startswith("--save_only_model with --save-hf-model false: under DeepSpeed")
    cfg = load_config(None, {"dataset": ["d.jsonl"], "save_only_model": True, "torch_dtype": "fp32"}, task="sft",
                      validate_paths=False)
    assert check_config(cfg, 1, choice) is None


def test_deepspeed_weights_only_checkpoint_is_its_model_folder_and_resume_says_so(tmp_path, demo_data):
    """Under DeepSpeed, --save_only_model writes no ZeRO partitions (they hold the optimizer state with the
    weights): the checkpoint's weights are its model/ folder, equal to a full checkpoint's; --resume of it
    is refused in one line that names the folder to start from."""
    from safetensors.torch import load_file

    from swiftlite.train.loop import train
    data = demo_data[0]
    common = {"parallelism": "zero2", "max_steps": 2}
    full = train(_cfg(tmp_path, data, "ds_full", **common))
    light = train(_cfg(tmp_path, data, "ds_light", save_only_model=True, **common))
    assert light.losses == full.losses
    ck, ref = tmp_path / "ds_light" / "checkpoint-2", tmp_path / "ds_full" / "checkpoint-2"
    assert (ref / "ds").is_dir() and not (ck / "ds").exists() and not (ck / layout.RNG_DIR).exists()
    got, want = load_file(str(ck / "model" / "model.safetensors")), load_file(str(ref / "model" / "model.safetensors"))
    assert got.keys() == want.keys() and all(bool((got[k] == want[k]).all()) for k in want)
    # export reads such a checkpoint's weights from its model/ folder (no ds/ to read)
    import swiftlite.export as ex
    res = ex.export(ex.ExportOptions(ckpt=str(ck), output=str(tmp_path / "exported"), log=lambda *_: None))
    out = load_file(str(res.output / "model.safetensors"))
    assert out.keys() <= want.keys() and all(bool((out[k] == want[k].to(out[k].dtype)).all()) for k in out)
    with pytest.raises(UserError, match=r"--resume: checkpoint-2 was saved with --save_only_model under DeepSpeed: "
                                         r"it holds the weights only as its model/ folder"):
        train(_cfg(tmp_path, data, "ds_light", save_only_model=True, resume="true", max_steps=4,
                   parallelism="zero2"))
