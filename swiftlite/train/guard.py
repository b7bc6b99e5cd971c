"""The non-finite guard: a step whose loss or global gradient norm is nan/inf is never applied.

Both numbers are already all-reduced by the step (no extra synchronisation), so every rank decides
alike. `--nan-policy stop` (default) ends the run with one line naming the step and the newest good
checkpoint; `--nan-policy skip` counts the step in logging.jsonl and goes on, and stops after
`--max-skipped-steps` skipped in a row. The torch engines refuse a non-finite update themselves
(`TorchEngine.step` leaves the weights as they were: `Engine.skips_nonfinite`); DeepSpeed has
already applied its step when the norm is known, so on DeepSpeed a non-finite step always stops the run. Checkpoints are checked
for finite weights when they are saved (checkpoint/state.check_finite).
"""

from __future__ import annotations

import math
from typing import Any

from swiftlite.errors import UserError


class NonFiniteStep(UserError):
    """The run stopped on a nan/inf loss or gradient norm."""


class NonFiniteGuard:
    def __init__(self, policy: str, max_skipped: int, engine: Any, log: Any):
        self.policy, self.max_skipped, self.log = policy, max_skipped, log
        self.can_skip = bool(engine.skips_nonfinite)   # the Engine Protocol's (parallel/base.py)
        self.skipped = 0      # in total
        self.in_a_row = 0

    def check(self, stats: Any, last_checkpoint: Any) -> bool:
        """True when the step was finite; False when it was skipped; raises NonFiniteStep to stop."""
        bad = [f"{name} is {value}" for name, value in (("loss", stats.loss), ("grad norm", stats.grad_norm))
               if not math.isfinite(value)]
        if not bad:
            self.in_a_row = 0
            return True
        self.skipped += 1
        self.in_a_row += 1
        where = f"{' and '.join(bad)} at step {stats.step}"
        good = f"last good checkpoint: {last_checkpoint.name}" if last_checkpoint else "no checkpoint saved yet"
        if self.policy == "skip" and not self.can_skip:
            raise NonFiniteStep(f"{where}; DeepSpeed applied that step already, so it cannot be skipped "
                                f"(--nan-policy skip works with the torch backends); {good}")
        if self.policy != "skip":
            raise NonFiniteStep(f"{where}; {good} (--nan-policy skip skips such steps)")
        if self.in_a_row > self.max_skipped:
            raise NonFiniteStep(f"{where}: {self.in_a_row} non-finite steps in a row (--max-skipped-steps "
                                f"{self.max_skipped}); {good}")
        self.log.log({"step": stats.step, "skipped_step": "; ".join(bad), "skipped_steps": self.skipped})
        return False
