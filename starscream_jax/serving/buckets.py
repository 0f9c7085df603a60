"""The shapes a server compiles: each forward program's `Bucket` (phase, rows, positions, pages and a mixed step's
chunk rows) and a server's `Buckets`, from its limits (`Buckets.for_limits`); sizes round up to the next bucket
(`Buckets.round_up`), so that every program is compiled once, at start (`Engine.warm_up`)."""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import NamedTuple

from ..errors import StarscreamError
from .steps import LAYOUT_OF, MixedInputs, StepInputs


class Bucket(NamedTuple):
    """One forward program's shape: its phase, rows (per cache shard in `Buckets.shapes`, of all shards in an
    engine's keys; a mixed step's decode rows), positions a row (1 in decode; a mixed step's chunks'), pages a row,
    and a mixed step's prompt-chunk rows (0 in the other phases)."""

    phase: str
    rows: int
    width: int
    pages: int
    chunks: int = 0

    @classmethod
    def of(cls, phase: str, inputs: StepInputs | MixedInputs) -> Bucket:
        """The bucket that host `inputs` of `phase` run in."""
        if phase == "mixed":
            return cls(phase, inputs.decode.tokens.shape[0], *inputs.prefill.tokens.shape[1:],
                       inputs.prefill.table.shape[1], inputs.prefill.tokens.shape[0])
        return cls(phase, *inputs.tokens.shape, inputs.table.shape[1])

    def zeros(self) -> StepInputs | MixedInputs:
        """Host inputs of this bucket with every row padding (`StepInputs.zeros`)."""
        if self.phase == "mixed":
            return MixedInputs(StepInputs.zeros(self.rows, 1, self.pages),
                               StepInputs.zeros(self.chunks, self.width, self.pages))
        return StepInputs.zeros(self.rows, self.width, self.pages, self.phase == "scored")

    def of_shards(self, shards: int) -> Bucket:
        """This bucket of rows per shard (`Buckets.shapes`) as the rows of all `shards` (an engine's keys)."""
        return self._replace(rows=self.rows * shards, chunks=self.chunks * shards)


def _steps_down(limit: int, factor: int, count: int) -> tuple[int, ...]:
    """`count` sizes falling from `limit` by `factor` each (at least 1), rising."""
    sizes = {limit}
    while len(sizes) < count and min(sizes) > 1:
        sizes.add(max(1, min(sizes) // factor))
    return tuple(sorted(sizes))


@dataclass(frozen=True, kw_only=True)
class Buckets:
    """The shapes a server compiles: rows per cache shard of decode steps and of prefill steps, prompt positions per
    prefill row, pages per row (each a rising tuple; a size rounds up to the next), with `scored` a scored prefill of
    every prefill shape (prompt log-probabilities; the engine sets it from `EngineConfig.prompt_logprobs`), and mixed
    steps of each decode bucket (rows and pages) with `mixed_chunks` prompt chunks per shard (each of the largest
    positions bucket; none where empty: the engine sets it from `EngineConfig.mixed_chunks`, one chunk by default).
    `for_limits` gives a server's defaults; every bucket is compiled at start (`Engine.warm_up`), so their count sets
    the start-up time."""

    rows: tuple[int, ...]
    positions: tuple[int, ...]
    pages: tuple[int, ...]
    prefill_rows: tuple[int, ...] | None = None  # None: as `rows`
    scored: bool = False
    decode_pages: tuple[int, ...] | None = None  # None: as `pages`
    mixed_chunks: tuple[int, ...] = ()

    @classmethod
    def for_limits(cls, rows: int, chunk: int, pages: int, prefill_rows: int, reads_in_place: bool = False) -> Buckets:
        """Few buckets, where padding costs little: decode rows of a sixteenth, a quarter and all of `rows` (a
        decode step reads every weight whatever its rows, so padding rows is nearly free); prefill steps of one
        chunk or of `prefill_rows` chunks, each padded to `chunk` positions; pages per row in four halvings from
        `pages` (gathering copies every page of the padded table, so pages keep finer steps), except in decode
        where its attention `reads_in_place` (cuDNN's paged kernel reads a row's visible positions only, whatever
        the table's width: one decode bucket of pages, and fewer programs to compile at start)."""
        return cls(rows=_steps_down(rows, 4, 3), positions=(chunk,), pages=_steps_down(pages, 2, 4),
                   prefill_rows=tuple(sorted({1, prefill_rows})), decode_pages=(pages,) if reads_in_place else None)

    def rows_of(self, phase: str) -> tuple[int, ...]:
        """Rows per shard of `phase`'s steps (a mixed step's chunks: `mixed_chunks`)."""
        if phase == "mixed":
            return self.mixed_chunks
        return (self.prefill_rows or self.rows) if LAYOUT_OF[phase] == "prefill" else self.rows

    def pages_of(self, phase: str) -> tuple[int, ...]:
        """Pages per row of `phase`'s steps (a mixed step's: decode's, so that its decode rows gather no wider a table
        than a decode step's where decode gathers)."""
        return self.pages if phase in ("prefill", "scored") else (self.decode_pages or self.pages)

    def shapes(self) -> list[Bucket]:
        """Every bucket a server may run (rows per shard), decode first."""
        decode = [Bucket("decode", rows, 1, pages) for pages in self.pages_of("decode") for rows in self.rows]
        prefill = [Bucket(phase, rows, positions, pages) for phase in ("prefill", "scored")[:1 + self.scored]
                   for pages in self.pages for rows in self.rows_of("prefill") for positions in self.positions]
        mixed = [Bucket("mixed", rows, self.positions[-1], pages, chunks) for pages in self.pages_of("decode")
                 for rows in self.rows for chunks in self.mixed_chunks]
        return decode + prefill + mixed

    def programs(self) -> int:
        """Most programs a server compiles: decode (rows x pages), prefill (rows x positions x pages), twice the
        prefill where `scored`, and mixed (decode rows x pages x `mixed_chunks`)."""
        return len(self.shapes())

    @staticmethod
    def round_up(size: int, sizes: tuple[int, ...], what: str) -> int:
        index = bisect.bisect_left(sizes, size)
        if index == len(sizes):
            raise StarscreamError(f"{size} {what} exceed the largest compiled bucket {sizes[-1]}")
        return sizes[index]
