"""`--parallelism` has one owner: dry-run, preflight and the trainer report the same backend for every
value x {1, 2} processes x {fp32, bf16, fp16}, or the same one-line refusal before anything starts."""

from __future__ import annotations

import io
from contextlib import redirect_stderr, redirect_stdout
from types import SimpleNamespace

import pytest

from swiftlite.cli import main, parse_run_args
from swiftlite.config import load_config
from swiftlite.errors import UserError
from swiftlite.launch import preflight
from swiftlite.parallel.base import parallelism_names


def trainer_resolve(*args, **kwargs):
    """The backend a rank builds (train/run.resolve_run_here: the run it resolves, or is handed)."""
    from swiftlite.train.run import resolve_run_here
    return resolve_run_here(*args, **kwargs).choice


VALUES = [n for n in parallelism_names() if n != "deepspeed"] + ["deepspeed"]
DTYPES = ["fp32", "bf16", "fp16"]


def _argv(data: str, out: str, parallelism: str, nproc: int, dtype: str) -> list[str]:
    argv = ["--dataset", data, "--output-dir", out, "--parallelism", parallelism, "--torch-dtype", dtype]
    if nproc > 1:
        argv += ["--nproc-per-node", str(nproc)]
    if parallelism == "deepspeed":
        argv += ["--deepspeed", "zero3"]
    if parallelism == "zero3_offload_nvme":
        argv += ["--offload-dir", out + "-nvme"]
    return argv


def _dry_run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(["sft", *argv, "--dry-run"])
    return rc, out.getvalue(), err.getvalue()


def _outcome(fn):
    try:
        return ("ok", fn())
    except UserError as e:
        return ("error", str(e))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from swiftlite.demo import write_demo_data
    d = tmp_path_factory.mktemp("data")
    write_demo_data(d, n_train=64, n_val=8)
    return str(d / "train.jsonl")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nproc", [1, 2])
@pytest.mark.parametrize("parallelism", VALUES)
def test_dry_run_preflight_and_trainer_agree(parallelism, nproc, dtype, data, tmp_path, monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NPROC_PER_NODE", "NNODES"):
        monkeypatch.delenv(k, raising=False)
    argv = _argv(data, str(tmp_path / "out"), parallelism, nproc, dtype)
    cfg = load_config(*parse_run_args(argv))
    pre = _outcome(lambda: preflight(cfg, nproc, data=False).choice.name)
    world = SimpleNamespace(device="cpu", device_type="cpu", distributed=nproc > 1, world_size=nproc,
                            local_world_size=nproc, rank=0, is_main=False)
    run = _outcome(lambda: trainer_resolve(cfg, world).name)
    rc, out, err = _dry_run(argv)
    if pre[0] == "ok":
        shown = next(line for line in out.splitlines() if line.startswith("backend:"))
        assert rc == 0 and shown.split()[1] == pre[1] == run[1], (out, pre, run)
    else:
        # refused before any process starts: one line, exit 2, the same reason everywhere
        assert rc == 2 and err.strip() == f"error: {pre[1]}" and run == pre, (err, pre, run)
        assert "no backend" not in pre[1]
    assert not (tmp_path / "out").exists()  # neither dry-run nor preflight creates the run folder


def test_expected_choices_on_cpu(data, tmp_path):
    """The table's content, not only its agreement: a few rows spelled out."""
    def choice(*extra):
        cfg = load_config(*parse_run_args(["--dataset", data, "--output-dir", str(tmp_path / "o"), *extra]))
        return preflight(cfg, (cfg.parallel.nproc_per_node or 1), data=False).choice
    assert choice().name == "single"
    assert choice("--nproc-per-node", "2").name == "fsdp"
    assert choice("--parallelism", "ddp").name == "single"          # one process: nothing to replicate
    assert choice("--parallelism", "fsdp2", "--nproc-per-node", "2").name == "fsdp"
    z = choice("--parallelism", "zero3_offload", "--nproc-per-node", "2")
    assert (z.name, z.key, z.deepspeed_source, z.memory_family) == ("zero3_offload", "deepspeed", "zero3_offload",
                                                                   "zero3_offload")
    from swiftlite.parallel.deepspeed import fp16_available
    if fp16_available():   # a CPU with AVX512-FP16: DeepSpeed's loss scaling runs here
        assert choice("--torch-dtype", "fp16").name == "zero2"
    else:                  # refused before launch with the reason, never "no backend"
        with pytest.raises(UserError, match="--parallelism auto chose zero2 .*no GPU"):
            choice("--torch-dtype", "fp16")


def test_user_json_memory_family_follows_its_stage_offload_and_hpz(tmp_path):
    """A DeepSpeed JSON of the user's is estimated with the formulas of what it configures: hpZ makes
    a ZeRO-3 config ZeRO++ (its secondary weight partition counts), offload makes it zero3_offload."""
    import json

    from swiftlite.parallel.resolve import memory_family_for
    cases = {"s2": ({"stage": 2}, "zero2"), "s3": ({"stage": 3}, "zero3"),
             "hpz": ({"stage": 3, "zero_hpz_partition_size": 2}, "zero3pp"),
             "hpz_auto": ({"stage": 3, "zero_hpz_partition_size": "auto"}, "zero3pp"),
             "hpz_off": ({"stage": 3, "zero_hpz_partition_size": 1}, "zero3"),
             "off": ({"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}},
                     "zero3_offload")}
    for name, (zo, family) in cases.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"zero_optimization": zo}))
        assert memory_family_for(str(path), 4) == family, name
