"""Decode attention over an 8-bit KV cache read in place by a Pallas kernel: one query per row q [B, 1, H, E] (the
compute dtype), the cache's keys and values [B, T, K, E] in int8 or fp8 e4m3 with float32 scales per position and
kv head [B, T, K], each row seeing its first `lengths` [B] positions; out [B, 1, H, E] in q's dtype.

Why a kernel: XLA's batched dot wants (batch, kv head) leading and copied the converted cache into that order every step
(an int8 cache ran 0.25x bf16 at batch 64 on an H200, benchmarks/NOTES.md run 19); written as reductions in the cache's
own order (`ops._decode_over_8_bit_cache`) it reads in place but multiplies on CUDA cores, each cache value meeting G
queries twice (scores and values): about 8 float32 operations per byte, as much time as the read itself at batch 64.
Here the tensor cores do the products: each program takes one row, one kv head and one stretch of positions
(flash-decoding), loads a [positions, E] tile of keys with the cache's strides (E contiguous bytes per position),
converts it to float16 in registers (exact; int8 by a byte permute and a paired subtraction on NVIDIA,
`weight_only.widened`, where each value converted to bfloat16 took two conversion instructions: the Llama 3 8B step with
an int8 cache ran 5.27 ms at batch 1 against 6.14 before, unchanged at 14.1 ms at batch 64, benchmarks/NOTES.md run 89),
computes the scores of the head's G queries (padded to 16 rows; in float16, each row scaled by a power of two into its
range, `weight_only.half_inputs`) with a dot, multiplies by the key scales, 1 / sqrt(E) and the rows' inverse factors,
keeps an online softmax, weighs the probabilities by the value scales and accumulates their dot (in float16) with the
value tile. Each program writes its float32 partial (running max, sum, weighted values); XLA merges the stretches.
Nothing the size of the cache is written. A paged cache (`paged_decode_attention`: pools of pages [pages, page_size, K,
E], each row's block table) runs the same kernel over a block of whole pages a loop step (16-position pages gathered by
one load, or each page a tile of its own, `Tiling.pages_apart`; each read where it lies in the pool: one page a step ran
the Llama 3 8B step at batch 64 in 19.2 ms against the dense kernel's 12.7, benchmarks/NOTES.md run 90). A program's
loop ends at its row's length: the positions past it are neither read nor computed. Lowered by Pallas' Triton backend
(NVIDIA and ROCm); interpreted on CPU for the tests.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .weight_only import half_inputs, kernel_out_shape, widened

TARGET_PROGRAMS = 264
"""Programs a call aims at (two per SM of an H200): few rows and kv heads split the positions."""


class Tiling(NamedTuple):
    """How the kernel walks the cache: `block` positions a loop step (a [block, E] tile of keys and of values; in a
    dense cache the largest power of two up to `block` that divides its length, in a paged one whole pages, at least
    one), `warps` per program and Triton's pipeline `stages` (loads of later steps issued while a step computes);
    `tiling_for` picks one by shape. `pages_apart` (the paged form only): each page of a step loaded as a tile of
    its own and given its own dots, where by default one gathering load reads the step's pages (which ran 0.37 ms a
    layer against the dense form's 0.21, benchmarks/NOTES.md run 93)."""

    block: int = 64
    warps: int = 4
    stages: int = 2
    pages_apart: bool = False


MANY_ROWS_TILING = Tiling(block=128, warps=4, stages=3)
"""Where rows and kv heads alone fill the GPU: the fastest of a sweep on an H200 at Llama 3 8B's shape (64 rows,
4,096 positions: 0.208 ms a layer, 2.67 TB/s, against 0.276 ms by the default `Tiling`; the step 10.67 ms against
12.82 at batch 64 over an int8 cache, benchmarks/NOTES.md runs 93-94). At batch 1 it ran the step 7.02 ms against
4.81: fewer, longer stretches."""


def tiling_for(rows: int, kv_heads: int) -> Tiling:
    """`MANY_ROWS_TILING` where rows x kv heads reach TARGET_PROGRAMS (no stretches needed), else the default."""
    return MANY_ROWS_TILING if rows * kv_heads >= TARGET_PROGRAMS else Tiling()


BLOCK = 64
"""The dense cache's lengths the kernel takes are whole multiples of BLOCK positions."""
QUERY_ROWS = 16
"""A kv head's queries are padded to the tensor cores' smallest dot (16 rows)."""
MASKED = -1e30


def applies(query_heads: int, kv_heads: int, length: int, head_dim: int) -> bool:
    """Whether the kernel takes the shape: whole blocks of positions, a power-of-two head_dim of at least 16 and
    a kv head's queries within one padded dot (at most QUERY_ROWS, or a power of two)."""
    group = query_heads // kv_heads
    return (length % BLOCK == 0 and head_dim >= 16 and head_dim & (head_dim - 1) == 0
            and (group <= QUERY_ROWS or group & (group - 1) == 0))


def applies_paged(query_heads: int, kv_heads: int, page_size: int, head_dim: int) -> bool:
    """Whether the paged form takes the shape: pages of a power of two of at least 16 positions (one page a loop
    step, the dot's smallest side), a power-of-two head_dim of at least 16 and a kv head's queries within one padded
    dot."""
    group = query_heads // kv_heads
    return (page_size >= 16 and page_size & (page_size - 1) == 0 and head_dim >= 16
            and head_dim & (head_dim - 1) == 0 and (group <= QUERY_ROWS or group & (group - 1) == 0))


def split_count(rows: int, kv_heads: int, length: int, block: int = BLOCK) -> int:
    """Stretches of positions per (row, kv head): doubled from 1 while the programs are under TARGET_PROGRAMS, each
    stretch keeps whole blocks, and the float32 partials (QUERY_ROWS x E x 4 bytes per stretch) stay within a
    quarter of the 8-bit keys and values they sum (T x E x 2 bytes). Llama 3 8B at batch 1 (8 kv heads, 4096
    positions): 32 stretches of 128 positions, 256 programs."""
    splits = 1
    while (rows * kv_heads * splits < TARGET_PROGRAMS and length % (splits * 2 * block) == 0
           and splits * 2 * QUERY_ROWS * 8 <= length):
        splits *= 2
    return splits


def decode_attention(q_B1HE, k_BTKE, v_BTKE, k_scale_BTK, v_scale_BTK, lengths_B, interpret: bool = False,
                     ptx: bool = False, tiling: Tiling | None = None) -> jax.Array:
    """out [B, 1, H, E] in q's dtype: each row's query heads attending to its first `lengths` positions of the
    8-bit cache (module docstring); kv head k serves query heads k G .. k G + G - 1. `ptx`: the kernel compiles
    for an NVIDIA GPU and may carry inline PTX (`weight_only.widened`)."""
    T = k_BTKE.shape[1]
    tiling = tiling or tiling_for(q_B1HE.shape[0], k_BTKE.shape[2])
    return _launch(q_B1HE, [k_BTKE, v_BTKE, k_scale_BTK, v_scale_BTK], lengths_B, _dense_tiles, T,
                   tiling._replace(block=math.gcd(tiling.block, T)), k_BTKE.shape[2], interpret, ptx)


def paged_decode_attention(q_B1HE, k_pages_PAKE, v_pages_PAKE, k_scale_PAK, v_scale_PAK, table_BM, lengths_B,
                           interpret: bool = False, ptx: bool = False, tiling: Tiling | None = None) -> jax.Array:
    """`decode_attention` over a paged 8-bit cache read in place: pools of pages [pages, A, K, E] (values) and
    [pages, A, K] (scales), row b's i-th page named by its block table [B, M]; each loop step reads whole pages
    where they lie (`pages_per_step`; no gathered copy of the rows)."""
    page_size, M = k_pages_PAKE.shape[1], table_BM.shape[1]
    tiling = tiling or tiling_for(q_B1HE.shape[0], k_pages_PAKE.shape[2])
    pages = pages_per_step(page_size, M, tiling.block)
    table_BM = jnp.pad(table_BM.astype(jnp.int32), ((0, 0), (0, -M % pages)))  # padding names page 0, never seen
    return _launch(q_B1HE, [table_BM, k_pages_PAKE, v_pages_PAKE, k_scale_PAK, v_scale_PAK], lengths_B, _paged_tiles,
                   table_BM.shape[1] * page_size, tiling._replace(block=pages * page_size), k_pages_PAKE.shape[2],
                   interpret, ptx)


def pages_per_step(page_size: int, table_width: int, block: int) -> int:
    """Whole pages a loop step of the paged form reads: `block` positions' worth, at least one, at most the table's
    width (a short table reads its pages in one step rather than padding it)."""
    return max(1, min(block // page_size, table_width))


def _launch(q_B1HE, cache, lengths_B, tiles, length: int, tiling: Tiling, K: int, interpret: bool,
            ptx: bool) -> jax.Array:
    """The kernel over `length` positions of a cache of K kv heads (`cache`: the operands `tiles` reads),
    `tiling.block` positions a step, stretches merged after."""
    B, _, H, E = q_B1HE.shape
    G = H // K
    block = tiling.block
    splits = split_count(B, K, length, block)
    q_BKQE = jnp.pad(q_B1HE[:, 0].reshape(B, K, G, E), ((0, 0), (0, 0), (0, max(QUERY_ROWS, G) - G), (0, 0)))
    rows = q_BKQE.shape[2]
    q_PE, inverse_P1 = half_inputs(q_BKQE.reshape(B * K * rows, E))
    operands = [q_PE.reshape(B, K, rows, E), inverse_P1.reshape(B, K, rows), *cache,
                lengths_B.astype(jnp.int32).reshape(B, 1)]
    kernel = functools.partial(_kernel, tiles=tiles, block=block, steps=length // splits // block, scale=E ** -0.5,
                               ptx=ptx and not interpret, apart=tiling.pages_apart)
    params = None if interpret else plgpu.CompilerParams(num_warps=tiling.warps, num_stages=tiling.stages)
    peak, total, mixed = pl.pallas_call(
        kernel, grid=(B, K, splits), interpret=interpret, compiler_params=params, name="eight_bit_decode",
        out_shape=[kernel_out_shape((B, K, splits, rows), jnp.float32, *operands),
                   kernel_out_shape((B, K, splits, rows), jnp.float32, *operands),
                   kernel_out_shape((B, K, splits, rows, E), jnp.float32, *operands)])(*operands)
    return _merged(peak, total, mixed)[:, :, :G].reshape(B, 1, H, E).astype(q_B1HE.dtype)


def _merged(peak_BKSQ, total_BKSQ, mixed_BKSQE) -> jax.Array:
    """The stretches' partial softmaxes merged: [B, K, Q, E] float32 (a stretch with no visible position has
    peak MASKED and weighs nothing)."""
    overall_BKQ = jnp.max(peak_BKSQ, axis=2)
    weight_BKSQ = jnp.exp(peak_BKSQ - overall_BKQ[:, :, None])
    total_BKQ = jnp.sum(weight_BKSQ * total_BKSQ, axis=2)
    return jnp.sum(weight_BKSQ[..., None] * mixed_BKSQE, axis=2) / jnp.maximum(total_BKQ, 1e-30)[..., None]


class _Chunk(NamedTuple):
    """Positions start .. start + C of a loop step as loaded: keys, values [C, E] and their scales [C]."""

    start: jax.Array
    k: jax.Array
    v: jax.Array
    k_scale: jax.Array
    v_scale: jax.Array


def _dense_tiles(refs, b, head, start, block, apart):
    """A dense cache's tiles at positions start .. start + block of row b and kv head `head`: one chunk, as stored
    (`apart` does not apply)."""
    k_ref, v_ref, k_scale_ref, v_scale_ref = refs
    positions = pl.ds(start, block)
    return [_Chunk(start, k_ref[b, positions, head, :], v_ref[b, positions, head, :], k_scale_ref[b, positions, head],
                   v_scale_ref[b, positions, head])]


def _paged_tiles(refs, b, head, start, block, apart):
    """A paged cache's tiles at positions start .. start + block (whole pages) of row b and kv head `head`, the
    pages the row's block table names, read from where they lie in the pool: gathered into one chunk by one load
    each, or with `apart` a chunk per page, each a plain tile load."""
    table_ref, k_ref, v_ref, k_scale_ref, v_scale_ref = refs
    page_size, E = k_ref.shape[1], k_ref.shape[3]
    count = block // page_size
    first = start // page_size
    if apart:
        def page_chunk(i):
            page = table_ref[b, first + i]
            return _Chunk(start + i * page_size, k_ref[page, :, head, :], v_ref[page, :, head, :],
                          k_scale_ref[page, :, head], v_scale_ref[page, :, head])

        return [page_chunk(i) for i in range(count)]
    pages = table_ref[b, pl.ds(first, count)]
    return [_Chunk(start, k_ref[pages, :, head, :].reshape(block, E), v_ref[pages, :, head, :].reshape(block, E),
                   k_scale_ref[pages, :, head].reshape(block), v_scale_ref[pages, :, head].reshape(block))]


def _kernel(q_ref, inverse_ref, *refs, tiles, block, steps, scale, ptx, apart):
    """Program (row b, kv head k, stretch s): positions s * steps * block onwards, `steps` blocks of `block`, their
    keys and values read by `tiles` (`_dense_tiles`, `_paged_tiles`; `apart` as they take it) from the cache's
    refs (all but the last four of `refs`: lengths and the three outputs) in one chunk or several, each chunk's
    scores a dot of its own, one softmax update a step."""
    *cache_refs, lengths_ref, peak_ref, total_ref, mixed_ref = refs
    b, head, stretch = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    q_QE = q_ref[b, head]
    inverse_Q = inverse_ref[b, head]
    length = lengths_ref[b, 0]
    rows = q_QE.shape[0]

    def scores(chunk: _Chunk):
        """The chunk's scores [Q, C] (scaled; positions past the row's length MASKED) and which it sees [C]."""
        scores_QC = jax.lax.dot_general(q_QE, widened(chunk.k, q_QE.dtype, ptx), (((1,), (1,)), ((), ())),
                                        preferred_element_type=jnp.float32)
        scores_QC = scores_QC * inverse_Q[:, None] * (chunk.k_scale * scale)[None, :]
        seen_C = chunk.start + jax.lax.broadcasted_iota(jnp.int32, chunk.k_scale.shape, 0) < length
        return jnp.where(seen_C[None, :], scores_QC, MASKED), seen_C

    def step(index, carry):
        peak_Q, total_Q, mixed_QE = carry
        start = pl.multiple_of((stretch * steps + index) * block, block)
        chunks = tiles(cache_refs, b, head, start, block, apart)
        scored = [scores(chunk) for chunk in chunks]
        new_peak_Q = functools.reduce(jnp.maximum, [jnp.max(scores_QC, axis=1) for scores_QC, _ in scored], peak_Q)
        kept_Q = jnp.exp(peak_Q - new_peak_Q)
        total_Q, mixed_QE = total_Q * kept_Q, mixed_QE * kept_Q[:, None]
        for chunk, (scores_QC, seen_C) in zip(chunks, scored):
            probabilities_QC = jnp.where(seen_C[None, :], jnp.exp(scores_QC - new_peak_Q[:, None]), 0.0)
            weighted_QC = probabilities_QC * chunk.v_scale[None, :]
            mixed_QE = mixed_QE + jax.lax.dot_general(
                weighted_QC.astype(q_QE.dtype), widened(chunk.v, q_QE.dtype, ptx), (((1,), (0,)), ((), ())),
                preferred_element_type=jnp.float32)
            total_Q = total_Q + jnp.sum(probabilities_QC, axis=1)
        return new_peak_Q, total_Q, mixed_QE

    start = (jnp.full((rows,), MASKED, jnp.float32), jnp.zeros((rows,), jnp.float32),
             jnp.zeros((rows, q_QE.shape[1]), jnp.float32))
    seen_steps = jnp.clip(pl.cdiv(length - stretch * steps * block, block), 0, steps)  # blocks holding a seen position
    peak_Q, total_Q, mixed_QE = jax.lax.fori_loop(0, seen_steps, step, start)
    peak_ref[b, head, stretch, :] = peak_Q
    total_ref[b, head, stretch, :] = total_Q
    mixed_ref[b, head, stretch, :, :] = mixed_QE
