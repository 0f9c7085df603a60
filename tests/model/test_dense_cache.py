"""The dense KV cache: placed by the layout."""
import jax

from starscream_jax.hardware.mesh import build_mesh
from starscream_jax.model.catalog import load_model_config
from starscream_jax.model.dense_cache import init_cache, split_cache
from starscream_jax.sharding.apply import use_layout

BATCH = 8


def test_kv_cache_is_placed_by_the_layout():
    mesh = build_mesh("2x4", data=1)
    config = load_model_config("tiny")
    with use_layout("starscream_decode", mesh):
        cache = jax.jit(lambda: init_cache(config, BATCH, 16))()
    assert cache.k.shape == (config.n_layers, BATCH, 16, config.n_kv_heads, config.head_dim)
    assert cache.k.sharding.spec == jax.sharding.PartitionSpec(None, ("data", "xcd"), None, "gpu", None)
    assert cache.v.sharding == cache.k.sharding and cache.k_scale is None


def test_a_cache_held_per_layer_gives_each_layer_its_own_arrays_and_takes_them_back():
    """`split_cache` keeps the fields and their length; `layer` gives a layer its own arrays ([B, T, K, E], an 8-bit
    cache's scales [B, T, K]), a stacked cache the stack with the layer's index; `with_layers` rebuilds the cache."""
    config = load_model_config("tiny").replace(kv_format="int8")
    stacked = init_cache(config, 2, 16)
    held = split_cache(stacked)
    assert held.held_per_layer and not stacked.held_per_layer and held.length == stacked.length == 16
    part = held.layer(1)
    assert part.layer is None and part.eight_bit and part.k.shape == (2, 16, config.n_kv_heads, config.head_dim)
    assert part.k_scale.shape == part.k.shape[:3]
    assert stacked.layer(1).layer == 1 and stacked.layer(1).read().k.shape == part.k.shape
    rebuilt = held.with_layers([held.layer(index) for index in range(config.n_layers)])
    assert jax.tree.structure(rebuilt) == jax.tree.structure(held)
    assert stacked.with_layers([stacked.layer(0)]).k is stacked.k
