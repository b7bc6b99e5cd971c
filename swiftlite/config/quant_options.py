"""The quantized base's options (`--quant_method`, `--quant_bits`, `--hqq_axis`, `--bnb_4bit_*`), with
ms-swift's names (swift/arguments/base_args/quant_args.py). A section of schema.RunConfig, kept here so
that schema.py stays short; models/quant.py (bitsandbytes) and models/hqq.py (HQQ) quantize, and
config/rules.py says which combinations run.
"""

from __future__ import annotations

from dataclasses import dataclass

from swiftlite.config.access import Section, opt
from swiftlite.dtypes import NAMES as DTYPES
from swiftlite.dtypes import normalize as _dtype_name


@dataclass(kw_only=True)
class QuantConfig(Section):
    quant_method: str | None = opt(None, "How the base is quantized: bnb (bitsandbytes, 4 or 8 bits; the default) or "
                                   "hqq (1/2/3/4/8 bits; single, ddp, zero1/2).", choices=("bnb", "hqq"))
    quant_bits: int | None = opt(None, "Bits of the quantized base (bnb: 4 or 8). --qlora implies 4.")
    hqq_axis: int | None = opt(None, "HQQ's grouping axis, 0 or 1 (default 1, transformers' HqqConfig).")
    bnb_4bit_quant_type: str = opt("nf4", "4-bit quantization type.", choices=("nf4", "fp4"))
    bnb_4bit_use_double_quant: bool = opt(True, "Double quantization of the 4-bit constants.")
    bnb_4bit_compute_dtype: str | None = opt(None, "Matmul dtype of the 4-bit layers: always --torch-dtype here "
                                             "(accepted when equal to it).", choices=DTYPES, normalize=_dtype_name)
    bnb_4bit_quant_storage: str | None = opt(None, "Storage dtype of the packed 4-bit weights: always --torch-dtype "
                                             "here, so FSDP/ZeRO-3 can shard them (accepted when equal to it).",
                                             choices=DTYPES, normalize=_dtype_name)
