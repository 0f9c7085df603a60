"""The typed layer weights: every LayerStack parameter is a field of the value the blocks read (none is dropped,
whatever the model's options), and a stacked value splits into each layer's, weights held per layer as held."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from starscream_jax.model.catalog import load_model_config
from starscream_jax.model.decoder import Transformer
from starscream_jax.model.layer_weights import (AttentionWeights, DenseMlpWeights, LayerWeights, RoutedMlpWeights,
                                                any_held_per_layer, layer_weights, split_layer_weights, unstacked)
from starscream_jax.sharding.apply import path_name

OPTIONS = {"plain": ("tiny", {}),
           "every option": ("tiny", dict(qkv_bias=True, qk_norm=True, post_norms=True, sliding_window=4,
                                         sliding_layers=(0,), weight_format="int8")),
           "experts": ("tiny-moe", dict(weight_format="int8", weight_scales="tensor"))}


def field_names(weights: LayerWeights) -> set[str]:
    """The names of the fields of `weights` (and of its parts) that hold an array."""
    paths = jax.tree_util.tree_flatten_with_path(weights)[0]
    return {path[-1].name for path, _ in paths}


@pytest.mark.parametrize("option", OPTIONS)
def test_every_layer_parameter_is_a_field_the_blocks_read(option):
    model_name, changes = OPTIONS[option]
    config = load_model_config(model_name, **changes)
    model = Transformer(config, rngs=nnx.Rngs(0))
    parameters = {path_name(path) for path, _ in nnx.to_flat_state(nnx.state(model.layers, nnx.Param))}
    weights = layer_weights(config, model.layers)
    assert isinstance(weights.attention, AttentionWeights)
    assert isinstance(weights.mlp, RoutedMlpWeights if config.n_experts else DenseMlpWeights)
    assert field_names(weights) - {"window"} == parameters
    assert (weights.window is not None) == bool(config.sliding_window)


def test_unstacked_splits_the_stack_and_keeps_weights_held_per_layer():
    config = load_model_config("tiny", n_layers=3, weight_format="int8", dtype="bfloat16")
    graphdef, params, rest = nnx.split(Transformer(config, rngs=nnx.Rngs(0)), nnx.Param, ...)
    stacked = layer_weights(config, nnx.merge(graphdef, params, rest).layers)
    held = layer_weights(config, nnx.merge(graphdef, split_layer_weights(params), rest).layers)
    assert not any_held_per_layer(stacked) and any_held_per_layer(held)
    assert isinstance(held.attention.wq, tuple) and held.attention.wq_scale.shape[0] == 3
    for layer, (from_stack, from_held) in enumerate(zip(unstacked(stacked, 3), unstacked(held, 3))):
        assert jax.tree.structure(from_stack) == jax.tree.structure(from_held)
        for got, expected in zip(jax.tree.leaves(from_held), jax.tree.leaves(from_stack)):
            np.testing.assert_array_equal(got, expected)
        np.testing.assert_array_equal(from_stack.mlp.w_down, params["layers"]["w_down"].get_value()[layer])
        assert from_stack.attention.wq.dtype == jnp.int8 and from_stack.attn_norm.dtype == jnp.float32
