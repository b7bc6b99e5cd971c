"""MuonClip, ms-swift's `--optimizer muonclip` (swift/optimizers/muonclip.py): Muon's orthogonalised
momentum for the matrices, momentum SGD for the rest, and QK-Clip, which shrinks the query and key
projections when the attention logits of the step grew past a threshold (Kimi K2's remedy for
exploding logits). The same parameter groups, update and defaults as ms-swift's, so a script's
--learning_rate and --optim_args mean the same; config/muonclip_options.py reads --optim_args.

What differs, and why:
- The step's largest attention logit is bounded as max|q| x max|k| x scale per layer (Cauchy-Schwarz),
  from forward hooks on each attention module's query and key (after q_norm/k_norm where the model has
  them; RoPE rotates pairs of coordinates, so the norms before it are the norms after). ms-swift takes
  the same bound under SDPA and flash attention by patching torch's functions for the whole process, and
  the exact maximum under eager attention; here it is the bound on every attention implementation, and
  nothing outside the model is patched.
- Only forwards that train count (module in training mode, gradients on): evaluation and GRPO's
  generation do not move the next step's clip (ms-swift's patch sees every forward).
- Each rank's bound is reduced to the maximum over ranks at the step, as ms-swift does.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from swiftlite.config import RunConfig

#: Newton-Schulz quintic coefficients of Moonlight's Muon, which ms-swift's MuonClip uses.
NS_COEFFS = (3.4445, -4.7750, 2.0315)
#: What makes a trainable tensor a query/key projection (ms-swift's _is_qk_name).
QK_NAMES = ("q_proj", "k_proj", ".wq", ".wk", "/wq", "/wk")


def orthogonalise(g: torch.Tensor, steps: int, eps: float = 1e-7) -> torch.Tensor:
    """Newton-Schulz iteration towards the nearest semi-orthogonal matrix of `g`, in bf16 as Moonlight's
    (and ms-swift's), on the wide orientation of the matrix; returned in g's dtype."""
    a, b, c = NS_COEFFS
    x = g.bfloat16() / (g.norm() + eps)
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.T if tall else x).to(g.dtype)


class LogitBound:
    """The largest attention logit of the training forwards since the last step, bounded per layer as
    max over tokens and heads of |q| times that of |k|, times the attention's scale. Forward hooks on
    each attention module's query and key outputs (attention modules: those with q_proj and k_proj)."""

    def __init__(self, model: torch.nn.Module):
        self.peak: torch.Tensor | None = None
        self.handles = []
        self.layers = 0
        for attn in model.modules():
            if not (hasattr(attn, "q_proj") and hasattr(attn, "k_proj")):
                continue
            head_dim = getattr(attn, "head_dim", None)
            if not head_dim:
                continue
            scale = float(getattr(attn, "scaling", head_dim ** -0.5))
            seen: dict[str, torch.Tensor] = {}
            for side in ("q", "k"):
                # after the per-head norm where the model has one (Qwen3's q_norm/k_norm): what the logits use
                module = getattr(attn, f"{side}_norm", None) or getattr(attn, f"{side}_proj")
                self.handles.append(module.register_forward_hook(self._hook(side, seen, head_dim, scale)))
            self.layers += 1

    def _hook(self, side: str, seen: dict, head_dim: int, scale: float):
        def hook(module, args, output):
            if not (module.training and torch.is_grad_enabled()):
                return
            out = output[0] if isinstance(output, tuple) else output
            norms = out.detach().float().reshape(-1, head_dim).norm(dim=-1).max()
            seen[side] = norms
            if len(seen) == 2:
                bound = seen.pop("q") * seen.pop("k") * scale
                self.peak = bound if self.peak is None else torch.maximum(self.peak, bound)
        return hook

    def consume(self) -> float | None:
        """The bound over the forwards since the last call, the maximum over ranks; None when no
        training forward ran on any rank. Every rank calls it at each step (a collective)."""
        import torch.distributed as dist
        peak, self.peak = self.peak, None
        if dist.is_available() and dist.is_initialized():
            device = peak.device if peak is not None else _collective_device()
            t = peak.reshape(1) if peak is not None else torch.full((1,), -math.inf, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            peak = t[0]
        if peak is None:
            return None
        v = float(peak)
        return None if v == -math.inf else v

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def _collective_device() -> torch.device:
    import torch.distributed as dist
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class MuonClip(torch.optim.Optimizer):
    """ms-swift's MuonClip update. Per parameter, with momentum buffer m += grad (m = mu m + grad):
    the update is orthogonalise(m) x sqrt(max(rows, cols)) x rms_scale_factor for a matrix of a Muon
    group (the RMS of AdamW's update, so the learning rate means AdamW's), m itself otherwise;
    Nesterov adds grad + mu x update; decoupled weight decay p *= 1 - lr x wd; then, in the query/key
    group, when the step's logit bound exceeds qk_clip_tau, both p and the update are scaled by
    sqrt(tau / bound); finally p -= lr x update. The step counter is a tensor (checkpoint formats
    keep tensors)."""

    def __init__(self, groups: list[dict], *, lr: float, bound: LogitBound | None, **settings):
        super().__init__(groups, dict(lr=lr, **settings))
        self.bound = bound

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        peak = self.bound.consume() if self.bound is not None else None
        for group in self.param_groups:
            lr, mu, wd = float(group["lr"]), float(group["momentum"]), float(group["weight_decay"])
            clip = None
            if group["is_qk"] and group["qk_clip_enabled"] and peak is not None and peak > group["qk_clip_tau"]:
                clip = math.sqrt(group["qk_clip_tau"] / peak)
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                    state["step"] = torch.zeros((), dtype=torch.float32)
                buf = state["momentum_buffer"]
                state["step"] += 1
                buf.mul_(mu).add_(p.grad)
                if group["apply_muon"] and p.ndim >= 2:
                    update = orthogonalise(buf, group["newton_schulz_steps"]) * (
                        math.sqrt(max(p.shape[0], p.shape[1])) * group["rms_scale_factor"])
                else:
                    update = buf
                if group["nesterov"]:
                    update = p.grad.add(update, alpha=mu)
                if wd:
                    p.mul_(1 - lr * wd)
                if clip is not None:
                    p.mul_(clip)
                    update = update * clip
                p.add_(update, alpha=-lr)
        return loss


def build(model: torch.nn.Module, cfg: "RunConfig") -> MuonClip:
    """MuonClip over the trainable parameters in ms-swift's groups: the query/key matrices, the other
    matrices (both Muon; the input embedding and the output head excluded), and the rest (momentum
    SGD); every group with the weight decay of --optim_args or --weight_decay. The logit bound's hooks
    are attached to `model` when the clip is on."""
    from swiftlite.config.muonclip_options import muonclip_args
    from swiftlite.errors import UserError
    args = muonclip_args(cfg.optim.optim_args)
    wd = args.pop("weight_decay")
    settings = dict(args, weight_decay=cfg.optim.weight_decay if wd is None else wd)
    qk, other, rest = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim >= 2 and "embed_tokens" not in name and "lm_head" not in name:
            (qk if any(k in name.lower() for k in QK_NAMES) else other).append(p)
        else:
            rest.append(p)
    groups = [dict(params=ps, apply_muon=muon, is_qk=is_qk) for ps, muon, is_qk in
              ((qk, True, True), (other, True, False), (rest, False, False)) if ps]
    bound = None
    if settings["qk_clip_enabled"]:
        bound = LogitBound(model)
        if not bound.layers:
            raise UserError("--optimizer muonclip: QK-Clip finds no attention module with q_proj and k_proj in this "
                            "model; add --optim_args qk_clip_enabled=false, or use --optim muon")
    return MuonClip(groups, lr=cfg.learning_rate, bound=bound, **settings)
