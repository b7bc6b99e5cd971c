"""`swiftlite export --quant_method fp8`: the export as a block-wise FP8 HF folder (transformers'
FineGrainedFP8 format, which vLLM and SGLang serve as "fp8" with weight_block_size).

ms-swift's `swift export --quant_method fp8` loads the model through transformers with a
FineGrainedFP8Config and saves it. transformers quantizes at load only on a GPU (compute capability
8.9+) or an XPU; the quantization itself is a tensor operation, so here the written 16-bit export is
quantized file by file with transformers' own operation (`Fp8Quantize`, the one its loader applies)
on the CPU or wherever the tensors are, and the folder gets the config transformers would write. So
the result is the same folder ms-swift writes, on any machine, holding about one shard in memory.

Format (what transformers' FP8Linear and vLLM's block-wise fp8 read):
- each quantized Linear's `weight` is float8_e4m3fn, with `weight_scale_inv` (float32, one per
  128 x 128 block: the block's max |w| / 448) next to it; the dequantized weight is weight x scale;
- config.json's `quantization_config` is FineGrainedFP8Config's: quant_method fp8, dynamic
  activation scales, weight_block_size [128, 128], modules_to_not_convert;
- not quantized, as transformers leaves them: the output head (transformers' modules_to_not_convert
  default, which ms-swift passes too), embeddings, norms, biases; and any Linear whose shape the block
  does not divide, which is named in modules_to_not_convert so that loaders keep it 16-bit.

A mixture of experts is refused: transformers 5 fuses each layer's experts into 3-D tensors, and
ms-swift itself sends FP8 MoE exports to its Megatron path (examples/export/quantize/moe/fp8.sh).

--verify: the folder is loaded back by transformers, dequantized to 16 bits (its `dequantize` load, what
it also falls back to without an FP8 GPU), and every quantized weight must equal the 16-bit one to FP8's
rounding (3 mantissa bits: |error| <= 2^-4 of the block's largest value, plus the 16-bit rounding).
"""

from __future__ import annotations

import json
import types
from dataclasses import dataclass
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


def _fp8_config(skip: list[str]) -> Any:
    from transformers import FineGrainedFP8Config
    return FineGrainedFP8Config(modules_to_not_convert=skip, weight_block_size=BLOCK)


def _dequantizing(skip: list[str]) -> Any:
    from transformers import FineGrainedFP8Config
    return FineGrainedFP8Config(modules_to_not_convert=skip, weight_block_size=BLOCK, dequantize=True)


def _plan(folder: Path, trust_remote_code: bool) -> tuple[set[str], list[str]]:
    """(names of the Linear weights to quantize, modules to keep 16-bit): from the architecture built on
    the meta device, the output head skipped as transformers skips it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    fused = [n for n, p in model.named_parameters() if p.ndim > 2]
    if fused:
        raise UserError(f"--quant_method fp8: {folder.name} is a mixture of experts ({fused[0]}: transformers fuses "
                        "the experts into 3-D tensors); ms-swift exports FP8 MoE models with Megatron; export it "
                        "16-bit or with --quant_method bnb")
    head = model.get_output_embeddings()
    skip = sorted({n for n, m in model.named_modules() if m is head and n})
    names: set[str] = set()
    for n, m in model.named_modules():
        if not isinstance(m, torch.nn.Linear) or m is head:
            continue
        rows, cols = m.weight.shape
        if rows % BLOCK[0] or cols % BLOCK[1]:
            skip.append(n)
        else:
            names.add(f"{n}.weight")
    if not names:
        raise UserError(f"--quant_method fp8: no linear layer of {folder.name} has a shape that {BLOCK[0]} x "
                        f"{BLOCK[1]} blocks divide; nothing would be quantized")
    return names, skip


def fp8_export(tmp: Path, q: Fp8Export, dtype: str, max_shard: int, trust_remote_code: bool,
               log: Callable[[str], None], check: bool = False, source: Path | None = None) -> dict[str, Any]:
    """Replace the 16-bit export in `tmp` by its FP8 form; or, given `source` (an HF folder exported as
    it is), write `source` in FP8 into `tmp`. Returns what the README records."""
    import torch
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    from swiftlite import dtypes
    from swiftlite.checkpoint.readers import SafetensorsReader, stream
    from swiftlite.export.output import copy_other_files, replacing
    from swiftlite.hf_io import write_sharded
    src = source or tmp
    names, skip = _plan(src, trust_remote_code)
    qconf = _fp8_config(skip)
    quantize = Fp8Quantize(types.SimpleNamespace(quantization_config=qconf))
    log(f"quantizing: {q.describe(dtype)} on cpu ({len(names)} linear weights)")
    reader = SafetensorsReader(src)
    missing = sorted(names - set(reader.file_of))
    if missing:
        raise UserError(f"--quant_method fp8: {src.name}'s safetensors lack {missing[0]} (a layout transformers "
                        "converts at load); export it 16-bit first, then quantize that folder")
    half = dtypes.torch_dtype(dtype)

    def tensors():
        for name, t in stream(reader, sorted(reader.file_of), max(max_shard // 2, 1)):
            if name in names:
                yield from quantize._quantize_one(name, t.to(half)).items()
            else:
                yield name, t.to(half) if t.is_floating_point() else t

    with replacing(tmp) as qdir:
        write_sharded(tensors(), qdir, dtype=None, max_shard_size=max_shard)
        conf = json.loads((src / "config.json").read_text())
        conf["quantization_config"] = json.loads(qconf.to_json_string(use_diff=False))
        (qdir / "config.json").write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n")
        copy_other_files(src, qdir)
        report = {"quantization": q.describe(dtype),
                  "fp8 layers": f"{len(names)} linear weights; kept {dtype}: {', '.join(skip) or 'none'}"}
        if check:
            report["quantized reload"] = _reload_check(src, qdir, names, skip, trust_remote_code)
    return report


def _reload_check(src: Path, folder: Path, names: set[str], skip: list[str], trust_remote_code: bool) -> str:
    """transformers loads the written folder (dequantizing where it cannot run FP8), and each quantized
    weight equals the 16-bit one to FP8's rounding, block by block."""
    import torch
    from transformers import AutoModelForCausalLM

    from swiftlite.checkpoint.readers import SafetensorsReader
    from swiftlite.export.reference import VerifyError
    # dequantize=True: the check is of the stored values, so they are read back as 16-bit weights on any device
    again = AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=trust_remote_code,
                                                 quantization_config=_dequantizing(skip))
    live = dict(again.named_parameters())
    reader, worst = SafetensorsReader(src), 0.0
    for name in sorted(names):
        want = reader.read([name])[name].float()
        got = live[name].detach().float()
        rows, cols = want.shape
        blocks = want.reshape(rows // BLOCK[0], BLOCK[0], cols // BLOCK[1], BLOCK[1])
        amax = blocks.abs().amax(dim=(1, 3), keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
        err = ((got - want).reshape(blocks.shape).abs() / amax).max().item()
        worst = max(worst, err)
        if err > 2.0 ** -(_MANTISSA + 1) + 2.0 ** -7:
            raise VerifyError(f"{name}: reloaded FP8 weight differs from the 16-bit one by {err:.3g} of its block's "
                              "largest value, more than FP8 rounding")
    return (f"transformers reloads the folder; each of the {len(names)} FP8 weights is the 16-bit one to FP8 "
            f"rounding (largest error {worst:.3g} of its block's largest value)")
