"""`swiftlite export`: its flags -> `swiftlite.export.ExportOptions` (the work is in swiftlite/export/,
imported when the command runs).

Flags follow ms-swift (`swift export --adapters CKPT --merge_lora true`): every multi-word flag has
both spellings (--max-shard-size and --max_shard_size); --adapters is --ckpt; a switch is given bare
(`--merge-lora`) or with a value (`--merge_lora true`, `--merge_lora=false`), as sft's booleans.
"""

from __future__ import annotations

import sys
from pathlib import Path
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
        from swiftlite.cli import cached_dataset
        if cached_dataset.requested(args):   # the data's options, not a checkpoint's: cli/cached_dataset.py
            raise typer.Exit(cached_dataset.export_cached(args))
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
_QUANTIZE = ("calibrated and other quantized exports (GPTQ/AWQ/FP8/HQQ) are not available: `swiftlite export` "
             "writes a 16-bit HF folder, or a bitsandbytes one (--quant_method bnb --quant_bits 4|8), which needs "
             "no calibration; drop the flag")
#: ms-swift's `swift export` options (ExportArguments, commit 3602360a) that mean something here
#: other than "a setting of the run": their own reason.
EXPORT_REFUSALS = {**{k: _UPLOAD for k in ("push_to_hub", "hub_model_id", "hub_private_repo", "commit_message",
                                           "hub_token", "use_hf")},
                   **{k: _QUANTIZE for k in ("quant_n_samples", "quant_batch_size", "group_size", "hqq_axis",
                                             "bnb_4bit_quant_storage")}}
#: --quant_method values of ms-swift's export that are refused, with what they would need.
QUANT_METHODS_REFUSED = {
    "gptq": "GPTQ calibrates on data with the gptqmodel package", "gptq_v2": "GPTQ calibrates on data",
    "awq": "AWQ calibrates on data with the autoawq package", "hqq": "HQQ needs the hqq package", "eetq": "EETQ needs the eetq package",
    "quanto": "quanto needs the optimum-quanto package"}


def refuse_msswift_options(args: list[str], known: set[str]) -> None:
    """Every ms-swift option of the command line that `swiftlite export` does not take, each with its
    reason, at once (exit 2); anything else unknown is left to click ("No such option")."""
    from swiftlite.config.load import alias_keys
    from swiftlite.config.msswift import APPENDS, NO_MEANING
    from swiftlite.config.msswift_unsupported import EXPORT_FROM_RUN, GROUPS, refusal
    from swiftlite.config.schema import field_specs
    from swiftlite.errors import raise_all
    run_options = set(field_specs()) | set(alias_keys()) | set(NO_MEANING) | set(APPENDS)
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
    if problems:   # the quantization options' own mistakes belong to the same list (one run names all)
        try:
            bnb_options(**_raw_values(args, _BNB_FLAGS))
        except UserError as e:
            problems += getattr(e, "lines", [str(e)])
    raise_all(problems)


#: bnb_options' keyword -> the flag's ms-swift spelling (the dashed one is accepted too).
_BNB_FLAGS = {"method": "--quant_method", "bits": "--quant_bits", "quant_type": "--bnb_4bit_quant_type",
              "double_quant": "--bnb_4bit_use_double_quant", "compute_dtype": "--bnb_4bit_compute_dtype"}


def _raw_values(args: list[str], flags: dict[str, str]) -> dict:
    """The values of `flags` on a raw command line (before click parses it): `--f v`, `--f=v`, or a
    bare switch (true); quant_bits as an int where it is one."""
    out: dict = {k: None for k in flags}
    spell = {f: k for k, f in flags.items()} | {f.replace("_", "-"): k for k, f in flags.items()}
    for i, a in enumerate(args):
        name, eq, val = a.partition("=")
        if name in spell:
            if not eq:
                val = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else "true"
            out[spell[name]] = int(val) if spell[name] == "bits" and val.lstrip("-").isdigit() else val
    return out


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
    quant_method: Optional[str] = typer.Option(None, "--quant-method", "--quant_method",
                                               help="bnb: write the export quantized by bitsandbytes (with "
                                                    "--quant-bits 4 or 8); fp8: block-wise FP8 (transformers' "
                                                    "FineGrainedFP8 format, e4m3 weights with a scale per 128 x "
                                                    "128 block; a mixture of experts per expert, as the hub's FP8 "
                                                    "checkpoints); LoRA runs are merged first; as "
                                                    "ms-swift's `swift export --quant_method bnb|fp8`."),
    quant_bits: Optional[int] = typer.Option(None, "--quant-bits", "--quant_bits",
                                             help="4 or 8, with --quant-method bnb."),
    bnb_4bit_quant_type: Optional[str] = typer.Option(None, "--bnb-4bit-quant-type", "--bnb_4bit_quant_type",
                                                      help="4-bit type: nf4 (default, ms-swift's) or fp4."),
    bnb_4bit_use_double_quant: Optional[str] = typer.Option(
        None, "--bnb-4bit-use-double-quant", "--bnb_4bit_use_double_quant", metavar=SWITCH_METAVAR,
        help="4-bit: quantize the quantization constants too (default: true, ms-swift's)."),
    bnb_4bit_compute_dtype: Optional[str] = typer.Option(None, "--bnb-4bit-compute-dtype", "--bnb_4bit_compute_dtype",
                                                         help="4-bit compute dtype (default: --dtype)."),
    to_ollama: str = switch("--to-ollama", "--to_ollama",
                            help="Also write a Modelfile (TEMPLATE read off the chat template, stop words, "
                                 "sampling settings) so that `ollama create NAME -f OUT/Modelfile` imports the "
                                 "export; LoRA runs are merged first; with --model alone the folder is used as it is "
                                 "(ms-swift's)"),
    to_cached_dataset: str = switch("--to-cached-dataset", "--to_cached_dataset",
                                    help="Instead of a model: tokenize --dataset (and --val_dataset or "
                                         "--split_dataset_ratio) with --model's tokenizer and the run's data "
                                         "options, and write --output_dir/train and /val for `swiftlite sft|pt "
                                         "--cached_dataset` (ms-swift's; --use_chat_template false: pt rows)"),
) -> None:
    """Export a checkpoint to a 16-bit Hugging Face folder (vLLM, LMDeploy, transformers), or a
    bitsandbytes- or FP8-quantized one (--quant-method bnb|fp8)."""
    if ckpt is not None and adapters is not None and ckpt != adapters:
        raise UserError(f"--ckpt {ckpt} and --adapters {adapters}: both name the checkpoint; give one")
    model_only = ckpt is None and adapters is None
    if model_only:
        if base_model is None:
            raise UserError("export: pass the checkpoint to export with --ckpt or --adapters (or a model with --model)")
        ckpt, base_model = model_folder(base_model), None   # ms-swift's `swift export --model M`
    quant = bnb_options(quant_method, quant_bits, bnb_4bit_quant_type, bnb_4bit_use_double_quant,
                        bnb_4bit_compute_dtype)
    from swiftlite.export import ExportOptions, VerifyError, export
    opts = ExportOptions(ckpt=ckpt or adapters, output=output, base_model=base_model,
                         merge_lora=_on("--merge-lora", merge_lora), dtype=dtype.lower(),
                         max_shard_size=max_shard_size, verify=_on("--verify", verify),
                         overwrite=_on("--overwrite", overwrite),
                         ckpt_flag="--ckpt" if ckpt is not None else "--adapters", quant=quant,
                         ollama=_on("--to_ollama", to_ollama), model_only=model_only)
    try:
        export(opts)
    except VerifyError as e:
        print(f"error: --verify failed: {e}", file=sys.stderr)
        raise typer.Exit(1)


def model_folder(model: str) -> str:
    """`swift export --model M` with no checkpoint: M's own weights are what is exported (an HF
    folder, or a hub id's local snapshot). A preset has no weights to export."""
    from swiftlite.models.loading import resolve_model
    p = Path(model).expanduser()
    if p.is_dir():
        return str(p)
    ms = resolve_model(model)
    if ms.kind == "hub":
        from swiftlite.export.source import local_snapshot
        return str(local_snapshot(ms, None, f"--model {model}").ref)
    if ms.kind != "folder":
        raise UserError(f"--model {model}: a built-in model has no weights to export (its weights come from the seed "
                        "at training time); export a checkpoint with --ckpt")
    return str(ms.ref)


def bnb_options(method: str | None, bits: int | None, quant_type: str | None, double_quant: str | None,
                compute_dtype: str | None):
    """--quant_method bnb and its options -> export/quantize.BnbExport, fp8 -> export/fp8.Fp8Export
    (None without --quant_method); every mistake is named at once, in ms-swift's terms."""
    from swiftlite import dtypes
    from swiftlite.errors import raise_all
    from swiftlite.export.quantize import BNB_4BIT_TYPES, BnbExport
    given4 = [f for f, v in (("--bnb_4bit_quant_type", quant_type), ("--bnb_4bit_use_double_quant", double_quant),
                             ("--bnb_4bit_compute_dtype", compute_dtype)) if v is not None]
    problems = []
    bnb = method is not None and method.lower() == "bnb"
    if method is not None and method.lower() == "fp8":   # e4m3 in 128 x 128 blocks: nothing to choose
        problems += [f"{f}: FP8's format has no such setting (e4m3 weights, a scale per 128 x 128 block)"
                     for f in (["--quant_bits"] if bits is not None else []) + given4]
        raise_all(problems)
        from swiftlite.export.fp8 import Fp8Export
        return Fp8Export()
    if method is not None and not bnb:
        why = QUANT_METHODS_REFUSED.get(method.lower(), "not a quantization method ms-swift's export has")
        problems.append(f"--quant_method {method}: {why}; `swiftlite export` quantizes with bnb "
                        "(--quant_method bnb --quant_bits 4|8) or fp8")
    if not bnb:   # every option of a bnb export, named: it has nothing to apply to
        problems += [f"{f}: needs --quant_method bnb (a quantized export)"
                     for f in (["--quant_bits"] if bits is not None else []) + given4]
        raise_all(problems)
        return None
    if bits not in (4, 8):
        problems.append(f"--quant_bits {bits}: --quant_method bnb takes 4 or 8" if bits is not None else
                        "--quant_method bnb needs --quant_bits 4 or 8")
    if bits == 8:
        problems += [f"{f}: applies to 4-bit quantization, not --quant_bits 8" for f in given4]
    if quant_type is not None and quant_type.lower() not in BNB_4BIT_TYPES:
        problems.append(f"--bnb_4bit_quant_type {quant_type}: choose nf4 or fp4")
    cd = None
    if compute_dtype is not None:
        cd = dtypes.normalize(compute_dtype)
        if cd not in dtypes.NAMES or cd == "auto":
            problems.append(f"--bnb_4bit_compute_dtype {compute_dtype}: choose bfloat16, float16 or float32")
    dq = True
    if double_quant is not None:
        try:
            dq = _on("--bnb_4bit_use_double_quant", double_quant)
        except UserError as e:
            problems.append(str(e))
    raise_all(problems)
    return BnbExport(bits=bits, quant_type=(quant_type or "nf4").lower(), double_quant=dq, compute_dtype=cd)


export_cmd.command_settings = {"cls": _SwitchCommand}


def register(app: typer.Typer) -> None:
    """Add `export` to an app of your own (swiftlite's app takes it from COMMANDS in cli/main.py)."""
    app.command("export", **export_cmd.command_settings)(export_cmd)
