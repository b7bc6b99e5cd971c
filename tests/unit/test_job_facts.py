"""The job's facts are resolved once (swiftlite/job.py) and handed from the launcher to the ranks.

The case that failed before: `--parallelism auto` with a hub model id on a CUDA machine. Preflight
resolved the backend without the model's shape, the rank with it, and the planner (which reads only
presets and folders) refused in preflight a job the rank would have run. Here a hub id (its config in
a local huggingface_hub cache, offline) and an 80 GB GPU go through `--dry-run`, preflight and the
trainer's resolution, which must all name the same backend; the rank then uses the facts it is handed
without resolving again, unless the whole job's smallest GPU differs from the launcher's.
"""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout
from types import SimpleNamespace

import pytest

from swiftlite.cli import main, parse_run_args
from swiftlite.config import load_config


def rank_resolve(*args, **kwargs):
    """The backend a rank builds (train/run.resolve_run_here: the run it resolves, or is handed)."""
    from swiftlite.train.run import resolve_run_here
    return resolve_run_here(*args, **kwargs).choice


GB = 10**9
REPO = "acme/llama-8b-like"
#: Llama-3-8B's shape (what the memory model reads from config.json)
CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
          "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
          "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
          "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


@pytest.fixture
def hub_model(tmp_path, monkeypatch):
    """REPO in a huggingface_hub cache of its own (config only), the hub offline."""
    import huggingface_hub.constants as hub
    cache = tmp_path / "hub"
    repo_dir = cache / ("models--" + REPO.replace("/", "--"))
    sha = "0" * 40
    (repo_dir / "snapshots" / sha).mkdir(parents=True)
    (repo_dir / "snapshots" / sha / "config.json").write_text(json.dumps(CONFIG))
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(sha)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return REPO


@pytest.fixture
def gpus(monkeypatch):
    """An 80 GB GPU in the launching process and in the rank (`memory["total"]` to change it)."""
    import torch
    memory = {"total": 80 * GB}
    monkeypatch.setattr("swiftlite.parallel.resolve.local_gpu_memory", lambda: memory["total"])
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: SimpleNamespace(total_memory=memory["total"]))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NPROC_PER_NODE", "NNODES", "SWIFTLITE_JOB_FACTS"):
        monkeypatch.delenv(k, raising=False)
    return memory


def _argv(model, tmp_path, *extra):
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "hello"}]}) + "\n")
    return ["--model", model, "--dataset", str(data), "--output-dir", str(tmp_path / "out"), "--nproc-per-node", "8",
            "--torch-dtype", "bf16", "--max-length", "4096", "--gradient-checkpointing", "true", *extra]


def _rank_world():
    return SimpleNamespace(device="cuda:0", device_type="cuda",
                           distributed=False, world_size=8, local_world_size=8, rank=0, is_main=True)


def test_hub_id_on_an_80gb_gpu_resolves_to_one_backend_everywhere(hub_model, gpus, tmp_path, capsys):
    from swiftlite.job import RESOLUTIONS
    from swiftlite.launch import preflight
    argv = _argv(hub_model, tmp_path, "--train-type", "full")
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["sft", *argv, "--dry-run"]) == 0
    dry = next(line for line in out.getvalue().splitlines() if line.startswith("backend:")).split()[1]

    facts = preflight(load_config(*parse_run_args(argv)), 8, data=False)   # the launching process
    assert facts.gpu_memory == 80 * GB and facts.shape is not None and facts.shape["hidden"] == 4096
    # a rank started by an external launcher (nothing handed): the same function, the same answer
    alone = rank_resolve(load_config(*parse_run_args(argv)), _rank_world())
    # a rank started by swiftlite: the handed facts, no second resolution
    before = RESOLUTIONS["count"]
    handed = rank_resolve(load_config(*parse_run_args(argv)), _rank_world(), facts)
    assert RESOLUTIONS["count"] == before
    assert dry == facts.choice.name == alone.name == handed.name
    assert facts.choice.name != "single"   # 8B full fine-tune on 80 GB GPUs: the memory model decided
    assert f"--parallelism auto: {dry}" in capsys.readouterr().out


def test_handed_facts_survive_the_environment_and_yield_to_a_smaller_job_gpu(hub_model, gpus, tmp_path, monkeypatch):
    from swiftlite import env
    from swiftlite.job import RESOLUTIONS, Resolved, handed_facts
    from swiftlite.launch import preflight
    argv = _argv(hub_model, tmp_path, "--train-type", "full")
    facts = preflight(load_config(*parse_run_args(argv)), 8, data=False)
    monkeypatch.setenv(env.JOB_FACTS, facts.to_json())          # what forked and torchrun ranks get
    assert handed_facts() == facts == Resolved.from_json(facts.to_json())
    before = RESOLUTIONS["count"]
    assert rank_resolve(load_config(*parse_run_args(argv)), _rank_world()).name == facts.choice.name
    assert RESOLUTIONS["count"] == before
    gpus["total"] = 40 * GB   # another node's GPUs are smaller: the job's smallest decides, resolved again
    again = rank_resolve(load_config(*parse_run_args(argv)), _rank_world())
    assert RESOLUTIONS["count"] == before + 1
    from swiftlite.planner.recommend import resolve_auto
    cfg = load_config(*parse_run_args(argv))
    assert again.name == resolve_auto(cfg, 8, 40 * GB, shape=_shape(cfg), gpus_per_node=8).backend


def _shape(cfg):
    from swiftlite.job import model_shape
    return model_shape(cfg)


def test_rank_applies_the_launchers_max_length(hub_model, gpus, tmp_path):
    """A rank that parsed the command line again has no --max-length (a hub model's context is read
    from its config); the handed facts give it the one the launcher resolved (8192), without the rank
    reading the model's config again."""
    from swiftlite.launch import preflight
    argv = _argv(hub_model, tmp_path, "--train-type", "lora")
    at = argv.index("--max-length")
    argv = argv[:at] + argv[at + 2:]
    facts = preflight(load_config(*parse_run_args(argv)), 8, data=False)
    assert facts.max_length == 8192
    rank_cfg = load_config(*parse_run_args(argv))
    assert rank_cfg.data.max_length is None
    import swiftlite.models.loading as loading
    read = []
    original = loading.model_config
    loading.model_config = lambda *a, **k: read.append(a) or original(*a, **k)
    try:
        from swiftlite.train.run import resolve_run_here
        run_cfg = resolve_run_here(rank_cfg, _rank_world(), facts).config
    finally:
        loading.model_config = original
    assert run_cfg.data.max_length == 8192 and run_cfg.model.torch_dtype == "bf16" and not read
    assert rank_cfg.data.max_length is None   # the user's config stays what the command line said


def test_one_sft_process_runs_the_rules_once_and_resolves_the_backend_once(tmp_path, monkeypatch):
    """Issue 24's counter: a single-process `swiftlite sft` (preflight and the trainer in one process)
    runs the config rules once and resolves the job's facts (the backend among them) once."""
    from swiftlite.config import rules
    from swiftlite.demo import write_demo_data
    from swiftlite.job import RESOLUTIONS
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NPROC_PER_NODE", "NNODES", "SWIFTLITE_JOB_FACTS"):
        monkeypatch.delenv(k, raising=False)
    train, _ = write_demo_data(tmp_path / "data", n_train=16, n_val=4)
    runs, resolutions = rules.RUNS["count"], RESOLUTIONS["count"]
    assert main(["sft", "--model", "tiny-llama-2l", "--dataset", str(train), "--gradient-accumulation-steps", "1",
                 "--gradient-checkpointing", "false", "--max-steps", "1",
                 "--per-device-train-batch-size", "2", "--output-dir", str(tmp_path / "out")]) == 0
    assert (rules.RUNS["count"] - runs, RESOLUTIONS["count"] - resolutions) == (1, 1)
    assert (tmp_path / "out" / "logging.jsonl").is_file()


def test_hub_id_without_max_length_runs_the_rules_once(hub_model, tmp_path, monkeypatch):
    """The same counter with a hub model id and no --max-length (its context is read from the config in
    the hub cache, in preflight): the model's context is positive by construction, so the rules that
    config.load ran are not run again; only a --torch-dtype auto that preflight makes concrete is
    judged again (--bnb-4bit-compute-dtype)."""
    from swiftlite.config import rules
    from swiftlite.job import RESOLUTIONS
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NPROC_PER_NODE", "NNODES", "SWIFTLITE_JOB_FACTS"):
        monkeypatch.delenv(k, raising=False)
    argv = _argv(hub_model, tmp_path, "--train-type", "lora")
    at = argv.index("--max-length")
    argv = argv[:at] + argv[at + 2:]
    at = argv.index("--nproc-per-node")
    argv = argv[:at] + argv[at + 2:]
    runs, resolutions = rules.RUNS["count"], RESOLUTIONS["count"]
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["sft", *argv, "--dry-run"]) == 0
    assert (rules.RUNS["count"] - runs, RESOLUTIONS["count"] - resolutions) == (1, 1), out.getvalue()
