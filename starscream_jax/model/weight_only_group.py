"""Several weight-only 8-bit projections of one input in one kernel launch: x [M, K] (a few rows, the compute
dtype) times W_g [K, N_g] (int8 or fp8 e4m3) with float32 scales [N_g] per output channel, for g = 0 .. G - 1:
decode's q, k and v (one launch), gate and up (one launch), o and down alone (G = 1).

Why: on an H200 the single-projection kernel (`weight_only`) read q (4096 x 4096 int8) at 1.0 TB/s and k / v
(4096 x 1024) at 0.4 TB/s at batch 1 (benchmarks/results/h200_weight_only.json): a fixed cost per launch (a few
microseconds) and too few column blocks to fill 132 SMs dominate the small projections. One launch for the weights
that share an input pays that cost once per group and gives the grid every group member's column blocks at once
(q, k and v of Llama 3 8B: 48 blocks of 128 channels instead of 32, 8 and 8).

Each weight is read in place, as stored (no concatenated copy is held or made): the kernel takes the G weight
arrays and their G scale arrays as separate operands. The grid is (column blocks of all weights together, splits
of K); program (b, s) finds the weight whose blocks contain b from static offsets (`pl.when` per weight), streams
its [K / splits, cols] part in steps of `depth` rows, converts each 8-bit tile to x's dtype in registers (exact:
int8 and e4m3 values are bf16 values; or to float16, `Blocks.convert`), accumulates in float32 (a tensor-core
dot on rows padded to 16, or, for 1-4 rows, a multiply and a sum), and multiplies by the weight's scales in the
epilogue. All weights write into one output [splits, rows, N_0 + .. + N_{G-1}] (column block b at columns
b * cols), so that the splits' float32 partials are summed and cast by one XLA reduction for the whole group, and
each projection is a slice of it that XLA fuses into its consumer (rope, the cache write, SwiGLU). One block size
for the whole group: the columns a block takes divide every N_g, the depth divides the shared K.
"""
from __future__ import annotations

import dataclasses

import functools
import itertools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ..errors import StarscreamError
from .weight_only import (
    IMPLEMENTATIONS,
    MAX_ROWS,
    Blocks,
    column_block_product,
    finished,
    kernel_inputs,
    kernel_out_shape,
    padded_rows,
    power_of_two_block,
    reference,
    split_count,
)

FEW_ROWS_BLOCKS = Blocks(cols=128, depth=64)
"""Blocks at 1 to 16 rows: on the H200 at one row the kernel's default (128 columns, 64 rows deep, 4 warps, dot)
was the fastest of the four tilings tried for int8 q, k / v, o and down (16.7, 10.8, 17.9, 35.3 us against 19.6-21.8,
14.4-16.1, 20.1-21.1, 37.7-47.2) and within the rounds' spread of the best for fp8 and gate / up
(benchmarks/results/h200_weight_only.json)."""
MANY_ROWS_BLOCKS = Blocks(cols=64, depth=128)
"""Blocks above 16 rows: at 64 rows narrower and deeper tiles (64 columns, 128 rows) beat the default on every int8
shape (q 16.8 against 18.2 us, k / v 10.8 against 17.6, o 18.4 against 28.3, gate / up 48.4 against 52.2, down
44.2 against 44.3); twice the programs for the 64-row accumulator, half the registers each."""


FP8_FEW_ROWS_BLOCKS = dataclasses.replace(FEW_ROWS_BLOCKS, convert="half")
"""Blocks for e4m3 weights at 1 to 16 rows: converted through float16 (the hardware's paired conversion), which on the
H200 ran one layer of Llama 3 8B in 131.6 us at one row against 150.1 us cast to bfloat16 (1.26x and 1.10x bf16's
layer), and 134.8 against 153.4 us at 16 rows, over seven alternating rounds
(benchmarks/results/h200_weight_only_layer_rounds7.json). int8 stays cast: through float16 it ran 152.7 against
139.3 us at one row in portable operations; by the byte permute of `weight_only.INT8_TO_HALF_PTX` one layer ran
128.1 against 135.0 us (benchmarks/results/h200_weight_only_layer_int8_half_ptx.json), but the whole decode step
ran 4.73 ms at batch 1 where it ran 4.32 and 4.61 ms cast in two other processes the same day
(benchmarks/results/decode_int8_half_ptx.json): not a gain the step shows."""


def blocks_for(rows: int, weight_dtype=jnp.int8) -> Blocks:
    """The measured choice of tiling for `rows` token rows of weights in `weight_dtype` (FEW_ROWS_BLOCKS,
    FP8_FEW_ROWS_BLOCKS for float8 weights, MANY_ROWS_BLOCKS above 16 rows)."""
    if rows > 16:
        return MANY_ROWS_BLOCKS
    return FP8_FEW_ROWS_BLOCKS if jnp.issubdtype(weight_dtype, jnp.floating) else FEW_ROWS_BLOCKS


def applies(rows: int, depth: int, widths: Sequence[int], implementation: str) -> bool:
    """Whether x [rows, depth] times weights [depth, N_g] (N_g in `widths`) runs as one grouped launch:
    `implementation` not "xla", 1 to MAX_ROWS rows, K and every N_g multiples of 16."""
    return (implementation != "xla" and 0 < rows <= MAX_ROWS and depth % 16 == 0 and len(widths) > 0
            and all(width % 16 == 0 for width in widths))


def grouped_weight_only_matmul(x_MK: jax.Array, weights: Sequence[tuple[jax.Array, jax.Array]],
                               implementation: str = "pallas", blocks: Blocks | None = None,
                               ptx: bool = False) -> list[jax.Array]:
    """[out_g [M, N_g] in x's dtype = (x [M, K] @ W_g [K, N_g] (int8 or fp8)) * scale_g [N_g] (float32, or a
    scalar)] for each (W_g, scale_g) of `weights`, all from one kernel launch ("pallas"; "interpret": the same
    kernel interpreted, CPU tests) or from `weight_only.reference` each ("xla"). `blocks`: the tiling (None:
    `blocks_for(M, the first weight's dtype)`); `ptx`: the kernel compiles for an NVIDIA GPU and may carry inline
    PTX (`weight_only.widened`: int8 into float16 where `blocks.convert` is "half")."""
    rows, depth = x_MK.shape
    _check(x_MK, weights, implementation)
    widths = [values.shape[1] for values, _ in weights]
    scales = [jnp.broadcast_to(jnp.asarray(scale, jnp.float32), (width,)) for (_, scale), width in zip(weights, widths)]
    if implementation == "xla":
        return [reference(x_MK, values, scale) for (values, _), scale in zip(weights, scales)]
    if not applies(rows, depth, widths, implementation):
        raise StarscreamError(f"grouped weight-only matmul of x {x_MK.shape} by widths {widths}: the kernel takes 1 "
                              f"to {MAX_ROWS} rows and K, N multiples of 16; use implementation 'xla'")
    out_MT = _grouped_call(x_MK, [values for values, _ in weights], scales,
                           blocks or blocks_for(rows, weights[0][0].dtype),
                           interpret=implementation == "interpret", ptx=ptx)
    starts = [0, *itertools.accumulate(widths)]
    return [out_MT[:, start:start + width] for start, width in zip(starts, widths)]


def _check(x_MK, weights, implementation: str) -> None:
    """Refuses an unknown implementation, an empty group, or a weight that is not [K, N] in 8 bits."""
    if implementation not in IMPLEMENTATIONS:
        raise StarscreamError(f"grouped weight-only matmul implementation {implementation!r}; use one of "
                              f"{', '.join(IMPLEMENTATIONS)}")
    wrong = [f"{values.shape} {values.dtype}" for values, _ in weights
             if values.ndim != 2 or values.shape[0] != x_MK.shape[1] or jnp.dtype(values.dtype).itemsize != 1]
    if not weights or wrong:
        raise StarscreamError(f"grouped weight-only matmul of x {x_MK.shape} by W {', '.join(wrong) or 'none'}: "
                              "give one or more weights [K, N] in an 8-bit format")


def group_grid(rows: int, depth: int, widths: Sequence[int], blocks: Blocks) -> tuple[int, int, list[int], int]:
    """(columns per block, rows of K per step, each weight's first block in the joint grid plus the total, splits
    of K): the columns divide every width, the depth divides K, and the splits fill the GPU for the group's blocks
    together (`weight_only.split_count`, `rows`: the rows of partials written)."""
    col_block = power_of_two_block(math.gcd(*widths), blocks.cols)
    depth_block = power_of_two_block(depth, blocks.depth)
    starts = [0, *itertools.accumulate(width // col_block for width in widths)]
    splits = split_count(rows, depth, starts[-1], depth // depth_block, blocks.splits)
    return col_block, depth_block, starts, splits


def _grouped_call(x_MK, values: list[jax.Array], scales: list[jax.Array], blocks: Blocks,
                  interpret: bool, ptx: bool) -> jax.Array:
    """The launch: out [M, sum N_g] in x's dtype (module docstring)."""
    rows, depth = x_MK.shape
    padded, use_dot = padded_rows(rows, blocks.reduce)
    out_rows = 1 if rows == 1 else padded  # one row: the padded rows' zeros summed away in the kernel
    widths = [w.shape[1] for w in values]
    col_block, depth_block, starts, splits = group_grid(out_rows, depth, widths, blocks)
    x_PK, inverse_P1 = kernel_inputs(x_MK, padded, blocks.convert)
    out_dtype = jnp.float32 if splits > 1 else x_MK.dtype
    kernel = functools.partial(_kernel, starts=tuple(starts), col_block=col_block, depth_block=depth_block,
                               steps=depth // depth_block // splits, use_dot=use_dot, collapse=out_rows < padded,
                               ptx=ptx and not interpret)
    params = None if interpret else plgpu.CompilerParams(num_warps=blocks.warps, num_stages=blocks.stages)
    operands = [x_PK, *values, *(scale.reshape(1, -1) for scale in scales)]
    out_SPT = pl.pallas_call(kernel, out_shape=kernel_out_shape((splits, out_rows, sum(widths)), out_dtype, *operands),
                             grid=(starts[-1], splits), interpret=interpret, compiler_params=params,
                             name="weight_only_group")(*operands)
    return finished(out_SPT, inverse_P1, rows, x_MK.dtype)


def _kernel(x_ref, *refs, starts, col_block, depth_block, steps, use_dot, collapse, ptx):
    """Program (b, s): the weight g whose blocks hold b (starts[g] <= b < starts[g + 1]) computes its column block
    b - starts[g] over split s of K into out[s, :, b * cols : (b + 1) * cols] (`_column_block`)."""
    count = len(starts) - 1
    w_refs, scale_refs, out_ref = refs[:count], refs[count:2 * count], refs[2 * count]
    block, split = pl.program_id(0), pl.program_id(1)
    for g in range(count):
        @pl.when((block >= starts[g]) & (block < starts[g + 1]))
        def _(g=g):
            _column_block(x_ref, w_refs[g], scale_refs[g], out_ref, block - starts[g], block, split,
                          col_block=col_block, depth_block=depth_block, steps=steps, use_dot=use_dot,
                          collapse=collapse, ptx=ptx)


def _column_block(x_ref, w_ref, scale_ref, out_ref, local, block, split, *, col_block, depth_block, steps, use_dot,
                  collapse, ptx):
    """W's column block `local` (`weight_only.column_block_product` of split `split`) written at the joint
    output's column block `block` of out[split]."""
    cols = pl.ds(pl.multiple_of(local * col_block, col_block), col_block)
    out_cols = pl.ds(pl.multiple_of(block * col_block, col_block), col_block)
    out_ref[split, :, out_cols] = column_block_product(x_ref, w_ref, scale_ref, cols, split, col_block=col_block,
                                                       depth_block=depth_block, steps=steps, use_dot=use_dot,
                                                       collapse=collapse, ptx=ptx).astype(out_ref.dtype)
