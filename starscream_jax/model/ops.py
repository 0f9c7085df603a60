"""Kernels that run per device inside `jax.shard_map`: attention (with the KV cache), vocab-parallel embedding
lookup and cross entropy. Each takes its placement from the active layout; with none active it runs unsharded.

Inside shard_map every array is the local shard; the only communication is the explicit psum / pmax over the mesh
axes that shard the vocabulary, one axis at a time (inside the GPU first), so it stays hierarchical.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from ..errors import ShardingRuleError
from ..hardware.axes import axes_of, dim_axes, spec_axes
from ..hardware.backend import policy_of
from ..sharding.apply import Placement, compute_device, placed_by
from ..sharding.collectives import hierarchical_all_gather, hierarchical_psum
from ..sharding.rules import LogicalNames
from .names import ATTN_KV, ATTN_Q, CACHE, CACHE_SCALE, LOGITS, POSITIONS, RESIDUAL, TOKENS
from . import eight_bit_decode
from .split_k import merge_partials, partial_attention, strided_positions


class AttentionOptions(NamedTuple):
    """How attention departs from causal softmax(q k / sqrt(head_dim)) v (Gemma 2): `scale` multiplies the scores
    (None: head_dim ** -0.5), `softcap` caps them as softcap * tanh(scores / softcap) (0: not capped), and with
    `sliding` each query sees only the keys less than a window (given per layer, `attention`'s `window`) behind it.
    Attention with options runs in XLA's form with an explicit mask (`explicit_attention`) in every phase."""

    scale: float | None = None
    softcap: float = 0.0
    sliding: bool = False

    def describe(self) -> str:
        parts = [f"an attention scale of {self.scale}" if self.scale is not None else "",
                 f"attention soft-capping at {self.softcap}" if self.softcap else "",
                 "a sliding attention window" if self.sliding else ""]
        return ", ".join(part for part in parts if part)

    def scores(self, scores: jax.Array, head_dim: int) -> jax.Array:
        """Raw float32 scores q k scaled and soft-capped."""
        scores = scores * (head_dim ** -0.5 if self.scale is None else self.scale)
        return self.softcap * jnp.tanh(scores / self.softcap) if self.softcap else scores


def visible_keys(query_positions_BS: jax.Array, key_positions_BT: jax.Array, window=None) -> jax.Array:
    """[B, S, T]: whether each query sees each key, those at its position or before it and, given a `window` (a
    scalar), less than `window` positions behind it."""
    behind_BST = query_positions_BS[:, :, None] - key_positions_BT[:, None, :]
    visible_BST = behind_BST >= 0
    return visible_BST if window is None else visible_BST & (behind_BST < window)


def explicit_attention(q_BSHE, k_BTKE, v_BTKE, visible_BST, options: AttentionOptions, k_scale_BTK=None,
                        v_scale_BTK=None):
    """Grouped-query attention in XLA's form under `options`, each query seeing the keys where `visible_BST`
    [B, S, T]: scores in float32 (an 8-bit cache's key scales [B, T, K] applied to them and its value scales to the
    probabilities), probabilities cast to the queries' dtype before they weigh the values, as transformers does."""
    B, S, H, E = q_BSHE.shape
    K = k_BTKE.shape[2]
    q_BSKGE = q_BSHE.reshape(B, S, K, H // K, E)
    scores_BKGST = jnp.einsum("bskge,btke->bkgst", q_BSKGE, k_BTKE.astype(q_BSHE.dtype),
                              preferred_element_type=jnp.float32)
    if k_scale_BTK is not None:
        scores_BKGST = scores_BKGST * jnp.swapaxes(k_scale_BTK, 1, 2)[:, :, None, None, :]
    scores_BKGST = options.scores(scores_BKGST, E)
    masked_BKGST = jnp.where(visible_BST[:, None, None], scores_BKGST, jnp.finfo(jnp.float32).min)
    probabilities_BKGST = jax.nn.softmax(masked_BKGST, axis=-1)
    if v_scale_BTK is not None:
        probabilities_BKGST = probabilities_BKGST * jnp.swapaxes(v_scale_BTK, 1, 2)[:, :, None, None, :]
    out_BSKGE = jnp.einsum("bkgst,btke->bskge", probabilities_BKGST.astype(q_BSHE.dtype), v_BTKE.astype(q_BSHE.dtype))
    return out_BSKGE.reshape(B, S, H, E)


def _offset(axes: tuple[str, ...], local_size: int):
    """Index of this device's first element along a dimension sharded over `axes` (0 when unsharded)."""
    return jax.lax.axis_index(axes) * local_size if axes else 0


def run_sharded(local_fn, args, names: list[LogicalNames | None], outs: list[tuple[LogicalNames, tuple]],
                tensor: str, check_vma: bool = True, placement: Placement | None = None):
    """Runs `local_fn(*local_args, specs=...)` on every device's shards under `placement` (None: `current()`).
    `names` are the logical names of `args` (None = a replicated scalar); `outs` the (logical names, global shape)
    of each result; `specs` hands the local function each argument's PartitionSpec so it knows which axes shard
    which dimension. `check_vma=False` for a local function whose kernels (Pallas) do not say how their outputs
    vary over the mesh axes."""
    placement = placed_by(placement)
    if not placement.placed:
        return local_fn(*args, specs=[PartitionSpec()] * len(args))
    specs = [PartitionSpec() if n is None else placement.activation_spec(n, a.shape, tensor)
             for a, n in zip(args, names)]
    out_specs = tuple(placement.activation_spec(n, shape, tensor) for n, shape in outs)
    fn = jax.shard_map(lambda *a: local_fn(*a, specs=specs), mesh=placement.mesh, in_specs=tuple(specs),
                       out_specs=out_specs[0] if len(outs) == 1 else out_specs, check_vma=check_vma)
    return fn(*[placement.placed_as(a, s) for a, s in zip(args, specs)])


def kv_heads_for_local_queries(kv_BTKE, local_heads: int, group: int, q_axes, kv_axes):
    """The kv heads that serve this device's query heads. When kv heads are copied over some axes the queries are
    split over (fewer kv heads than devices), each device slices out the one(s) its query heads share."""
    local_kv = kv_BTKE.shape[2]
    if local_heads == local_kv * group:
        return kv_BTKE
    needed = max(1, local_heads // group)
    start = _offset(q_axes, local_heads) // group - _offset(kv_axes, local_kv)
    return jax.lax.dynamic_slice_in_dim(kv_BTKE, start, needed, axis=2)


def _check_head_split(n_heads: int, n_kv: int, q_axes, kv_axes, mesh_shape: dict):
    if tuple(kv_axes) != tuple(q_axes)[:len(kv_axes)]:
        raise ShardingRuleError(f"kv heads sharded over {kv_axes} but query heads over {q_axes}; the kv-head axes must "
                                f"lead the query-head axes so each device's queries find their kv heads")
    devices = 1
    for a in q_axes:
        devices *= mesh_shape[a]
    local, group = n_heads // devices, n_heads // n_kv
    if local % group and group % local:
        raise ShardingRuleError(f"{n_heads} query heads over {devices} devices gives {local} per device, which "
                                f"splits groups of {group} query heads per kv head unevenly; use a head count whose "
                                f"per-device share divides or is divided by {group}")


def fused_attention(q_BSHE, k_BTKE, v_BTKE, device=None, **options):
    """`jax.nn.dot_product_attention(q, k, v, **options)` through the vendor's fused kernel where the backend policy
    of `device` (None: `compute_device()`) asks for it (`BackendPolicy.fuses_attention`: cuDNN's flash attention on
    NVIDIA GPUs with bf16 / fp16 inputs, where JAX would pick XLA's unfused form, [B, H, S, T] scores in memory);
    XLA's form elsewhere, and for shapes cuDNN refuses (it raises NotImplementedError while tracing)."""
    if policy_of(device or compute_device()).fuses_attention(q_BSHE.dtype):
        try:
            return jax.nn.dot_product_attention(q_BSHE, k_BTKE, v_BTKE, implementation="cudnn", **options)
        except NotImplementedError:
            pass
    return jax.nn.dot_product_attention(q_BSHE, k_BTKE, v_BTKE, **options)


def _causal_attention(q_BSHE, k_BTKE, v_BTKE, device):
    """Causal attention of one device's shards (`fused_attention`)."""
    return fused_attention(q_BSHE, k_BTKE, v_BTKE, device, is_causal=True)


def attention_over_8_bit_cache(q_BSHE, k_BTKE, v_BTKE, k_scale_BTK, v_scale_BTK, positions_BS, device=None):
    """Attention of the queries at `positions` [B, S] to one layer's 8-bit cache (values [B, T, K, E], a float32
    scale per position and kv head [B, T, K]): each query sees the cached positions up to its own. The scales are
    applied to the scores (keys') and to the probabilities (values'), so no dequantized copy of the cache is made.
    Decode (S = 1) reads the cache in place where the backend policy of `device` (None: `compute_device()`) says so
    (`BackendPolicy.eight_bit_attention`): on an NVIDIA GPU by the Pallas kernel of `eight_bit_decode` (tensor
    cores), for a shape it does not take by reductions in XLA (`_decode_over_8_bit_cache`). Elsewhere, and for a
    prefill chunk (S > 1), batched matmuls of the 8-bit values converted in their own fusions."""
    implementation = _eight_bit_decode_implementation(q_BSHE.shape[2], *k_BTKE.shape[1:], device=device)
    if q_BSHE.shape[1] == 1 and implementation in ("pallas", "interpret"):
        ptx = policy_of(device or compute_device()).inline_ptx
        return eight_bit_decode.decode_attention(q_BSHE, k_BTKE, v_BTKE, k_scale_BTK, v_scale_BTK,
                                                 positions_BS[:, 0] + 1, interpret=implementation == "interpret",
                                                 ptx=ptx)
    if q_BSHE.shape[1] == 1 and implementation == "reductions":
        return _decode_over_8_bit_cache(q_BSHE, k_BTKE, v_BTKE, k_scale_BTK, v_scale_BTK, positions_BS)
    B, S, H, E = q_BSHE.shape
    K = k_BTKE.shape[2]
    q_BSKGE = q_BSHE.reshape(B, S, K, H // K, E)
    scores_BKGST = jnp.einsum("bskge,btke->bkgst", q_BSKGE, k_BTKE.astype(q_BSHE.dtype),
                              preferred_element_type=jnp.float32)
    scores_BKGST = scores_BKGST * (jnp.swapaxes(k_scale_BTK, 1, 2)[:, :, None, None, :] * E ** -0.5)
    seen = jnp.arange(k_BTKE.shape[1])[None, None, None, None, :] <= positions_BS[:, None, None, :, None]
    probabilities_BKGST = jax.nn.softmax(jnp.where(seen, scores_BKGST, jnp.finfo(jnp.float32).min), axis=-1)
    weighted_BKGST = probabilities_BKGST * jnp.swapaxes(v_scale_BTK, 1, 2)[:, :, None, None, :]
    out_BSKGE = jnp.einsum("bkgst,btke->bskge", weighted_BKGST.astype(q_BSHE.dtype), v_BTKE.astype(q_BSHE.dtype))
    return out_BSKGE.reshape(B, S, H, E)


def _eight_bit_decode_implementation(query_heads: int, length: int, kv_heads: int, head_dim: int,
                                     device=None) -> str:
    """How decode over an 8-bit cache runs on `device` (None: `compute_device()`), by its backend policy
    (`BackendPolicy.eight_bit_attention`): "pallas" on `eight_bit_decode`'s kernel where the policy asks for it (the
    CUDA policy) and the kernel takes the shape, else "reductions" (`_decode_over_8_bit_cache`) where the policy
    reads the cache in place, else "" (XLA's batched dots, as a prefill chunk runs)."""
    chosen = policy_of(device or compute_device()).eight_bit_attention
    if chosen == "pallas" and eight_bit_decode.applies(query_heads, kv_heads, length, head_dim):
        return "pallas"
    return "reductions" if chosen in ("pallas", "reductions") else ""


def _decode_over_8_bit_cache(q_B1HE, k_BTKE, v_BTKE, k_scale_BTK, v_scale_BTK, positions_B1):
    """Decode attention (one query per row, at `positions` [B, 1]) to an 8-bit cache [B, T, K, E] read in place:
    out [B, 1, H, E] in q's dtype.

    Why not matmuls: a batched dot of q [B, K, G, E] with the cache needs (b, k) as the cache's leading dimensions,
    so XLA copied the converted cache [B, T, K, E] into [B, K, T, E] bfloat16 every step (an int8 cache ran 0.25x of
    bfloat16's at batch 64 on an H200, benchmarks/NOTES.md run 19). Here every product keeps the cache's own order:
    scores [B, T, K, G] = sum over E of k [B, T, K, 1, E] * q [B, 1, K, G, E], a reduction over the cache's minor
    dimension whose fusion converts each 8-bit row as it reads it; out [B, K, G, E] = sum over T of
    p [B, T, K, G, 1] * v [B, T, K, 1, E], a reduction over the cache's positions, likewise. Both in float32 on
    CUDA cores (each cache value meets G queries twice: at large batches as much time as the read, which is why a
    GPU runs `eight_bit_decode`'s tensor-core kernel instead); the key scales multiply the scores and the value
    scales the probabilities, so nothing the size of the cache is written."""
    B, _, H, E = q_B1HE.shape
    K = k_BTKE.shape[2]
    q_BKGE = q_B1HE[:, 0].reshape(B, K, H // K, E).astype(jnp.float32)
    scores_BTKG = jnp.sum(k_BTKE.astype(jnp.float32)[:, :, :, None, :] * q_BKGE[:, None], axis=-1)
    scores_BTKG = scores_BTKG * (k_scale_BTK * E ** -0.5)[..., None]
    seen_BT = jnp.arange(k_BTKE.shape[1])[None, :] <= positions_B1
    masked_BTKG = jnp.where(seen_BT[:, :, None, None], scores_BTKG, jnp.finfo(jnp.float32).min)
    weighted_BTKG = jax.nn.softmax(masked_BTKG, axis=1) * v_scale_BTK[..., None]
    out_BKGE = jnp.sum(weighted_BTKG[..., None] * v_BTKE.astype(jnp.float32)[:, :, :, None, :], axis=1)
    return out_BKGE.reshape(B, 1, H, E).astype(q_B1HE.dtype)


def _cached_attention(q_BSHE, cache_k_BTKE, cache_v_BTKE, positions_BS, device=None):
    """Attention of the queries at `positions` [B, S] to a cache [B, T, K, E] of one layer: each query sees the
    cached positions up to its own. Decode (S = 1): the positions a query sees are a prefix of the cache, given as
    `key_value_seq_lengths` [B] (position + 1), which cuDNN's fused kernel takes on NVIDIA GPUs (reading the cache
    with its strides, no transpose, no [B, H, 1, T] mask; `fused_attention`). Prefill into a cache (S > 1): an
    explicit [B, 1, S, T] mask, which cuDNN takes as a bias (`fused_attention`)."""
    k_BTKE, v_BTKE = cache_k_BTKE.astype(q_BSHE.dtype), cache_v_BTKE.astype(q_BSHE.dtype)
    if q_BSHE.shape[1] == 1:
        return fused_attention(q_BSHE, k_BTKE, v_BTKE, device, key_value_seq_lengths=positions_BS[:, 0] + 1)
    key_positions = jnp.arange(cache_k_BTKE.shape[1])
    mask = key_positions[None, None, None, :] <= positions_BS[:, None, :, None]
    return fused_attention(q_BSHE, k_BTKE, v_BTKE, device, mask=mask)


def _sequence_split_attention(q_BSHE, k_BSKE, v_BSKE, positions_BS, seq_axes: tuple[str, ...],
                              options: AttentionOptions | None = None, window=None):
    """Causal attention of this device's stretch of the sequence (context parallelism): the keys and values of the
    whole sequence, and their positions, are all-gathered over the mesh axes that split it, one axis at a time from
    the innermost (inside the GPU first), and each query sees the keys at positions up to its own. The gathers'
    transposes reduce-scatter the key and value gradients back. With `options`, `explicit_attention` (`window`:
    the layer's sliding window, or None)."""
    key_positions = hierarchical_all_gather(positions_BS, seq_axes, dimension=1)
    keys, values = (hierarchical_all_gather(x, seq_axes, dimension=1) for x in (k_BSKE, v_BSKE))
    if options is not None:
        return explicit_attention(q_BSHE, keys, values, visible_keys(positions_BS, key_positions, window), options)
    mask = key_positions[:, None, None, :] <= positions_BS[:, None, :, None]  # [B, 1, S_local, T]
    return jax.nn.dot_product_attention(q_BSHE, keys, values, mask=mask)


def attention(q_BSHE, k_BSKE, v_BSKE, positions_BS, cache=None, cache_index=None,
              options: AttentionOptions | None = None, window=None, placement: Placement | None = None):
    """Causal grouped-query attention through `jax.nn.dot_product_attention` (cuDNN's fused kernel on NVIDIA GPUs
    in training, in prefill into a KV cache, its explicit mask as a bias, and in decode; see `_cached_attention`).
    Returns out [B, S, H, E].

    Without a cache: keys are the S new positions. With a cache (one layer's own arrays as `dense_cache.DenseLayer`'s
    `read` gives them: keys and values [B, T, K, E] `k` and `v`, and an 8-bit cache's scales; this module stays below
    the cache's, which attends through it) that already holds the new keys and values at their positions (the model writes them into
    its cache in place, `dense_cache.write_cache`), queries attend to every cached position <= their own, and k / v
    are not read. An 8-bit cache (with its scales [B, T, K]) is read by `attention_over_8_bit_cache`.
    Placement: ATTN_Q / ATTN_KV names; the cache uses CACHE's. A layout that splits `seq` runs context-parallel
    attention (`_sequence_split_attention`), from the new keys alone where the cache holds nothing before them
    (`cache_index` 0, known while tracing: a whole prompt's prefill) and holds them as they are (not in 8 bits,
    which the unsharded model reads). A layout that splits the cache's positions (`cache_seq`) attends split-K
    (`_split_k_attention`), 8-bit caches too: decode, and a later chunk of a prompt split over the sequence
    (chunked prefill), whose queries are gathered over the partitions that split it.

    `options` (Gemma 2's scale, soft-capping, sliding window: `AttentionOptions`; None for plain attention) runs
    every form but split-K in XLA's form with an explicit mask (`explicit_attention`); `window` is this layer's
    window, a scalar int32 (traced inside a layer loop), when `options.sliding`. `placement`: where it runs (None:
    `current()`).
    """
    n_heads, n_kv = q_BSHE.shape[2], k_BSKE.shape[2]
    group = n_heads // n_kv
    placement = placed_by(placement)
    device = placement.device

    def local(q, k, v, pos, *rest, specs):
        q_axes, kv_axes, seq_axes = dim_axes(specs[0], 2), dim_axes(specs[1], 2), dim_axes(specs[0], 1)
        layer_window = None
        if options is not None and options.sliding:
            *rest, layer_window = rest
        if cache is None or (seq_axes and _from_start(cache_index) and len(rest) == 2):
            k_sel = kv_heads_for_local_queries(k, q.shape[2], group, q_axes, kv_axes)
            v_sel = kv_heads_for_local_queries(v, q.shape[2], group, q_axes, kv_axes)
            if seq_axes:
                return _sequence_split_attention(q, k_sel, v_sel, pos, seq_axes, options, layer_window)
            if options is not None:
                return explicit_attention(q, k_sel, v_sel, visible_keys(pos, pos, layer_window), options)
            return _causal_attention(q, k_sel, v_sel, device)
        selected = [kv_heads_for_local_queries(entry, q.shape[2], group, q_axes, kv_axes) for entry in rest]
        if cache_axes := dim_axes(specs[4], 1):
            return _split_k_attention(q, pos, cache_axes, seq_axes, *selected, options=options, window=layer_window)
        if options is not None:
            key_positions_BT = jnp.broadcast_to(jnp.arange(selected[0].shape[1]), (q.shape[0], selected[0].shape[1]))
            return explicit_attention(q, *selected[:2], visible_keys(pos, key_positions_BT, layer_window), options,
                                       *selected[2:])
        if len(selected) == 4:
            return attention_over_8_bit_cache(q, *selected, pos, device=device)
        return _cached_attention(q, *selected, pos, device)

    if placement.placed:
        q_spec = placement.activation_spec(ATTN_Q, q_BSHE.shape)
        kv_spec = placement.activation_spec(ATTN_KV, k_BSKE.shape)
        _check_head_split(n_heads, n_kv, axes_of(q_spec[2]), axes_of(kv_spec[2]), dict(placement.mesh.shape))
        if cache is not None:
            _check_cache_split(q_spec, placement.activation_spec(CACHE, cache.k.shape), placement.layout.name)
    args = [q_BSHE, k_BSKE, v_BSKE, positions_BS]
    names = [ATTN_Q, ATTN_KV, ATTN_KV, POSITIONS]
    if cache is not None:
        args, names = [*args, cache.k, cache.v], [*names, CACHE, CACHE]
    eight_bit = cache is not None and cache.eight_bit
    if eight_bit:
        args, names = [*args, cache.k_scale, cache.v_scale], [*names, CACHE_SCALE, CACHE_SCALE]
    if options is not None and options.sliding:
        if window is None:
            raise ShardingRuleError("sliding-window attention needs the layer's window; pass window=")
        args, names = [*args, jnp.asarray(window, jnp.int32)], [*names, None]
    kernel = eight_bit and q_BSHE.shape[1] == 1 and _eight_bit_decode_implementation(
        n_heads, *cache.k.shape[1:], device=device) in ("pallas", "interpret")
    return run_sharded(local, args, names, [(ATTN_Q, q_BSHE.shape)], "attention", check_vma=not kernel,
                       placement=placement)


def _from_start(cache_index) -> bool:
    """Whether the new positions start the cache (index 0 known while tracing): then they attend to themselves."""
    return not isinstance(cache_index, jax.core.Tracer) and int(cache_index) == 0


def _check_cache_split(q_spec, cache_spec, layout: str) -> None:
    """A layout that splits the queries' sequence must split the cache's positions over the same axes (prefill
    writes the cache where its attention holds the keys); split-K needs every query whole, or gathered, on the
    devices that split the cache's positions."""
    seq_axes, cache_axes = axes_of(q_spec[1]), axes_of(cache_spec[1])
    if seq_axes and set(seq_axes) != set(cache_axes):
        raise ShardingRuleError(
            f"layout {layout} splits the sequence over {seq_axes} but the KV cache's positions over "
            f"{cache_axes or 'no axis'}; give 'cache_seq' the axes of 'seq' so prefill writes the cache in place")
    shared = set(cache_axes) & spec_axes(q_spec)
    if not seq_axes and shared:
        raise ShardingRuleError(
            f"layout {layout} splits the KV cache's positions and the queries over {sorted(shared)}; split-K "
            f"attention needs each query whole where the cache is split: map 'cache_seq' to other axes")


def _split_k_attention(q_BSHE, positions_BS, cache_axes: tuple[str, ...], seq_axes: tuple[str, ...],
                       cache_k_BTKE, cache_v_BTKE, *scales_BTK, options: AttentionOptions | None = None,
                       window=None):
    """Attention of the queries to this device's slots of a cache whose positions are split over `cache_axes`
    (strided order, names.CACHE), merged with the other devices' parts (`split_k.merge_partials`: one collective
    per axis, inside the GPU first). Each query sees the positions up to its own. An 8-bit cache's k / v scales
    [B, T, K] are split with its positions. Queries split over `seq_axes` (a later chunk of a prompt split over the
    sequence, `seq_axes` those of the cache) are first gathered over them, every device attending the whole chunk
    to its slots, and each keeps its own stretch of the merged output: the merge moves the chunk's
    [B, S, H, E + 2] float32 parts, not the cache. `options` and `window` as `attention` takes them."""
    local_S = q_BSHE.shape[1]
    first = _offset(seq_axes, local_S)
    q_BSHE, positions_BS = (hierarchical_all_gather(x, seq_axes, dimension=1) for x in (q_BSHE, positions_BS))
    parts, mine = jax.lax.axis_size(cache_axes), jax.lax.axis_index(cache_axes)
    key_positions_T = strided_positions(cache_k_BTKE.shape[1], parts, mine)
    visible_BST = key_positions_T[None, None, :] <= positions_BS[:, :, None]
    if window is not None:
        visible_BST = visible_BST & (positions_BS[:, :, None] - key_positions_T[None, None, :] < window)
    extra = {} if options is None else {"scale": options.scale, "softcap": options.softcap}
    with jax.named_scope("split_k"):
        part = partial_attention(q_BSHE, cache_k_BTKE, cache_v_BTKE, visible_BST, *scales_BTK, **extra)
        out_BSHE = merge_partials(part, cache_axes).out.astype(q_BSHE.dtype)
    return jax.lax.dynamic_slice_in_dim(out_BSHE, first, local_S, axis=1) if seq_axes else out_BSHE


def embed_lookup(table_VD, tokens_BS, out: LogicalNames = RESIDUAL, placement: Placement | None = None):
    """The rows of an embedding table [V, D] for tokens [B, S] int: [B, S, D], placed by `placement`'s rule (None:
    `current()`) for `out` (default ("batch", "seq", "embed")); `jnp.take` unplaced.

    Vocabulary-parallel, for a table whose V is split (over `gpu` under starscream_tp): each device looks its tokens
    up in its own rows (zeros for tokens in another device's rows) and a psum over the vocabulary's mesh axes, one
    axis at a time, completes them; no [B, S, V] one-hot and no gather of the table. The table may come as stored
    (`create_sharded`; its D split inside the GPU) or as used (`weight`): one stored otherwise than the layout uses
    it is first taken as `weight(table, ("vocab", "embed"))` does, gathered inside the GPU, its gradient summed back
    into the stored shards. Explicit and Auto mesh axes alike."""
    placement = placed_by(placement)
    if not placement.placed:
        return jnp.take(table_VD, tokens_BS, axis=0)
    out_spec = placement.activation_spec(out, (*tokens_BS.shape, table_VD.shape[1]), "embedding")
    table_VD, table_spec = _table_at_use(placement, table_VD, axes_of(out_spec[2]))
    tokens_spec = PartitionSpec(out_spec[0], out_spec[1])
    vocab, embed = table_spec.partitions
    vocab_axes = axes_of(vocab)
    if axes_of(embed) != axes_of(out_spec[2]):
        raise ShardingRuleError(f"embedding table at use shards embed over {embed} but the residual stream "
                                f"over {out_spec[2]}; make the weight and activation rules for 'embed' agree")

    def local(table, tokens):
        ids = tokens - _offset(vocab_axes, table.shape[0])
        inside = (ids >= 0) & (ids < table.shape[0])
        rows = jnp.take(table, jnp.clip(ids, 0, table.shape[0] - 1), axis=0) * inside[..., None].astype(table.dtype)
        return hierarchical_psum(rows, vocab_axes)

    fn = jax.shard_map(local, mesh=placement.mesh, in_specs=(table_spec, tokens_spec), out_specs=out_spec)
    return fn(table_VD, placement.placed_as(tokens_BS, tokens_spec))


def _table_at_use(placement: Placement, table_VD, embed_axes: tuple[str, ...]):
    """(table, its PartitionSpec as shard_map takes it): on Explicit axes the table's own type (it may be `reduced`
    over the token axes, see `sharding.weight`), through `weight` first when its D is placed otherwise than the
    residual stream's; on Auto axes always through `weight`, placed as the layout's weights rules say."""
    names = ("vocab", "embed")
    if placement.auto:
        used = placement.weight(table_VD, names, tensor="embedding table")
        return used, placement.weight_spec(names, table_VD.shape, "embedding table")
    spec = jax.typeof(table_VD).sharding.spec
    if not spec.reduced and dim_axes(spec, 1) != embed_axes:
        table_VD = placement.weight(table_VD, names, tensor="embedding table")
        spec = jax.typeof(table_VD).sharding.spec
    return table_VD, spec.update(partitions=tuple(spec.partitions) + (None,) * (2 - len(spec.partitions)))


def cross_entropy(logits_BSV, targets_BS, placement: Placement | None = None):
    """Per-token cross entropy in nats, [B, S], of logits [B, S, V] against integer labels [B, S]: forward and
    gradient those of `optax.softmax_cross_entropy_with_integer_labels` on the whole logits.

    Computed where the layout places the logits (("batch", "seq", "vocab"): V split over `gpu` under starscream_tp):
    the max and the sum of exponentials are reduced over the vocabulary's mesh axes (pmax / psum of [B, S] values,
    one axis at a time), and the label's logit is a masked sum on the device that holds it; the [B, S, V] logits are
    never gathered and no [B, S, V] one-hot is built. Explicit and Auto mesh axes alike; plain unplaced.
    `placement`: where it runs (None: `current()`)."""
    def local(logits, targets, *, specs):
        vocab_axes = dim_axes(specs[0], 2)
        logits = logits.astype(jnp.float32)
        peak = jax.lax.stop_gradient(jnp.max(logits, axis=-1))
        peak = hierarchical_psum(peak, vocab_axes, jax.lax.pmax)
        total = jnp.sum(jnp.exp(logits - peak[..., None]), axis=-1)
        # the target's logit as a masked sum (0 where the target is in another device's shard): its gradient is an
        # elementwise select that fuses with the softmax's, where take_along_axis's is a scatter into a float32
        # [B, S, V] array written and read again
        ids = targets - _offset(vocab_axes, logits.shape[-1])
        picked = jnp.sum(jnp.where(jnp.arange(logits.shape[-1]) == ids[..., None], logits, 0.0), axis=-1)
        total, picked = hierarchical_psum(total, vocab_axes), hierarchical_psum(picked, vocab_axes)
        return jnp.log(total) + peak - picked

    return run_sharded(local, [logits_BSV, targets_BS], [LOGITS, TOKENS], [(TOKENS, targets_BS.shape)],
                       "cross entropy", placement=placement)
