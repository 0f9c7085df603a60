"""Numbers and tables as the commands print them: the principles' table of `check` and of `starscream inspect` is
this one formatter (`format_columns`, `principle_rows`, `violation_lines`)."""
from __future__ import annotations

import textwrap

from ..hardware.axes import XCD
from .principles import AttentionRatio, Principles, Verdict


def format_bytes(count: float) -> str:
    """A byte count with a binary unit: '512 B', '1.5 KiB', '3.2 MiB', '2.0 GiB'."""
    for unit in ("B", "KiB", "MiB"):
        if count < 1024:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} GiB"


def format_seconds(value: float) -> str:
    """Seconds as ms below one second ("12.3 ms"), else s ("1.23 s")."""
    return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.2f} s"


def clip(text: str, width: int) -> str:
    """`text` cut to `width` characters, ending in "..." where it was cut."""
    return text if len(text) <= width else text[: width - 3] + "..."


SHOWN_VIOLATIONS = 3
"""How many violations of each failed principle the tables print (--json and the verdicts hold them all)."""

Row = tuple[str, str]
"""(label, cell) of one line of a table column."""


def verdict_cell(verdict: Verdict) -> str:
    """"ok" (every op judged, none failed), "FAIL (violations)" (followed by how many ops went unjudged when some
    did: a failure stands whatever was left out), or "not judged (N ops)" / "not judged (K of N ops)" when nothing,
    or only part of the program, was judged: unjudged ops never read as passing."""
    unjudged = len(getattr(verdict, "unjudged", ()))
    if verdict.ok is None:
        judged = getattr(verdict, "judged_ops", 0)
        ops = f"{unjudged} of {unjudged + judged} ops" if judged else f"{unjudged} op{'s' * (unjudged != 1)}"
        return f"not judged ({ops})" if unjudged else "not judged"
    if verdict.ok:
        return "ok"
    return f"FAIL ({len(verdict.violations)})" + (f", {unjudged} unjudged" if unjudged else "")


def attention_cell(summary: AttentionRatio) -> str:
    """Attention's ratio to the reference and whether it passes principle 1, or "-" when it was not compared."""
    if summary.ratio is None:
        return "-"
    return f"{summary.ratio:.2f} {'ok' if summary.ok else 'FAIL'}"


def principle_rows(principles: Principles, decode: bool = False) -> list[Row]:
    """The three verdicts' rows, with attention's ratio under principle 1 (`decode`: judged by bytes read)."""
    return [
        ("  1 kernel shapes" + (" (bytes read)" if decode else ""), verdict_cell(principles.shape_preservation)),
        ("    attention " + ("K/V reads per GPU" if decode else "work per token") + " / gpu_tp",
         attention_cell(principles.shape_preservation.attention)),
        (f"  2 no redundancy over {XCD}", verdict_cell(principles.no_redundancy)),
        ("  3 hierarchical collectives", verdict_cell(principles.hierarchical_collectives)),
    ]


def format_columns(columns: dict[str, list[Row]], names: bool = True) -> list[str]:
    """Columns of rows side by side under their names, each cell right-aligned, the labels those of the first
    column (every column has the same labels). Without `names`: no names line and the cells left-aligned, so one
    column reads as labels and values (`check`'s, whose cells list parameters)."""
    labels = [label for label, _ in next(iter(columns.values()))]
    label_width = max(len(label) for label in labels)
    widths = {name: max(len(name) if names else 0, *(len(cell) for _, cell in rows)) for name, rows in columns.items()}
    align = ">" if names else "<"
    lines = [" " * label_width + "".join(f"  {name:>{widths[name]}}" for name in columns)] if names else []
    for index, label in enumerate(labels):
        cells = "".join(f"  {columns[name][index][1]:{align}{widths[name]}}" for name in columns)
        lines.append(f"{label:<{label_width}}{cells}".rstrip())
    return lines


def violation_lines(name: str, principles: Principles, width: int) -> list[str]:
    """Why principle 1 was not judged, or judged only in part, where so; the first violations of each failed
    principle of `name`'s program; then the ops principle 1 left unjudged, each with its reason."""
    lines = []
    shapes = principles.shape_preservation
    if not shapes.judged:
        lines += textwrap.wrap(f"{name} shape_preservation: not judged: {shapes.not_judged}", width,
                               subsequent_indent="  ")
    for principle, verdict in principles.verdicts():
        if verdict.violations:
            lines.append(f"{name} {principle}: {len(verdict.violations)} violation(s), e.g.")
            lines += [clip(f"  {line}", width) for line in verdict.violations[:SHOWN_VIOLATIONS]]
    if shapes.unjudged:
        lines.append(clip(f"{name} shape_preservation: {len(shapes.unjudged)} op(s) unjudged: " + ", ".join(
            f"{op.name} ({op.reason})" for op in shapes.unjudged), width))
    return lines
