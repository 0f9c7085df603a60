"""Training metrics: JSON lines on disk, a loss plot (PNG) and losses printed in nats and bits.

Each record is one JSON object per line, for example {"step": 10, "loss": 2.9, "tokens_per_s": 51000.0}; evaluation
records carry "eval_loss" instead of "loss" (and, for a mixture of experts trained with a load-balancing weight, the
validation batches' "load_balance": 1 when the experts share the tokens evenly). Losses are natural-log
cross-entropies (nats per token); a value that is not finite is written as null, so that every line stays JSON.
A process killed mid-write leaves a partial last line: reading skips it, and appending first cuts it off.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

from ..errors import StarscreamError
from .data import nats_to_bits


def format_loss(nats: float) -> str:
    """A loss in nats per token, with its value in bits beside it: '2.310 nats (3.333 bits)'."""
    return f"{nats:.3f} nats ({nats_to_bits(nats):.3f} bits)"


class MetricsLog:
    """Appends records to a JSON lines file, after the records it holds (all of them, or those of steps up to
    `keep_through`: a resumed run keeps what led to its checkpoint and writes the steps it replays once; 0 starts
    the file afresh).

    With `enabled=False` (processes other than 0) it writes nothing.
    """

    def __init__(self, path: str | Path, enabled: bool = True, keep_through: int | None = None):
        self.path = Path(path)
        self.enabled = enabled
        self._file = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            keep_records_through(self.path, keep_through)
            self._file = self.path.open("a", encoding="utf-8")

    def write(self, record: dict) -> None:
        """Append one record (a flat dict of JSON-serializable values; non-finite floats become null) and flush it
        to disk."""
        if self._file is not None:
            finite = {key: None if isinstance(value, float) and not math.isfinite(value) else value
                      for key, value in record.items()}
            self._file.write(json.dumps(finite, allow_nan=False) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()


def keep_records_through(path: Path, last_step: int | None) -> None:
    """Rewrites the file at `path` (if it exists) keeping the records of steps up to `last_step` (None: every
    one), in order; a partial last line (a write cut short) goes too. The new content replaces the old in one
    rename."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
            if line.endswith("\n") and (last_step is None or _step_of(line) <= last_step)]
    partial = path.with_name(f"{path.name}.partial-{os.getpid()}")
    partial.write_text("".join(kept), encoding="utf-8")
    partial.replace(path)


def _step_of(line: str) -> float:
    """The step of one record line; a line that is not a JSON record with a step is kept (-inf), for
    `read_metrics` to name."""
    try:
        step = json.loads(line).get("step")
    except (json.JSONDecodeError, AttributeError):
        return -math.inf
    return step if isinstance(step, int) else -math.inf


def read_metrics(path: str | Path) -> list[dict]:
    """All records of a JSON lines file, in file order; a partial last line (a write cut short) is skipped, any
    other line that is not JSON is an error naming it."""
    lines = Path(path).read_text(encoding="utf-8", errors="replace").splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number < len(lines):
                raise StarscreamError(f"{path}, line {number}: not a JSON record ({line[:60]!r}); fix or delete "
                                      "that line") from None
    return records


def last_records_by_step(records: list[dict], key: str) -> list[tuple[int, float]]:
    """(step, value) of `key`, keeping the last record of each step; null (non-finite) values are left out."""
    value_by_step = {record["step"]: record[key] for record in records if record.get(key) is not None}
    return sorted(value_by_step.items())


def plot_losses(records: list[dict], png_path: str | Path, reference_nats: float | None = None,
                title: str = "training loss") -> Path:
    """Plot training and evaluation loss (nats) against step into a PNG (matplotlib's Agg backend, no display).

    `reference_nats`, when given, is drawn as a horizontal line (the corpus' unigram entropy).
    """
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(7, 4), dpi=100)
    for key, label in (("loss", "train"), ("eval_loss", "validation")):
        points = last_records_by_step(records, key)
        if points:
            steps, losses = zip(*points)
            axes.plot(steps, losses, label=label, marker="o" if key == "eval_loss" else None)
    if reference_nats is not None:
        axes.axhline(reference_nats, color="grey", linestyle="--",
                     label=f"unigram entropy {format_loss(reference_nats)}")
    axes.set_xlabel("step")
    axes.set_ylabel("loss (nats per token)")
    axes.set_title(title)
    axes.legend()
    figure.tight_layout()
    output_path = Path(png_path)
    output_path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output_path)
    pyplot.close(figure)
    return output_path
