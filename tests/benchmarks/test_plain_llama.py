"""The plain JAX Llama the benchmarks run beside the library computes what the library's model computes on the same
parameters: its loss (unsharded and with plain tensor or fully sharded data parallelism) and its greedy decode."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding

from starscream_jax.benchmarks.plain_llama import (PLAIN_AXIS, plain_cache, plain_decode_step, plain_decode_weights,
                                                   plain_differences, plain_loss, plain_param_specs)
from starscream_jax.inference.generate import generate
from starscream_jax.model.catalog import load_model_config
from starscream_jax.model.decoder import Transformer, next_token_loss


def small(model: str):
    """`model`'s structure (llama3.2-1b: tied embeddings; tiny: a separate lm_head) at a tiny size, float32."""
    config = load_model_config(model, dtype="float32")
    return config.replace(vocab_size=256, d_model=64, n_layers=2, d_ff=128, n_heads=4, n_kv_heads=2, head_dim=16)


@pytest.mark.parametrize("model", ["tiny", "llama3.2-1b"])
def test_plain_loss_equals_the_library_model_on_its_parameters(model):
    config = small(model)
    library_model = Transformer(config, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, config.vocab_size)
    params = nnx.to_pure_dict(nnx.state(library_model, nnx.Param))
    expected = float(jax.jit(next_token_loss)(library_model, tokens))
    plain = jax.jit(plain_loss, static_argnums=(2, 3))(params, tokens, config, None)
    assert float(plain) == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("parallelism", ["tp", "fsdp"])
def test_plain_baselines_with_sharding_annotations_compute_the_unsharded_loss(parallelism):
    """The plain tensor-parallel and FSDP steps place their parameters and activations by ordinary annotations; on
    two devices their loss is the unsharded one."""
    config = load_model_config("tiny", dtype="float32").replace(n_layers=2)
    params = nnx.to_pure_dict(nnx.state(Transformer(config, rngs=nnx.Rngs(0)), nnx.Param))
    tokens = jax.random.randint(jax.random.key(1), (4, 17), 0, config.vocab_size)
    expected = jax.jit(plain_loss, static_argnums=(2, 3))(params, tokens, config, None)
    mesh = Mesh(np.asarray(jax.devices()[:2]), (PLAIN_AXIS,), axis_types=(AxisType.Auto,))
    specs = plain_param_specs(params, parallelism)
    placed = jax.tree.map(lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec)), params, specs)
    assert PLAIN_AXIS in placed["layers"]["wq"].sharding.spec
    with jax.set_mesh(mesh):
        loss = jax.jit(plain_loss, static_argnums=(2, 3, 4))(placed, tokens, config, None, parallelism)
    assert float(loss) == pytest.approx(float(expected), rel=1e-5)


@pytest.mark.parametrize("model", ["tiny", "llama3.2-1b"])
def test_plain_decode_continues_a_prompt_with_the_library_models_greedy_tokens(model):
    """The plain decode step, fed a prompt token by token (each step writing its keys and values in place), then its
    own tokens, gives the tokens the library's `generate` gives on the same parameters."""
    config = small(model)
    library_model = Transformer(config, rngs=nnx.Rngs(0))
    prompt = np.asarray(jax.random.randint(jax.random.key(2), (3, 5), 0, config.vocab_size))
    expected = generate(library_model, prompt, 6).tokens
    weights = plain_decode_weights(nnx.to_pure_dict(nnx.state(library_model, nnx.Param)), jnp.float32)
    step, cache = plain_decode_step(config, None), plain_cache(config, 3, 16)
    produced = []
    for position in range(5 + 6 - 1):
        token = jnp.asarray(prompt[:, position] if position < 5 else produced[-1], jnp.int32)
        next_token, cache = step(weights, cache, token, jnp.int32(position))
        if position >= 4:
            produced.append(next_token)
    np.testing.assert_array_equal(np.stack(produced, axis=1), expected)


def test_the_options_the_plain_llama_does_not_compute_are_named():
    assert plain_differences(load_model_config("llama3-8b")) == []
    assert plain_differences(load_model_config("qwen2.5-72b")) == ["qkv_bias = True"]
    assert "sliding_window = 4096" in plain_differences(load_model_config("gemma2-27b"))
    assert plain_differences(load_model_config("tiny-moe"))[0].startswith("n_experts = ")
