"""The projections: one-row projections padded only where XLA:GPU would reduce them, and decode's projections by 8-bit
weights on the weight-only kernel (one launch for those sharing an input) where the policy or the configuration asks
for it and every operand is whole on each device."""
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from starscream_jax.hardware.backend import CUDA
from starscream_jax.hardware.mesh import build_mesh
from starscream_jax.model.catalog import load_model_config
from starscream_jax.model.decoder import Transformer, create_sharded_model
from starscream_jax.model.dense_cache import init_cache
from starscream_jax.sharding.apply import UNPLACED, use_layout


def test_only_projections_xla_would_reduce_are_padded_and_only_on_cuda(monkeypatch):
    """Under the CUDA policy, Llama 3 8B at batch 1: k and v (4096 x 1024 weights) are padded, q (4096 x 4096) is
    not, nor any at batch 2; under the portable policy (CPU, ROCm) none is."""
    from starscream_jax.model import projections

    def padded(batch: int, weight_shape) -> bool:
        return projections._padded_rows(UNPLACED, jax.ShapeDtypeStruct((batch, 1, 4096), jnp.bfloat16),
                                        jax.ShapeDtypeStruct(weight_shape, jnp.bfloat16)) > 1

    assert not padded(1, (4096, 8, 128))  # this machine's devices run the portable policy
    monkeypatch.setattr(projections, "policy_of", lambda device: CUDA)
    assert padded(1, (4096, 8, 128)) and not padded(1, (4096, 32, 128)) and not padded(2, (4096, 8, 128))


def _eight_bit_decode(format_name: str, implementation: str, mesh=None, layout=None, batch: int = 3):
    """(pallas calls traced, logits [batch, 1, V]) of one decode step of the 2-layer tiny model with 8-bit weights at
    cache position 3, its projections run as `implementation` says (ModelConfig.eight_bit_matmul)."""
    config = load_model_config("tiny").replace(n_layers=2, dtype="bfloat16", weight_format=format_name,
                                               eight_bit_matmul=implementation)
    with contextlib.ExitStack() as stack:
        if layout:
            stack.enter_context(use_layout(layout, mesh))
            model = create_sharded_model(config, layout, mesh)
        else:
            model = Transformer(config, rngs=nnx.Rngs(0))
        graphdef, params = nnx.split(model)
        tokens_B1 = (jnp.arange(batch, dtype=jnp.int32)[:, None] * 67 + 5) % config.vocab_size

        def step(params, cache):
            return nnx.merge(graphdef, params)(tokens_B1, cache=cache, cache_index=3).logits

        cache = init_cache(config, batch, 8)
        traced = str(jax.make_jaxpr(step)(params, cache)).count("pallas_call")
        return traced, jax.jit(step)(params, cache)


@pytest.mark.parametrize("format_name", ["int8", pytest.param("float8_e4m3fn", marks=pytest.mark.slow)])
# (fp8 weights' numerics on the kernel: tests/model/test_weight_only.py; int8 keeps the claim that decode runs it)
def test_decode_projections_by_8_bit_weights_run_on_the_weight_only_kernel(format_name):
    """ModelConfig.eight_bit_matmul "interpret": each layer's 7 projections (q, k, v, o, gate, up, down) run on the
    weight-only kernel (interpreted) in 4 launches (q, k and v in one, o, gate and up in one, down), unsharded and
    under starscream_decode on one device, and the logits are the XLA path's to bfloat16's rounding of the
    projections; "xla" runs none."""
    plain_calls, expected = _eight_bit_decode(format_name, "xla")
    calls, got = _eight_bit_decode(format_name, "interpret")
    placed_calls, placed = _eight_bit_decode(format_name, "interpret", build_mesh("1x1"), "starscream_decode")
    # 4 pallas_calls per layer (a layer's body, the same for both, may be printed once)
    assert plain_calls == 0 and calls in (4, 8) and placed_calls in (4, 8)
    scale = float(jnp.max(jnp.abs(expected)))
    for logits in (got, placed):
        np.testing.assert_allclose(np.asarray(logits), np.asarray(expected), atol=0.02 * scale)
    assert float(jnp.max(jnp.abs(got - expected))) > 0  # the two paths round differently: both really ran


def test_the_weight_only_kernel_is_cudas_default_and_split_weights_keep_xlas_path(monkeypatch):
    """eight_bit_matmul "" takes the backend policy's choice: the kernel under CUDA's, the projections that share an
    input in one launch (q, k, v; o; gate, up; down: 4 per layer; traced only: no GPU here),
    XLA's matmul under the portable policy (CPU, ROCm); weights split over the mesh (starscream_decode on 2 GPUs x 4
    partitions) run XLA's path, whose placement rules hold the collectives."""
    from starscream_jax.model import projections

    assert _eight_bit_decode("int8", "")[0] == 0
    assert _eight_bit_decode("int8", "interpret", build_mesh("2x4"), "starscream_decode", batch=8)[0] == 0
    monkeypatch.setattr(projections, "policy_of", lambda device: CUDA)
    config = load_model_config("tiny").replace(n_layers=1, dtype="bfloat16", weight_format="int8")
    graphdef, params = nnx.split(Transformer(config, rngs=nnx.Rngs(0)))
    jaxpr = jax.make_jaxpr(lambda p, c: nnx.merge(graphdef, p)(jnp.zeros((2, 1), jnp.int32), cache=c,
                                                             cache_index=3).logits)(params, init_cache(config, 2, 8))
    assert str(jaxpr).count("pallas_call") == 4 and "interpret=False" in str(jaxpr).replace(" ", "")
