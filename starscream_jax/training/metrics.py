"""Training metrics: JSON lines on disk, a loss plot (PNG) and losses printed in nats and bits.

Each record is one JSON object per line, for example {"step": 10, "loss": 2.9, "tokens_per_s": 51000.0}; evaluation
records carry "eval_loss" instead of "loss" (and, for a mixture of experts trained with a load-balancing weight, the
validation batches' "load_balance": 1 when the experts share the tokens evenly). Losses are natural-log
cross-entropies (nats per token). A process killed mid-write leaves a partial last line: reading skips it, and
appending first cuts it off.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import StarscreamError
from .data import nats_to_bits


def format_loss(nats: float) -> str:
    """A loss in nats per token, with its value in bits beside it: '2.310 nats (3.333 bits)'."""
    return f"{nats:.3f} nats ({nats_to_bits(nats):.3f} bits)"


class MetricsLog:
    """Writes records to a JSON lines file, after what it holds (`append`) or replacing it.

    With `enabled=False` (processes other than 0) it writes nothing.
    """

    def __init__(self, path: str | Path, enabled: bool = True, append: bool = True):
        self.path = Path(path)
        self.enabled = enabled
        self._file = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if append:
                drop_partial_last_line(self.path)
            self._file = self.path.open("a" if append else "w", encoding="utf-8")

    def write(self, record: dict) -> None:
        """Append one record (a flat dict of JSON-serializable values) and flush it to disk."""
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()


def drop_partial_last_line(path: Path) -> None:
    """Cuts a last line that lacks its newline (a write cut short) off the file at `path`, if it exists."""
    if not path.is_file():
        return
    with path.open("rb+") as metrics_file:
        content = metrics_file.read()
        if content and not content.endswith(b"\n"):
            metrics_file.truncate(content.rfind(b"\n") + 1)


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
    """(step, value) of `key`, keeping the last record of each step (a resumed run rewrites the steps it replays)."""
    value_by_step = {record["step"]: record[key] for record in records if key in record}
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
