"""`swiftlite export --quant_method bnb --quant_bits 4|8`: the export as a bitsandbytes-quantized HF folder.

ms-swift's `swift export --quant_method bnb` loads the model through transformers with a
BitsAndBytesConfig and saves it (`save_pretrained` serializes bitsandbytes' 4-bit and 8-bit layers);
vLLM and transformers load such a folder as is (its config.json carries the quantization_config).
Here the same happens to the 16-bit export: the full weights (a full fine-tune, or a LoRA merged into its
base) are first written as always, in the hidden temp folder (and checked there by --verify), then that
folder is loaded quantized and saved into a second hidden folder, which replaces it. So a quantized export
is exactly "the 16-bit export, quantized by transformers", and nothing is published before both steps
are complete.

ms-swift's defaults: nf4, double quantization on, compute dtype the export's --dtype; transformers keeps
lm_head (and what it cannot quantize) in 16 bits. The quantized model is held in memory once (about a
quarter of the bf16 size at 4 bits), on the GPU when there is one, else on the CPU (bitsandbytes' CPU
backend). FP8 is export/fp8.py; GPTQ, AWQ, HQQ and EETQ need calibration data or other kernels and
are refused in the CLI.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from swiftlite import dtypes
from swiftlite.export.output import copy_other_files, replacing

BNB_4BIT_TYPES = ("nf4", "fp4")


@dataclass(frozen=True)
class BnbExport:
    bits: int                          # 4 or 8
    quant_type: str = "nf4"            # 4-bit only (ms-swift's default)
    double_quant: bool = True          # 4-bit only (ms-swift's default)
    compute_dtype: str | None = None   # 4-bit only; None: the export's --dtype

    def describe(self, dtype: str) -> str:
        if self.bits == 8:
            return "bitsandbytes int8 (LLM.int8)"
        return (f"bitsandbytes 4-bit {self.quant_type}{', double quantization' if self.double_quant else ''}, "
                f"compute dtype {self.compute_dtype or dtype}")

    def config(self, dtype: str) -> Any:
        from transformers import BitsAndBytesConfig
        if self.bits == 8:
            return BitsAndBytesConfig(load_in_8bit=True)
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=self.quant_type,
                                  bnb_4bit_use_double_quant=self.double_quant,
                                  bnb_4bit_compute_dtype=dtypes.torch_dtype(self.compute_dtype or dtype))

    def suffix(self) -> str:
        """ms-swift's output suffix: <checkpoint>-bnb-int4."""
        return f"bnb-int{self.bits}"


#: The files the quantized save writes itself; every other file of the 16-bit export is copied over.
_WEIGHTS = ("config.json", "generation_config.json")


def quantize_export(tmp: Path, q: Any, dtype: str, max_shard: int, trust_remote_code: bool,
                    log: Callable[[str], None], check: bool = False, source: Path | None = None) -> dict[str, Any]:
    """Replace the 16-bit export in `tmp` by its bitsandbytes-quantized form; or, given `source` (an HF
    folder exported as it is), write `source` quantized into `tmp`: transformers loads the folder
    itself, converting what it converts (a mixture of experts' per-expert tensors, which it fuses in
    memory), and saves it in the hub's layout again. `check` (--verify):
    reload the written folder and compare its tensors with the quantized model's in memory (equal,
    bit for bit). Returns what the README records. An FP8 export (export/fp8.py) is written there."""
    if not isinstance(q, BnbExport):
        from swiftlite.export.fp8 import fp8_export
        return fp8_export(tmp, q, dtype, max_shard, trust_remote_code, log, check, source)
    import torch
    from transformers import AutoModelForCausalLM
    device = {"": 0} if torch.cuda.is_available() else {"": "cpu"}
    log(f"quantizing: {q.describe(dtype)} on {'cuda:0' if device[''] == 0 else 'cpu'}")
    src = source or tmp
    model = AutoModelForCausalLM.from_pretrained(str(src), quantization_config=q.config(dtype),
                                                 dtype=dtypes.torch_dtype(dtype), device_map=device,
                                                 trust_remote_code=trust_remote_code)
    with replacing(tmp) as qdir:
        model.save_pretrained(str(qdir), max_shard_size=max_shard)
        qconf = json.loads((qdir / "config.json").read_text()).get("quantization_config")
        if not qconf:
            raise RuntimeError("transformers wrote no quantization_config into config.json")
        if source is None:   # config.json: the 16-bit export's (with the keys older readers need) + quantization
            conf = json.loads((tmp / "config.json").read_text())
            conf["quantization_config"] = qconf
            (qdir / "config.json").write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n")
        copy_other_files(src, qdir, skip=_WEIGHTS)
        report = {"quantization": q.describe(dtype)}
        if check:
            report["quantized reload"] = _reload_check(model, qdir, trust_remote_code, device)
    return report


def _reload_check(model: Any, folder: Path, trust_remote_code: bool, device: dict) -> str:
    """The written folder, loaded back, holds exactly the quantized model's tensors (packed weights,
    scales, quantization constants), bit for bit. Compared as tensors, not logits: bitsandbytes' CPU
    4-bit forward needs layer widths its kernel blocks divide, which small models do not have."""
    import torch
    from transformers import AutoModelForCausalLM

    from swiftlite.export.reference import VerifyError
    again = AutoModelForCausalLM.from_pretrained(str(folder), device_map=device, trust_remote_code=trust_remote_code)
    want, got = model.state_dict(), again.state_dict()
    if want.keys() != got.keys():
        missing = sorted(set(want) ^ set(got))
        raise VerifyError(f"the quantized folder reloads with other tensors than the quantized model: {missing[:3]}")
    bad = [k for k in want if not torch.equal(want[k].cpu(), got[k].cpu())]
    if bad:
        raise VerifyError(f"the quantized folder reloads with other values than the quantized model: {bad[:3]}")
    return f"the written folder reloads as the quantized model's {len(want)} tensors, bit for bit"
