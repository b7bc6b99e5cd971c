"""Helper for test_estimator_terms.py (not a test itself): measures one memory term of the planner
on CPU, with swiftlite's own engines, and writes the figures to OUT.json (every rank: OUT.rank<r>.json).

    torchrun --standalone --nproc-per-node 2 _terms_worker.py step zero2 OUT.json
    torchrun --standalone --nproc-per-node 2 _terms_worker.py step zero3 OUT.json
    torchrun --standalone --nproc-per-node 2 _terms_worker.py autocast ddp OUT.json
    torchrun --standalone --nproc-per-node 2 _terms_worker.py offload zero2_offload OUT.json
    torchrun --standalone --nproc-per-node 2 _terms_worker.py offload zero3_offload_optimizer.json OUT.json

The model is a bf16 Llama of ~57M parameters (768 hidden x 8 layers, 260-token vocabulary, so that
the linear layers are nearly all of it), trained in full with fp32 master weights (--torch-dtype
bf16), on short fixed token batches: the terms measured are proportional to the parameters, and
activations are kept small beside them. Run with MALLOC_MMAP_THRESHOLD_=65536 so that freed tensors
leave the resident set at once (docs/design.md trap 8).

step:     ZeRO's optimizer-step transient: the kernel's peak-RSS mark is reset just before
          `engine.step()` of step 3 (the optimizer state exists since step 1) and read after it;
          the rise over the RSS before the step is what the step adds.
autocast: the 16-bit weight copies autocast caches under single/ddp: the RSS just before and just
          after the autocast region of step 3's forward exits (its cache is dropped at the exit;
          gradient checkpointing on, so no saved tensor keeps a copy alive).
offload:  where the offload families keep their states, from the tensors (on CPU the accelerator
          and the host are one memory, so the split is read from what DeepSpeed's optimizer holds):
          `device` = the 16-bit module parameters and the gradient buffers DeepSpeed keeps for the
          accelerator, `host` = the fp32 master partitions, their fp32 gradient buffers and AdamW's
          moments (DeepSpeed's offload keeps those in host memory).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

SEQ, STEPS, VOCAB = 32, 3, 260


def rss() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def make_model():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    conf = LlamaConfig(hidden_size=768, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=12,
                       num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=256,
                       tie_word_embeddings=False)
    return LlamaForCausalLM(conf).to(torch.bfloat16)


def make_cfg(parallelism: str, deepspeed_json: str | None):
    from swiftlite.config import RunConfig
    cfg = RunConfig()
    cfg.train.train_type = "full"
    cfg.model.torch_dtype = "bf16"
    cfg.parallel.parallelism = parallelism
    cfg.parallel.deepspeed = deepspeed_json
    cfg.train.per_device_train_batch_size = 1
    cfg.train.gradient_accumulation_steps = 1
    cfg.optim.learning_rate = 1e-4
    return cfg


def batch(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(3, VOCAB, (1, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


def nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def offload_split(engine) -> dict[str, int]:
    """(device, host) bytes of the states an offloading DeepSpeed engine holds, from its tensors."""
    opt = engine.ds.optimizer
    params = sum(nbytes(getattr(p, "ds_tensor", p)) for p in engine.ds.module.parameters())
    # offload_param (zero3_offload): the 16-bit partitions themselves live in host memory
    device, host = (0, params) if getattr(opt, "offload_param", False) else (params, 0)
    for attr in ("grads_in_partition", "grad_partitions_flat_buffer"):
        buf = getattr(opt, attr, None)
        on_host = attr == "grad_partitions_flat_buffer" and getattr(opt, "offload_optimizer", False)
        if not on_host:
            device += sum(nbytes(b) for b in buf) if isinstance(buf, (list, tuple)) else nbytes(buf)
    masters = (getattr(opt, "single_partition_of_fp32_groups", None)          # ZeRO-1/2
               or getattr(opt, "fp32_partitioned_groups_flat", None) or [])   # ZeRO-3
    host += sum(nbytes(m) + nbytes(m.grad) for m in masters)
    if getattr(opt, "offload_optimizer", False):
        # ZeRO-3 with offload_optimizer: the gradient partitions are gathered into a host buffer
        host += nbytes(getattr(opt, "grad_partitions_flat_buffer", None))
    inner = opt.optimizer
    for state in inner.state.values():
        host += sum(nbytes(v) for k, v in state.items() if k != "step")
    return {"device": device, "host": host}


def main(mode: str, backend: str, out: str) -> None:
    import torch.distributed as dist

    from swiftlite.distributed import World, init_distributed
    from swiftlite.parallel.base import BackendChoice, build_engine, find_backend
    from swiftlite.parallel.deepspeed import ds_env_defaults

    deepspeed = backend.startswith("zero") or backend.endswith(".json")
    if deepspeed:
        ds_env_defaults()
        world = World.from_env()
    else:
        world = init_distributed()
    ds_json = backend if backend.endswith(".json") else None
    name = "deepspeed" if ds_json else backend
    cfg = make_cfg(name, ds_json)
    model = make_model()
    if mode == "autocast":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # counted before the engine is built: ZeRO-3 partitions the parameters in place
    result: dict = {"n_params": sum(p.numel() for p in model.parameters()),
                    "n_linear": sum(m.weight.numel() for n, m in model.named_modules()
                                    if isinstance(m, torch.nn.Linear) and not n.endswith("lm_head"))}
    rec = find_backend(name)
    choice = BackendChoice(name=rec.name, requested=name, deepspeed_source=ds_json or rec.ds_preset)
    engine = build_engine(model, cfg, world, STEPS, choice)
    engine.train()
    exits: list[tuple[int, int]] = []
    if mode == "autocast":
        autocast_cls = torch.amp.autocast_mode.autocast
        original_exit = autocast_cls.__exit__

        def exit_measured(self, *args):
            before = rss()["VmRSS"]
            value = original_exit(self, *args)
            exits.append((before, rss()["VmRSS"]))
            return value
        autocast_cls.__exit__ = exit_measured
    for step in range(STEPS):
        exits.clear()
        loss = engine.forward(batch(step))
        engine.backward(loss / SEQ)
        last = step == STEPS - 1
        if last and mode == "autocast":
            result["autocast_exits"] = list(exits)
            result["autocast_freed"] = max((b - a for b, a in exits), default=0)
        if last and mode == "step":
            before = rss()["VmRSS"]
            reset_peak()
            engine.step()
            result["step_rise"] = rss()["VmHWM"] - before
        else:
            engine.step()
    if mode == "offload":
        result.update(offload_split(engine))
    result["rank"] = world.rank
    Path(f"{out}.rank{world.rank}.json").write_text(json.dumps(result))
    if dist.is_initialized():
        dist.barrier()
        # leave no communication thread running into interpreter exit: once, under a loaded CI machine, a
        # ZeRO-3 offload rank aborted there ("terminate called without an active exception") after its
        # figures were written
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
