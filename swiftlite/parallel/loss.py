"""The training objective, computed the same way by every backend (docs/design.md, Numerics: Loss).

    loss_sum = token_loss_sum(module, batch, loss_options(cfg))   # engine.forward of every backend

`token_loss_sum` returns the SUM of the next-token cross-entropy over target tokens (labels shifted by
one, IGNORE = -100 excluded), in fp32; the trainer divides by the target tokens of the global batch.
With --enable-dft-loss (ms-swift's DFT) each token's term is weighted by its target's probability
exp(-loss), held constant, in every impl that has per-token losses (chunked, plain; the rules refuse
liger and cce, whose kernels return the sum only). Under a weighted --loss-scale (ms-swift's agent
scales, config/loss_scale.py) the batch carries each token's weight as "loss_scale" (not a model input),
and each target's term is multiplied by its weight (ms-swift's: the sum of weight x cross-entropy; the
trainer still divides by the number of targets); the same impls, the same refusal of liger and cce. With --router-aux-loss-coef (MoE models) the
model's router load-balancing loss is added, times the micro-batch's target tokens: divided by the
step's targets, each micro-batch's aux loss counts by its share of them (ms-swift's weighting).
`--loss-impl` picks how it is computed:

* ``chunked`` (default): only positions with a target get logits (the hidden states at label positions
  != IGNORE are gathered first: exact, and prompt tokens cost nothing), and the lm_head matmul and the
  loss run chunk by chunk (parallel/chunked_ce.py), so the [tokens x vocab] logits never exist.
* ``liger`` / ``cce``: the same gathered hidden states through Liger's fused linear cross-entropy or
  Apple's Cut Cross-Entropy (GPU kernels; optional extras swiftlite[liger] / swiftlite[cce]).
* ``plain``: the model's own forward (full logits), upcast to fp32, F.cross_entropy.

How the loss reaches a sharded lm_head. The loss must run where the backend has lm_head's weight whole:
* the CausalLM instance's `forward` is replaced (once, on the instance) by one that, when called with
  `swiftlite_labels=`, runs the decoder (`model.model(...)`) and then the loss; called without it,
  it is the original forward (generation, plain loss). The call enters through the root module, so
  FSDP2's root pre-forward (and FSDP1's root unit) has unsharded embeddings, norm and lm_head once per
  micro-batch, DDP sees an ordinary forward, and DeepSpeed's engine forward runs as usual;
* the loss itself is the forward of the lm_head module (its instance `forward` also dispatches on a
  keyword), so ZeRO-3's module hooks gather lm_head's weight once when it starts, release it when it
  ends, and gather it once more for its backward, the same collectives on every rank whatever its
  number of target tokens or chunks (a rank with no target still calls it once).
The chunked loss computes its gradients during its forward, so it never needs the weight again.
An lm_head that is not a plain dense Linear (LoRA on lm_head, modules_to_save, a quantized head) is
called once on the gathered target positions (logits for target tokens only, not chunked). A model
whose logits are not `lm_head(hidden)` (final-logit softcapping, logit scaling) uses the plain path.

Import-light: torch is imported inside the functions (the planner and the CLI import this module).
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from swiftlite.data.tokenize import IGNORE  # the label that marks a token without loss
from swiftlite.errors import UserError

if TYPE_CHECKING:
    import torch

#: --loss-impl values (the same tuple as the schema field's choices; a unit test keeps them equal).
LOSS_IMPLS = ("chunked", "liger", "cce", "plain")
DEFAULT_LOSS_IMPL = "chunked"
#: The chunked loss holds one [chunk x vocab] fp32 logits buffer at a time: about this many elements
#: (64 MiB), and never fewer rows than MIN_CHUNK_TOKENS (small matmuls are slow on CPUs).
CHUNK_LOGIT_ELEMENTS = 16 * 2**20
MIN_CHUNK_TOKENS = 128
#: impl -> (module to import, pip extra)
EXTRAS = {"liger": ("liger_kernel", "liger"), "cce": ("cut_cross_entropy", "cce")}
#: Config attributes under which a CausalLM's logits are not lm_head(hidden): such models use `plain`.
NOT_PLAIN_HEAD = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


@dataclass(frozen=True)
class LossOptions:
    impl: str = DEFAULT_LOSS_IMPL
    chunk_tokens: int = 0            # 0: auto (chunk_tokens_for)
    liger_kernels: bool = False      # --use-liger-kernel: Liger's RMSNorm/RoPE/SwiGLU
    dft: bool = False                # --enable-dft-loss: each token's loss x its target's probability
    router_aux: float = 0.0          # --router-aux-loss-coef: MoE load balancing, weighted by target tokens


def loss_options(cfg: Any) -> LossOptions:
    """The loss options of a RunConfig (defaults for configs without the fields)."""
    train = getattr(cfg, "train", None)
    return LossOptions(impl=getattr(train, "loss_impl", DEFAULT_LOSS_IMPL),
                       chunk_tokens=int(getattr(train, "loss_chunk_tokens", 0) or 0),
                       liger_kernels=bool(getattr(train, "use_liger_kernel", False)),
                       dft=bool(getattr(train, "enable_dft_loss", False)),
                       router_aux=float(getattr(train, "router_aux_loss_coef", 0.0) or 0.0))


def chunk_tokens_for(vocab: int, setting: int = 0) -> int:
    """Rows per chunk of the chunked loss: `setting` when > 0, else ~CHUNK_LOGIT_ELEMENTS / vocab."""
    if setting > 0:
        return setting
    return max(MIN_CHUNK_TOKENS, CHUNK_LOGIT_ELEMENTS // max(1, vocab))


# --------------------------------------------------------------------------------------------------
# Checks before any process starts


def _missing(module: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(module) is None


def check_loss_options(cfg: Any, *, cuda: bool | None = None) -> None:
    """One-line UserError for a loss option this machine cannot run: liger/cce (GPU kernels) on a CPU
    or without their package, --use-liger-kernel likewise, a bad --loss-chunk-tokens. Call it in the
    preflight (before any process starts). `cuda` defaults to torch.cuda.is_available()."""
    opts = loss_options(cfg)
    if opts.impl not in LOSS_IMPLS:
        raise UserError(f"--loss-impl {opts.impl!r}: choose from {', '.join(LOSS_IMPLS)}")
    if opts.chunk_tokens < 0:
        raise UserError(f"--loss-chunk-tokens must be >= 0 (0 = auto), got {opts.chunk_tokens}")
    wanted = [(f"--loss-impl {opts.impl}", *EXTRAS[opts.impl])] if opts.impl in EXTRAS else []
    if opts.liger_kernels:
        wanted.append(("--use-liger-kernel", *EXTRAS["liger"]))
    if not wanted:
        return
    if cuda is None:
        import torch
        cuda = torch.cuda.is_available()
    for flag, module, extra in wanted:
        if not cuda:
            raise UserError(f"{flag} runs GPU (Triton/CUDA) kernels and this run has no GPU: use "
                            f"--loss-impl chunked (exact, the default) on CPU")
        if _missing(module):
            raise UserError(f"{flag} needs the {module} package: pip install 'swiftlite[{extra}]'")


# --------------------------------------------------------------------------------------------------
# The loss


def token_loss_sum(module: "torch.nn.Module", batch: dict[str, "torch.Tensor"],
                   options: LossOptions | None = None) -> "torch.Tensor":
    """Summed next-token cross-entropy over target tokens, in fp32.

    A sum, not a mean: the trainer divides by the target tokens of the whole global batch, so the
    objective does not change with micro-batching or the number of ranks (docs/design.md, "Numerics").
    `module` is what the backend runs (a DDP/FSDP/DeepSpeed wrapper, a peft model or the CausalLM).
    """
    opts = options or LossOptions()
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "shift_labels", "loss_scale")}
    weights = batch.get("loss_scale")
    # A slice of a sequence-parallel batch (parallel/sequence.py) carries its targets already shifted:
    # position t's target is token t + 1 of the whole sequence, which may sit in the next slice.
    shifted = "shift_labels" in batch
    labels = batch["shift_labels"] if shifted else batch["labels"]
    head = _prepare(module, opts)
    if head is not None:
        out = module(**inputs, use_cache=False, swiftlite_labels=labels,
                     **({"swiftlite_shifted": True} if shifted else {}),
                     **({"swiftlite_weights": weights} if weights is not None else {}))
        return out.loss_sum
    return _plain(module, inputs, labels, opts.dft, opts.router_aux, weights, shifted)


def _plain(module: "torch.nn.Module", inputs: dict, labels: "torch.Tensor", dft: bool = False,
           router_aux: float = 0.0, weights: "torch.Tensor | None" = None, shifted: bool = False) -> "torch.Tensor":
    out = module(**inputs, use_cache=False, **({"output_router_logits": True} if router_aux else {}))
    logits = out.logits if hasattr(out, "logits") else out[0]
    cut = 0 if shifted else 1     # shifted: labels and weights are aligned with the positions already
    labels = labels[:, cut:]
    logits = logits[:, :logits.shape[1] - cut].float()
    loss = _ce_sum(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), dft,
                   None if weights is None else weights[:, cut:].reshape(-1))
    if router_aux:
        loss = loss + router_aux * out.aux_loss.float() * (labels != IGNORE).sum()
    return loss


def router_aux_loss(lm: Any, router_logits: Any, attention_mask: Any) -> "torch.Tensor":
    """The MoE model's own load-balancing loss (`load_balancing_loss_func` of its modeling module,
    with its number of experts and experts per token), as its forward computes `aux_loss`."""
    import sys
    fn = getattr(sys.modules[type(lm).__module__], "load_balancing_loss_func", None)
    conf = lm.config
    experts = getattr(lm, "num_experts", None) or getattr(conf, "num_experts", None) or \
        getattr(conf, "num_local_experts", None)
    top_k = getattr(lm, "num_experts_per_tok", None) or getattr(conf, "num_experts_per_tok", None)
    if fn is None or not experts or not top_k:
        raise UserError(f"--router-aux-loss-coef: {type(lm).__name__} has no router load-balancing loss "
                        "(not a transformers MoE model)")
    return fn(router_logits, experts, top_k, attention_mask)


def _ce_sum(logits: "torch.Tensor", targets: "torch.Tensor", dft: bool,
            weights: "torch.Tensor | None" = None) -> "torch.Tensor":
    """Summed cross-entropy (IGNORE excluded); `dft`: each token's loss times exp(-loss), detached
    (ms-swift's DFT: the target's probability as a constant weight); `weights`: each token's loss times
    its --loss-scale weight."""
    import torch
    import torch.nn.functional as F
    if not dft and weights is None:
        return F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="sum")
    per_token = F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="none")
    if dft:
        per_token = per_token * torch.exp(-per_token.detach())
    if weights is not None:
        per_token = per_token * weights.to(per_token.device, torch.float32)
    return per_token.sum()


@dataclass
class _Head:
    """What the replaced forward of one CausalLM needs (kept on the instance as `_swiftlite_head`);
    `impl` and `chunk` follow the latest call."""
    decoder: Any
    fused: bool       # lm_head is a plain dense Linear, whose replaced forward computes the loss
    original: Any     # the CausalLM's own forward (a function taking the instance first)
    impl: str = DEFAULT_LOSS_IMPL
    chunk: int = 0
    dft: bool = False
    router_aux: float = 0.0


_STATE = "_swiftlite_head"
_ROOTS: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()   # root -> weakref(CausalLM)


def _NO_LM() -> None:  # the cached answer for a root without a transformers CausalLM (plain loss)
    return None


def find_causal_lm(module: "torch.nn.Module") -> Any:
    """The transformers CausalLM inside `module` (through DDP/FSDP/DeepSpeed/peft wrappers), or None."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover
        return None
    for m in module.modules():
        if isinstance(m, PreTrainedModel) and m.get_output_embeddings() is not None:
            return m
    return None


def _plain_head_reason(lm: Any) -> str | None:
    """Why this CausalLM's logits are not lm_head(decoder(...)), or None."""
    conf = getattr(lm, "config", None)
    for attr in NOT_PLAIN_HEAD:
        for v in (getattr(conf, attr, None), getattr(lm, attr, None)):
            if v is not None and v is not False and v != 1:
                return f"{type(lm).__name__} applies {attr} to its logits"
    decoder = getattr(lm, getattr(lm, "base_model_prefix", "model"), None)
    if decoder is None or decoder is lm:
        return f"{type(lm).__name__} has no separate decoder module"
    return None


def _prepare(module: "torch.nn.Module", opts: LossOptions) -> _Head | None:
    """Find the CausalLM once per root module, apply Liger's kernels when asked, and (for every impl but
    plain, on models whose logits are lm_head(hidden)) install the loss-computing forwards."""
    if opts.impl not in LOSS_IMPLS:
        raise UserError(f"--loss-impl {opts.impl!r}: choose from {', '.join(LOSS_IMPLS)}")
    ref = _ROOTS.get(module)
    lm = ref() if ref is not None else None
    if lm is None:
        if ref is _NO_LM:
            return None
        lm = find_causal_lm(module)
        _ROOTS[module] = weakref.ref(lm) if lm is not None else _NO_LM
        if lm is None:
            return None
    if opts.liger_kernels and not lm.__dict__.get("_swiftlite_liger"):
        apply_liger_kernels(lm)
        object.__setattr__(lm, "_swiftlite_liger", True)
    if opts.impl == "plain":
        return None
    if _STATE not in lm.__dict__:
        object.__setattr__(lm, _STATE, None if _plain_head_reason(lm) else _install(lm))
    state = lm.__dict__[_STATE]
    if state is None:
        return None
    state.impl = opts.impl
    state.chunk = opts.chunk_tokens
    state.dft = opts.dft
    state.router_aux = opts.router_aux
    return state


def _is_dense_linear(head: Any) -> bool:
    import torch
    return (isinstance(head, torch.nn.Linear) and type(head).forward is torch.nn.Linear.forward
            and head.weight.dtype.is_floating_point)


def _install(lm: Any) -> _Head:
    import types
    bound = lm.forward
    original = bound.__func__ if getattr(bound, "__self__", None) is lm else (lambda _self, *a, **k: bound(*a, **k))
    head = lm.get_output_embeddings()
    state = _Head(decoder=getattr(lm, getattr(lm, "base_model_prefix", "model")), fused=_is_dense_linear(head),
                  original=original)
    lm.forward = types.MethodType(_causal_lm_forward, lm)
    if state.fused:
        head.forward = types.MethodType(_head_forward, head)
    return state


def _causal_lm_forward(self: Any, *args: Any, swiftlite_labels: "torch.Tensor | None" = None,
                       swiftlite_weights: "torch.Tensor | None" = None, swiftlite_shifted: bool = False,
                       **kwargs: Any):
    """The CausalLM's forward: its original one, or (with swiftlite_labels) decoder + summed loss
    (`swiftlite_weights`: each token's --loss-scale weight, aligned with the labels)."""
    state = self.__dict__[_STATE]
    if swiftlite_labels is None:
        return state.original(self, *args, **kwargs)
    for k in ("labels", "logits_to_keep", "return_dict", "use_cache", "num_items_in_batch"):
        kwargs.pop(k, None)
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    if state.router_aux:
        kwargs["output_router_logits"] = True
    out = state.decoder(*args, use_cache=False, **kwargs)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    cut = 0 if swiftlite_shifted else 1   # shifted: labels aligned with the positions (sequence parallel)
    labels = swiftlite_labels[:, cut:]
    keep = labels != IGNORE
    h = hidden[:, :hidden.shape[1] - cut][keep]   # [targets, H]: only positions that have a target
    y = labels[keep]
    w = None if swiftlite_weights is None else swiftlite_weights[:, cut:][keep].float()
    if state.fused:
        loss = self.get_output_embeddings()(h, swiftlite_targets=y, swiftlite_impl=state.impl,
                                            swiftlite_chunk=state.chunk, swiftlite_dft=state.dft,
                                            **({"swiftlite_weights": w} if w is not None else {}))
    else:
        loss = _ce_sum(self.get_output_embeddings()(h).float(), y, state.dft, w)
    if state.router_aux:   # ms-swift's weighting: the micro-batch's share of the step's target tokens
        aux = router_aux_loss(self, out.router_logits, kwargs.get("attention_mask"))
        loss = loss + state.router_aux * aux.float() * y.numel()
    return _summed_loss_class()(loss_sum=loss)


@functools.cache
def _summed_loss_class() -> type:
    from dataclasses import dataclass

    from transformers.utils import ModelOutput

    @dataclass
    class SummedLoss(ModelOutput):
        """The summed token loss of a swiftlite_labels forward. Not named `loss`: that is HF's mean,
        which wrappers add to (peft's AdaLoraModel.forward adds its orthogonal penalty to any `loss`
        the model returns; swiftlite applies it once per optimizer step, train/adalora.py)."""
        loss_sum: Any = None

    return SummedLoss   # built on first use: transformers stays out of import time


def _head_forward(self: Any, hidden: "torch.Tensor", *, swiftlite_targets: "torch.Tensor | None" = None,
                  swiftlite_impl: str = DEFAULT_LOSS_IMPL, swiftlite_chunk: int = 0, swiftlite_dft: bool = False,
                  swiftlite_weights: "torch.Tensor | None" = None):
    """lm_head's forward: the Linear, or (with swiftlite_targets) the summed loss of those targets.
    Running as this module's forward is what gives ZeRO-3 the gathered weight (module docstring)."""
    import torch
    if swiftlite_targets is None:
        return torch.nn.Linear.forward(self, hidden)
    w, b, y = self.weight, self.bias, swiftlite_targets
    if swiftlite_impl == "chunked":
        from swiftlite.parallel.chunked_ce import linear_cross_entropy_sum
        return linear_cross_entropy_sum(hidden, w, b, y, chunk_tokens_for(w.shape[0], swiftlite_chunk),
                                        dft=swiftlite_dft, weights=swiftlite_weights)
    if swiftlite_weights is not None:   # the rules refuse it before launch (config/rules_targets.py)
        raise UserError(f"--loss-impl {swiftlite_impl} returns the summed loss only; a weighted --loss-scale "
                        "needs each token's: use --loss-impl chunked or plain")
    if swiftlite_impl in EXTRAS and not y.numel():  # no target on this rank: a zero still tied to the weight
        return torch.nn.Linear.forward(self, hidden).float().sum()
    if swiftlite_impl == "liger":
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
        out = liger_fused_linear_cross_entropy(hidden, w, y, bias=b, ignore_index=IGNORE, reduction="sum")
        return (out[0] if isinstance(out, tuple) else out).float()
    if swiftlite_impl == "cce":
        from cut_cross_entropy import linear_cross_entropy
        return linear_cross_entropy(hidden, w, y, bias=b, ignore_index=IGNORE, reduction="sum").float()
    raise UserError(f"--loss-impl {swiftlite_impl!r}: choose from {', '.join(LOSS_IMPLS)}")


def apply_liger_kernels(lm: Any) -> None:
    """--use-liger-kernel: Liger's RMSNorm, RoPE and SwiGLU on this CausalLM instance (the loss stays
    --loss-impl's). Needs a GPU and liger-kernel (check_loss_options says so before launch)."""
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
    except ImportError:
        raise UserError("--use-liger-kernel needs the liger_kernel package: pip install 'swiftlite[liger]'") from None
    _apply_liger_kernel_to_instance(model=lm, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False)


__all__ = ["CHUNK_LOGIT_ELEMENTS", "DEFAULT_LOSS_IMPL", "LOSS_IMPLS", "LossOptions", "apply_liger_kernels",
           "check_loss_options", "chunk_tokens_for", "find_causal_lm", "loss_options", "token_loss_sum"]
