"""The training run: `train(cfg)` (loop.py) builds the run (run.py), then steps (step.py) with observers
around each step (observers.py) and validation (evaluate.py). docs/design.md has the numerics."""

from swiftlite.train.loop import TrainResult, train

__all__ = ["TrainResult", "train"]
