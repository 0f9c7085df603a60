"""model/weight_only.py: the weight-only 8-bit matmul (its Pallas kernel interpreted on CPU) against the dequantized
product."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from starscream_jax.errors import StarscreamError
from starscream_jax.hardware.backend import policy_of
from starscream_jax.model.quantize import quantize
from starscream_jax.model.weight_only import (MAX_ROWS, TARGET_PROGRAMS, Blocks, applies, half_inputs, padded_rows,
                                              reference, split_count, weight_only_matmul, widened)

SMALL = Blocks(cols=32, depth=32)
"""Blocks for the test's small shapes: several column blocks and loop steps per program."""


def operands(rows: int, depth: int, cols: int, format_name: str, seed: int = 0):
    """x [rows, depth] bfloat16, W's 8-bit values [depth, cols] and float32 scales [cols] (per channel, the
    channels' ranges spread over 1..cols)."""
    key_w, key_x = jax.random.split(jax.random.key(seed))
    w = jax.random.normal(key_w, (depth, cols)) * jnp.linspace(0.1, 3.0, cols)
    values, scale = quantize(w, "w_gate", ("embed", "mlp"), format_name)
    return jax.random.normal(key_x, (rows, depth)).astype(jnp.bfloat16), values, scale


def dequantized_product(x, values, scale) -> np.ndarray:
    """x @ (values * scale) in float64: what an 8-bit weight stands for."""
    return np.asarray(x, np.float64) @ (np.asarray(values.astype(jnp.float32), np.float64) * np.asarray(scale))


@pytest.mark.parametrize("format_name", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("rows, reduce, convert", [(1, "dot", "cast"), (1, "sum", "cast"), (3, "auto", "cast"),
                                                   (16, "dot", "cast"), (40, "dot", "cast"), (1, "dot", "half"),
                                                   (3, "sum", "half"), (40, "dot", "half")])
def test_the_kernel_gives_the_dequantized_product(format_name, rows, reduce, convert):
    """Interpreted, for decode's row counts (padded to the kernel's), each reduction form and conversion: within
    bfloat16's rounding of the output of the float64 dequantized product, and equal to the float32 reference."""
    x, values, scale = operands(rows, 256, 96, format_name)
    got = weight_only_matmul(x, values, scale, "interpret", Blocks(cols=32, depth=32, reduce=reduce, convert=convert))
    assert got.shape == (rows, 96) and got.dtype == jnp.bfloat16
    expected = dequantized_product(x, values, scale)
    np.testing.assert_allclose(np.asarray(got, np.float64), expected, rtol=1e-2, atol=1e-2 * np.abs(expected).max())
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(reference(x, values, scale), np.float32),
                               rtol=1e-2, atol=1e-6)


@pytest.mark.parametrize("splits", [1, 2, 8])
def test_splits_of_the_contraction_add_up_to_the_whole_product(splits):
    """K = 256 in 8 steps of 32 rows, split 1, 2 or 8 ways: float32 partials summed after the kernel, each already
    times its scales (which commute with the sum)."""
    x, values, scale = operands(2, 256, 64, "int8", seed=1)
    got = weight_only_matmul(x, values, scale, "interpret", Blocks(cols=32, depth=32, splits=splits))
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(reference(x, values, scale), np.float32),
                               rtol=1e-2, atol=1e-6)


def test_one_row_writes_partials_of_one_row_not_of_the_padded_sixteen():
    """Decode at batch 1: x padded to 16 rows for the tensor-core dot, but each split writes one row of float32
    partials (the zero rows summed away in the kernel), so the extra pass moves 1/16 of the padded bytes."""
    x, values, scale = operands(1, 256, 64, "int8", seed=4)
    blocks = Blocks(cols=32, depth=32, splits=8)
    jaxpr = str(jax.make_jaxpr(lambda x: weight_only_matmul(x, values, scale, "interpret", blocks))(x))
    assert "f32[8,1,64]" in jaxpr and "f32[8,16,64]" not in jaxpr
    np.testing.assert_allclose(np.asarray(weight_only_matmul(x, values, scale, "interpret", blocks), np.float32),
                               np.asarray(reference(x, values, scale), np.float32), rtol=1e-2, atol=1e-6)


def test_int8_through_float16_bits_is_exact():
    every = jnp.arange(-128, 128, dtype=jnp.int32).astype(jnp.int8)
    np.testing.assert_array_equal(np.asarray(widened(every, jnp.float16), np.float32), np.arange(-128, 128))


def test_half_inputs_rescale_each_row_exactly_into_float16():
    """Rows of very different magnitudes (1e6 would overflow float16; 1e-6 would be a subnormal) keep every bit
    of their bfloat16 values, and the factors undo the scaling."""
    x = jnp.asarray([[1e6, -3e5, 7.0, 0.0], [1e-6, -2e-6, 5e-7, 1e-7], [0.0] * 4], jnp.bfloat16)
    half, inverse = half_inputs(x)
    assert half.dtype == jnp.float16 and inverse.shape == (3, 1)
    assert np.all(np.abs(np.asarray(half, np.float32)) < 2.0 ** 15)
    np.testing.assert_array_equal(np.asarray(half, np.float32) * np.asarray(inverse), np.asarray(x, np.float32))


@pytest.mark.parametrize("format_name", ["int8", "float8_e4m3fn"])
def test_half_conversion_keeps_rows_of_any_magnitude(format_name):
    """Activations of 1e5 (beyond float16's range unscaled) give the product the cast path gives."""
    x, values, scale = operands(2, 256, 64, format_name, seed=5)
    x = x * jnp.asarray([[1e5], [1e-5]], x.dtype)
    got = weight_only_matmul(x, values, scale, "interpret", Blocks(cols=32, depth=32, convert="half"))
    cast = weight_only_matmul(x, values, scale, "interpret", Blocks(cols=32, depth=32))
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(cast, np.float32), rtol=2e-2)


def test_one_scale_for_the_tensor_scales_every_channel():
    x, values, _ = operands(1, 64, 32, "float8_e4m3fn", seed=2)
    got = weight_only_matmul(x, values, jnp.float32(0.5), "interpret", SMALL)
    expected = dequantized_product(x, values, np.full(32, 0.5))
    np.testing.assert_allclose(np.asarray(got, np.float64), expected, rtol=1e-2, atol=1e-2 * np.abs(expected).max())


def test_the_xla_implementation_is_the_reference():
    x, values, scale = operands(100, 64, 32, "int8", seed=3)  # more rows than the kernel takes: XLA's alone
    np.testing.assert_array_equal(weight_only_matmul(x, values, scale, "xla"), reference(x, values, scale))


def test_split_count_fills_the_gpu_only_while_the_partials_stay_small():
    """A narrow output (k and v of Llama 3 8B: N 1024, 8 column blocks) at one row is split up to MAX_SPLITS (16)
    ways; a wide one (gate: 112 column blocks) just past TARGET_PROGRAMS; 64 rows keep the partials under a quarter
    of the weight's bytes; a given count is taken, or refused where it does not divide the steps."""
    assert split_count(16, 4096, 8, 64) == 16
    gate = split_count(16, 4096, 112, 64)
    assert 112 * gate >= TARGET_PROGRAMS > 112 * gate // 2
    assert split_count(64, 4096, 32, 64) * 64 * 4 * 4 <= 4096
    assert split_count(16, 4096, 8, 64, given=4) == 4
    with pytest.raises(StarscreamError, match="splits 3 does not divide the 64 steps"):
        split_count(16, 4096, 8, 64, given=3)


def test_rows_are_padded_to_a_power_of_two_and_to_16_for_a_dot():
    assert padded_rows(1, "dot") == (16, True) and padded_rows(1, "sum") == (1, False)
    assert padded_rows(3, "auto") == (4, False) and padded_rows(5, "auto") == (16, True)
    assert padded_rows(33, "auto") == (64, True)
    with pytest.raises(StarscreamError, match="reduce 'sum' takes at most 4 rows, not 5"):
        padded_rows(5, "sum")


def test_what_the_kernel_takes_and_what_it_refuses():
    assert applies(MAX_ROWS, 4096, 1024, "pallas") and not applies(MAX_ROWS + 1, 4096, 1024, "pallas")
    assert not applies(1, 4096, 1024, "xla") and not applies(1, 4100, 1024, "pallas")
    x, values, scale = operands(1, 64, 32, "int8")
    with pytest.raises(StarscreamError, match=r"W must be \[K, N\] in an 8-bit format"):
        weight_only_matmul(x, values.astype(jnp.bfloat16), scale, "interpret")
    with pytest.raises(StarscreamError, match="implementation 'cuda'"):
        weight_only_matmul(x, values, scale, "cuda")
    with pytest.raises(StarscreamError, match="the kernel takes 1 to 64 rows"):
        weight_only_matmul(jnp.zeros((65, 64), jnp.bfloat16), values, scale, "interpret")
    with pytest.raises(StarscreamError, match="cols = 24"):
        Blocks(cols=24)


@pytest.mark.gpu
@pytest.mark.parametrize("format_name", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("reduce, convert", [("dot", "cast"), ("auto", "cast"), ("dot", "half")])
def test_the_compiled_kernel_on_a_gpu_gives_the_dequantized_product(format_name, rows, reduce, convert):
    """The Triton kernel compiled (Llama 3 8B's k / v shape, 4096 x 1024, split over K), with the inline PTX its
    backend takes (int8 into float16 by a byte permute on NVIDIA): within bfloat16's rounding of the float64
    product, as interpreted on the CPU."""
    x, values, scale = operands(rows, 4096, 1024, format_name, seed=rows)
    ptx = policy_of(jax.devices()[0]).inline_ptx
    got = jax.jit(lambda x: weight_only_matmul(x, values, scale, "pallas", Blocks(reduce=reduce, convert=convert),
                                               ptx))(x)
    expected = dequantized_product(x, values, scale)
    assert np.linalg.norm(np.asarray(got, np.float64) - expected) <= 1e-2 * np.linalg.norm(expected)
