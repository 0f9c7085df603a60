"""model/weight_only_mosaic.py: the Mosaic GPU weight-only kernel lowered for CUDA on the CPU (its layouts and
conversions are chosen while lowering), the XLA work around it against the dequantized product, and on a Hopper GPU
the compiled kernel against the dequantized product."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from starscream_jax.errors import StarscreamError
from starscream_jax.model import weight_only_mosaic
from starscream_jax.model.weight_only_mosaic import MosaicTiling, applies, mosaic_weight_only_matmul, transposed
from tests.model.test_weight_only import dequantized_product, operands


@pytest.mark.parametrize("rows, depth, cols, dtype", [(1, 4096, 1024, jnp.int8), (13, 512, 128, jnp.int8),
                                                      (64, 1024, 256, jnp.float8_e4m3fn)])
def test_the_kernel_lowers_for_cuda(rows, depth, cols, dtype):
    """Lowered for an NVIDIA GPU on the CPU: the conversion of each weight format in registers, the MMA of a
    register operand by a transposed shared-memory one, and the pipeline's copies all pass Mosaic GPU's lowering
    (e4m3 to bfloat16 would not: Hopper converts e4m3 to float16 only)."""
    args = (jax.ShapeDtypeStruct((rows, depth), jnp.bfloat16), jax.ShapeDtypeStruct((cols, depth), dtype),
            jax.ShapeDtypeStruct((cols,), jnp.float32))
    lowered = jax.jit(mosaic_weight_only_matmul).trace(*args).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


def xla_partials(x_PK, w_NK, tiling, splits):
    """What the kernel computes, by XLA: float32 partials [splits, N, P] of W_T @ x^T over each split of K."""
    w_SNk = w_NK.astype(jnp.float32).reshape(w_NK.shape[0], splits, -1).transpose(1, 0, 2)
    x_SPk = x_PK.astype(jnp.float32).reshape(x_PK.shape[0], splits, -1).transpose(1, 0, 2)
    return jnp.einsum("snk,spk->snp", w_SNk, x_SPk, precision=jax.lax.Precision.HIGHEST)


@pytest.mark.parametrize("format_name", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("rows, splits", [(1, 0), (5, 2), (64, 4)])
def test_padding_splits_scales_and_row_factors_around_the_kernel(monkeypatch, format_name, rows, splits):
    """With the kernel's partials computed by XLA: the rows padded to a multiple of 8 and cut back, the splits
    summed, the per-channel scales applied, fp8's float16 row factors undone: the dequantized product."""
    monkeypatch.setattr(weight_only_mosaic, "_kernel", xla_partials)
    x, values, scale = operands(rows, 512, 128, format_name)
    got = mosaic_weight_only_matmul(x, transposed(values), scale, MosaicTiling(splits=splits))
    assert got.shape == (rows, 128) and got.dtype == jnp.bfloat16
    expected = dequantized_product(x, values, scale)
    np.testing.assert_allclose(np.asarray(got, np.float64), expected, rtol=1e-2, atol=1e-2 * np.abs(expected).max())


def test_what_the_kernel_takes_and_what_it_refuses():
    assert applies(1, 4096, 1024) and applies(64, 14336, 4096) and not applies(65, 4096, 1024)
    assert not applies(1, 4096, 96) and not applies(1, 4000, 1024) and applies(1, 4032, 1024, MosaicTiling(depth=64))
    x = jnp.zeros((1, 256), jnp.bfloat16)
    with pytest.raises(StarscreamError, match="N a multiple of 64"):
        mosaic_weight_only_matmul(x, jnp.zeros((96, 256), jnp.int8), jnp.ones(96))
    with pytest.raises(StarscreamError, match=r"\[N, K\] in int8 or float8_e4m3fn"):
        mosaic_weight_only_matmul(x, jnp.zeros((128, 256), jnp.bfloat16), jnp.ones(128))
    with pytest.raises(StarscreamError, match="depth is 64 or 128"):
        MosaicTiling(depth=32)


@pytest.mark.gpu
@pytest.mark.parametrize("format_name", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_the_compiled_kernel_on_a_gpu_gives_the_dequantized_product(format_name, rows):
    """Compiled for the GPU at Llama 3 8B's k / v shape (4096 x 1024, split over K): within bfloat16's rounding of
    the float64 dequantized product. Hopper or newer only (Mosaic GPU's warpgroup MMA)."""
    if not weight_only_mosaic.available():
        pytest.skip(f"Mosaic GPU's warpgroup MMA needs an NVIDIA GPU of compute capability 9.0 or newer, not "
                    f"{jax.devices()[0].device_kind}")
    x, values, scale = operands(rows, 4096, 1024, format_name, seed=rows)
    got = jax.jit(mosaic_weight_only_matmul)(x, transposed(values), scale)
    expected = dequantized_product(x, values, scale)
    assert np.linalg.norm(np.asarray(got, np.float64) - expected) <= 1e-2 * np.linalg.norm(expected)
