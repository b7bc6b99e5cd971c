"""GaLore (--use_galore, swiftlite/galore.py): which weights are projected, that their updates are
low-rank (the projection happens), the per-parameter mode's ms-swift numbers (projection gap, decay,
schedule), the optimizer state as plain tensors that a weights-only load reads back and continues from
exactly, and the refusals. Each test fails if GaLore is ignored or its settings are."""

from __future__ import annotations

import io

import pytest
import torch

from swiftlite.cli import parse_run_args
from swiftlite.config import load_config
from swiftlite.errors import UserError


def cfg_of(*argv: str):
    config_file, values = parse_run_args(["--dataset", "train.jsonl", "--model", "tiny-llama-2l", "--train_type",
                                          "full", "--torch_dtype", "fp32", *argv])
    return load_config(config_file, values, validate_paths=False)


def _model(cfg):
    from swiftlite.models.loading import load_model
    return load_model(cfg)


def _grads(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=g)
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()


def test_default_targets_are_the_linear_layers_but_the_head():
    from swiftlite.galore import projected_params, target_names
    cfg = cfg_of("--use_galore", "true")
    model = _model(cfg)
    names = target_names(model, cfg)
    assert "lm_head" not in names and {"q_proj", "down_proj"} <= set(names)
    ids = {id(p) for p in projected_params(model, cfg)}
    linear = {id(m.weight) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    assert ids == linear
    emb = cfg_of("--use_galore", "true", "--galore_with_embedding", "true")
    assert id(model.get_input_embeddings().weight) in {id(p) for p in projected_params(model, emb)}
    only = cfg_of("--use_galore", "true", "--galore_target_modules", "q_proj", "v_proj")
    assert len(projected_params(model, only)) == 2 * model.config.num_hidden_layers
    with pytest.raises(UserError, match="--galore_target_modules nothing_here"):
        projected_params(model, cfg_of("--use_galore", "true", "--galore_target_modules", "nothing_here"))


def test_projected_updates_have_the_galore_rank_and_the_rest_do_not():
    """One step without weight decay: every projected matrix moves by a matrix of rank <= galore_rank
    (the update is projected back from rank-r moments); a plain AdamW step moves it at full rank."""
    from swiftlite.optim import build_optimizer
    rank = 2
    cfg = cfg_of("--use_galore", "true", "--galore_rank", str(rank), "--weight_decay", "0", "--learning_rate", "1e-2")
    model = _model(cfg)
    q = model.model.layers[0].self_attn.q_proj.weight
    before = q.detach().clone()
    opt = build_optimizer(model, cfg)
    assert type(opt).__name__ == "GaLoreAdamW" and opt.param_groups[0]["rank"] == rank
    _grads(model, 0)
    opt.step()
    assert 0 < torch.linalg.matrix_rank(q.detach() - before).item() <= rank
    plain = _model(cfg_of("--weight_decay", "0", "--learning_rate", "1e-2"))
    q2 = plain.model.layers[0].self_attn.q_proj.weight
    before2 = q2.detach().clone()
    opt2 = build_optimizer(plain, cfg_of("--weight_decay", "0", "--learning_rate", "1e-2"))
    _grads(plain, 0)
    opt2.step()
    assert torch.linalg.matrix_rank(q2.detach() - before2).item() > rank


def test_per_parameter_mode_is_msswifts_numbers():
    from swiftlite.optim import build_optimizer, build_scheduler
    base = ("--use_galore", "true", "--galore_update_proj_gap", "5", "--warmup_steps", "3")
    cfg = cfg_of(*base, "--galore_optim_per_parameter", "true")
    model = _model(cfg)
    opt = build_optimizer(model, cfg)
    assert opt.param_groups[0]["update_proj_gap"] == 10
    assert len(opt.param_groups) == 2 and opt.param_groups[1]["weight_decay"] == cfg.optim.weight_decay
    assert any(p.ndim == 1 for p in opt.param_groups[1]["params"])   # norms decayed too, as ms-swift's
    sched = build_scheduler(opt, cfg, 20)
    lrs = []
    for _ in range(12):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    # warm-up over 2 x 3 steps, then cosine over the remaining 40 - 6 steps
    assert lrs[0] == 0 and lrs[5] < lrs[6] == pytest.approx(cfg.learning_rate)
    import math
    assert lrs[11] == pytest.approx(cfg.learning_rate * 0.5 * (1 + math.cos(math.pi * 5 / 34)))
    plain = build_optimizer(model, cfg_of(*base))
    assert plain.param_groups[0]["update_proj_gap"] == 5
    assert all(g["weight_decay"] == 0 for g in plain.param_groups[1:] if all(p.ndim == 1 for p in g["params"]))


def test_state_is_plain_tensors_and_a_weights_only_load_continues_exactly():
    """After steps that computed projections, the saved state has no projector object (torch's
    weights-only loader reads it); an optimizer loaded from it makes the same next step as the
    original, projections included (they are refreshed every 2 steps here)."""
    from swiftlite.optim import build_optimizer
    cfg = cfg_of("--use_galore", "true", "--galore_rank", "2", "--galore_update_proj_gap", "2", "--galore_proj_type",
                 "full", "--learning_rate", "1e-2")
    model = _model(cfg)
    opt = build_optimizer(model, cfg)
    for s in range(3):
        _grads(model, s)
        opt.step()
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    first = saved["optim"]["state"][0]
    assert "projector" not in first and {"galore_ortho_left", "galore_ortho_right"} <= first.keys()
    twin = _model(cfg)
    twin.load_state_dict(saved["model"])
    opt2 = build_optimizer(twin, cfg)
    opt2.load_state_dict(saved["optim"])
    for m, o in ((model, opt), (twin, opt2)):
        _grads(m, 3)
        o.step()   # step 4: 3 % 2 != 0, the loaded projector is used as it was saved
        _grads(m, 4)
        o.step()   # step 5: the projections are recomputed
    for (n, a), b in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("argv,message", [
    (("--galore_rank", "8"), "--galore_rank is an option of GaLore: add --use_galore true"),
    (("--use_galore", "true", "--train_type", "lora"), "--use_galore with --train_type lora: GaLore projects"),
    (("--use_galore", "true", "--optim", "sgd"), "--use_galore with --optim sgd: galore-torch projects for AdamW"),
    (("--use_galore", "true", "--optimizer", "muon"), "--use_galore with --optimizer muon: one optimizer plugin"),
    (("--use_galore", "true", "--galore_rank", "0"), "--galore_rank 0 --galore_update_proj_gap 50: both must"),
    (("--use_galore", "true", "--galore_optim_per_parameter", "true", "--warmup_ratio", "0.1"),
     "--warmup_ratio 0.1 with --galore_optim_per_parameter true"),
])
def test_refusals(argv, message):
    with pytest.raises(UserError) as e:
        cfg_of(*argv)
    assert message in str(e.value)


def test_optimizer_galore_is_use_galore_and_q_galore_is_refused():
    from swiftlite.config.galore_options import uses_galore
    from swiftlite.optim import optim_name
    cfg = cfg_of("--optimizer", "galore")
    assert uses_galore(cfg) and optim_name(cfg) == "adamw_torch_fused"
    with pytest.raises(UserError, match="--galore_quantization: Q-GaLore"):
        cfg_of("--use_galore", "true", "--galore_quantization", "true")
