"""ms-swift's --sequence_parallel_size: a base of schema.ParallelConfig, kept here so schema.py stays
short. parallel/sequence.py does it; the rule below says where it runs. Import-light (no torch)."""

from __future__ import annotations

from dataclasses import dataclass

from swiftlite.config.access import Section, opt


@dataclass(kw_only=True)
class SequenceOptions(Section):
    sequence_parallel_size: int = opt(1, "Ulysses sequence parallelism (sft, pt, grpo): groups of N consecutive ranks "
                                      "share their rows, each rank holds 1/N of every sequence's tokens, and attention "
                                      "runs on all tokens for 1/N of the heads (two all-to-alls per layer); the "
                                      "data is split over world / N ranks. N divides the world size and the "
                                      "model's attention heads (docs/backends.md, \"Sequence parallelism\"). "
                                      "ms-swift's default, 1: off.")


def sequence_problem(c) -> str | None:
    """The rule (config/rules.py's table): where --sequence_parallel_size > 1 cannot run, whatever the world."""
    n = c.parallel.sequence_parallel_size
    if n < 1:
        return f"--sequence_parallel_size {n}: give 1 (off) or the number of ranks that share a sequence"
    if n == 1:
        return None
    from swiftlite.config.tasks import task_spec
    grpo = task_spec(c.task).own_options == "rlhf" and c.rlhf.rlhf_type == "grpo"
    if task_spec(c.task).own_options is not None and not grpo:
        what = f"--rlhf_type {c.rlhf.rlhf_type}" if task_spec(c.task).own_options == "rlhf" else f"`swiftlite {c.task}`"
        return (f"--sequence_parallel_size {n} with {what}: sequence parallelism is built for sft, pt and grpo "
                "(token losses); train this command without it")
    if grpo and c.rlhf.chord_sft_dataset:
        return (f"--sequence_parallel_size {n} with --chord_sft_dataset: CHORD's expert batches are not cut into "
                "slices; use one of them")
    if c.train.train_type == "longlora":
        return (f"--sequence_parallel_size {n} with --train_type longlora: S2-Attn groups the positions of whole rows; "
                "use one of them")
    if c.train.router_aux_loss_coef:
        return (f"--sequence_parallel_size {n} with --router_aux_loss_coef: the router's load-balancing loss would "
                "see one slice of each sequence; train without one of them")
    return None
