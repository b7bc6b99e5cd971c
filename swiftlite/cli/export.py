"""`swiftlite export`: its flags -> `swiftlite.export.ExportOptions` (the work is in swiftlite/export/,
imported when the command runs).

Flags follow ms-swift: every multi-word flag has both spellings (--max-shard-size and
--max_shard_size); switches are plain flags (`--merge_lora`, not `--merge_lora true`).
"""

from __future__ import annotations

import sys
from typing import Optional

import typer


def switch(*names: str, help: str) -> typer.models.OptionInfo:
    """An on/off flag (ms-swift's `--merge_lora true` is written `--merge_lora` here)."""
    return typer.Option(False, *names, help=help)


def export_cmd(
    ckpt: str = typer.Option(..., "--ckpt", "--ckpt-dir", "--ckpt_dir", "--checkpoint",
                             help="Run folder (its latest checkpoint), checkpoint-N folder, or adapter folder."),
    output: str = typer.Option(..., "--output", "--output-dir", "--output_dir", "-o",
                               help="Folder to write (must not exist, unless --overwrite)."),
    base_model: Optional[str] = typer.Option(None, "--base-model", "--base_model", "--model",
                                             help="Base model (preset, folder or hub id); default: the run's."),
    merge_lora: bool = switch("--merge-lora", "--merge_lora",
                              help="LoRA runs: merge into the base and write a full model "
                                   "(default: write the adapter alone)."),
    dtype: str = typer.Option("bf16", "--dtype", "--torch-dtype", "--torch_dtype", help="bf16 or fp16."),
    max_shard_size: str = typer.Option("5GB", "--max-shard-size", "--max_shard_size",
                                       help="Largest safetensors shard (5GB, 500MB, 2GiB)."),
    verify: bool = switch("--verify", help="Reload the export and compare logits with the "
                                           "training-side model; exit 1 if anything fails."),
    overwrite: bool = switch("--overwrite", help="Replace --output if it exists (only once the new "
                                                 "export is complete)."),
) -> None:
    """Export a checkpoint to a 16-bit Hugging Face folder (vLLM, LMDeploy, transformers)."""
    from swiftlite.export import ExportOptions, VerifyError, export
    opts = ExportOptions(ckpt=ckpt, output=output, base_model=base_model,
                         merge_lora=merge_lora, dtype=dtype.lower(),
                         max_shard_size=max_shard_size, verify=verify,
                         overwrite=overwrite)
    try:
        export(opts)
    except VerifyError as e:
        print(f"error: --verify failed: {e}", file=sys.stderr)
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add `export` to an app of your own (swiftlite's app takes it from COMMANDS in cli/main.py)."""
    app.command("export")(export_cmd)
