"""Helper for test_deepspeed_smoke.py (not a test itself).

    python _ds_worker.py reference OUT.json                          # 1 process, plain torch
    torchrun --standalone --nproc-per-node 2 _ds_worker.py zero2 OUT.json
    torchrun --standalone --nproc-per-node 2 _ds_worker.py zero3 OUT.json

Trains the tiny Llama for STEPS optimizer steps on fixed random token batches and writes the
per-step global loss (summed token CE / global target tokens) plus checks to OUT.json (rank 0).
The DeepSpeed runs drive swiftlite's DeepSpeed Engine exactly as the trainer does: each rank scales
its summed micro-batch loss by world_size / global_tokens, backward per micro-batch, one step().
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch

STEPS, SAVE_AT, SEQ, VOCAB = 10, 5, 16, 260
MICRO, GAS, WORLD = 1, 2, 2          # DeepSpeed: 2 ranks x micro 1 x gas 2; reference: micro 2 x gas 2
GLOBAL = MICRO * GAS * WORLD


def make_cfg(parallelism: str, deepspeed_json: str | None = None):
    from swiftlite.config import RunConfig
    cfg = RunConfig()
    cfg.train.train_type = "full"
    cfg.model.torch_dtype = "fp32"
    cfg.parallel.parallelism = parallelism
    cfg.parallel.deepspeed = deepspeed_json
    cfg.train.per_device_train_batch_size = MICRO
    cfg.train.gradient_accumulation_steps = GAS
    cfg.optim.learning_rate = 3e-3
    cfg.optim.warmup_steps = 2
    cfg.optim.lr_scheduler = "cosine"
    cfg.optim.max_grad_norm = 1.0      # active: the random-token gradients are larger than that
    cfg.optim.weight_decay = 0.1
    return cfg


def make_model(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    conf = LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)
    return LlamaForCausalLM(conf).float()


def global_batch(step: int) -> list[dict[str, torch.Tensor]]:
    """GLOBAL sequences for optimizer step `step`, right-padded to SEQ, different lengths. Two batches
    alternate, so the loss falls visibly (an optimizer that does nothing would show)."""
    g = torch.Generator().manual_seed(1000 + step % 2)
    rows = []
    for _ in range(GLOBAL):
        n = int(torch.randint(6, SEQ + 1, (1,), generator=g))
        ids = torch.randint(3, VOCAB, (SEQ,), generator=g)
        mask = torch.zeros(SEQ, dtype=torch.long)
        mask[:n] = 1
        ids[n:] = 0
        labels = ids.clone()
        labels[n:] = -100
        labels[: int(torch.randint(1, 4, (1,), generator=g))] = -100   # a "prompt" without loss
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return rows


def stack(rows):
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def targets(rows) -> int:
    return sum(int((r["labels"][1:] != -100).sum()) for r in rows)


def micro_rows(rows, k: int, rank: int, world: int, micro: int):
    """Micro-batch k of `rank`: the same split the trainer uses (rank-major within each micro step)."""
    start = (k * world + rank) * micro
    return rows[start:start + micro]


def reference(out: str) -> None:
    from swiftlite.optim import build_optimizer, build_scheduler
    from swiftlite.parallel.loss import token_loss_sum
    cfg = make_cfg("single")
    model = make_model()
    model.train()
    opt = build_optimizer(model, cfg)
    sched = build_scheduler(opt, cfg, STEPS)
    losses, norms = [], []
    for step in range(STEPS):
        rows = global_batch(step)
        ntok = targets(rows)
        total = 0.0
        for k in range(GAS):
            b = stack(micro_rows(rows, k, 0, 1, MICRO * WORLD))
            loss = token_loss_sum(model, b)
            (loss / ntok).backward()
            total += float(loss.detach())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.max_grad_norm)))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total / ntok)
    n_params = sum(p.numel() for p in model.parameters())
    json.dump({"losses": losses, "grad_norms": norms, "n_params": n_params,
               "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}, open(out, "w"))


def ds_run(preset: str, out: str) -> None:
    import torch.distributed as dist

    from swiftlite.parallel.base import World, build_engine
    from swiftlite.parallel.deepspeed import ds_env_defaults, zero_init_context

    ds_env_defaults()
    world = World.from_env()
    assert world.world_size == WORLD, world
    ds_json = None
    if preset.startswith("zero3"):
        from swiftlite.parallel.ds_config import load_ds_config
        d = load_ds_config(preset)
        d["zero_optimization"]["stage3_param_persistence_threshold"] = 0   # tiny models hide gather bugs
        ds_json = os.path.join(tempfile.gettempdir(), f"swiftlite_ds_test_{os.environ.get('TORCHELASTIC_RUN_ID', os.getpid())}.json")
        if world.rank == 0:
            json.dump(d, open(ds_json + ".tmp", "w"))
            os.replace(ds_json + ".tmp", ds_json)
    cfg = make_cfg(preset, ds_json)
    if ds_json:
        import time
        while not os.path.exists(ds_json):
            time.sleep(0.05)

    def run(engine, steps, ckpt=None, save_at=None):
        losses, norms, lrs = [], [], []
        for step in steps:
            rows = global_batch(step)
            ntok = targets(rows)
            total = torch.zeros(())
            for k in range(GAS):
                b = stack(micro_rows(rows, k, world.rank, WORLD, MICRO))
                loss = engine.forward(b)
                engine.backward(loss * (world.world_size / ntok))
                total += loss.detach()
            norms.append(engine.step())
            lrs.append(engine.lr())
            dist.all_reduce(total)
            losses.append(float(total) / ntok)
            if save_at is not None and step + 1 == save_at:
                engine.save(ckpt)
        return losses, norms, lrs

    result: dict = {}
    engine = build_engine(make_model(), cfg, world, STEPS, backend="deepspeed")
    result["state_bytes"] = engine.state_bytes()
    result["stage"] = engine.stage
    ckpt = tempfile.mkdtemp(prefix="swiftlite_ds_ckpt_") if world.rank == 0 else None
    obj = [ckpt]
    dist.broadcast_object_list(obj, src=0)
    ckpt = obj[0]
    losses, norms, lrs = run(engine, range(STEPS), ckpt, SAVE_AT)
    result.update(losses=losses, grad_norms=norms, lrs=lrs)
    full = engine.full_state_dict()
    if world.rank == 0:
        result["full_state_dict"] = {k: list(v.shape) for k, v in full.items()}
        result["full_numel"] = sum(v.numel() for k, v in full.items() if k != "lm_head.weight")
    result["n_params"] = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
    del engine, full

    # Resume: a fresh model (other seed) loads the step-SAVE_AT checkpoint and replays the rest.
    engine2 = build_engine(make_model(seed=123), cfg, world, STEPS, backend="deepspeed")
    engine2.load(ckpt)
    result["resumed_losses"], _, _ = run(engine2, range(SAVE_AT, STEPS))
    del engine2

    if preset == "zero3":
        # The model is partitioned while it is built: every rank holds about half of each weight.
        from transformers import LlamaForCausalLM
        with zero_init_context(cfg, world, 64):
            zmodel = LlamaForCausalLM(make_model().config)
        local = sum(p.ds_tensor.numel() for p in zmodel.parameters())
        total = sum(p.ds_numel for p in zmodel.parameters())
        result["zero_init"] = {"all_partitioned": all(p.numel() == 0 for p in zmodel.parameters()),
                               "local": local, "total": total}
        # LoRA under ZeRO-3: the adapter must come back with real shapes.
        from peft import LoraConfig, get_peft_model
        pm = get_peft_model(make_model(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        want = {k: list(v.shape) for k, v in pm.named_parameters() if v.requires_grad}
        cfg_l = make_cfg(preset, ds_json)
        cfg_l.train.train_type = "lora"
        eng = build_engine(pm, cfg_l, world, STEPS, backend="deepspeed")
        run(eng, range(1))
        ad = eng.adapter_state_dict()
        if world.rank == 0:
            result["adapter"] = {k: list(v.shape) for k, v in ad.items()}
            result["adapter_want"] = want
    if world.rank == 0:
        json.dump(result, open(out, "w"))
        if ds_json:
            os.remove(ds_json)
        import shutil
        shutil.rmtree(ckpt, ignore_errors=True)
    dist.barrier()


if __name__ == "__main__":
    mode, out = sys.argv[1], sys.argv[2]
    if mode == "reference":
        reference(out)
    else:
        ds_run(mode, out)
