"""`--verify`: the written files, every weight, and the logits on a fixed prompt, against the
training-side model rebuilt from the checkpoint (`reference.py`)."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import torch

from swiftlite import dtypes
from swiftlite.config.tasks import task_spec
from swiftlite.checkpoint import layout
from swiftlite.checkpoint.readers import ModelReader, st_dtype, tensor_value
from swiftlite.models.hqq import is_hqq_layer
from swiftlite.export.adapter import load_adapter
from swiftlite.export.output import ExportResult
from swiftlite.export.reference import VerifyError, reference_model, reference_tokenizer
from swiftlite.export.source import ExportOptions, Source, resolve_base
from swiftlite.hf_io import ADAPTER_CONFIG, ADAPTER_FILES, ADAPTER_WEIGHTS

# Logit agreement of the export (run in its dtype) with the training-side model (fp32), as
# max |diff| / max |reference logit|: at most this, or twice what the training-side model itself loses
# when cast to the export dtype, whichever is larger (docs/export.md). The e2e models land at 0.5-0.7%
# in bf16.
TOLERANCE = {"bf16": 0.04, "fp16": 0.01}
# One unit of rounding (relative) of each 16-bit dtype: merged weights may differ by this much.
ROUNDING = {"bf16": 2**-7, "fp16": 2**-10}

# Names that must never reach an exported (merged) model.
PEFT_MARKERS = ("base_layer", "lora_", "boft_", "miss_", "modules_to_save", "original_module", "lora_magnitude")

FIXED_PROMPT = [{"role": "user", "content": "reverse: abcdefgh"}]
FIXED_TEXT = "The quick brown fox jumps over the lazy dog. 0123456789"


def prompt_for(tokenizer: Any) -> torch.Tensor:
    """The fixed verification prompt as input ids (chat-rendered when a template exists)."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(FIXED_PROMPT, tokenize=False, add_generation_prompt=True)
        text += "hgfedcba"
    else:
        text = FIXED_TEXT
    if tokenizer is None:
        return torch.arange(1, 33).unsqueeze(0)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return torch.tensor([ids])


def check_files(folder: Path, kind: str, dtype: torch.dtype) -> list[str]:
    """Structural checks on the written files; returns problems."""
    from safetensors import safe_open
    problems: list[str] = []
    if kind == "adapter":
        for f in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
            if not (folder / f).is_file():
                problems.append(f"missing {f}")
        files = [folder / ADAPTER_WEIGHTS]
    else:
        for f in ("config.json", "generation_config.json", "README.md"):
            if not (folder / f).is_file():
                problems.append(f"missing {f}")
        stray = [f for f in ADAPTER_FILES if (folder / f).exists()]
        if stray:
            problems.append(f"stray adapter files: {stray}")
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            wm = json.loads(index.read_text())["weight_map"]
            files = [folder / f for f in sorted(set(wm.values()))]
            for f in files:
                if not f.is_file():
                    problems.append(f"index names missing shard {f.name}")
            files = [f for f in files if f.is_file()]
            listed = set(wm)
        else:
            files = [folder / "model.safetensors"] if (folder / "model.safetensors").is_file() else []
            if not files:
                problems.append("no model.safetensors and no index")
            listed = None
        others = [p.name for p in folder.glob("*.safetensors") if p not in files]
        if others:
            problems.append(f"safetensors files not in the index: {others}")
    seen: set[str] = set()
    for f in files:
        if not f.is_file():
            continue
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                sl = st.get_slice(k)
                shape, dt = sl.get_shape(), st_dtype(sl.get_dtype())
                seen.add(k)
                if math.prod(shape) == 0:
                    problems.append(f"zero-size tensor {k} {shape}")
                if kind != "adapter" and any(m in k for m in PEFT_MARKERS):
                    problems.append(f"peft name in a merged model: {k}")
                if dt.is_floating_point and dt != dtype:
                    problems.append(f"{k} is {dt}, expected {dtype}")
    if kind != "adapter" and files and listed is not None and listed != seen:
        problems.append(f"index and shards disagree on {len(listed ^ seen)} tensor names")
    return problems


def verify_export(folder: Path, src: Source, opts: ExportOptions, result: ExportResult) -> dict[str, Any]:
    """Load the written folder with transformers, check every key, compare logits with the training-side
    model. Raises VerifyError listing every problem; returns a summary for the log and README."""
    from transformers import AutoTokenizer

    from swiftlite.export.base_model import folder_class
    log = opts.log
    dtype = dtypes.torch_dtype(opts.dtype)
    problems = check_files(folder, result.kind, dtype)
    tokenizer = None
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # noqa: BLE001 - reported as a verification failure
        if result.kind == "model":
            problems.append(f"tokenizer does not load: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
    if result.kind == "model":
        if tokenizer is not None and not getattr(tokenizer, "chat_template", None) and src.cfg is not None \
                and task_spec(src.cfg.task).needs_chat_template:
            problems.append("tokenizer has no chat template")
        exported, loading = folder_class(folder).from_pretrained(str(folder), dtype=dtype, output_loading_info=True)
        for what in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
            got = loading.get(what) or []
            if got:
                problems.append(f"{what.replace('_', ' ')} when loading with transformers: {sorted(map(str, got))[:5]}")
        conf = json.loads((folder / "config.json").read_text())
        if conf.get("dtype") != dtypes.hf_name(opts.dtype):
            problems.append(f"config.json dtype {conf.get('dtype')}, expected {dtypes.hf_name(opts.dtype)}")
        emb, head = exported.get_input_embeddings(), exported.get_output_embeddings()
        if head is not None and emb is not None:
            shared = head.weight.data_ptr() == emb.weight.data_ptr()
            if shared != bool(conf.get("tie_word_embeddings")):
                problems.append(f"tie_word_embeddings={conf.get('tie_word_embeddings')} but the loaded model "
                                f"{'shares' if shared else 'does not share'} lm_head and embeddings")
        bad = [n for n, p in exported.named_parameters() if p.is_floating_point() and p.dtype != dtype]
        if bad:
            problems.append(f"parameters not in {opts.dtype} after loading: {bad[:3]}")
    else:
        from peft import PeftModel

        from swiftlite.models.loading import load_model
        ms = resolve_base(src)
        cfg = copy.deepcopy(src.cfg)
        base = load_model(cfg, ms)
        from swiftlite.models.quant import disable_cpu_repack
        disable_cpu_repack(base)
        exported = PeftModel.from_pretrained(base, str(folder))
    exported.eval()
    ref, ref_desc = reference_model(src)
    report: dict[str, Any] = {"reference": ref_desc}

    # 1. Weights: each exported tensor against the training-side one cast to the export dtype.
    #    Full fine-tunes must match exactly; LoRA merges within rounding (peft's get_delta_weight on the
    #    base as trained: dequantized for QLoRA).
    if result.kind == "model":
        want = reference_weights(ref)
        got = exported.state_dict()
        # DeepSpeed keeps fp32 masters next to 16-bit module weights (the reference): exporting them
        # to another 16-bit dtype rounds once where the reference rounded twice.
        run_dtype = src.cfg.model.torch_dtype if src.cfg is not None else "fp32"
        double = src.weights is layout.CheckpointFormat.DS and run_dtype not in ("fp32", opts.dtype)
        exact = not src.is_peft and not double
        rtol = ROUNDING[opts.dtype]
        if double:
            rtol = max(rtol, ROUNDING[run_dtype])
        worst, bad_names = 0.0, []
        for k, a in got.items():
            if k not in want:
                bad_names.append(f"{k} (not in the training-side model)")
                continue
            w = want[k]
            if not a.is_floating_point():
                ok = torch.equal(a, w)
            elif exact:
                ok = torch.equal(a, w.to(dtype))
            else:
                err = (a.float() - w.float()).abs() / (w.float().abs() + 1e-8)
                worst = max(worst, float(err.max()) if err.numel() else 0.0)
                ok = bool(torch.isclose(a.float(), w.float(), rtol=rtol, atol=1e-8).all())
            if not ok:
                bad_names.append(k)
        if bad_names:
            problems.append(f"{len(bad_names)} exported tensors differ from the training-side model "
                            f"{'cast to ' + opts.dtype if exact else 'beyond rounding'}: {bad_names[:3]}")
        report["weights"] = (f"{len(got)} tensors {'equal to the training-side ones cast to ' + opts.dtype if exact else f'within {rtol:.2g} relative (rounding) of the merged training-side ones, worst {worst:.2g}'}"
                             if not bad_names else f"{len(bad_names)} of {len(got)} differ")
    else:
        adapter = load_adapter(src, lambda _m: None)
        from safetensors.torch import load_file
        got = load_file(str(folder / ADAPTER_WEIGHTS))
        bad_names = [k for k, v in adapter.tensors.items() if k not in got or not torch.equal(got[k], v.to(dtype))]
        if bad_names or set(got) != set(adapter.tensors):
            problems.append(f"adapter tensors differ from the checkpoint's: {bad_names[:3]}")
        report["weights"] = f"{len(got)} adapter tensors equal to the checkpoint's cast to {opts.dtype}"

    # 2. Logits on a fixed prompt: the export (in its dtype, as a server runs it) against the
    #    training-side model in fp32. Tolerance: 4% of the logit scale, or twice the error the
    #    training-side model itself makes when cast to the export dtype, whichever is larger.
    ref_tok = reference_tokenizer(src)
    ids = prompt_for(ref_tok or tokenizer)
    if tokenizer is not None and ref_tok is not None and getattr(ref_tok, "chat_template", None):
        ids_export = prompt_for(tokenizer)
        if not torch.equal(ids_export, ids):
            problems.append("the exported tokenizer renders the fixed prompt differently from the training one")
    with torch.no_grad():
        ref_logits = ref(input_ids=ids).logits.float()
        exp_logits = exported(input_ids=ids).logits.float()
    scale = max(float(ref_logits.abs().max()), 1e-6)
    diff = float((exp_logits - ref_logits).abs().max())
    rel = diff / scale
    cal = None
    quantized = any(getattr(p, "quant_state", None) is not None or p.dtype == torch.int8 for p in ref.parameters()) \
        or any(is_hqq_layer(m) for m in ref.modules())   # a quantized base computes in its own dtype
    if not quantized:
        ref.to(dtype)  # the training-side model itself at the export dtype: what rounding alone costs
        with torch.no_grad():
            cal = float((ref(input_ids=ids).logits.float() - ref_logits).abs().max()) / scale
    tol = max(TOLERANCE[opts.dtype], 2 * cal) if cal is not None else TOLERANCE[opts.dtype]
    top1 = float((exp_logits.argmax(-1) == ref_logits.argmax(-1)).float().mean())
    if not math.isfinite(rel) or rel > tol:
        problems.append(f"logits differ from the training-side model: max |diff| {diff:.4g} = {rel:.2%} of the "
                        f"logit scale {scale:.3g} (tolerance {tol:.1%})")
    report.update({"prompt tokens": int(ids.shape[1]), "max abs logit diff": f"{diff:.4g}",
                   "logit scale (max |ref|)": f"{scale:.4g}",
                   "relative diff": f"{rel:.3%} (tolerance {tol:.1%})",
                   "training-side model cast to " + opts.dtype: ("-" if cal is None else f"{cal:.3%}"),
                   "top-1 agreement": f"{top1:.1%}",
                   "checks": "passed" if not problems else "FAILED"})
    for k, v in report.items():
        log(f"verify: {k}: {v}")
    if problems:
        raise VerifyError("; ".join(problems))
    return report


def reference_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """HF-named weights of the training-side model; for a peft model the merged values computed by
    peft itself (base weight, dequantized for 4/8-bit, + get_delta_weight; modules_to_save copies)."""
    from peft import PeftModel
    if not isinstance(model, PeftModel):
        reader = ModelReader(model)
        return reader.read(reader.names())
    from peft.tuners.boft import BOFTLayer
    from peft.tuners.lora import LoraLayer
    from peft.tuners.miss import MissLayer
    from peft.utils import ModulesToSaveWrapper
    inner = model.get_base_model()
    name = model.active_adapter if isinstance(model.active_adapter, str) else model.active_adapter[0]
    out: dict[str, torch.Tensor] = {}
    done: list[str] = []
    for mname, mod in inner.named_modules():
        if any(mname.startswith(p) for p in done):
            continue
        if isinstance(mod, LoraLayer):
            base = mod.get_base_layer()
            w = tensor_value(base, "weight", getattr(base, "weight", None)).float()   # HQQ: no .weight
            merged = w + mod.get_delta_weight(name).float().reshape(w.shape)
            if mod.use_dora.get(name):   # peft's DoRA merge: magnitude / row norm of the merged weight
                dora = mod.lora_magnitude_vector[name]
                norm = dora.get_weight_norm(w, merged - w, scaling=1).detach()
                merged = (dora.weight.detach().float() / norm).view(-1, 1) * merged
            out[f"{mname}.weight"] = merged
            if getattr(base, "bias", None) is not None:
                out[f"{mname}.bias"] = base.bias.detach().float()
            done.append(mname + ".")
        elif isinstance(mod, (BOFTLayer, MissLayer)):   # peft's own merge, on a copy (BOFT: a rotation;
            # MiSS: a block tiled over the input columns, or bat's product with the weight's blocks)
            from swiftlite.models.tuners import boft_layers
            with boft_layers(1, "adapter boft_n_butterfly_factor"):
                merged_mod = copy.deepcopy(mod)
            merged_mod.merge()
            base = merged_mod.get_base_layer()
            out[f"{mname}.weight"] = base.weight.detach().float()
            if getattr(base, "bias", None) is not None:
                out[f"{mname}.bias"] = base.bias.detach().float()
            done.append(mname + ".")
        elif isinstance(mod, ModulesToSaveWrapper):
            for n, t in mod.modules_to_save[name].state_dict().items():
                out[f"{mname}.{n}"] = t.detach()
            done.append(mname + ".")
        else:
            non_persistent = getattr(mod, "_non_persistent_buffers_set", set())
            own = list(mod.named_parameters(recurse=False))
            own += [(n, b) for n, b in mod.named_buffers(recurse=False) if n not in non_persistent]
            if is_hqq_layer(mod):   # an HQQ layer no adapter wraps: its weight, not the packed W_q
                own = [("weight", None)] + ([("bias", mod.bias)] if mod.bias is not None else [])
            for n, t in own:
                out[f"{mname}.{n}" if mname else n] = tensor_value(mod, n, t)
    return out
