"""Any swiftlite checkpoint -> a Hugging Face folder (16-bit safetensors) that vLLM and LMDeploy load.

    swiftlite export --ckpt RUN_OR_CHECKPOINT --output DIR [--merge-lora] [--dtype bf16] [--verify]
    swiftlite export --adapters CHECKPOINT --merge_lora true      # ms-swift's spelling: CHECKPOINT-merged

What `--ckpt` may be
    a run folder            its `latest` checkpoint (refused, with the reason, if that one is broken)
    checkpoint-N/           dcp/ (single, ddp, fsdp, fsdp1), ds/ (DeepSpeed ZeRO-1/2/3), adapter/ (LoRA)
    a peft adapter folder   adapter_config.json + adapter_model.safetensors (needs --base-model)
    an HF model folder      config.json + *.safetensors (re-sharded and cast)

Where the weights come from
    full fine-tune, torch   the DCP shards, read offline (no process group) a few tensors at a time
    full fine-tune, ZeRO    the fp32 master partitions of the ZeRO optimizer files (DeepSpeed's
                            zero_to_fp32 helpers; ZeRO-2 partitions are stitched lazily here, ZeRO-3
                            through DeepSpeed's lazy GatheredTensor), memory-mapped
    LoRA / QLoRA            checkpoint-N/adapter/ (else the trainable tensors of dcp/ or ds/) plus the
                            base model named in the run's args.json (or --base-model)

Memory: tensors stream from the checkpoint into `hf_io.write_sharded`, which flushes a shard as soon
as it reaches --max-shard-size; a read batch is at most half a shard, so the export's peak memory is
about 1.5 shards plus the largest tensor, whatever the model size. QLoRA merges hold the 4-bit base
(what the run trained against, quantized the same way) and dequantize it one layer at a time.

Atomicity: everything is written into a hidden `.NAME.export-tmp-PID` folder next to --output, which is
renamed to --output only when complete (and verified, with --verify). An interrupted export leaves only
that hidden folder, which the next export removes.

User mistakes (not a checkpoint, base model missing, adapter/base mismatch, output exists) are
UserErrors: one line, exit 2. A failed --verify is a VerifyError: exit 1 and nothing is published.

Modules: source.py (what --ckpt is), base_model.py (architecture, ties, tokenizer), adapter.py (LoRA),
model.py (writing the weights), output.py (temp folder, model card, atomic move), reference.py (the
training-side model, also used by `swiftlite infer`), verify.py (--verify), memprobe.py (RSS
diagnostics). The offline tensor readers live in `swiftlite.checkpoint.readers`.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from swiftlite import dtypes
from swiftlite.checkpoint.readers import (DCPReader, ModelReader, SafetensorsReader, TensorReader, ZeroReader,
                                          stream, tensor_value)

from swiftlite.errors import UserError
from swiftlite.export.adapter import Adapter, check_adapter_fits, load_adapter, merge_lora, peft_name
from swiftlite.export.base_model import expected_tensors, meta_model, tied_names
from swiftlite.export.model import export_adapter, export_model
from swiftlite.export.output import (ExportResult, append_readme, cast_checked, move_into_place, prepare_output,
                                     write_readme)
from swiftlite.export.reference import Reference, VerifyError, load_reference, reference_model, reference_tokenizer
from swiftlite.export.source import (ExportOptions, Source, default_output, inspect_source, resolve_base,
                                     resolve_checkpoint)
from swiftlite.export.verify import (PEFT_MARKERS, TOLERANCE, check_files, prompt_for, reference_weights,
                                     verify_export)
from swiftlite.hf_io import ADAPTER_FILES, write_config, write_generation_config, write_tokenizer

__all__ = [
    "export", "ExportOptions", "ExportResult", "VerifyError", "Source", "resolve_checkpoint", "inspect_source",
    "default_output",
    "resolve_base", "TensorReader", "stream", "DCPReader", "SafetensorsReader", "ModelReader", "ZeroReader",
    "tensor_value", "meta_model", "expected_tensors", "tied_names", "Adapter", "peft_name", "load_adapter",
    "check_adapter_fits", "merge_lora", "cast_checked", "write_readme", "append_readme", "prepare_output",
    "move_into_place", "export_model", "export_adapter", "Reference", "load_reference", "reference_model",
    "reference_tokenizer", "prompt_for", "check_files", "verify_export", "reference_weights", "TOLERANCE",
    "PEFT_MARKERS", "ADAPTER_FILES", "write_config", "write_generation_config", "write_tokenizer",
]


def export(opts: ExportOptions) -> ExportResult:
    """Run one export (see the module docstring); returns what was written."""
    from transformers.utils import logging as hf_logging

    from swiftlite.sizes import parse_size
    hf_logging.disable_progress_bar()  # the export logs its own lines; no per-load bars
    log = opts.log
    if opts.dtype not in dtypes.HALF:
        raise UserError(f"--dtype {opts.dtype}: choose bf16 or fp16")
    max_shard = parse_size(opts.max_shard_size, "--max-shard-size")
    src = inspect_source(opts.ckpt, opts.base_model, log, opts.ckpt_flag)
    if src.train_type == "adapter":   # no merge and no HF architecture reproduce it (models/adapter.py)
        from swiftlite.models.adapter import refuse_export
        refuse_export(opts.ckpt_flag, opts.ckpt)
    if opts.quant is not None and src.is_peft and not opts.merge_lora:
        opts.merge_lora = True
        log("the LoRA is merged into its base first: a quantized export is a full model (as ms-swift does)")
    if opts.ollama:
        _check_ollama(opts, src)
    if opts.merge_lora and not src.is_peft:
        raise UserError(f"--merge-lora: {opts.ckpt_flag} {opts.ckpt} is a full fine-tune ({src.path.name}), there is "
                        "no LoRA adapter to merge; export it without --merge-lora")
    if opts.output is None:
        opts.output = str(default_output(src, opts.merge_lora, opts.quant))
        log(f"output {opts.output} (no --output given: <checkpoint>-{Path(opts.output).name[len(src.path.name) + 1:]})")
    out, tmp = prepare_output(opts.output, opts.overwrite, src)
    log(f"source {src.describe()}")
    t0 = time.perf_counter()
    try:
        # an HF folder to quantize is loaded by transformers as it is: no 16-bit re-export first
        as_is = opts.quant is not None and src.form == "hf"
        if src.is_peft and not opts.merge_lora:
            result = export_adapter(src, opts, tmp, out)
        elif opts.ollama and opts.model_only:   # ms-swift's: the folder used as it is, FROM its path
            from swiftlite.export.ollama import write_modelfile
            write_modelfile(tmp, src.path, str(src.path.resolve()), f"--model {src.path}", log, out)
            result = ExportResult(out, "modelfile", ["Modelfile"], 0, (tmp / "Modelfile").stat().st_size,
                                  base_desc=str(src.path))
        elif as_is:
            result = _quantized_folder(src, opts, tmp, out, max_shard)
        else:
            result = export_model(src, opts, tmp, out, max_shard)
        if opts.verify and not as_is:
            report = verify_export(tmp, src, opts, result)
            result.verify = report
            append_readme(tmp, "## Verification\n\n" + "\n".join(f"- {k}: {v}" for k, v in report.items()) + "\n")
        if opts.quant is not None and not as_is:   # the verified 16-bit folder, quantized (export/quantize.py)
            from swiftlite.export.quantize import quantize_export
            qreport = quantize_export(tmp, opts.quant, opts.dtype, max_shard, _trusts_code(src), log,
                                      check=opts.verify)
            append_readme(tmp, "## Quantization\n\n" + "\n".join(f"- {k}: {v}" for k, v in qreport.items())
                          + "\n\nThis folder's weights are the 16-bit export above, " + _quant_note(opts.quant) + "\n")
            result.files, result.tensors, result.bytes = _folder_totals(tmp)
            if result.verify is not None:
                result.verify.update(qreport)
        if opts.ollama and not opts.model_only:   # next to the written (and verified) weights
            from swiftlite.export.ollama import write_modelfile
            write_modelfile(tmp, tmp, ".", f"{opts.ckpt_flag} {opts.ckpt}", log, out)
            result.files = sorted([*result.files, "Modelfile"])
        move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    result.output = out
    log(f"wrote {out} ({len(result.files)} files, {result.tensors} tensors, {result.bytes / 1e6:.1f} MB) "
        f"in {time.perf_counter() - t0:.1f} s")
    return result



def _check_ollama(opts: ExportOptions, src: Source) -> None:
    """--to_ollama: ollama imports a 16-bit safetensors folder, so a LoRA is merged first (as for a
    quantized export, and said); a bitsandbytes export is refused."""
    if opts.quant is not None:
        raise UserError(f"--to_ollama with --quant_method {getattr(opts.quant, 'method', 'bnb')}: ollama imports "
                        "16-bit safetensors (and quantizes "
                        "them itself: `ollama create --quantize q4_K_M`); drop --quant_method")
    if opts.model_only and opts.verify:
        raise UserError("--verify with --to_ollama on --model alone: the folder is used as it is, nothing is "
                        "written to verify but the Modelfile; drop --verify")
    if src.is_peft and not opts.merge_lora:
        opts.merge_lora = True
        opts.log("the LoRA is merged into its base first: ollama imports a full model")


def _quant_note(quant) -> str:
    note = getattr(quant, "note", None)
    return note() if note else "quantized by transformers' bitsandbytes integration."


def _trusts_code(src: Source) -> bool:
    return bool(src.cfg.model.trust_remote_code) if src.cfg is not None else False


def _folder_totals(folder: Path) -> tuple[list[str], int, int]:
    """(file names, safetensors tensors, bytes) of a written folder."""
    from safetensors import safe_open
    files = sorted(p.name for p in folder.iterdir() if p.is_file())
    tensors = sum(len(safe_open(str(folder / f), "pt").keys()) for f in files if f.endswith(".safetensors"))
    return files, tensors, sum((folder / f).stat().st_size for f in files)


def _quantized_folder(src: Source, opts: ExportOptions, tmp: Path, out: Path, max_shard: int) -> ExportResult:
    """`export --model FOLDER --quant_method bnb`: the folder quantized by transformers, which reads it
    in the layout it was saved in (nothing of it changes, so there is no 16-bit re-export first);
    with --verify, its reload check is the verification."""
    from swiftlite.export.quantize import quantize_export
    report = quantize_export(tmp, opts.quant, opts.dtype, max_shard, _trusts_code(src), opts.log,
                             check=opts.verify, source=src.path)
    files, tensors, size = _folder_totals(tmp)
    write_readme(tmp, src, {"kind": "model", "dtype": opts.dtype, "output_name": out.name, "final_path": str(out),
                            "weights_from": f"{src.path} (loaded by transformers)", "base_desc": str(src.path),
                            "what": opts.quant.describe(opts.dtype), "files": len(files)})
    append_readme(tmp, "## Quantization\n\n" + "\n".join(f"- {k}: {v}" for k, v in report.items()) + "\n")
    return ExportResult(out, "model", files, tensors, size, base_desc=str(src.path),
                        verify=report if opts.verify else None)
