"""Split-K (flash-decoding) attention: each device attends to its own part of the key positions, and the partial
results are merged exactly.

A softmax over key positions split into parts can be computed part by part: part i gives its normalised output
o_i = sum_t exp(s_t - m_i) v_t / l_i, its running max m_i = max_t s_t and its sum l_i = sum_t exp(s_t - m_i). The
whole softmax's output is sum_i w_i o_i / sum_i w_i with w_i = l_i exp(m_i - max_j m_j). A part with no visible key
(all masked) has m_i = -inf and l_i = 0, and weighs nothing.

  partial_attention   one part: q [B, S, H, E] against k / v [B, T, K, E] (grouped-query: query head h reads kv
                      head h // (H / K)) under a mask [B, S, T] -> `PartialAttention`
  combine_partials    the exact merge of n parts stacked on a leading axis ([n, ...] fields): pure, for parts a
                      device holds itself (a paged cache's pages, or the stages of `merge_partials`)
  merge_partials      the merge across devices, inside `jax.shard_map`: one collective of the packed parts per mesh
                      axis that splits the keys, the partitions of a GPU (xcd) first, so each collective stays inside
                      one GPU or takes one partition from each GPU. The result is whole on every device of the group.

The KV cache a decode layout splits by position over `xcd` (`cache_seq`) is read this way: each partition reads only
its 1/X of the cache, and the merge moves [B, S, H, E + 2] float32 values per partition, independent of T.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from ..hardware.axes import INSIDE_GPU


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PartialAttention:
    """One part's attention over its key positions: `out` [..., B, S, H, E] float32 normalised by its own sum,
    `max` [..., B, S, H] (-inf where the part holds no visible key) and `sum` [..., B, S, H] float32 (0 there)."""

    out: jax.Array
    max: jax.Array
    sum: jax.Array


def partial_attention(q_BSHE: jax.Array, k_BTKE: jax.Array, v_BTKE: jax.Array, visible_BST: jax.Array,
                      k_scale_BTK: jax.Array | None = None, v_scale_BTK: jax.Array | None = None, *,
                      scale: float | None = None, softcap: float = 0.0) -> PartialAttention:
    """Softmax attention of the queries to the keys where `visible_BST` is True, scaled by 1/sqrt(E) (or `scale`),
    as one part of a split-K attention (see the module docstring). Scores and sums in float32. Keys and values of an
    8-bit cache come with their float32 scales per position and kv head [B, T, K], applied to the scores (the
    keys') and to the weights (the values'), as `ops.attention_over_8_bit_cache` applies them. `softcap` (0: none)
    caps the scaled scores as softcap * tanh(scores / softcap) (Gemma 2)."""
    B, S, H, E = q_BSHE.shape
    K = k_BTKE.shape[2]
    q_BSKGE = q_BSHE.reshape(B, S, K, H // K, E)
    scores_BSKGT = jnp.einsum("bskge,btke->bskgt", q_BSKGE, k_BTKE.astype(q_BSHE.dtype),
                              preferred_element_type=jnp.float32) * (E ** -0.5 if scale is None else scale)
    if k_scale_BTK is not None:
        scores_BSKGT = scores_BSKGT * jnp.swapaxes(k_scale_BTK, 1, 2)[:, None, :, None, :]
    if softcap:
        scores_BSKGT = softcap * jnp.tanh(scores_BSKGT / softcap)
    scores_BSKGT = jnp.where(visible_BST[:, :, None, None, :], scores_BSKGT, -jnp.inf)
    max_BSKG = jnp.max(scores_BSKGT, axis=-1)
    finite_max = jnp.where(jnp.isfinite(max_BSKG), max_BSKG, 0.0)
    weights_BSKGT = jnp.exp(scores_BSKGT - finite_max[..., None])
    sum_BSKG = jnp.sum(weights_BSKGT, axis=-1)
    if v_scale_BTK is not None:
        weights_BSKGT = weights_BSKGT * jnp.swapaxes(v_scale_BTK, 1, 2)[:, None, :, None, :]
    out_BSKGE = jnp.einsum("bskgt,btke->bskge", weights_BSKGT, v_BTKE.astype(jnp.float32))
    out_BSKGE = out_BSKGE / jnp.where(sum_BSKG > 0, sum_BSKG, 1.0)[..., None]
    return PartialAttention(out_BSKGE.reshape(B, S, H, E), max_BSKG.reshape(B, S, H), sum_BSKG.reshape(B, S, H))


def strided_positions(slots: int, parts: int, mine) -> jax.Array:
    """The sequence positions [slots] of device `mine`'s slots in a KV cache whose positions are split over `parts`
    devices in strided order (model.names.CACHE): mine, mine + parts, mine + 2 parts, ..."""
    return mine + parts * jnp.arange(slots)


def combine_partials(parts: PartialAttention) -> PartialAttention:
    """The exact merge of n parts whose fields are stacked on a leading axis (out [n, ..., E], max / sum [n, ...])
    -> the merged PartialAttention (no leading axis): out the whole softmax's output, max and sum those of all the
    keys together, so a merged result merges again with others."""
    top = jnp.max(parts.max, axis=0)
    finite_top = jnp.where(jnp.isfinite(top), top, 0.0)
    weights = parts.sum * jnp.exp(parts.max - finite_top)  # 0 for a part with no visible key
    total = jnp.sum(weights, axis=0)
    out = jnp.sum(weights[..., None] * parts.out, axis=0) / jnp.where(total > 0, total, 1.0)[..., None]
    return PartialAttention(out, top, total)


def merge_partials(part: PartialAttention, axes: tuple[str, ...]) -> PartialAttention:
    """Inside `jax.shard_map`: this device's part merged with those of the other devices along the mesh `axes` that
    split the keys, one collective per axis (xcd first). Out, max and sum are packed into one array [.., E + 2] and
    gathered as a sum of one slot per device ([n, .., E + 2], zeros but this device's slot): an all-reduce whose
    result JAX types as the same on every device of the group (an all-gather's it types as varying), so the merged
    output leaves `shard_map` replicated over `axes`."""
    for axis in sorted(axes, key=lambda name: name != INSIDE_GPU):
        packed = jnp.concatenate([part.out, part.max[..., None], part.sum[..., None]], axis=-1)
        slots = jnp.arange(jax.lax.axis_size(axis)) == jax.lax.axis_index(axis)
        gathered = jax.lax.psum(jnp.where(slots.reshape(-1, *[1] * packed.ndim), packed, 0.0), axis)
        part = combine_partials(PartialAttention(gathered[..., :-2], gathered[..., -2], gathered[..., -1]))
    return part
