"""The transpose of a 2-D array of 1-byte values (int8, fp8) by a Pallas kernel: x [K, N] -> x.T [N, K].

Why a kernel: fp8 training's forward GEMM reads the weight with its contraction dimension innermost (cuBLASLt's fp8
GEMM takes both operands that way), while the stored weight [in, out] holds it outermost, so XLA transposes each
layer's e4m3 weight every step; for the weights whose dot has several non-contracted dimensions (gate/up) or
several contracted ones (o) it does so in a loop fusion that moves the 1-byte elements at about 0.3 TB/s on an H200:
11 of the 259 ms of the Llama 3.2 3B fp8 step (benchmarks/NOTES.md run 92). Here each program moves one [TILE, TILE]
tile, read whole and written whole (the transpose happens in registers and shared memory), at a copy's rate. The
values travel as int8 (a bitcast), so one kernel serves every 1-byte format. Lowered by Pallas' Triton backend;
interpreted on CPU for the tests.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

TILE = 64
"""Rows and columns a program moves: a [64, 64] tile of bytes in, its transpose out."""
SMALLEST_TILE = 16


def tile_for(rows: int, cols: int) -> int:
    """The tile side for an array [rows, cols]: the largest power of two up to TILE dividing both, 0 where it would
    be under SMALLEST_TILE (the kernel does not take the shape)."""
    side = math.gcd(TILE, rows, cols)
    return side if side >= SMALLEST_TILE else 0


def transposed(x_KN: jax.Array, interpret: bool = False) -> jax.Array:
    """x [K, N] of a 1-byte dtype -> [N, K] of the same dtype, exactly x.T; both sides multiples of `tile_for`'s
    tile (callers check `tile_for` first)."""
    K, N = x_KN.shape
    side = tile_for(K, N)
    if x_KN.dtype.itemsize != 1 or not side:
        raise ValueError(f"byte transpose of {x_KN.dtype} [{K}, {N}]: wants 1-byte values and sides that are "
                         f"multiples of {SMALLEST_TILE}")
    as_bytes = jax.lax.bitcast_convert_type(x_KN, jnp.int8)
    params = None if interpret else plgpu.CompilerParams(num_warps=4, num_stages=1)
    out_NK = pl.pallas_call(
        _kernel, grid=(K // side, N // side), interpret=interpret, compiler_params=params, name="byte_transpose",
        in_specs=[pl.BlockSpec((side, side), lambda i, j: (i, j))],
        out_specs=pl.BlockSpec((side, side), lambda i, j: (j, i)),
        out_shape=jax.ShapeDtypeStruct((N, K), jnp.int8))(as_bytes)
    return jax.lax.bitcast_convert_type(out_NK, x_KN.dtype)


def _kernel(x_ref, out_ref):
    out_ref[...] = x_ref[...].T
