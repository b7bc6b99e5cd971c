"""The `swiftlite` command line.

`sft` and `pt` take ms-swift-style flags generated from the RunConfig fields (both `--max_length`
and `--max-length`, lists as `--dataset a.jsonl b.jsonl`, booleans as `--packing` or
`--packing true`), so a new config field is a new flag with no code here. The other commands are
plain Typer commands. Heavy imports (torch, transformers) happen inside commands: `--help` is fast.
Each command parses, builds a config, and calls one function.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

import typer

from swiftlite.errors import UserError

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="swiftlite: fine-tune LLMs with FSDP2, DeepSpeed ZeRO or DDP, and ship them.")

IGNORED_FLAGS = {"--local_rank", "--local-rank"}  # appended by the DeepSpeed launcher
SHORTHANDS = {"--lora": ("train_type", "lora"), "--qlora": ("train_type", "qlora"),
              "--full": ("train_type", "full")}


@app.callback()
def _root() -> None:
    """swiftlite: fine-tune LLMs with FSDP2, DeepSpeed ZeRO or DDP, and ship them."""


# -- sft / pt: flags from the config fields ------------------------------------------------------

def _flag_table() -> dict[str, Any]:
    from swiftlite.config import field_specs
    table: dict[str, Any] = {}
    for spec in field_specs().values():
        if spec.cli:
            for f in spec.flags:
                table[f] = spec
    return table


def parse_run_args(args: list[str]) -> tuple[str | None, dict[str, Any]]:
    """argv of `sft`/`pt` -> (config file, flat overrides). Unknown flags are errors naming them."""
    from swiftlite.config import FALSE_WORDS, TRUE_WORDS
    table = _flag_table()
    values: dict[str, Any] = {}
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
        spec = table.get(name)
        if spec is None:
            import difflib
            close = difflib.get_close_matches(name, list(table) + ["--config", *SHORTHANDS], n=1, cutoff=0.7)
            raise UserError(f"unknown option {name}" + (f" (did you mean {close[0]}?)" if close else ""))
        if spec.base_type is bool:
            if eq:
                values[spec.name] = inline
            elif i < len(args) and args[i].lower() in TRUE_WORDS | FALSE_WORDS:
                values[spec.name], i = args[i], i + 1
            else:
                values[spec.name] = True
            continue
        if eq:
            vals = [inline]
        else:
            vals = []
            while i < len(args) and not (args[i].startswith("--") and len(args[i]) > 2):
                vals.append(args[i])
                i += 1
                if not spec.is_list:
                    break
        if not vals:
            raise UserError(f"{name} needs a value")
        values[spec.name] = vals if spec.is_list else vals[0]
    return config_file, values


def _run_help(task: str) -> str:
    from swiftlite.config import SECTIONS, field_specs
    lines = [f"Usage: swiftlite {task} [OPTIONS]", "",
             ("Supervised fine-tuning on chat data." if task == "sft" else "Continued pre-training on text."),
             "Every option also accepts its underscore spelling (--max_length = --max-length).", "",
             "  --config FILE                YAML or JSON with option values (flags override it)",
             "  --lora / --qlora / --full    shorthands for --train-type"]
    specs = field_specs()
    for sec in SECTIONS:
        lines.append(f"\n{sec}:")
        for spec in specs.values():
            if spec.section != sec or not spec.cli:
                continue
            flag = spec.flags[0] + ("" if spec.base_type is bool else " LIST" if spec.is_list else " VALUE")
            extra = [a for a in spec.aliases]
            default = "" if spec.default in (None, [], False) else f" [default: {spec.default}]"
            lines.append(f"  {flag:<36} {spec.help}{default}" + (f" (also {', '.join(extra)})" if extra else ""))
    return "\n".join(lines)


def run_command(task: str, args: list[str]) -> int:
    """`swiftlite sft|pt ...`: validate, then launch or train here."""
    if any(a in ("--help", "-h") for a in args):
        print(_run_help(task))
        return 0
    from swiftlite import env
    from swiftlite.config import load_config
    config_file, values = parse_run_args(args)
    cfg = load_config(config_file, values, task=task)
    from swiftlite.parallel.base import load_plugins
    load_plugins(cfg.parallel.external_plugins)
    from swiftlite.launch import plan_launch, preflight, resolve_for_launch, run_forked, run_launched, run_rank
    plan = plan_launch(cfg, [task, *args])
    world = env.world_vars().world_size if env.inside_launcher() else plan.world_size
    # Everything that can be checked without a process group is checked here, once, before any
    # folder is created or any rank starts: a run that fails validation leaves nothing behind.
    if not env.settings().preflight_done:
        choice = preflight(cfg, world, data=not cfg.parallel.dry_run and not env.inside_launcher())
    else:
        choice = None
    if cfg.parallel.dry_run:
        print_plan(cfg, plan, choice or resolve_for_launch(cfg, world))
        return 0
    if plan.fork:
        return run_forked(plan, cfg)
    if plan.command is not None:
        return run_launched(plan, cfg)
    run_rank(cfg)
    return 0


def print_plan(cfg: Any, plan: Any, choice: Any) -> None:
    """--dry-run: the resolved backend (the same `resolve_backend` answer the trainer gets), world,
    batch arithmetic and launch command."""
    import shlex
    world = plan.world_size
    backend = choice.name
    reason = f" ({choice.reason})" if choice.reason else ""
    t = cfg.train
    print(f"backend:        {backend}{reason}")
    if choice.deepspeed_source:
        print(f"deepspeed:      {choice.deepspeed_source}")
    print(f"world:          {plan.nnodes} node(s) x {plan.nproc_per_node} process(es) = {world}")
    print(f"batch:          per-device {t.per_device_train_batch_size} x {world} x accumulation "
          f"{t.gradient_accumulation_steps} = global {t.per_device_train_batch_size * world * t.gradient_accumulation_steps}")
    print(f"model:          {cfg.model.model} ({cfg.train.train_type}, {cfg.model.torch_dtype})")
    print(f"output:         {cfg.train.output_dir}")
    from swiftlite.launch import redact_argv
    how = (shlex.join(redact_argv(plan.command)) if plan.command
           else f"{plan.nproc_per_node} processes forked from this one" if plan.fork else "this process")
    print("launch:         " + how)


_RUN_SETTINGS = {"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []}


@app.command("sft", context_settings=_RUN_SETTINGS, add_help_option=False)
def sft_cmd(ctx: typer.Context) -> None:
    """Supervised fine-tuning on chat data (see `swiftlite sft --help`)."""
    raise typer.Exit(run_command("sft", list(ctx.args)))


@app.command("pt", context_settings=_RUN_SETTINGS, add_help_option=False)
def pt_cmd(ctx: typer.Context) -> None:
    """Continued pre-training on text (see `swiftlite pt --help`)."""
    raise typer.Exit(run_command("pt", list(ctx.args)))


# -- other commands -------------------------------------------------------------------------------

@app.command("models")
def models_cmd() -> None:
    """List the built-in model presets."""
    from swiftlite.models.presets import PRESETS, param_count
    for p in PRESETS.values():
        n = param_count(p.config)
        size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
        src = "built-in (random init, shipped tokenizer)" if p.builtin else p.hub_id
        print(f"{p.name:<16} {size:>8}  {p.config['model_type']:<8} {src}  {p.description}".rstrip())


@app.command("estimate")
def estimate_cmd(
    model: str = typer.Option("tiny-llama", "--model", help="Preset name or local HF folder (config.json only)."),
    train_type: Optional[str] = typer.Option(None, "--train-type", "--train_type",
                                             help="full, lora or qlora (default full)."),
    lora: bool = typer.Option(False, "--lora", help="Shorthand for --train-type lora."),
    qlora: bool = typer.Option(False, "--qlora", help="Shorthand for --train-type qlora (a 4-bit base)."),
    gpus: int = typer.Option(1, "--gpus", "--nproc-per-node", "--nproc_per_node", help="GPUs per node."),
    nodes: int = typer.Option(1, "--nodes", "--nnodes", help="Number of nodes."),
    gpu_memory: str = typer.Option("80GB", "--gpu-memory", "--gpu_memory",
                                   help="Memory per GPU: 80GB (10^9 bytes), 24GiB (2^30); a bare number is GB."),
    cpu_memory: Optional[str] = typer.Option(None, "--cpu-memory", "--cpu_memory",
                                             help="CPU memory per node (same units); checks the offload rows "
                                                  "(default: reported, not checked)."),
    max_length: int = typer.Option(2048, "--max-length", "--max_length", help="Sequence length."),
    micro_batch: int = typer.Option(1, "--per-device-train-batch-size", "--per_device_train_batch_size",
                                    "--batch-size", help="Micro-batch per GPU."),
    gradient_checkpointing: bool = typer.Option(True, "--gradient-checkpointing/--no-gradient-checkpointing",
                                                help="Activation checkpointing."),
    dtype: str = typer.Option("bf16", "--torch-dtype", "--torch_dtype", "--dtype", help="bf16, fp16 or fp32."),
    lora_rank: int = typer.Option(8, "--lora-rank", "--lora_rank", help="LoRA rank (all-linear targets)."),
    quant_bits: Optional[int] = typer.Option(None, "--quant-bits", "--quant_bits",
                                             help="4 or 8: quantized base for LoRA (--qlora implies 4)."),
    external_plugins: Optional[list[str]] = typer.Option(
        None, "--external-plugins", "--external_plugins", metavar="FILE",
        help="Python file run first; it may register backends, which then get a row. Repeat for several."),
    as_json: bool = typer.Option(False, "--json", help="Print the decision and every estimate as JSON."),
) -> None:
    """Memory per GPU for each backend, what fits, and the recommended backend."""
    shorthands = [t for t, on in (("lora", lora), ("qlora", qlora)) if on]
    if len(shorthands) > 1 or (shorthands and train_type not in (None, shorthands[0])):
        given = [f"--{t}" for t in shorthands] + ([f"--train-type {train_type}"] if train_type else [])
        raise UserError(f"{' and '.join(given)}: pick one train type")
    from swiftlite.parallel.base import load_plugins
    load_plugins(external_plugins or [])
    from swiftlite.planner.render import render, run_estimate, to_json
    decision = run_estimate(model=model, train_type=(shorthands or [train_type or "full"])[0], gpus=gpus,
                            nodes=nodes, gpu_memory=gpu_memory, cpu_memory=cpu_memory, max_length=max_length,
                            micro_batch=micro_batch, gradient_checkpointing=gradient_checkpointing, dtype=dtype,
                            lora_rank=lora_rank, quant_bits=quant_bits)
    if as_json:
        print(to_json(decision))
    else:
        render(decision)


def main(argv: list[str] | None = None) -> int:
    """Entry point: one-line errors with exit code 2 for user mistakes, never a traceback."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] in ("sft", "pt"):
            # These parse their own flags (run_command); skipping Typer's parameter machinery
            # (which builds pydantic validators) saves ~0.3 s of start-up on every run and rank.
            return run_command(argv[0], argv[1:])
        from swiftlite import cli_extra
        cli_extra.register_all(app)
        rc = typer.main.get_command(app).main(args=argv, prog_name="swiftlite", standalone_mode=False)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `swiftlite ... | head`: the reader left; say nothing more (and let the interpreter's final
        # flush of stdout go nowhere instead of raising again).
        import os
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except Exception as e:
        # click's own usage errors (bad option value, missing argument): one line, exit 2
        if hasattr(e, "format_message") and hasattr(e, "exit_code"):
            if type(e).__name__ == "Exit":
                return e.exit_code
            if type(e).__name__ == "Abort":
                return 130
            print(f"error: {e.format_message()}", file=sys.stderr)
            return 2 if e.exit_code in (1, 2) else e.exit_code
        if type(e).__name__ == "Exit":
            return getattr(e, "exit_code", 0)
        raise
    return rc if isinstance(rc, int) else 0


if __name__ == "__main__":
    sys.exit(main())
