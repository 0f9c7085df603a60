"""model/eight_bit_decode.py: decode attention over an 8-bit cache by a Pallas kernel (interpreted on CPU, lowered
for CUDA without a GPU, compiled on one) against the XLA form (`ops._decode_over_8_bit_cache`) and the dequantized
cache; and the model's decode through it."""
import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from starscream_jax.hardware.backend import policy_of
from starscream_jax.hardware.mesh import build_mesh
from starscream_jax.model import ops
from starscream_jax.model.catalog import load_model_config
from starscream_jax.model.decoder import Transformer, create_sharded_model
from starscream_jax.model.dense_cache import init_cache
from starscream_jax.model.eight_bit_decode import (Tiling, applies, decode_attention, pages_per_step,
                                                   paged_decode_attention, split_count)
from starscream_jax.model.quantize import quantize_cache_entry
from starscream_jax.sharding.apply import use_layout


def operands(format_name: str, batch: int, length: int, kv_heads: int = 2, group: int = 4, head_dim: int = 32):
    """q [B, 1, H, E] bfloat16, the 8-bit cache (values [B, T, K, E], scales [B, T, K]) of random keys and values
    whose ranges vary over positions, and each row's visible length [B] (1, the whole cache, and between)."""
    keys = jax.random.split(jax.random.key(batch + length), 3)
    q = jax.random.normal(keys[0], (batch, 1, kv_heads * group, head_dim)).astype(jnp.bfloat16)
    spread = jnp.linspace(0.5, 3.0, length)[None, :, None, None]
    (k8, k_scale), (v8, v_scale) = (quantize_cache_entry(jax.random.normal(key, (batch, length, kv_heads, head_dim))
                                                         * spread, format_name) for key in keys[1:])
    lengths = jnp.array([1, length, length // 2 + 3] * batch, jnp.int32)[:batch]
    return q, k8, v8, k_scale, v_scale, lengths


@pytest.mark.parametrize("format_name, batch, length", [
    ("float8_e4m3fn", 1, 512), ("float8_e4m3fn", 3, 256), ("float8_e4m3fn", 2, 192),
    pytest.param("int8", 1, 512, marks=pytest.mark.slow),
    pytest.param("int8", 3, 256, marks=pytest.mark.slow)])  # interpreted on CPU, int8 takes 10-17 s a case (the
# int8 cache runs the kernel in the model below)
def test_the_kernel_gives_the_xla_forms_attention(format_name, batch, length):
    """Interpreted: rows seeing 1 position (every later stretch empty), all of them and some; the positions split
    into stretches merged after (`split_count`); a length of 192 walked in blocks of 64 (the largest power of two
    up to the tiling's 128 that divides it): within bfloat16's rounding of the XLA form."""
    q, k8, v8, k_scale, v_scale, lengths = operands(format_name, batch, length)
    got = decode_attention(q, k8, v8, k_scale, v_scale, lengths, interpret=True)
    assert got.shape == q.shape and got.dtype == q.dtype
    expected = ops._decode_over_8_bit_cache(q, k8, v8, k_scale, v_scale, (lengths - 1)[:, None])
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(expected, np.float32), rtol=2e-2, atol=2e-2)
    assert split_count(batch, 2, length) > 1 or length % 128  # 192 positions: one stretch of three 64-blocks


def test_the_stretches_fill_the_gpu_and_the_shapes_it_takes():
    """Llama 3 8B (8 kv heads, 4096 positions): batch 1 split into 32 stretches of 128 positions (more would
    write partials over a quarter of the cache's bytes), batch 64 not split (512 programs already)."""
    assert split_count(1, 8, 4096) == 32 and split_count(64, 8, 4096) == 1 and split_count(1, 8, 64) == 1
    assert applies(32, 8, 4096, 128) and applies(28, 4, 4096, 128)  # 7 queries per kv head, padded to 16
    assert not applies(32, 8, 4000, 128) and not applies(32, 8, 4096, 96)


@pytest.mark.parametrize("format_name", ["int8", "float8_e4m3fn"])
def test_the_paged_form_attends_alike_with_its_pages_gathered_or_apart(format_name):
    """Interpreted: 3 rows over a shuffled pool of 16-position pages (lengths 1, a whole 6-page table, and between),
    a loop step reading four pages by one gathering load, or each page as a tile with its own dots: the same
    attention (equal here; a GPU's products may round a bfloat16 step apart), and within bfloat16's rounding of
    the XLA form over the rows laid out in order."""
    q, k8, v8, k_scale, v_scale, lengths = operands(format_name, 3, 96)
    page, width = 16, 6
    table = jax.random.permutation(jax.random.key(2), 3 * width).reshape(3, width).astype(jnp.int32)
    pools = []
    for rows in (k8, v8, k_scale, v_scale):
        paged_rows = rows.reshape(3 * width, page, *rows.shape[2:])
        pools.append(jnp.zeros_like(paged_rows).at[table.reshape(-1)].set(paged_rows))
    gathered, apart = (paged_decode_attention(q, *pools, table, lengths, interpret=True,
                                              tiling=Tiling(pages_apart=pages_apart)) for pages_apart in (False, True))
    expected = ops._decode_over_8_bit_cache(q, k8, v8, k_scale, v_scale, (lengths - 1)[:, None])
    np.testing.assert_allclose(np.asarray(apart, np.float32), np.asarray(gathered, np.float32), rtol=0, atol=1e-2)
    np.testing.assert_allclose(np.asarray(apart, np.float32), np.asarray(expected, np.float32), rtol=2e-2, atol=2e-2)


def test_the_paged_form_reads_whole_pages_a_step():
    """A loop step reads a block's worth of whole pages: four 16-position pages, two of 32, one of 128 (never part
    of a page), and no more pages than a row's table holds."""
    assert [pages_per_step(16, 40, 64), pages_per_step(32, 40, 64), pages_per_step(128, 40, 64)] == [4, 2, 1]
    assert pages_per_step(16, 2, 64) == 2 and pages_per_step(16, 40, 256) == 16


def _decode_logits(implementation: str, monkeypatch, layout=None):
    """Logits [3, 1, V] of one decode step of the 2-layer tiny model with an int8 cache of 64 positions holding
    3 written ones, decode attention by `implementation` ("interpret": the kernel; "": the XLA form), unsharded or
    under `layout` on one device."""
    monkeypatch.setattr(ops, "_eight_bit_decode_implementation", lambda *shape, device=None: implementation)
    config = load_model_config("tiny").replace(n_layers=2, dtype="bfloat16", kv_format="int8")
    with contextlib.ExitStack() as stack:
        if layout:
            mesh = build_mesh("1x1")
            stack.enter_context(use_layout(layout, mesh))
            model = create_sharded_model(config, layout, mesh)
        else:
            model = Transformer(config, rngs=nnx.Rngs(0))
        graphdef, params = nnx.split(model)
        prompt = jnp.array([[5, 9, 2], [7, 1, 4], [3, 3, 8]], jnp.int32)

        def steps(params, cache):
            cache = nnx.merge(graphdef, params)(prompt, cache=cache, cache_index=0).cache
            return nnx.merge(graphdef, params)(prompt[:, :1], cache=cache, cache_index=3).logits

        jaxpr = str(jax.make_jaxpr(steps)(params, init_cache(config, 3, 64)))
        return jaxpr.count("pallas_call"), jax.jit(steps)(params, init_cache(config, 3, 64))


def test_decode_over_an_int8_cache_runs_the_kernel_in_the_model(monkeypatch):
    """Where the kernel is chosen, each layer's decode attention is one of its launches (prefill keeps its
    matmuls), unsharded and inside the layout's shard map, and the logits are the XLA form's to bfloat16's
    rounding."""
    plain_calls, expected = _decode_logits("", monkeypatch)
    calls, got = _decode_logits("interpret", monkeypatch)
    placed_calls, placed = _decode_logits("interpret", monkeypatch, "starscream_decode")
    assert plain_calls == 0 and calls in (1, 2) and placed_calls in (1, 2)
    scale = float(jnp.max(jnp.abs(expected)))
    for logits in (got, placed):
        np.testing.assert_allclose(np.asarray(logits), np.asarray(expected), atol=0.02 * scale)


@pytest.mark.parametrize("batch, ptx", [(1, False), (64, False), (64, True)])
def test_the_kernel_lowers_for_cuda_without_a_gpu(batch, ptx):
    """Pallas' Triton lowering takes the kernel at Llama 3 8B's shape (strided [64, 128] tiles of an int8 cache
    [B, 4096, 8, 128], the scales' [64] columns), int8 into float16 by portable operations or by inline PTX: one
    Triton call."""
    shapes = [((batch, 1, 32, 128), jnp.bfloat16), ((batch, 4096, 8, 128), jnp.int8),
              ((batch, 4096, 8, 128), jnp.int8), ((batch, 4096, 8), jnp.float32), ((batch, 4096, 8), jnp.float32),
              ((batch,), jnp.int32)]
    lowered = jax.jit(functools.partial(decode_attention, ptx=ptx)).trace(
        *(jax.ShapeDtypeStruct(*shape) for shape in shapes)).lower(lowering_platforms=("cuda",))
    assert lowered.as_text().count("xla.gpu.triton") == 1


@pytest.mark.gpu
@pytest.mark.parametrize("format_name", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("batch", [1, 64])
def test_the_compiled_kernel_on_a_gpu_gives_the_xla_forms_attention(format_name, batch):
    """Llama 3 8B's attention shape (8 kv heads of 4 queries, head_dim 128, 4096 positions) compiled: within
    bfloat16's rounding of the XLA form, with the inline PTX the backend takes (int8 into float16 on NVIDIA)."""
    q, k8, v8, k_scale, v_scale, lengths = operands(format_name, batch, 4096, kv_heads=8, head_dim=128)
    ptx = policy_of(jax.devices()[0]).inline_ptx
    got = jax.jit(functools.partial(decode_attention, ptx=ptx))(q, k8, v8, k_scale, v_scale, lengths)
    expected = jax.jit(ops._decode_over_8_bit_cache)(q, k8, v8, k_scale, v_scale, (lengths - 1)[:, None])
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(expected, np.float32), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("ptx, apart", [(False, False), (True, False), (True, True)])
def test_the_paged_form_lowers_for_cuda_without_a_gpu(ptx, apart):
    """The paged form at an 8B server's shape (pools of 16-position int8 pages [P, 16, 8, 128] with their scales, 64
    rows' block tables of 40 pages): one Triton call, each page read through the row's table (gathered, or each page
    a tile of its own)."""
    shapes = [((64, 1, 32, 128), jnp.bfloat16), ((4096, 16, 8, 128), jnp.int8), ((4096, 16, 8, 128), jnp.int8),
              ((4096, 16, 8), jnp.float32), ((4096, 16, 8), jnp.float32), ((64, 40), jnp.int32), ((64,), jnp.int32)]
    tiling = Tiling(pages_apart=apart)
    lowered = jax.jit(functools.partial(paged_decode_attention, ptx=ptx, tiling=tiling)).trace(
        *(jax.ShapeDtypeStruct(*shape) for shape in shapes)).lower(lowering_platforms=("cuda",))
    assert lowered.as_text().count("xla.gpu.triton") == 1


@pytest.mark.gpu
@pytest.mark.parametrize("apart", [False, True])
@pytest.mark.parametrize("format_name", ["int8", "float8_e4m3fn"])
def test_the_compiled_paged_form_on_a_gpu_gives_the_dense_forms_attention(format_name, apart):
    """The paged form compiled over 8B-shaped pages: each row's pages (a shuffled table) attended as the XLA form
    attends the same positions laid out in order (within bfloat16's rounding, as the dense kernel is), and within a
    few bfloat16 steps of the dense kernel (which visits the positions in other blocks, so its float16 sums round
    apart: up to 4 steps of 2^-9 near 0.4 on the H200)."""
    q, k8, v8, k_scale, v_scale, lengths = operands(format_name, 8, 1024, kv_heads=8, head_dim=128)
    page = 16
    table = jax.random.permutation(jax.random.key(1), 8 * 1024 // page).reshape(8, 1024 // page).astype(jnp.int32)
    pools = []
    for rows in (k8, v8, k_scale, v_scale):  # row b's positions p*16 .. p*16 + 15 stored at page table[b, p]
        paged_rows = rows.reshape(8 * 1024 // page, page, *rows.shape[2:])
        pools.append(jnp.zeros_like(paged_rows).at[table.reshape(-1)].set(paged_rows))
    ptx = policy_of(jax.devices()[0]).inline_ptx
    got = jax.jit(functools.partial(paged_decode_attention, ptx=ptx, tiling=Tiling(pages_apart=apart)))(
        q, *pools, table, lengths)
    dense = jax.jit(functools.partial(decode_attention, ptx=ptx))(q, k8, v8, k_scale, v_scale, lengths)
    expected = jax.jit(ops._decode_over_8_bit_cache)(q, k8, v8, k_scale, v_scale, (lengths - 1)[:, None])
    got, dense, expected = (np.asarray(x, np.float32) for x in (got, dense, expected))
    np.testing.assert_allclose(got, expected, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(got, dense, rtol=0, atol=1.6e-2)
