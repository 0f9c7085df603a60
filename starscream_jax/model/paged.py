"""The paged KV cache as the model reads and writes it: per layer, pools of pages [pages, page_size, K, E] for keys
and values, and each row's block table [B, M] of page indices.

Placement (PAGES, TABLE): the page dimension over the layout's `attn_batch` axes (the partitions under the starscream
layouts), as are the rows of the batch and of the block table, kv heads over its `kv_heads` axes (gpu). Each shard
of the batch owns the pages of the same shard of the pool, and its block tables hold indices local to that shard, so
writing and reading the cache are local to a device: no page is stored twice and none moves. Pages lead the pool,
each page's positions in order with their kv heads, as cuDNN's paged attention reads them (no copy per step) and as
a row's gathered pages are laid out ([B, M * page_size, K, E] is a reshape of the gathered [B, M, page_size, K, E]).

Positions of padding (rows without a sequence, tokens past a row's chunk) are -1: they write nothing, read page 0 of
their shard (the null page no sequence holds) and their outputs are discarded.

A mixed step (`RowSplit`) runs a step's decode rows and prompt chunks as one stream of tokens per cache shard
([shards, n]: the shard's decode rows, one token each, then its chunks, `width` tokens each), so that every matmul of
the block reads its weights once for both; attention splits the stream back into its two groups of rows on each
device (a reshape of the local stream, nothing moves between devices) and attends each as its own step would (the
decode rows by the decode kernels, the chunks over their gathered pages). The block tables [shards * (decode +
prefill), M] hold each shard's decode rows, then its chunks.

An 8-bit cache (the model's `kv_format`: int8 or an fp8 format) holds the pages in that format and beside them a
float32 scale per position and kv head [pages, page_size, K] (SCALES, placed as the pages are): each new key or value
is quantized as the dense cache quantizes it (`quantize.quantize_cache_entry`, its head's amax over head_dim), and
decode reads the 8-bit pages and their scales in place where the backend takes the library's kernel
(`eight_bit_decode.paged_decode_attention`: `BackendPolicy.eight_bit_attention`), prefill chunks and other backends
gather them and attend as the dense 8-bit cache is (`ops.attention_over_8_bit_cache`). The pages of a layer take 1
byte per value and 4 per position and kv head.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import jax
import jax.numpy as jnp
from jax.tree_util import register_dataclass

from ..errors import StarscreamError
from ..hardware.axes import dim_axes
from ..sharding.apply import Placement, placed_by
from .quantize import quantize_cache_entry
from .names import ATTN_KV, ATTN_Q, POSITIONS
from . import eight_bit_decode
from ..hardware.backend import policy_of
from ..jax_private import cudnn_paged_decode
from .ops import (
    AttentionOptions,
    attention_over_8_bit_cache,
    explicit_attention,
    fused_attention,
    kv_heads_for_local_queries,
    run_sharded,
    visible_keys,
)

PAGES = ("attn_batch", "seq", "kv_heads", "head_dim")
"""One layer's pool of key (or value) pages [pages, page_size, K, E]."""
SCALES = PAGES[:3]
"""One layer's scales of an 8-bit pool [pages, page_size, K]: one per position and kv head."""
TABLE = ("attn_batch", None)
"""Block tables [B, M]: row b's i-th page (an index local to the row's shard)."""
KERNELS = ("gather", "cudnn")
"""Paged decode attention: `gather` copies each row's pages into [B, M * page_size, K, E] and runs
`jax.nn.dot_product_attention` (cuDNN's fused kernel on NVIDIA GPUs, XLA's elsewhere: exact, every backend);
`cudnn` runs cuDNN's paged attention on the pages in place (NVIDIA GPUs; 16-bit pages, decode steps whose every
query head has its kv head on its device; prefill chunks and Gemma 2's attention options gather; an 8-bit cache's
decode reads its pages in place by the library's 8-bit kernel where the backend takes it, `_eight_bit_in_place`).
JAX's Pallas paged-attention kernel for GPUs was measured and dropped: it reads a head-major pool at 2.1 TB/s where
cuDNN's kernel reads 3.5-4.0 (benchmarks/NOTES.md run 38)."""


@dataclass(frozen=True)
class RowSplit:
    """How a mixed step's stream of tokens splits on each cache shard: `decode` rows of one token, then `prefill`
    rows (prompt chunks) of `width` tokens; the stream holds decode + prefill * width tokens a shard, and the step's
    rows (block tables, outputs) decode + prefill a shard, in that order."""

    decode: int
    prefill: int
    width: int

    def __post_init__(self):
        if min(self.decode, self.prefill, self.width) < 1:
            raise StarscreamError(f"a mixed step of {self.decode} decode rows and {self.prefill} chunks of "
                                  f"{self.width} positions a shard; each needs at least 1")

    @property
    def tokens(self) -> int:
        """Tokens of one shard's stream."""
        return self.decode + self.prefill * self.width

    def groups(self, stream_bnX: jax.Array) -> tuple[jax.Array, jax.Array]:
        """A device's streams [b, n, ...] (b shards' worth, n = `tokens`) as its decode rows [b * decode, 1, ...]
        and its chunks [b * prefill, width, ...]."""
        shards, rest = stream_bnX.shape[0], stream_bnX.shape[2:]
        decode, prefill = stream_bnX[:, :self.decode], stream_bnX[:, self.decode:]
        return (decode.reshape(shards * self.decode, 1, *rest),
                prefill.reshape(shards * self.prefill, self.width, *rest))

    def rows(self, rows_RX: jax.Array) -> tuple[jax.Array, jax.Array]:
        """A device's rows [b * (decode + prefill), ...] (block tables) as its decode rows' and its chunks'."""
        by_shard = rows_RX.reshape(-1, self.decode + self.prefill, *rows_RX.shape[1:])
        rest = rows_RX.shape[1:]
        return (by_shard[:, :self.decode].reshape(-1, *rest), by_shard[:, self.decode:].reshape(-1, *rest))

    def joined(self, decode_RX: jax.Array, prefill_RX: jax.Array) -> jax.Array:
        """The inverse of `rows`: a device's decode rows [b * decode, ...] and chunks [b * prefill, ...] as its rows
        [b * (decode + prefill), ...], each shard's decode rows, then its chunks."""
        by_shard = self._side_by_side(decode_RX, prefill_RX, decode_RX.shape[1:])
        return by_shard.reshape(-1, *decode_RX.shape[1:])

    def last_tokens(self, prefill_last_B: jax.Array) -> jax.Array:
        """Where each row's last token sits in a device's streams [b, decode + prefill], from its chunks' last
        indices [b * prefill] (a decode row's one token is its last)."""
        shards = prefill_last_B.shape[0] // self.prefill
        decode_bD = jnp.broadcast_to(jnp.arange(self.decode, dtype=jnp.int32), (shards, self.decode))
        starts_P = self.decode + self.width * jnp.arange(self.prefill, dtype=jnp.int32)
        return jnp.concatenate([decode_bD, starts_P + prefill_last_B.reshape(shards, self.prefill)], axis=1)

    def stream(self, decode_BSX: jax.Array, prefill_BSX: jax.Array) -> jax.Array:
        """The inverse of `groups`: decode rows [b * decode, 1, ...] and chunks [b * prefill, width, ...] as the
        streams [b, n, ...]."""
        return self._side_by_side(decode_BSX, prefill_BSX, decode_BSX.shape[2:])

    def _side_by_side(self, decode: jax.Array, prefill: jax.Array, rest: tuple[int, ...]) -> jax.Array:
        """[b, decode (+ ...), rest] of each shard's decode part, then its chunks' part: both arrays are grouped
        by shard, b shards' worth each, whatever their rows hold (a row, or a row's tokens)."""
        shards = decode.shape[0] // self.decode
        return jnp.concatenate([decode.reshape(shards, -1, *rest), prefill.reshape(shards, -1, *rest)], axis=1)


@register_dataclass
@dataclass(frozen=True, kw_only=True)
class PagedCache:
    """Key and value page pools, one array per layer (L arrays of [pages, page_size, K, E] each), and the block
    tables [B, M] of the rows of the step that reads them; `kernel` (static) picks the decode attention; `split`
    (static) a mixed step's split of its stream (None: a step of one kind, its rows the model's). An 8-bit cache has
    the pools in its format and `k_scale` / `v_scale` (L arrays of [pages, page_size, K] float32); None otherwise."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    table: jax.Array
    kernel: str = field(default="gather", metadata={"static": True})
    k_scale: tuple[jax.Array, ...] | None = None
    v_scale: tuple[jax.Array, ...] | None = None
    split: RowSplit | None = field(default=None, metadata={"static": True})

    def layer(self, index: int) -> PagedLayer:
        scales = (self.k_scale[index], self.v_scale[index]) if self.k_scale is not None else (None, None)
        return PagedLayer(k=self.k[index], v=self.v[index], table=self.table, kernel=self.kernel, k_scale=scales[0],
                          v_scale=scales[1], split=self.split)

    def with_layers(self, layers: list[PagedLayer]) -> PagedCache:
        """The cache holding the updated pools (and scales) of `layers`, one per layer in order."""
        scales = {}
        if self.k_scale is not None:
            scales = {"k_scale": tuple(layer.k_scale for layer in layers),
                      "v_scale": tuple(layer.v_scale for layer in layers)}
        return replace(self, k=tuple(layer.k for layer in layers), v=tuple(layer.v for layer in layers), **scales)


@register_dataclass
@dataclass(frozen=True, kw_only=True)
class PagedLayer:
    """One layer's key and value pages [pages, page_size, K, E], the block tables [B, M], the kernel and a mixed
    step's `split` (`PagedCache`); an 8-bit layer's scales [pages, page_size, K] (None otherwise)."""

    k: jax.Array
    v: jax.Array
    table: jax.Array
    kernel: str = field(default="gather", metadata={"static": True})
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None
    split: RowSplit | None = field(default=None, metadata={"static": True})

    def attend(self, q_BSHE: jax.Array, k_BSKE: jax.Array, v_BSKE: jax.Array, positions_BS: jax.Array, index,
               options: AttentionOptions | None, window, placement: Placement) -> tuple[jax.Array, PagedLayer]:
        """`LayerCache.attend` of the paged cache: `paged_attention` under the named scope "attention" (the new
        keys and values land at each token's own position, `positions_BS`, so `index` is not read)."""
        with jax.named_scope("attention"):
            return paged_attention(q_BSHE, k_BSKE, v_BSKE, positions_BS, self, options, window, placement)


def pool_shape(pages: int, page_size: int, n_kv_heads: int, head_dim: int) -> tuple[int, int, int, int]:
    """One layer's key (or value) pool [pages, page_size, K, E]; its scales in an 8-bit cache are the first three."""
    return pages, page_size, n_kv_heads, head_dim


def init_pages(n_layers: int, shape: tuple[int, ...], dtype, sharding=None) -> tuple:
    """L empty page pools of `shape` ([pages, page_size, K, E], `pool_shape`), each its own buffer, on `sharding`
    (a NamedSharding by PAGES under the layout that serves; the default device without)."""
    return tuple(jnp.zeros(shape, dtype, device=sharding) for _ in range(n_layers))


def init_page_scales(n_layers: int, shape: tuple[int, ...], sharding=None) -> tuple:
    """L scale pools [pages, page_size, K] float32 of an 8-bit cache (`shape`: a pool's first three), all ones, on
    `sharding` (SCALES)."""
    return tuple(jnp.ones(shape[:3], jnp.float32, device=sharding) for _ in range(n_layers))


def paged_attention(q_BSHE, k_BSKE, v_BSKE, positions_BS, cache: PagedLayer, options: AttentionOptions | None = None,
                    window=None, placement: Placement | None = None):
    """Writes the S new keys and values of each row into its pages at their positions (quantized first in an 8-bit
    cache), then attends each query to its row's cached positions up to its own. q [B, S, H, E] (ATTN_Q), k / v
    [B, S, K, E] (ATTN_KV), positions [B, S] (-1: padding); in a mixed step (`cache.split`) each is the shards'
    streams [shards, n, ...] and the table holds [shards * (decode + prefill), M] rows: each device splits its
    stream into its decode rows and its chunks (`RowSplit.groups`), writes both groups' keys and values, then
    attends each group as a step of its kind does. With attention `options` (Gemma 2's scale and soft-capping; with
    a sliding window, `window` [] int32 is this layer's) every phase attends in XLA's explicit form over the
    gathered pages (`_gathered_attention`), which cuDNN's kernels do not compute. `placement`: where it runs (None:
    `current()`). Returns (out shaped as q, the layer with its updated pages and scales)."""
    if cache.kernel not in KERNELS:
        raise StarscreamError(f"unknown paged-attention kernel {cache.kernel!r}; choose one of {', '.join(KERNELS)}")
    group = q_BSHE.shape[2] // k_BSKE.shape[2]
    eight_bit = cache.k_scale is not None
    windows = [] if window is None else [jnp.asarray(window, jnp.int32)]
    placement, split = placed_by(placement), cache.split

    def local(q, k, v, positions, table, *rest, specs):
        window, pools = (rest[0] if windows else None), tuple(rest[len(windows):])
        axes = dim_axes(specs[0], 2), dim_axes(specs[1], 2)
        rows = [(q, k, v, positions, table)] if split is None else \
            list(zip(*(split.groups(stream) for stream in (q, k, v, positions)), split.rows(table)))
        for _, new_k, new_v, at, tables in rows:  # every group written before any attends
            pools = _written(pools, new_k, new_v, at, tables)
        out = [_attended(cache.kernel, queries, pools, at, tables, axes, group, options, window, placement)
               for queries, _, _, at, tables in rows]
        return (out[0] if split is None else split.stream(*out)), *pools

    pools = [cache.k, cache.v] + ([cache.k_scale, cache.v_scale] if eight_bit else [])
    pool_names = [PAGES, PAGES] + ([SCALES, SCALES] if eight_bit else [])
    args = [q_BSHE, k_BSKE, v_BSKE, positions_BS, cache.table, *windows, *pools]
    names = [ATTN_Q, ATTN_KV, ATTN_KV, POSITIONS, TABLE, *[None] * len(windows), *pool_names]
    out, *pools = run_sharded(local, args, names, [(ATTN_Q, q_BSHE.shape)] + [
        (name, pool.shape) for name, pool in zip(pool_names, pools)], "paged attention",
        check_vma=cache.kernel == "gather" and not eight_bit,  # custom calls and Pallas kernels carry no varying axes
        placement=placement)
    scales = {"k_scale": pools[2], "v_scale": pools[3]} if eight_bit else {}
    return out, replace(cache, k=pools[0], v=pools[1], **scales)


def _attended(kernel: str, q_BSHE, pools, positions_BS, table_BM, axes, group: int,
              options: AttentionOptions | None, window, placement: Placement):
    """One device's rows of one kind attended over its written pools: decode rows by cuDNN's paged kernel or the
    8-bit kernel in place where they take them, else (and prompt chunks) over the gathered pages. `axes`: the
    mesh axes of the queries' and the keys' head dimension. -> out [B, S, H, E]."""
    eight_bit_kernel = _eight_bit_in_place(kernel, q_BSHE, pools, group, options, placement.device)
    if _reads_in_place(kernel, q_BSHE, pools, group, options):
        return cudnn_paged_decode(q_BSHE, *pools, table_BM, jnp.maximum(positions_BS[:, 0], 0) + 1,
                                  q_BSHE.shape[-1] ** -0.5)
    if eight_bit_kernel:
        return eight_bit_decode.paged_decode_attention(
            q_BSHE, *pools, table_BM, jnp.maximum(positions_BS[:, 0], 0) + 1,
            interpret=eight_bit_kernel == "interpret", ptx=policy_of(placement.device).inline_ptx)
    return _gathered_attention(q_BSHE, pools, positions_BS, table_BM, *axes, group, placement.device, options, window)


def reads_in_place(kernel: str, dtype, options: AttentionOptions | None) -> bool:
    """Whether decode over pages stored in `dtype` can be attended by cuDNN's paged kernel in place: asked for,
    16-bit pages (an 8-bit cache is not cuDNN's to read), no attention options. The engine sizes its decode buckets
    by it."""
    return kernel == "cudnn" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and options is None


def _reads_in_place(kernel: str, q_BSHE, pools, group: int, options: AttentionOptions | None) -> bool:
    """Whether cuDNN's paged kernel attends this layer: `reads_in_place` for its pages, a decode step (one query per
    row), pages without scales, and every local query head's kv head on this device (a layout that splits query
    heads over more axes than kv heads gathers instead)."""
    pages_k = pools[0]
    return (reads_in_place(kernel, pages_k.dtype, options) and q_BSHE.shape[1] == 1 and len(pools) == 2
            and q_BSHE.shape[2] == pages_k.shape[2] * group)


def _eight_bit_in_place(kernel: str, q_BSHE, pools, group: int, options: AttentionOptions | None, device) -> str:
    """"pallas" where a decode step attends 8-bit pages in place by `eight_bit_decode.paged_decode_attention`: the
    paged kernel asked for reads in place ("cudnn", not "gather", which always gathers), the backend policy of
    `device` asks for the library's 8-bit attention kernel (`BackendPolicy.eight_bit_attention`), one query per row,
    pages with scales, no attention options, every local query head's kv head on this device and a shape the kernel
    takes; else "" (the pages gathered)."""
    if kernel == "gather" or len(pools) != 4 or q_BSHE.shape[1] != 1 or options is not None:
        return ""
    pages_k = pools[0]
    heads_here = q_BSHE.shape[2] == pages_k.shape[2] * group
    takes = eight_bit_decode.applies_paged(q_BSHE.shape[2], pages_k.shape[2], pages_k.shape[1], pages_k.shape[3])
    return "pallas" if policy_of(device).eight_bit_attention == "pallas" and heads_here and takes else ""


def _written(pools, k_BSKE, v_BSKE, positions_BS, table_BM) -> tuple:
    """(k pages, v pages[, k scales, v scales]) with the new keys and values written: as they are, or in an 8-bit
    cache quantized to the pages' format with their scales."""
    if len(pools) == 2:
        return tuple(_write(pages, new, positions_BS, table_BM) for pages, new in zip(pools, (k_BSKE, v_BSKE)))
    pages_k, pages_v, scales_k, scales_v = pools
    written = []
    for pages, scales, new in ((pages_k, scales_k, k_BSKE), (pages_v, scales_v, v_BSKE)):
        values_BSKE, scale_BSK = quantize_cache_entry(new, pages.dtype.name)
        written.append((_write(pages, values_BSKE, positions_BS, table_BM),
                        _write(scales, scale_BSK, positions_BS, table_BM)))
    (pages_k, scales_k), (pages_v, scales_v) = written
    return pages_k, pages_v, scales_k, scales_v


def _write(pages_PAKE, new_BSKE, positions_BS, table_BM):
    """The pages with each valid token's key (or value) written at (its row's page of its position, slot); also
    scales [pages, page_size, K] from new scales [B, S, K]. Padding (position -1) is dropped, not written: sent to
    one place, the padding of a prefill chunk (thousands of positions when a cached prefix leaves a few tokens to
    compute) made the scatter collide on one entry, which a GPU serializes (benchmarks/NOTES.md run 48)."""
    page_size = pages_PAKE.shape[1]
    valid = positions_BS >= 0
    at = jnp.maximum(positions_BS, 0)
    page_BS = jnp.where(valid, jnp.take_along_axis(table_BM, at // page_size, axis=1), pages_PAKE.shape[0])
    return pages_PAKE.at[page_BS, at % page_size].set(new_BSKE.astype(pages_PAKE.dtype), mode="drop")


def _gathered_attention(q_BSHE, pools, positions_BS, table_BM, q_axes, kv_axes, group, device,
                        options: AttentionOptions | None = None, window=None):
    """Each row's pages gathered into [B, M * page_size, K, E]; a query sees the positions up to its own. Decode
    (S = 1) passes the visible length to `fused_attention` (cuDNN on NVIDIA GPUs, the policy of `device`), prefill
    chunks a mask (cuDNN takes it as a bias; JAX's default, XLA's form, wrote [B, K, G, S, T] float32 scores and took
    0.48 s of workload A's 5.85, benchmarks/NOTES.md run 65). An 8-bit cache's pages are gathered in their format
    with their scales [B, M * page_size, K] and attended as the dense 8-bit cache is
    (`ops.attention_over_8_bit_cache`: the scales on the scores and the probabilities), so the gathered copy is of
    8-bit values, not of dequantized floats. With `options`, `ops.explicit_attention`
    over the positions each query sees (less than `window` behind it, where given)."""
    seen_BS = jnp.maximum(positions_BS, 0)  # padding sees position 0 only, so no row is all masked
    gathered = [_gathered_rows(pool, table_BM, q_BSHE.shape[2], group, q_axes, kv_axes) for pool in pools]
    if options is not None:
        key_positions_BT = jnp.broadcast_to(jnp.arange(gathered[0].shape[1]), gathered[0].shape[:2])
        return explicit_attention(q_BSHE, gathered[0], gathered[1], visible_keys(seen_BS, key_positions_BT, window),
                                   options, *gathered[2:])
    if len(pools) == 4:
        return attention_over_8_bit_cache(q_BSHE, *gathered, seen_BS, device=device)
    keys_BTKE, values_BTKE = (rows.astype(q_BSHE.dtype) for rows in gathered)
    if q_BSHE.shape[1] == 1:
        return fused_attention(q_BSHE, keys_BTKE, values_BTKE, device, key_value_seq_lengths=seen_BS[:, 0] + 1)
    mask = jnp.arange(keys_BTKE.shape[1])[None, None, None, :] <= seen_BS[:, None, :, None]
    return fused_attention(q_BSHE, keys_BTKE, values_BTKE, device, mask=mask)


def _gathered_rows(pool_PAK, table_BM, local_heads: int, group: int, q_axes, kv_axes) -> jax.Array:
    """A pool of pages [pages, page_size, K, E] (or of their scales [pages, page_size, K]) gathered by the block
    tables [B, M] into each row's positions [B, M * page_size, K, (E)], as stored, with the kv heads this device's
    `local_heads` query heads read."""
    rows_BMAK = pool_PAK[table_BM]
    rows_BTK = rows_BMAK.reshape(table_BM.shape[0], table_BM.shape[1] * pool_PAK.shape[1], *pool_PAK.shape[2:])
    return kv_heads_for_local_queries(rows_BTK, local_heads, group, q_axes, kv_axes)
