"""GKD's divergence between the student's and the teacher's next-token distributions (Agarwal et al. 2024,
"On-Policy Distillation of Language Models"; TRL's `GKDTrainer.generalized_jsd_loss`, ms-swift's
swift/rlhf_trainers/gkd_loss.py `jsd_loss`), per target position, both logits divided by --temperature:

    beta = 0:      KL(teacher || student)                   (forward KL)
    beta = 1:      KL(student || teacher)                   (reverse KL)
    0 < beta < 1:  beta KL(teacher || m) + (1 - beta) KL(student || m),  m = beta teacher + (1 - beta) student

(m mixes the probabilities, computed as a logsumexp of the log-probabilities). With --gkd_logits_topk k both
distributions are renormalised over the teacher's k most likely tokens at the position (ms-swift's top-k mode);
a teacher known only by those k (a teacher server's log-probabilities) is given as (values, token ids), [N, k]
each, never spread over the vocabulary.
Vocabularies of different sizes are aligned as ms-swift does: the shorter side's missing entries take the
other side's logits (so they cancel). Computed in fp32, `CHUNK` positions at a time, so one [CHUNK, V] set of
log-probabilities is alive at once. Import-light: torch only.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

#: positions whose log-softmax is taken at once
CHUNK = 512


def _kl(input_log: torch.Tensor, target_log: torch.Tensor) -> torch.Tensor:
    """KL(target || input) per row, from log-probabilities."""
    return (target_log.exp() * (target_log - input_log)).sum(-1)


def align_vocab(s: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad the narrower logits with the other's values at the extra ids (a teacher with a larger, padded
    embedding table: the extra entries then contribute nothing that differs)."""
    vs, vt = s.shape[-1], t.shape[-1]
    if vs < vt:
        s = torch.cat([s, t[..., vs:]], dim=-1)
    elif vt < vs:
        t = torch.cat([t, s[..., vt:]], dim=-1)
    return s, t


def jsd_sum(student: torch.Tensor, teacher: torch.Tensor | tuple[torch.Tensor, torch.Tensor], beta: float,
            temperature: float, topk: int | None = None) -> torch.Tensor:
    """The summed divergence over N positions: `student` [N, Vs] (with grad), `teacher` [N, Vt] logits, or
    the teacher's top-k alone as (log-probabilities, token ids), [N, k] each (`topk` is then theirs)."""
    if student.shape[0] == 0:
        return student.sum() * 0.0
    total = student.new_zeros((), dtype=torch.float32)
    for a in range(0, student.shape[0], CHUNK):
        if isinstance(teacher, tuple):      # the same as the dense top-k below, without the [N, V] teacher
            t, idx = teacher[0][a:a + CHUNK].float(), teacher[1][a:a + CHUNK]
            s = student[a:a + CHUNK].float().gather(-1, idx)
        else:
            s, t = align_vocab(student[a:a + CHUNK].float(), teacher[a:a + CHUNK].float())
        if topk is not None and not isinstance(teacher, tuple):
            t, idx = torch.topk(t, k=min(topk, t.shape[-1]), dim=-1)
            s = s.gather(-1, idx)
        s_log = F.log_softmax(s / temperature, dim=-1)
        t_log = F.log_softmax(t / temperature, dim=-1)
        if beta == 0:
            d = _kl(s_log, t_log)
        elif beta == 1:
            d = _kl(t_log, s_log)
        else:
            m = torch.logsumexp(torch.stack([s_log + math.log1p(-beta), t_log + math.log(beta)]), dim=0)
            d = beta * _kl(m, t_log) + (1 - beta) * _kl(m, s_log)
        total = total + d.sum()
    return total


__all__ = ["CHUNK", "align_vocab", "jsd_sum"]
