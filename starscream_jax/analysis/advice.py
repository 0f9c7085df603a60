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
"""
from __future__ import annotations

from dataclasses import dataclass

from ..hardware.axes import ACROSS_GPUS, XCD
from ..sharding.layouts import Layout
from .report import Report

LOOKUP = ("gather", "scatter", "scatter-add")
GRADIENT_SUMS = ("reduce_sum", "dot_general")


@dataclass(frozen=True)
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
        return (Advice(f"{len(flat)} flat collectives", "", f"layout {layout.name} splits weights over partitions of "
                       "several GPUs at once", "a hierarchical layout (starscream_tp, starscream_fsdp, ...)"),)
    found = []
    for collective in flat:
        primitive = collective.op_name.rsplit("/", 1)[-1]
        if primitive in LOOKUP:
            found.append(Advice(collective.name, collective.op_name,
                                "XLA partitions a lookup in a vocabulary-split table against tokens split otherwise",
                                "look the tokens up with embed_lookup(table, tokens)"))
        elif "transpose" in collective.op_name and any(kind in primitive for kind in GRADIENT_SUMS):
            found.append(Advice(collective.name, collective.op_name,
                                "a weight gradient summed over every token axis in one collective",
                                "on Auto axes XLA chooses this sum; on an Explicit mesh weights_at_use(model) in the "
                                "loss sums it inside each GPU, then across GPUs" if auto_axes else
                                "weights_at_use(model) in the loss sums it inside each GPU, then across GPUs (norm "
                                "scales excepted: Flax's norms multiply by them elementwise)"))
    return tuple(found)


def _flat_by_design(layout: Layout) -> bool:
    """Whether a params rule of `layout` maps a name to `xcd` together with an axis across GPUs."""
    return any(XCD in axes and set(axes) & set(ACROSS_GPUS)
               for name in layout.params.names() for axes in [layout.params.lookup(name)[1]])
