"""The smallest fix for each flat collective `check` finds in a user's step, read from what the collective computes.

A collective is flat when one of its groups spans partitions of several GPUs and several partitions of one GPU at
once (principle 3). In a model placed by a layout two causes account for the ones JAX's and XLA's own partitioning
leave, each named by the primitive whose partitioning emitted the collective (the last part of its op_name):
  a gather, or the scatter of its gradient  a token lookup in an embedding table split over the vocabulary, which
                                            XLA partitions against tokens split another way by moving rows between
                                            partitions of different GPUs: `embed_lookup` looks each token up where its
                                            row lives and completes the rows with one hierarchical psum;
  a gradient's sum (reduce_sum, or the      a weight's gradient summed over every mesh axis that splits the tokens in
  transpose of a dot_general)               one collective: on an Explicit mesh `weights_at_use(model)` in the loss
                                            sums it in two stages (inside each GPU, then across GPUs); on Auto axes the
                                            reduction is XLA's to choose, and only the Explicit path types it so.
A token batch that enters the step whole on every partition of a GPU, where the layout splits tokens over them and
nothing in the step splits it (a model without activation constraints), leaves each partition computing every token:
`advise_batch` names the one line that places it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..hardware.axes import ACROSS_GPUS, XCD
from ..sharding.layouts import Layout
from .report import Report

LOOKUP = ("gather", "scatter", "scatter-add")
GRADIENT_SUMS = ("reduce_sum", "dot_general")


@dataclass(frozen=True, kw_only=True)
class Advice:
    """One flat collective (`name`, its op_name), why the partitioning emitted it, and the smallest fix."""

    name: str
    op_name: str
    why: str
    fix: str


def advise(report: Report, layout: Layout, auto_axes: bool) -> tuple[Advice, ...]:
    """Advice for each flat collective of `report` whose cause is known (see the module); `auto_axes`: whether the
    step ran on a mesh with Auto axes. Under a layout that itself stores a weight over partitions of several GPUs at
    once (flat_tp, flat_fsdp), flatness is the layout's design: one piece of advice says so."""
    flat = [collective for collective in report.collectives if collective.scope == "flat"]
    if flat and _flat_by_design(layout):
        return (Advice(name=f"{len(flat)} flat collectives", op_name="",
                       why=f"layout {layout.name} splits weights over partitions of several GPUs at once",
                       fix="a hierarchical layout (starscream_tp, starscream_fsdp, ...)"),)
    found = []
    for collective in flat:
        primitive = collective.op_name.rsplit("/", 1)[-1]
        if primitive in LOOKUP:
            found.append(Advice(
                name=collective.name, op_name=collective.op_name,
                why="XLA partitions a lookup in a vocabulary-split table against tokens split otherwise",
                fix="look the tokens up with embed_lookup(table, tokens)"))
        elif "transpose" in collective.op_name and any(kind in primitive for kind in GRADIENT_SUMS):
            found.append(Advice(
                name=collective.name, op_name=collective.op_name,
                why="a weight gradient summed over every token axis in one collective",
                fix="on Auto axes XLA chooses this sum; on an Explicit mesh weights_at_use(model) in the loss sums it "
                "inside each GPU, then across GPUs" if auto_axes else
                "weights_at_use(model) in the loss sums it inside each GPU, then across GPUs (norm scales excepted: "
                "Flax's norms multiply by them elementwise)"))
    return tuple(found)


def _flat_by_design(layout: Layout) -> bool:
    """Whether a params rule of `layout` maps a name to `xcd` together with an axis across GPUs."""
    return any(XCD in axes and set(axes) & set(ACROSS_GPUS)
               for name in layout.params.names() for axes in [layout.params.lookup(name)[1]])


def advise_batch(report: Report, layout: Layout) -> tuple[Advice, ...]:
    """Advice for each integer input of two or more dimensions (a token batch [B, S, ...]) held whole by several
    partitions of a GPU while the layout splits tokens over `xcd` by the batch, when the step's matmuls work on more
    tokens per device than the layout's share of that batch (B x S over the batch split): nothing in the step split
    it, so every partition computes every token. The fix places it before the call, as the layout places tokens."""
    axes = layout.activations.lookup("batch")[1]
    if XCD not in axes or report.tokens_per_device is None:
        return ()
    split = math.prod(report.mesh_axes.get(axis, 1) for axis in axes)
    return tuple(Advice(name=entry.name, op_name="",
                        why=_copied_batch(entry, report.tokens_per_device, layout.name, split, axes),
                        fix="place it before the step as the layout places tokens: tokens = jax.device_put(tokens, "
                        "starscream_jax.batch_sharding(layout, mesh))")
                 for entry in report.inputs
                 if entry.dtype.startswith(("int", "uint")) and len(entry.shape) >= 2 and entry.replication_xcd > 1
                 and report.tokens_per_device * split > math.prod(entry.shape))


def _copied_batch(entry, tokens_per_device: int, layout: str, split: int, axes: tuple[str, ...]) -> str:
    """Why a token batch `entry` (an `InputReport`) is a copy, in words."""
    return (f"the token batch (argument {entry.name}, {entry.dtype} {entry.shape}) enters whole on the partitions of "
            f"each GPU and nothing in the step splits it: {tokens_per_device} tokens per device, where {layout} "
            f"splits the batch {split} ways ({' x '.join(axes)})")
