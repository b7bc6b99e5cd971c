"""GRPO's CHORD options (arXiv 2508.11408; ms-swift's `--chord_*`, swift/rlhf_trainers/args_mixin.py
GRPOArgumentsMixin, its names and defaults): an SFT loss on expert rows mixed into GRPO's with a
weight mu that follows a warmup and a cosine decay. A base of schema.RlhfConfig, kept here so that
schema.py stays short; rlhf/chord.py computes the loss, `chord_problem` (config/rules.py's GRPO rule)
says which values run. Import-light (no torch)."""

from __future__ import annotations

from dataclasses import dataclass

from swiftlite.config.access import Section, opt


@dataclass(kw_only=True)
class ChordOptions(Section):
    chord_sft_dataset: list[str] = opt(help="GRPO CHORD: the expert SFT dataset(s) (sft's formats); with it each "
                                       "micro-batch's loss is (1 - mu) x GRPO's + mu x the mean cross-entropy of a "
                                       "batch of its rows.", factory=list)
    chord_sft_per_device_train_batch_size: int | None = opt(None, "GRPO CHORD: expert rows per micro-batch and "
                                                            "process (required with --chord-sft-dataset).")
    chord_enable_phi_function: bool = opt(False, "GRPO CHORD: weight each expert token's loss by phi = p (1 - p), p "
                                          "its probability under the policy (CHORD-phi).")
    chord_mu_warmup_steps: int | None = opt(None, "GRPO CHORD: steps over which mu rises linearly from 0 to "
                                            "--chord-mu-peak (required).")
    chord_mu_decay_steps: int | None = opt(None, "GRPO CHORD: steps of mu's cosine decay from the peak to "
                                           "--chord-mu-valley (required).")
    chord_mu_peak: float | None = opt(None, "GRPO CHORD: mu's peak, in [0, 1] (required).")
    chord_mu_valley: float | None = opt(None, "GRPO CHORD: mu after the decay, in [0, 1] (required).")


#: The keys above (config/rules.py lists them among GRPO's own).
CHORD_KEYS = ("chord_sft_dataset", "chord_sft_per_device_train_batch_size", "chord_enable_phi_function",
              "chord_mu_warmup_steps", "chord_mu_decay_steps", "chord_mu_peak", "chord_mu_valley")
#: What a CHORD run must give (ms-swift has no defaults for them: None fails in its schedule).
CHORD_REQUIRED = ("chord_sft_per_device_train_batch_size", "chord_mu_warmup_steps", "chord_mu_decay_steps",
                  "chord_mu_peak", "chord_mu_valley")


def chord_problem(r: object, explicit: set[str] | frozenset[str]) -> str | None:
    """The CHORD options' rule: all of them with --chord_sft_dataset, in range; none without it."""
    if not r.chord_sft_dataset:
        given = [k for k in CHORD_KEYS if k in explicit]
        return (f"{', '.join('--' + k.replace('_', '-') for k in given)} applies to CHORD (--chord-sft-dataset): "
                "drop it or give the expert dataset") if given else None
    missing = [k for k in CHORD_REQUIRED if getattr(r, k) is None]
    if missing:
        return (f"--chord-sft-dataset needs {', '.join('--' + k.replace('_', '-') for k in missing)} (CHORD's "
                "batch size and mu schedule; ms-swift has no defaults for them)")
    checks = [("chord_sft_per_device_train_batch_size", r.chord_sft_per_device_train_batch_size >= 1),
              ("chord_mu_warmup_steps", r.chord_mu_warmup_steps >= 0),
              ("chord_mu_decay_steps", r.chord_mu_decay_steps >= 0),
              ("chord_mu_peak", 0.0 <= r.chord_mu_peak <= 1.0), ("chord_mu_valley", 0.0 <= r.chord_mu_valley <= 1.0)]
    for k, ok in checks:
        if not ok:
            return f"--{k.replace('_', '-')} {getattr(r, k)}: out of range"
    return None


__all__ = ["CHORD_KEYS", "CHORD_REQUIRED", "ChordOptions", "chord_problem"]
