"""Writing Hugging Face model folders: sharded safetensors + index, streamed.

Tensors arrive one at a time (an iterator), are cast to the target dtype, and are flushed to a
shard file as soon as the shard reaches `max_shard_size` bytes, so peak memory is about one shard.
Shards get their final `model-0000i-of-0000n` names once n is known. Names and layout follow
transformers' `save_pretrained`, which vLLM and LMDeploy read.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Iterable, Iterator

import torch
from safetensors.torch import save_file

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str | int, flag: str = "--max-shard-size") -> int:
    """'5GB' -> 5e9 bytes, '100MiB' -> 100*2**20; a bad value is a UserError naming the flag."""
    from swiftlite.errors import UserError
    if isinstance(text, int):
        return text
    m = _SIZE.match(str(text))
    if not m:
        raise UserError(f"{flag}: cannot read size {text!r} (e.g. 5GB, 500MB, 80GiB)")
    value = float(m.group(1)) * _UNITS[(m.group(2) or "B").upper()]
    if value <= 0:
        raise UserError(f"{flag}: size must be > 0, got {text!r}")
    return int(value)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def write_sharded(tensors: Iterable[tuple[str, torch.Tensor]], out: Path, *, dtype: str | None,
                  max_shard_size: int, prefix: str = "model") -> dict[str, str]:
    """Stream (name, tensor) pairs into `prefix-0000i-of-0000n.safetensors` files + index.

    Floating tensors are cast to `dtype` (None keeps them). Returns name -> shard file. With one
    shard the file is `prefix.safetensors` and no index is written (as save_pretrained does).
    """
    out.mkdir(parents=True, exist_ok=True)
    target = DTYPES[dtype] if dtype else None
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = 0
    tmp_files: list[tuple[Path, list[str]]] = []
    total = 0

    def flush() -> None:
        nonlocal shard, shard_bytes
        if not shard:
            return
        path = out / f".shard-{len(tmp_files):05d}.tmp"
        save_file(shard, str(path), metadata={"format": "pt"})
        tmp_files.append((path, list(shard)))
        shard, shard_bytes = {}, 0

    for name, t in tensors:
        t = t.detach()
        if target is not None and t.is_floating_point():
            t = t.to(target)
        t = t.contiguous().cpu()
        size = _nbytes(t)
        if shard and shard_bytes + size > max_shard_size:
            flush()
        shard[name] = t.clone() if t.data_ptr() in {v.data_ptr() for v in shard.values()} else t
        shard_bytes += size
        total += size
    flush()
    n = len(tmp_files)
    weight_map: dict[str, str] = {}
    for i, (path, names) in enumerate(tmp_files):
        final = f"{prefix}.safetensors" if n == 1 else f"{prefix}-{i + 1:05d}-of-{n:05d}.safetensors"
        os.replace(path, out / final)
        for k in names:
            weight_map[k] = final
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / f"{prefix}.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return weight_map


def drop_tied(sd_items: Iterable[tuple[str, torch.Tensor]], tie_word_embeddings: bool
              ) -> Iterator[tuple[str, torch.Tensor]]:
    """Skip lm_head.weight when it is tied to the embeddings (save_pretrained does the same)."""
    for k, v in sd_items:
        if tie_word_embeddings and k.endswith("lm_head.weight"):
            continue
        yield k, v
