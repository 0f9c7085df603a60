"""The grouped matmul of the routed mixture-of-experts block: rows grouped by expert, each group padded to whole
tiles of M rows, each tile multiplied by its own expert's weights, and no FLOPs spent on another expert's.

Shapes: x [R, K] with R = N tiles x M rows, w [G, K, F] (G experts), padded sizes [G] int32 (rows of each group,
multiples of M, in order from row 0; their sum, the live rows, may be less than R); out [R, F]. Rows past the live
rows come out 0 and add nothing to the weight gradients.

Three implementations of one function, with one custom VJP (dx = dy w^T per tile, dw_g = sum over g's tiles of
x^T dy):
  pallas     a Pallas kernel (Triton backend: CUDA and ROCm). One program per (tile, column block): it reads its
             tile's expert from a small int array and that expert's weights in place (no copy per tile); tiles past
             the live rows only write zeros, so a device that holds a few of the experts (expert parallelism) does
             the FLOPs of its own rows. The weight gradient: one program per (expert, row block, column block) of
             dw, looping over that expert's tiles only.
  interpret  the same kernels in Pallas interpret mode (CPU tests).
  xla        batched matmuls of the tiles [N, M, K] x [N, K, F] on weights gathered per tile (the CPU default: XLA
             on CPU runs them well; on a GPU the per-tile weight copies cost more than the matmuls).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ..errors import PresetError, StarscreamError
from ..sharding.apply import compute_device

IMPLEMENTATIONS = ("pallas", "interpret", "xla")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Blocks:
    """Block sizes of the Pallas kernels (powers of two; each is cut to the largest power of two that divides its
    dimension). cols x depth: the output block and the contraction step of the tile kernel; weight_block: the side
    of the square block of an expert's weight gradient that one program of the weight-gradient kernel sums (a tile
    of rows per step); group: row blocks a column block visits before the next (programs that run together share
    weights and rows in L2); warps and stages: Triton's launch width and pipeline depth. cols and warps None: by the
    tile (`cols_and_warps`). shared_memory: the bytes one program may use, which cut the blocks and stages
    (`_fitted`); None: the compiling device's (`shared_memory_bytes`), which `grouped_matmul` fills in."""

    cols: int | None = None
    depth: int = 64
    weight_block: int = 128
    group: int = 8
    warps: int | None = None
    stages: int = 3
    shared_memory: int | None = None

    def __post_init__(self):
        sizes = {"cols": 128 if self.cols is None else self.cols, "depth": self.depth,
                 "weight_block": self.weight_block}
        wrong = [f"{name} = {value!r}" for name, value in sizes.items()
                 if isinstance(value, bool) or not isinstance(value, int) or value < 16 or value & (value - 1)]
        counts = {"group": self.group, "warps": 1 if self.warps is None else self.warps, "stages": self.stages,
                  "shared_memory": 1 if self.shared_memory is None else self.shared_memory}
        wrong += [f"{name} = {value!r}" for name, value in counts.items()
                  if isinstance(value, bool) or not isinstance(value, int) or value < 1]
        if wrong:
            raise StarscreamError(f"grouped-matmul Blocks {', '.join(wrong)}: cols, depth and weight_block are powers "
                                  "of two of at least 16 (cols or None), group, warps (or None), stages and "
                                  "shared_memory (bytes, or None) whole numbers of at least 1")


DEFAULT_BLOCKS = Blocks()


def default_implementation() -> str:
    """'pallas' on a GPU (CUDA or ROCm), 'xla' elsewhere."""
    return "pallas" if jax.default_backend() in ("gpu", "cuda", "rocm") else "xla"


def grouped_matmul(x_RK: jax.Array, w_GKF: jax.Array, padded_sizes_G: jax.Array, tile: int,
                   implementation: str = "xla", blocks: Blocks = DEFAULT_BLOCKS, device=None) -> jax.Array:
    """out [R, F]: each tile of `tile` rows of x [R, K] times its group's weights w [G, K, F] (module docstring).
    Operands of different dtypes are promoted to a common one first, as `jnp.matmul` does (the kernels multiply
    blocks of one dtype). `device`: the one the program compiles for (None: `compute_device()`), whose shared
    memory the Pallas kernels' blocks are cut to unless `blocks.shared_memory` says."""
    if implementation == "pallas" and blocks.shared_memory is None:
        blocks = dataclasses.replace(blocks, shared_memory=shared_memory_bytes(device or compute_device()))
    dtype = jnp.result_type(x_RK, w_GKF)
    return _grouped_matmul(x_RK.astype(dtype), w_GKF.astype(dtype), padded_sizes_G, tile, implementation, blocks)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _grouped_matmul(x_RK, w_GKF, padded_sizes_G, tile, implementation, blocks):
    return _tiles_times_weights(x_RK, w_GKF, padded_sizes_G, tile, implementation, blocks, transpose=False)


def _forward(x_RK, w_GKF, padded_sizes_G, tile, implementation, blocks):
    out_RF = _grouped_matmul(x_RK, w_GKF, padded_sizes_G, tile, implementation, blocks)
    return out_RF, (x_RK, w_GKF, padded_sizes_G)


def _backward(tile, implementation, blocks, residuals, dout_RF):
    x_RK, w_GKF, padded_sizes_G = residuals
    dx_RK = _tiles_times_weights(dout_RF, w_GKF, padded_sizes_G, tile, implementation, blocks, transpose=True)
    dw_GKF = _weight_gradient(x_RK, dout_RF, padded_sizes_G, tile, implementation, blocks)
    return _summed_like(dx_RK, x_RK), _summed_like(dw_GKF, w_GKF), None


def _summed_like(cotangent: jax.Array, primal: jax.Array) -> jax.Array:
    """The cotangent summed over the manual mesh axes it varies over and its primal does not (inside a shard map:
    weights the same on every device of an axis, used there with tokens that differ)."""
    extra = tuple(sorted(_varying_axes(cotangent) - _varying_axes(primal)))
    return jax.lax.psum(cotangent, extra) if extra else cotangent


def _varying_axes(x: jax.Array) -> frozenset:
    """The manual mesh axes over which x differs inside a shard map (none outside one)."""
    manual = jax.typeof(x).manual_axis_type
    return manual.varying if manual is not None else frozenset()


_grouped_matmul.defvjp(_forward, _backward)


def _tiles_times_weights(x_RK, w_GKF, padded_sizes_G, tile, implementation, blocks, transpose: bool):
    """[R, F] (x [R, K] against w [G, K, F]) or, `transpose`, [R, K] (x [R, F] against w [G, K, F] transposed)."""
    _check(x_RK, w_GKF, tile, implementation, transpose)
    tiles = x_RK.shape[0] // tile
    ends_G = jnp.cumsum(padded_sizes_G.astype(jnp.int32))
    tile_group_N = jnp.minimum(jnp.searchsorted(ends_G, jnp.arange(tiles) * tile, side="right"),
                               w_GKF.shape[0] - 1).astype(jnp.int32)
    live_tiles_1 = (ends_G[-1:] // tile).astype(jnp.int32)
    if implementation == "xla":
        weights_N = w_GKF[tile_group_N]
        x_NMK = x_RK.reshape(tiles, tile, -1)
        out_NMF = (jnp.einsum("nmf,nkf->nmk", x_NMK, weights_N) if transpose
                   else jnp.einsum("nmk,nkf->nmf", x_NMK, weights_N))
        live_N = jnp.arange(tiles) < live_tiles_1
        return jnp.where(live_N[:, None, None], out_NMF, 0).reshape(x_RK.shape[0], -1)
    return _pallas_tiles(x_RK, w_GKF, tile_group_N, live_tiles_1, tile, blocks, transpose,
                         interpret=implementation == "interpret")


def _weight_gradient(x_RK, dout_RF, padded_sizes_G, tile, implementation, blocks):
    """dw [G, K, F]: for each group g, x^T dout over g's rows."""
    groups = padded_sizes_G.shape[0]
    ends_G = jnp.cumsum(padded_sizes_G.astype(jnp.int32))
    offsets_G1 = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends_G])
    if implementation == "xla":
        tiles = x_RK.shape[0] // tile
        tile_group_N = jnp.searchsorted(ends_G, jnp.arange(tiles) * tile, side="right")  # G for tiles past the live
        per_tile_NKF = jnp.einsum("nmk,nmf->nkf", x_RK.reshape(tiles, tile, -1), dout_RF.reshape(tiles, tile, -1),
                                  preferred_element_type=jnp.float32)
        return jax.ops.segment_sum(per_tile_NKF, tile_group_N, groups).astype(x_RK.dtype)
    return _pallas_weight_gradient(x_RK, dout_RF, offsets_G1, tile, blocks, interpret=implementation == "interpret")


def _check(x_RK, w_GKF, tile, implementation, transpose):
    if implementation not in IMPLEMENTATIONS:
        raise StarscreamError(f"grouped matmul implementation {implementation!r} is unknown; use one of "
                              f"{', '.join(IMPLEMENTATIONS)}")
    contraction = w_GKF.shape[2 if transpose else 1]
    if x_RK.shape[1] != contraction or x_RK.shape[0] % tile:
        raise StarscreamError(f"grouped matmul of rows {x_RK.shape} and weights {w_GKF.shape}: the rows must be "
                              f"whole tiles of {tile} and their width the weights' {contraction}")


def _block(dim: int, wanted: int) -> int:
    """The largest power of two up to `wanted` that divides `dim` (16 at least: the matrix units' smallest)."""
    block = wanted
    while dim % block and block > 16:
        block //= 2
    if dim % block:
        raise PresetError(f"the grouped matmul's dimension {dim} is not a multiple of 16; use a model whose "
                          f"d_model and expert d_ff are multiples of 16")
    return block


def cols_and_warps(blocks: Blocks, tile: int) -> tuple[int, int]:
    """(output columns per program, Triton warps per program): `blocks.cols` and `blocks.warps`, or by default 128
    columns and 8 warps for tiles of 128 rows or more, 256 columns and 4 warps below. Measured on an H200
    (benchmarks/results/gmm_h200*.json and superseded/, forward and backward against a GEMM of the same shape):
    Mixtral's 128-row tiles 0.78 of the GEMM with 128 x 8, 0.76 with 256 columns, 0.74 with 4 warps; Qwen3-30B-A3B's
    32-row tiles, over four runs, 0.57 to 0.65 with 128 x 8, 0.65 to 0.72 with 128 x 4, 0.69 to 0.79 with 256 x 4."""
    small = tile < 128
    return blocks.cols or (256 if small else 128), blocks.warps or (4 if small else 8)


def _compiler_params(blocks: Blocks, stages: int, tile: int):
    return plgpu.CompilerParams(num_warps=cols_and_warps(blocks, tile)[1], num_stages=stages)


SHARED_MEMORY_BYTES = {"9.0": 232448, "10.0": 232448, "8.0": 166912, "8.7": 166912, "8.6": 101376, "8.9": 101376,
                       "12.0": 101376, "gfx942": 65536, "gfx950": 163840}
"""Shared memory (LDS on AMD) one kernel program may use, by CUDA compute capability or AMD architecture: the
opt-in maximum per thread block in the CUDA C++ Programming Guide's table of compute capabilities
(https://docs.nvidia.com/cuda/cuda-c-programming-guide/#features-and-technical-specifications; 227 KiB on the H200
is also what Triton reported there) and the LDS per compute unit in ROCm's table of AMD GPU specifications
(https://rocm.docs.amd.com/en/latest/reference/gpu-specs.html: 64 KiB on gfx942, MI300X; 160 KiB on gfx950, MI355X).
Other devices get 48 KiB, what every CUDA device gives without opting in."""


def shared_memory_bytes(device) -> int:
    """The shared memory one program may use on `device` (`SHARED_MEMORY_BYTES`)."""
    capability = str(getattr(device, "compute_capability", "")).lower().split(":")[0]
    return SHARED_MEMORY_BYTES.get(capability, 49152)


def _fitted(blocks: Blocks, depth_block: int, col_block: int, bytes_per_stage, interpret: bool):
    """(depth block, column block, pipeline stages) of a kernel whose blocks take bytes_per_stage(depth_block,
    col_block) of shared memory per stage (Triton keeps one copy of them per stage: 4 stages of a 128-row bf16
    weight-gradient step asked for 256 KiB of the H200's 227 KiB): `blocks.stages` and the blocks given where they
    fit the device's shared memory, else fewer stages first, then the larger block halved."""
    stages = blocks.stages
    if interpret:
        return depth_block, col_block, stages
    available = blocks.shared_memory
    while bytes_per_stage(depth_block, col_block) * stages > available:
        if stages > 1:
            stages -= 1
        elif max(depth_block, col_block) > 16:
            depth_block, col_block = ((depth_block // 2, col_block) if depth_block >= col_block
                                      else (depth_block, col_block // 2))
        else:
            raise StarscreamError(f"the grouped matmul's smallest blocks need {bytes_per_stage(16, 16)} bytes of "
                                  f"shared memory, more than the {available} this GPU gives one kernel; use fewer "
                                  f"rows per tile")
    return depth_block, col_block, stages


def _out_shape(shape, x, *operands) -> jax.ShapeDtypeStruct:
    """A kernel's output of `shape` and x's dtype, typed (inside a shard map) as varying over every manual mesh axis
    that an operand varies over."""
    varying = frozenset().union(*map(_varying_axes, (x, *operands)))
    if not varying:
        return jax.ShapeDtypeStruct(shape, x.dtype)
    return jax.ShapeDtypeStruct(shape, x.dtype, manual_axis_type=jax.sharding.ManualAxisType(varying=varying))


def _grouped_order(program, row_blocks: int, col_blocks: int, group: int):
    """(row block, column block) of a program numbered in groups of `group` row blocks: down the group's row
    blocks first, then the next column block, so that the programs running at once share few weight and row
    blocks. (lax.div and lax.rem: the operands are not negative, and Triton lowers them, not Python's //.)"""
    per_group = group * col_blocks
    first_row = jax.lax.div(program, per_group) * group
    rows_here = jnp.minimum(row_blocks - first_row, group)
    within = jax.lax.rem(program, per_group)
    return first_row + jax.lax.rem(within, rows_here), jax.lax.div(within, rows_here)


def _pallas_tiles(x_RK, w_GKF, tile_group_N, live_tiles_1, tile, blocks, transpose, interpret):
    rows, depth = x_RK.shape
    cols = w_GKF.shape[1] if transpose else w_GKF.shape[2]
    depth_block, col_block, stages = _fitted(
        blocks, _block(depth, blocks.depth), _block(cols, cols_and_warps(blocks, tile)[0]),
        lambda depth_block, col_block: (tile + col_block) * depth_block * x_RK.dtype.itemsize, interpret)
    tiles = rows // tile
    kernel = functools.partial(_tile_kernel, tile=tile, col_block=col_block, depth_block=depth_block, tiles=tiles,
                               col_blocks=cols // col_block, group=blocks.group, transpose=transpose)
    return pl.pallas_call(kernel, out_shape=_out_shape((rows, cols), x_RK, w_GKF, tile_group_N),
                          grid=(tiles * (cols // col_block),), interpret=interpret,
                          compiler_params=None if interpret else _compiler_params(blocks, stages, tile),
                          name="grouped_matmul_t" if transpose else "grouped_matmul")(
        tile_group_N, live_tiles_1, x_RK, w_GKF)


def _tile_kernel(tile_group_ref, live_tiles_ref, x_ref, w_ref, out_ref, *, tile, col_block, depth_block, tiles,
                 col_blocks, group, transpose):
    """One (tile, column block) of out: x[tile rows] [M, K] times w[tile's group] [K, cols] (or, `transpose`, times
    the transpose of w[group] [cols, K]), accumulated in float32 over K in steps; zeros past the live tiles."""
    tile_index, col_index = _grouped_order(pl.program_id(0), tiles, col_blocks, group)
    rows = pl.ds(pl.multiple_of(tile_index * tile, tile), tile)
    cols = pl.ds(pl.multiple_of(col_index * col_block, col_block), col_block)
    live = tile_index < live_tiles_ref[0]

    @pl.when(live)
    def _multiply():
        expert = tile_group_ref[tile_index]

        def step(index, acc_MC):
            depth = pl.ds(pl.multiple_of(index * depth_block, depth_block), depth_block)
            x_MD = x_ref[rows, depth]
            if transpose:
                return acc_MC + _dot(x_MD, w_ref[expert, cols, depth], 1, 1)
            return acc_MC + _dot(x_MD, w_ref[expert, depth, cols], 1, 0)

        acc_MC = jax.lax.fori_loop(0, x_ref.shape[1] // depth_block, step,
                                   jnp.zeros((tile, col_block), jnp.float32))
        out_ref[rows, cols] = acc_MC.astype(out_ref.dtype)

    @pl.when(jnp.logical_not(live))
    def _zero():
        out_ref[rows, cols] = jnp.zeros((tile, col_block), out_ref.dtype)


def _dot(a: jax.Array, b: jax.Array, a_contracted: int, b_contracted: int) -> jax.Array:
    """The float32 product of two 2-D blocks over the dimensions named (a transpose is read, not made)."""
    return jax.lax.dot_general(a, b, (((a_contracted,), (b_contracted,)), ((), ())),
                               preferred_element_type=jnp.float32)


def _pallas_weight_gradient(x_RK, dout_RF, offsets_G1, tile, blocks, interpret):
    depth, cols = x_RK.shape[1], dout_RF.shape[1]
    groups = offsets_G1.shape[0] - 1
    depth_block, col_block, stages = _fitted(
        blocks, _block(depth, blocks.weight_block), _block(cols, blocks.weight_block),
        lambda depth_block, col_block: tile * (depth_block + col_block) * x_RK.dtype.itemsize, interpret)
    per_group = (depth // depth_block) * (cols // col_block)
    kernel = functools.partial(_weight_kernel, tile=tile, depth_block=depth_block, col_block=col_block,
                               depth_blocks=depth // depth_block, col_blocks=cols // col_block, group=blocks.group)
    return pl.pallas_call(kernel, out_shape=_out_shape((groups, depth, cols), x_RK, dout_RF, offsets_G1),
                          grid=(groups * per_group,), interpret=interpret,
                          compiler_params=None if interpret else _compiler_params(blocks, stages, tile),
                          name="grouped_matmul_dw")(offsets_G1, x_RK, dout_RF)


def _weight_kernel(offsets_ref, x_ref, dout_ref, dw_ref, *, tile, depth_block, col_block, depth_blocks, col_blocks,
                   group):
    """One block [depth_block, col_block] of dw[g] = x[g's rows]^T dout[g's rows], summed tile by tile over the
    group's rows only (an empty group writes zeros)."""
    per_group = depth_blocks * col_blocks
    expert = jax.lax.div(pl.program_id(0), per_group)
    depth_index, col_index = _grouped_order(jax.lax.rem(pl.program_id(0), per_group), depth_blocks, col_blocks,
                                            group)
    depth = pl.ds(pl.multiple_of(depth_index * depth_block, depth_block), depth_block)
    cols = pl.ds(pl.multiple_of(col_index * col_block, col_block), col_block)
    start, end = offsets_ref[expert], offsets_ref[expert + 1]

    def step(index, acc_DC):
        rows = pl.ds(pl.multiple_of(start + index * tile, tile), tile)
        return acc_DC + _dot(x_ref[rows, depth], dout_ref[rows, cols], 0, 0)

    acc_DC = jax.lax.fori_loop(0, jax.lax.div(end - start, tile), step,
                               jnp.zeros((depth_block, col_block), jnp.float32))
    dw_ref[expert, depth, cols] = acc_DC.astype(dw_ref.dtype)
