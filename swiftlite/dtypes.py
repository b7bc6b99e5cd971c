"""The one dtype table: swiftlite's short names <-> torch dtypes <-> Hugging Face config names.

`--torch-dtype` takes the short names (bf16, fp16, fp32) and the spellings ms-swift and
transformers use (bfloat16, float16, float32); `normalize` folds them. torch is imported only when a
torch dtype is asked for, so the CLI can use this module at `--help` time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

#: The names a run config holds.
NAMES = ("bf16", "fp16", "fp32")
#: Other spellings accepted on input (ms-swift / transformers / torch).
ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}
#: The name Hugging Face writes in config.json ("torch_dtype"/"dtype").
HF_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
#: 16-bit names (exported weights, mixed precision).
HALF = ("bf16", "fp16")
BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def normalize(name: Any) -> str:
    """A short name from any accepted spelling; the input unchanged when it is not one (the caller
    then reports it)."""
    s = str(name).strip().lower()
    if s.startswith("torch."):
        s = s[len("torch."):]
    return ALIASES.get(s, s)


def torch_dtype(name: str) -> "torch.dtype":
    """torch dtype for a short name (or an accepted alias)."""
    import torch
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[normalize(name)]


def from_torch(dtype: "torch.dtype") -> str:
    """Short name of a torch dtype (bf16/fp16/fp32); other dtypes by their torch name."""
    text = str(dtype).replace("torch.", "")
    return normalize(text)


def hf_name(name: str) -> str:
    """bfloat16/float16/float32 for config.json."""
    return HF_NAMES[normalize(name)]
