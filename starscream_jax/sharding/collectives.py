"""Hierarchical collectives for code that runs per device inside `jax.shard_map` over a ('data', 'gpu', 'xcd') mesh.

Layouts and `sharding.einsum` let XLA pick the collectives, and for the layouts here it picks hierarchical ones. Code
written against local shards (a custom kernel, a loss, a sampler) names its collectives itself; these keep them
hierarchical: each one's replica groups lie inside one GPU (`xcd`) or take one partition from each GPU (the other
axes), never both.

  reduce_scatter_inside_gpu   sum over the partitions of a GPU, each keeping 1/X of the result   (on-package link)
  all_gather_inside_gpu       the inverse: the GPU's X pieces concatenated on every partition    (on-package link)
  all_reduce_across_gpus      sum over the GPUs (data and gpu axes), partition by partition      (inter-GPU link)
  hierarchical_all_reduce     the three composed: a sum over every device that sends 1/X of the bytes across GPUs
  hierarchical_psum           psum (or pmax) over any axes, one axis at a time, inside the GPU first: for small
                              values, where latency and not bandwidth sets the time
  hierarchical_all_gather     a dimension split over several axes put back together, one axis at a time, the
                              innermost (the partitions of a GPU, in this project's layouts) first

Each takes the axis names from the mesh in use (`jax.sharding.get_abstract_mesh()`), so a mesh without a data axis or
with one partition per GPU works unchanged.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from ..errors import ShardingRuleError
from ..hardware.axes import ACROSS_GPUS, INSIDE_GPU, dim_axes


def _present(axes: tuple[str, ...]) -> tuple[str, ...]:
    """The `axes` the mesh in use has."""
    names = jax.sharding.get_abstract_mesh().axis_names
    return tuple(axis for axis in axes if axis in names)


def reduce_scatter_inside_gpu(x: jax.Array, dimension: int = 0) -> jax.Array:
    """Sum of `x` over the partitions of each GPU, split along `dimension`: each partition keeps its 1/X slice
    (x.shape[dimension] / X rows, in partition order)."""
    _check_divisible(x, dimension, "reduce_scatter_inside_gpu")
    return jax.lax.psum_scatter(x, INSIDE_GPU, scatter_dimension=dimension, tiled=True)


def all_gather_inside_gpu(x: jax.Array, dimension: int = 0) -> jax.Array:
    """The partitions' slices of `x` concatenated along `dimension` (X times its rows), on every partition."""
    return jax.lax.all_gather(x, INSIDE_GPU, axis=dimension, tiled=True)


def all_reduce_across_gpus(x: jax.Array) -> jax.Array:
    """Sum of `x` over the GPUs (the data and gpu axes): partition i of each GPU sums with partition i of the
    others."""
    axes = _present(ACROSS_GPUS)
    return jax.lax.psum(x, axes) if axes else x


def hierarchical_all_reduce(x: jax.Array, dimension: int = 0) -> jax.Array:
    """Sum of `x` over every device, as a reduce-scatter inside each GPU along `dimension`, an all-reduce of the
    1/X slice across GPUs and an all-gather inside each GPU. Equal to `jax.lax.psum(x, all axes)`; the inter-GPU
    link carries 1/X of the bytes a flat all-reduce sends over it."""
    return all_gather_inside_gpu(all_reduce_across_gpus(reduce_scatter_inside_gpu(x, dimension)), dimension)


def hierarchical_psum(x: jax.Array, axes: tuple[str, ...] | str, reduction=jax.lax.psum) -> jax.Array:
    """`reduction` (jax.lax.psum or jax.lax.pmax) of `x` over the mesh `axes`, one axis at a time, `xcd` first; a
    reduction over (gpu, xcd) at once would be one flat collective spanning both levels."""
    for axis in sorted((axes,) if isinstance(axes, str) else axes, key=lambda name: name != INSIDE_GPU):
        x = reduction(x, axis)
    return x


def hierarchical_sum(x: jax.Array, spec: PartitionSpec, mesh, dims: tuple[int, ...]) -> jax.Array:
    """`x` (placed by `spec` on `mesh`) summed over its dimensions `dims`: each device sums its own shard, then the
    sums are added over the mesh axes that split those dimensions, inside each GPU first (`hierarchical_psum`); the
    result is placed as `x` was, less the summed dimensions. `jnp.sum` over dimensions split over (gpu, xcd) would
    be one flat all-reduce spanning both levels."""
    axes = tuple(axis for dim in dims for axis in dim_axes(spec, dim))
    kept = PartitionSpec(*(dim_axes(spec, dim) or None for dim in range(x.ndim) if dim not in dims))
    return jax.shard_map(lambda local: hierarchical_psum(jnp.sum(local, axis=dims), axes), mesh=mesh,
                         in_specs=spec, out_specs=kept)(x)


def hierarchical_all_gather(x: jax.Array, axes: tuple[str, ...], dimension: int) -> jax.Array:
    """`dimension` of `x`, split over the mesh `axes` (major first, as a PartitionSpec entry lists them), gathered
    whole on every device: one tiled all-gather per axis, from the innermost, so that each stays on one level."""
    for axis in reversed(axes):
        x = jax.lax.all_gather(x, axis, axis=dimension, tiled=True)
    return x


def _check_divisible(x: jax.Array, dimension: int, name: str) -> None:
    partitions = jax.lax.axis_size(INSIDE_GPU)
    if x.shape[dimension] % partitions:
        raise ShardingRuleError(
            f"{name}: dimension {dimension} of the local array {tuple(x.shape)} has {x.shape[dimension]} rows, which "
            f"the {partitions} partitions of a GPU do not divide; scatter along a dimension they divide")
