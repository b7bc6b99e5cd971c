"""--train_type boft, adalora and bone (peft's MiSS) (models/tuners.py, config/rules_tuners.py, train/adalora.py,
export/tuner_merge.py, the planner's adapter counts). Each test fails if its part is ignored: on a
tiny in-memory model, or the config rules alone."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from swiftlite.cli import parse_run_args
from swiftlite.config import load_config
from swiftlite.errors import UserError


def cfg_of(*argv: str, task: str = "sft"):
    config_file, values = parse_run_args(["--dataset", "train.jsonl", "--model", "tiny-llama-2l", *argv])
    return load_config(config_file, values, task=task, validate_paths=False)


def tiny_llama(seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    conf = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(conf).float()


def adapted(*argv: str, total_steps: int = 20, seed: int = 0):
    from swiftlite.models.lora import apply_lora
    cfg = cfg_of(*argv)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cfg, apply_lora(tiny_llama(seed), cfg, total_steps)


def test_msswift_defaults_and_peft_configs():
    from peft import AdaLoraConfig, BOFTConfig
    cfg, m = adapted("--train_type", "boft")
    conf = m.peft_config["default"]
    assert isinstance(conf, BOFTConfig)
    assert (conf.boft_block_size, conf.boft_block_num, conf.boft_n_butterfly_factor, conf.boft_dropout) == (4, 0, 1, 0.0)
    names = [n for n, p in m.named_parameters() if p.requires_grad]
    assert names and all(".boft_R." in n or ".boft_s." in n for n in names)
    cfg, m = adapted("--train_type", "adalora", total_steps=37)
    conf = m.peft_config["default"]
    assert isinstance(conf, AdaLoraConfig)
    assert (conf.target_r, conf.init_r, conf.tinit, conf.tfinal, conf.deltaT, conf.beta1, conf.beta2,
            conf.orth_reg_weight, conf.total_step, conf.lora_alpha) == (8, 12, 0, 0, 1, 0.85, 0.85, 0.5, 37, 32)
    assert m.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].shape == (12, 32)


@pytest.mark.parametrize("argv,expect", [
    (["--train_type", "boft", "--use_dora", "true"], "--use_dora: DoRA is a variant of peft's LoRA"),
    (["--train_type", "adalora", "--init_weights", "pissa"], "--init_weights: --init_weights (PiSSA"),
    (["--train_type", "adalora", "--lorap_lr_ratio", "16"], "--lorap_lr_ratio: LoRA+"),
    (["--train_type", "boft", "--lora_rank", "16"], "--lora_rank does not apply to --train_type boft"),
    (["--train_type", "boft", "--lora_alpha", "16"], "--lora_alpha does not apply to --train_type boft"),
    (["--train_type", "adalora", "--lora_rank", "16"], "--lora_rank does not apply to --train_type adalora"),
    (["--train_type", "adalora", "--use_rslora", "true"], "--use_rslora does not apply"),
    (["--train_type", "boft", "--quant_bits", "4"], "--quant_bits 4 with --train_type boft"),
    (["--train_type", "adalora", "--quant_bits", "8"], "--quant_bits 8 with --train_type adalora"),
    (["--boft_block_size", "8"], "--boft_block_size is an option of --train_type boft; this run trains lora"),
    (["--train_type", "boft", "--adalora_init_r", "8"], "--adalora_init_r is an option of --train_type adalora"),
    (["--train_type", "full", "--boft_dropout", "0.1"], "--boft_dropout is an option of --train_type boft"),
    (["--train_type", "boft", "--boft_block_num", "4"], "--boft_block_size 4 --boft_block_num 4: give exactly one"),
    (["--train_type", "boft", "--boft_n_butterfly_factor", "0"], "--boft_n_butterfly_factor must be >= 1"),
    (["--train_type", "adalora", "--adalora_target_r", "16"], "--adalora_target_r 16: must be > 0 and at most"),
    (["--train_type", "adalora", "--adalora_orth_reg_weight", "-1"], "--adalora_orth_reg_weight must be >= 0"),
    (["--train_type", "adalora", "--adalora_deltaT", "0"], "--adalora_deltaT >= 1"),
    (["--train_type", "boft", "--optim", "muon"], "--optim muon with --train_type boft"),
    (["--train_type", "bone", "--init_weights", "pissa"], "--init_weights pissa: a LoRA initialisation; --train_type "
                                                          "bone (peft's MiSS) takes true, false, bat"),
    (["--train_type", "bone", "--init_weights", "mini"], "--init_weights mini: peft MiSS's mini variant needs its mini_r"),
    (["--train_type", "lora", "--init_weights", "bat"], "--init_weights bat: not one of"),
    (["--reft_rank", "8"], "--reft_rank is the rank of --train_type bone here (ms-swift's ReFT, --train_type reft, is "
                           "not available); this run trains lora"),
    (["--train_type", "boft", "--reft_rank", "8"], "--reft_rank is the rank of --train_type bone here"),
    (["--train_type", "bone", "--reft_rank", "0"], "--reft_rank must be >= 1"),
    (["--train_type", "bone", "--lora_rank", "16"], "--lora_rank does not apply to --train_type bone: Bone's rank is "
                                                    "--reft_rank"),
    (["--train_type", "bone", "--lora_alpha", "16"], "--lora_alpha does not apply to --train_type bone"),
    (["--train_type", "bone", "--lora_dropout", "0.1"], "--lora_dropout does not apply to --train_type bone"),
    (["--train_type", "bone", "--use_dora", "true"], "--use_dora: DoRA is a variant of peft's LoRA"),
    (["--train_type", "bone", "--quant_bits", "4"], "--quant_bits 4 with --train_type bone"),
    (["--train_type", "bone", "--boft_block_size", "8"], "--boft_block_size is an option of --train_type boft"),
    (["--train_type", "bone", "--optim", "muon"], "--optim muon with --train_type bone"),
])
def test_refusals(argv, expect):
    with pytest.raises(UserError) as e:
        cfg = cfg_of(*argv)
        from swiftlite.optim import optim_problem
        why = optim_problem(cfg)
        if why:
            raise UserError(why)
    assert expect in str(e.value), str(e.value)


def test_adalora_refused_for_rlhf_and_on_sharding_backends():
    config_file, values = parse_run_args(["--dataset", "t.jsonl", "--model", "tiny-llama-2l", "--train_type", "adalora"])
    with pytest.raises(UserError, match="--train_type adalora with swiftlite rlhf"):
        load_config(config_file, values, task="rlhf", validate_paths=False)
    from swiftlite.parallel.base import BackendChoice
    from swiftlite.train.adalora import adalora_problem
    cfg = cfg_of("--train_type", "adalora")
    for name in ("fsdp", "fsdp1", "zero2", "zero3"):
        assert "--train_type adalora with --parallelism" in adalora_problem(cfg, BackendChoice(name, name))
    for name in ("single", "ddp"):
        assert adalora_problem(cfg, BackendChoice(name, name)) is None
    assert adalora_problem(cfg_of("--train_type", "boft"), BackendChoice("zero3", "zero3")) is None


def test_adalora_schedule_against_steps_is_one_line():
    with pytest.raises(UserError, match="--adalora_tinit 5 --adalora_tfinal 5 with 10 optimizer steps"):
        adapted("--train_type", "adalora", "--adalora_tinit", "5", "--adalora_tfinal", "5", total_steps=10)


def test_butterfly_factor_refused_without_fbd_cuda():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device may load peft's extension")
    with pytest.raises(UserError, match="--boft_n_butterfly_factor 2: peft builds butterfly factors above 1 only"):
        adapted("--train_type", "boft", "--boft_n_butterfly_factor", "2")


def test_orth_penalty_is_pefts_regulariser():
    """The penalty train/adalora.py adds equals what peft's AdaLoraModel.forward adds to a loss it
    computes from labels (orth_reg_weight x R), to 1e-5."""
    from swiftlite.train.adalora import orth_penalty
    cfg, m = adapted("--train_type", "adalora", "--adalora_orth_reg_weight", "0.7")
    with torch.no_grad():   # A and B away from their near-zero start, so R is not trivially ~1
        for n, p in m.named_parameters():
            if "lora_A" in n or "lora_B" in n:
                p.normal_(0, 0.5)
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        with_reg = m(input_ids=ids, labels=ids).loss
        plain = m.base_model.model(input_ids=ids, labels=ids).loss   # the wrapped model: no regulariser
        ours = 0.7 * orth_penalty(m)
    assert float(ours) > 0.1
    assert abs(float(with_reg - plain) - float(ours)) < 1e-5


class _Engine:
    """The Engine surface AdaLoraEngine uses: step() with an update, after_update hooks."""

    def __init__(self, model):
        self.model = model
        self.opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        self.opt.register_step_post_hook(lambda *_: [f() for f in self.hooks])
        self.hooks = []

    def after_update(self, fn):
        self.hooks.append(fn)

    def step(self):
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return 0.0


def _train(m, engine, steps):
    torch.manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, 64, (2, 9))
        m.base_model.model(input_ids=ids, labels=ids).loss.backward()   # a loss without peft's regulariser
        engine.step()


def test_adalora_engine_allocates_ranks_and_adds_the_penalty():
    from swiftlite.train.adalora import AdaLoraEngine, orth_penalty
    steps = 6
    cfg, m = adapted("--train_type", "adalora", "--adalora_init_r", "6", "--adalora_target_r", "2",
                     "--adalora_tinit", "1", "--adalora_tfinal", "2", "--adalora_orth_reg_weight", "0.5",
                     total_steps=steps)
    m0 = copy.deepcopy(m)
    engine = AdaLoraEngine(_Engine(m), m, start_step=0)
    # the penalty's gradient is added once per step: after step(), a step on its gradient alone
    # (orth weight x dR) is what separates it from a run with weight 0
    _train(m, engine, steps)
    assert engine.global_step == steps and engine.last_penalty > 0
    pattern = m.peft_config["default"].rank_pattern
    assert pattern, "update_and_allocate never set a rank pattern"
    kept = [sum(v) for v in pattern.values()]
    assert sum(kept) == 2 * len(kept) and min(kept) < 6   # the budget: target_r per layer on average
    for n, p in m.named_parameters():   # masked singular values are exactly zero after the last step
        if "lora_E" in n:
            mask = torch.tensor(pattern[n.removeprefix("base_model.model.")])   # peft's names: the wrapped model's
            assert torch.all(p.detach().view(-1)[~mask] == 0) and torch.all(p.detach().view(-1)[mask] != 0)
    # weight 0: no penalty gradient, so the adapter ends elsewhere
    cfg0, z = adapted("--train_type", "adalora", "--adalora_init_r", "6", "--adalora_target_r", "2",
                      "--adalora_tinit", "1", "--adalora_tfinal", "2", "--adalora_orth_reg_weight", "0",
                      total_steps=steps)
    z.load_state_dict(m0.state_dict())
    engine0 = AdaLoraEngine(_Engine(z), z, start_step=0)
    _train(z, engine0, steps)
    a = dict(m.named_parameters())
    assert any(not torch.equal(p, a[n]) for n, p in z.named_parameters() if "lora_A" in n)
    assert engine0.last_penalty == 0.0


def test_penalty_gradient_is_exactly_the_regulariser():
    from swiftlite.train.adalora import AdaLoraEngine, orth_penalty
    cfg, m = adapted("--train_type", "adalora", "--adalora_orth_reg_weight", "0.5")
    grads = {}

    class Capture(_Engine):
        def step(self):
            grads.update({n: p.grad.clone() for n, p in self.model.named_parameters() if p.grad is not None})
            self.opt.zero_grad(set_to_none=True)
            return 0.0

    AdaLoraEngine(Capture(m), m, 0).step()
    ref = {n: p for n, p in m.named_parameters() if p.requires_grad}
    expected = torch.autograd.grad(0.5 * orth_penalty(m), list(ref.values()), allow_unused=True)
    for (n, _), g in zip(ref.items(), expected):
        if g is not None:
            torch.testing.assert_close(grads[n], g, rtol=0, atol=1e-6)


def test_bone_is_msswifts_config_on_pefts_miss():
    """ms-swift's BoneConfig(target_modules, r=reft_rank, init_weights) with its defaults (reft_rank 4,
    init_weights true), built as peft's MissConfig on every linear but the head."""
    from peft import MissConfig
    from peft.tuners.miss import MissLinear
    cfg, m = adapted("--train_type", "bone")
    conf = m.peft_config["default"]
    assert isinstance(conf, MissConfig)
    assert (conf.r, conf.init_weights, conf.miss_dropout, conf.mini_r, conf.bias) == (4, True, 0.0, 1, "none")
    wrapped = {n.removeprefix("base_model.model.") for n, mod in m.named_modules() if isinstance(mod, MissLinear)}
    assert len(wrapped) == 14 and {n.rsplit(".", 1)[-1] for n in wrapped} == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    names = [n for n, p in m.named_parameters() if p.requires_grad]
    assert len(names) == 14 and all(".miss_block." in n for n in names)
    q = m.base_model.model.model.layers[0].self_attn.q_proj
    assert q.miss_block["default"].shape == (4, 32) and not q.miss_block["default"].any()   # zeros: the base's output
    for value, peft_value, shape in (("false", False, (4, 32)), ("bat", "bat", (8, 4, 4))):
        cfg, m = adapted("--train_type", "bone", "--init_weights", value, "--reft_rank", "4")
        assert m.peft_config["default"].init_weights == peft_value
        assert m.base_model.model.model.layers[0].self_attn.q_proj.miss_block["default"].shape == shape
    cfg, m = adapted("--train_type", "bone", "--reft_rank", "8", "--target_modules", "q_proj", "v_proj")
    assert m.peft_config["default"].r == 8
    assert sum(p.numel() for p in m.parameters() if p.requires_grad) == 2 * 8 * (32 + 16)   # q 32, v 16 outputs
    cfg, m = adapted("--train_type", "bone", "--modules_to_save", "lm_head")   # trained in full, saved with it
    assert m.peft_config["default"].modules_to_save == ["lm_head"]
    assert any("lm_head.modules_to_save" in n for n, p in m.named_parameters() if p.requires_grad)


@pytest.mark.parametrize("argv,expect", [
    (["--reft_rank", "80", "--target_modules", "down_proj"], "--reft_rank 80: model.layers.0.mlp.down_proj takes 64 "
                                                             "inputs, fewer than the rank"),
    (["--reft_rank", "40", "--target_modules", "q_proj"], "--reft_rank 40: model.layers.0.self_attn.q_proj takes 32 "
                                                          "inputs, fewer than the rank"),
    (["--reft_rank", "3", "--init_weights", "bat"], "--reft_rank 3 --init_weights bat: model.layers.0.self_attn.q_proj is "
                                                    "32 x 32, not a whole number of 3 x 3 blocks"),
])
def test_bone_blocks_checked_before_launch(argv, expect):
    """peft MiSS's condition on each adapted layer, on the meta model (launch/preflight.py), one line; the
    same values pass where they fit (r 3 without bat: peft pads the last column block)."""
    from swiftlite.models.lora import check_targets, check_tuner
    cfg = cfg_of("--train_type", "bone", *argv)
    with torch.device("meta"):
        model = tiny_llama()
    with pytest.raises(UserError) as e:
        check_tuner(model, cfg, check_targets(model, cfg))
    assert expect in str(e.value) and "\n" not in str(e.value), str(e.value)
    ok = cfg_of("--train_type", "bone", "--reft_rank", "3")
    check_tuner(model, ok, check_targets(model, ok))
    check_tuner(model, cfg_of("--train_type", "bone", "--init_weights", "bat"), "all-linear")


def test_bone_adapter_runs_on_a_bf16_base():
    """ms-swift casts the model to its dtype after loading a Bone adapter (peft 0.14 multiplied an fp32
    block with bf16 activations); peft's MiSS casts the input to the block's dtype, so a saved adapter
    (fp32 block) runs on a bf16 base as loaded, and gives the fp32 model's output to bf16 rounding."""
    import tempfile

    from peft import PeftModel
    cfg, m = adapted("--train_type", "bone", "--init_weights", "bat")
    with torch.no_grad():
        for p in m.parameters():
            if p.requires_grad:
                p.normal_(0, 0.1)
    ids = torch.randint(0, 64, (1, 9))
    with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m.save_pretrained(d)
        bf = PeftModel.from_pretrained(tiny_llama(0).to(torch.bfloat16), d)
        with torch.no_grad():
            want, got = m(input_ids=ids).logits, bf(input_ids=ids).logits
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("kind", ["boft", "adalora", "bone", "bone-bat", "bone-r5"])
def test_export_merge_is_pefts(kind):
    """export/tuner_merge.merge_tuner gives peft's merge_and_unload, with non-trivial adapters (AdaLoRA:
    after a rank pattern shrank the saved tensors, so the scale must stay alpha / init_r)."""
    from peft import PeftModel, get_peft_model_state_dict

    from swiftlite.export.tuner_merge import merge_tuner, tuner_modules
    extra = {"boft": ["--boft_block_size", "8"], "bone-bat": ["--init_weights", "bat"], "bone-r5": ["--reft_rank", "5"]}
    cfg, m = adapted("--train_type", kind.split("-")[0], *extra.get(kind, []))   # r 5: peft pads the last block
    with torch.no_grad():
        for n, p in m.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.3)
    if kind == "adalora":
        conf = m.peft_config["default"]
        conf.rank_pattern = {n: [i % 3 != 0 for i in range(12)] for n, _ in m.base_model.model.named_parameters()
                             if "lora_E" in n}   # peft's names: the wrapped model's
    sd = get_peft_model_state_dict(m)
    conf = m.peft_config["default"].to_dict()
    conf["peft_type"] = str(conf["peft_type"].value if hasattr(conf["peft_type"], "value") else conf["peft_type"])
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        m.save_pretrained(d)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from swiftlite.models.tuners import boft_layers
            with boft_layers(1, "x"):
                ref = PeftModel.from_pretrained(tiny_llama(0), d).merge_and_unload()
    base = tiny_llama(0).state_dict()
    mods = tuner_modules(conf["peft_type"], sd)
    assert len(mods) == 14
    for mod, parts in mods.items():
        merged = merge_tuner(conf, parts, base[f"{mod}.weight"])
        torch.testing.assert_close(merged, ref.state_dict()[f"{mod}.weight"].float(), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(merged, base[f"{mod}.weight"], atol=1e-3)


@pytest.mark.parametrize("argv", [
    ["--train_type", "boft"], ["--train_type", "boft", "--boft_block_size", "0", "--boft_block_num", "4"],
    ["--train_type", "adalora"], ["--train_type", "adalora", "--target_modules", "q_proj", "v_proj"],
    ["--train_type", "lora", "--lora_rank", "4"],
    ["--train_type", "bone"], ["--train_type", "bone", "--init_weights", "bat", "--reft_rank", "2"],
    ["--train_type", "bone", "--reft_rank", "6", "--target_modules", "q_proj", "v_proj"],
])
def test_planner_counts_the_adapters_parameters(argv):
    from swiftlite.models.shape import shape_from_config
    from swiftlite.planner.memory import Workload
    cfg, m = adapted(*argv, "--max_length", "64")
    real = sum(p.numel() for p in m.parameters() if p.requires_grad)
    shape = shape_from_config(m.config.to_dict())
    w = Workload(train_type=cfg.train.train_type, lora_rank=cfg.lora.lora_rank,
                 lora_targets=tuple(cfg.lora.target_modules),
                 boft_block=(cfg.lora.boft_block_size, cfg.lora.boft_block_num, cfg.lora.boft_n_butterfly_factor),
                 adalora_init_r=cfg.lora.adalora_init_r, bone_rank=cfg.lora.reft_rank)
    assert w.adapter_params(shape) == real
    from swiftlite.planner.recommend import workload_from_config   # what estimate and the preflight count
    assert workload_from_config(cfg, 1, None).adapter_params(shape) == real


def test_training_loss_has_no_per_forward_penalty():
    """The summed token loss (parallel/loss.py) is not HF's `loss`, so peft's AdaLoraModel.forward does
    not add its penalty to every micro-batch's sum (it is applied once per step, train/adalora.py)."""
    from swiftlite.parallel.loss import loss_options, token_loss_sum
    cfg, m = adapted("--train_type", "adalora", "--adalora_orth_reg_weight", "0.7", "--lora_dropout", "0")
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_" in n and p.requires_grad:
                p.normal_(0, 0.5)
    ids = torch.randint(0, 64, (1, 9))
    batch = {"input_ids": ids, "labels": ids.clone()}
    with torch.no_grad():
        got = token_loss_sum(m, batch, loss_options(cfg))
        m.peft_config["default"].orth_reg_weight = 0.0
        plain = token_loss_sum(m, batch, loss_options(cfg))
    assert float(got) == float(plain)
