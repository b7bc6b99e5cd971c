"""The model entries of a torch.distributed.checkpoint folder (checkpoint-N/dcp/), read offline."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from swiftlite.checkpoint.readers.base import TensorReader
from swiftlite.checkpoint.safety import check_dcp_metadata


class DCPReader(TensorReader):
    """The model entries ("model.<fqn>") of a torch.distributed.checkpoint folder, read offline."""

    def __init__(self, dcp_dir: Path, prefix: str = "model."):
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata
        check_dcp_metadata(dcp_dir)  # allow-list unpickler first: DCP reads .metadata with pickle

        class _CachedReader(FileSystemReader):
            _md = None

            def read_metadata(self, *a: Any, **kw: Any) -> Any:  # read (and unpickle) once
                if self._md is None:
                    self._md = super().read_metadata(*a, **kw)
                return self._md

        self.dir = dcp_dir
        self.prefix = prefix
        self.reader = _CachedReader(str(dcp_dir))
        md = self.reader.read_metadata()
        self.info = {}
        for k, v in md.state_dict_metadata.items():
            if k.startswith(prefix) and isinstance(v, TensorStorageMetadata):
                self.info[k[len(prefix):]] = (v.size, v.properties.dtype)

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        import warnings

        import torch.distributed.checkpoint as dcp
        inner = {n: torch.empty(self.info[n][0], dtype=self.info[n][1]) for n in names}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process": intended
            dcp.load({self.prefix.rstrip("."): inner}, storage_reader=self.reader, no_dist=True)
        return inner
