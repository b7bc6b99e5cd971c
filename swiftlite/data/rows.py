"""The tokenized-data containers every data path returns: `DataStats` (what happened to the rows) and
`Tokenized` (rows + stats). A module of its own so that the eager pipeline (pipeline.py), the lazy
rows (lazy.py) and the stream (stream.py) share them without importing each other."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from swiftlite.data.tokenize import IGNORE


@dataclass
class DataStats:
    rows: int = 0              # rows read and tokenized
    truncated: int = 0         # cut to --max-length (--truncation-strategy left/right), kept
    skipped: list[str] = field(default_factory=list)
    no_target: int = 0         # dropped: no target token left
    deleted: int = 0           # dropped: longer than --max-length (--truncation-strategy delete)
    self_cognition: int = 0    # sources in ms-swift's self-cognition format (--model_name/--model_author)

    def add(self, other: "DataStats") -> None:
        self.rows += other.rows
        self.truncated += other.truncated
        self.skipped += other.skipped
        self.no_target += other.no_target
        self.deleted += other.deleted
        self.self_cognition += other.self_cognition

    def unusable(self) -> str:
        """Why rows were not used, for "no usable rows" errors."""
        return (f"read {self.rows}, skipped {len(self.skipped)}, {self.no_target} without an answer"
                + (f", {self.deleted} longer than --max-length deleted" if self.deleted else ""))


@dataclass
class Tokenized:
    rows: list[dict[str, Any]]  # {"input_ids": [...], "labels": [...], (position_ids)}
    stats: DataStats

    def targets(self, i: int) -> int:
        lab = self.rows[i]["labels"]
        return sum(1 for x in lab[1:] if x != IGNORE)
