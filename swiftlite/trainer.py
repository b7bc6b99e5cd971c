"""The training loop moved to swiftlite/train/ (loop.py, run.py, step.py, evaluate.py, observers.py);
this module keeps the old import path for the launcher until it imports swiftlite.train."""

from swiftlite.train.loop import TrainResult, train
from swiftlite.train.run import resolve_backend, smallest_gpu_memory

__all__ = ["TrainResult", "resolve_backend", "smallest_gpu_memory", "train"]
