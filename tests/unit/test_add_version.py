"""--add_version: ms-swift's <output_dir>/vN-<timestamp> run folders; --resume auto finds the run again."""

from __future__ import annotations

import re
import shutil

import pytest

from swiftlite import env
from swiftlite.checkpoint import layout
from swiftlite.config.load import apply_add_version
from swiftlite.config import load_config
from swiftlite.errors import UserError


def _command(tmp_path, data, monkeypatch, **extra):
    """One `swiftlite sft` command: a fresh process (no run version chosen yet), then the trainer."""
    from swiftlite.train.loop import train
    monkeypatch.delenv(env.RUN_VERSION, raising=False)
    values = {"model": "tiny-llama-2l", "train_type": "full", "dataset": [f"{data}#16"], "max_steps": 4,
              "per_device_train_batch_size": 2, "gradient_accumulation_steps": 1, "save_steps": 2,
              "output_dir": str(tmp_path / "out"), "dataloader_num_workers": 0,
              "gradient_checkpointing": False, **extra}
    cfg = load_config(None, values, task="sft")
    apply_add_version(cfg)     # load_config applied it already: again, a no-op
    return cfg, train(cfg)


def test_each_run_gets_the_next_version_and_resume_auto_finds_the_newest(tmp_path, demo_data, monkeypatch):
    data = demo_data[0]
    cfg0, r0 = _command(tmp_path, data, monkeypatch, add_version=True)
    cfg1, r1 = _command(tmp_path, data, monkeypatch, add_version=True)
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert len(names) == 2 and all(re.fullmatch(r"v\d+-\d{8}-\d{6}", n) for n in names)
    assert [n.split("-")[0] for n in names] == ["v0", "v1"]
    assert r0.run_dir.name == names[0] and r1.run_dir.name == names[1]
    assert (r1.run_dir / layout.checkpoint_name(4)).is_dir() and (r1.run_dir / layout.ARGS).is_file()
    # an interrupted v1: the same command again with --resume auto continues v1, no v2
    shutil.rmtree(r1.run_dir / layout.checkpoint_name(4))
    (r1.run_dir / "latest").write_text(layout.checkpoint_name(2))
    cfg2, r2 = _command(tmp_path, data, monkeypatch, add_version=True, resume="auto")
    assert r2.run_dir == r1.run_dir and len(r2.losses) == 2
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == names
    # a rank of the same job (the launcher's choice in its environment) lands in the same folder
    rank_cfg = load_config(None, {"dataset": ["d.jsonl"], "output_dir": str(tmp_path / "out"), "add_version": True},
                           task="sft", validate_paths=False)
    apply_add_version(rank_cfg)
    assert rank_cfg.train.output_dir == cfg2.train.output_dir


def test_default_is_the_output_dir_itself_and_multi_node_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv(env.RUN_VERSION, raising=False)
    cfg = load_config(None, {"dataset": ["d.jsonl"], "output_dir": str(tmp_path / "o")}, task="sft",
                      validate_paths=False)
    assert cfg.train.add_version is False
    apply_add_version(cfg)
    assert cfg.train.output_dir == str(tmp_path / "o")
    with pytest.raises(UserError, match=r"--add_version with --nnodes > 1"):   # refused as the config loads
        load_config(None, {"dataset": ["d.jsonl"], "output_dir": str(tmp_path / "o"), "add_version": True,
                           "nnodes": 2, "master_addr": "10.0.0.1"}, task="sft", validate_paths=False)


def test_the_cli_applies_it_before_the_plan(tmp_path, demo_data):
    from tests.conftest import cli_env, run_cli
    e = cli_env()
    e.pop(env.RUN_VERSION, None)
    out = run_cli(["sft", "--model", "tiny-llama-2l", "--dataset", demo_data[0], "--max_steps", "2",
                   "--output_dir", tmp_path / "o", "--add_version", "true", "--dry-run"], env=e).stdout
    assert re.search(r"output:\s+\S+/o/v0-\d{8}-\d{6}\n", out), out
    assert not (tmp_path / "o").exists()          # --dry-run names the folder, creates nothing
