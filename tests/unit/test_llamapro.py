"""--train_type llamapro (models/llamapro.py, config/rules_tuners.py, the planner's counts): LLaMA-Pro's
block expansion on tiny in-memory models. Each test fails if its part is ignored."""

from __future__ import annotations

import pytest
import torch

from swiftlite.cli import parse_run_args
from swiftlite.config import load_config
from swiftlite.errors import UserError


def cfg_of(*argv: str, task: str = "sft", model: str = "tiny-llama-2l"):
    config_file, values = parse_run_args(["--dataset", "train.jsonl", "--model", model, *argv])
    return load_config(config_file, values, task=task, validate_paths=False)


def tiny(kind: str = "qwen2", layers: int = 4, seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2)
    if kind == "qwen2":   # q/k/v biases; alternating sliding layers, so layer_types must follow the copies
        conf = Qwen2Config(**common, use_sliding_window=True, sliding_window=3,
                           layer_types=["full_attention", "sliding_attention"] * (layers // 2))
        return Qwen2ForCausalLM(conf).float().eval()
    return LlamaForCausalLM(LlamaConfig(**common, attention_bias=True, mlp_bias=True)).float().eval()


def expanded(kind: str, *argv: str, layers: int = 4):
    from swiftlite.models.llamapro import expand
    base = tiny(kind, layers)
    ids = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = base(ids).logits
    old = list(base.model.layers)
    model = expand(base, cfg_of("--train_type", "llamapro", *argv))
    return model, old, ids, before


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_expanded_model_computes_the_base_model(kind):
    model, old, ids, before = expanded(kind, "--llamapro_num_new_blocks", "2")
    with torch.no_grad():
        after = model(ids).logits
    assert torch.equal(after, before)
    # and generation with the cache (each layer its own cache slot) gives the base's tokens
    base = tiny(kind)
    want = base.generate(ids[:1], max_new_tokens=5, do_sample=False)
    assert torch.equal(model.generate(ids[:1], max_new_tokens=5, do_sample=False), want)


def test_positions_indices_config_and_trainable():
    model, old, _, _ = expanded("qwen2", "--llamapro_num_new_blocks", "2")
    layers = list(model.model.layers)
    assert len(layers) == 6 and model.config.num_hidden_layers == 6
    # a copy after every 2nd layer: [0, 1, copy(1), 2, 3, copy(3)]
    assert layers[0] is old[0] and layers[1] is old[1] and layers[3] is old[2] and layers[4] is old[3]
    for pos, src in ((2, old[1]), (5, old[3])):
        new = layers[pos]
        assert new is not src
        assert torch.equal(new.self_attn.q_proj.weight, src.self_attn.q_proj.weight)
        assert torch.equal(new.mlp.up_proj.weight, src.mlp.up_proj.weight)
        assert not new.self_attn.o_proj.weight.any() and not new.mlp.down_proj.weight.any()
        assert src.self_attn.o_proj.weight.any()
    assert [m.self_attn.layer_idx for m in layers] == list(range(6))
    assert model.config.layer_types == ["full_attention", "sliding_attention", "sliding_attention",
                                        "full_attention", "sliding_attention", "sliding_attention"]
    # what export and the planner read without building the model (models/llamapro.expanded_config)
    from swiftlite.models.llamapro import expanded_config
    conf = expanded_config(tiny("qwen2").config, cfg_of("--train_type", "llamapro", "--llamapro_num_new_blocks", "2"))
    assert (conf.num_hidden_layers, conf.layer_types) == (6, model.config.layer_types)
    trainable = {n.split(".")[2] for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {"2", "5"}
    assert all(p.requires_grad for p in layers[2].parameters())


def test_groups_and_biases_zeroed():
    from swiftlite.models.llamapro import new_positions
    model, old, _, _ = expanded("llama", "--llamapro_num_new_blocks", "4", "--llamapro_num_groups", "2")
    assert len(model.model.layers) == 6   # ms-swift inserts one block per group
    assert new_positions(4, 2) == [2, 5] and new_positions(4, 4) == [1, 3, 5, 7] and new_positions(28, 4)[-1] == 31
    new = model.model.layers[2]
    assert not new.self_attn.o_proj.bias.any() and not new.mlp.down_proj.bias.any()


def test_gradients_reach_only_the_new_blocks_through_checkpointing():
    """Reentrant checkpointing with frozen embeddings passes no gradient into the layers unless the input
    requires one (prepare_model calls enable_input_require_grads for llamapro)."""
    from swiftlite.models.llamapro import expand
    model = expand(tiny("qwen2"), cfg_of("--train_type", "llamapro", "--llamapro_num_new_blocks", "2")).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.enable_input_require_grads()
    ids = torch.randint(0, 64, (2, 7))
    model(ids, labels=ids).loss.backward()
    got = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert got and all(n.startswith(("model.layers.2.", "model.layers.5.")) for n in got)
    # the zeroed down_proj gets a gradient, so the block leaves the identity at the first step
    assert "model.layers.2.mlp.down_proj.weight" in got


@pytest.mark.parametrize("argv,expect", [
    (["--llamapro_num_new_blocks", "3"], "--llamapro_num_new_blocks 3: the model's 4 layers are not divisible"),
    (["--llamapro_num_groups", "3"], "--llamapro_num_groups 3: the model's 4 layers are not divisible"),
])
def test_divisibility_refused(argv, expect):
    from swiftlite.models.llamapro import expand, expanded_config
    with pytest.raises(UserError, match=expect):
        expand(tiny("qwen2"), cfg_of("--train_type", "llamapro", *argv))
    with pytest.raises(UserError, match=expect):
        expanded_config(tiny("qwen2").config, cfg_of("--train_type", "llamapro", *argv))


@pytest.mark.parametrize("argv,expect", [
    (["--llamapro_num_new_blocks", "0"], "--llamapro_num_new_blocks must be >= 1"),
    (["--llamapro_num_groups", "0"], "--llamapro_num_groups must be >= 1"),
    (["--lora_rank", "16"], "--lora_rank does not apply to --train_type llamapro"),
    (["--target_modules", "q_proj"], "--target_modules does not apply to --train_type llamapro"),
    (["--quant_bits", "4"], "--quant_bits 4 with --train_type llamapro"),
])
def test_option_refusals(argv, expect):
    with pytest.raises(UserError, match=expect):
        cfg_of("--train_type", "llamapro", *argv)


def test_muon_refused_names_the_new_blocks_norms():
    from swiftlite.optim import optim_problem
    why = optim_problem(cfg_of("--train_type", "llamapro", "--optim", "muon"))
    assert why and "the new blocks' norms" in why


def test_options_of_another_train_type_refused():
    with pytest.raises(UserError, match="--llamapro_num_new_blocks is an option of --train_type llamapro"):
        cfg_of("--train_type", "lora", "--llamapro_num_new_blocks", "4")


def test_defaults_and_learning_rate():
    cfg = cfg_of("--tuner_type", "llamapro")
    assert (cfg.lora.llamapro_num_new_blocks, cfg.lora.llamapro_num_groups) == (4, None)
    assert cfg.learning_rate == 1e-4 and not cfg.is_peft   # ms-swift: 1e-5 only for full
    assert cfg_of("--train_type", "full").learning_rate == 1e-5


def test_backends():
    from swiftlite.models.llamapro import backend_problem
    from swiftlite.parallel.base import BackendChoice
    cfg = cfg_of("--train_type", "llamapro")
    assert backend_problem(cfg, BackendChoice("ddp", "ddp")) is None
    for name in ("single", "fsdp", "hsdp"):
        assert backend_problem(cfg, BackendChoice(name, name)) is None
    for name in ("fsdp1", "zero2", "zero3"):
        why = backend_problem(cfg, BackendChoice(name, name))
        assert why and why.startswith(f"--train_type llamapro with --parallelism {name}:")


def test_preflight_reads_the_model_config():
    from swiftlite.models.llamapro import check_model
    from swiftlite.models.source import resolve_model
    cfg = cfg_of("--train_type", "llamapro", "--llamapro_num_new_blocks", "4", model="tiny-llama-2l")
    with pytest.raises(UserError, match="the model's 2 layers are not divisible"):
        check_model(cfg, resolve_model("tiny-llama-2l"))
    check_model(cfg_of("--train_type", "llamapro", "--llamapro_num_new_blocks", "2"), resolve_model("tiny-llama-2l"))


def test_planner_counts_the_expanded_model():
    from swiftlite.planner import Workload, model_state_bytes, shape_from_model_arg, trainable_params
    base = shape_from_model_arg("llama-8b")
    w = Workload(train_type="llamapro", dtype="fp32", world_size=1)
    shape = w.trained_shape(base)
    assert shape.layers == base.layers + 4
    assert shape.n_params == base.n_params + 4 * base.n_layer_params
    assert trainable_params(shape, w) == 4 * base.n_layer_params
    states = model_state_bytes(shape, w, "single")
    assert states["params"] == 4 * shape.n_params   # fp32: frozen + trainable, each once
    assert states["grads"] == 4 * 4 * base.n_layer_params and states["optimizer"] == 8 * 4 * base.n_layer_params
    from swiftlite.planner.memory import unavailable_reason
    assert unavailable_reason(w, "fsdp1") and unavailable_reason(w, "zero3")
    assert not unavailable_reason(w, "ddp") and not unavailable_reason(w, "fsdp")
    assert not w.sharded_loading   # the FSDP2 backends load the whole model on each rank before the copies


def test_mixture_of_experts_copy_is_an_identity():
    """Qwen3-MoE holds its experts' down_proj as one fused parameter: zeroed too, so the copy adds nothing."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from swiftlite.models.llamapro import expand
    torch.manual_seed(0)
    conf = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_experts=4,
                          num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=8)
    model = Qwen3MoeForCausalLM(conf).float().eval()
    ids = torch.randint(0, 64, (1, 9))
    with torch.no_grad():
        before = model(ids).logits
    expand(model, cfg_of("--train_type", "llamapro", "--llamapro_num_new_blocks", "2"))
    assert not model.model.layers[1].mlp.experts.down_proj.any()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
