"""The dense KV cache that training's prefill and static decode write and read, typed as the decoder reads it
(`DenseCache`, one layer's part `DenseLayer`): keys and values [L, B, T, K, E] (an 8-bit cache's scales beside them),
stacked or held as one array per layer (`split_cache`); created and placed by the active layout (`cache_entries`,
`init_cache`, `cache_shardings`), written in place at a position (`write_cache`; split by position over the
`cache_seq` axes where the layout splits it), and the bound a write must keep (`cache_room`). The paged cache the
server reads is `paged`.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec
from jax.tree_util import register_dataclass

from ..errors import StarscreamError
from ..hardware.axes import dim_axes
from ..sharding.apply import Placement, placed_by
from ..sharding.collectives import hierarchical_all_gather
from ..sharding.layouts import Layout
from .config import ModelConfig
from .names import CACHE, KV_CACHE, KV_CACHE_SCALE
from .ops import AttentionOptions, attention
from .quantize import quantize_cache_entry

CACHE_NAMES = {"k": KV_CACHE, "v": KV_CACHE, "k_scale": KV_CACHE_SCALE, "v_scale": KV_CACHE_SCALE}
"""The logical names of each field of a stacked KV cache (one layer's: without the leading `layers`)."""


@register_dataclass
@dataclass(frozen=True, kw_only=True)
class DenseCache:
    """The dense KV cache of every layer. Stacked, each field is one array with the layers leading; held per layer
    (`split_cache`: each layer's attention reads its own array in place, when the layers run without a loop), each
    is a tuple of L arrays of one layer's shape. An 8-bit cache (`ModelConfig.kv_format`) holds the keys and values
    in its format with float32 scales per position and kv head; a 16-bit one has no scales (None):

      k, v              [L, B, T, K, E]  layers, batch, cache_seq, kv_heads, head_dim   keys and values
      k_scale, v_scale  [L, B, T, K]     layers, batch, cache_seq, kv_heads             8-bit scales (names:
                                                                                        CACHE_NAMES)

    The same type holds the cache's ShapeDtypeStructs (`cache_entries`) and NamedShardings (`cache_shardings`)."""

    k: jax.Array | tuple[jax.Array, ...]
    v: jax.Array | tuple[jax.Array, ...]
    k_scale: jax.Array | tuple[jax.Array, ...] | None = None
    v_scale: jax.Array | tuple[jax.Array, ...] | None = None

    @property
    def held_per_layer(self) -> bool:
        """Whether each field is a tuple of L arrays ([B, T, K, E] each) rather than one stacked array."""
        return isinstance(self.k, tuple)

    @property
    def length(self) -> int:
        """T, the positions the cache holds."""
        return self.k[0].shape[1] if self.held_per_layer else self.k.shape[2]

    def entries(self) -> dict:
        """{field name: value} of the fields present (the scales only in an 8-bit cache)."""
        return _present(self)

    def layer(self, index) -> DenseLayer:
        """Layer `index`'s part as its block writes and reads it: its own arrays when held per layer (`index` an
        int), else the whole stack with the index (an int, or traced inside a layer loop)."""
        if self.held_per_layer:
            return DenseLayer(**{name: held[index] for name, held in self.entries().items()})
        return DenseLayer(**self.entries(), layer=index)

    def with_layers(self, layers: list[DenseLayer]) -> DenseCache:
        """The cache holding what `layers` (each layer's part, in order, after its block wrote it) hold: held per
        layer, each layer's own arrays; stacked, the stack the last of them wrote into (each block writes into the
        whole stack in place, so the last holds every layer's writes)."""
        if not self.held_per_layer:
            return DenseCache(**{name: getattr(layers[-1], name) for name in self.entries()})
        return DenseCache(**{name: tuple(getattr(layer, name) for layer in layers) for name in self.entries()})


@register_dataclass
@dataclass(frozen=True, kw_only=True)
class DenseLayer:
    """One layer's part of a `DenseCache` as its block writes (`write_cache`) and attention reads (`read`) it.
    With `layer` None the fields are this layer's own arrays; otherwise they are the whole stack and `layer` []
    int32 (traced inside a layer loop) is this layer's index in it, so that the write lands in the stack in place:

      k, v              [B, T, K, E] or [L, B, T, K, E]   keys and values
      k_scale, v_scale  [B, T, K] or [L, B, T, K]         an 8-bit cache's scales (None in a 16-bit one)"""

    k: jax.Array
    v: jax.Array
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None
    layer: jax.Array | int | None = None

    @property
    def eight_bit(self) -> bool:
        """Whether the keys and values are held in 8 bits with their scales."""
        return self.k_scale is not None

    def entries(self) -> dict:
        """{field name: array} of the cache's fields present (k, v and an 8-bit cache's scales; not `layer`)."""
        return _present(self)

    def read(self) -> DenseLayer:
        """This layer's own arrays ([B, T, K, E], scales [B, T, K]) as attention reads them: a slice of the stack
        where the part is the stack's."""
        if self.layer is None:
            return self
        return DenseLayer(**{name: stacked[self.layer] for name, stacked in self.entries().items()})

    def attend(self, q_BSHE: jax.Array, k_BSKE: jax.Array, v_BSKE: jax.Array, positions_BS: jax.Array, index,
               options: AttentionOptions | None, window, placement: Placement) -> tuple[jax.Array, DenseLayer]:
        """`LayerCache.attend` of a dense cache: the S new keys and values [B, S, K, E] written at positions
        index .. index + S - 1 (`write_cache`), then each query [B, S, H, E] attends to the cached positions up to
        its own (`ops.attention`, under the named scope "attention"). -> (out [B, S, H, E], this part written)."""
        written = write_cache(self, index, k_BSKE, v_BSKE, placement)
        with jax.named_scope("attention"):
            return attention(q_BSHE, k_BSKE, v_BSKE, positions_BS, written.read(), index, options, window,
                             placement), written


def _present(cache: DenseCache | DenseLayer) -> dict:
    """{name: value} of the cache fields (CACHE_NAMES) `cache` holds: k and v, and an 8-bit cache's scales."""
    return {name: value for name in CACHE_NAMES if (value := getattr(cache, name)) is not None}


def cache_room(cache: DenseCache, cache_index, new_tokens: int) -> jax.Array | None:
    """Whether a write of `new_tokens` at `cache_index` ends inside the cache's T positions (XLA would clamp it onto
    the last slots). An index known at trace time is checked at once (StarscreamError; returns None). A traced one
    (decode inside jit) cannot be: the result is a traced bool, False for a write that would not fit, with which
    the model makes every logit NaN, so that the clamped write is seen by whoever reads the step's output (the
    generation loop bounds the index itself)."""
    length = cache.length
    index = None if isinstance(cache_index, jax.core.Tracer) else int(cache_index)
    if new_tokens > length or (index is not None and not 0 <= index <= length - new_tokens):
        at = "" if index is None else f" at position {index}"
        raise StarscreamError(f"cannot write {new_tokens} token(s){at} into a KV cache of {length} positions; "
                              f"make the cache longer (init_cache max_len) or stop generating at position {length}")
    if index is not None:
        return None
    return (cache_index >= 0) & (cache_index <= length - new_tokens)


def write_cache(part: DenseLayer, index, k_BSKE: jax.Array, v_BSKE: jax.Array,
                placement: Placement | None = None) -> DenseLayer:
    """One layer's part of the KV cache with its S new keys and values [B, S, K, E] written at positions
    index .. index + S - 1: a dynamic-update-slice of S positions, which XLA runs in place on a donated cache (into
    the stack at `part.layer` where the part is the stack's). Where the layout splits the cache's positions
    (`cache_seq`), each device writes the new positions it owns into its own slots (`_write_owned`). An 8-bit cache
    gets the new keys and values in its format with their scales (`quantize_cache_entry`), the scales written where
    their positions are. `placement`: where the cache lives (None: `current()`)."""
    placement = placed_by(placement)
    layer, cache = part.layer, part.entries()
    one_layer = layer is None
    new = {"k": k_BSKE, "v": v_BSKE}
    if part.eight_bit:
        for name in ("k", "v"):
            new[name], new[name + "_scale"] = quantize_cache_entry(new[name], cache[name].dtype.name)
    if cache_split_axes(placement, part.k.shape[-4:]):
        return replace(part, **{name: _write_owned(placement, cache[name], layer, index, entry, CACHE_NAMES[name])
                                for name, entry in new.items()})

    def write(name, new_entry):
        # both placed by the cache's rules (no-ops inside the model, where they already are)
        names = CACHE_NAMES[name][1:] if one_layer else CACHE_NAMES[name]
        start = (0, index) + (0,) * (new_entry.ndim - 2)
        placed = new_entry.astype(cache[name].dtype) if one_layer else new_entry[None].astype(cache[name].dtype)
        return jax.lax.dynamic_update_slice(placement.constrain(cache[name], names, "kv cache"),
                                            placement.constrain(placed, names, "new keys and values"),
                                            start if one_layer else (layer, *start))

    return replace(part, **{name: write(name, new_entry) for name, new_entry in new.items()})


def cache_split_axes(placement: Placement, shape_BTKE: tuple[int, ...]) -> tuple[str, ...]:
    """The mesh axes `placement` splits a cache's positions over (`cache_seq`; () unplaced)."""
    spec = placement.activation_spec(CACHE, shape_BTKE, "kv cache")
    return () if spec is None else dim_axes(spec, 1)


def _write_owned(placement: Placement, full: jax.Array, layer, index, new_BS: jax.Array,
                 stacked_names: tuple[str, ...]) -> jax.Array:
    """`write_cache` of one entry (full: [L, B, T, ...] named `stacked_names`, or [B, T, ...] with `layer` None; the
    new positions [B, S, ...]) whose positions are split over the `cache_seq` axes: each device keeps the new
    positions index + s it owns (names.CACHE: those congruent to its index modulo the number of parts) and scatters
    them into its slots; the others are dropped. New entries split over the sequence (prefill under a sequence
    split) are first gathered over its axes, inside the GPU first (attention gathers the same keys). A scatter
    into the donated cache, in place."""
    names = stacked_names[1:] if layer is None else stacked_names
    cache_spec = placement.activation_spec(names, full.shape, "kv cache")
    new_names = tuple("seq" if name == "cache_seq" else name for name in stacked_names[1:])
    new_spec = placement.activation_spec(new_names, new_BS.shape, "new keys and values")
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

    write = jax.shard_map(local, mesh=placement.mesh, in_specs=(cache_spec, new_spec, PartitionSpec(), PartitionSpec()),
                          out_specs=cache_spec)
    return write(placement.placed_as(full, cache_spec), placement.placed_as(new_BS, new_spec), layer,
                 jnp.asarray(index, jnp.int32))


def cache_entries(config: ModelConfig, batch: int, length: int) -> DenseCache:
    """A stacked KV cache of `length` positions as ShapeDtypeStructs: k and v [L, B, T, K, E] in the compute dtype,
    or in `config.kv_format` with k_scale and v_scale [L, B, T, K] float32 beside them."""
    L, K, E = config.n_layers, config.n_kv_heads, config.head_dim
    values = jax.ShapeDtypeStruct((L, batch, length, K, E), jnp.dtype(config.kv_format or config.dtype))
    if not config.kv_format:
        return DenseCache(k=values, v=values)
    scales = jax.ShapeDtypeStruct((L, batch, length, K), jnp.float32)
    return DenseCache(k=values, v=values, k_scale=scales, v_scale=scales)


def init_cache(config: ModelConfig, batch: int, max_len: int, placement: Placement | None = None) -> DenseCache:
    """An empty stacked KV cache (`cache_entries`), placed by `placement` (None: `current()`; kv heads over gpu and
    batch over xcd under the starscream layouts)."""
    placement = placed_by(placement)
    return DenseCache(**{name: placement.constrain(jnp.zeros(entry.shape, entry.dtype), CACHE_NAMES[name], "kv cache")
                         for name, entry in cache_entries(config, batch, max_len).entries().items()})


def split_cache(cache: DenseCache, placement: Placement | None = None) -> DenseCache:
    """A stacked KV cache held as one array per layer: each field L arrays of one layer's ([B, T, K, E], scales
    [B, T, K]), placed by the cache's rules under `placement` (None: `current()`; copies: call once, as generation
    does before its decode loop)."""
    placement = placed_by(placement)
    return DenseCache(**{name: tuple(placement.constrain(layer, CACHE_NAMES[name][1:], "kv cache") for layer in stacked)
                         for name, stacked in cache.entries().items()})


def cache_shardings(config: ModelConfig, batch: int, length: int, layout: Layout | str, mesh,
                    per_layer: bool = False) -> DenseCache:
    """The NamedSharding `layout` gives each field of a KV cache (`cache_entries`: [L, B, T, K, E], T = `length`)
    on `mesh`, or with `per_layer` the one each layer's array of it ([B, T, K, E]) gets, as `split_cache` places
    it."""
    placement, specs = Placement.of(layout, mesh), {}
    for name, entry in cache_entries(config, batch, length).entries().items():
        names, shape = (CACHE_NAMES[name][1:], entry.shape[1:]) if per_layer else (CACHE_NAMES[name], entry.shape)
        specs[name] = placement.sharding(names, shape, "kv cache")
    return DenseCache(**specs)
