"""--optim (optim.build_optimizer, optim.optim_problem): each name builds the optimizer it names, with
HF Trainer's arguments; the ones that need whole matrices are refused on sharding backends and say
why; extra-package optimizers are refused with the alternatives. Fails if --optim is ignored."""

from __future__ import annotations

import warnings

import pytest
import torch

from swiftlite.cli import parse_run_args
from swiftlite.config import load_config
from swiftlite.errors import UserError


def cfg_of(*argv: str):
    config_file, values = parse_run_args(["--dataset", "train.jsonl", "--model", "tiny-llama-2l", *argv])
    return load_config(config_file, values, validate_paths=False)


def lora_model(cfg):
    from transformers import LlamaConfig, LlamaForCausalLM

    from swiftlite.models.lora import apply_lora
    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return apply_lora(m, cfg) if cfg.is_peft else m


def _expected():
    from transformers.optimization import Adafactor
    return {"adamw_torch_fused": torch.optim.AdamW, "adamw_torch": torch.optim.AdamW, "sgd": torch.optim.SGD,
            "adagrad": torch.optim.Adagrad, "rmsprop": torch.optim.RMSprop, "adafactor": Adafactor,
            "muon": torch.optim.Muon}


@pytest.mark.parametrize("name", ["adamw_torch_fused", "adamw_torch", "sgd", "adagrad", "rmsprop", "adafactor",
                                  "muon"])
def test_optim_builds_the_named_optimizer(name):
    from swiftlite.optim import build_optimizer
    cfg = cfg_of("--optim", name, "--learning_rate", "3e-4")
    opt = build_optimizer(lora_model(cfg), cfg)
    assert type(opt) is _expected()[name]
    assert opt.param_groups[0]["lr"] == pytest.approx(3e-4)
    if name.startswith("adamw"):
        assert bool(opt.defaults["fused"]) == (name == "adamw_torch_fused")
        assert opt.defaults["betas"] == (cfg.optim.adam_beta1, cfg.optim.adam_beta2)
    if name == "adafactor":   # HF Trainer's: the schedule drives the lr
        assert opt.defaults["relative_step"] is False and opt.defaults["scale_parameter"] is False


def test_default_is_hf_and_msswift_default():
    assert cfg_of().optim.optim == "adamw_torch_fused"


def test_sgd_step_is_plain_sgd():
    from swiftlite.optim import build_optimizer
    cfg = cfg_of("--optim", "sgd", "--learning_rate", "0.5", "--weight_decay", "0")
    model = lora_model(cfg)
    p = next(p for n, p in model.named_parameters() if "lora_A" in n)
    before = p.detach().clone()
    p.grad = torch.ones_like(p)
    opt = build_optimizer(model, cfg)
    opt.step()
    assert torch.allclose(p.detach(), before - 0.5)


@pytest.mark.parametrize("argv,msg", [
    (["--optim", "adafactor", "--parallelism", "fsdp", "--nproc_per_node", "2"],
     "--optim adafactor: it factors each matrix's second moment"),
    (["--optim", "muon", "--parallelism", "zero2", "--nproc_per_node", "2"], "--optim muon: it orthogonalises"),
    (["--optim", "muon", "--train_type", "full"], "--optim muon: torch.optim.Muon updates 2-D matrices only"),
    (["--optim", "muon", "--use_dora", "true"], "--optim muon: torch.optim.Muon updates 2-D matrices only"),
])
def test_whole_matrix_optimizers_refused_where_they_cannot_work(argv, msg):
    from swiftlite.optim import optim_problem
    from swiftlite.planner import choose_backend as resolve_backend
    cfg = cfg_of(*argv)
    assert optim_problem(cfg, resolve_backend(cfg, cfg.parallel.nproc_per_node or 1)).startswith(msg)


@pytest.mark.parametrize("argv", [["--optim", "sgd", "--parallelism", "zero3", "--nproc_per_node", "2"],
                                  ["--optim", "rmsprop", "--parallelism", "fsdp", "--nproc_per_node", "2"],
                                  ["--optim", "adafactor", "--parallelism", "ddp", "--nproc_per_node", "2"]])
def test_elementwise_optimizers_run_on_sharding_backends(argv):
    from swiftlite.optim import optim_problem
    from swiftlite.planner import choose_backend as resolve_backend
    cfg = cfg_of(*argv)
    assert optim_problem(cfg, resolve_backend(cfg, 2)) is None


def test_extra_package_optimizers_refused():
    with pytest.raises(UserError, match="--optim adamw_8bit: not available: --optim takes"):
        cfg_of("--optim", "adamw_8bit")


def test_msswift_optimizer_plugin_muon_is_torch_muon_at_adamw_scale():
    from swiftlite.optim import build_optimizer
    cfg = cfg_of("--optimizer", "muon", "--optim", "sgd")          # ms-swift: the plugin wins over --optim
    opt = build_optimizer(lora_model(cfg), cfg)
    assert type(opt) is torch.optim.Muon and opt.defaults["adjust_lr_fn"] == "match_rms_adamw"
    with pytest.raises(UserError, match="--use_galore with --train_type lora: GaLore projects"):
        cfg_of("--optimizer", "galore")                             # the galore plugin is GaLore (full training)
    with pytest.raises(UserError, match="--optimizer lorap: give --lorap_lr_ratio"):
        cfg_of("--optimizer", "lorap")


@pytest.mark.parametrize("argv,flag", [(("--optim", "adafactor"), "--optim adafactor"),
                                       (("--optimizer", "muonclip"), "--optimizer muonclip"),
                                       (("--train_type", "full", "--use_galore", "true"), "--use_galore")])
def test_auto_takes_ddp_for_an_optimizer_that_needs_whole_matrices(argv, flag):
    """`auto` never picks a backend the optimizer cannot run (it picked FSDP, then refused it as if the
    user had asked for it): DDP on CPU, and the sharding backends unavailable in the GPU planner."""
    from swiftlite.planner.memory import unavailable_reason
    from swiftlite.planner.recommend import resolve_auto, workload_from_config
    cfg = cfg_of(*argv, "--max_length", "512")
    d = resolve_auto(cfg, 2, None)
    assert d.backend == "ddp" and flag in d.reason
    assert resolve_auto(cfg_of(), 2, None).backend == "fsdp"             # the rule is the optimizer's
    w = workload_from_config(cfg, 2, 80 * 2**30)
    assert w.whole_matrices == flag
    assert unavailable_reason(w, "fsdp").startswith(f"{flag} needs each weight matrix whole")
    assert unavailable_reason(w, "zero3") and unavailable_reason(w, "zero2") and not unavailable_reason(w, "ddp")
    gpu = resolve_auto(cfg, 2, 80 * 2**30)
    assert gpu.backend in ("ddp", "single"), gpu
