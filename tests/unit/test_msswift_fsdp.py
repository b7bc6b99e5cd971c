"""ms-swift's --fsdp / --fsdp_config mean the swiftlite FSDP backend and options they name
(config/msswift_fsdp.py): the preset, HF's option words, ms-swift's and accelerate's JSON shapes, each
key's translation, each refusal (all reported together), args.json, and one 2-step fsdp x 2 run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from swiftlite.cli import parse_run_args
from swiftlite.config import load_config
from swiftlite.errors import UserError, UserErrors

BASE = ["--model", "tiny-llama-2l", "--dataset", "d.jsonl"]

# ms-swift's examples/train/multi-gpu/fsdp_qlora/fsdp_offload.json and fsdp2_lora/fsdp2.json at 3602360a
ACCELERATE_OFFLOAD = {
    "compute_environment": "LOCAL_MACHINE", "debug": False, "distributed_type": "FSDP", "downcast_bf16": "no",
    "fsdp_config": {"fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_backward_prefetch": "BACKWARD_PRE",
                    "fsdp_cpu_ram_efficient_loading": True, "fsdp_forward_prefetch": False,
                    "fsdp_offload_params": True, "fsdp_sharding_strategy": "FULL_SHARD",
                    "fsdp_state_dict_type": "FULL_STATE_DICT", "fsdp_sync_module_states": True,
                    "fsdp_use_orig_params": False},
    "machine_rank": 0, "main_training_function": "main", "mixed_precision": "no", "num_machines": 1,
    "num_processes": 2, "rdzv_backend": "static", "same_network": True, "tpu_env": [], "tpu_use_cluster": False,
    "tpu_use_sudo": False, "use_cpu": False}
ACCELERATE_FSDP2 = {
    "compute_environment": "LOCAL_MACHINE", "debug": False, "distributed_type": "FSDP", "downcast_bf16": "no",
    "fsdp_config": {"fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_cpu_ram_efficient_loading": True,
                    "fsdp_reshard_after_forward": True, "fsdp_state_dict_type": "FULL_STATE_DICT",
                    "fsdp_activation_checkpointing": True, "fsdp_version": 2},
    "machine_rank": 0, "main_training_function": "main", "mixed_precision": "bf16", "num_machines": 1,
    "num_processes": 2, "rdzv_backend": "static", "same_network": True, "tpu_env": [], "tpu_use_cluster": False,
    "tpu_use_sudo": False, "use_cpu": False}


@pytest.fixture(autouse=True)
def _no_launcher_env(monkeypatch):
    for k in ("NPROC_PER_NODE", "NNODES", "NODE_RANK", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"):
        monkeypatch.delenv(k, raising=False)


def resolve(*argv: str, nproc: str | None = "2"):
    """Resolved on 2 processes unless said otherwise (FSDP's options need a sharded run)."""
    config_file, values = parse_run_args([*BASE, *(["--nproc-per-node", nproc] if nproc else []), *argv])
    return load_config(config_file, values, validate_paths=False)


def refusals(*argv: str, nproc: str | None = "2") -> list[str]:
    with pytest.raises(UserError) as e:
        resolve(*argv, nproc=nproc)
    return e.value.lines if isinstance(e.value, UserErrors) else [str(e.value)]


def knobs(cfg) -> dict:
    p = cfg.parallel
    return {"parallelism": p.parallelism, "reshard_after_forward": p.reshard_after_forward,
            "cpu_offload": p.cpu_offload, "forward_prefetch": p.forward_prefetch,
            "backward_prefetch": p.backward_prefetch, "sharded_loading": p.sharded_loading,
            "gradient_checkpointing": cfg.train.gradient_checkpointing}


DEFAULT = {"parallelism": "fsdp", "reshard_after_forward": None, "cpu_offload": False, "forward_prefetch": None,
           "backward_prefetch": None, "sharded_loading": True, "gradient_checkpointing": True}


def test_preset_fsdp2_is_fsdp2_with_activation_checkpointing():
    cfg = resolve("--fsdp", "fsdp2", "--gradient_checkpointing", "true")  # agrees with the preset
    assert knobs(cfg) == DEFAULT
    assert "parallelism" in cfg.explicit and "gradient_checkpointing" in cfg.explicit


@pytest.mark.parametrize("argv,changed", [
    (["full_shard auto_wrap"], {}),
    (["full_shard", "auto_wrap"], {}),                             # unquoted words read the same
    (["shard_grad_op"], {"reshard_after_forward": "false"}),
    (["hybrid_shard", "auto_wrap"], {"parallelism": "hsdp"}),
    (["hybrid_shard_zero2"], {"parallelism": "hsdp", "reshard_after_forward": "false"}),
    (["full_shard offload auto_wrap"], {"cpu_offload": True}),
    (["offload"], {"cpu_offload": True}),                          # full_shard is HF's default strategy
])
def test_hf_option_words(argv, changed):
    assert knobs(resolve("--fsdp", *argv)) == {**DEFAULT, **changed}


@pytest.mark.parametrize("words,conf,changed", [
    ("full_shard", {"fsdp_version": 1}, {"parallelism": "fsdp1"}),
    ("shard_grad_op", {"version": 1}, {"parallelism": "fsdp1", "reshard_after_forward": "false"}),
    ("full_shard", {"fsdp_version": 1, "backward_prefetch": "BACKWARD_PRE", "use_orig_params": True,
                    "forward_prefetch": False, "limit_all_gathers": True}, {"parallelism": "fsdp1"}),
    ("full_shard", {"reshard_after_forward": False}, {"reshard_after_forward": "false"}),  # the key wins
    ("shard_grad_op", {"fsdp_reshard_after_forward": True}, {}),
    ("full_shard", {"sharding_strategy": "SHARD_GRAD_OP"}, {"reshard_after_forward": "false"}),
    ("full_shard", {"sharding_strategy": 4}, {"parallelism": "hsdp"}),
    ("full_shard", {"cpu_offload": True}, {"cpu_offload": True}),
    ("full_shard offload", {"offload_params": False}, {}),
    ("full_shard", {"activation_checkpointing": True}, {}),
    ("full_shard", {"forward_prefetch": True}, {"forward_prefetch": 1}),
    ("full_shard", {"backward_prefetch": "BACKWARD_PRE"}, {}),    # FSDP2's own one-layer prefetch
    ("full_shard", {"cpu_ram_efficient_loading": False}, {"sharded_loading": False}),
    ("full_shard", {"cpu_ram_efficient_loading": True, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}, {}),
    ("full_shard", {"state_dict_type": "SHARDED_STATE_DICT"}, {}),
    ("full_shard", {"state_dict_type": "FULL_STATE_DICT"}, {}),
])
def test_fsdp_config_keys(words, conf, changed):
    assert knobs(resolve("--fsdp", words, "--fsdp_config", json.dumps(conf))) == {**DEFAULT, **changed}


def test_activation_checkpointing_sets_gradient_checkpointing():
    cfg = resolve("--fsdp", "full_shard", "--gradient_checkpointing", "false")
    assert cfg.train.gradient_checkpointing is False  # no activation_checkpointing: nothing changes
    cfg = resolve("--fsdp", "full_shard", "--fsdp_config", '{"activation_checkpointing": true}')
    assert cfg.train.gradient_checkpointing is True
    lines = refusals("--fsdp", "full_shard", "--fsdp_config", '{"activation_checkpointing": true}',
                     "--gradient_checkpointing", "false")
    assert lines == ["--fsdp full_shard means --gradient-checkpointing true, but --gradient-checkpointing false is "
                     "given: drop one"]


def test_msswift_json_file_and_text(tmp_path):
    f = tmp_path / "my_fsdp.json"
    f.write_text(json.dumps({"_note": "comments are skipped", "fsdp": "shard_grad_op auto_wrap offload",
                             "fsdp_config": {"fsdp_version": 2, "cpu_ram_efficient_loading": False,
                                             "activation_checkpointing": False}}))
    want = {**DEFAULT, "reshard_after_forward": "false", "cpu_offload": True, "sharded_loading": False}
    assert knobs(resolve("--fsdp", str(f))) == want
    assert knobs(resolve("--fsdp", f.read_text())) == want
    # a file without "fsdp" takes ms-swift's default words, full_shard auto_wrap
    f.write_text(json.dumps({"fsdp_config": {"fsdp_version": 1}}))
    assert knobs(resolve("--fsdp", str(f))) == {**DEFAULT, "parallelism": "fsdp1"}


def test_accelerate_config_files(tmp_path, monkeypatch):
    monkeypatch.setenv("NPROC_PER_NODE", "2")  # as ms-swift's scripts launch: nproc_per_node=2
    f = tmp_path / "fsdp_offload.json"
    f.write_text(json.dumps(ACCELERATE_OFFLOAD))
    cfg = resolve("--fsdp", str(f), nproc=None)
    assert knobs(cfg) == {**DEFAULT, "cpu_offload": True}
    f.write_text(json.dumps(ACCELERATE_FSDP2))
    assert knobs(resolve("--fsdp", str(f), "--gradient_checkpointing", "true", nproc=None)) == DEFAULT
    monkeypatch.setenv("NPROC_PER_NODE", "4")
    assert refusals("--fsdp", str(f), nproc=None) == [
        f"--fsdp {f}: num_processes 2 but this run starts 4 (--nproc-per-node / NPROC_PER_NODE x nodes): make them "
        "agree"]


def test_config_file_keys(tmp_path):
    p = tmp_path / "run.yaml"
    p.write_text("dataset: [d.jsonl]\nfsdp: shard_grad_op\nfsdp_config: {fsdp_version: 1}\n")
    cfg = load_config(str(p), {"model": "tiny-llama-2l", "nproc_per_node": 2}, validate_paths=False)
    assert knobs(cfg) == {**DEFAULT, "parallelism": "fsdp1", "reshard_after_forward": "false"}
    assert json.loads(cfg.parallel.fsdp_config) == {"fsdp_version": 1}


def test_args_json_records_what_was_said_and_the_result(tmp_path):
    from swiftlite.config import load_args, save_args
    cfg = resolve("--fsdp", "shard_grad_op", "offload", "--fsdp_config", '{"fsdp_version": 2}')
    save_args(cfg, tmp_path / "args.json")
    par = json.loads((tmp_path / "args.json").read_text())["parallel"]
    assert (par["fsdp"], par["fsdp_config"]) == (["shard_grad_op offload"], '{"fsdp_version": 2}')
    assert (par["parallelism"], par["reshard_after_forward"], par["cpu_offload"]) == ("fsdp", "false", True)
    back = load_args(tmp_path / "args.json")
    assert knobs(back) == knobs(cfg)


@pytest.mark.parametrize("argv,line", [
    (["--fsdp", "full_shard", "--fsdp_config", '{"auto_wrap_policy": "SIZE_BASED_WRAP"}'],
     "--fsdp full_shard: auto_wrap_policy 'SIZE_BASED_WRAP': swiftlite wraps each decoder layer"),
    (["--fsdp", "full_shard", "--fsdp_config", '{"min_num_params": 100000}'],
     "--fsdp full_shard: min_num_params 100000: size-based wrapping is not available"),
    (["--fsdp", "full_shard", "--fsdp_config", '{"limit_all_gatherz": true}'],
     "--fsdp full_shard: limit_all_gatherz True: not an FSDP option swiftlite honours"),
    (["--fsdp", "full_shard", "--fsdp_config", '{"state_dict_type": "LOCAL_STATE_DICT"}'],
     "--fsdp full_shard: state_dict_type 'LOCAL_STATE_DICT': checkpoints are sharded"),
    (["--fsdp", "full_shard", "--fsdp_config", '{"activation_cpu_offload": true}'],
     "--fsdp full_shard: activation_cpu_offload True: offloading activations to CPU is not available"),
    (["--fsdp", "full_shard", "--fsdp_config", '{"fsdp_version": 1, "forward_prefetch": true}'],
     "--fsdp full_shard: forward_prefetch True: swiftlite's fsdp1 does not prefetch forward"),
    (["--fsdp", "full_shard", "--fsdp_config", '{"backward_prefetch": "BACKWARD_POST"}'],
     "--fsdp full_shard: backward_prefetch 'BACKWARD_POST': FSDP2 always prefetches"),
    (["--fsdp", "full_shard", "--fsdp_config", '{"fsdp_version": 3}'],
     "--fsdp full_shard: fsdp_version must be 1 or 2"),
    (["--fsdp", "no_shard"], "--fsdp no_shard: no_shard replicates the model on every rank: use --parallelism ddp"),
    (["--fsdp", "hybrid_shard", "--fsdp_config", '{"fsdp_version": 1}'],
     "--fsdp hybrid_shard: hybrid_shard with fsdp_version 1: swiftlite's hybrid sharding is FSDP2's"),
    (["--fsdp", "full_shard", "wrap_all"], "--fsdp full_shard wrap_all: unknown option 'wrap_all'"),
    (["--fsdp", "fsdp3"], "--fsdp fsdp3: not a preset (fsdp2), an HF option"),
    (["--fsdp", "fsdp2", "--deepspeed", "zero2"],
     "--fsdp fsdp2 with --deepspeed zero2: ms-swift refuses FSDP with DeepSpeed too: keep one"),
    (["--fsdp", "fsdp2", "--parallelism", "zero3"],
     "--fsdp fsdp2 means --parallelism fsdp, but --parallelism zero3 is given: drop one"),
    (["--fsdp", "shard_grad_op", "--reshard-after-forward", "true"],
     "--fsdp shard_grad_op means --reshard-after-forward false, but --reshard-after-forward true is given"),
    (["--fsdp", "hybrid_shard", "--parallelism", "fsdp"], "--fsdp hybrid_shard means --parallelism hsdp, but"),
    (["--fsdp", "fsdp2", "--fsdp_config", '{"fsdp_version": 1}'],
     "--fsdp_config with --fsdp fsdp2: ms-swift replaces it with the file's fsdp_config"),
    (["--fsdp_config", '{"fsdp_version": 2}'], "--fsdp_config needs --fsdp"),
    (["--fsdp", "full_shard", "--fsdp_config", "{bad json"], "--fsdp_config {bad json: not a preset"),
])
def test_refusals(argv, line):
    lines = refusals(*argv)
    assert len(lines) == 1 and lines[0].startswith(line), lines


def test_one_process_names_the_fsdp_setting():
    """ms-swift runs FSDP on one GPU; here FSDP on one process is single, which has nothing to shard:
    an option the translation sets is refused naming --fsdp, not a flag the user never typed."""
    assert refusals("--fsdp", "shard_grad_op offload", nproc=None) == [
        "--fsdp shard_grad_op offload sets --reshard-after-forward false, --cpu-offload true, which one process "
        "does not use (FSDP on one process runs as single: nothing to shard): start 2 or more processes "
        "(--nproc-per-node, NPROC_PER_NODE)"]
    assert knobs(resolve("--fsdp", "fsdp2", nproc=None)) == DEFAULT  # nothing a single process lacks


def test_agreeing_flags_are_accepted():
    assert knobs(resolve("--fsdp", "fsdp2", "--parallelism", "fsdp")) == DEFAULT
    assert knobs(resolve("--fsdp", "fsdp2", "--parallelism", "fsdp2")) == DEFAULT  # its alias
    assert knobs(resolve("--fsdp", "shard_grad_op", "--reshard_after_forward", "false"))["reshard_after_forward"] \
        == "false"


def test_every_refusal_is_reported_at_once(tmp_path):
    lines = refusals("--fsdp", "full_shard", "--fsdp_config",
                     '{"auto_wrap_policy": "SIZE_BASED_WRAP", "xla": true, "fsdp_foo": 1}',
                     "--deepspeed", "zero3", "--lora_rank", "-1")
    joined = "\n".join(lines)
    assert len(lines) == 5, lines
    for part in ("auto_wrap_policy 'SIZE_BASED_WRAP'", "xla True: XLA FSDP is not available", "foo 1: not an FSDP",
                 "with --deepspeed zero3", "--lora-rank"):
        assert part in joined, (part, lines)


def test_the_backend_resolves_and_the_dry_run_line():
    from swiftlite.planner import choose_backend as resolve_backend
    assert resolve_backend(resolve("--fsdp", "fsdp2"), 2).name == "fsdp"
    assert resolve_backend(resolve("--fsdp", "full_shard", "--fsdp_config", '{"fsdp_version": 1}'), 2).name == "fsdp1"
    assert resolve_backend(resolve("--fsdp", "fsdp2"), 1).name == "single"  # nothing to shard on one process
    from swiftlite.config.msswift_fsdp import describe
    assert describe(["shard_grad_op offload"], None) == \
        "--fsdp shard_grad_op offload -> --parallelism fsdp --reshard-after-forward false --cpu-offload true"


def test_two_step_fsdp2_run(tmp_path, demo_data):
    """ms-swift's --fsdp fsdp2 trains as --parallelism fsdp on 2 processes (and args.json says so)."""
    from tests.conftest import run_cli
    train, _ = demo_data
    out = tmp_path / "out"
    run_cli(["sft", "--model", "tiny-llama-2l", "--dataset", f"{train}#16", "--fsdp", "fsdp2",
             "--nproc-per-node", "2", "--max-steps", "2", "--torch-dtype", "fp32", "--output-dir", out,
             "--gradient-accumulation-steps", "1"], timeout=300)
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    assert (state["backend"], state["world_size"], state["global_step"]) == ("fsdp", 2, 2)
    assert sorted(p.name for p in (out / "checkpoint-2" / "dcp").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    args = json.loads((out / "args.json").read_text())
    assert (args["parallel"]["fsdp"], args["parallel"]["parallelism"]) == (["fsdp2"], "fsdp")
    assert args["train"]["gradient_checkpointing"] is True
