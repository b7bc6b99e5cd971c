"""LISA (--lisa_activated_layers, train/lisa.py): the draw schedule, draws that depend on --seed and the
window alone, an engine on the single backend that changes exactly the drawn layers and the parameters
outside the layers (frozen layers bit for bit unchanged: no update, no weight decay, no stale momentum),
the options' rules and the backends that refuse it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from swiftlite.cli import parse_run_args
from swiftlite.config import load_config
from swiftlite.distributed import World
from swiftlite.errors import UserError
from swiftlite.parallel.base import BackendChoice, build_engine
from swiftlite.train.lisa import lisa_problem, sample, window_start, with_lisa


def cfg_of(*argv: str, task: str = "sft"):
    config_file, values = parse_run_args(["--dataset", "train.jsonl", "--model", "tiny-llama-2l", *argv])
    return load_config(config_file, values, task=task, validate_paths=False)


def test_draws_at_step_zero_one_and_every_interval():
    """ms-swift's rule: a draw when global_step % K == 0 or global_step == 1 (steps done at the start)."""
    draws = [g for g in range(62) if window_start(g, 20) == g]
    assert draws == [0, 1, 20, 40, 60]
    assert [window_start(g, 20) for g in (0, 1, 2, 19, 20, 21, 39, 40)] == [0, 1, 1, 1, 20, 20, 20, 40]
    assert [window_start(g, 1) for g in range(5)] == [0, 1, 2, 3, 4]
    assert [window_start(g, 2) for g in range(6)] == [0, 1, 2, 2, 4, 4]


def test_a_draw_depends_on_the_seed_and_the_window_only():
    first = sample(42, 20, 28, 2)
    np.random.seed(0)
    np.random.rand(100)   # numpy's global state: not used
    assert sample(42, 20, 28, 2) == first and len(set(first)) == 2 and all(0 <= i < 28 for i in first)
    windows = [tuple(sample(42, s, 28, 2)) for s in (0, 1, 20, 40, 60)]
    assert len(set(windows)) > 1
    assert sample(43, 20, 28, 2) != first or sample(43, 40, 28, 2) != sample(42, 40, 28, 2)
    assert sample(7, 0, 4, 4) == [0, 1, 2, 3]


def _model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    conf = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(conf)


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[2]) if parts[:2] == ["model", "layers"] else None


@pytest.mark.parametrize("optim", [[], ["--optim", "adamw_torch"], ["--optim", "sgd"],
                                   ["--use_galore", "true", "--galore_rank", "8", "--galore_update_proj_gap", "2"]],
                         ids=["adamw_torch_fused", "adamw_torch", "sgd", "galore"])
def test_single_engine_changes_exactly_the_drawn_layers(optim):
    """Steps 1..5 with N=1, K=2 (draws before steps 1, 2, 3 and 5): after each step the parameters that
    changed are the drawn layer's and every non-layer one; a layer of an earlier window keeps its weights
    bit for bit (AdamW with weight decay 0.1 and its moments would move it if its gradient were zeros)."""
    if optim and optim[0] == "--use_galore":
        pytest.importorskip("galore_torch")
    seed = 3
    cfg = cfg_of("--train_type", "full", "--lisa_activated_layers", "1", "--lisa_step_interval", "2",
                 "--seed", str(seed), "--learning_rate", "1e-2", "--weight_decay", "0.1", "--torch_dtype", "fp32",
                 *optim)
    expected = [sample(seed, window_start(g, 2), 4, 1) for g in range(5)]
    assert expected[0] != expected[1] != expected[2] and expected[2] == expected[3] != expected[4]
    model = _model()
    engine = build_engine(model, cfg, World(), 5, BackendChoice(name="single", requested="single"))
    engine = with_lisa(engine, model, cfg, 0, 5, log=lambda *_: None)
    gen = torch.Generator().manual_seed(1)
    for step in range(5):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        ids = torch.randint(0, 64, (2, 12), generator=gen)
        engine.backward(model(input_ids=ids, labels=ids).loss)
        grads = {n for n, p in model.named_parameters() if p.grad is not None}
        engine.step()
        changed = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}
        layers = {_layer_of(n) for n in changed} - {None}
        assert layers == set(expected[step]), (step, layers, expected[step])
        frozen = {n for n in before if _layer_of(n) not in (None, *expected[step])}
        assert not grads & frozen   # None, not zeros, at the update
        assert not changed & frozen
        outside = {n for n in before if _layer_of(n) is None and not n.endswith("norm.weight")}
        assert outside <= changed   # embeddings and lm_head train throughout
    assert engine.layers.active == sample(seed, 4, 4, 1)


def test_more_layers_than_the_model_has_is_refused():
    cfg = cfg_of("--train_type", "full", "--lisa_activated_layers", "5")
    with pytest.raises(UserError, match="--lisa_activated_layers 5: the model has 4 decoder layers"):
        with_lisa(object(), _model(), cfg, 0, 1)


@pytest.mark.parametrize("argv,expect", [
    (["--lisa_activated_layers", "2"], "--lisa_activated_layers 2 with --train_type lora: LISA samples"),
    (["--train_type", "adalora", "--lisa_activated_layers", "2"], "with --train_type adalora: LISA samples"),
    (["--train_type", "full", "--lisa_activated_layers", "-1"], "--lisa_activated_layers -1: must be >= 0"),
    (["--train_type", "full", "--lisa_activated_layers", "2", "--lisa_step_interval", "0"],
     "--lisa_step_interval 0: must be >= 1"),
    (["--train_type", "full", "--lisa_step_interval", "5"], "--lisa_step_interval 5 without --lisa_activated_layers"),
])
def test_rules(argv, expect):
    with pytest.raises(UserError) as e:
        cfg_of(*argv)
    assert expect in str(e.value) and "\n" not in str(e.value)


def test_rlhf_is_refused():
    with pytest.raises(UserError, match="--lisa_activated_layers 2 with swiftlite rlhf"):
        cfg_of("--train_type", "full", "--lisa_activated_layers", "2", task="rlhf")


def test_backends():
    """single runs it (also what auto picks for one CPU process); every backend that wraps or partitions
    the parameters is refused before launch with one line."""
    from swiftlite.planner.recommend import choose_backend
    cfg = cfg_of("--train_type", "full", "--lisa_activated_layers", "2")
    assert cfg.lora.lisa_activated_layers == 2 and cfg.lora.lisa_step_interval == 20
    assert lisa_problem(cfg, BackendChoice("single", "single")) is None
    auto = choose_backend(cfg, 1)
    assert auto.name == "single" and lisa_problem(cfg, auto) is None
    for name in ("ddp", "fsdp", "fsdp1", "hsdp", "zero2", "zero3", "zero3_offload"):
        why = lisa_problem(cfg, BackendChoice(name, name))
        assert why.startswith(f"--lisa_activated_layers with --parallelism {name}: ") and "\n" not in why
    assert lisa_problem(cfg_of("--train_type", "full"), BackendChoice("zero3", "zero3")) is None
    assert lisa_problem(cfg, choose_backend(cfg, 2)) is not None   # auto on 2 CPU processes: fsdp
