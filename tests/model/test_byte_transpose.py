"""model/byte_transpose.py: the transpose of 1-byte arrays by a Pallas kernel (interpreted on CPU, lowered for CUDA
without a GPU) is exactly x.T, for every 1-byte format, and refuses what it does not take."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from starscream_jax.model.byte_transpose import tile_for, transposed


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2])
@pytest.mark.parametrize("shape", [(192, 320), (16, 128), (64, 64)])
def test_the_kernel_transposes_every_byte_exactly(dtype, shape):
    """Every byte of x lands at its transposed place (compared as bytes: fp8 NaNs and signed zeros too)."""
    x = (jax.random.normal(jax.random.key(0), shape) * 40).astype(dtype)
    got = transposed(x, interpret=True)
    assert got.shape == shape[::-1] and got.dtype == x.dtype
    as_bytes = lambda array: np.asarray(jax.lax.bitcast_convert_type(array, jnp.int8))  # noqa: E731
    np.testing.assert_array_equal(as_bytes(got), as_bytes(x).T)


def test_the_tile_is_the_largest_power_of_two_dividing_both_sides():
    assert tile_for(3072, 16384) == 64 and tile_for(16, 128) == 16 and tile_for(96, 160) == 32
    assert tile_for(24, 64) == 0 and tile_for(100, 64) == 0  # under 16: XLA's transpose


def test_what_the_kernel_does_not_take_is_refused_in_one_line():
    with pytest.raises(ValueError, match="1-byte values and sides that are multiples of 16"):
        transposed(jnp.zeros((64, 64), jnp.bfloat16), interpret=True)
    with pytest.raises(ValueError, match=r"\[24, 64\]"):
        transposed(jnp.zeros((24, 64), jnp.int8), interpret=True)


def test_the_kernel_lowers_for_cuda_without_a_gpu():
    """Llama 3.2 3B's gate/up weight in e4m3 [3072, 16384]: one Triton call."""
    lowered = jax.jit(transposed).trace(jax.ShapeDtypeStruct((3072, 16384), jnp.float8_e4m3fn)).lower(
        lowering_platforms=("cuda",))
    assert lowered.as_text().count("xla.gpu.triton") == 1


@pytest.mark.gpu
def test_the_compiled_kernel_on_a_gpu_transposes_every_byte_exactly():
    """Compiled at Llama 3.2 3B's gate/up shape in e4m3."""
    x = (jax.random.normal(jax.random.key(0), (3072, 16384)) * 40).astype(jnp.float8_e4m3fn)
    got = jax.jit(transposed)(x)
    as_bytes = lambda array: np.asarray(jax.lax.bitcast_convert_type(array, jnp.int8))  # noqa: E731
    np.testing.assert_array_equal(as_bytes(got), as_bytes(x).T)
