"""--train_type adapter (models/adapter.py, config/rules_tuners.py, the planner's counts, export's refusal):
ms-swift's Houlsby adapter on tiny in-memory models. Each test fails if its part is ignored."""

from __future__ import annotations

import pytest
import torch

from swiftlite.errors import UserError
from tests.unit.test_llamapro import cfg_of, tiny


def adapted(kind: str = "qwen2", *argv: str) -> torch.nn.Module:
    from swiftlite.models.adapter import attach
    return attach(tiny(kind), cfg_of("--train_type", "adapter", *argv))


@pytest.mark.parametrize("kind,act", [("qwen2", "gelu"), ("llama", "relu")])
def test_forward_is_the_mlp_plus_the_adapter(kind, act):
    """Each MLP's output x becomes x + linear2(act(linear1(x))), computed here by hand from the base MLP's
    own output (the hook must not change what the MLP computes, only add to it)."""
    from transformers.activations import ACT2CLS

    from swiftlite.models.adapter import ATTR
    base = tiny(kind)
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        plain = [layer.mlp(x) for layer in base.model.layers]
    model = adapted(kind, "--adapter_length", "8", "--adapter_act", act)
    fn = ACT2CLS[act]()
    with torch.no_grad():
        for layer, y in zip(model.model.layers, plain):
            a = getattr(layer.mlp, ATTR)
            assert a.linear1.weight.shape == (8, 32) and a.linear2.weight.shape == (32, 8)
            want = y + (fn(y @ a.linear1.weight.T + a.linear1.bias) @ a.linear2.weight.T + a.linear2.bias)
            torch.testing.assert_close(layer.mlp(x), want, rtol=1e-6, atol=1e-6)
            assert (layer.mlp(x) - y).abs().max() > 1e-3   # not an identity: xavier weights (ms-swift's)


def test_whole_model_uses_the_adapters():
    ids = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = tiny("qwen2")(ids).logits
        after = adapted("qwen2")(ids).logits
    assert (after - before).abs().max() > 1e-3


def test_computed_in_the_adapters_dtype_returned_in_the_inputs():
    from swiftlite.models.adapter import adapter_class
    torch.manual_seed(0)
    a = adapter_class()(16, 4, "gelu")   # fp32
    x = torch.randn(3, 16).to(torch.bfloat16)
    out = a(x)
    assert out.dtype == torch.bfloat16
    h = x.float()
    want = (h + a.linear2(torch.nn.functional.gelu(a.linear1(h)))).to(torch.bfloat16)
    assert torch.equal(out, want)


def test_only_adapters_train_with_the_counted_parameters():
    from swiftlite.models.adapter import ATTR, adapter_params
    model = adapted("qwen2", "--adapter_length", "8")
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(f".mlp.{ATTR}.linear" in n for n in trainable)
    assert len(trainable) == 4 * 4   # 4 layers x (linear1, linear2) x (weight, bias)
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert n == adapter_params(4, 32, 8) == 4 * (2 * 32 * 8 + 8 + 32)
    # ms-swift's names: model.layers.<i>.mlp.adapter_default.linear1.weight
    assert "model.layers.0.mlp.adapter_default.linear1.weight" in trainable


def test_initialisation_is_ms_swifts_and_follows_the_seed():
    from swiftlite.models.adapter import ATTR
    a = getattr(adapted("qwen2").model.layers[0].mlp, ATTR)
    for lin in (a.linear1, a.linear2):
        bound = (6 / sum(lin.weight.shape)) ** 0.5   # xavier_uniform_
        assert lin.weight.abs().max() <= bound and lin.weight.abs().max() > bound / 2
        assert 0 < lin.bias.abs().max() < 1e-4   # normal(std=1e-6)
    same = getattr(adapted("qwen2").model.layers[0].mlp, ATTR)
    other = getattr(adapted("qwen2", "--seed", "5").model.layers[0].mlp, ATTR)
    assert torch.equal(a.linear1.weight, same.linear1.weight)   # every rank and a rebuilt checkpoint agree
    assert not torch.equal(a.linear1.weight, other.linear1.weight)


def test_gradients_reach_every_adapter():
    model = adapted("llama").train()
    ids = torch.randint(0, 64, (2, 9))
    model(ids, labels=ids).loss.backward()
    for name, p in model.named_parameters():
        assert (p.grad is not None and p.grad.abs().sum() > 0) == p.requires_grad, name


def test_tuple_output_gets_the_adapter_on_its_first_element():
    """ms-swift's hidden_pos=0: an MLP that returns (hidden, router logits) keeps the second element."""
    from swiftlite.models.adapter import ATTR, attach

    class TupleMLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(32, 32)

        def forward(self, x):
            return self.proj(x), torch.ones(1)

    model = tiny("qwen2")
    for layer in model.model.layers:
        layer.mlp = TupleMLP()
    x = torch.randn(1, 3, 32)
    plain = model.model.layers[0].mlp(x)
    attach(model, cfg_of("--train_type", "adapter"))
    out = model.model.layers[0].mlp(x)
    a = getattr(model.model.layers[0].mlp, ATTR)
    torch.testing.assert_close(out[0], a(plain[0]))
    assert torch.equal(out[1], plain[1])


def test_a_layer_without_mlp_refused():
    from swiftlite.models.adapter import architecture_problem, attach
    model = tiny("qwen2")
    del model.model.layers[1].mlp
    why = architecture_problem(model)
    assert why and why.startswith("--train_type adapter: decoder layer 1 (Qwen2DecoderLayer) has no `mlp` module")
    with pytest.raises(UserError, match="has no `mlp` module"):
        attach(model, cfg_of("--train_type", "adapter"))


def test_preflight_reads_the_model():
    from swiftlite.models.adapter import check_model
    from swiftlite.models.source import resolve_model
    check_model(cfg_of("--train_type", "adapter"), resolve_model("tiny-llama-2l"))   # has an mlp per layer


def test_defaults_are_ms_swifts():
    cfg = cfg_of("--tuner_type", "adapter")
    assert (cfg.lora.adapter_length, cfg.lora.adapter_act) == (128, "gelu")
    assert cfg.learning_rate == 1e-4 and not cfg.is_peft
    cfg = cfg_of("--tuner_type", "adapter", "--adapter_length", "16", "--adapter_act", "silu")
    assert (cfg.lora.adapter_length, cfg.lora.adapter_act) == (16, "silu")


@pytest.mark.parametrize("argv,message", [
    (["--adapter_act", "swishy"], "--adapter_act swishy: not an activation of transformers' ACT2CLS"),
    (["--adapter_length", "0"], "--adapter_length must be >= 1, got 0"),
    (["--lora_rank", "16"], "--lora_rank does not apply to --train_type adapter"),
    (["--target_modules", "q_proj"], "--target_modules does not apply to --train_type adapter"),
    (["--quant_bits", "4"], "--quant_bits 4 with --train_type adapter"),
    (["--new_special_tokens", "<x>"], "--new_special_tokens with --train_type adapter"),
    (["--use_galore", "true"], "--use_galore with --train_type adapter"),
])
def test_refusals(argv, message):
    with pytest.raises(UserError) as e:
        cfg_of("--train_type", "adapter", *argv)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_options_without_train_type_adapter_refused():
    with pytest.raises(UserError, match="--adapter_length is an option of --train_type adapter; this run trains lora"):
        cfg_of("--adapter_length", "64")
    with pytest.raises(UserError, match="--adapter_act is an option of --train_type adapter; this run trains full"):
        cfg_of("--train_type", "full", "--adapter_act", "relu")


def test_rlhf_refused():
    with pytest.raises(UserError, match="--train_type adapter with swiftlite rlhf"):
        cfg_of("--train_type", "adapter", "--rlhf_type", "dpo", task="rlhf")


def test_muon_refused_names_the_biases():
    from swiftlite.optim import optim_problem
    why = optim_problem(cfg_of("--train_type", "adapter", "--optim", "muon"))
    assert why and "the Houlsby adapters' biases" in why


def test_backends():
    from swiftlite.models.adapter import backend_problem
    from swiftlite.parallel.base import BackendChoice
    cfg = cfg_of("--train_type", "adapter")
    for name in ("single", "ddp", "fsdp", "hsdp", "zero2", "zero3", "zero3_offload"):
        assert backend_problem(cfg, BackendChoice(name, name)) is None, name
    why = backend_problem(cfg, BackendChoice("fsdp1", "fsdp1"))
    assert why and why.startswith("--train_type adapter with --parallelism fsdp1:")
    assert backend_problem(cfg_of("--train_type", "lora"), BackendChoice("fsdp1", "fsdp1")) is None
    # a DeepSpeed --save_only_model checkpoint would hold no adapter weights (its weights are the HF copy)
    only = cfg_of("--train_type", "adapter", "--save_only_model", "true")
    why = backend_problem(only, BackendChoice("zero2", "zero2"))
    assert why and why.startswith("--save_only_model with --train_type adapter under --parallelism zero2:")
    assert backend_problem(only, BackendChoice("fsdp", "fsdp")) is None   # dcp/ holds them there


def test_planner_counts_the_adapters():
    """The planner's count is the built model's: per layer 2 x hidden x length + length + hidden."""
    from swiftlite.models.adapter import attach
    from swiftlite.models.loading import load_model
    from swiftlite.planner import Workload, model_state_bytes, shape_from_model_arg, trainable_params
    from swiftlite.planner.memory import unavailable_reason
    from swiftlite.planner.recommend import workload_from_config
    cfg = cfg_of("--train_type", "adapter", "--adapter_length", "8", "--torch_dtype", "fp32", "--max_length", "64")
    model = attach(load_model(cfg), cfg)
    built = sum(p.numel() for p in model.parameters() if p.requires_grad)
    shape = shape_from_model_arg("tiny-llama-2l")
    w = workload_from_config(cfg, 1, None)
    assert w.adapter_length == 8 and trainable_params(shape, w) == built
    big = shape_from_model_arg("llama-8b")
    w = Workload(train_type="adapter", dtype="fp32", world_size=1)   # ms-swift's 128
    assert w.trained_shape(big) is big
    n = big.layers * (2 * big.hidden * 128 + 128 + big.hidden)
    assert trainable_params(big, w) == n
    states = model_state_bytes(big, w, "single")
    assert states["params"] == 4 * (big.n_params + n)   # fp32: the frozen base and the adapters
    assert states["grads"] == 4 * n and states["optimizer"] == 8 * n
    assert unavailable_reason(w, "fsdp1")
    assert not any(unavailable_reason(w, b) for b in ("single", "ddp", "fsdp", "hsdp", "zero2", "zero3"))
    assert w.sharded_loading   # the adapters are created real next to the skeleton's meta base


def test_checkpoint_records_the_width_and_writes_no_hf_folder(tmp_path):
    """A resume with another --adapter_length is another run (run facts, and the model-only resume's shape
    check); the checkpoint's HF copy is skipped, never a model/ folder transformers would load without
    the adapters."""
    from swiftlite.checkpoint.state import WEIGHT_SHAPE, export_weights, run_facts

    class Data:
        rows = [{"input_ids": [1, 2], "labels": [1, 2]}]

    cfg = cfg_of("--train_type", "adapter", "--adapter_length", "8")
    assert run_facts(cfg, Data, 8)["shape"]["adapter_length"] == 8 and "adapter_length" in WEIGHT_SHAPE
    assert "adapter_length" not in run_facts(cfg_of("--train_type", "adapter"), Data, 8)["shape"]   # default

    class Engine:
        def full_state_dict(self):
            raise AssertionError("the HF copy of an adapter run must not be written")

    class World:
        is_main = True

    export_weights(Engine(), None, None, cfg, World(), tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_export_refusal_is_one_line():
    from swiftlite.models.adapter import refuse_export
    with pytest.raises(UserError) as e:
        refuse_export("--ckpt", "out/checkpoint-4")
    msg = str(e.value)
    assert msg.startswith("--ckpt out/checkpoint-4: a --train_type adapter checkpoint cannot be exported")
    assert "ms-swift cannot merge it either" in msg and "\n" not in msg


def test_weights_only_checkpoint_across_formats_names_no_folder(tmp_path):
    """A --save_only_model adapter checkpoint read by another format is refused without pointing at a model/
    folder it does not have."""
    from swiftlite.checkpoint.state import weights_only_problem
    from swiftlite.parallel.base import BackendChoice
    state = {"save_only_model": True, "format": "dcp", "backend": "single", "train_type": "adapter"}
    why = weights_only_problem(tmp_path, cfg_of("--train_type", "adapter"), BackendChoice("zero2", "zero2"), state)
    assert why and "its Houlsby adapters have no HF folder" in why and "model/" not in why
    full = weights_only_problem(tmp_path, cfg_of("--train_type", "full"), BackendChoice("zero2", "zero2"),
                                {**state, "train_type": "full"})
    assert full and full.endswith("start a new run from its model/ folder")


def test_planner_counts_what_the_adapter_saves_for_backward():
    """The planner's activation term for the adapter is what autograd saves in its forward, counted with
    saved-tensor hooks on the adapter of a real layer (its input, the MLP's output, requires grad)."""
    from swiftlite.models.adapter import ATTR
    from swiftlite.planner import Workload, shape_from_model_arg
    from swiftlite.planner.activations import activation_bytes
    model = adapted("llama", "--adapter_length", "8")
    adapter = getattr(model.model.layers[0].mlp, ATTR)
    x = torch.randn(2, 5, 32, requires_grad=True)
    saved: dict[int, int] = {}
    weights = {p.untyped_storage().data_ptr() for p in adapter.parameters()}

    def pack(t):   # activations only: the weights autograd keeps are the model's states, counted elsewhere
        if t.untyped_storage().data_ptr() not in weights:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        adapter(x)
    per_token = sum(saved.values()) / (2 * 5)
    shape = shape_from_model_arg("tiny-llama-2l")
    args = dict(dtype="fp32", world_size=1, max_length=64, micro_batch=1, gradient_checkpointing=False,
                loss_impl="plain")
    extra = (activation_bytes(shape, Workload(train_type="adapter", adapter_length=8, **args))
             - activation_bytes(shape, Workload(train_type="full", **args)))
    assert per_token == (32 + 2 * 8) * 4   # the model's hidden (32) and the bottleneck's two (8 each), fp32
    assert extra == shape.layers * 64 * (shape.hidden + 2 * 8) * 4
