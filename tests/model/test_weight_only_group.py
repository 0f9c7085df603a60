"""model/weight_only_group.py: several 8-bit projections of one input in one launch (the Pallas kernel interpreted
on CPU, lowered for CUDA without a GPU, compiled on one) against each weight's dequantized product."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from starscream_jax.errors import StarscreamError
from starscream_jax.hardware.backend import policy_of
from starscream_jax.model.quantize import quantize
from starscream_jax.model.weight_only import Blocks
from starscream_jax.model.weight_only_group import (FEW_ROWS_BLOCKS, FP8_FEW_ROWS_BLOCKS, MANY_ROWS_BLOCKS, applies,
                                                    blocks_for, group_grid, grouped_weight_only_matmul)

SMALL = Blocks(cols=32, depth=32)


def group(rows: int, depth: int, widths, format_name: str, seed: int = 0):
    """x [rows, depth] bfloat16 and [(values [depth, N], scale [N])] per width, the channels' ranges spread."""
    keys = jax.random.split(jax.random.key(seed), len(widths) + 1)
    weights = []
    for key, width in zip(keys[1:], widths):
        w = jax.random.normal(key, (depth, width)) * jnp.linspace(0.1, 3.0, width)
        weights.append(quantize(w, "w_gate", ("embed", "mlp"), format_name))
    return jax.random.normal(keys[0], (rows, depth)).astype(jnp.bfloat16), weights


def dequantized(x, values, scale) -> np.ndarray:
    """x @ (values * scale) in float64."""
    return np.asarray(x, np.float64) @ (np.asarray(values.astype(jnp.float32), np.float64) * np.asarray(scale))


def assert_products(outs, x, weights):
    """Each output within bfloat16's rounding of its weight's float64 dequantized product."""
    assert len(outs) == len(weights)
    for out, (values, scale) in zip(outs, weights):
        assert out.shape == (x.shape[0], values.shape[1]) and out.dtype == x.dtype
        expected = dequantized(x, values, scale)
        np.testing.assert_allclose(np.asarray(out, np.float64), expected, rtol=1e-2,
                                   atol=1e-2 * np.abs(expected).max())


@pytest.mark.parametrize("format_name", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("rows, reduce", [(1, "dot"), (1, "sum"), (3, "auto"), (40, "dot")])
def test_q_k_v_in_one_launch_give_each_weights_dequantized_product(format_name, rows, reduce):
    """Three weights of widths 128, 32, 32 (q, k, v in miniature) in one interpreted launch: each output is its own
    weight's product, at one padded row, a few summed rows and a 40-row dot."""
    x, weights = group(rows, 256, (128, 32, 32), format_name)
    outs = grouped_weight_only_matmul(x, weights, "interpret", Blocks(cols=32, depth=32, reduce=reduce))
    assert_products(outs, x, weights)


@pytest.mark.parametrize("splits", [1, 2, 8])
@pytest.mark.parametrize("convert", ["cast", "half"])
def test_splits_of_k_add_up_for_every_weight_of_the_group(splits, convert):
    x, weights = group(2, 256, (64, 64), "int8", seed=1)
    blocks = Blocks(cols=32, depth=32, splits=splits, convert=convert)
    assert_products(grouped_weight_only_matmul(x, weights, "interpret", blocks), x, weights)


def test_one_launch_for_the_group_and_no_copy_of_the_weights():
    """One pallas_call, taking every weight array itself (G weight operands, no concatenation of the 8-bit values)
    and writing one joint [splits, 1, 192] output that one reduction sums."""
    x, weights = group(1, 256, (128, 32, 32), "int8", seed=2)
    jaxpr = jax.make_jaxpr(lambda x, w: grouped_weight_only_matmul(x, w, "interpret", SMALL))(x, weights)
    text = str(jaxpr)
    assert text.count("pallas_call") == 1 and "concatenate" not in text
    call = next(eqn for eqn in jaxpr.jaxpr.eqns if eqn.primitive.name == "pallas_call")
    assert [v.aval.dtype for v in call.invars].count(jnp.dtype(jnp.int8)) == 3
    assert call.outvars[0].aval.shape[1:] == (1, 192)


def test_a_scale_for_the_tensor_and_mixed_formats():
    """A scalar scale scales every channel; weights of different 8-bit formats share one launch."""
    x, (first, second) = group(1, 64, (32, 32), "int8", seed=3)
    fp8 = quantize(jnp.linspace(-1, 1, 64 * 32).reshape(64, 32), "w_gate", ("embed", "mlp"), "float8_e4m3fn")
    weights = [(first[0], jnp.float32(0.5)), fp8]
    outs = grouped_weight_only_matmul(x, weights, "interpret", SMALL)
    assert_products(outs, x, [(first[0], np.full(32, 0.5)), fp8])


def test_the_grid_takes_every_weights_blocks_and_splits_for_the_group():
    """Llama 3 8B's q, k, v at one row: 32 + 8 + 8 blocks of 128 columns, split 8 ways (384 programs); gate and
    up: 224 blocks, split 2 ways; 64 rows: 64-column blocks, partials under a quarter of the weights' bytes."""
    assert group_grid(1, 4096, (4096, 1024, 1024), FEW_ROWS_BLOCKS) == (128, 64, [0, 32, 40, 48], 8)
    assert group_grid(1, 4096, (14336, 14336), FEW_ROWS_BLOCKS) == (128, 64, [0, 112, 224], 2)
    cols, depth, starts, splits = group_grid(64, 4096, (4096, 1024, 1024), MANY_ROWS_BLOCKS)
    assert (cols, depth, starts[-1]) == (64, 128, 96) and splits * 64 * 4 * 4 <= 4096
    assert blocks_for(1) == blocks_for(16) == FEW_ROWS_BLOCKS and blocks_for(64) == MANY_ROWS_BLOCKS
    assert blocks_for(1, jnp.float8_e4m3fn) == blocks_for(16, "float8_e4m3fnuz") == FP8_FEW_ROWS_BLOCKS
    assert FP8_FEW_ROWS_BLOCKS.convert == "half" and blocks_for(64, jnp.float8_e4m3fn) == MANY_ROWS_BLOCKS


def test_what_the_group_takes_and_refuses():
    assert applies(64, 4096, (4096, 1024), "pallas") and not applies(65, 4096, (4096,), "pallas")
    assert not applies(1, 4096, (4096, 1000), "pallas") and not applies(1, 4096, (4096,), "xla")
    x, weights = group(1, 64, (32,), "int8")
    with pytest.raises(StarscreamError, match="give one or more weights"):
        grouped_weight_only_matmul(x, [(weights[0][0].astype(jnp.bfloat16), weights[0][1])], "interpret")
    with pytest.raises(StarscreamError, match="implementation 'cuda'"):
        grouped_weight_only_matmul(x, weights, "cuda")
    with pytest.raises(StarscreamError, match="1 to 64 rows"):
        grouped_weight_only_matmul(jnp.zeros((65, 64), jnp.bfloat16), weights, "interpret")
    xla = grouped_weight_only_matmul(x, weights, "xla")
    assert_products(xla, x, weights)


@pytest.mark.parametrize("rows, convert, format_name, ptx", [(1, "cast", "int8", False), (64, "cast", "int8", False),
                                                           (1, "half", "int8", False), (1, "half", "int8", True),
                                                           (1, "half", "float8_e4m3fn", True)])
def test_the_kernel_lowers_for_cuda_without_a_gpu(rows, convert, format_name, ptx):
    """Pallas' Triton lowering accepts the kernel (per-weight branches, the joint output, each conversion, int8's
    inline PTX) for Llama 3 8B's q, k, v, lowered for CUDA from this machine: one Triton call in the program."""
    x = jax.ShapeDtypeStruct((rows, 4096), jnp.bfloat16)
    weights = [(jax.ShapeDtypeStruct((4096, width), format_name), jax.ShapeDtypeStruct((width,), jnp.float32))
               for width in (4096, 1024, 1024)]
    blocks = dataclasses.replace(blocks_for(rows), convert=convert)
    lowered = jax.jit(lambda x, w: grouped_weight_only_matmul(x, w, "pallas", blocks, ptx)).trace(x, weights).lower(
        lowering_platforms=("cuda",))
    assert lowered.as_text().count("xla.gpu.triton") == 1


@pytest.mark.gpu
@pytest.mark.parametrize("format_name", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_the_compiled_group_on_a_gpu_gives_each_dequantized_product(format_name, rows):
    """q, k, v and gate, up of Llama 3 8B's shapes compiled (Triton), each within bfloat16's rounding of its
    float64 product, with the inline PTX the backend takes (int8 into float16 on NVIDIA)."""
    ptx = policy_of(jax.devices()[0]).inline_ptx
    for widths in ((4096, 1024, 1024), (14336, 14336)):
        x, weights = group(rows, 4096, widths, format_name, seed=rows)
        outs = jax.jit(lambda x, w: grouped_weight_only_matmul(x, w, "pallas", ptx=ptx))(x, weights)
        for out, (values, scale) in zip(outs, weights):
            expected = dequantized(x, values, scale)
            assert np.linalg.norm(np.asarray(out, np.float64) - expected) <= 1e-2 * np.linalg.norm(expected)
