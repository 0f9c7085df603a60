"""The typed layer weights: every LayerStack parameter is a field of the value the blocks read (none is dropped,
whatever the model's options), a stacked value splits into each layer's, weights held per layer as held, and
inference's copy with q/k/v and gate/up stacked computes what the model does, the model itself unchanged."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from starscream_jax.model.catalog import load_model_config
from starscream_jax.model.decoder import Transformer
from starscream_jax.hardware.mesh import build_mesh
from starscream_jax.model.decoder import abstract_model
from starscream_jax.model.layer_weights import (AttentionWeights, DenseMlpWeights, LayerWeights, RoutedMlpWeights,
                                                any_held_per_layer, inference_split, layer_weights,
                                                split_layer_weights, stack_projections, unstacked)
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


def layer_parameters(model) -> dict[str, jax.Array]:
    return {path_name(path): variable.get_value()
            for path, variable in nnx.to_flat_state(nnx.state(model.layers, nnx.Param))}


@pytest.mark.parametrize("changes", [{}, dict(weight_format="int8"),
                                     dict(weight_format="float8_e4m3fn", weight_scales="tensor", qkv_bias=True)],
                         ids=["float", "int8 per channel", "fp8 per tensor"])
def test_stacked_projections_compute_the_models_logits_and_leave_the_model_as_it_was(changes):
    config = load_model_config("tiny", **changes)
    model = Transformer(config, rngs=nnx.Rngs(0))
    before = layer_parameters(model)
    stacked = stack_projections(model)
    kept = layer_parameters(stacked)
    assert layer_parameters(model).keys() == before.keys()  # the model keeps its own weights
    assert not {"wq", "wk", "wv", "w_gate", "w_up"} & kept.keys() and {"wqkv", "w_gate_up"} <= kept.keys()
    L, D, H, K, E, F = (config.n_layers, config.d_model, config.n_heads, config.n_kv_heads, config.head_dim,
                        config.d_ff)
    G = H // K
    assert kept["wqkv"].shape == (L, D, K, G + 2, E) and kept["w_gate_up"].shape == (L, D, 2, F)
    # kv head k's G query heads, then its key, then its value
    np.testing.assert_array_equal(kept["wqkv"][:, :, 1, :G], before["wq"][:, :, G:2 * G])
    np.testing.assert_array_equal(kept["wqkv"][:, :, 1, G + 1], before["wv"][:, :, 1])
    np.testing.assert_array_equal(kept["w_gate_up"][:, :, 1], before["w_up"])
    if config.weight_format:  # scales per output channel, a per-tensor one spread over its channels
        assert kept["wqkv_scale"].shape == (L, K, G + 2, E) and kept["w_gate_up_scale"].shape == (L, 2, F)
        np.testing.assert_array_equal(kept["w_gate_up_scale"][:, 0],
                                      np.broadcast_to(np.reshape(before["w_gate_scale"], (L, -1)), (L, F)))
    tokens = jnp.arange(24).reshape(2, 12) % config.vocab_size
    np.testing.assert_allclose(stacked(tokens)[0], model(tokens)[0], atol=2e-5)
    # as inference reads them: every field of the typed weights is a parameter, none dropped
    weights = layer_weights(config, stacked.layers)
    assert weights.attention.wq is None and weights.mlp.w_gate is None
    assert field_names(weights) - {"window"} == kept.keys()


def test_stacking_keeps_what_cannot_be_stacked_apart():
    moe = load_model_config("tiny-moe")
    kept = layer_parameters(stack_projections(Transformer(moe, rngs=nnx.Rngs(0))))
    assert "wqkv" in kept and {"w_gate", "w_up"} <= kept.keys()  # the experts run their own grouped matmuls
    unfused = load_model_config("tiny", fuse_projections=False)
    assert {"wq", "w_gate"} <= layer_parameters(stack_projections(Transformer(unfused, rngs=nnx.Rngs(0)))).keys()
    # weights held per layer (as an engine over several devices holds 8-bit ones) stay so
    config = load_model_config("tiny", weight_format="int8")
    graphdef, params, rest = nnx.split(Transformer(config, rngs=nnx.Rngs(0)), nnx.Param, ...)
    held = layer_parameters(stack_projections(nnx.merge(graphdef, split_layer_weights(params), rest)))
    assert isinstance(held["wq"], tuple) and "wqkv" not in held
    # over several devices a layout splits each projection and places each output by its own rule
    several = layer_parameters(stack_projections(Transformer(load_model_config("tiny"), rngs=nnx.Rngs(0)),
                                                 build_mesh("2x4")))
    assert {"wq", "wk", "wv", "w_gate", "w_up"} <= several.keys() and "wqkv" not in several


def test_inference_split_of_an_abstract_model_holds_the_stacked_shapes():
    config = load_model_config("tiny", weight_format="int8")
    _, params, _ = inference_split(abstract_model(config))
    layers = params["layers"]
    assert isinstance(layers["wqkv"].get_value(), jax.ShapeDtypeStruct)
    assert layers["wqkv"].get_value().dtype == jnp.int8 and layers["wqkv_scale"].get_value().dtype == jnp.float32
    assert layers["w_gate_up"].get_value().shape == (config.n_layers, config.d_model, 2, config.d_ff)
