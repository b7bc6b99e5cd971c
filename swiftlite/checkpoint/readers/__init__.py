"""Offline tensor readers: the weights of a checkpoint (or model) without a process group, with
their shapes known up front and their values read a batch at a time.

    base.py       TensorReader (the interface), batches and stream (bounded-memory iteration)
    dcp.py        the model entries of a torch.distributed.checkpoint folder
    zero.py       the fp32 master weights of a DeepSpeed ZeRO checkpoint
    hf_folder.py  an HF folder's *.safetensors files
    live.py       an in-memory model, bitsandbytes layers dequantized
"""

from swiftlite.checkpoint.readers.base import TensorReader, batches, stream
from swiftlite.checkpoint.readers.dcp import DCPReader
from swiftlite.checkpoint.readers.hf_folder import SafetensorsReader, st_dtype
from swiftlite.checkpoint.readers.live import ModelReader, tensor_value
from swiftlite.checkpoint.readers.zero import ZeroReader

__all__ = ["TensorReader", "batches", "stream", "DCPReader", "SafetensorsReader", "st_dtype", "ModelReader",
           "tensor_value", "ZeroReader"]
