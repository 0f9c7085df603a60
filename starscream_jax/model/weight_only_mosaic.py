"""Weight-only 8-bit decode matmul on Hopper's TMA and warpgroup MMA: out [M, N] = (x [M, K] @ W) * scale [N] for a
few rows (decode's batches, M <= 64), W held transposed as W_T [N, K] (int8 or fp8 e4m3, K innermost) with a float32
scale per output channel.

Why beside `weight_only`'s Triton kernel: in the whole decode step that kernel reads 8-bit weights at 2.0-2.5 TB/s
where cuBLAS reads bfloat16 at 4.2 (benchmarks/NOTES.md run 84), so 8-bit weights give 1.07x at batch 1 where their
bytes allow 1.8x; tilings were swept without closing the gap (runs 72, 86). This kernel keeps more bytes in flight
the way Hopper's fastest GEMMs do: each program streams its rows of W_T by TMA copies into a ring of `stages`
shared-memory buffers (`plgpu.emit_pipeline`), converts each [64, depth] tile in registers and multiplies it as the
left operand of a warpgroup MMA whose right operand is x's [P, depth] tile read transposed from shared memory. The
operands are swapped (out^T = W_T @ x^T) so that the 64 output channels fill the MMA's 64-row side and the few tokens
its narrow side (P: the rows padded to a multiple of 8, the MMA's smallest width), so no weight row is padding.

Conversion: int8 to bfloat16 in registers (exact). Hopper has no conversion from e4m3 to bfloat16 (the lowering
refuses it), so fp8 weights become float16 (exact) and multiply x in float16 (`weight_only.half_inputs`: each row
rescaled by a power of two into float16's range, undone on the output).

Grid: (N / 64 tiles of W_T's rows, splits of K); program (m, s) accumulates [64, P] in float32 over the
K / splits columns of split s and writes it to out [splits, N, P]; one small XLA pass sums the splits, multiplies
the scales (and undoes the row factors), and transposes to [M, N] in x's dtype (a few kilobytes).

Lowering: Pallas' Mosaic GPU backend, NVIDIA Hopper and newer only (`available`); ROCm has no Mosaic GPU backend,
so AMD chips keep `weight_only`'s Triton kernel. XLA:CPU cannot run it (its interpreter takes no register operand
for the MMA): the tests lower it for CUDA on the CPU and compare it with `weight_only.reference` on the GPU. It is a
candidate `scripts/bench_weight_only.py` times beside the Triton kernel, not yet decode's choice.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ..errors import StarscreamError
from .weight_only import MAX_ROWS, half_inputs, split_count

TILE_ROWS = 64
"""Rows of W_T (output channels) per program: the warpgroup MMA's M."""
TOKEN_MULTIPLE = 8
"""x's rows are padded to a multiple of this: the MMA's smallest N."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicTiling:
    """depth: columns of W_T (K) per pipeline step, 128 by default (one 128-byte swizzled row of int8); stages:
    TMA copies in flight per program (the shared-memory ring); splits: parts of K (0: `weight_only.split_count`'s
    choice, two programs per SM where the row tiles alone are fewer)."""

    depth: int = 128
    stages: int = 4
    splits: int = 0

    def __post_init__(self):
        if self.depth not in (64, 128) or not 1 <= self.stages <= 8 or not 0 <= self.splits <= 16:
            raise StarscreamError(f"Mosaic weight-only tiling depth {self.depth}, stages {self.stages}, splits "
                                  f"{self.splits}: depth is 64 or 128, stages 1..8, splits 0..16")


def available(device=None) -> bool:
    """Whether `device` runs Mosaic GPU kernels with warpgroup MMA: an NVIDIA GPU of compute capability 9.0 or
    newer."""
    device = device or jax.devices()[0]
    capability = getattr(device, "compute_capability", None)
    return device.platform == "gpu" and capability is not None and float(capability) >= 9.0


def applies(rows: int, depth: int, cols: int, tiling: MosaicTiling = MosaicTiling()) -> bool:
    """Whether x [rows, depth] @ W [depth, cols] runs on the kernel: 1 to MAX_ROWS rows, N a multiple of
    TILE_ROWS, K a multiple of `tiling.depth`."""
    return 0 < rows <= MAX_ROWS and cols % TILE_ROWS == 0 and depth % tiling.depth == 0


def transposed(w_KN: jax.Array) -> jax.Array:
    """W [K, N] as the kernel reads it, W_T [N, K] (K innermost): made once where the weights are loaded, never per
    call."""
    return jnp.transpose(w_KN)


def mosaic_weight_only_matmul(x_MK: jax.Array, w_NK: jax.Array, scale_N: jax.Array,
                              tiling: MosaicTiling = MosaicTiling()) -> jax.Array:
    """out [M, N] in x's dtype = (x [M, K] @ W_T [N, K]^T) * scale [N] (float32, or a scalar), W_T int8 or fp8
    e4m3 (see the module docstring). Raises StarscreamError for shapes the kernel does not take (`applies`)."""
    rows, depth = x_MK.shape
    cols = w_NK.shape[0]
    if w_NK.shape[1] != depth or w_NK.dtype not in (jnp.int8, jnp.float8_e4m3fn):
        raise StarscreamError(f"Mosaic weight-only matmul of x {x_MK.shape} by W_T {w_NK.shape} {w_NK.dtype}: W_T "
                              "must be [N, K] in int8 or float8_e4m3fn")
    if not applies(rows, depth, cols, tiling):
        raise StarscreamError(f"Mosaic weight-only matmul of x {x_MK.shape} by W_T {w_NK.shape}: the kernel takes 1 "
                              f"to {MAX_ROWS} rows, N a multiple of {TILE_ROWS} and K of {tiling.depth}; use "
                              "weight_only.weight_only_matmul")
    padded = -(-rows // TOKEN_MULTIPLE) * TOKEN_MULTIPLE
    x_PK = jnp.pad(x_MK, ((0, padded - rows), (0, 0)))
    inverse_P1 = None
    if w_NK.dtype == jnp.float8_e4m3fn:
        x_PK, inverse_P1 = half_inputs(x_PK)
    elif x_PK.dtype != jnp.bfloat16:
        x_PK = x_PK.astype(jnp.bfloat16)
    steps = depth // tiling.depth
    splits = split_count(padded, depth, cols // TILE_ROWS, steps, tiling.splits)
    out_SNP = _kernel(x_PK, w_NK, tiling, splits)
    out_NP = jnp.sum(out_SNP, axis=0) * jnp.broadcast_to(jnp.asarray(scale_N, jnp.float32), (cols,))[:, None]
    out_PN = out_NP.T if inverse_P1 is None else out_NP.T * inverse_P1
    return out_PN[:rows].astype(x_MK.dtype)


def _kernel(x_PK: jax.Array, w_NK: jax.Array, tiling: MosaicTiling, splits: int) -> jax.Array:
    """The Mosaic GPU call: float32 partials [splits, N, P] of W_T @ x^T."""
    tokens, depth = x_PK.shape
    cols = w_NK.shape[0]
    steps = depth // tiling.depth // splits
    w_swizzle = plgpu.find_swizzle(tiling.depth * 8, "W_T tile")
    x_swizzle = plgpu.find_swizzle(tiling.depth * 16, "x tile")
    w_transforms = (plgpu.TilingTransform((8, w_swizzle)), plgpu.SwizzleTransform(w_swizzle))
    x_transforms = (plgpu.TilingTransform((8, x_swizzle // 2)), plgpu.SwizzleTransform(x_swizzle))

    def body(_, w_smem, x_smem, acc_ref):
        plgpu.wgmma(acc_ref, w_smem[...].astype(x_PK.dtype), plgpu.transpose_ref(x_smem, (1, 0)))
        plgpu.wgmma_wait(0)  # the step's buffers return to the ring only once the MMA has read them
        return acc_ref

    def kernel(x_gmem, w_gmem, out_gmem, out_smem):
        tile, split = jax.lax.axis_index("tile"), jax.lax.axis_index("split")
        rows = pl.ds(tile * TILE_ROWS, TILE_ROWS)
        specs = [plgpu.BlockSpec((TILE_ROWS, tiling.depth), lambda k: (0, split * steps + k), transforms=w_transforms),
                 plgpu.BlockSpec((tokens, tiling.depth), lambda k: (0, split * steps + k), transforms=x_transforms)]

        def accumulate(acc_ref):
            plgpu.emit_pipeline(body, grid=(steps,), in_specs=specs, max_concurrent_steps=tiling.stages,
                                init_carry=acc_ref)(w_gmem.at[rows], x_gmem)
            return acc_ref[...]

        out_smem[...] = pl.run_scoped(accumulate, plgpu.ACC((TILE_ROWS, tokens), jnp.float32))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[split, rows])
        plgpu.wait_smem_to_gmem(0)

    call = plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((splits, cols, tokens), jnp.float32),
                        grid=(cols // TILE_ROWS, splits), grid_names=("tile", "split"),
                        scratch_types=dict(out_smem=plgpu.SMEM((TILE_ROWS, tokens), jnp.float32)),
                        kernel_name="weight_only_mosaic")
    return call(x_PK, w_NK)
