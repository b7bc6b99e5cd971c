"""The rules about where a run's rows come from besides --dataset and how they are read: ms-swift's
--cached_dataset and --cached_val_dataset (tokenized folders, data/cached.py) and --agent_template
(tool-calling rows, data/agent.py). Rules of config/rules.py's table, kept here
so that module stays short. Import-light (no torch)."""

from __future__ import annotations

from swiftlite.config.data_options import AGENT_TEMPLATES
from swiftlite.config.rule_table import rule
from swiftlite.config.schema import RunConfig
from swiftlite.config.tasks import task_spec


@rule("cached datasets")
def cached_datasets(c: RunConfig):
    d = c.data
    if not (d.cached_dataset or d.cached_val_dataset):
        return None
    flag = "--cached_dataset" if d.cached_dataset else "--cached_val_dataset"
    if task_spec(c.task).own_options is not None:
        return (f"{flag}: cached datasets hold sft or pt rows (`swiftlite export --to_cached_dataset true`); "
                f"`swiftlite {c.task}` reads its pairs or prompts from --dataset")
    if d.streaming:   # ms-swift: "Cached dataset does not support streaming."
        return f"{flag} with --streaming: cached rows are already tokenized, there is nothing to stream; drop --streaming"
    if d.lazy_tokenize:
        return f"{flag} with --lazy-tokenize: cached rows are already tokenized; drop --lazy-tokenize"
    if d.split_dataset_ratio > 0 and not d.dataset:
        return (f"--split-dataset-ratio {d.split_dataset_ratio} holds out --dataset rows, and there is no --dataset: "
                "give the export's validation folder to --cached_val_dataset")


@rule("agent template")
def agent_template(c: RunConfig):
    v = c.data.agent_template
    if v is None:
        return None
    if v not in AGENT_TEMPLATES:
        return (f"--agent_template {v}: not available; {', '.join(AGENT_TEMPLATES)} are (hermes: Qwen2.5's and Qwen3's "
                "tool format; react_en/react_zh/react_grpo: ReAct text); ms-swift's other agent templates write tool "
                "calls in their model's own syntax")
    rows = task_spec(c.task).own_options == "rlhf" and c.rlhf.rlhf_type in ("grpo", "gkd")   # prompts, sft rows
    if not task_spec(c.task).chat or (task_spec(c.task).own_options is not None and not rows):
        kind = f" --rlhf-type {c.rlhf.rlhf_type}" if task_spec(c.task).own_options == "rlhf" else ""
        return (f"--agent_template applies to tool-calling chat rows (sft, rlhf grpo and gkd); drop it from "
                f"`swiftlite {c.task}{kind}`")


@rule("response prefix")
def response_prefix(c: RunConfig):
    if not c.data.response_prefix or task_spec(c.task).own_options != "rlhf" or c.rlhf.rlhf_type != "grpo":
        return None
    return ("--response_prefix: GRPO's rollouts are generated from the chat template's generation prompt as it is; "
            "to start every completion with a text, put it into the template (--template chat.jinja)")
