"""An HF folder's *.safetensors weights, tensor by tensor."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from swiftlite.checkpoint.readers.base import TensorReader
from swiftlite.errors import UserError

# safetensors' dtype names (its file format, not a swiftlite dtype setting).
_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}


def st_dtype(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name ("BF16" -> torch.bfloat16)."""
    return _ST_DTYPES.get(name, torch.float32)


class SafetensorsReader(TensorReader):
    """An HF folder's *.safetensors, tensor by tensor (safe_open reads only what is asked)."""

    def __init__(self, folder: Path):
        from safetensors import safe_open
        self.folder = folder
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            wm = json.loads(index.read_text())["weight_map"]
            files = list(dict.fromkeys(wm.values()))
        else:
            files = sorted(p.name for p in folder.glob("*.safetensors"))
        if not files:
            raise UserError(f"{folder}: no *.safetensors weights")
        self.file_of: dict[str, str] = {}
        self.info = {}
        for fn in files:
            with safe_open(str(folder / fn), "pt") as f:
                for k in f.keys():
                    sl = f.get_slice(k)
                    self.file_of[k] = fn
                    self.info[k] = (torch.Size(sl.get_shape()), st_dtype(sl.get_dtype()))

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        from safetensors import safe_open
        out: dict[str, torch.Tensor] = {}
        by_file: dict[str, list[str]] = {}
        for n in names:
            by_file.setdefault(self.file_of[n], []).append(n)
        for fn, ns in by_file.items():
            with safe_open(str(self.folder / fn), "pt") as f:
                for n in ns:
                    out[n] = f.get_tensor(n)
        return out
