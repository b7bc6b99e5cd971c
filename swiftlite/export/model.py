"""Writing the weights: full weights (a full fine-tune, or LoRA merged into its base) as an HF folder,
or a LoRA adapter alone in peft format."""

from __future__ import annotations

import re

from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from swiftlite import dtypes
from swiftlite.checkpoint import layout
from swiftlite.checkpoint.readers import (DCPReader, ModelReader, SafetensorsReader, TensorReader, ZeroReader,
                                          stream)
from swiftlite.errors import UserError
from swiftlite.export.adapter import check_adapter_fits, load_adapter, merge_lora
from swiftlite.export.tuner_merge import merge_tuner
from swiftlite.export.base_model import (base_ref, expected_tensors, meta_model, tie_candidates, tied_names,
                                         tokenizer_for)
from swiftlite.export.memprobe import MemProbe
from swiftlite.export.output import ExportResult, cast_checked, write_readme
from swiftlite.export.source import ExportOptions, Source, model_config_for, resolve_base
from swiftlite.hf_io import (ADAPTER_WEIGHTS, write_adapter_config, write_adapter_weights, write_config,
                             write_generation_config, write_sharded, write_tokenizer)


def load_base_for_lora(src: Source, ms: Any, log: Callable[[str], None]) -> tuple[TensorReader, str]:
    """The base weights the run trained against, as a reader, and a sentence saying which they are."""
    from swiftlite.models.loading import load_model
    cfg = src.cfg
    run_dtype = cfg.model.torch_dtype
    q = cfg.quant.quant_bits
    name = ms.ref if ms.kind != "preset" else f"{cfg.model.model} (built-in, random init with seed {cfg.train.seed})"
    if q:
        model = load_model(cfg, ms)
        from swiftlite.models.quant import disable_cpu_repack
        disable_cpu_repack(model)
        reader: TensorReader = ModelReader(model)
        if cfg.quant_method == "hqq":
            desc = (f"{name}, quantized with HQQ to {q} bits exactly as in training, then dequantized with "
                    f"HQQLinear.dequantize ({reader.quantized} layers); LoRA merged into the dequantized weights "
                    "(what was trained against), not into the original weights")
        elif q == 4:
            how = (f"{cfg.quant.bnb_4bit_quant_type} 4-bit"
                   f"{' + double quant' if cfg.quant.bnb_4bit_use_double_quant else ''}, compute {run_dtype}")
            desc = (f"{name}, quantized {how} exactly as in training, then dequantized with "
                    f"bitsandbytes.functional.dequantize_4bit ({reader.quantized} layers); LoRA merged into the "
                    "dequantized weights (what was trained against), not into the original weights")
        else:
            desc = (f"{name}, quantized to 8-bit as in training and dequantized ({reader.quantized} layers); "
                    "LoRA merged into the dequantized weights")
        return reader, desc
    if ms.kind == "preset":
        return ModelReader(load_model(cfg, ms)), f"{name}, {run_dtype}"
    folder = Path(ms.ref)
    try:
        return SafetensorsReader(folder), f"{folder} (safetensors, as {run_dtype}, as in training)"
    except UserError:
        return ModelReader(load_model(cfg, ms)), f"{folder} (loaded with transformers, {run_dtype})"


def export_model(src: Source, opts: ExportOptions, tmp: Path, out: Path, max_shard: int) -> ExportResult:
    """Full weights (full fine-tune, or LoRA merged into its base) -> shards + config + tokenizer."""
    from transformers import AutoConfig
    log = opts.log
    dtype = dtypes.torch_dtype(opts.dtype)
    budget = max(1, min(max_shard // 2, 1 << 30))
    trust = bool(src.cfg.model.trust_remote_code) if src.cfg is not None else False
    ms = None
    base_folder: Path | None = None
    if src.hf_dir is not None and not src.is_peft and (src.base_from != "--base-model"):
        conf = AutoConfig.from_pretrained(str(src.hf_dir), trust_remote_code=trust)
        conf_from = str(src.hf_dir)
        base_folder = src.hf_dir
    else:
        ms = resolve_base(src)
        conf = model_config_for(src, ms)
        conf_from = f"base model {src.cfg.model.model}"
        base_folder = Path(ms.ref) if ms.kind == "folder" else None
    model = meta_model(conf, trust)
    arch = type(model).__name__
    expected = expected_tensors(model)
    tied = tied_names(model) if getattr(conf, "tie_word_embeddings", False) else {}
    info: dict[str, Any] = {"kind": "model", "dtype": opts.dtype, "output_name": out.name, "final_path": str(out)}
    replace: dict[str, torch.Tensor] = {}
    loras: dict[str, dict[str, torch.Tensor]] = {}
    tuned: dict[str, dict[str, torch.Tensor]] = {}   # BOFT / AdaLoRA / MiSS modules (export/tuner_merge.py)
    adapter = None

    if src.is_peft:
        adapter = load_adapter(src, log)
        base_desc_short = src.cfg.model.model
        check_adapter_fits(adapter, expected, base_desc_short)
        reader, base_desc = load_base_for_lora(src, ms, log)
        info["base_desc"] = base_desc
        info["base_ref"] = base_ref(src, ms)
        info["hub_base"] = ms.hub_id
        info["weights_from"] = f"{base_desc_short} + adapter {adapter.origin}"
        info["what"] = f"LoRA merged into the base ({len(adapter.lora_modules())} modules)"
        log(f"base: {base_desc}")
        loras = adapter.lora_modules()
        tuned = adapter.tuner_modules()
        if tuned:
            info["what"] = f"{adapter.peft_type} adapter merged into the base ({len(tuned)} modules)"
        replace = adapter.replacements()
        run_dtype = dtypes.torch_dtype(src.cfg.model.torch_dtype)
    else:
        if src.weights is layout.CheckpointFormat.DCP:
            reader = DCPReader(src.dcp_dir)
            info["weights_from"] = f"{src.path.name}/{layout.DCP_DIR} (torch.distributed.checkpoint, {len(reader.info)} tensors)"
        elif src.weights is layout.CheckpointFormat.DS:
            reader = ZeroReader(src.path, exclude_frozen=False)
            info["weights_from"] = (f"{src.path.name}/{layout.DS_TAG} (ZeRO-{reader.stage} fp32 master weights of "
                                    f"{reader.world} ranks)")
        elif src.hf_dir is not None:   # an HF folder, or a checkpoint's model/ alone
            reader = SafetensorsReader(src.hf_dir)
            info["weights_from"] = f"{src.hf_dir} (safetensors)"
        else:
            raise UserError(f"--ckpt {src.arg}: no full weights to export")
        info["what"] = "full weights"
        info["base_desc"] = conf_from
        run_dtype = None
        log(f"weights: {info['weights_from']}; architecture from {conf_from}")

    # Names to write: the architecture's, minus tied copies; every one must be in the source.
    have = reader.info
    tie = bool(tied)
    if tie:
        extra_touch = set(replace) | {f"{m}.weight" for m in (*loras, *tuned)}
        if any(k in extra_touch for pair in tied.items() for k in pair):
            tie = False  # the adapter changes one side of the tie: write both
            log("note: the adapter changes a tied embedding; writing lm_head separately (tie_word_embeddings=false)")
        else:
            for dst, srcname in tied.items():
                if dst in have and srcname in have:
                    got = reader.read([dst, srcname])
                    if not torch.equal(got[dst], got[srcname]):
                        tie = False
                        log(f"note: {dst} differs from {srcname} in the checkpoint; writing both "
                            "(tie_word_embeddings=false)")
    else:
        # An untied architecture whose checkpoint holds no lm_head: it was trained tied.
        cand = tie_candidates(model)
        if cand and all(k not in have and k not in replace and v in have for k, v in cand.items()):
            conf.tie_word_embeddings = True
            model = meta_model(conf, trust)
            tied, tie = tied_names(model) or cand, True
            expected = expected_tensors(model)
            log("note: the checkpoint holds no lm_head.weight: writing a tied model (tie_word_embeddings=true)")
    skip = set(tied) if tie else set()
    names = [k for k in expected if k not in skip]
    missing = [k for k in names if k not in have and k not in replace]
    if missing and ".experts." in missing[0] and any(re.search(r"\.experts\.\d+\.", k) for k in have):
        # transformers 5 fuses a mixture of experts' per-expert weights in memory (experts.gate_up_proj)
        # and converts them only while from_pretrained / save_pretrained run; this export streams tensors
        # by name and does not convert between the two layouts
        raise UserError(f"--ckpt {src.arg}: {conf_from} stores its experts one by one (e.g. "
                        f"{next(k for k in have if re.search(r'[.]experts[.][0-9]+[.]', k))}), transformers fuses "
                        f"them in memory ({missing[0]}): exporting a mixture of experts from such a folder is not "
                        "available; load and save it with transformers instead")
    if missing:
        raise UserError(f"--ckpt {src.arg}: the weights do not match the architecture of {conf_from}: "
                        f"{len(missing)} tensors missing (e.g. {missing[0]})")
    for k in names:   # a tensor the adapter replaces (modules_to_save) is checked as it is written
        if k in replace and tuple(replace[k].shape) != tuple(expected[k]):
            raise UserError(f"--ckpt {src.arg}: the adapter's {k} is {list(replace[k].shape)}, {list(expected[k])} in "
                            f"{conf_from}")
        if k not in replace and k in have and tuple(have[k][0]) != tuple(expected[k]):
            raise UserError(f"--ckpt {src.arg}: the weights do not match the architecture of {conf_from}: "
                            f"{k} is {list(have[k][0])} in the checkpoint, {list(expected[k])} in the model")
    unexpected = [k for k in have if k not in expected and not src.is_peft and not k.endswith("rotary_emb.inv_freq")]
    if unexpected:
        raise UserError(f"--ckpt {src.arg}: the checkpoint holds tensors that {conf_from} does not have "
                        f"(e.g. {unexpected[0]}); pass the right --base-model")
    fan = bool(adapter.config.get("fan_in_fan_out")) if adapter else False
    read_names = [k for k in names if k not in replace]

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        it = stream(reader, read_names, budget)
        for k in names:
            if k in replace:
                t = replace[k]
            else:
                rk, t = next(it)
                if rk != k:
                    raise RuntimeError(f"export: read {rk}, expected {k}")
                if run_dtype is not None and t.is_floating_point():
                    t = t.to(run_dtype)  # the base as the run loaded it
                if k.endswith(".weight") and k[:-7] in loras:
                    parts = loras[k[:-7]]
                    t = merge_lora(t, parts, adapter.scale(k[:-7], parts["A"].shape[0]), fan)
                elif k.endswith(".weight") and k[:-7] in tuned:
                    t = merge_tuner(adapter.config, tuned[k[:-7]], t)
                elif k.endswith(".bias") and "B_bias" in loras.get(k[:-5], {}):
                    parts = loras[k[:-5]]
                    t = t.float() + parts["B_bias"].float() * adapter.scale(k[:-5], parts["A"].shape[0])
            out_t = cast_checked(k, t, dtype)
            del t
            yield k, out_t
            del out_t

    probe = MemProbe()
    weight_map = write_sharded(tensors(), tmp, dtype=opts.dtype, max_shard_size=max_shard)
    probe.stop()
    reader.close()
    conf_dict = write_config(conf, arch, tmp, dtype, tie)
    tokenizer = tokenizer_for(src, ms)
    gen = write_generation_config(tmp, conf_dict, tokenizer, base_folder)
    has_template = write_tokenizer(tokenizer, tmp) if tokenizer is not None else False
    if not has_template:
        log("warning: the tokenizer has no chat template (chat serving needs one: re-export with a run "
            "that used --template)")
    shards = sorted(set(weight_map.values()))
    info["files"] = f"{len(shards)} safetensors shard(s), {len(weight_map)} tensors"
    if "base_ref" not in info and ms is not None:
        info["base_ref"] = base_ref(src, ms)
        info["hub_base"] = ms.hub_id
    write_readme(tmp, src, info)
    total = sum(p.stat().st_size for p in tmp.glob("*.safetensors"))
    log(f"{len(weight_map)} tensors in {len(shards)} shard(s), {opts.dtype}, tie_word_embeddings={tie}, "
        f"eos {gen.get('eos_token_id')}")
    return ExportResult(out, "model", sorted(p.name for p in tmp.iterdir()), len(weight_map), total,
                        info.get("base_desc"))


def export_adapter(src: Source, opts: ExportOptions, tmp: Path, out: Path) -> ExportResult:
    """A LoRA run without --merge-lora: the adapter alone (peft format) + tokenizer + README."""
    log = opts.log
    dtype = dtypes.torch_dtype(opts.dtype)
    adapter = load_adapter(src, log)
    ms = resolve_base(src)
    conf = model_config_for(src, ms)
    trust = bool(src.cfg.model.trust_remote_code)
    expected = expected_tensors(meta_model(conf, trust))
    check_adapter_fits(adapter, expected, src.cfg.model.model)
    c = dict(adapter.config)
    c["base_model_name_or_path"] = base_ref(src, ms)
    c["inference_mode"] = True
    write_adapter_config(c, tmp)
    tensors = {k: cast_checked(k, v, dtype) for k, v in adapter.tensors.items()}
    weights = write_adapter_weights(tensors, tmp)
    tokenizer = tokenizer_for(src, ms)
    if tokenizer is not None:
        write_tokenizer(tokenizer, tmp)
    base_desc = (f"{src.cfg.model.model} (built-in, random init with seed {src.cfg.train.seed})"
                 if ms.kind == "preset" else ms.ref)
    if src.cfg.quant.quant_bits:
        kind = ("hqq" if src.cfg.quant_method == "hqq" else
                src.cfg.quant.bnb_4bit_quant_type if src.cfg.quant.quant_bits == 4 else "int8")
        base_desc += f"; trained against its {src.cfg.quant.quant_bits}-bit quantized form ({kind})"
    infer_base = src.cfg.model.model + (f" --seed {src.cfg.train.seed}" if ms.kind == "preset" else "")
    info = {"kind": "adapter", "dtype": opts.dtype, "output_name": out.name, "base_desc": base_desc,
            "final_path": str(out), "base_is_builtin": ms.kind == "preset", "hub_base": ms.hub_id,
            "base_ref": base_ref(src, ms), "infer_base": infer_base,
            "weights_from": adapter.origin, "what": "LoRA adapter only (peft format, not merged)",
            "files": f"{ADAPTER_WEIGHTS} ({len(tensors)} tensors)"}
    write_readme(tmp, src, info)
    log(f"adapter only (no --merge-lora): {len(tensors)} tensors for base {base_desc}")
    total = weights.stat().st_size
    return ExportResult(out, "adapter", sorted(p.name for p in tmp.iterdir()), len(tensors), total, base_desc)
