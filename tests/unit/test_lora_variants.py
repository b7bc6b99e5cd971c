"""LoRA variants peft provides: --use_dora, --use_rslora, --init_weights, --lorap_lr_ratio, --lora_bias
(models/lora.py, optim.param_groups, export/adapter.py, hf_io.write_adapter). Each test fails if its
flag is ignored. One 2-step CLI run (DoRA); everything else on a tiny in-memory model."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

from swiftlite.cli import parse_run_args
from swiftlite.config import load_config
from swiftlite.errors import UserError
from tests.conftest import run_cli


def cfg_of(*argv: str):
    config_file, values = parse_run_args(["--dataset", "train.jsonl", "--model", "tiny-llama-2l", *argv])
    return load_config(config_file, values, validate_paths=False)


def tiny_qwen2(seed: int = 0) -> torch.nn.Module:
    """A 1-layer Qwen2 (its q/k/v projections have biases: --lora_bias all has something to train)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    conf = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2)
    return Qwen2ForCausalLM(conf).float()


def lora_of(*argv: str, seed: int = 0):
    from swiftlite.models.lora import apply_lora
    cfg = cfg_of("--lora_rank", "4", "--lora_alpha", "8", *argv)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cfg, apply_lora(tiny_qwen2(seed), cfg)


def q_proj(model):
    return model.base_model.model.model.layers[0].self_attn.q_proj


# -- rsLoRA, init_weights, lora_bias: what peft was asked for ------------------------------------------

def test_rslora_scales_by_alpha_over_sqrt_r():
    _, plain = lora_of()
    _, rs = lora_of("--use_rslora", "true")
    assert q_proj(plain).scaling["default"] == pytest.approx(8 / 4)
    assert q_proj(rs).scaling["default"] == pytest.approx(8 / math.sqrt(4))


def test_init_weights_false_and_gaussian_start_non_zero():
    _, default = lora_of()
    assert torch.count_nonzero(q_proj(default).lora_B["default"].weight) == 0   # B = 0: adapter starts at 0
    _, rand = lora_of("--init_weights", "false")
    assert torch.count_nonzero(q_proj(rand).lora_B["default"].weight) > 0
    _, gauss = lora_of("--init_weights", "gaussian")
    a = q_proj(gauss).lora_A["default"].weight
    assert a.std().item() == pytest.approx(1 / 4, rel=0.3)                     # peft: normal(0, 1/r)


def test_lora_bias_all_trains_every_bias():
    _, none = lora_of()
    _, all_ = lora_of("--lora_bias", "all")
    trainable = lambda m: {n for n, p in m.named_parameters() if p.requires_grad and n.endswith(".bias")}
    assert trainable(none) == set()
    assert {n.rsplit(".", 2)[0].rsplit(".", 1)[-1] for n in trainable(all_)} >= {"q_proj", "k_proj", "v_proj"}


# -- PiSSA / OLoRA: the base changes; the saved adapter is a plain LoRA of the original base -----------

@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_pissa_olora_adapter_is_converted_for_the_original_base(init, tmp_path):
    from peft import PeftModel

    from swiftlite.hf_io import write_adapter
    original = tiny_qwen2(seed=0)
    cfg, model = lora_of("--init_weights", init, seed=0)
    w0 = original.model.layers[0].self_attn.q_proj.weight
    residual = q_proj(model).base_layer.weight
    assert (residual - w0).abs().max() > 1e-3          # peft moved the principal part out of the base
    with torch.no_grad():                               # "training": move every adapter tensor
        for n, p in model.named_parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    ids = torch.arange(1, 17).unsqueeze(0)
    trained = model.eval()(input_ids=ids).logits
    from peft import get_peft_model_state_dict
    write_adapter(model, get_peft_model_state_dict(model), tmp_path / "adapter")
    conf = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert conf["r"] == 8 and conf["lora_alpha"] == 16 and conf["init_lora_weights"] is True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reloaded = PeftModel.from_pretrained(tiny_qwen2(seed=0), str(tmp_path / "adapter"))
    assert torch.allclose(reloaded.eval()(input_ids=ids).logits, trained, atol=1e-5)
    # the export merge (W + s B A on the model folder's weights) gives the trained weight too
    from safetensors.torch import load_file

    from swiftlite.export.adapter import Adapter, merge_lora
    ad = Adapter(conf, load_file(str(tmp_path / "adapter" / "adapter_model.safetensors")), "t")
    mod = "model.layers.0.self_attn.q_proj"
    parts = ad.lora_modules()[mod]
    merged = merge_lora(w0, parts, ad.scale(mod, parts["A"].shape[0]), False)
    qp = q_proj(model)
    want = qp.base_layer.weight + qp.get_delta_weight("default")
    assert torch.allclose(merged, want, atol=1e-5)


def test_init_weights_refusals():
    with pytest.raises(UserError, match="--init_weights corda: not one of"):
        cfg_of("--init_weights", "corda")
    with pytest.raises(UserError, match="bitsandbytes-quantized base cannot hold"):
        cfg_of("--init_weights", "pissa", "--train_type", "qlora")
    with pytest.raises(UserError, match="--init_weights loftq fits A and B to the quantization error"):
        cfg_of("--init_weights", "loftq")
    assert cfg_of("--init_weights", "pissa_niter_4").lora.init_weights == "pissa_niter_4"
    config_file, values = parse_run_args(["--dataset", "t.jsonl", "--init_weights", "olora"])
    with pytest.raises(UserError, match="the dpo reference is the base with the adapter off"):
        load_config(config_file, values, task="rlhf", validate_paths=False)
    values["ref_model"] = "tiny-llama-2l"
    assert load_config(config_file, values, task="rlhf", validate_paths=False).lora.init_weights == "olora"
    with pytest.raises(UserError, match="--use-dora needs --train-type lora/qlora"):
        cfg_of("--use_dora", "true", "--train_type", "full")


@pytest.mark.parametrize("argv,expect", [
    (["--parallelism", "fsdp", "--nproc_per_node", "2"], "--sharded_loading false"),
    (["--parallelism", "fsdp", "--nproc_per_node", "2", "--sharded_loading", "false"], None),
    (["--train_type", "qlora"], "--use_dora with a 4-bit base"),
    (["--train_type", "qlora", "--parallelism", "fsdp", "--nproc_per_node", "2", "--sharded_loading", "false"], None),
    (["--parallelism", "zero3", "--nproc_per_node", "2"], None),
])
def test_base_reading_adapters_on_a_skeleton(argv, expect):
    """DoRA's magnitude is the norm of the base weight: on a skeleton (meta weights) it is refused,
    naming the way out; the whole-model paths build it."""
    from swiftlite.planner import choose_backend as resolve_backend
    from swiftlite.train.run import skeleton_mode
    cfg = cfg_of("--use_dora", "true", *argv)
    choice = resolve_backend(cfg, cfg.parallel.nproc_per_node or 1)
    if expect is None:
        skeleton_mode(cfg, choice)
    else:
        with pytest.raises(UserError, match=expect):
            skeleton_mode(cfg, choice)


# -- LoRA+ ----------------------------------------------------------------------------------------------

def test_lorap_lr_ratio_puts_b_matrices_at_ratio_times_lr():
    from swiftlite.optim import build_optimizer, build_scheduler
    cfg, model = lora_of("--lorap_lr_ratio", "16", "--learning_rate", "2e-4", "--lr_scheduler", "linear",
                         "--warmup_steps", "0")
    opt = build_optimizer(model, cfg)
    names = {id(p): n for n, p in model.named_parameters()}
    lr_of = {names[id(p)]: g["lr"] for g in opt.param_groups for p in g["params"]}
    b = [n for n in lr_of if "lora_B" in n]
    a = [n for n in lr_of if "lora_A" in n]
    assert b and a
    assert all(lr_of[n] == pytest.approx(2e-4 * 16) for n in b)
    assert all(lr_of[n] == pytest.approx(2e-4) for n in a)
    assert opt.param_groups[0]["lr"] == pytest.approx(2e-4)             # the logged lr is the base one
    sched = build_scheduler(opt, cfg, total_steps=4)
    opt.step()
    sched.step()                                                         # the schedule keeps the ratio
    assert opt.param_groups[0]["lr"] == pytest.approx(2e-4 * 3 / 4)
    ratios = {round(g["lr"] / opt.param_groups[0]["lr"], 6) for g in opt.param_groups}
    assert ratios == {1.0, 16.0}
    _, plain_model = lora_of()
    plain = build_optimizer(plain_model, cfg_of())
    assert {g.get("lr") for g in plain.param_groups} == {1e-4}


# -- DoRA: the magnitude vector is saved, and export merges it as peft does ----------------------------

def test_dora_merge_matches_peft():
    from peft import get_peft_model_state_dict

    from swiftlite.export.adapter import Adapter, merge_lora
    cfg, model = lora_of("--use_dora", "true")
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn_like(p))
    sd = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
    ad = Adapter({"r": 4, "lora_alpha": 8, "use_dora": True}, sd, "t")
    mod = "model.layers.0.self_attn.q_proj"
    parts = ad.lora_modules()[mod]
    assert "m" in parts and parts["m"].shape == (32,)
    w0 = q_proj(model).base_layer.weight.detach().clone()
    merged = merge_lora(w0, parts, ad.scale(mod, 4), False)
    want = model.merge_and_unload().model.layers[0].self_attn.q_proj.weight
    assert torch.allclose(merged, want, atol=1e-5)
    assert not torch.allclose(merged, merge_lora(w0, {k: v for k, v in parts.items() if k != "m"}, 2.0, False),
                              atol=1e-3)


def test_dora_run_saves_magnitudes_and_exports(demo_data, tmp_path):
    from safetensors.torch import load_file
    train, _ = demo_data
    run = tmp_path / "run"
    run_cli(["sft", "--model", "tiny-llama-2l", "--dataset", f"{train}#16", "--gradient-accumulation-steps", "1", "--gradient-checkpointing", "false", "--max_steps", "2", "--use_dora", "true",
             "--output_dir", run])
    adapter = run / "checkpoint-2" / "adapter"
    sd = load_file(str(adapter / "adapter_model.safetensors"))
    mags = [k for k in sd if k.endswith(".lora_magnitude_vector")]
    assert len(mags) == len([k for k in sd if k.endswith(".lora_A.weight")]) > 0
    assert json.loads((adapter / "adapter_config.json").read_text())["use_dora"] is True
    out = tmp_path / "merged"
    proc = run_cli(["export", "--ckpt", run, "--output", out, "--merge-lora", "--verify"])
    assert "checks: passed" in proc.stdout + proc.stderr
    merged = load_file(str(next(out.glob("*.safetensors"))))
    assert not any("magnitude" in k or "lora_" in k for k in merged)


def test_loftq_fits_the_adapter_to_the_4bit_error(tmp_path):
    """QLoRA + --init_weights loftq (peft's replace_lora_weights_loftq): B is no longer zero, and the
    quantized base plus the adapter is closer to the folder's 16-bit weights than the base alone."""
    import bitsandbytes.functional as bnbf

    from swiftlite.models.loading import prepare_model
    tiny_qwen2(seed=0).save_pretrained(tmp_path / "m", safe_serialization=True)
    from safetensors.torch import load_file
    w = load_file(str(tmp_path / "m" / "model.safetensors"))["model.layers.0.self_attn.q_proj.weight"]
    config_file, values = parse_run_args(["--dataset", "t.jsonl", "--model", str(tmp_path / "m"),
                                          "--train_type", "qlora", "--init_weights", "loftq", "--lora_rank", "4"])
    cfg = load_config(config_file, values, validate_paths=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = prepare_model(cfg)
    layer = q_proj(model)
    assert torch.count_nonzero(layer.lora_B["default"].weight) > 0
    base = layer.base_layer.weight
    deq = bnbf.dequantize_4bit(base.data, base.quant_state).float()
    s = torch.linalg.svdvals(w - deq)
    err_loftq = (w - deq - layer.get_delta_weight("default").float()).norm()   # scale alpha/r included
    assert err_loftq.item() == pytest.approx(s[4:].norm().item(), rel=1e-3)    # the best rank-4 fit
    assert err_loftq < 0.95 * (w - deq).norm()
    with pytest.raises(UserError, match="is a built-in preset"):
        from swiftlite.models.lora import apply_loftq
        apply_loftq(None, cfg_of("--train_type", "qlora", "--init_weights", "loftq"), None)
