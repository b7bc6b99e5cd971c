"""Config: flags over files, both spellings, unknown keys, validation rules."""

from __future__ import annotations

import json

import pytest

from swiftlite.planner import choose_backend as resolve_backend
from swiftlite.cli import parse_run_args
from swiftlite.config import load_args, load_config, save_args
from swiftlite.errors import UserError


def cfg_from(argv, tmp_path=None, **kw):
    """Parse, validate, and resolve --parallelism (as preflight does) on the planned world."""
    config_file, values = parse_run_args(argv)
    cfg = load_config(config_file, values, **kw)
    resolve_backend(cfg, (cfg.parallel.nproc_per_node or 1) * (cfg.parallel.nnodes or 1))
    return cfg


def test_both_spellings_and_aliases():
    a = cfg_from(["--dataset", "x.jsonl", "--max_length", "64", "--parallelism_type", "fsdp", "--lr", "3e-4"])
    b = cfg_from(["--dataset", "x.jsonl", "--max-length", "64", "--parallelism-type", "fsdp",
                  "--learning-rate", "3e-4"])
    assert a.to_dict() == b.to_dict()
    assert a.data.max_length == 64 and a.parallel.parallelism == "fsdp" and a.learning_rate == 3e-4


def test_lists_booleans_and_shorthands():
    c = cfg_from(["--dataset", "a.jsonl", "b.jsonl#10", "--packing", "--gradient_checkpointing", "false",
                  "--qlora", "--seed=5"])
    assert c.data.dataset == ["a.jsonl", "b.jsonl#10"]
    assert c.data.packing is True and c.train.gradient_checkpointing is False
    assert c.train.train_type == "qlora" and c.quant.quant_bits == 4 and c.train.seed == 5


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_flags_override_file(tmp_path, suffix):
    data = {"dataset": ["d.jsonl"], "max_length": 256, "train": {"seed": 9}, "learning_rate": 1e-3}
    p = tmp_path / f"c{suffix}"
    if suffix == ".json":
        p.write_text(json.dumps(data))
    else:
        import yaml
        p.write_text(yaml.safe_dump(data))
    c = cfg_from(["--config", str(p), "--max-length", "128"])
    assert c.data.max_length == 128 and c.train.seed == 9 and c.learning_rate == 1e-3


def test_unknown_key_in_file_is_named(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("dataset: [d.jsonl]\nmax_lenght: 5\n")
    with pytest.raises(UserError, match=r"unknown option 'max_lenght' \(did you mean 'max_length'\?\)"):
        cfg_from(["--config", str(p)])


def test_unknown_flag_is_named():
    with pytest.raises(UserError, match="unknown option --max-lenght"):
        parse_run_args(["--max-lenght", "5"])


@pytest.mark.parametrize("argv,msg", [
    (["--learning-rate", "-1"], "--learning-rate must be > 0"),
    (["--max-length", "0"], "--max-length must be > 0"),
    (["--max-length", "abc"], "max_length: expected an integer, got 'abc'"),
    (["--parallelism", "zero5"], "--parallelism: unknown value 'zero5'"),
    (["--train-type", "half"], "train_type='half' is not one of"),
    (["--nproc-per-node", "0"], "--nproc-per-node must be > 0"),
    (["--resume", "--resume-from", "x"], "--resume and --resume-from both given"),
    (["--torch-dtype", "fp16", "--parallelism", "fsdp"], "needs loss scaling"),
])
def test_rules(argv, msg):
    with pytest.raises(UserError, match=msg.replace("(", r"\(").replace("[", r"\[")):
        cfg_from(["--dataset", "d.jsonl", *argv])


def test_dataset_required():
    with pytest.raises(UserError, match="--dataset is required"):
        cfg_from([])


def test_ms_swift_env_vars_fill_launch_options(monkeypatch):
    for k in ("RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("NPROC_PER_NODE", "4")
    monkeypatch.setenv("NNODES", "2")
    monkeypatch.setenv("NODE_RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29555")
    c = cfg_from(["--dataset", "d.jsonl"])
    p = c.parallel
    assert (p.nproc_per_node, p.nnodes, p.node_rank, p.master_addr, p.master_port) == (4, 2, 1, "10.0.0.1", 29555)
    c2 = cfg_from(["--dataset", "d.jsonl", "--nproc-per-node", "2"])
    assert c2.parallel.nproc_per_node == 2  # a flag beats the env


def test_args_json_roundtrip(tmp_path):
    c = cfg_from(["--dataset", "d.jsonl", "--lora", "--lora-rank", "16", "--max-steps", "7"])
    save_args(c, tmp_path / "args.json")
    assert load_args(tmp_path / "args.json").to_dict() == c.to_dict()


def test_launch_command_is_an_argument_list(monkeypatch):
    from swiftlite.launch import plan_launch
    for k in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    args = ["--dataset", "d; rm -rf /", "--nproc-per-node", "2", "--launcher", "torchrun"]
    c = cfg_from(args, validate_paths=False)
    plan = plan_launch(c, ["sft", *args])
    assert plan.command[1:3] == ["-m", "swiftlite.torchrun"] and not plan.fork
    assert "d; rm -rf /" in plan.command  # passed as one argument, never through a shell
    assert "--nproc-per-node=2" in plan.command and any(a.startswith("--master-port=") for a in plan.command)


def test_one_node_forks_several_nodes_use_torchrun(monkeypatch):
    """--launcher auto: one node forks its ranks from the launching process (no command to run);
    several nodes or a rendezvous backend re-run under torchrun; fork across nodes is refused."""
    from swiftlite.errors import UserError
    from swiftlite.launch import plan_launch
    for k in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    one = plan_launch(cfg_from(["--dataset", "d.jsonl", "--nproc-per-node", "2"], validate_paths=False), [])
    assert one.fork and one.command is None and one.world_size == 2 and one.master_port
    two = plan_launch(cfg_from(["--dataset", "d.jsonl", "--nproc-per-node", "2", "--nnodes", "2",
                                "--master-addr", "10.0.0.1", "--master-port", "29555"], validate_paths=False), [])
    assert not two.fork and two.command[1:3] == ["-m", "swiftlite.torchrun"]
    rdzv = plan_launch(cfg_from(["--dataset", "d.jsonl", "--nproc-per-node", "2", "--rdzv-backend", "c10d"],
                                validate_paths=False), [])
    assert not rdzv.fork and any(a.startswith("--rdzv-backend=c10d") for a in rdzv.command)
    with pytest.raises(UserError, match="--launcher fork"):
        plan_launch(cfg_from(["--dataset", "d.jsonl", "--nnodes", "2", "--launcher", "fork"],
                             validate_paths=False), [])


def test_auto_launcher_keeps_torchrun_on_cuda_builds(monkeypatch, tmp_path):
    """A CUDA (or ROCm) build of torch is never forked by --launcher auto: read from torch/version.py."""
    import importlib.util
    from types import SimpleNamespace

    from swiftlite import launch
    for k in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    assert launch.gpu_torch_build() is False  # the CPU wheel the tests run on
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "version.py").write_text("cuda: Optional[str] = '12.8'\nhip: Optional[str] = None\n")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: SimpleNamespace(origin=str(fake / "__init__.py")) if name == "torch"
                        else real(name, *a))
    assert launch.gpu_torch_build() is True
    c = cfg_from(["--dataset", "d.jsonl", "--nproc-per-node", "2"], validate_paths=False)
    plan = launch.plan_launch(c, [])
    assert not plan.fork and plan.command[1:3] == ["-m", "swiftlite.torchrun"]
    forced = launch.plan_launch(cfg_from(["--dataset", "d.jsonl", "--nproc-per-node", "2", "--launcher", "fork"],
                                         validate_paths=False), [])
    assert forced.fork


def test_every_rule_refusal_is_reported_at_once():
    """Three bad values in one command: three lines, one per mistake (errors.UserErrors)."""
    import pytest as _pytest

    from swiftlite.config import build_config, validate
    from swiftlite.errors import UserErrors
    cfg = build_config({"model": "tiny-llama-2l", "dataset": ["x.jsonl"], "lora_rank": 0, "learning_rate": -1.0,
                        "warmup_ratio": 3.0})
    with _pytest.raises(UserErrors) as e:
        validate(cfg, check_paths=False)
    lines = e.value.lines
    assert len(lines) == 3, lines
    assert any(l.startswith("--lora-rank must be > 0") for l in lines)
    assert any(l.startswith("--learning-rate must be > 0") for l in lines)
    assert any(l.startswith("--warmup-ratio must be in [0, 1)") for l in lines)
