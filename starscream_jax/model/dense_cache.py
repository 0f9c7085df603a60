"""The dense KV cache that training's prefill and static decode write and read: its entries ({"k", "v"} of
[L, B, T, K, E], an 8-bit cache's scales beside them: `cache_entries`), created and placed by the active layout
(`init_cache`, `cache_shardings`), written in place at a position (`write_cache`; split by position over the
`cache_seq` axes where the layout splits it), held as one array per layer (`split_cache`), and the bound a write
must keep (`cache_room`). The paged cache the server reads is `paged`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from ..errors import StarscreamError
from ..hardware.axes import dim_axes
from ..sharding.apply import activation_spec, constrain, placed_as, use_layout
from ..sharding.collectives import hierarchical_all_gather
from ..sharding.layouts import Layout
from .config import ModelConfig
from .names import CACHE, KV_CACHE, KV_CACHE_SCALE
from .quantize import quantize_cache_entry


def held_per_layer(cache: dict | None) -> bool:
    """Whether a KV cache is held as one array per layer ([B, T, K, E] each, `split_cache`) rather than stacked
    (False for no cache)."""
    return cache is not None and isinstance(cache["k"], (list, tuple))


def split_cache(cache: dict) -> dict:
    """A stacked KV cache ({"k", "v"}: [L, B, T, K, E] each, and an 8-bit cache's scales [L, B, T, K]) as one
    array per layer: L arrays of [B, T, K, E] (or [B, T, K]) each (copies; call once, as generation does before its
    decode loop)."""
    return {name: tuple(constrain(layer, CACHE_NAMES[name][1:], "kv cache") for layer in stacked)
            for name, stacked in cache.items()}


def cache_room(cache: dict, cache_index, new_tokens: int) -> jax.Array | None:
    """Whether a write of `new_tokens` at `cache_index` ends inside the cache's T positions (XLA would clamp it onto
    the last slots). An index known at trace time is checked at once (StarscreamError; returns None). A traced one
    (decode inside jit) cannot be: the result is a traced bool, False for a write that would not fit, with which
    the model makes every logit NaN, so that the clamped write is seen by whoever reads the step's output (the
    generation loop bounds the index itself)."""
    length = cache["k"][0].shape[1] if held_per_layer(cache) else cache["k"].shape[2]
    index = None if isinstance(cache_index, jax.core.Tracer) else int(cache_index)
    if new_tokens > length or (index is not None and not 0 <= index <= length - new_tokens):
        at = "" if index is None else f" at position {index}"
        raise StarscreamError(f"cannot write {new_tokens} token(s){at} into a KV cache of {length} positions; "
                              f"make the cache longer (init_cache max_len) or stop generating at position {length}")
    if index is not None:
        return None
    return (cache_index >= 0) & (cache_index <= length - new_tokens)


CACHE_NAMES = {"k": KV_CACHE, "v": KV_CACHE, "k_scale": KV_CACHE_SCALE, "v_scale": KV_CACHE_SCALE}
"""The logical names of each entry of a stacked KV cache (one layer's: without the leading `layers`)."""


def write_cache(cache: dict, layer, index, k_BSKE: jax.Array, v_BSKE: jax.Array) -> dict:
    """The KV cache {"k", "v"} ([L, B, T, K, E] each) with the S new keys and values of `layer` written at positions
    index .. index + S - 1: a dynamic-update-slice of S positions, which XLA runs in place on a donated cache. With
    `layer` None, `cache` is one layer's ([B, T, K, E] each). Where the layout splits the cache's positions
    (`cache_seq`), each device writes the new positions it owns into its own slots (`_write_owned`). An 8-bit cache
    (with "k_scale" and "v_scale", [L, B, T, K] each) gets the new keys and values in its format with their scales
    (`quantize_cache_entry`), the scales written where their positions are."""
    one_layer = layer is None
    new = {"k": k_BSKE, "v": v_BSKE}
    if "k_scale" in cache:
        for name in ("k", "v"):
            new[name], new[name + "_scale"] = quantize_cache_entry(new[name], cache[name].dtype.name)
    if cache_split_axes(cache["k"].shape[-4:]):
        return {name: _write_owned(cache[name], layer, index, entry, CACHE_NAMES[name]) for name, entry in new.items()}

    def write(name, new_entry):
        # both placed by the cache's rules (no-ops inside the model, where they already are)
        names = CACHE_NAMES[name][1:] if one_layer else CACHE_NAMES[name]
        start = (0, index) + (0,) * (new_entry.ndim - 2)
        placed = new_entry.astype(cache[name].dtype) if one_layer else new_entry[None].astype(cache[name].dtype)
        return jax.lax.dynamic_update_slice(constrain(cache[name], names, "kv cache"),
                                            constrain(placed, names, "new keys and values"),
                                            start if one_layer else (layer, *start))

    return {name: write(name, new_entry) for name, new_entry in new.items()}


def cache_split_axes(shape_BTKE: tuple[int, ...]) -> tuple[str, ...]:
    """The mesh axes the active layout splits a cache's positions over (`cache_seq`; () outside a layout)."""
    spec = activation_spec(CACHE, shape_BTKE, "kv cache")
    return () if spec is None else dim_axes(spec, 1)


def _write_owned(full: jax.Array, layer, index, new_BS: jax.Array, stacked_names: tuple[str, ...]) -> jax.Array:
    """`write_cache` of one entry (full: [L, B, T, ...] named `stacked_names`, or [B, T, ...] with `layer` None; the
    new positions [B, S, ...]) whose positions are split over the `cache_seq` axes: each device keeps the new
    positions index + s it owns (names.CACHE: those congruent to its index modulo the number of parts) and scatters
    them into its slots; the others are dropped. New entries split over the sequence (prefill under a sequence
    split) are first gathered over its axes, inside the GPU first (attention gathers the same keys). A scatter
    into the donated cache, in place."""
    names = stacked_names[1:] if layer is None else stacked_names
    cache_spec = activation_spec(names, full.shape, "kv cache")
    new_names = tuple("seq" if name == "cache_seq" else name for name in stacked_names[1:])
    new_spec = activation_spec(new_names, new_BS.shape, "new keys and values")
    cache_axes = dim_axes(cache_spec, names.index("cache_seq"))
    seq_axes = dim_axes(new_spec, 1)
    stacked = layer is not None
    layer = layer if stacked else jnp.int32(0)

    def local(cache, new, layer, index):
        new = hierarchical_all_gather(new, seq_axes, dimension=1).astype(cache.dtype)
        parts, mine = jax.lax.axis_size(cache_axes), jax.lax.axis_index(cache_axes)
        positions_S = index + jnp.arange(new.shape[1])
        past_the_end = cache.shape[int(stacked) + 1]  # the slot of a position another device owns: dropped
        slots_S = jnp.where(positions_S % parts == mine, positions_S // parts, past_the_end)
        if not stacked:
            return cache.at[:, slots_S].set(new, mode="drop")
        return cache.at[layer, :, slots_S].set(jnp.swapaxes(new, 0, 1), mode="drop")

    write = jax.shard_map(local, in_specs=(cache_spec, new_spec, PartitionSpec(), PartitionSpec()),
                          out_specs=cache_spec)
    return write(placed_as(full, cache_spec), placed_as(new_BS, new_spec), layer, jnp.asarray(index, jnp.int32))


def cache_entries(config: ModelConfig, batch: int, length: int) -> dict[str, jax.ShapeDtypeStruct]:
    """Each entry of a stacked KV cache of `length` positions: "k" and "v" [L, B, T, K, E] in the compute dtype, or
    in `config.kv_format` with "k_scale" and "v_scale" [L, B, T, K] float32 beside them (names: CACHE_NAMES)."""
    L, K, E = config.n_layers, config.n_kv_heads, config.head_dim
    entries = dict.fromkeys(("k", "v"), jax.ShapeDtypeStruct((L, batch, length, K, E),
                                                            jnp.dtype(config.kv_format or config.dtype)))
    if config.kv_format:
        entries.update(dict.fromkeys(("k_scale", "v_scale"), jax.ShapeDtypeStruct((L, batch, length, K), jnp.float32)))
    return entries


def init_cache(config: ModelConfig, batch: int, max_len: int) -> dict:
    """An empty KV cache (`cache_entries`), placed by the active layout (kv heads over gpu and batch over xcd under
    the starscream layouts)."""
    return {name: constrain(jnp.zeros(entry.shape, entry.dtype), CACHE_NAMES[name], "kv cache")
            for name, entry in cache_entries(config, batch, max_len).items()}


def cache_shardings(config: ModelConfig, batch: int, length: int, layout: Layout | str, mesh,
                    per_layer: bool = False) -> dict:
    """The NamedSharding `layout` gives each entry of a KV cache (`cache_entries`: [L, B, T, K, E], T = `length`) on
    `mesh`, or with `per_layer` one layer's array of it ([B, T, K, E]) as `split_cache` places it."""
    specs = {}
    with use_layout(layout, mesh):
        for name, entry in cache_entries(config, batch, length).items():
            names, shape = (CACHE_NAMES[name][1:], entry.shape[1:]) if per_layer else (CACHE_NAMES[name], entry.shape)
            specs[name] = NamedSharding(mesh, activation_spec(names, shape, "kv cache"))
    return specs
