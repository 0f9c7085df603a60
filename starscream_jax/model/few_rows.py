"""Decode's projections: a few rows (one new token per sequence) times a weight, out [M, N] = x [M, K] @ w [K, N]
for M <= MAX_ROWS, a pass over the weight's bytes that does next to no arithmetic.

XLA runs such a product as a cuBLAS GEMM (its rows padded to 8 for the tensor cores), with one launch's ramp and
tail per weight; at batch 1 a decode step runs 7 of them per layer. The Pallas kernel here (Triton backend) reads
the weight in blocks of `Blocks.depth` rows x `Blocks.cols` columns, one program per column block and slice of the
contraction (`splits`), enough programs to keep every multiprocessor reading; with more than one slice the partial
sums [splits, M, N] (float32) are added by XLA, which fuses the addition into the op that reads the result.

Implementations: "pallas" (the kernel), "interpret" (the same kernel in Pallas interpret mode, CPU tests), "xla"
(`jnp.matmul`). The default is "pallas" on NVIDIA GPUs, where it was measured (benchmarks/NOTES.md), "xla"
elsewhere. The gradient, where one is asked for, is XLA's (dx = dy w^T, dw = x^T dy).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ..errors import StarscreamError
from .grouped_matmul import kernel_output

IMPLEMENTATIONS = ("pallas", "interpret", "xla")
MAX_ROWS = 16
"""The most rows the kernel takes: its blocks are 16 rows (the matrix units' smallest), the rows past M masked."""


@dataclasses.dataclass(frozen=True)
class Blocks:
    """cols x depth: the weight block one program reads per step (powers of two of at least 16; each cut to the
    largest power of two that divides its dimension); programs: the contraction is split into slices until the
    column blocks times the slices reach this many programs (at least 2 steps per slice); warps and stages:
    Triton's launch width and pipeline depth."""

    cols: int = 128
    depth: int = 128
    programs: int = 264
    warps: int = 8
    stages: int = 4


DEFAULT_BLOCKS = Blocks()
_IMPLEMENTATION: contextvars.ContextVar[str | None] = contextvars.ContextVar("few_rows_implementation", default=None)


@contextlib.contextmanager
def use_implementation(implementation: str):
    """Projections traced inside the block run with `implementation` (one of IMPLEMENTATIONS) instead of the
    default (`implementation`)."""
    if implementation not in IMPLEMENTATIONS:
        raise StarscreamError(f"few-rows matmul implementation {implementation!r} is unknown; use one of "
                              f"{', '.join(IMPLEMENTATIONS)}")
    token = _IMPLEMENTATION.set(implementation)
    try:
        yield
    finally:
        _IMPLEMENTATION.reset(token)


def implementation() -> str:
    """The implementation projections traced now use: `use_implementation`'s, else "pallas" on an NVIDIA GPU,
    else "xla"."""
    from .ops import on_cuda

    chosen = _IMPLEMENTATION.get()
    if chosen is not None:
        return chosen
    return "pallas" if on_cuda() else "xla"


def few_rows_matmul(x_MK: jax.Array, w_KN: jax.Array, implementation: str = "xla",
                    blocks: Blocks = DEFAULT_BLOCKS) -> jax.Array:
    """out [M, N] in the operands' common dtype: x [M, K] (M <= MAX_ROWS) times w [K, N]."""
    dtype = jnp.result_type(x_MK, w_KN)
    if x_MK.ndim != 2 or w_KN.ndim != 2 or x_MK.shape[1] != w_KN.shape[0] or x_MK.shape[0] > MAX_ROWS:
        raise StarscreamError(f"few-rows matmul of {x_MK.shape} and {w_KN.shape}: give x [M, K] with M <= "
                              f"{MAX_ROWS} and w [K, N]")
    if implementation not in IMPLEMENTATIONS:
        raise StarscreamError(f"few-rows matmul implementation {implementation!r} is unknown; use one of "
                              f"{', '.join(IMPLEMENTATIONS)}")
    return _matmul(x_MK.astype(dtype), w_KN.astype(dtype), implementation, blocks)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _matmul(x_MK, w_KN, implementation, blocks):
    if implementation == "xla":
        return jnp.matmul(x_MK, w_KN)
    return _pallas(x_MK, w_KN, blocks, interpret=implementation == "interpret")


def _forward(x_MK, w_KN, implementation, blocks):
    return _matmul(x_MK, w_KN, implementation, blocks), (x_MK, w_KN)


def _backward(implementation, blocks, residuals, dout_MN):
    x_MK, w_KN = residuals
    return jnp.matmul(dout_MN, w_KN.T), jnp.matmul(x_MK.T, dout_MN)


_matmul.defvjp(_forward, _backward)


def _largest_block(dim: int, wanted: int) -> int:
    block = wanted
    while dim % block and block > 16:
        block //= 2
    return block


def plan(depth: int, cols: int, blocks: Blocks = DEFAULT_BLOCKS) -> tuple[int, int, int]:
    """(depth block, column block, slices of the contraction) for w [depth, cols]."""
    depth_block, col_block = _largest_block(depth, blocks.depth), _largest_block(cols, blocks.cols)
    steps, splits = depth // depth_block, 1
    while (cols // col_block) * splits < blocks.programs and steps % (2 * splits) == 0 and steps // (2 * splits) >= 2:
        splits *= 2
    return depth_block, col_block, splits


def _pallas(x_MK, w_KN, blocks: Blocks, interpret: bool):
    (rows, depth), cols = x_MK.shape, w_KN.shape[1]
    depth_block, col_block, splits = plan(depth, cols, blocks)
    if depth % depth_block or cols % col_block:
        raise StarscreamError(f"few-rows matmul of {x_MK.shape} and {w_KN.shape}: K and N must be multiples of 16")
    kernel = functools.partial(_kernel, rows=rows, col_block=col_block, depth_block=depth_block,
                               steps=depth // depth_block // splits)
    out_dtype = jnp.float32 if splits > 1 else x_MK.dtype
    partial_SMN = pl.pallas_call(
        kernel, out_shape=kernel_output((splits, rows, cols), out_dtype, x_MK, w_KN),
        grid=(cols // col_block, splits), interpret=interpret, name="few_rows_matmul",
        compiler_params=None if interpret else plgpu.CompilerParams(num_warps=blocks.warps,
                                                                    num_stages=blocks.stages))(x_MK, w_KN)
    return partial_SMN[0] if splits == 1 else partial_SMN.sum(0).astype(x_MK.dtype)


def _kernel(x_ref, w_ref, out_ref, *, rows, col_block, depth_block, steps):
    """One column block of one slice of the contraction: x [16 rows, rows past M masked to 0] times w's blocks,
    summed in float32 over the slice's `steps` blocks of depth."""
    cols = pl.ds(pl.multiple_of(pl.program_id(0) * col_block, col_block), col_block)
    first = pl.program_id(1) * steps
    live = jnp.arange(MAX_ROWS)[:, None] < rows

    def step(index, acc_RC):
        depth = pl.ds(pl.multiple_of((first + index) * depth_block, depth_block), depth_block)
        x_RD = plgpu.load(x_ref.at[pl.ds(0, MAX_ROWS), depth], mask=live, other=0)
        return acc_RC + jax.lax.dot_general(x_RD, w_ref[depth, cols], (((1,), (0,)), ((), ())),
                                            preferred_element_type=jnp.float32)

    acc_RC = jax.lax.fori_loop(0, steps, step, jnp.zeros((MAX_ROWS, col_block), jnp.float32))
    plgpu.store(out_ref.at[pl.program_id(1), pl.ds(0, MAX_ROWS), cols], acc_RC.astype(out_ref.dtype), mask=live)
