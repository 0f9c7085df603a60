"""The few-rows matmul of decode's projections (its Pallas kernel in interpret mode, compiled on a GPU, and XLA's)
against a float32 matmul, forward and gradients; its block plan; and the decode step's projections through it,
unsharded and under every layout that keeps sequences whole, against the same step through XLA's GEMMs."""
import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from starscream_jax.errors import StarscreamError
from starscream_jax.model import few_rows
from starscream_jax.model.config import load_model_config
from starscream_jax.model.decoder import Transformer, init_cache
from starscream_jax.model.few_rows import Blocks, few_rows_matmul, plan
from starscream_jax.sharding.apply import param_shardings, use_layout
from starscream_jax.sharding.layouts import EXPERT_LAYOUTS, LAYOUTS
from tests.model.test_decoder import FAST_COMPILE, FP32_TOLERANCE, mesh_of

pytestmark = pytest.mark.filterwarnings(  # a Pallas API on its way out fails here first; the Triton backend's own
    "error:(?!The Pallas Triton backend is deprecated):DeprecationWarning")  # notice (JAX 0.11) is the README's

SPLIT = Blocks(cols=32, depth=16, programs=8)
"""Blocks that loop over depth and split the contraction: on 64 x 96 weights, 3 column blocks x 2 slices of 2 steps
of 16 rows."""


def inputs(rows: int, depth: int = 64, cols: int = 96, seed: int = 0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(rows, depth)).astype(np.float32), rng.normal(size=(depth, cols)).astype(np.float32),
            rng.normal(size=(rows, cols)).astype(np.float32))


def output_and_grads(matmul, x_MK, w_KN, cotangent_MN):
    out, pullback = jax.vjp(matmul, x_MK, w_KN)
    return out, pullback(cotangent_MN.astype(out.dtype))


@pytest.mark.parametrize("implementation", ["interpret", "xla"])
@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("blocks", [Blocks(), SPLIT], ids=["default", "split"])
def test_few_rows_matmul_equals_a_float32_matmul(implementation, rows, blocks):
    x_MK, w_KN, cotangent_MN = inputs(rows)
    matmul = functools.partial(lambda x, w: few_rows_matmul(x, w, implementation, blocks))
    got = jax.jit(functools.partial(output_and_grads, matmul))(x_MK, w_KN, cotangent_MN)
    expected = output_and_grads(lambda x, w: x @ w, x_MK, w_KN, cotangent_MN)
    for actual, reference in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(actual), np.asarray(reference), rtol=1e-5, atol=1e-4)


def test_the_plan_splits_the_contraction_until_the_programs_fill_the_device():
    """Llama 3 8B's decode weights under the default blocks (128 x 128, 264 programs): k and v (8 column blocks),
    q and o (32) and down (32 blocks of 14336 rows) split 16 ways, up (112 blocks) 4 ways (448 programs; 2 ways
    would leave 224); SPLIT on the test's weights: 2."""
    assert plan(4096, 1024) == (128, 128, 16)
    assert plan(4096, 4096) == (128, 128, 16)
    assert plan(4096, 14336) == (128, 128, 4)
    assert plan(14336, 4096) == (128, 128, 16)
    assert plan(64, 96, SPLIT) == (16, 32, 2)
    assert plan(48, 80) == (16, 16, 1)


@pytest.mark.parametrize("shapes", [((17, 64), (64, 96)), ((4, 64), (32, 96)), ((4, 64, 1), (64, 96)),
                                    ((4, 40), (40, 96))])
def test_bad_operands_are_one_clear_error(shapes):
    x_shape, w_shape = shapes
    with pytest.raises(StarscreamError, match="few-rows matmul of"):
        few_rows_matmul(jnp.ones(x_shape), jnp.ones(w_shape), "interpret")


def test_an_unknown_implementation_is_one_clear_error():
    with pytest.raises(StarscreamError, match="implementation 'cuda' is unknown; use one of pallas, interpret, xla"):
        few_rows_matmul(jnp.ones((1, 64)), jnp.ones((64, 96)), "cuda")
    with pytest.raises(StarscreamError, match="implementation 'cuda' is unknown"):
        with few_rows.use_implementation("cuda"):
            pass


def test_the_default_is_xla_off_nvidia_gpus():
    assert few_rows.implementation() == "xla"
    with few_rows.use_implementation("interpret"):
        assert few_rows.implementation() == "interpret"
    assert few_rows.implementation() == "xla"


DECODE_CASES = [("1x1x1", None, 1)] + [("1x2x4", name, 8) for name, layout in LAYOUTS.items()
                                        if not layout.splits_sequence and name not in EXPERT_LAYOUTS]


@pytest.mark.parametrize("mesh_name, layout, batch", DECODE_CASES)
def test_decode_projections_through_the_kernel_compute_the_same_logits(mesh_name, layout, batch, monkeypatch):
    """One decode step of the tiny model with the projections through the kernel (interpret mode) against the same
    step through XLA's GEMMs; unsharded every projection goes through the kernel, under a layout those whose
    product is local and placed as the layout wants (the rest stay XLA's einsums, with their collectives)."""
    config = load_model_config("tiny")
    graphdef, params = nnx.split(Transformer(config, rngs=nnx.Rngs(0)))
    tokens_B1 = (np.arange(batch, dtype=np.int32) * 7)[:, None]
    mesh = mesh_of(mesh_name)
    calls = []
    kernel = few_rows.few_rows_matmul
    monkeypatch.setattr(few_rows, "few_rows_matmul", lambda *a, **k: calls.append(a[1].shape) or kernel(*a, **k))

    def decode(implementation: str):
        with contextlib.ExitStack() as stack:
            placed = params
            if layout:
                placed = jax.device_put(params, param_shardings(params, layout, mesh))
                stack.enter_context(use_layout(layout, mesh))
            stack.enter_context(few_rows.use_implementation(implementation))
            step = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t, cache=init_cache(config, batch, 4),
                                                                 cache_index=2)[0], compiler_options=FAST_COMPILE)
            return np.asarray(step(placed, tokens_B1))

    through_kernel = decode("interpret")
    # starscream_decode splits every weight over two axes (one the contracted side), so none of its products is local
    assert len(calls) >= 7 if layout is None else (len(calls) > 0) == (layout != "starscream_decode")
    traced = len(calls)
    np.testing.assert_allclose(through_kernel, decode("xla"), atol=FP32_TOLERANCE)
    assert len(calls) == traced  # "xla" never calls the kernel


def test_projections_of_many_rows_or_many_positions_stay_xla_gemms(monkeypatch):
    """Batch 17 (more rows than the kernel takes) and a prefill of 2 positions: no projection calls the kernel."""
    config = load_model_config("tiny")
    model = Transformer(config, rngs=nnx.Rngs(0))
    calls = []
    monkeypatch.setattr(few_rows, "few_rows_matmul", lambda *a, **k: calls.append(a) or a[0] @ a[1])
    with few_rows.use_implementation("interpret"):
        jax.eval_shape(lambda t: model(t, cache=init_cache(config, 17, 4), cache_index=2), np.zeros((17, 1), np.int32))
        jax.eval_shape(lambda t: model(t, cache=init_cache(config, 2, 4), cache_index=0), np.zeros((2, 2), np.int32))
    assert calls == []


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8])
def test_the_kernel_on_a_gpu_equals_a_float32_matmul(rows):
    """The compiled Triton kernel (bfloat16 in, float32 sums) on Llama 3 8B's k shape and a split one: relative
    error against the float32 product of the same bfloat16 values."""
    for blocks, (depth, cols) in ((Blocks(), (4096, 1024)), (SPLIT, (64, 96))):
        x_MK, w_KN, _ = inputs(rows, depth, cols, seed=1)
        x_MK, w_KN = jnp.asarray(x_MK, jnp.bfloat16), jnp.asarray(w_KN, jnp.bfloat16)
        got = np.asarray(jax.jit(lambda x, w: few_rows_matmul(x, w, "pallas", blocks))(x_MK, w_KN), np.float32)
        reference = np.asarray(x_MK, np.float32) @ np.asarray(w_KN, np.float32)
        assert np.linalg.norm(got - reference) <= 1e-2 * np.linalg.norm(reference)


@pytest.mark.parametrize("layout", ["starscream_decode", "starscream_tp"])
def test_on_one_device_every_projection_goes_through_the_kernel(layout, monkeypatch):
    """A one-device mesh (the layouts' axes of size 1 split nothing): all 7 projections of a layer are local."""
    config = load_model_config("tiny")
    model = Transformer(config, rngs=nnx.Rngs(0))
    calls = []
    monkeypatch.setattr(few_rows, "few_rows_matmul", lambda *a, **k: calls.append(a[1].shape) or a[0] @ a[1])
    mesh = mesh_of("1x1x1")
    with use_layout(layout, mesh), few_rows.use_implementation("interpret"):
        jax.eval_shape(lambda t: model(t, cache=init_cache(config, 1, 4), cache_index=2), np.zeros((1, 1), np.int32))
    assert len(calls) % 7 == 0 and len(calls) >= 7
