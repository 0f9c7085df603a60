"""The dense KV cache: placed by the layout."""
import jax

from starscream_jax.hardware.mesh import build_mesh
from starscream_jax.model.catalog import load_model_config
from starscream_jax.model.dense_cache import init_cache
from starscream_jax.sharding.apply import use_layout

BATCH = 8


def test_kv_cache_is_placed_by_the_layout():
    mesh = build_mesh("2x4", data=1)
    config = load_model_config("tiny")
    with use_layout("starscream_decode", mesh):
        cache = jax.jit(lambda: init_cache(config, BATCH, 16))()
    assert cache["k"].shape == (config.n_layers, BATCH, 16, config.n_kv_heads, config.head_dim)
    assert cache["k"].sharding.spec == jax.sharding.PartitionSpec(None, ("data", "xcd"), None, "gpu", None)
    assert cache["v"].sharding == cache["k"].sharding
