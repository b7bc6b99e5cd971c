"""A platform's node-level RANK / WORLD_SIZE (PAI-DLC, Kubeflow: no LOCAL_RANK) are the node rank and
the node count, with NPROC_PER_NODE ranks per node, as in ms-swift's DLC example: --dry-run and the run
agree on the world (2 local "nodes" x 2 processes = 4), with --deepspeed zero2 too."""

from __future__ import annotations

import json
import time

import pytest

from swiftlite.distributed import free_port
from tests.conftest import cli_env, run_cli, spawn_cli


def _node_env(rank: int, port: int) -> dict[str, str]:
    env = cli_env()
    for k in ("LOCAL_RANK", "TORCHELASTIC_RUN_ID", "NNODES", "NODE_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(k, None)
    env.update({"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                "NPROC_PER_NODE": "2"})
    return env


@pytest.mark.parametrize("backend", [pytest.param([], id="auto"),
                                     pytest.param(["--deepspeed", "zero2"], id="zero2", marks=pytest.mark.long)])
def test_dlc_env_same_world_in_dry_run_and_run(demo_data, tmp_path, backend):
    train, _ = demo_data
    out = tmp_path / "out"
    args = ["sft", "--model", "tiny-llama-2l", "--dataset", f"{train}#32", "--torch-dtype", "fp32",
            "--gradient-checkpointing", "false", "--max-steps", "1", "--save-hf-model", "false",
            "--output-dir", str(out), *backend]
    port = free_port()
    dry = run_cli([*args, "--dry-run"], env=_node_env(1, port), check=False, timeout=120)
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert "world:          2 node(s) x 2 process(es) = 4" in dry.stdout, dry.stdout
    # ms-swift's rule on the whole world: ceil(16 / (1 x 4)) = 4 micro-batches per step
    assert "batch:          per-device 1 x 4 x accumulation 4 = global 16" in dry.stdout, dry.stdout
    assert "--nnodes=2 --node-rank=1 --master-addr=127.0.0.1" in dry.stdout, dry.stdout
    procs = []
    for rank in (0, 1):
        procs.append(spawn_cli(args, env=_node_env(rank, port), merge_stderr=True))
        time.sleep(0.5)   # node 0 first: it hosts the rendezvous store
    outputs = [p.communicate(timeout=540)[0] for p in procs]
    for p, text in zip(procs, outputs):
        assert p.returncode == 0, text[-4000:]
    state = json.loads((out / "checkpoint-1" / "trainer_state.json").read_text())
    assert state["world_size"] == 4, state
    assert json.loads((out / "args.json").read_text())["train"]["gradient_accumulation_steps"] == 4


def test_node_level_vars_are_nodes_not_a_rank(monkeypatch):
    from swiftlite import env
    from swiftlite.cli import parse_run_args
    from swiftlite.config import load_config
    for k in ("LOCAL_RANK", "TORCHELASTIC_RUN_ID", "NNODES", "NODE_RANK"):
        monkeypatch.delenv(k, raising=False)
    for k, v in {"RANK": "1", "WORLD_SIZE": "3", "MASTER_ADDR": "10.0.0.1", "NPROC_PER_NODE": "8"}.items():
        monkeypatch.setenv(k, v)
    assert not env.inside_launcher()
    cfg = load_config(*parse_run_args(["--dataset", "d.jsonl"]), validate_paths=False)
    assert (cfg.parallel.nnodes, cfg.parallel.node_rank, cfg.parallel.nproc_per_node) == (3, 1, 8)
    assert cfg.parallel.master_addr == "10.0.0.1" and cfg.train.gradient_accumulation_steps == 1  # 16 / 24
    monkeypatch.setenv("NNODES", "2")             # ms-swift's own variables win, as in its DLC script
    assert load_config(*parse_run_args(["--dataset", "d.jsonl"]), validate_paths=False).parallel.nnodes == 2
    monkeypatch.setenv("LOCAL_RANK", "0")         # a real launcher's rank: torchrun's values describe it
    assert env.inside_launcher() and env.launcher_values() == {}
