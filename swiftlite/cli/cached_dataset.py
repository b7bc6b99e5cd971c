"""`swiftlite export --to_cached_dataset true ...`: tokenize a dataset once and write it as a cached
dataset (data/cached.py) that `swiftlite sft|pt --cached_dataset DIR/train --cached_val_dataset
DIR/val` read instead of tokenizing, as ms-swift's `swift export --to_cached_dataset true`.

Its options are the run's data options, parsed by the run's own flag table and rules, so a flag
means here what it means to `swiftlite sft`: --model (its tokenizer only, no weights are read),
--dataset, --val_dataset, --split_dataset_ratio, --max_length, --truncation_strategy, --loss_scale (a
weighted one's weights are written as the `loss_scale` column, ms-swift's), --agent_template, --template,
--system, ... ms-swift's `--use_chat_template false` makes pt rows (every token a
target, no template), otherwise the rows are sft's. Any other run option would do nothing here: it
is refused with that reason. The rows are the ones the run would make (data.pipeline.spec_tokenizer),
unpacked: --packing belongs to the training run.
"""

from __future__ import annotations

from pathlib import Path

from swiftlite.errors import UserError

SPELLINGS = ("--to_cached_dataset", "--to-cached-dataset")
TRUE, FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")

#: The run options that decide a cached folder's rows (config field names); any other is refused.
DATA_OPTIONS = frozenset({
    "model", "model_revision", "trust_remote_code", "template", "system", "enable_thinking", "new_special_tokens",
    "max_length", "truncation_strategy", "loss_scale", "is_binary_loss_scale", "agent_template", "dataset", "val_dataset", "split_dataset_ratio",
    "dataset_num_proc", "columns", "model_name", "model_author", "seed", "skip_bad_rows", "load_from_cache_file",
    "output_dir"})


def _switch(args: list[str], names: tuple[str, ...]) -> tuple[str | None, list[str]]:
    """(the value of a switch given bare, `--f v` or `--f=v`, or None; args without it)."""
    out, value, i = [], None, 0
    while i < len(args):
        name, eq, v = args[i].partition("=")
        if name in names:
            if eq:
                value = v
            elif i + 1 < len(args) and not args[i + 1].startswith("--"):
                value, i = args[i + 1], i + 1
            else:
                value = "true"
        else:
            out.append(args[i])
        i += 1
    return value, out


def _on(flag: str, value: str) -> bool:
    if value.strip().lower() in TRUE:
        return True
    if value.strip().lower() in FALSE:
        return False
    raise UserError(f"{flag}: expected true or false, got {value!r}")


def requested(args: list[str]) -> bool:
    """Whether this export command line asks for a cached dataset."""
    value, _ = _switch(args, SPELLINGS)
    return value is not None and _on("--to_cached_dataset", value)


def export_cached(args: list[str]) -> int:
    """Tokenize, split and write OUT/train (and OUT/val); every refusal at once, nothing written."""
    from swiftlite.cli.run_flags import parse_run_args
    from swiftlite.config import field_reads, load_config
    from swiftlite.errors import Refusals
    _, args = _switch(args, SPELLINGS)
    chat, args = _switch(args, ("--use_chat_template", "--use-chat-template"))
    mode, args = _switch(args, ("--template_mode", "--template-mode"))
    refused = Refusals(watch=field_reads)
    task = "sft"
    if chat is not None:
        task = "sft" if refused.check(_on, "--use_chat_template", chat) is not False else "pt"
    if mode is not None and mode != "train":
        refused.add(f"--template_mode {mode}: cached datasets hold sft or pt rows (train); rlhf and kto read their "
                    "pairs from --dataset")
    config_file, values = parse_run_args(args, refused)
    cfg = load_config(config_file, values, task=task, refusals=refused)
    if "output_dir" not in cfg.explicit:
        refused.add("--to_cached_dataset: pass --output_dir (the folder to write: OUT/train, OUT/val)")
    for key in sorted(set(cfg.explicit) - DATA_OPTIONS):
        refused.add(f"--{key}: an option of the training run; `swiftlite export --to_cached_dataset true` only "
                    "tokenizes (its options: the data's and --model's tokenizer): drop the flag", (key,))
    if cfg.data.cached_dataset or cfg.data.cached_val_dataset:
        refused.add("--cached_dataset: the rows to cache come from --dataset / --val_dataset")
    out = Path(cfg.train.output_dir).expanduser()
    if out.exists() and any(out.iterdir()):
        refused.add(f"--output_dir {cfg.train.output_dir}: exists and is not empty; pass a new folder", ("output_dir",))
    from swiftlite.data.sources import check_spec
    for flag, specs in (("--dataset", cfg.data.dataset), ("--val-dataset", cfg.data.val_dataset)):
        for spec in specs:
            refused.check(check_spec, spec, flag)
    from swiftlite.models.loading import load_tokenizer, model_defaults, resolve_model
    source = None if refused.blocked(("model",)) else refused.check(resolve_model, cfg.model.model, about=("model",))
    refused.raise_all()
    from swiftlite.job import concrete_config
    dtype, max_length, _ = model_defaults(cfg, source)
    run = concrete_config(cfg, dtype, max_length)
    tokenizer = load_tokenizer(run, source)
    from swiftlite.config.tasks import task_spec
    from swiftlite.data import cached
    from swiftlite.data.pipeline import spec_tokenizer, train_and_validation
    tok, sc = spec_tokenizer(run, tokenizer)
    train, val = train_and_validation(run.data, tok, run.train.seed)
    if sc is not None:
        sc.check_used([*run.data.dataset, *run.data.val_dataset],
                      train.stats.self_cognition + (val.stats.self_cognition if val is not None else 0))
    chat_rows = task_spec(run.task).chat
    meta = {"task": run.task, "rows": cached.rows_kind(chat_rows), "model": run.model.model,
            "tokenizer": cached.tokenizer_fingerprint(tokenizer, chat_rows),
            "max_length": run.data.max_length, "truncation_strategy": run.data.truncation_strategy,
            "loss_scale": run.data.loss_scale, "is_binary_loss_scale": run.data.is_binary_loss_scale,
            "agent_template": run.data.agent_template, "template": run.model.template, "dataset": list(run.data.dataset)}
    out.mkdir(parents=True, exist_ok=True)
    for name, part in (("train", train), ("val", val)):
        if part is None:
            continue
        cached.write(out / name, part, {**meta, "split": name})
        flag = "--cached_dataset" if name == "train" else "--cached_val_dataset"
        print(f"{name}: {len(part.rows)} rows -> {out / name}  ({flag} {out / name})", flush=True)
    st = train.stats
    print(f"read {st.rows} rows: {st.truncated} truncated, {st.deleted} over --max_length {run.data.max_length} "
          f"deleted, {st.no_target} without a target, {len(st.skipped)} skipped", flush=True)
    return 0
