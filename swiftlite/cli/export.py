"""`swiftlite export`: its flags -> `swiftlite.export.ExportOptions` (the work is in swiftlite/export/,
imported when the command runs).

Flags follow ms-swift (`swift export --adapters CKPT --merge_lora true`): every multi-word flag has
both spellings (--max-shard-size and --max_shard_size); --adapters is --ckpt; a switch is given bare
(`--merge-lora`) or with a value (`--merge_lora true`, `--merge_lora=false`), as sft's booleans.
"""

from __future__ import annotations

import sys
from typing import Optional

import typer
import typer.core

from swiftlite.errors import UserError

TRUE, FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


class _SwitchCommand(typer.core.TyperCommand):
    """Click has no optional-value options that Typer passes through: a bare switch (last, or
    followed by another flag) gets "true" inserted before parsing, so `--merge-lora`,
    `--merge_lora true` and `--merge_lora=false` all work (and `--merge_lora maybe` is an error
    naming the flag)."""

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        refuse_msswift_options(args, {name for p in self.params for name in p.opts})
        names = {name for p in self.params if getattr(p, "metavar", None) == SWITCH_METAVAR for name in p.opts}
        out: list[str] = []
        for i, a in enumerate(args):
            out.append(a)
            if a in names and (i + 1 == len(args) or args[i + 1].startswith("-")):
                out.append("true")
        return super().parse_args(ctx, out)


SWITCH_METAVAR = "[true|false]"

_UPLOAD = "nothing is uploaded: upload the exported folder yourself (huggingface-cli upload REPO DIR)"
_QUANTIZE = ("quantized export (GPTQ/AWQ/bnb/FP8) is not available: `swiftlite export` writes a 16-bit HF folder; "
             "quantize it with the serving engine's own tools")
#: ms-swift's `swift export` options (ExportArguments, commit 3602360a) that mean something here
#: other than "a setting of the run": their own reason.
EXPORT_REFUSALS = {**{k: _UPLOAD for k in ("push_to_hub", "hub_model_id", "hub_private_repo", "commit_message",
                                           "hub_token", "use_hf")},
                   **{k: _QUANTIZE for k in ("quant_method", "quant_bits", "quant_n_samples", "quant_batch_size",
                                             "group_size", "hqq_axis", "bnb_4bit_quant_type",
                                             "bnb_4bit_use_double_quant", "bnb_4bit_compute_dtype",
                                             "bnb_4bit_quant_storage")}}


def refuse_msswift_options(args: list[str], known: set[str]) -> None:
    """Every ms-swift option of the command line that `swiftlite export` does not take, each with its
    reason, at once (exit 2); anything else unknown is left to click ("No such option")."""
    from swiftlite.config.load import alias_keys
    from swiftlite.config.msswift import NO_MEANING
    from swiftlite.config.msswift_unsupported import EXPORT_FROM_RUN, GROUPS, refusal
    from swiftlite.config.schema import field_specs
    from swiftlite.errors import raise_all
    run_options = set(field_specs()) | set(alias_keys()) | set(NO_MEANING)
    export_groups = {n for why, names in GROUPS if "swiftlite export" in why for n in names}
    problems = []
    for a in args:
        name = a.partition("=")[0]
        if not name.startswith("--") or name in known:
            continue
        key = name[2:].replace("-", "_")
        why = EXPORT_REFUSALS.get(key) or (refusal(key) if key in export_groups else None)
        if why is None and (key in run_options or refusal(key) is not None):
            why = EXPORT_FROM_RUN
        if why is not None:
            problems.append(f"{name}: {why}")
    raise_all(problems)


def switch(*names: str, help: str) -> typer.models.OptionInfo:
    """An on/off flag: bare, or with true/false (yes/no, 1/0)."""
    return typer.Option("false", *names, metavar=SWITCH_METAVAR, help=help + " (default: false)",
                        show_default=False)


def _on(flag: str, value: str) -> bool:
    v = value.strip().lower()
    if v in TRUE:
        return True
    if v in FALSE:
        return False
    raise UserError(f"{flag}: expected true or false, got {value!r}")


def export_cmd(
    ckpt: Optional[str] = typer.Option(None, "--ckpt", "--ckpt-dir", "--ckpt_dir", "--checkpoint",
                                       help="Run folder (its latest checkpoint), checkpoint-N folder, or adapter "
                                            "folder."),
    adapters: Optional[str] = typer.Option(None, "--adapters",
                                           help="ms-swift's name for --ckpt: a checkpoint-N folder (or its "
                                                "adapter/ folder) of a LoRA run."),
    output: Optional[str] = typer.Option(None, "--output", "--output-dir", "--output_dir", "-o",
                                         help="Folder to write (must not exist, unless --overwrite). Default: "
                                              "<checkpoint>-merged with --merge-lora (ms-swift's), else "
                                              "<checkpoint>-export."),
    base_model: Optional[str] = typer.Option(None, "--base-model", "--base_model", "--model",
                                             help="Base model (preset, folder or hub id); default: the run's."),
    merge_lora: str = switch("--merge-lora", "--merge_lora",
                             help="LoRA runs: merge into the base and write a full model; without it the "
                                  "adapter alone is written. An error for a full fine-tune"),
    dtype: str = typer.Option("bf16", "--dtype", "--torch-dtype", "--torch_dtype", help="bf16 or fp16."),
    max_shard_size: str = typer.Option("5GB", "--max-shard-size", "--max_shard_size",
                                       help="Largest safetensors shard (5GB, 500MB, 2GiB)."),
    verify: str = switch("--verify", help="Reload the export and compare logits with the "
                                          "training-side model; exit 1 if anything fails"),
    overwrite: str = switch("--overwrite", "--exist-ok", "--exist_ok",
                            help="Replace --output if it exists (only once the new export is complete)"),
) -> None:
    """Export a checkpoint to a 16-bit Hugging Face folder (vLLM, LMDeploy, transformers)."""
    if ckpt is None and adapters is None:
        raise UserError("export: pass the checkpoint to export with --ckpt or --adapters")
    if ckpt is not None and adapters is not None and ckpt != adapters:
        raise UserError(f"--ckpt {ckpt} and --adapters {adapters}: both name the checkpoint; give one")
    from swiftlite.export import ExportOptions, VerifyError, export
    opts = ExportOptions(ckpt=ckpt or adapters, output=output, base_model=base_model,
                         merge_lora=_on("--merge-lora", merge_lora), dtype=dtype.lower(),
                         max_shard_size=max_shard_size, verify=_on("--verify", verify),
                         overwrite=_on("--overwrite", overwrite),
                         ckpt_flag="--ckpt" if ckpt is not None else "--adapters")
    try:
        export(opts)
    except VerifyError as e:
        print(f"error: --verify failed: {e}", file=sys.stderr)
        raise typer.Exit(1)


export_cmd.command_settings = {"cls": _SwitchCommand}


def register(app: typer.Typer) -> None:
    """Add `export` to an app of your own (swiftlite's app takes it from COMMANDS in cli/main.py)."""
    app.command("export", **export_cmd.command_settings)(export_cmd)
