"""The reader interface and bounded-memory iteration over it."""

from __future__ import annotations

import math
import time
from typing import Iterable, Iterator

import torch

from swiftlite import env


class TensorReader:
    """names() in checkpoint order, shape/dtype per name, read(names) -> {name: tensor}."""
    info: dict[str, tuple[torch.Size, torch.dtype]]

    def names(self) -> list[str]:
        return list(self.info)

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def close(self) -> None:
        pass


def nbytes(shape: Iterable[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def batches(reader: TensorReader, names: list[str], budget: int) -> Iterator[list[str]]:
    """Consecutive names whose source bytes add up to at most `budget` (one name may exceed it)."""
    batch: list[str] = []
    size = 0
    for n in names:
        shape, dtype = reader.info[n]
        b = nbytes(shape, dtype)
        if batch and size + b > budget:
            yield batch
            batch, size = [], 0
        batch.append(n)
        size += b
    if batch:
        yield batch


def stream(reader: TensorReader, names: list[str], budget: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs, reading `budget` bytes at a time; nothing is kept after it is yielded."""
    throttle = env.settings().export_throttle_s  # tests of a kill mid-export slow it down
    for batch in batches(reader, names, budget):
        got = reader.read(batch)
        for n in batch:
            t = got.pop(n)
            if throttle:
                time.sleep(throttle)
            yield n, t
            del t  # hold nothing while the next batch is read
        del got
