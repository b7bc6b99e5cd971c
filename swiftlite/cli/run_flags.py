"""The flags of `sft` and `pt`, generated from the RunConfig fields (`swiftlite.config.field_specs`).

ms-swift's style: both `--max_length` and `--max-length`, lists as `--dataset a.jsonl b.jsonl`,
booleans as `--packing` or `--packing true`, JSON objects as `--gradient_checkpointing_kwargs '{...}'`.
A new config field is a new flag (and a line of `--help`) with no code here. ms-swift flags that mean
nothing here (config/msswift.py) are read like any flag and answered by `build_config`.
"""

from __future__ import annotations

from typing import Any

from swiftlite.errors import Refusals, UserError

IGNORED_FLAGS = {"--local_rank", "--local-rank"}  # appended by the DeepSpeed launcher
SHORTHANDS = {"--lora": ("train_type", "lora"), "--qlora": ("train_type", "qlora"),
              "--full": ("train_type", "full")}
TASK_HELP = {"sft": "Supervised fine-tuning on chat data.", "pt": "Continued pre-training on text.",
             "rlhf": "Preference training (--rlhf-type: DPO and its siblings on chosen/rejected pairs), GRPO "
                     "(--rlhf-type grpo) on prompts with reward functions, or GKD (--rlhf-type gkd) distilling a "
                     "teacher on sft rows (docs/rlhf.md)."}
FLAG_WIDTH = 36


def _flag_table() -> dict[str, Any]:
    from swiftlite.config import field_specs
    table: dict[str, Any] = {}
    for spec in field_specs().values():
        if spec.cli:
            for f in spec.flags:
                table[f] = spec
    return table


def _no_meaning_table() -> dict[str, Any]:
    from swiftlite.config.msswift import NO_MEANING
    return {f: e for e in NO_MEANING.values() for f in (f"--{e.name}", f"--{e.name.replace('_', '-')}")}


def _values(args: list[str], i: int, many: bool) -> tuple[list[str], int]:
    """The values after a flag, from args[i]: one, or (many) every token up to the next flag."""
    vals = []
    while i < len(args) and not (args[i].startswith("--") and len(args[i]) > 2):
        vals.append(args[i])
        i += 1
        if not many:
            break
    return vals, i


def parse_run_args(args: list[str], refusals: Refusals | None = None) -> tuple[str | None, dict[str, Any]]:
    """argv of `sft`/`pt`/`rlhf` -> (config file, flat overrides). Every refused or unknown flag of the
    command line is reported at once (one line each): ms-swift's options that swiftlite does not
    implement with their reason (config/msswift_unsupported.py), NO_MEANING values that do not fit,
    refused values, and unknown flags (a suggestion only for a misspelling of a swiftlite flag).
    Raised here, or, given `refusals` (the run's: errors.Refusals), added to them with the field each
    names, and the flags accepted returned, so that the later stages report theirs in the same run."""
    from swiftlite.config import FALSE_WORDS, TRUE_WORDS
    from swiftlite.config.msswift import APPENDS, appended, check_no_meaning, check_value
    from swiftlite.config.msswift_unsupported import misspelling_of, refusal
    table = _flag_table()
    no_meaning = _no_meaning_table()
    values: dict[str, Any] = {}
    problems = refusals if refusals is not None else Refusals()
    config_file = None
    i = 0
    while i < len(args):
        tok = args[i]
        if not tok.startswith("--"):
            raise UserError(f"unexpected argument {tok!r} (options start with --)")
        name, eq, inline = tok.partition("=")
        i += 1
        if name in IGNORED_FLAGS:
            if not eq and i < len(args) and not args[i].startswith("--"):
                i += 1
            continue
        if name == "--config":
            if eq:
                config_file = inline
            elif i < len(args):
                config_file, i = args[i], i + 1
            else:
                raise UserError("--config needs a file")
            continue
        if name in SHORTHANDS:
            key, val = SHORTHANDS[name]
            values[key] = val
            continue
        key = name[2:].replace("-", "_")
        if key in APPENDS:   # ms-swift's --custom_register_path: more --external_plugins (config/msswift.py)
            vals, i = ([inline], i) if eq else _values(args, i, True)
            if not vals:
                raise UserError(f"{name} needs a value")
            values.setdefault(key, []).extend(vals)
            continue
        spec = table.get(name)
        if spec is None and name in no_meaning:  # kept as given: accepted if it fits, else says why not
            entry = no_meaning[name]
            if eq:
                value: Any = inline
            elif entry.switch:
                if i < len(args) and args[i].lower() in TRUE_WORDS | FALSE_WORDS:
                    value, i = args[i], i + 1
                else:
                    value = True
            else:
                vals, i = _values(args, i, entry.many)
                if not vals:
                    raise UserError(f"{name} needs a value")
                value = vals if entry.many else vals[0]
            try:
                check_no_meaning(entry.name, value, "flags")
            except UserError as e:
                problems.add(e, (entry.name,))
            else:
                values[entry.name] = value
            continue
        if spec is None:
            if not eq:  # skip its values, so that the flags after it are read (and reported) too
                _, i = _values(args, i, True)
            why = refusal(name)
            if why is not None:
                problems.add(f"{name}: {why}")
                continue
            close = misspelling_of(name, list(table) + list(no_meaning) + ["--config", *SHORTHANDS])
            problems.add(f"unknown option {name}" + (f" (did you mean {close}?)" if close else ""))
            continue
        if spec.is_switch:
            if eq:
                values[spec.name] = inline
            elif i < len(args) and args[i].lower() in TRUE_WORDS | FALSE_WORDS | set(spec.choices):
                values[spec.name], i = args[i], i + 1
            else:
                values[spec.name] = True
            continue
        if eq:
            vals = [inline]
        else:
            vals, i = _values(args, i, spec.is_list)
        if not vals:
            raise UserError(f"{name} needs a value")
        values[spec.name] = vals if spec.is_list else vals[0]
        if not spec.is_list and not (spec.choices and vals[0] in spec.choices):
            try:
                check_value(spec.name, vals[0], "flags")  # --train_type adalora, --rlhf_type kto
            except UserError as e:
                problems.add(e, (spec.name,))
                del values[spec.name]
    if refusals is None:
        problems.raise_all()
    return config_file, appended(values)


def _shown_default(default: Any) -> str:
    """` [default: X]`, or nothing for an unset value (None, off, empty). 0 and 0.0 are shown:
    they are values (`0 in (None, False)` is true in Python, hence the identity tests)."""
    if default is None or default is False or default == [] or default == "":
        return ""
    if isinstance(default, (list, tuple)):
        default = " ".join(map(str, default))  # as it is typed: --target-modules all-linear
    return f" [default: {default}]"


def help_line(spec: Any) -> str:
    """One option of `sft --help`: flag, help, choices, default, other spellings."""
    flag = spec.flags[0] + ("" if spec.base_type is bool else " LIST" if spec.is_list else
                            " JSON" if spec.is_dict else " VALUE")
    choices = f" [choices: {', '.join(map(str, spec.choices))}]" if spec.choices else ""
    also = f" (also {', '.join(spec.aliases)})" if spec.aliases else ""
    return f"  {flag:<{FLAG_WIDTH}} {spec.help}{choices}{_shown_default(spec.default)}{also}"


def run_help(task: str) -> str:
    """`swiftlite sft --help` / `pt --help` / `rlhf --help`: every config field, by section."""
    from swiftlite.config import SECTIONS, field_specs
    from swiftlite.config.schema import section_classes
    from swiftlite.config.tasks import task_spec
    classes = section_classes()
    lines = [f"Usage: swiftlite {task} [OPTIONS]", "", TASK_HELP[task],
             "Every option also accepts its underscore spelling (--max_length = --max-length); ms-swift's "
             "flags mean what they mean there, and the ones that mean nothing here say what to use instead "
             "(docs/usage.md, \"ms-swift flags\").", "",
             f"  {'--config FILE':<{FLAG_WIDTH}} YAML or JSON with option values (flags override it)",
             f"  {'--lora / --qlora / --full':<{FLAG_WIDTH}} shorthands for --train-type"]
    specs = field_specs()
    for sec in SECTIONS:
        if sec == "rlhf" and task_spec(task).own_options != sec:
            continue  # rlhf's own options (config/rules.py refuses them elsewhere)
        lines.append(f"\n{sec}:")
        mine = [s for s in specs.values() if s.section == sec and s.cli]
        own = set(vars(classes[sec]).get("__annotations__", {}))
        # a section's own fields first, then those of its option mixins (config/*_options.py)
        lines += [help_line(s) for s in sorted(mine, key=lambda s: s.name not in own)]
    return "\n".join(lines)
