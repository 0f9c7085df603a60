"""Weight-only 8-bit decode matmul: x [M, K] (a few rows, the compute dtype) times W [K, N] stored in int8 or fp8
e4m3 with a float32 scale per output channel [N], out [M, N] in x's dtype, reading each weight byte once.

Why a kernel of its own: in decode the weights' bytes bound the step, and XLA's GEMM fusion that converts the 8-bit
operand as it reads it read int8 and fp8 weights at 1.5-1.6 TB/s on an H200, where cuBLAS reads bf16 at 2.85
(benchmarks/NOTES.md run 24), so 8-bit weights, half the bytes, gave no speed. This kernel streams the 8-bit tile
from HBM, converts it in registers (int8 and e4m3 values are exact in bf16) and accumulates in float32.

Lowering: Pallas on its Triton backend (`jax.experimental.pallas`, `pallas.triton.CompilerParams`). On NVIDIA it is
the GPU lowering Pallas has for every CUDA generation (the Mosaic GPU backend targets Hopper's TMA and warpgroup
MMA, which a memory-bound stream of a few rows does not need); ROCm's XLA also lowers Pallas through Triton's AMD
backend, so the same kernel source serves MI300X (int8, e4m3fnuz) and MI355X (e4m3fn). XLA:CPU has no lowering:
there the kernel runs in Pallas interpret mode (tests) or the caller takes the XLA path.

Layout of the work: one program per (column block of `cols` output channels, split of the contraction); each
program loops over its part of K in steps of `depth` rows, loads x [M, depth] and the 8-bit tile [depth, cols]
(`cols` contiguous bytes per row), converts the tile to x's dtype and accumulates [M, cols] in float32: through a
tensor-core dot where M is padded to at least 16 rows, or, for 1-4 rows, as a broadcast multiply and a sum over
depth (no 16-row tensor-core minimum, no wasted rows). The scale multiplies the accumulator in the epilogue
(scale commutes with the sum over K). With several splits (too few column blocks to fill the GPU, e.g. k and v
at N = 1024) each split writes its float32 partial [M, cols] and one small XLA pass adds them and casts.

Conversion (`Blocks.convert`): "cast" converts each tile to x's dtype as the compiler lowers `astype` (int8 to
bfloat16 goes through float32: two conversion instructions per weight, which run at a quarter of the arithmetic
rate on NVIDIA's SMs and may bound the kernel below the HBM rate); "half" computes in float16: x is rescaled per
row by a power of two into float16's range and cast (`half_inputs`: exact for every value within 2^29 of its row's
largest), int8 becomes float16 through its bits (1024 + (w + 128) as float16's bits, less 1152: integer operations
and one packed subtraction, `widened`), e4m3 through the hardware's paired float8-to-float16 conversion, and the
row factors are undone on the output (powers of two: exact).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ..errors import StarscreamError

IMPLEMENTATIONS = ("pallas", "interpret", "xla")
MAX_ROWS = 64
"""The most rows (tokens) the kernel takes: decode's batches; more rows are compute-bound GEMMs for XLA."""
TARGET_PROGRAMS = 264
"""Programs a call aims at (two per SM of an H200's 132): a column block alone is too few for narrow outputs."""
MAX_SPLITS = 16


@dataclasses.dataclass(frozen=True, kw_only=True)
class Blocks:
    """Tiling of the kernel. cols: output channels per program; depth: rows of W per loop step; splits: parts of K
    (0: chosen by shape, `split_count`); reduce: "dot" (tensor cores, rows padded to 16), "sum" (multiply and sum,
    at most 4 rows) or "auto" (sum for 1-4 rows, dot above); "dot" by default, the form Triton's matmul lowering is
    built for (the padded rows cost no bytes: x is a few kilobytes); warps, stages: Triton's launch width and
    pipeline depth. Each block size is cut to the largest power of two that divides its dimension."""

    cols: int = 128
    depth: int = 64
    splits: int = 0
    reduce: str = "dot"
    warps: int = 4
    stages: int = 4
    convert: str = "cast"

    def __post_init__(self):
        wrong = [f"{name} = {value!r}" for name, value in (("cols", self.cols), ("depth", self.depth))
                 if isinstance(value, bool) or not isinstance(value, int) or value < 16 or value & (value - 1)]
        if self.reduce not in ("auto", "dot", "sum"):
            wrong.append(f"reduce = {self.reduce!r}")
        if self.convert not in ("cast", "half"):
            wrong.append(f"convert = {self.convert!r}")
        if not (isinstance(self.splits, int) and 0 <= self.splits <= MAX_SPLITS):
            wrong.append(f"splits = {self.splits!r}")
        if wrong:
            raise StarscreamError(f"weight-only matmul Blocks {', '.join(wrong)}: cols and depth are powers of two "
                                  f"of at least 16, reduce one of auto, dot, sum, convert cast or half, "
                                  f"splits 0..{MAX_SPLITS}")


DEFAULT_BLOCKS = Blocks()


def default_implementation(device=None) -> str:
    """'pallas' on a GPU (CUDA or ROCm), 'xla' elsewhere (no Pallas lowering on CPU)."""
    platform = (device or jax.devices()[0]).platform
    return "pallas" if platform in ("gpu", "cuda", "rocm") else "xla"


def applies(rows: int, depth: int, cols: int, implementation: str) -> bool:
    """Whether x [rows, depth] @ W [depth, cols] runs on the kernel: `implementation` not "xla", at most MAX_ROWS
    rows, and K and N multiples of 16 (the smallest block)."""
    return implementation != "xla" and 0 < rows <= MAX_ROWS and depth % 16 == 0 and cols % 16 == 0


def reference(x_MK: jax.Array, w_KN: jax.Array, scale_N: jax.Array) -> jax.Array:
    """The exact product the kernel computes: x @ (values * scale) in float32, cast to x's dtype."""
    product = jnp.dot(x_MK.astype(jnp.float32), w_KN.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return (product * jnp.broadcast_to(scale_N, (w_KN.shape[1],)).astype(jnp.float32)).astype(x_MK.dtype)


def weight_only_matmul(x_MK: jax.Array, w_KN: jax.Array, scale_N: jax.Array, implementation: str = "pallas",
                       blocks: Blocks = DEFAULT_BLOCKS, ptx: bool = False) -> jax.Array:
    """out [M, N] in x's dtype = (x [M, K] @ W [K, N] (int8 or fp8, converted exactly)) * scale [N] (float32, or a
    scalar: one scale for the tensor). "pallas" (GPU), "interpret" (the same kernel interpreted: CPU tests) or
    "xla" (`reference`). `ptx`: the kernel compiles for an NVIDIA GPU and may carry inline PTX (`widened`; the
    backend policy's `inline_ptx`)."""
    rows, depth = x_MK.shape
    cols = w_KN.shape[1]
    if w_KN.shape[0] != depth or jnp.dtype(w_KN.dtype).itemsize != 1:
        raise StarscreamError(f"weight-only matmul of x {x_MK.shape} by W {w_KN.shape} {w_KN.dtype}: W must be "
                              "[K, N] in an 8-bit format")
    if implementation not in IMPLEMENTATIONS:
        raise StarscreamError(f"weight-only matmul implementation {implementation!r}; use one of "
                              f"{', '.join(IMPLEMENTATIONS)}")
    scale_N = jnp.broadcast_to(jnp.asarray(scale_N, jnp.float32), (cols,))
    if not applies(rows, depth, cols, implementation):
        if implementation != "xla":
            raise StarscreamError(f"weight-only matmul of x {x_MK.shape} by W {w_KN.shape}: the kernel takes 1 to "
                                  f"{MAX_ROWS} rows and K, N multiples of 16; use implementation 'xla'")
        return reference(x_MK, w_KN, scale_N)
    return _kernel_call(x_MK, w_KN, scale_N, blocks, interpret=implementation == "interpret", ptx=ptx)


def padded_rows(rows: int, reduce: str) -> tuple[int, bool]:
    """(rows the kernel computes, whether by tensor-core dot): a power of two (Triton's blocks are), at least 16
    for a dot; "auto" sums 1-4 rows and dots more."""
    power = 1 << (rows - 1).bit_length()
    use_dot = reduce == "dot" or (reduce == "auto" and power > 4)
    if not use_dot and power > 4:
        raise StarscreamError(f"weight-only matmul reduce 'sum' takes at most 4 rows, not {rows}; use 'dot' or "
                              "'auto'")
    return (max(power, 16), True) if use_dot else (power, False)


def power_of_two_block(dim: int, wanted: int) -> int:
    """The largest power of two up to `wanted` that divides `dim`."""
    block = 1
    while block * 2 <= wanted and dim % (block * 2) == 0:
        block *= 2
    return block


def split_count(rows: int, depth: int, col_blocks: int, depth_steps: int, given: int = 0) -> int:
    """Parts the contraction is split into: `given`, or doubled from 1 while the programs (col_blocks x splits) are
    under TARGET_PROGRAMS, the steps divide evenly, and the float32 partials (splits x `rows` written x 4 bytes per
    column) stay under a quarter of the weight's bytes (depth per column), so that the extra pass stays small."""
    if given:
        if depth_steps % given:
            raise StarscreamError(f"weight-only matmul splits {given} does not divide the {depth_steps} steps of K")
        return given
    splits = 1
    while (col_blocks * splits < TARGET_PROGRAMS and splits * 2 <= MAX_SPLITS and depth_steps % (splits * 2) == 0
           and splits * 2 * rows * 4 * 4 <= depth):
        splits *= 2
    return splits


def half_inputs(x_PK: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(x [P, K] times 2^(15 - e) per row, e the exponent of the row's largest magnitude (below 2^e), in float16;
    the inverse factors [P, 1] float32). Every value within 2^29 of its row's largest keeps all its bits (a bfloat16
    value has fewer than float16's); smaller ones, whose products are below the output's rounding, lose bits or
    become zero."""
    x_PK = x_PK.astype(jnp.float32)
    _, exponent_P1 = jnp.frexp(jnp.max(jnp.abs(x_PK), axis=1, keepdims=True))
    factor_P1 = jnp.ldexp(jnp.ones_like(exponent_P1, jnp.float32), 15 - exponent_P1)
    return (x_PK * factor_P1).astype(jnp.float16), 1.0 / factor_P1


INT8_TO_HALF_PTX = """{
.reg .b32 biased, exponent, offset;
mov.b32 exponent, 0x64646464;
mov.b32 offset, 0x64806480;
xor.b32 biased, $2, 0x80808080;
prmt.b32 $0, biased, exponent, 0x4140;
prmt.b32 $1, biased, exponent, 0x4342;
sub.f16x2 $0, $0, offset;
sub.f16x2 $1, $1, offset;
}"""
"""Four int8 values (one register) into four float16 (two registers), exact: each byte's sign bit flipped (w + 128),
placed under float16's exponent byte 0x64 (1024 + w + 128) by a byte permute, less 1152 by a paired subtraction:
five instructions for four values, where a conversion instruction per value runs at a quarter of the arithmetic
rate."""


def widened(w: jax.Array, dtype, ptx: bool = False) -> jax.Array:
    """An 8-bit tile as `dtype` (exact): int8 into float16 through its bits (`w + 128` under float16's exponent of
    1024, less 1152; by INT8_TO_HALF_PTX where `ptx`: a kernel compiled for an NVIDIA GPU), anything else by
    `astype`."""
    if jnp.dtype(dtype) == jnp.float16 and w.dtype == jnp.int8:
        if ptx:
            return plgpu.elementwise_inline_asm(INT8_TO_HALF_PTX, args=[w], constraints="=r,=r,r", pack=4,
                                                result_shape_dtypes=[jax.ShapeDtypeStruct(w.shape, jnp.float16)])[0]
        biased = jax.lax.bitcast_convert_type(w, jnp.uint8) ^ jnp.uint8(0x80)
        bits = biased.astype(jnp.uint16) | jnp.uint16(0x6400)
        return jax.lax.bitcast_convert_type(bits, jnp.float16) - jnp.float16(1152)
    return w.astype(dtype)


def kernel_inputs(x_MK: jax.Array, padded: int, convert: str) -> tuple[jax.Array, jax.Array | None]:
    """(x padded with rows of zeros to `padded` rows, in float16 by `half_inputs` where `convert` is "half"; the
    row factors to undo on the output, or None)."""
    x_PK = jnp.pad(x_MK, ((0, padded - x_MK.shape[0]), (0, 0))) if padded != x_MK.shape[0] else x_MK
    return half_inputs(x_PK) if convert == "half" else (x_PK, None)


def finished(out_SPN: jax.Array, inverse_P1: jax.Array | None, rows: int, dtype) -> jax.Array:
    """The kernel's output [splits, P or 1, N] -> [rows, N] in `dtype`: the splits' partials summed, the row
    factors of a "half" call undone."""
    out_PN = jnp.sum(out_SPN, axis=0) if out_SPN.shape[0] > 1 else out_SPN[0]
    if inverse_P1 is not None:
        out_PN = out_PN * inverse_P1[:out_PN.shape[0]]
    return out_PN[:rows].astype(dtype)


def _kernel_call(x_MK, w_KN, scale_N, blocks: Blocks, interpret: bool, ptx: bool) -> jax.Array:
    rows, depth = x_MK.shape
    cols = w_KN.shape[1]
    padded, use_dot = padded_rows(rows, blocks.reduce)
    # each block at least 16: see `applies`
    col_block, depth_block = power_of_two_block(cols, blocks.cols), power_of_two_block(depth, blocks.depth)
    col_blocks, depth_steps = cols // col_block, depth // depth_block
    out_rows = 1 if rows == 1 else padded  # one row: the padded rows' zeros summed away in the kernel
    splits = split_count(out_rows, depth, col_blocks, depth_steps, blocks.splits)
    x_PK, inverse_P1 = kernel_inputs(x_MK, padded, blocks.convert)
    out_dtype = jnp.float32 if splits > 1 else x_MK.dtype
    kernel = functools.partial(_kernel, col_block=col_block, depth_block=depth_block,
                               steps=depth_steps // splits, use_dot=use_dot, collapse=out_rows < padded,
                               ptx=ptx and not interpret)
    params = None if interpret else plgpu.CompilerParams(num_warps=blocks.warps, num_stages=blocks.stages)
    out_SPN = pl.pallas_call(kernel,
                             out_shape=kernel_out_shape((splits, out_rows, cols), out_dtype, x_PK, w_KN, scale_N),
                             grid=(col_blocks, splits), interpret=interpret, compiler_params=params,
                             name="weight_only_matmul")(x_PK, w_KN, scale_N.reshape(1, cols))
    return finished(out_SPN, inverse_P1, rows, x_MK.dtype)


def kernel_out_shape(shape, dtype, *operands) -> jax.ShapeDtypeStruct:
    """The kernel's output; inside a shard map typed as varying over the manual mesh axes its operands vary over
    (none where they are replicated)."""
    manual = [jax.typeof(x).manual_axis_type for x in operands]
    if all(axis_type is None for axis_type in manual):
        return jax.ShapeDtypeStruct(shape, dtype)
    varying = frozenset().union(*(axis_type.varying for axis_type in manual if axis_type is not None))
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.sharding.ManualAxisType(varying=varying))


def _kernel(x_ref, w_ref, scale_ref, out_ref, *, col_block, depth_block, steps, use_dot, collapse, ptx):
    """One (column block, split) of out: `column_block_product` written to out[split] (float32 partials, or x's
    dtype unsplit)."""
    col_index, split = pl.program_id(0), pl.program_id(1)
    cols = pl.ds(pl.multiple_of(col_index * col_block, col_block), col_block)
    out_ref[split, :, cols] = column_block_product(x_ref, w_ref, scale_ref, cols, split, col_block=col_block,
                                                   depth_block=depth_block, steps=steps, use_dot=use_dot,
                                                   collapse=collapse, ptx=ptx).astype(out_ref.dtype)


def column_block_product(x_ref, w_ref, scale_ref, cols, split, *, col_block, depth_block, steps, use_dot,
                         collapse, ptx) -> jax.Array:
    """Inside a kernel: x [P, the `steps` x `depth_block` rows of K of split `split`] times W's columns `cols`
    [.., col_block] converted to x's dtype (`widened`), float32 accumulation (a tensor-core dot where `use_dot`, else
    products summed on the CUDA cores), times the columns' scales: [P, col_block] float32, or [1, col_block] with
    `collapse` (one real row and P - 1 rows of zeros, summed into the one row: partials of one row, not of P)."""
    first = split * steps

    def step(index, acc_PC):
        depth = pl.ds(pl.multiple_of((first + index) * depth_block, depth_block), depth_block)
        x_PD = x_ref[:, depth]
        w_DC = widened(w_ref[depth, cols], x_PD.dtype, ptx)
        if use_dot:
            return acc_PC + jax.lax.dot_general(x_PD, w_DC, (((1,), (0,)), ((), ())),
                                                preferred_element_type=jnp.float32)
        products_PDC = x_PD.astype(jnp.float32)[:, :, None] * w_DC.astype(jnp.float32)[None, :, :]
        return acc_PC + jnp.sum(products_PDC, axis=1)

    acc_PC = jax.lax.fori_loop(0, steps, step, jnp.zeros((x_ref.shape[0], col_block), jnp.float32))
    if collapse:
        acc_PC = jnp.sum(acc_PC, axis=0, keepdims=True)
    return acc_PC * scale_ref[:, cols]
