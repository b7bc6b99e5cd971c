"""--model_name / --model_author: ms-swift's self-cognition substitution, on local data of that format.

What ms-swift does (swift/dataset/loader.init_self_cognition_preprocessor and
dataset/llm.SelfCognitionPreprocessor, ms-swift 3602360a): only the rows of its `swift/self-cognition`
dataset are touched, whose columns are `query`, `response` and `tag` ("zh" or "en"). In each row,
`{{NAME}}` and `{{AUTHOR}}` are replaced in the query and the response, by the first value of
--model_name / --model_author for a "zh" row and the second for any other tag; a single value serves
both. A placeholder whose flag is not given stays as written.

swiftlite has no dataset hub of its own, so "that dataset" is any --dataset / --val-dataset source in
that format: every row has `query`, `response` and `tag` (a local copy of ms-swift's file, which is
what replacing `swift/self-cognition#500` by a local file gives). Other sources are left as they are,
as in ms-swift. A run that gives the flags but has no such source is refused (the flags would do
nothing). ms-swift's `qwen3` / `empty_think` subsets (a `/no_think` suffix, an empty think block) are
other dataset names, not these flags, and are not reproduced.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from swiftlite.errors import UserError

COLUMNS = ("query", "response", "tag")


def _pair(flag: str, values: list[str] | None) -> tuple[str, str] | None:
    """ms-swift's (zh, en) pair: one value -> both; two -> (zh, en)."""
    if not values:
        return None
    if len(values) > 2:
        raise UserError(f"--{flag} {' '.join(values)}: takes one name, or two (the Chinese one, then the English "
                        "one), as in ms-swift")
    return (values[0], values[0]) if len(values) == 1 else (values[0], values[1])


def is_self_cognition(rows: list[dict]) -> bool:
    return bool(rows) and all(isinstance(r, dict) and all(c in r for c in COLUMNS) for r in rows)


@dataclass
class SelfCognition:
    """The substitution of one run; `matched` counts the sources it applied to."""
    name: tuple[str, str] | None
    author: tuple[str, str] | None
    matched: int = 0

    def key(self) -> list:
        return [list(self.name or ()), list(self.author or ())]

    def row(self, row: dict) -> dict:
        """One self-cognition row with its placeholders filled (ms-swift's preprocess)."""
        out = dict(row)
        for placeholder, val in (("{{NAME}}", self.name), ("{{AUTHOR}}", self.author)):
            if val is None:
                continue
            v = val[0] if row.get("tag") == "zh" else val[1]
            for col in ("query", "response"):
                if isinstance(out.get(col), str):
                    out[col] = out[col].replace(placeholder, v)
        return out

    def __call__(self, src: Any) -> Any:
        """A source's rows (data/sources.Rows): substituted when the source is in the self-cognition format."""
        if not is_self_cognition(src.rows):
            return src
        self.matched += 1
        return replace(src, rows=[self.row(r) for r in src.rows])

    def stream_row(self, row: dict) -> dict:
        """--streaming: rows are filled one by one, those in the self-cognition format."""
        return self.row(row) if isinstance(row, dict) and all(c in row for c in COLUMNS) else row

    def check_used(self, specs: list[str], matched: int) -> None:
        """`matched`: the sources filled (DataStats.self_cognition, also when read from the cache)."""
        if matched == 0:
            flags = " / ".join(f for f, v in (("--model_name", self.name), ("--model_author", self.author)) if v)
            raise UserError(f"{flags}: no --dataset/--val-dataset source ({', '.join(specs)}) is in ms-swift's "
                            "self-cognition format (every row with query, response and tag columns), the only "
                            "rows whose {{NAME}}/{{AUTHOR}} these flags fill; add such a file or drop the flags")


def from_config(d: Any) -> SelfCognition | None:
    """The run's substitution (cfg.data), or None without --model_name / --model_author."""
    name, author = _pair("model_name", d.model_name), _pair("model_author", d.model_author)
    if name is None and author is None:
        return None
    return SelfCognition(name, author)
