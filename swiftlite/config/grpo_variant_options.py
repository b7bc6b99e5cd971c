"""GRPO's variant options: two-sided clipping (--delta), DAPO's dynamic sampling (--dynamic_sample,
--max_resample_times), FIPO's influence weights (--loss_type fipo, --fipo_*) and the entropy options
(--top_entropy_quantile, --log_entropy: rlhf/entropy.py), with ms-swift's names and
defaults (swift/rlhf_trainers/args_mixin.py GRPOArgumentsMixin). A base of schema.RlhfConfig, kept here so
that schema.py stays short; rlhf/grpo_loss.py and rlhf/dynamic_sample.py use them, config/rules_grpo_variants.py
says which values run. Import-light (no torch)."""

from __future__ import annotations

from dataclasses import dataclass

from swiftlite.config.access import Section, opt


@dataclass(kw_only=True)
class GrpoVariantOptions(Section):
    delta: float | None = opt(None, "GRPO: two-sided clipping (INTELLECT-2): the unclipped term's ratio is capped "
                              "at delta, so a token with a negative advantage and a large ratio has a bounded loss; "
                              "> 1 + --epsilon-high. Default: off.")
    dynamic_sample: bool = opt(False, "GRPO: DAPO's dynamic sampling: a round's groups whose rewards are all equal "
                               "(std 0, no signal) are replaced by groups sampled for other prompts of the "
                               "training set, up to --max-resample-times times; when still too few groups have a "
                               "signal, the round keeps its own groups (ms-swift's rule).")
    max_resample_times: int = opt(3, "GRPO --dynamic-sample: the most resampling rounds per generation round.")
    fipo_decay_rate: float = opt(32.0, "GRPO --loss-type fipo: the half-life, in tokens, of the future KL's decay.")
    fipo_clip_range: float | None = opt(0.2, "GRPO --loss-type fipo: the influence weight is clamped to [1 - r, "
                                        "1 + r] ([1, 1 + r] with --fipo-clip-high-only); 0: no clamp.")
    fipo_clip_high_only: bool = opt(True, "GRPO --loss-type fipo: clamp the influence weight to [1, 1 + "
                                    "--fipo-clip-range] (never below 1).")
    fipo_safety_threshold: float | None = opt(4.0, "GRPO --loss-type fipo: a token with a negative advantage and a "
                                              "ratio above this keeps its influence weight within [0.8, 1].")
    top_entropy_quantile: float = opt(1.0, "GRPO: only the tokens whose entropy is in this top fraction of their "
                                      "micro-batch's completion tokens keep their policy term (the 80/20 rule of "
                                      "high-entropy tokens); 1: every token. Logs entropy/threshold.")
    log_entropy: bool = opt(False, "GRPO: also log the step's per-completion mean entropies (entropy/mean, "
                            "entropy/max, entropy/min); the token-mean `entropy` is logged every step anyway.")


#: The keys above (config/rules.py's GRPO_KEYS lists them).
FIPO_KEYS = ("fipo_decay_rate", "fipo_clip_range", "fipo_clip_high_only", "fipo_safety_threshold")
GRPO_VARIANT_KEYS = ("delta", "dynamic_sample", "max_resample_times", *FIPO_KEYS, "top_entropy_quantile",
                     "log_entropy")



def describe_variants(r: object) -> str:
    """What `--dry-run` and the run line add for these options (empty when none applies)."""
    out = ""
    if (r.loss_type or "grpo") == "fipo":
        clip = r.fipo_clip_range
        out += (f", FIPO weights (half-life {r.fipo_decay_rate:g} tokens"
                + (f", clamped to [{1.0 if r.fipo_clip_high_only else 1 - clip:g}, {1 + clip:g}]" if clip else "")
                + (f", safety threshold {r.fipo_safety_threshold:g}" if r.fipo_safety_threshold is not None else "")
                + ")")
    if r.delta is not None:
        out += f", unclipped ratio capped at {r.delta:g}"
    if r.dynamic_sample:
        out += f", dynamic sampling (up to {r.max_resample_times} resamples)"
    if r.top_entropy_quantile < 1.0:
        out += f", loss on the top {r.top_entropy_quantile:g} of tokens by entropy"
    return out


__all__ = ["FIPO_KEYS", "GRPO_VARIANT_KEYS", "GrpoVariantOptions", "describe_variants"]
