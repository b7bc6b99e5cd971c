"""What each training command means to the layers below the trainer: the facts about `sft`, `pt` and
`rlhf` that the config rules, the data pipeline, the tokenizer loader, the planner and export need,
looked up by the command's name (`RunConfig.task`).

    spec = task_spec(cfg.task)
    spec.needs_chat_template    # rows are conversations rendered with the tokenizer's chat template
    spec.sequences_per_sample   # rlhf: a pair is two sequences (chosen, rejected) through the model

The trainer's side of a task (its data pipeline, batches, step, validation and engine setup) is
swiftlite/train/tasks.py, whose `TokenTask` and `PreferenceTask` carry these facts as `task.spec`.
They live here, not there, because of the layers: every package imports config, and the trainer's
side of a task imports data, rlhf and train, so a rule in config or a check in data that imported
train/tasks.py would close an import cycle. Pure data, no imports.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TaskSpec:
    name: str                          # the command: sft, pt, rlhf
    unit: str                          # what one sample is: "row" or "pair"
    sequences_per_sample: int          # sequences a sample puts through the model
    chat: bool                         # rows are conversations (chat template, --system); False: plain text
    own_options: str | None = None     # the RunConfig section only this command takes ("rlhf")

    @property
    def needs_chat_template(self) -> bool:
        """A tokenizer without a chat template cannot render this command's rows."""
        return self.chat

    @property
    def plain_text(self) -> bool:
        """Rows are plain text: every token is a target, no template, no system prompt (pt)."""
        return not self.chat


SPECS: dict[str, TaskSpec] = {
    "sft": TaskSpec("sft", unit="row", sequences_per_sample=1, chat=True),
    "pt": TaskSpec("pt", unit="row", sequences_per_sample=1, chat=False),
    # preference pairs are rendered with the chat template too (rlhf/data.py, data/tokenize.py)
    "rlhf": TaskSpec("rlhf", unit="pair", sequences_per_sample=2, chat=True, own_options="rlhf"),
}


def task_spec(name: str) -> TaskSpec:
    """The facts of command `name` (RunConfig.task)."""
    return SPECS[name]


def reward_model(cfg: "Any") -> bool:  # noqa: F821 (a RunConfig; nothing imported here)
    """The run trains a reward model (`rlhf --rlhf_type rm`): the causal LM's config with a sequence-
    classification head of one output (transformers' AutoModelForSequenceClassification, num_labels 1)
    instead of lm_head. Loading, LoRA and export read it; pure data like the specs."""
    return SPECS[cfg.task].own_options == "rlhf" and getattr(cfg.rlhf, "rlhf_type", None) == "rm"


__all__ = ["SPECS", "TaskSpec", "reward_model", "task_spec"]
