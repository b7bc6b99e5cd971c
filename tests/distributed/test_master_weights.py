"""bf16 = fp32 master weights + bf16 compute on every backend (docs/backends.md, "Precision").

fsdp, fsdp1, ddp and ZeRO-3 on 2 CPU processes train the 4-layer demo Llama in full with
--torch-dtype bf16, lr 1e-5, for 8 steps through the real CLI. Their checkpoints must hold fp32
parameters and fp32 AdamW state (read from the checkpoint's metadata: DCP's `.metadata` through the
allow-list reader, DeepSpeed's ZeRO files through the ZeRO reader), their HF copies stay bf16, and
their loss curves agree. Then an update bf16 cannot represent: --pure-bf16 loses it, the fp32
master keeps it.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from tests.conftest import ROOT, read_losses, read_state_bytes, run_cli

STEPS = 8
REL = 1e-2
BACKENDS = ("fsdp", "fsdp1", "ddp", "zero3")
LR = 1e-5

pytestmark = pytest.mark.slow


def _args(train, out, parallelism, *extra, steps=STEPS, lr=LR):
    return ["sft", "--model", "tiny-llama", "--dataset", train, "--torch-dtype", "bf16", "--train-type", "full",
            "--learning-rate", lr, "--gradient-accumulation-steps", "1", "--gradient-checkpointing", "false", "--max-steps", steps, "--logging-steps", 1, "--save-steps", steps,
            "--output-dir", out, "--seed", 7, "--parallelism", parallelism, "--nproc-per-node", 2,
            "--per-device-train-batch-size", 2, *extra]


def _zero3_json(root: Path) -> Path:
    """ZeRO-3 with every parameter partitioned (tiny models otherwise keep small ones whole)."""
    zero3 = json.loads((ROOT / "ds_configs" / "zero3.json").read_text())
    zero3["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    path = root / "zero3_all_partitioned.json"
    path.write_text(json.dumps(zero3))
    return path


@pytest.fixture(scope="module")
def runs(demo_data, tmp_path_factory):
    train, _val = demo_data
    root = tmp_path_factory.mktemp("master")
    out = {}
    for name in BACKENDS:
        par = str(_zero3_json(root)) if name == "zero3" else name
        d = root / name
        run_cli(_args(train, d, par), timeout=600)
        out[name] = d
    return out


def dcp_dtypes(ckpt: Path) -> Counter:
    """(group, dtype) -> count of the tensors a DCP checkpoint holds, from its `.metadata` alone:
    group "param" for the model entries, else the optimizer state's key (exp_avg, exp_avg_sq)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from swiftlite.checkpoint.layout import DCP_DIR
    from swiftlite.checkpoint.safety import load_dcp_metadata
    md = load_dcp_metadata(ckpt / DCP_DIR)
    out: Counter = Counter()
    for key, meta in md.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata):
            continue
        if key.startswith("model."):
            out[("param", meta.properties.dtype)] += 1
        elif key.startswith("optim.state.") and key.rsplit(".", 1)[-1] in ("exp_avg", "exp_avg_sq"):
            out[(key.rsplit(".", 1)[-1], meta.properties.dtype)] += 1
    return out


def zero_dtypes(ckpt: Path) -> Counter:
    """The same for a DeepSpeed checkpoint: its master weights through the ZeRO reader, and the
    AdamW state in each rank's optimizer file (allow-list loader, memory-mapped)."""
    import glob

    import torch

    from swiftlite.checkpoint.layout import DS_TAG
    from swiftlite.checkpoint.readers import ZeroReader
    from swiftlite.checkpoint.safety import safe_torch_load
    out: Counter = Counter()
    for _shape, dtype in ZeroReader(ckpt, exclude_frozen=False).info.values():
        out[("param", dtype)] += 1
    files = sorted(glob.glob(str(ckpt / DS_TAG / "*optim_states.pt")))
    assert len(files) == 2
    for f in files:
        with safe_torch_load():
            sd = torch.load(f, map_location="cpu")
        osd = sd["optimizer_state_dict"]
        base = osd.get("optimizer_state_dict") or osd.get("base_optimizer_state")
        for state in base["state"].values():
            for k in ("exp_avg", "exp_avg_sq"):
                out[(k, state[k].dtype)] += 1
    return out


@pytest.mark.parametrize("name", BACKENDS)
def test_checkpoint_holds_fp32_parameters_and_optimizer_state(runs, name):
    import torch
    ckpt = runs[name] / f"checkpoint-{STEPS}"
    got = zero_dtypes(ckpt) if name == "zero3" else dcp_dtypes(ckpt)
    assert got, name
    assert {dtype for (_group, dtype) in got} == {torch.float32}, (name, got)
    groups = {group for (group, _dtype) in got}
    assert groups == {"param", "exp_avg", "exp_avg_sq"}, (name, got)
    if name != "zero3":  # one entry per parameter (39 tensors in tiny-llama: tied embedding once)
        assert got[("param", torch.float32)] == got[("exp_avg", torch.float32)] == 39


def test_loss_curves_agree(runs):
    curves = {name: read_losses(runs[name]) for name in BACKENDS}
    ref = curves["fsdp"]
    assert sorted(ref) == list(range(1, STEPS + 1))
    worst = {}
    for name, curve in curves.items():
        rel = [abs(curve[s] - ref[s]) / abs(ref[s]) for s in range(1, STEPS + 1)]
        worst[name] = max(rel)
    print("max relative loss difference to fsdp:", {k: f"{v:.2e}" for k, v in worst.items()})
    assert all(v <= REL for v in worst.values()), (worst, curves)


@pytest.mark.parametrize("name", BACKENDS)
def test_hf_copy_in_the_checkpoint_stays_bf16(runs, name):
    from safetensors import safe_open
    folder = runs[name] / f"checkpoint-{STEPS}" / "model"
    dtypes = set()
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as fh:
            dtypes |= {str(fh.get_slice(k).get_dtype()) for k in fh.keys()}
    assert dtypes == {"BF16"}, (name, dtypes)
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.parametrize("name", BACKENDS)
def test_state_bytes_equal_the_estimate(runs, name):
    """What each rank holds (counted from its tensors) is what the memory model says: 4 + 4 + 8 bytes
    per parameter on the torch backends, DeepSpeed's 2 + 2 + 12, all sharded but DDP's."""
    from swiftlite.planner.memory import Workload, model_state_bytes
    from swiftlite.planner.shape import shape_from_model_arg
    want = model_state_bytes(shape_from_model_arg("tiny-llama"),
                             Workload(train_type="full", dtype="bf16", world_size=2), name)
    for rank, got in read_state_bytes(runs[name]).items():
        for key, value in want.items():
            assert abs(got[key] - value) <= 0.02 * value, (name, rank, key, got[key], value)


# -- an update below bf16's resolution ----------------------------------------------------------------

def _norm_weights(reader) -> dict:
    names = [n for n in reader.info if n.endswith("norm.weight")]
    assert len(names) == 9  # 2 per layer x 4 + the final norm
    return reader.read(names)


@pytest.fixture(scope="module")
def one_step(demo_data, tmp_path_factory):
    """One fsdp x 2 step with lr 1e-5 and a constant schedule, with master weights and with --pure-bf16."""
    train, _ = demo_data
    root = tmp_path_factory.mktemp("one_step")
    out = {}
    for name, extra in (("master", []), ("pure", ["--pure-bf16"])):
        d = root / name
        run_cli(_args(train, d, "fsdp", "--lr-scheduler", "constant", *extra, steps=1), timeout=600)
        out[name] = d / "checkpoint-1"
    return out


def test_pure_bf16_loses_an_update_that_master_weights_keep(one_step):
    """RMSNorm weights start at exactly 1.0, where bf16's spacing is 2**-7 = 0.0078: AdamW's first
    step moves each by about lr (1e-5, plus weight decay 1e-6), far below half of that spacing.
    --pure-bf16 rounds the updated weights back to 1.0: the step is lost. The fp32 master keeps it."""
    import torch

    from swiftlite.checkpoint.layout import DCP_DIR
    from swiftlite.checkpoint.readers import DCPReader
    pure = _norm_weights(DCPReader(one_step["pure"] / DCP_DIR))
    master = _norm_weights(DCPReader(one_step["master"] / DCP_DIR))
    for name, w in pure.items():
        assert w.dtype == torch.bfloat16
        assert torch.equal(w, torch.ones_like(w)), f"{name}: pure bf16 kept an update below its resolution?"
    for name, w in master.items():
        assert w.dtype == torch.float32
        delta = (w - 1.0).abs()
        # every element whose gradient is not exactly 0 moved; a bf16 gradient can sum to exactly 0 (one of
        # 256 did on a CPU whose bf16 matmuls use AMX tiles), so up to 1% may stay: pure bf16 keeps none
        assert (delta > 0).float().mean() >= 0.99, f"{name}: the fp32 master lost updates"
        assert float(delta.median()) == pytest.approx(LR, rel=0.2), name
        assert torch.equal(w.to(torch.bfloat16).float(), torch.ones_like(w))  # invisible in bf16 ...
    # ... and the pure checkpoint's whole state is bf16
    assert {d for (_g, d) in dcp_dtypes(one_step["pure"])} == {torch.bfloat16}


def test_pure_bf16_on_deepspeed_keeps_bf16_optimizer_state(demo_data, tmp_path):
    """--pure-bf16 on DeepSpeed: its bf16_master_weights_and_grads + bf16_optimizer_states."""
    import torch
    train, _ = demo_data
    d = tmp_path / "zero3_pure"
    run_cli(_args(train, d, str(_zero3_json(tmp_path)), "--pure-bf16", steps=2), timeout=600)
    got = zero_dtypes(d / "checkpoint-2")
    assert {dtype for (_g, dtype) in got} == {torch.bfloat16}, got
