"""Chunked linear cross-entropy in plain PyTorch: the lm_head matmul and the loss, chunk by chunk.

    loss = linear_cross_entropy_sum(hidden, weight, bias, targets, chunk_tokens)
    # == F.cross_entropy(F.linear(hidden, weight, bias).float(), targets, reduction="sum")

`hidden` holds only the positions that have a target ([N, H], gathered by the caller), `targets` their
labels ([N]). The [N x V] logits never exist at once: each chunk of `chunk_tokens` rows computes its
logits ([chunk x V], upcast to fp32), its log-sum-exp, its loss, and at once its share of the gradients
(softmax - one-hot, then grad_hidden = g @ W and grad_weight += g^T @ h), and is freed. The gradients
are computed in the forward (as Liger's fused linear cross-entropy does) rather than by recomputing the
chunk's logits in the backward: the same memory (one chunk of logits, a [N x H] gradient instead of the
[N x H] saved input) and one lm_head-sized matmul fewer per chunk. The backward only scales them by
the incoming gradient. So the weight is needed only while the forward runs, which is what makes the
sharded backends simple (see loss.py). Under `torch.no_grad()` (validation) no gradient is computed.

Exactness: the loss is the fp32 log-sum-exp minus the target logit, summed in fp32; the gradients are
the analytic ones. Against the plain path (full logits, fp32 upcast, F.cross_entropy) the loss agrees
to fp32 rounding (tests/unit/test_loss.py: 1e-6 relative; gradients 1e-5).

Dtypes follow the plain path: the matmul runs in the weight's dtype (or autocast's, when active),
logits are upcast to fp32, the gradient of the logits is cast back to the matmul dtype for the two
gradient matmuls. The weight gradient is accumulated over chunks in fp32 and cast to the weight's dtype.
"""

from __future__ import annotations

import torch

__all__ = ["linear_cross_entropy_sum"]


class _ChunkedLinearCE(torch.autograd.Function):
    """forward(hidden [N,H], weight [V,H], bias [V] | None, targets [N], chunk) -> fp32 scalar."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk, need_h, need_w, need_b, dft=False,  # noqa: D401
                row_weights=None):
        n = hidden.shape[0]
        dtype = weight.dtype
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = (torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
                  if need_b and bias is not None else None)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        w_t = weight.t()
        for start in range(0, n, chunk):
            end = min(n, start + chunk)
            h = hidden[start:end]
            if h.dtype != dtype and not torch.is_autocast_enabled(h.device.type):
                h = h.to(dtype)
            y = targets[start:end]
            logits = torch.addmm(bias, h, w_t) if bias is not None else h @ w_t
            logits = logits.float()
            # log-sum-exp as torch.logsumexp computes it (max + log sum exp(x - max)), but in place:
            # one [chunk x V] fp32 buffer, which then becomes the softmax and the logits' gradient
            target_logit = logits.gather(1, y[:, None]).squeeze(1)
            m = logits.amax(dim=-1, keepdim=True)
            s = logits.sub_(m).exp_().sum(dim=-1, keepdim=True)
            row_loss = m.squeeze(1) + s.log().squeeze(1) - target_logit
            # DFT: each row's loss weighted by its target's probability exp(-loss), a constant; a
            # weighted --loss-scale: by the row's weight; both constants, so the gradient scales alike
            p = torch.exp(-row_loss) if dft else None
            if row_weights is not None:
                rw = row_weights[start:end].to(row_loss.device, torch.float32)
                p = rw if p is None else p * rw
            total += (row_loss * p).sum() if p is not None else row_loss.sum()
            if not (need_h or need_w or need_b):
                continue
            # d loss / d logits = softmax - one_hot(target) (DFT: times the row's constant weight)
            g = logits.div_(s)
            g[torch.arange(end - start, device=g.device), y] -= 1.0
            if p is not None:
                g.mul_(p[:, None])
            g_mm = g.to(h.dtype) if g.dtype != h.dtype else g
            if need_h:
                grad_h[start:end] = g_mm @ weight
            if need_w:  # in place, in fp32: no [V x H] temporary per chunk
                grad_w.addmm_(g.t(), h if h.dtype == torch.float32 else h.float())
            if grad_b is not None:
                grad_b.add_(g.sum(0))
            del logits, g, g_mm
        ctx.grads = (grad_h,
                     grad_w.to(weight.dtype) if grad_w is not None and weight.dtype != torch.float32 else grad_w,
                     grad_b.to(bias.dtype) if grad_b is not None and bias.dtype != torch.float32 else grad_b)
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grads = ctx.grads
        if grads is None:
            raise RuntimeError("the chunked cross-entropy's backward ran twice (its gradients are consumed)")
        ctx.grads = None  # drop the references, so that autograd can take the tensors over as .grad
        grad_h, grad_w, grad_b = (None if g is None else g.mul_(grad_out.to(g.dtype)) for g in grads)
        return grad_h, grad_w, grad_b, None, None, None, None, None, None, None


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             targets: torch.Tensor, chunk_tokens: int, dft: bool = False,
                             weights: torch.Tensor | None = None) -> torch.Tensor:
    """Summed cross-entropy of `targets` under logits = hidden @ weight.T + bias, in fp32, chunked over
    rows (`chunk_tokens` rows at a time). Every target must be a valid class (the caller drops ignored
    positions first). Differentiable in hidden, weight and bias. `dft`: each row's loss times its
    target's probability, held constant (--enable-dft-loss; ms-swift's DFT); `weights` ([N], constants):
    each row's loss times its weight (a weighted --loss-scale)."""
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be > 0, got {chunk_tokens}")
    grad = torch.is_grad_enabled()
    need_h = grad and hidden.requires_grad
    need_w = grad and weight.requires_grad
    need_b = grad and bias is not None and bias.requires_grad
    return _ChunkedLinearCE.apply(hidden, weight, bias, targets, int(chunk_tokens), need_h, need_w, need_b,
                                  bool(dft), None if weights is None else weights.detach())
