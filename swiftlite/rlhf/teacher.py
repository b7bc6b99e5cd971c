"""GRPO's teacher: on-policy distillation (`--teacher_model`; ms-swift's OPD-RL,
swift/rlhf_trainers/grpo_trainer.py `_postprocess_batch` and swift/rl_core/advantage.py).

A frozen teacher scores the policy's own sampled completions token by token. Per completion token t
(log-probs at --temperature, as the policy's own in the loss):

    A_t = A + coef x (log p_teacher(y_t) - log p_old(y_t))

A is the completion's reward advantage (rlhf/grpo_loss.advantages; 0 without --reward_funcs), coef
--teacher_kl_coef (ms-swift's default 1.0), p_old the policy that sampled the round: the signed
log-ratio is the k1 estimate of the reverse KL, used as a per-token reward (ms-swift's
`expand_advantage_to_per_token`). The loss is GRPO's with this [completions, tokens] advantage. The
logged `teacher_kl` is the k3 estimate exp(d) - d - 1 with d = log p_teacher - log p_old, the token mean
over the round's completions (ms-swift's monitoring metric: it falls as the student nears the teacher).

Which teacher (`setup_teacher`):
- --teacher_model naming the run's own --model, with LoRA/QLoRA: the policy's base with the adapter
  disabled, no second copy (ms-swift's "fixed teacher" rule);
- otherwise a frozen copy of the teacher, loaded like the policy and laid out by the run's backend
  (rlhf/frozen.py), or on a DeepSpeed run with --teacher_deepspeed by the teacher's own ZeRO config.

`check_teacher` (preflight, before any rank starts): the teacher resolves, and its vocabulary holds
every token id of the policy's (a teacher with another tokenizer scores other tokens; ms-swift
requires the same tokenizer too).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from swiftlite.config.rules_teacher import same_model
from swiftlite.errors import UserError


def check_teacher(cfg: Any) -> None:
    """The teacher resolves (a local folder: weights and no code of its own unless --trust-remote-code)
    and its vocabulary covers the policy's."""
    if cfg.rlhf.teacher_model is None or same_model(cfg):
        return
    from swiftlite.models.loading import model_config, resolve_model
    source = resolve_model(cfg.rlhf.teacher_model)
    source.check_folder(cfg.model.trust_remote_code)
    teacher = source.config(cfg.model.trust_remote_code, None)
    policy = model_config(cfg)
    tv, pv = getattr(teacher, "vocab_size", None), getattr(policy, "vocab_size", None)
    if tv is not None and pv is not None and tv < pv:
        raise UserError(f"--teacher-model {cfg.rlhf.teacher_model}: its vocabulary has {tv} tokens, the policy's "
                        f"{pv}: the teacher must share the policy's tokenizer (it scores the policy's token ids)")


def setup_teacher(run: Any) -> tuple[Callable[..., torch.Tensor] | None, str]:
    """(a callable (prompt_ids, prompt_mask, completion_ids, completion_mask) -> per-token teacher
    log-probs [B, C], what the teacher is in words), or (None, "") without --teacher_model."""
    from swiftlite.rlhf.generate import token_logps
    from swiftlite.rlhf.reference import adapters_disabled, peft_model, root_module
    cfg, engine = run.cfg, run.engine
    r = cfg.rlhf
    if r.teacher_model is None:
        return None, ""
    temp = r.temperature
    if same_model(cfg) and cfg.is_peft:
        peft = peft_model(engine.module)

        def base(*t: torch.Tensor) -> torch.Tensor:
            module, ctx = root_module(engine)
            with adapters_disabled(peft):
                return token_logps(module, *t, temp, ctx)[0]
        return base, "the base model with the adapter disabled"
    from swiftlite.rlhf.frozen import build_frozen
    frozen = build_frozen(run, model=r.teacher_model, teacher_deepspeed=r.teacher_deepspeed)
    return (lambda *t: token_logps(frozen.module, *t, temp, frozen.autocast())[0]), \
        f"a frozen copy of {r.teacher_model} ({frozen.layout})"


def logits_of(module: Any, ctx: Any, batch: dict) -> torch.Tensor:
    """The logits of a collated micro-batch (padded, or padding-free with position ids) through `module`
    under `ctx` (its engine's autocast)."""
    with ctx if ctx is not None else contextlib.nullcontext():
        out = module(**{k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch},
                     use_cache=False)
    return out.logits if hasattr(out, "logits") else out[0]


def teacher_module(run: Any) -> tuple[Callable[[dict], torch.Tensor], str]:
    """GKD's teacher (rlhf/gkd.py): (batch -> its logits, what the teacher is in words), the same teacher
    forms as `setup_teacher` but the whole next-token distributions (GKD compares them, GRPO's teacher
    scores the sampled tokens only). The batch is a collated sft micro-batch (padded or padding-free)."""
    from swiftlite.rlhf.reference import adapters_disabled, peft_model, root_module
    cfg, engine = run.cfg, run.engine
    if cfg.rlhf.teacher_model_server:   # its top-k log-probabilities (rlhf/teacher_server.py)
        from swiftlite.rlhf.teacher_server import ServerTeacher, wait_for_server
        url, k = cfg.rlhf.teacher_model_server, cfg.rlhf.gkd_logits_topk
        vocab = root_module(engine)[0].config.vocab_size
        return ServerTeacher(url, k, vocab, wait_for_server(url, 60.0)), \
            f"the teacher server {url} (its top {k} log-probabilities at each position)"
    if same_model(cfg) and cfg.is_peft:
        peft = peft_model(engine.module)

        def base(batch: dict) -> torch.Tensor:
            module, ctx = root_module(engine)
            with adapters_disabled(peft):
                return logits_of(module, ctx, batch)
        return base, "the base model with the adapter disabled"
    from swiftlite.rlhf.frozen import build_frozen
    frozen = build_frozen(run, model=cfg.rlhf.teacher_model, teacher_deepspeed=cfg.rlhf.teacher_deepspeed)
    return (lambda batch: logits_of(frozen.module, frozen.autocast(), batch)), \
        f"a frozen copy of {cfg.rlhf.teacher_model} ({frozen.layout})"


def token_advantages(adv: torch.Tensor, teacher: torch.Tensor, old: torch.Tensor, mask: torch.Tensor,
                     coef: float) -> torch.Tensor:
    """[B, T] advantages: each completion's `adv` [B] on its tokens plus coef x (teacher - old), zero
    outside `mask` (ms-swift's expand_advantage_to_per_token)."""
    m = mask.to(teacher.dtype)
    return (adv.to(teacher.dtype).unsqueeze(1) + coef * (teacher - old)) * m


def k3_sum(teacher: torch.Tensor, old: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """(sum over the masked tokens of exp(d) - d - 1, d = teacher - old; their count): `teacher_kl`'s
    parts, summed over micro-batches and ranks before dividing."""
    d = (teacher - old).masked_fill(~mask.bool(), 0.0)     # masked before exp, as ms-swift
    return float((torch.exp(d) - d - 1).sum()), float(mask.sum())


__all__ = ["check_teacher", "k3_sum", "setup_teacher", "logits_of", "teacher_module", "token_advantages"]
