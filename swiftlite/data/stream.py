"""--streaming: training rows read and tokenized as training consumes them (ms-swift's rules).

The stream is the `--dataset` specs in the order given, each file in file order (JSONL and .txt line
by line, never whole in memory; other formats are loaded by `datasets` and then streamed), restarted
from the first spec when it ends. Rows that eager tokenization would drop (no answer left, over
--max-length under delete, bad rows with --skip-bad-rows) are dropped from the stream, counted.
Step k takes the stream's next global batch (per-device x world x accumulation usable rows), cut
into micro-batches exactly as data/loader.BatchPlan cuts a global batch, so every rank, reading the
stream itself, takes its own micro-batches and knows the global target count without a collective.

ms-swift's rules, checked before launch (config/rules.py): --max-steps is required (a stream has no
length), `path#N` is the file's first N rows (ms-swift's `take(N)`: not shuffled, not repeated), no
--split-dataset-ratio (give --val-dataset, which is tokenized up front), no epoch save/eval strategy. There is no shuffle: the order is the
files' (ms-swift shuffles a 1000-row buffer; swiftlite keeps the order so that resume is exact).
Resume reads the stream again from its start up to the resumed step's rows (tokenizing them: the
time of that many rows, said in the log) and continues exactly where the checkpoint left off.
With --dataloader-num-workers > 0 one DataLoader worker reads the stream ahead (it is sequential;
more workers would read the same rows).

--packing (ms-swift's IterablePackingDataset): the usable rows are packed as they are read, whole and in
order, into packs of at most --max-length tokens (data/collate.iter_packs, the function the
non-streaming --packing runs; ms-swift's `--packing_strategy sequential`: its default binpack reorders
the rows of a 128-row buffer), and the stream's items are the packs: step k takes the next global batch
of packs, cut by rank as above, each pack one padding-free row with position ids restarting at each
packed row. A row over --max-length is cut or (truncation "delete") dropped before packing, as ms-swift
does, never split across packs. Resume is as exact as without packing (the packs are a function of the
stream).
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from swiftlite.data.rows import DataStats, Tokenized
from swiftlite.errors import UserError


@dataclass(frozen=True)
class StreamPlan:
    """A BatchPlan without a dataset length: the global batch shape only."""
    per_device: int
    world_size: int
    accumulation: int
    max_steps: int

    @property
    def global_batch(self) -> int:
        return self.per_device * self.world_size * self.accumulation

    @property
    def steps_per_epoch(self) -> int:
        """Unknown for a stream: the run's steps (the logged "epoch" is the share of --max-steps done)."""
        return self.max_steps

    def cut(self, rows: list[dict], rank: int) -> list[list[dict]]:
        chunks = [rows[i * self.per_device:(i + 1) * self.per_device] for i in range(self.world_size * self.accumulation)]
        return [chunks[m * self.world_size + rank] for m in range(self.accumulation)]


def _raw_rows(spec: str, skip_bad_rows: bool, skipped: list[str],
              columns: dict[str, str] | None = None) -> Iterator[tuple[dict, str]]:
    """The rows of one spec in file order; `path#N`: its first N rows (ms-swift's `take(N)` on a stream:
    no shuffle, and no repetition when the file is shorter); `columns` (--columns) renamed."""
    from swiftlite.data.sources import parse_source, rename_columns
    s = parse_source(spec)
    rows = _file_rows(spec[:spec.rindex("#")] if s.count else spec, skip_bad_rows, skipped)
    for row, where in (itertools.islice(rows, s.count) if s.count else rows):
        yield (rename_columns(row, columns) if isinstance(row, dict) else row), where


def _file_rows(spec: str, skip_bad_rows: bool, skipped: list[str]) -> Iterator[tuple[dict, str]]:
    from swiftlite.data.sources import _iter_jsonl, load_rows, parse_source
    s = parse_source(spec)
    path = Path(s.path).expanduser()
    if s.hub is None and path.is_file() and path.suffix.lower() == ".jsonl":
        yield from _iter_jsonl(path, skip_bad_rows, skipped)
        return
    if s.hub is None and path.is_file() and path.suffix.lower() == ".txt":
        with path.open(encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                if line.strip():
                    yield {"text": line.rstrip("\n")}, f"{path}:{n}"
        return
    src = load_rows(spec, skip_bad_rows=skip_bad_rows)
    skipped += src.skipped
    yield from zip(src.rows, src.where)


class TokenStream:
    """The usable tokenized rows of the specs, forever (the specs restart when they end); with
    `pack_length` (--packing: its --max-length), their packs instead: data/collate.iter_packs over each
    pass of the specs, the rows in stream order, whole, next-fit into packs of at most pack_length
    tokens (one open pack held: the buffer is bounded by pack_length tokens), the last pack of a pass
    closed at the pass's end, so a pass gives exactly the packs the non-streaming --packing cuts from
    the same rows in the same order."""

    def __init__(self, specs: list[str], encode: Callable[[list[tuple[dict, str]]], tuple[list[dict], DataStats]],
                 skip_bad_rows: bool, transform: Callable[[Any], Any] | None = None, pack_length: int | None = None,
                 columns: dict[str, str] | None = None):
        self.specs, self.encode, self.skip_bad_rows, self.transform = specs, encode, skip_bad_rows, transform
        self.pack_length, self.columns = pack_length, columns
        self.stats = DataStats()

    def _pass(self, n_pass: int) -> Iterator[dict]:
        """The usable rows of one pass over the specs."""
        skipped = self.stats.skipped if n_pass == 0 else []   # a bad line is reported once, not per pass
        for spec in self.specs:
            for row, where in _raw_rows(spec, self.skip_bad_rows, skipped, self.columns):
                if self.transform is not None:
                    row = self.transform.stream_row(row)
                part, st = self.encode([(row, where)])
                if n_pass == 0:
                    self.stats.add(st)
                if part:
                    yield part[0]

    def rows(self) -> Iterator[dict]:
        """The stream's items: tokenized rows, or packs with `pack_length`."""
        from swiftlite.data.collate import iter_packs
        for n_pass in itertools.count():
            found = False
            items = self._pass(n_pass)
            for item in (iter_packs(items, self.pack_length) if self.pack_length else items):
                found = True
                yield item
            if not found:
                raise UserError(f"--dataset {' '.join(self.specs)}: no usable rows in the stream "
                                f"({self.stats.unusable()})")


class StreamData(Tokenized):
    """What prepare_datasets returns for a stream: no rows in memory; the first usable row (checked
    before launch) and the facts a checkpoint compares (the files' names, sizes and times)."""

    def __init__(self, stream: TokenStream, first: dict):
        super().__init__([], stream.stats)
        self.stream, self.first = stream, first

    def for_facts(self) -> Tokenized:
        h = hashlib.sha256()
        for spec in self.stream.specs:
            p = Path(spec).expanduser()
            h.update(spec.encode())
            if p.is_file():
                st = p.stat()
                h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
        x = int.from_bytes(h.digest()[:7], "big")
        return Tokenized([{"input_ids": [x], "labels": [x]}], self.stats)


def stream_tokenized(specs: list[str], encode: Callable[[list[tuple[dict, str]]], Any], *, skip_bad_rows: bool,
                     transform: Any = None, pack_length: int | None = None,
                     columns: dict[str, str] | None = None) -> StreamData:
    """The stream of `specs`; `encode` is the eager pipeline's row encoder (pipeline.prepare_datasets);
    `pack_length` (--packing): the stream's items are packs of at most that many tokens."""
    probe = TokenStream(specs, encode, skip_bad_rows, transform, columns=columns)
    first = next(probe.rows())      # a stream with no usable row fails here, before launch
    data = StreamData(TokenStream(specs, encode, skip_bad_rows, transform, pack_length, columns), first)
    if transform is not None:       # --model_name/--model_author: a source whose first row has the columns
        from swiftlite.data.self_cognition import COLUMNS
        for spec in specs:
            row = next((r for r, _ in _raw_rows(spec, True, [], columns)), None)
            data.stats.self_cognition += int(isinstance(row, dict) and all(c in row for c in COLUMNS))
    return data


class _StepStream:
    """StepData for data steps first, first + 1, ... from a fresh read of the stream."""

    def __init__(self, batches: "StreamBatches", first: int, end: int):
        self.batches, self.first, self.end = batches, first, end

    def __iter__(self) -> Iterator[Any]:
        b = self.batches
        rows = b.data.stream.rows()
        for _ in range(self.first * b.plan.global_batch):   # resume: to the resumed step's rows
            next(rows)
        for _k in range(self.first, self.end):
            yield b.build([next(rows) for _ in range(b.plan.global_batch)])


class StreamBatches:
    """train/step.TokenBatches' interface over a stream: `step_data(k)` for k = first, first + 1, ..."""

    def __init__(self, data: StreamData, plan: StreamPlan, pad_id: int, world: Any, form: Any,
                 num_workers: int, pin_memory: bool, prefetch_factor: int | None):
        self.data, self.plan, self.pad_id, self.world, self.form = data, plan, pad_id, world, form
        self.num_workers, self.pin_memory, self.prefetch_factor = num_workers, pin_memory, prefetch_factor
        self._it: Iterator[Any] | None = None
        self.sp: Any = None   # parallel/sequence.SequenceParallel: a group's ranks read the same rows
        self._loader_it: Any = None
        self.next = 0
        self.end = plan.max_steps

    def build(self, rows: list[dict]) -> Any:
        from swiftlite.data.collate import collate, count_targets, real_tokens
        from swiftlite.data.prefetch import StepData
        padding_free = bool(self.form and self.form.padding_free)
        micro = [collate(mb, self.pad_id, padding_free=padding_free) for mb in self.plan.cut(rows, self.world.rank // (self.sp.size if self.sp else 1))]
        targets = sum(count_targets(collate([r], self.pad_id)) for r in rows)
        return StepData(micro, targets, sum(real_tokens(b) for b in micro))

    def prefetch(self, first: int, end: int) -> None:
        self.close()
        self.next, self.end = first, end
        if first > 0 and self.world.is_main:
            unit = "packs" if self.data.stream.pack_length else "rows"
            print(f"streaming: re-reading the stream to step {first} ({first * self.plan.global_batch} {unit}) "
                  "to resume exactly", flush=True)
        source = _StepStream(self, first, end)
        if self.num_workers > 0:
            import torch
            from torch.utils.data import IterableDataset

            from swiftlite.data.prefetch import loader_iter

            class _It(IterableDataset):
                def __iter__(self_inner):
                    return iter(source)
            self._loader_it = loader_iter(_It(), num_workers=1, prefetch_factor=self.prefetch_factor,
                                          pin_memory=bool(self.pin_memory and torch.cuda.is_available()))
            self._it = self._loader_it
        else:
            self._it = iter(source)

    def step_data(self, k: int) -> Any:
        if self._it is None or k != self.next:
            self.prefetch(k, max(self.end, k + 1))
        self.next += 1
        return next(self._it)

    def close(self) -> None:
        it, self._loader_it, self._it = self._loader_it, None, None
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()
