"""The mesh's axis names and the small helpers every layer uses to read mesh axes out of specs.

Every mesh this library builds has three axes, outermost first: `data` (data-parallel groups of GPUs, or nodes),
`gpu` (physical GPUs that tensor or expert parallelism spans) and `xcd` (the partitions of one GPU). A GPU that is not
partitioned has `xcd` of size 1, so the same rules run everywhere.
"""
from __future__ import annotations

from jax.sharding import PartitionSpec

DATA = "data"
GPU = "gpu"
XCD = "xcd"
AXES = (DATA, GPU, XCD)
INSIDE_GPU = XCD
ACROSS_GPUS = (DATA, GPU)

MeshAxes = None | str | tuple[str, ...]
"""One dimension's mesh axes as a rule table or a PartitionSpec entry writes them: None, one name or a tuple."""


def axes_of(entry: MeshAxes) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (or rule), as a tuple: None -> (), "xcd" -> ("xcd",)."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def dim_axes(spec: PartitionSpec, dim: int) -> tuple[str, ...]:
    """The mesh axes that shard dimension `dim` under `spec` (a spec may be shorter than the rank)."""
    return axes_of(spec[dim]) if dim < len(spec) else ()


def spec_axes(spec: PartitionSpec) -> frozenset[str]:
    """Every mesh axis that shards some dimension under `spec`."""
    return frozenset(axis for entry in spec.partitions for axis in axes_of(entry))
