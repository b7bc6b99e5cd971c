"""The multi-node knobs and their refusals, without training: --reshard-after-forward (bool or a
partial group size), --forward/--backward-prefetch, --cpu-offload, hsdp's shard size (default: the
processes per node), ZeRO++ hpZ/qwZ/qgZ in the zero3pp preset and in a user JSON. Every refusal is a
one-line UserError raised by the backend resolution preflight runs. Training runs: tests/distributed/
test_hsdp.py and test_zero3pp.py."""

from __future__ import annotations

import json

import pytest

from swiftlite.cli import parse_run_args
from swiftlite.config import load_config
from swiftlite.errors import UserError
from swiftlite.parallel import hsdp as hsdp_mod
from swiftlite.parallel.ds_config import quantized_comm_problem
from swiftlite.parallel.ds_config import PRESET_DIR, resolve_ds_config
from swiftlite.parallel.fsdp2 import check_cpu_offload, reshard_after_forward
from swiftlite.planner import choose_backend as resolve_backend

DATA = ["--dataset", "train.jsonl", "--model", "tiny-llama-2l", "--train-type", "full", "--torch-dtype", "fp32"]


def cfg_from(argv):
    config_file, values = parse_run_args([*DATA, *argv])
    return load_config(config_file, values, validate_paths=False)


def resolve(argv):
    """As preflight: the planned world is --nnodes x --nproc-per-node."""
    cfg = cfg_from(argv)
    world = (cfg.parallel.nproc_per_node or 1) * (cfg.parallel.nnodes or 1)
    return cfg, resolve_backend(cfg, world)


# -- --reshard-after-forward -----------------------------------------------------------------------

@pytest.mark.parametrize("given,value", [([], True), (["true"], True), (["1"], True), (["false"], False),
                                         (["0"], False), (["off"], False), (["4"], 4)])
def test_reshard_after_forward_values(given, value):
    flag = ["--reshard-after-forward", *given] if given else []
    cfg, choice = resolve(["--parallelism", "fsdp", "--nproc-per-node", "8", *flag])
    assert choice.name == "fsdp"
    got = reshard_after_forward(cfg)
    assert got == value and type(got) is type(value)


def test_reshard_after_forward_from_a_config_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("reshard_after_forward: false\nparallelism: fsdp\nnproc_per_node: 2\n")
    cfg = load_config(str(f), {"dataset": ["train.jsonl"]}, validate_paths=False)
    assert reshard_after_forward(cfg) is False


@pytest.mark.parametrize("argv,expect", [
    (["--parallelism", "fsdp", "--nproc-per-node", "8", "--reshard-after-forward", "3"],
     "sharded over 8 ranks.*give one of 2, 4"),
    (["--parallelism", "fsdp", "--nproc-per-node", "8", "--reshard-after-forward", "8"], "sharded over 8 ranks"),
    (["--parallelism", "fsdp", "--nproc-per-node", "8", "--reshard-after-forward", "two"],
     "--reshard-after-forward two: expected true, false or a number"),
    (["--parallelism", "hsdp", "--nproc-per-node", "2", "--nnodes", "2", "--reshard-after-forward", "2"],
     "hsdp each parameter is sharded over 2 ranks.*2 ranks have no such group"),
    (["--parallelism", "fsdp1", "--nproc-per-node", "8", "--reshard-after-forward", "2"],
     "partial resharding is FSDP2's"),
    (["--parallelism", "zero3", "--nproc-per-node", "2", "--reshard-after-forward", "false"],
     "--reshard-after-forward applies to fsdp/fsdp1/hsdp, not to --parallelism zero3"),
    (["--parallelism", "ddp", "--nproc-per-node", "2", "--forward-prefetch", "2"],
     "--forward-prefetch applies to fsdp/hsdp, not to --parallelism ddp"),
    (["--parallelism", "fsdp1", "--nproc-per-node", "2", "--backward-prefetch", "2"],
     "--backward-prefetch applies to fsdp/hsdp"),
    (["--parallelism", "fsdp", "--nproc-per-node", "2", "--forward-prefetch", "0"], "--forward-prefetch must be >= 1"),
    (["--parallelism", "ddp", "--nproc-per-node", "2", "--backward-prefetch", "0"], "--backward-prefetch must be >= 1"),
    (["--parallelism", "fsdp", "--nproc-per-node", "2", "--hsdp-shard-size", "2"],
     "--hsdp-shard-size applies to hsdp, not to --parallelism fsdp"),
    (["--parallelism", "hsdp", "--nproc-per-node", "4", "--hsdp-shard-size", "3"],
     "--hsdp-shard-size 3 must divide the 4 processes"),
    (["--parallelism", "hsdp", "--nproc-per-node", "4", "--hsdp-shard-size", "8"],
     "--hsdp-shard-size 8 must divide the 4 processes"),
    (["--parallelism", "hsdp", "--nproc-per-node", "4", "--hsdp-shard-size", "0"], "--hsdp-shard-size must be >= 1"),
    (["--parallelism", "zero3", "--nproc-per-node", "2", "--zero-quantized-weights"],
     "--zero-quantized-weights applies to zero3pp, not to --parallelism zero3"),
])
def test_refused_in_one_line(argv, expect):
    with pytest.raises(UserError, match=expect) as e:
        resolve(argv)
    assert "\n" not in str(e.value)


def test_flags_reach_apply_fsdp2():
    from swiftlite.parallel.fsdp2 import fsdp2_kwargs
    cfg, _ = resolve(["--parallelism", "fsdp", "--nproc-per-node", "8", "--reshard-after-forward", "4",
                      "--forward-prefetch", "2", "--backward-prefetch", "3"])
    assert fsdp2_kwargs(cfg) == {"mp": None, "reshard_after_forward": 4, "cpu_offload": False,
                                 "forward_prefetch": 2, "backward_prefetch": 3}
    cfg, _ = resolve(["--parallelism", "hsdp", "--nproc-per-node", "2"])
    assert fsdp2_kwargs(cfg)["reshard_after_forward"] is True
    assert fsdp2_kwargs(cfg)["forward_prefetch"] is None and fsdp2_kwargs(cfg)["backward_prefetch"] is None


@pytest.mark.parametrize("backend,knob", [
    (b, k) for b in ("fsdp", "hsdp", "fsdp1") for k in (["--reshard-after-forward", "false"], ["--cpu-offload"])
] + [(b, ["--forward-prefetch", "2"]) for b in ("fsdp", "hsdp")] + [("hsdp", ["--hsdp-shard-size", "1"])])
def test_fsdp_knobs_refused_on_one_process(backend, knob):
    """One process runs as single (unwrapped): the knob would be ignored there."""
    with pytest.raises(UserError, match="on one process runs as single"):
        resolve(["--parallelism", backend, *knob])


def test_knobs_accepted_where_they_apply():
    for argv in (["--parallelism", "fsdp", "--nproc-per-node", "4", "--forward-prefetch", "2", "--backward-prefetch", "3"],
                 ["--parallelism", "hsdp", "--nproc-per-node", "8", "--nnodes", "2", "--reshard-after-forward", "4",
                  "--forward-prefetch", "1"],
                 ["--parallelism", "fsdp1", "--nproc-per-node", "2", "--reshard-after-forward", "false"]):
        resolve(argv)


# -- --cpu-offload ---------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["fsdp", "hsdp", "fsdp1"])
def test_cpu_offload_refused_without_a_gpu(backend):
    import torch
    assert not torch.cuda.is_available()
    with pytest.raises(UserError, match="--cpu-offload moves parameters from the GPU to the CPU; this run has no GPU"):
        resolve(["--parallelism", backend, "--nproc-per-node", "2", "--cpu-offload"])


def test_cpu_offload_allowed_on_a_gpu_run():
    cfg = cfg_from(["--parallelism", "hsdp", "--nproc-per-node", "2", "--cpu-offload"])
    assert check_cpu_offload(cfg, 2, cuda=True) is None
    assert "no GPU" in check_cpu_offload(cfg, 2, cuda=False)


# -- hsdp's shard size -----------------------------------------------------------------------------

def test_shard_size_defaults_to_the_processes_per_node():
    cfg = cfg_from(["--parallelism", "hsdp", "--nproc-per-node", "4", "--nnodes", "3"])
    assert hsdp_mod.mesh_shape(cfg, 12, None) == (3, 4)          # before launch: --nproc-per-node
    assert hsdp_mod.mesh_shape(cfg, 12, 2) == (6, 2)             # in a rank: the launcher's LOCAL_WORLD_SIZE
    cfg = cfg_from(["--parallelism", "hsdp", "--nproc-per-node", "4", "--nnodes", "3", "--hsdp-shard-size", "6"])
    assert hsdp_mod.mesh_shape(cfg, 12, 4) == (2, 6)             # the flag wins


def test_shard_size_in_a_rank_comes_from_local_world_size(monkeypatch):
    """torchrun (by hand or under Slurm's srun) sets LOCAL_WORLD_SIZE on every node; a launcher that
    does not is refused rather than guessed (a guess of 1 would replicate the whole model)."""
    from swiftlite.distributed import World
    cfg = cfg_from(["--parallelism", "hsdp"])   # no --nproc-per-node: torchrun started the ranks
    world = World(rank=0, world_size=16, local_world_size=8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert hsdp_mod.mesh_shape(cfg, 16, hsdp_mod._local_world_size(cfg, world)) == (2, 8)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    with pytest.raises(UserError, match="LOCAL_WORLD_SIZE is not set.*--hsdp-shard-size"):
        hsdp_mod._local_world_size(cfg, world)
    cfg = cfg_from(["--parallelism", "hsdp", "--hsdp-shard-size", "4"])
    assert hsdp_mod.mesh_shape(cfg, 16, hsdp_mod._local_world_size(cfg, world)) == (4, 4)


def test_the_deepspeed_launchers_local_size_counts_too(monkeypatch):
    """The DeepSpeed launcher (--launcher deepspeed) sets LOCAL_SIZE instead of LOCAL_WORLD_SIZE."""
    from swiftlite.distributed import World
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("LOCAL_SIZE", "4")
    assert World.from_env().local_world_size == 4
    cfg = cfg_from(["--parallelism", "zero3pp"])
    assert resolve_ds_config(cfg, 8, 64, "zero3pp")["zero_optimization"]["zero_hpz_partition_size"] == 4


def test_hsdp_runs_as_single_on_one_process():
    _, choice = resolve(["--parallelism", "hsdp"])
    assert choice.name == "single"


# -- ZeRO++ ----------------------------------------------------------------------------------------

def test_zero3pp_fills_hpz_from_the_processes_per_node(monkeypatch):
    cfg = cfg_from(["--parallelism", "zero3pp", "--nproc-per-node", "4", "--nnodes", "2"])
    zo = resolve_ds_config(cfg, 8, 64, "zero3pp")["zero_optimization"]
    assert zo["stage"] == 3 and zo["zero_hpz_partition_size"] == 4
    assert zo["zero_quantized_weights"] is False and zo["zero_quantized_gradients"] is False
    cfg = cfg_from(["--parallelism", "zero3pp"])   # in a rank torchrun started: its LOCAL_WORLD_SIZE
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert resolve_ds_config(cfg, 8, 64, "zero3pp")["zero_optimization"]["zero_hpz_partition_size"] == 2
    # One node: the hpZ group would be the whole world (a second copy of each partition, no traffic
    # saved), so "auto" turns hpZ off.
    cfg = cfg_from(["--parallelism", "zero3pp", "--nproc-per-node", "4"])
    assert resolve_ds_config(cfg, 4, 64, "zero3pp")["zero_optimization"]["zero_hpz_partition_size"] == 1


def test_quantized_flags_fill_the_preset_and_are_allowed_on_a_gpu():
    cfg = cfg_from(["--parallelism", "zero3pp", "--nproc-per-node", "2", "--zero-quantized-weights",
                    "--zero-quantized-gradients"])
    ds = resolve_ds_config(cfg, 2, 64, "zero3pp")
    zo = ds["zero_optimization"]
    assert zo["zero_quantized_weights"] is True and zo["zero_quantized_gradients"] is True
    assert quantized_comm_problem(ds, cfg, cuda=True) is None
    assert "--zero-quantized-weights (ZeRO++ quantized communication) needs DeepSpeed's CUDA quantizer" in \
        quantized_comm_problem(ds, cfg, cuda=False)


@pytest.mark.parametrize("flag", ["--zero-quantized-weights", "--zero-quantized-gradients"])
def test_quantized_flags_refused_on_cpu(flag):
    with pytest.raises(UserError, match=f"{flag} .*this run has no GPU"):
        resolve(["--parallelism", "zero3pp", "--nproc-per-node", "2", flag])


def _user_json(tmp_path, **zero):
    ds = json.loads((PRESET_DIR / "zero3pp.json").read_text())
    ds["zero_optimization"].update(zero)
    p = tmp_path / "ds.json"
    p.write_text(json.dumps(ds))
    return str(p)


@pytest.mark.parametrize("key", ["zero_quantized_weights", "zero_quantized_gradients",
                                 "zero_quantized_nontrainable_weights"])
def test_a_user_json_gets_the_same_cpu_check(tmp_path, key):
    with pytest.raises(UserError, match=f"zero_optimization.{key}=true .*this run has no GPU"):
        resolve(["--parallelism", _user_json(tmp_path, **{key: True}), "--nproc-per-node", "2"])


@pytest.mark.parametrize("zero,world,expect", [
    ({"stage": 2}, 4, "zero_hpz_partition_size 2 .*needs ZeRO stage 3"),
    ({"zero_hpz_partition_size": 3}, 4, "zero_hpz_partition_size 3 .*must divide the 4 processes"),
    ({"zero_hpz_partition_size": 8}, 4, "zero_hpz_partition_size 8 .*must divide the 4 processes"),
    ({"zero_hpz_partition_size": 1, "stage": 2, "zero_quantized_gradients": True}, 4, "needs ZeRO stage 3"),
])
def test_bad_zeropp_json(tmp_path, zero, world, expect):
    zero = {"zero_hpz_partition_size": 2, **zero}
    with pytest.raises(UserError, match=expect):
        resolve(["--parallelism", _user_json(tmp_path, **zero), "--nproc-per-node", str(world)])


def test_flag_contradicting_the_json_is_refused(tmp_path):
    src = _user_json(tmp_path, zero_quantized_weights=False)
    cfg = cfg_from(["--parallelism", "zero3pp", "--nproc-per-node", "2", "--zero-quantized-weights"])
    with pytest.raises(UserError, match="zero_quantized_weights=false contradicts --zero-quantized-weights"):
        resolve_ds_config(cfg, 2, 64, src)


def test_flag_fills_a_json_without_the_key(tmp_path):
    ds = json.loads((PRESET_DIR / "zero3.json").read_text())
    p = tmp_path / "mine.json"
    p.write_text(json.dumps(ds))
    cfg = cfg_from(["--parallelism", "zero3pp", "--deepspeed", str(p), "--nproc-per-node", "2",
                    "--zero-quantized-gradients"])
    zo = resolve_ds_config(cfg, 2, 64, str(p))["zero_optimization"]
    assert zo["zero_quantized_gradients"] is True and "zero_quantized_weights" not in zo


def test_hpz_runs_on_cpu_so_zero3pp_resolves():
    _, choice = resolve(["--parallelism", "zero3pp", "--nproc-per-node", "2", "--nnodes", "2"])
    assert choice.name == "zero3pp" and choice.deepspeed_source == "zero3pp"


# -- prefetch wiring (real FSDP2 on a one-process gloo group) --------------------------------------

def test_prefetch_depth_sets_fsdp2_prefetch_lists(tmp_path):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaConfig, LlamaForCausalLM

    from swiftlite.distributed import free_port
    from swiftlite.parallel.fsdp2 import apply_fsdp2
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                                             num_attention_heads=2, num_key_value_heads=2))
        apply_fsdp2(model, init_device_mesh("cpu", (1,)), mp=None, reshard_after_forward=True, cpu_offload=False,
                    forward_prefetch=2, backward_prefetch=1)
        layers = list(model.model.layers)
        st = [m._get_fsdp_state() for m in layers]
        assert model._get_fsdp_state()._states_to_forward_prefetch == st[:2]
        assert [s._states_to_forward_prefetch for s in st] == [st[1:3], st[2:4], st[3:4], []]
        assert [s._states_to_backward_prefetch for s in st] == [[], st[0:1], st[1:2], st[2:3]]
        ids = torch.randint(0, 64, (2, 8))
        model(input_ids=ids, labels=ids).loss.backward()   # runs with the explicit prefetch
        assert all(p.grad is not None for p in model.parameters())
    finally:
        dist.destroy_process_group()
