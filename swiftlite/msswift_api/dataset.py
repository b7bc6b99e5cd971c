"""ms-swift's dataset registration as plugin files use it (swift/dataset: `register_dataset`, `DatasetMeta`,
`RowPreprocessor`, `ResponsePreprocessor`), e.g. examples/train/rlhf/opsd/opsd_plugin.py and
examples/custom/dataset.py: a `--dataset` naming a registered id reads the meta's source and runs its
preprocessor on every row (data/registered.py applies it).

What a meta can say here: `hf_dataset_id` (read from the Hugging Face hub) or `dataset_path` (a local file
or folder), `ms_dataset_id` (matched, read only through one of the other two: swiftlite reads no
ModelScope datasets), `dataset_name` (another name to match), `preprocess_func` (a RowPreprocessor, or a
function of one row). A meta with `subsets` or `split`, ms-swift's loader `load_dataset`, and its other
preprocessors are not here: the first two are refused when the dataset is read, the others fail to import
with the import's line (plugin_imports).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class DatasetMeta:
    ms_dataset_id: str | None = None
    hf_dataset_id: str | None = None
    dataset_path: str | None = None
    dataset_name: str | None = None
    ms_revision: str | None = None
    hf_revision: str | None = None
    subsets: list = field(default_factory=list)
    split: list = field(default_factory=list)
    preprocess_func: Any = None
    tags: list = field(default_factory=list)
    help: str | None = None
    huge_dataset: bool = False

    def names(self) -> list[str]:
        """The ids and paths a --dataset value may give for this meta."""
        return [n for n in (self.ms_dataset_id, self.hf_dataset_id, self.dataset_path, self.dataset_name) if n]


def register_dataset(dataset_meta: DatasetMeta, *, exist_ok: bool = False) -> None:
    """ms-swift's: a name registered twice raises unless exist_ok."""
    from swiftlite.data.registered import DATASETS
    key = dataset_meta.dataset_name or (dataset_meta.ms_dataset_id, dataset_meta.hf_dataset_id,
                                        dataset_meta.dataset_path)
    if not exist_ok and key in DATASETS:
        raise ValueError(f"The `{key}` has already been registered in the DATASET_MAPPING.")
    DATASETS[key] = dataset_meta


class RowPreprocessor:
    """ms-swift's base: `columns` renames a row's keys (old -> new) before `preprocess(row)`, which returns the
    row in ms-swift's standard form (`messages`, and columns such as `teacher_prompt`, `solution`) or None to
    drop it."""

    def __init__(self, *, columns: dict[str, str] | None = None, **kwargs: Any):
        self.columns = dict(columns or {})

    def preprocess(self, row: dict[str, Any]) -> dict[str, Any] | None:
        return row

    def __call__(self, row: dict[str, Any]) -> dict[str, Any] | None:
        renamed = dict(row)
        for old, new in self.columns.items():
            if old in renamed and new not in renamed:
                renamed[new] = renamed.pop(old)
        return self.preprocess(renamed)


class ResponsePreprocessor(RowPreprocessor):
    """ms-swift's query/response rows: its column aliases (`prompt`, `instruction`, `question`, `problem` ->
    query; `answer`, `output`, `solution`, ... -> response; `system_prompt` -> system), then `messages`
    from the history, the query and the response (a list of responses: the first, as ms-swift's default)."""

    SYSTEM = ("system", "system_prompt")
    QUERY = ("query", "prompt", "input", "instruction", "question", "problem")
    RESPONSE = ("response", "answer", "output", "targets", "target", "answer_key", "answers", "solution", "text",
                "completion", "content")

    def __init__(self, *, columns: dict[str, str] | None = None, **kwargs: Any):
        aliases = {**{k: "system" for k in self.SYSTEM}, **{k: "query" for k in self.QUERY},
                   **{k: "response" for k in self.RESPONSE}}
        super().__init__(columns={**aliases, **(columns or {})}, **kwargs)

    def preprocess(self, row: dict[str, Any]) -> dict[str, Any] | None:
        import ast
        response = row.pop("response", None)
        if isinstance(response, (list, tuple)):
            response = response[0]
        history = row.pop("history", None) or []
        if isinstance(history, str):       # e.g. "[['query1', 'response1']]"
            history = ast.literal_eval(history)
        history = [list(h) for h in history] + [[row.pop("query", None), response]]
        system = row.pop("system", None)
        messages = [{"role": "system", "content": system}] if system else []
        for q, r in history:
            messages.append({"role": "user", "content": q})
            if r is not None:
                messages.append({"role": "assistant", "content": r})
        row["messages"] = messages
        return row


PreprocessFunc = Callable[..., Any]

__all__ = ["DatasetMeta", "PreprocessFunc", "ResponsePreprocessor", "RowPreprocessor", "register_dataset"]
