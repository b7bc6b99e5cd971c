"""`swiftlite export --quant_method fp8`: the export as a block-wise FP8 HF folder (transformers'
FineGrainedFP8 format, which vLLM and SGLang serve as "fp8" with weight_block_size).

ms-swift's `swift export --quant_method fp8` loads the model through transformers with a
FineGrainedFP8Config and saves it. transformers quantizes at load only on a GPU (compute capability
8.9+) or an XPU; the quantization itself is a tensor operation, so here the written 16-bit export is
quantized file by file with transformers' own operation (`Fp8Quantize`, the one its loader applies)
on the CPU or wherever the tensors are, and the folder gets the config transformers would write. So
the result is the same folder ms-swift writes, on any machine, holding about one shard in memory.

Format (what transformers' FP8Linear / FP8Experts and vLLM's block-wise fp8 read):
- each quantized Linear's `weight` is float8_e4m3fn, with `weight_scale_inv` (float32, one per
  128 x 128 block: the block's max |w| / 448) next to it; the dequantized weight is weight x scale;
- config.json's `quantization_config` is FineGrainedFP8Config's: quant_method fp8, dynamic
  activation scales, weight_block_size [128, 128], modules_to_not_convert;
- not quantized, as transformers leaves them: the output head (transformers' modules_to_not_convert
  default, which ms-swift passes too), embeddings, norms, biases; and any Linear whose shape the block
  does not divide, which is named in modules_to_not_convert so that loaders keep it 16-bit, as is any
  other module keeping a 2-D weight (a mixture of experts' router, `mlp.gate`).

A mixture of experts is written in the hub's layout, one tensor per expert and projection
(`mlp.experts.3.gate_proj.weight`, FP8, with its `weight_scale_inv`), as the official FP8 checkpoints
(Qwen3-30B-A3B-FP8) store it and vLLM's per-expert loader reads it; transformers 5 stacks them into its
fused 3-D parameters (`experts.gate_up_proj`) as it loads. Which tensors those are comes from
transformers' own conversion table: its save-side conversion (`revert_weight_conversion`) names the
per-expert tensors of each fused parameter, and a 16-bit export holding the fused tensors (what a
checkpoint's export writes) is cut into them by that same conversion as it is written. transformers
swaps a module named `*.experts` for FP8Experts whole, so its projections are quantized all or none:
none when the blocks divide none of them (or it has biases, which FP8Experts does not hold), and the
module is then named in modules_to_not_convert; a module the blocks divide only in part is refused.

--verify: the folder is loaded back by transformers, dequantized to 16 bits (its `dequantize` load, what
it also falls back to without an FP8 GPU), and every quantized parameter must equal the 16-bit one to
FP8's rounding (3 mantissa bits: |error| <= 2^-4 of the block's largest value, plus the 16-bit rounding);
an experts parameter is compared with the 16-bit per-expert tensors stacked by transformers' load-side
conversion, the one that built the reloaded parameter.
"""

from __future__ import annotations

import json
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from swiftlite.errors import UserError

#: transformers' default block (FineGrainedFP8Config.weight_block_size), as ms-swift uses it.
BLOCK = (128, 128)
#: e4m3's mantissa bits: the relative rounding of a block's largest value is at most 2^-(bits + 1).
_MANTISSA = 3


@dataclass(frozen=True)
class Fp8Export:
    method: str = "fp8"

    def describe(self, dtype: str) -> str:
        return (f"FP8 e4m3 weights in {BLOCK[0]} x {BLOCK[1]} blocks with a float32 scale each (transformers' "
                f"FineGrainedFP8, dynamic activation scales); the rest {dtype}")

    def suffix(self) -> str:
        return "fp8"

    def note(self) -> str:
        return "quantized block by block with transformers' FineGrainedFP8 quantization operation."


@dataclass
class _Plan:
    model: Any                                      # the architecture on the meta device: transformers' conversions
    quantized: dict[str, list[str]] = field(default_factory=dict)   # model parameter -> its tensors written in FP8
    fused: set[str] = field(default_factory=set)    # source tensors in transformers' in-memory layout: cut per expert
    skip: list[str] = field(default_factory=list)   # modules_to_not_convert

    def names(self) -> set[str]:
        return {n for pieces in self.quantized.values() for n in pieces}


def _fp8_config(skip: list[str]) -> Any:
    from transformers import FineGrainedFP8Config
    return FineGrainedFP8Config(modules_to_not_convert=skip, weight_block_size=BLOCK)


def _dequantizing(skip: list[str]) -> Any:
    from transformers import FineGrainedFP8Config
    return FineGrainedFP8Config(modules_to_not_convert=skip, weight_block_size=BLOCK, dequantize=True)


def _saved(model: Any, name: str, t: Any) -> dict[str, Any]:
    """The checkpoint tensors transformers' save_pretrained writes for the model's tensor `name`: itself, or
    for a fused experts parameter one tensor per expert and projection."""
    from transformers.core_model_loading import revert_weight_conversion
    return revert_weight_conversion(model, {name: t})


def _merged(model: Any, tensors: dict[str, Any]) -> dict[str, Any]:
    """Checkpoint tensors as transformers' loader turns them into the model's parameters: the conversion
    table's converters (per-expert tensors stacked into the fused ones), fed in the loader's key order."""
    from copy import deepcopy

    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key
    table = get_model_conversion_mapping(model)
    renamings = [c for c in table if isinstance(c, WeightRenaming)]
    converters = [c for c in table if isinstance(c, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    out: dict[str, Any] = {}
    groups: dict[str, Any] = {}
    for key in sorted(tensors, key=dot_natural_key):
        target, pattern = rename_source_key(key, renamings, converters)
        if pattern is None:
            out[target] = tensors[key]
            continue
        groups.setdefault(target, deepcopy(by_pattern[pattern])).add_tensor(target, key, pattern, tensors[key])
    for target, converter in groups.items():
        out.update(converter.convert(target, model=model, config=model.config))
    return out


def _divides(t: Any) -> bool:
    return t.ndim == 2 and t.shape[0] % BLOCK[0] == 0 and t.shape[1] % BLOCK[1] == 0


def _plan(folder: Path, trust_remote_code: bool, have: set[str]) -> _Plan:
    """What to quantize, from the architecture built on the meta device and the source's tensor names
    (`have`): Linear weights but the output head's (skipped as transformers skips it) and each `*.experts`
    module's per-expert projections."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    head = model.get_output_embeddings()
    plan = _Plan(model, skip=sorted({n for n, m in model.named_modules() if m is head and n}))

    def stored(param: str, pieces: dict[str, Any]) -> None:
        if param in have and set(pieces) != {param}:
            plan.fused.add(param)
        elif not set(pieces) <= have:
            missing = sorted(set(pieces) - have)[0]
            raise UserError(f"--quant_method fp8: {folder.name}'s safetensors lack {missing} (a layout transformers "
                            "converts at load); export it 16-bit first, then quantize that folder")

    for n, m in model.named_modules():
        own = {f"{n}.{k}": p for k, p in m.named_parameters(recurse=False)}
        if n.endswith(".experts") and any(p.ndim == 3 for p in own.values()):
            # transformers' FP8 load swaps a module so named for FP8Experts (replace_with_fp8_linear)
            pieces = {p: _saved(model, p, t) for p, t in own.items()}
            for p, saved in pieces.items():
                stored(p, saved)
            weights = {p: saved for p, saved in pieces.items() if own[p].ndim == 3}
            cut = [(k, t) for saved in weights.values() for k, t in saved.items() if not _divides(t)]
            if getattr(m, "has_bias", False) or len(cut) == sum(len(s) for s in weights.values()):
                plan.skip.append(n)      # FP8Experts holds no biases; the blocks divide none of its projections
            elif cut:
                raise UserError(f"--quant_method fp8: {cut[0][0]} is {list(cut[0][1].shape)}, which {BLOCK[0]} x "
                                f"{BLOCK[1]} blocks do not divide, while they divide other projections of {n}; "
                                "transformers quantizes an experts module whole, so it cannot be kept 16-bit in part")
            else:
                plan.quantized.update({p: list(saved) for p, saved in weights.items()})
        elif isinstance(m, torch.nn.Linear) and m is not head:
            p = f"{n}.weight"
            if _divides(m.weight):
                plan.quantized[p] = list(_saved(model, p, m.weight))
                stored(p, dict.fromkeys(plan.quantized[p]))
            else:
                plan.skip.append(n)
        elif (m is not head and not isinstance(m, torch.nn.Embedding)
              and getattr(own.get(f"{n}.weight"), "ndim", 0) == 2):
            # a 2-D weight outside the Linears, such as a router: named so that a loader building it as a
            # linear layer that it would quantize keeps it 16-bit, as it is stored
            plan.skip.append(n)
    if not plan.quantized:
        raise UserError(f"--quant_method fp8: no linear layer of {folder.name} has a shape that {BLOCK[0]} x "
                        f"{BLOCK[1]} blocks divide; nothing would be quantized")
    return plan


def fp8_export(tmp: Path, q: Fp8Export, dtype: str, max_shard: int, trust_remote_code: bool,
               log: Callable[[str], None], check: bool = False, source: Path | None = None) -> dict[str, Any]:
    """Replace the 16-bit export in `tmp` by its FP8 form; or, given `source` (an HF folder exported as
    it is), write `source` in FP8 into `tmp`. Returns what the README records."""
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    from swiftlite import dtypes
    from swiftlite.checkpoint.readers import SafetensorsReader, stream
    from swiftlite.export.output import copy_other_files, replacing
    from swiftlite.hf_io import write_sharded
    src = source or tmp
    reader = SafetensorsReader(src)
    plan = _plan(src, trust_remote_code, set(reader.file_of))
    names = plan.names()
    experts = sum(len(v) for k, v in plan.quantized.items() if plan.model.get_parameter(k).ndim == 3)
    counted = f"{len(names)} weights" + (f", {experts} of them experts' projections" if experts else "")
    qconf = _fp8_config(plan.skip)
    quantize = Fp8Quantize(types.SimpleNamespace(quantization_config=qconf))
    log(f"quantizing: {q.describe(dtype)} on cpu ({counted})")
    half = dtypes.torch_dtype(dtype)

    def tensors():
        for name, t in stream(reader, sorted(reader.file_of), max(max_shard // 2, 1)):
            # a fused experts tensor is written as the per-expert tensors transformers saves it as
            parts = _saved(plan.model, name, t) if name in plan.fused else {name: t}
            for k, v in parts.items():
                v = v.to(half) if v.is_floating_point() else v
                if k in names:
                    yield from quantize._quantize_one(k, v).items()
                else:
                    yield k, v.contiguous()

    with replacing(tmp) as qdir:
        write_sharded(tensors(), qdir, dtype=None, max_shard_size=max_shard)
        conf = json.loads((src / "config.json").read_text())
        conf["quantization_config"] = json.loads(qconf.to_json_string(use_diff=False))
        (qdir / "config.json").write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n")
        copy_other_files(src, qdir)
        report = {"quantization": q.describe(dtype),
                  "fp8 layers": f"{counted}; kept {dtype}: {', '.join(plan.skip) or 'none'}"}
        if check:
            report["quantized reload"] = _reload_check(src, qdir, plan, trust_remote_code)
    return report


def _block_error(got: Any, want: Any) -> float:
    """The largest |got - want| over the largest |want| of its 128 x 128 block (of the last two dims)."""
    import torch
    *lead, rows, cols = want.shape
    blocks = want.float().reshape(*lead, rows // BLOCK[0], BLOCK[0], cols // BLOCK[1], BLOCK[1])
    amax = blocks.abs().amax(dim=(-3, -1), keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    return ((got.float() - want.float()).reshape(blocks.shape).abs() / amax).max().item()


def _reload_check(src: Path, folder: Path, plan: _Plan, trust_remote_code: bool) -> str:
    """transformers loads the written folder (dequantizing where it cannot run FP8), and each quantized
    parameter equals the 16-bit one to FP8's rounding, block by block."""
    from transformers import AutoModelForCausalLM

    from swiftlite.checkpoint.readers import SafetensorsReader
    from swiftlite.export.reference import VerifyError
    # dequantize=True: the check is of the stored values, so they are read back as 16-bit weights on any device
    again = AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=trust_remote_code,
                                                 quantization_config=_dequantizing(plan.skip))
    live = dict(again.named_parameters())
    reader, worst = SafetensorsReader(src), 0.0
    for name, pieces in sorted(plan.quantized.items()):
        if name in reader.file_of:    # a Linear's weight, or an experts parameter the source holds fused
            want = reader.read([name])[name]
        else:                         # the per-expert tensors, stacked as the loader stacked the reloaded ones
            want = _merged(plan.model, reader.read(pieces))[name]
        got = live[name].detach()
        if tuple(got.shape) != tuple(want.shape):
            raise VerifyError(f"{name}: reloaded as {list(got.shape)}, {list(want.shape)} in the 16-bit export")
        err = _block_error(got, want)
        worst = max(worst, err)
        if err > 2.0 ** -(_MANTISSA + 1) + 2.0 ** -7:
            raise VerifyError(f"{name}: reloaded FP8 weight differs from the 16-bit one by {err:.3g} of its block's "
                              "largest value, more than FP8 rounding")
    return (f"transformers reloads the folder; each of its {len(plan.quantized)} parameters stored in FP8 "
            f"({len(plan.names())} tensors) is the 16-bit one to FP8 rounding (largest error {worst:.3g} of "
            "its block's largest value)")
