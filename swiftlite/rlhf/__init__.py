"""Preference training (`swiftlite rlhf --rlhf_type dpo|orpo|simpo|cpo|kto|rm`), docs/rlhf.md.

    data.py       pair formats (ms-swift messages + rejected_response, TRL chosen/rejected), tokenization,
                  collation (a pair's two sides in one micro-batch)
    loss.py       DPO (sigmoid, ipo, hinge; label smoothing, RPO), ORPO, SimPO, CPO from summed log-probs
    reference.py  per-sequence log-probs through the backend; the reference (adapter off, frozen copy,
                  precomputed table in checkpoints)
    frozen.py     the frozen reference copy, laid out like the policy without optimizer
    kto.py        KTO: unpaired rows with a label, the KL estimate from mismatched rows, its step
    rm.py         reward models: a one-output score head, the pairwise loss with a margin, its step
    step.py       the preference step and validation (sft's StepStats plus TRL's metric names)
    demo.py       the built-in preference task (reverse strings: right vs wrong)

train/tasks.py is where the trainer picks these for `rlhf`.
"""
