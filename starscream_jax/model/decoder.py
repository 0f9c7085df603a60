"""A Llama-family decoder in Flax NNX whose every tensor carries logical axis names.

Shape letters as in `names`. Layers are stacked on a leading `layers` axis and run one after another with no loop in
the program, or with `jax.lax.scan` when `ModelConfig.scan_unroll` asks for a rolled loop (`layers_per_trip`). Under
`use_layout(layout, mesh)` every weight, activation and the KV cache is placed by the layout; outside it the same code
runs unsharded. Each projection runs under `jax.named_scope` with its name (qkv, o, gate_up, down, router, logits;
embed and attention for the per-device ops; a routed mixture of experts' own gate and up), so the compiled program's
op names, and the keys of `analysis.report`, read as the model does. In training and prefill q, k and v run as one
GEMM and gate and up as one (`_qkv`, `_gate_up`), from weights stored apart. A mixture-of-experts model routes each
token to its experts (`moe.routed_mlp`). Where a backend's compiler needs help, the model asks the backend policy
(`hardware.backend`), never the backend itself.
"""
from __future__ import annotations

import contextlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from ..errors import StarscreamError
from ..hardware.axes import dim_axes
from ..hardware.backend import policy_of
from ..sharding.collectives import hierarchical_all_gather
from ..sharding.apply import (
    activation_spec,
    active,
    compute_device,
    constrain,
    einsum,
    logical_names,
    param,
    placed_as,
    param_shardings,
    path_name,
    scale,
    shared_input,
    token_mean,
    use_layout,
    weight,
)
from ..sharding.at_use import create_sharded
from ..sharding.layouts import Layout
from .config import ModelConfig
from .moe import routed_mlp
from .names import ATTN_KV, ATTN_Q, CACHE, KV_CACHE, KV_CACHE_SCALE, LOGITS, POSITIONS, RESIDUAL, TOKENS
from .ops import AttentionOptions, attention, cross_entropy, embed_lookup
from .paged import PagedCache, PagedLayer, paged_attention, with_layers
from .weight_only import applies as weight_only_applies
from .weight_only_group import grouped_weight_only_matmul
from .quantize import (
    OCP_TO_FNUZ,
    QUANTIZED_INPUTS,
    SCALE_SUFFIX,
    Fp8Weight,
    Scaled,
    tensor_scale,
    fp8_einsum,
    fp8_weight,
    ocp_to_fnuz,
    quantize,
    quantize_cache_entry,
    scale_names,
)

LAYER_SCOPE = "closed_call"
"""The scope of one layer's ops in the compiled program's op names: JAX puts the body of `jax.lax.scan` under it
(rolled or unrolled), and `Transformer._run_layers_apart` puts each layer's block under it too, so a reader of the
program (`analysis.compile.layer_loop_ops`) finds the layers' ops alike in every form decode compiles to."""
CHECKPOINT_POLICIES = {"dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
                       "full": jax.checkpoint_policies.nothing_saveable}
"""The jax.checkpoint policy of each remat policy but "none" (config.REMAT_POLICIES): "dots" keeps the projections'
outputs (matmuls without batch dimensions; attention's batched score matmuls are recomputed)."""


def _normal(rngs: nnx.Rngs, shape, fan_in: int) -> jax.Array:
    return jax.random.normal(rngs.params(), shape, jnp.float32) * fan_in ** -0.5


def rms_norm(x_BSD: jax.Array, scale_D: jax.Array, eps: float, plus_one: bool = False) -> jax.Array:
    """RMSNorm in float32, returned in x's dtype; scaled by (1 + scale) with `plus_one` (Gemma), else by scale."""
    x32 = x_BSD.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if plus_one:
        scale_D = 1.0 + scale_D.astype(jnp.float32)
    return scale(normed, scale_D, ("norm",), "norm scale").astype(x_BSD.dtype)


def _norm(c: ModelConfig, x: jax.Array, scale_D: jax.Array) -> jax.Array:
    """`rms_norm` of x over its last axis as `c` computes it."""
    return rms_norm(x, scale_D, c.norm_eps, c.norm_plus_one)


FULL_WINDOW = 1 << 30
"""The window of a layer that attends to every earlier position, in a model with sliding-window layers."""


def attention_options(c: ModelConfig) -> AttentionOptions | None:
    """How attention departs from plain causal softmax(q k / sqrt(head_dim)) under `c` (Gemma 2's scale,
    soft-capping, sliding window); None where it does not, and attention runs as it always has."""
    if not (c.query_pre_attn_scalar or c.attn_softcap or c.sliding_window):
        return None
    return AttentionOptions(c.query_pre_attn_scalar ** -0.5 if c.query_pre_attn_scalar else None, c.attn_softcap,
                            bool(c.sliding_window))


def layer_windows(c: ModelConfig) -> np.ndarray:
    """Each layer's attention window [L] int32: `c.sliding_window` for the layers of `c.sliding_layers`,
    FULL_WINDOW for the others."""
    return np.array([c.sliding_window if layer in c.sliding_layers else FULL_WINDOW for layer in range(c.n_layers)],
                    np.int32)


def rope_frequencies(c: ModelConfig) -> jax.Array:
    """The rotary embedding's angular frequency of each of the head_dim / 2 pairs [E/2] float32: theta^(-2i/E),
    stretched as Llama 3.1 does when `c.rope_scaling == "llama3"`: wavelengths longer than
    original_max_len / low_freq_factor divided by `rope_factor`, shorter than original_max_len / high_freq_factor
    kept, those between blended smoothly."""
    half = c.head_dim // 2
    inv_freq = c.rope_theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    if c.rope_scaling != "llama3":
        return inv_freq
    wavelength = 2 * jnp.pi / inv_freq
    blend = (c.rope_original_max_len / wavelength - c.rope_low_freq_factor) / (
        c.rope_high_freq_factor - c.rope_low_freq_factor)
    blended = (1 - blend) * inv_freq / c.rope_factor + blend * inv_freq
    long_waves = wavelength > c.rope_original_max_len / c.rope_low_freq_factor
    short_waves = wavelength < c.rope_original_max_len / c.rope_high_freq_factor
    return jnp.where(long_waves, inv_freq / c.rope_factor, jnp.where(short_waves, inv_freq, blended))


def rope(x_BSNE: jax.Array, positions_BS: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotary position embedding (rotate-half form) of queries or keys at integer positions, with the angular
    frequencies `inv_freq` [E/2] of `rope_frequencies`."""
    half = x_BSNE.shape[-1] // 2
    angles = positions_BS[..., None].astype(jnp.float32) * inv_freq  # [B, S, E/2]
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    x1, x2 = x_BSNE[..., :half].astype(jnp.float32), x_BSNE[..., half:].astype(jnp.float32)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x_BSNE.dtype)


class LayerStack(nnx.Module):
    """All L transformer blocks, each weight stacked on a leading `layers` axis."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        c = config
        L, D, H, K, E, F = c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff
        self.attn_norm = param(jnp.ones((L, D)), ("layers", "norm"))
        self.wq = param(_normal(rngs, (L, D, H, E), D), ("layers", "embed", "heads", "head_dim"))
        self.wk = param(_normal(rngs, (L, D, K, E), D), ("layers", "embed", "kv_heads", "head_dim"))
        self.wv = param(_normal(rngs, (L, D, K, E), D), ("layers", "embed", "kv_heads", "head_dim"))
        self.wo = param(_normal(rngs, (L, H, E, D), H * E), ("layers", "heads", "head_dim", "embed"))
        if c.qkv_bias:
            self.bq = param(jnp.zeros((L, H, E)), ("layers", "heads", "head_dim"))
            self.bk = param(jnp.zeros((L, K, E)), ("layers", "kv_heads", "head_dim"))
            self.bv = param(jnp.zeros((L, K, E)), ("layers", "kv_heads", "head_dim"))
        if c.qk_norm:
            self.q_norm = param(jnp.ones((L, E)), ("layers", "norm"))
            self.k_norm = param(jnp.ones((L, E)), ("layers", "norm"))
        self.mlp_norm = param(jnp.ones((L, D)), ("layers", "norm"))
        if c.post_norms:
            self.attn_post_norm = param(jnp.ones((L, D)), ("layers", "norm"))
            self.mlp_post_norm = param(jnp.ones((L, D)), ("layers", "norm"))
        if c.n_experts:
            X = c.n_experts
            self.router = param(_normal(rngs, (L, D, X), D), ("layers", "embed", "experts"))
            self.w_gate = param(_normal(rngs, (L, X, D, F), D), ("layers", "experts", "embed", "expert_mlp"))
            self.w_up = param(_normal(rngs, (L, X, D, F), D), ("layers", "experts", "embed", "expert_mlp"))
            self.w_down = param(_normal(rngs, (L, X, F, D), F), ("layers", "experts", "expert_mlp", "embed"))
        else:
            self.w_gate = param(_normal(rngs, (L, D, F), D), ("layers", "embed", "mlp"))
            self.w_up = param(_normal(rngs, (L, D, F), D), ("layers", "embed", "mlp"))
            self.w_down = param(_normal(rngs, (L, F, D), F), ("layers", "mlp", "embed"))
        if c.weight_format:
            _quantize_in_place(c, self)


def _quantize_in_place(c: ModelConfig, layers: LayerStack) -> None:
    """Replaces each weight of QUANTIZED_INPUTS by its 8-bit values, with its scale beside it as `<name>_scale`
    (`quantize.quantize`)."""
    for key in QUANTIZED_INPUTS:
        names = logical_names(getattr(layers, key))
        values, scale = quantize(getattr(layers, key)[...], key, names, c.weight_format, c.weight_scales)
        setattr(layers, key, param(values, names))
        setattr(layers, key + SCALE_SUFFIX, param(scale, scale_names(key, names, c.weight_scales)))


class ModelOutput(NamedTuple):
    """What `Transformer.__call__` returns, whatever it is asked."""

    logits: jax.Array
    """[B, S, V] float32, placed by LOGITS."""
    cache: dict | None
    """The KV cache given, with the new keys and values written; None when none was given."""
    balance_loss: jax.Array
    """The mixture of experts' load-balancing loss, a float32 scalar: the mean over layers of `moe.balance_loss`
    (1 when even); 0 for a dense model."""


class Transformer(nnx.Module):
    """tokens [B, S] int32 -> ModelOutput (logits [B, S, V] float32, the updated KV cache when one is given, the
    load-balancing loss)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.embedding = param(jax.random.normal(rngs.params(), (config.vocab_size, config.d_model)) * 0.02,
                               ("vocab", "embed"))
        self.layers = LayerStack(config, rngs=rngs)
        self.final_norm = param(jnp.ones((config.d_model,)), ("norm",))
        if not config.tie_embeddings:
            self.lm_head = param(_normal(rngs, (config.d_model, config.vocab_size), config.d_model),
                                 ("embed", "vocab"))

    def __call__(self, tokens_BS: jax.Array, *, positions_BS: jax.Array | None = None,
                 cache: dict | None = None, cache_index: jax.Array | int = 0) -> ModelOutput:
        """tokens [B, S] -> ModelOutput: logits [B, S, V] float32, the KV cache ({"k", "v"} of [L, B, T, K, E]
        each, or L arrays of [B, T, K, E] each, `split_cache`) with the new keys and values written at
        `cache_index` (StarscreamError when they would not fit; every logit NaN when a traced index would not, see
        `_cache_room`), None without a cache, and the mixture of experts' load-balancing loss (mean over layers; 0
        for a dense model)."""
        c = self.config
        fits = None if cache is None else _cache_room(cache, cache_index, tokens_BS.shape[1])
        if positions_BS is None:
            positions_BS = jnp.broadcast_to(jnp.arange(tokens_BS.shape[1]) + cache_index, tokens_BS.shape)
        table_VD, x_BSD = self._embed(tokens_BS)
        stacked = _layer_weights(c, self.layers)
        x_BSD, (new_cache, balance_L) = self._run_layers(x_BSD, stacked, positions_BS, cache, cache_index)
        logits_BSV = self._logits(x_BSD, table_VD)
        if fits is not None:
            logits_BSV = jnp.where(fits, logits_BSV, jnp.nan)
        return ModelOutput(logits_BSV, new_cache, jnp.mean(balance_L))

    def paged(self, tokens_BS: jax.Array, positions_BS: jax.Array, last_B: jax.Array, cache: PagedCache,
              every_position: bool = False) -> tuple[jax.Array, ...]:
        """tokens [B, S] at `positions` [B, S] (-1: padding) through the model over a paged KV cache, each block
        writing its keys and values into its layer's pages (`paged.paged_attention`), the layers one after another
        (the pools are held per layer). Returns the logits [B, V] float32 of each row's token at index `last_B`
        [B] (only those rows reach the final norm and the vocabulary projection) and the updated cache; with
        `every_position` (a prompt's log-probabilities) also the logits [B, S, V] float32 of every position."""
        c = self.config
        table_VD, x_BSD = self._embed(tokens_BS)
        positions_BS = constrain(positions_BS, POSITIONS, "positions")
        layers = []
        for index, w in enumerate(_unstacked(_layer_weights(c, self.layers), c.n_layers)):
            with jax.named_scope(LAYER_SCOPE):
                x_BSD, layer, _ = _block(c, x_BSD, w, positions_BS, cache.layer(index))
            layers.append(layer)
        last_B11 = jnp.broadcast_to(last_B[:, None, None], (x_BSD.shape[0], 1, x_BSD.shape[2]))
        x_B1D = jnp.take_along_axis(x_BSD, constrain(last_B11, RESIDUAL, "last rows"), axis=1)
        logits_BV, cache = self._logits(x_B1D, table_VD)[:, 0], with_layers(cache, layers)
        return (logits_BV, cache, self._logits(x_BSD, table_VD)) if every_position else (logits_BV, cache)

    def _embed(self, tokens_BS):
        """(the embedding table as used [V, D], the tokens' rows [B, S, D] placed by RESIDUAL)."""
        with jax.named_scope("embed"):
            table_VD = weight(self.embedding[...], ("vocab", "embed"), jnp.dtype(self.config.dtype), "embedding")
            rows_BSD = embed_lookup(table_VD, tokens_BS, out=RESIDUAL)
            if self.config.scale_embedding:  # sqrt(D) rounded to the compute dtype first, as transformers does
                rows_BSD = rows_BSD * jnp.asarray(self.config.d_model ** 0.5, table_VD.dtype)
            return table_VD, rows_BSD

    def _logits(self, x_BSD, table_VD):
        """The final norm of x [B, S, D], then the vocabulary projection: logits [B, S, V] float32 (LOGITS)."""
        c = self.config
        x_BSD = _norm(c, x_BSD, self.final_norm[...])
        with jax.named_scope("logits"):
            if c.tie_embeddings:
                logits_BSV = einsum("bsd,vd->bsv", x_BSD, table_VD, out=LOGITS, tensor="logits")
            else:
                head_DV = weight(self.lm_head[...], ("embed", "vocab"), jnp.dtype(c.dtype), "lm_head")
                logits_BSV = einsum("bsd,dv->bsv", x_BSD, head_DV, out=LOGITS, tensor="logits")
            logits_BSV = logits_BSV.astype(jnp.float32)
            if c.logit_softcap:
                logits_BSV = c.logit_softcap * jnp.tanh(logits_BSV / c.logit_softcap)
            return logits_BSV

    def _run_layers(self, x_BSD, stacked, positions_BS, cache, cache_index):
        """The L blocks over x [B, S, D] -> (x, (cache or None, load-balancing loss per layer [L])). Without a
        cache and without a rolled loop (`rolls_layers`), or with a cache held per layer, one after another
        (`_run_layers_apart`); otherwise a `jax.lax.scan`, a stacked KV cache travelling through it whole, each block
        writing its new keys and values in place."""
        c = self.config
        positions_BS = constrain(positions_BS, ("attn_batch", "seq"), "positions")
        if held_per_layer(cache) or (cache is None and not rolls_layers(c)):
            return self._run_layers_apart(x_BSD, stacked, positions_BS, cache, cache_index)
        if any(isinstance(value, tuple) for value in stacked.values()):
            raise StarscreamError("weights held per layer (split_layer_weights) run only where the layers run one "
                                  "after another; hold the KV cache per layer too (split_cache), or keep the "
                                  "weights stacked for a layer loop")

        def block(carry, layer):
            x_BSD, cache = carry
            w, index = layer
            x_BSD, cache, balance = _block(c, x_BSD, w, positions_BS, None if cache is None else (cache, index,
                                                                                                  cache_index))
            return (x_BSD, cache), balance

        if c.remat != "none":
            block = jax.checkpoint(block, policy=CHECKPOINT_POLICIES[c.remat])
        (x_BSD, cache), balance_L = jax.lax.scan(block, (x_BSD, cache), (stacked, jnp.arange(c.n_layers)),
                                                 unroll=layers_per_trip(c))
        return x_BSD, (cache, balance_L)

    def _run_layers_apart(self, x_BSD, stacked, positions_BS, cache, cache_index):
        """The L blocks one after another (no loop in the program), with no KV cache (training and prefill without
        a layer loop) or one held per layer ({"k", "v"}: L arrays of [B, T, K, E] each, `split_cache`): each block
        writes its new keys and values into its own cache array in place, and attention reads that array whole,
        where a layer's part of a stacked cache is copied out before a library call (cuDNN's attention) can read it.
        Without a loop nothing a layer saves for the backward pass is stacked (a rolled loop writes each layer's
        saved activations into [L, ...] arrays and copies them out again). Each layer runs under the named scope
        LAYER_SCOPE, as a layer of the scan does. -> (x, (cache or None, balance [L]))."""
        c = self.config

        def block(x_BSD, w, layer_cache):
            return _block(c, x_BSD, w, positions_BS, None if layer_cache is None else (layer_cache, None, cache_index))

        if c.remat != "none":
            block = jax.checkpoint(block, policy=CHECKPOINT_POLICIES[c.remat])
        written, balances = {name: [] for name in cache or ()}, []
        for layer, w in enumerate(_unstacked(stacked, c.n_layers)):
            with jax.named_scope(LAYER_SCOPE):
                layer_cache = None if cache is None else {name: cache[name][layer] for name in cache}
                x_BSD, layer_cache, balance = block(x_BSD, w, layer_cache)
            for name in written:
                written[name].append(layer_cache[name])
            balances.append(balance)
        new_cache = None if cache is None else {name: tuple(layers) for name, layers in written.items()}
        return x_BSD, (new_cache, jnp.stack(balances))


def _unstacked(stacked: dict, n_layers: int) -> list[dict]:
    """Each layer's weights {name: [...]} from the stacked ones {name: [L, ...]}, split apart in one op per weight
    (whose gradient is one concatenation of the layers' gradients, where indexing each layer would pad every
    layer's gradient to the stack's shape and add the L of them); a weight held per layer (a tuple of L arrays,
    `split_layer_weights`) as held."""
    parts = {name: value if isinstance(value, tuple) else [part.reshape(part.shape[1:])
                                                            for part in jnp.split(value, n_layers)]
             for name, value in stacked.items()}
    return [{name: layers[index] for name, layers in parts.items()} for index in range(n_layers)]


def split_layer_weights(params):
    """`params` (an nnx.State of a Transformer's parameters) with each 8-bit layer weight [L, ...] held as L arrays
    [...] (a tuple), each placed as its layer's part of the stack was, for the programs that run the layers one
    after another (decode without a layer loop, `decode_holds_cache_per_layer`, and the paged step).

    Why: a GEMM fusion that converts an 8-bit weight as it reads it (XLA's Triton GEMM) reads whole arrays, so XLA
    copies each layer's slice out of a stack first, every step: for Llama 3 8B at batch 1 on an H200 those copies
    took 6.2 ms of a 10.4 ms step (benchmarks/NOTES.md run 19), where a bfloat16 slice is read in place by cuBLAS
    (float weights stay stacked). Copies once, one weight at a time, so the extra memory held while splitting is
    one stacked weight's. The sliced `layers` axis must be unsplit (no layout splits it)."""
    def split(path, variable):
        value = variable.get_value()
        if not _held_in_eight_bits(path, value):
            return variable
        sharding = value.sharding
        if isinstance(sharding, NamedSharding) and sharding.spec and sharding.spec[0] is not None:
            raise StarscreamError(f"{path_name(path)} splits its layers over {sharding.spec[0]}; weights held per "
                                  "layer need the layers axis unsplit (use a layout that keeps it whole)")
        layer_sharding = (NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[1:]))
                          if isinstance(sharding, NamedSharding) else sharding)
        if isinstance(value, jax.ShapeDtypeStruct):  # abstract arguments (`analysis.compile`)
            return variable.replace(tuple(jax.ShapeDtypeStruct(value.shape[1:], value.dtype, sharding=layer_sharding)
                                          for _ in range(value.shape[0])))
        layers = jax.jit(lambda stack: tuple(stack[index] for index in range(stack.shape[0])),
                         out_shardings=layer_sharding)(value)
        return variable.replace(layers)

    return jax.tree.map_with_path(split, params, is_leaf=lambda node: isinstance(node, nnx.Variable))


def _held_in_eight_bits(path, value) -> bool:
    """Whether a parameter is a stacked 8-bit layer weight (`split_layer_weights`)."""
    return (not isinstance(value, tuple) and path_name(path).split("/")[0] == "layers" and value.ndim > 1
            and jnp.dtype(value.dtype).itemsize == 1)


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


def decode_holds_cache_per_layer(c: ModelConfig) -> bool:
    """Whether generation holds the KV cache per layer (`split_cache`) while decoding: when decode runs no layer loop
    (`rolls_layers`), so that each layer's attention reads its own array in place."""
    return not rolls_layers(c)


def rolls_layers(c: ModelConfig, cache_per_layer: bool = False) -> bool:
    """Whether the model runs its layers as a rolled loop (`jax.lax.scan` with fewer layers per trip than it has,
    `layers_per_trip`) rather than one after another; never with a KV cache held per layer (`cache_per_layer`)."""
    return layers_per_trip(c) < c.n_layers and not cache_per_layer


def layers_per_trip(c: ModelConfig) -> int:
    """Layers per iteration of the layer loop, in every phase: `c.scan_unroll`, or when it is 0 every layer (no
    loop; see ModelConfig)."""
    return c.scan_unroll or c.n_layers


def _cache_room(cache: dict, cache_index, new_tokens: int) -> jax.Array | None:
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


def _layer_weight_names(c: ModelConfig) -> list[str]:
    names = ["attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down"]
    names += ["attn_post_norm", "mlp_post_norm"] if c.post_norms else []
    names += ["bq", "bk", "bv"] if c.qkv_bias else []
    names += ["q_norm", "k_norm"] if c.qk_norm else []
    names += ["router"] if c.n_experts else []
    return names + ([name + SCALE_SUFFIX for name in names if name in QUANTIZED_INPUTS] if c.weight_format else [])


CAST_ONCE = frozenset({"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "bq", "bk", "bv"})
"""The stacked layer weights used in the compute dtype: the projections' matrices and biases (norm scales and a
mixture of experts' router are used in float32)."""


def _layer_weights(c: ModelConfig, layers: LayerStack) -> dict:
    """Every stacked layer weight [L, ...] by name, those of CAST_ONCE cast to the compute dtype here, once per step
    before the layer loop, as stored (not gathered): each layer then slices and gathers its weights in that dtype,
    where casting inside the loop would copy each layer's float32 slice out of the stack first. A weight's
    gradient is the same either way (each layer's slice is used once). 8-bit weights and their scales stay as
    stored, and a weight held per layer (`split_layer_weights`: a tuple of L arrays) as held."""
    dtype = jnp.dtype(c.dtype)
    stored = {name: getattr(layers, name).get_value() for name in _layer_weight_names(c)}
    weights = {name: value.astype(dtype) if name in CAST_ONCE and not isinstance(value, tuple)
               and value.dtype.itemsize > 1 else value for name, value in stored.items()}
    if c.sliding_window:  # each layer's attention window travels with its weights (`layer_windows`)
        weights["window"] = jnp.asarray(layer_windows(c))
    return weights


def _used(scope: str, c: ModelConfig, weights: dict, key: str, names: tuple[str, ...]) -> jax.Array | Scaled | Fp8Weight:
    """One layer's weight `weights[key]` as its projection uses it (`_weight_at_use`), under the projection's named
    scope; an 8-bit weight gathered in 8 bits, with its scale as stored (`Scaled`)."""
    with jax.named_scope(scope):
        if key + SCALE_SUFFIX not in weights:
            return _weight_at_use(c, weights[key], names, key)
        return Scaled(weight(weights[key], names, None, key), weights[key + SCALE_SUFFIX])


def _weight_at_use(c: ModelConfig, value: jax.Array, names: tuple[str, ...], tensor: str) -> jax.Array | Fp8Weight:
    """A float weight as its projection uses it (`weight`: cast to the compute dtype, gathered); in fp8 training
    (`c.matmul_format`) its e4m3 values, quantized where it is stored and gathered in 8 bits (`quantize.fp8_weight`)."""
    if c.matmul_format:
        return fp8_weight(value, names, c.matmul_format, c.dtype, tensor)
    return weight(value, names, jnp.dtype(c.dtype), tensor)


def _values(w: jax.Array | Scaled | Fp8Weight) -> jax.Array:
    """The array a matmul reads of a used weight (an 8-bit weight's values)."""
    return w.values if isinstance(w, (Scaled, Fp8Weight)) else w


def _matmul(subscripts: str, x: jax.Array, w: jax.Array | Scaled | Fp8Weight, out: tuple[str, ...],
            tensor: str, x_scale: jax.Array | None = None) -> jax.Array:
    """`einsum(subscripts, x, w)` placed by `out`; for an 8-bit weight (x @ values) * scale, the values converted to
    x's dtype as the matmul reads them and the scale (over the output's trailing axes, or one number) placed as the
    output is; in fp8 training fp8 GEMMs forward and backward (`quantize.fp8_einsum`; `x_scale`: x's e4m3 scale
    where it was taken before x was typed as a shared input, `_fp8_scale`)."""
    if isinstance(w, Fp8Weight):
        return fp8_einsum(subscripts, x, w, out, tensor, x_scale)
    if not isinstance(w, Scaled):
        return einsum(subscripts, x, w, out, tensor)
    y = einsum(subscripts, x, w.values.astype(x.dtype), out, tensor)
    scale = w.scale if w.scale.ndim == 0 else constrain(w.scale, out[len(out) - w.scale.ndim:], f"{tensor} scale")
    return y * scale.astype(y.dtype)


def _project(scope: str, subscripts: str, x: jax.Array, w: jax.Array | Scaled | Fp8Weight, out: tuple[str, ...],
             c: ModelConfig, x_scale: jax.Array | None = None) -> jax.Array:
    """One projection `einsum(subscripts, x, w)` of x [B, S, ...] placed by `out` ([B, S, ...]), under the named
    scope `scope` (`_matmul`); on rows padded with zeros where the backend policy pads it (`_padded_rows`)."""
    with jax.named_scope(scope):
        implementation = _weight_only_implementation(subscripts, x, w, c)
        if implementation:
            return _weight_only(x, [(subscripts, w, out)], scope, implementation)[0]
        rows = _padded_rows(x, _values(w))
        if rows:
            return _padded_matmul(subscripts, x, w, out, scope, rows)
        return _matmul(subscripts, x, w, out, scope, x_scale)


def _weight_only_implementation(subscripts: str, x: jax.Array, w, c: ModelConfig) -> str:
    """The `weight_only` implementation a projection runs on, or "" for `_matmul`'s: an 8-bit weight (`Scaled`)
    times a few token rows (decode: B x S up to weight_only.MAX_ROWS), x's trailing axes contracted with w's
    leading ones (`_weight_only_axes`), every operand whole on each device (a weight split over the mesh runs
    `_matmul`, whose placement rules hold its collectives), and `c.eight_bit_matmul` (or the backend policy's
    choice) not "xla"."""
    if not isinstance(w, Scaled) or _weight_only_axes(subscripts) is None:
        return ""
    implementation = c.eight_bit_matmul or policy_of(compute_device()).eight_bit_matmul
    contracted = int(np.prod(w.values.shape[:x.ndim - 2]))
    if not weight_only_applies(x.shape[0] * x.shape[1], contracted, w.values.size // contracted, implementation):
        return ""
    whole = all(_local_shape(t) == t.shape for t in (x, w.values, w.scale))
    return implementation if whole else ""


def _weight_only_axes(subscripts: str) -> tuple[str, str] | None:
    """(x's contracted letters, w's output letters) of an einsum x [B, S, contracted...] @ w [contracted...,
    out...] -> [B, S, out...] (every decode projection: "bsd,dhe->bshe", "bshe,hed->bsd", ...); None for another
    form."""
    inputs, result = subscripts.replace(" ", "").split("->")
    x_letters, w_letters = inputs.split(",")
    contracted = x_letters[2:]
    if not w_letters.startswith(contracted) or result != x_letters[:2] + w_letters[len(contracted):]:
        return None
    return contracted, w_letters[len(contracted):]


def _projections(scope: str, x: jax.Array, projections: list[tuple[str, jax.Array | Scaled | Fp8Weight,
                                                                    tuple[str, ...]]],
                 c: ModelConfig, x_scale: jax.Array | None = None) -> list[jax.Array]:
    """The projections (subscripts, weight, out) of one input x [B, S, ...] under the named scope `scope`: where
    every weight is 8-bit and runs on the same weight-only implementation (`_weight_only_implementation`: decode's
    few rows, operands whole on each device) and grouping is asked for (`c.eight_bit_matmul` named, or the backend
    policy's `eight_bit_groups`), all of them in one launch (`_weight_only`: q, k, v or gate, up, each weight read
    in place); otherwise each by `_project`."""
    with jax.named_scope(scope):
        chosen = {_weight_only_implementation(subscripts, x, w, c) for subscripts, w, _ in projections}
        grouped = bool(c.eight_bit_matmul) or policy_of(compute_device()).eight_bit_groups
        if grouped and len(projections) > 1 and len(chosen) == 1 and "" not in chosen:
            return _weight_only(x, projections, scope, chosen.pop())
    return [_project(scope, subscripts, x, w, out, c, x_scale) for subscripts, w, out in projections]


def _weight_only(x: jax.Array, projections: list[tuple[str, Scaled, tuple[str, ...]]], scope: str,
                 implementation: str) -> list[jax.Array]:
    """`_matmul(subscripts, x, w)` of x [B, S, ...] by each 8-bit weight of `projections` ((subscripts, weight,
    out) sharing x) in one launch of the grouped weight-only kernel (`weight_only_group`): x as [B S, K], each
    weight's values as [K, N] (a reshape of a row-major array, no copy) with its scale per output channel [N] (or
    one number), applied in the kernel's epilogue; each result [B, S, out...] in x's dtype, placed by its `out`.
    Under a layout the operands, whole on each device, enter the kernel as replicated arrays of a shard map (each
    device computes the whole products, as the XLA path would; a shared input's `reduced` type, gradient
    bookkeeping that decode does not use, is dropped there)."""
    B, S = x.shape[:2]
    K = int(np.prod(x.shape[2:]))
    shapes = [w.values.shape[len(_weight_only_axes(subscripts)[0]):] for subscripts, w, _ in projections]

    def local(x, *arrays):
        pairs = [(values.reshape(K, -1), scale if scale.ndim == 0 else scale.reshape(-1))
                 for values, scale in zip(arrays[::2], arrays[1::2])]
        outs = grouped_weight_only_matmul(x.reshape(B * S, K), pairs, implementation)
        return tuple(y.reshape(B, S, *shape) for y, shape in zip(outs, shapes))

    arrays = [t for _, w, _ in projections for t in (w.values, w.scale)]
    if active() is None:
        return list(local(x, *arrays))
    whole = PartitionSpec()
    outs = jax.shard_map(local, mesh=active().mesh, in_specs=(whole,) * (1 + len(arrays)),
                         out_specs=(whole,) * len(projections))(*(placed_as(t, whole) for t in (x, *arrays)))
    return [constrain(y, out, f"{scope} output") for y, (_, _, out) in zip(outs, projections)]


def _fp8_scale(c: ModelConfig, x: jax.Array) -> jax.Array | None:
    """In fp8 training, the e4m3 scale of a projections' input x (`quantize.tensor_scale`), taken before x is
    typed as the shared input of several matmuls (`shared_input`), once for all of them; None otherwise."""
    return tensor_scale(x, c.matmul_format) if c.matmul_format else None


def _padded_rows(x: jax.Array, w: jax.Array) -> int:
    """The rows the projection of x [B, 1, ...] by w is padded to (`BackendPolicy.pads`: XLA:GPU would run one row
    per device as a multiply and a reduction), or 0 where it runs as it is."""
    if x.shape[1] != 1:
        return 0
    x_local, w_local = _local_shape(x), _local_shape(w)
    policy = policy_of(compute_device())
    pads = x_local[0] == 1 and policy.pads(int(np.prod(x_local)), int(np.prod(w_local)))
    return policy.padded_rows if pads else 0


def _local_shape(x: jax.Array) -> tuple[int, ...]:
    """The shape of the part of x each device holds under the active layout (x's shape outside one)."""
    if active() is None:
        return x.shape
    return jax.typeof(x).sharding.shard_shape(x.shape)


def _padded_matmul(subscripts: str, x: jax.Array, w: jax.Array | Scaled, out: tuple[str, ...], scope: str,
                   rows: int) -> jax.Array:
    """`einsum(subscripts, x, w)` for x [B, 1, ...], computed on x with zero rows appended ([B, rows, ...]) and the
    first row kept, so that XLA runs a GEMM (`_matmul`); the optimization barrier keeps XLA from folding the zero
    rows away. The extra rows cost nothing measurable where the weights' bytes bound the step."""
    padded = jax.lax.optimization_barrier(jnp.pad(x, [(0, 0), (0, rows - 1)] + [(0, 0)] * (x.ndim - 2)))
    return _matmul(subscripts, padded, w, out, scope)[:, :1]


def _block(c: ModelConfig, x_BSD, w, positions_BS, cached=None):
    """One pre-norm block: x + attention(norm(x)), then + mlp(norm(x)); with `c.post_norms` (Gemma 2) the attention's
    and the MLP's outputs are normed again before they are added. x [B, S, D] placed by RESIDUAL. Attention follows
    `attention_options(c)`, each layer with its own window (w["window"], `layer_windows`) in a sliding-window model.

    cached: None, or (cache, layer, cache_index): the KV cache of every layer ([L, B, T, K, E] each), this block's
    layer index and the position of the first new token; or (this layer's cache, [B, T, K, E] each, None,
    cache_index); or a `paged.PagedLayer` (this layer's pages, written and read by `paged.paged_attention` at the
    tokens' own positions). The new keys and values are written into the cache in place (`write_cache`) and
    attention reads this layer's part. Returns (x, cache or None, the layer's load-balancing loss: 0 for a dense
    MLP)."""
    h_BSD = _norm(c, x_BSD, w["attn_norm"])
    q_BSHE, k_BSKE, v_BSKE = _qkv(c, h_BSD, w)
    if c.qkv_bias:
        q_BSHE, k_BSKE, v_BSKE = (_add_bias(x, w[key], names) for x, key, names in (
            (q_BSHE, "bq", ("heads", "head_dim")), (k_BSKE, "bk", ("kv_heads", "head_dim")),
            (v_BSKE, "bv", ("kv_heads", "head_dim"))))
    if c.qk_norm:
        q_BSHE, k_BSKE = _norm(c, q_BSHE, w["q_norm"]), _norm(c, k_BSKE, w["k_norm"])
    inv_freq = rope_frequencies(c)
    q_BSHE, k_BSKE = rope(q_BSHE, positions_BS, inv_freq), rope(k_BSKE, positions_BS, inv_freq)
    options = attention_options(c)
    if isinstance(cached, PagedLayer):
        with jax.named_scope("attention"):
            attended_BSHE, cache = paged_attention(q_BSHE, k_BSKE, v_BSKE, positions_BS, cached, options,
                                                   w.get("window"))
    else:
        cache = layer_cache = None
        if cached is not None:
            cache, layer, cache_index = cached
            cache = write_cache(cache, layer, cache_index, k_BSKE, v_BSKE)
            layer_cache = cache if layer is None else {name: cache[name][layer] for name in cache}
        with jax.named_scope("attention"):
            attended_BSHE = attention(q_BSHE, k_BSKE, v_BSKE, positions_BS, layer_cache,
                                      None if cached is None else cached[2], options, w.get("window"))
    attended_BSHE = constrain(attended_BSHE, ("batch", "seq", "heads", "head_dim"), "attention output")
    wo_HED = _used("o", c, w, "wo", ("heads", "head_dim", "embed"))
    attn_out_BSD = _project("o", "bshe,hed->bsd", attended_BSHE, wo_HED, RESIDUAL, c)
    if c.post_norms:
        attn_out_BSD = _norm(c, attn_out_BSD, w["attn_post_norm"])
    x_BSD = x_BSD + attn_out_BSD
    h_BSD = _norm(c, x_BSD, w["mlp_norm"])
    if c.n_experts:
        mlp_BSD, balance = routed_mlp(c, h_BSD, w)
    else:
        mlp_BSD, balance = _dense_mlp(c, h_BSD, w), jnp.zeros((), jnp.float32)
    if c.post_norms:
        mlp_BSD = _norm(c, mlp_BSD, w["mlp_post_norm"])
    return x_BSD + mlp_BSD, cache, balance


def _add_bias(x_BSNE, bias_NE, names: tuple[str, ...]):
    """x [B, S, N, E] plus a projection's bias [N, E], the bias used as `weight` places it (`scale` of ones: its
    gradient summed over the token axes as a weight's is)."""
    return x_BSNE + scale(jnp.ones_like(x_BSNE), bias_NE.astype(x_BSNE.dtype), names, "bias")


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


def _fuses(c: ModelConfig, h_BSD: jax.Array) -> bool:
    """Whether projections sharing the input h [B, S, D] run as one GEMM: with `c.fuse_projections`, where each
    sequence brings more than one position (training, prefill: compute-bound GEMMs). Decode (one position) is bound
    by reading the weights, and stacking them would copy them every step (read, write, read again), so it runs the
    stored weights in separate GEMMs; so do 8-bit weights, each with its own scales."""
    return c.fuse_projections and h_BSD.shape[1] > 1 and not c.weight_format


def _same_split(stored: list[jax.Array], dimension: int) -> bool:
    """Whether the stored weights `stored` split dimension `dimension` over the same mesh axes (always, unsharded)."""
    if active() is None:
        return True
    return len({dim_axes(jax.typeof(value).sharding.spec, dimension) for value in stored}) == 1


def _by_kv_head(wq_DHE: jax.Array, K: int) -> jax.Array:
    """The stored query weight [D, H, E] as [D, K, G, E], each kv head's G query heads together, the mesh axes that
    split its heads kept on K. JAX's own reshape rule moves them to G where K is 1 (a size-1 axis, or one kv head),
    and the stack with wk / wv [D, K, E] would then mix placements; `_qkv` stacks only where wk splits K over the
    same axes as wq splits H, so they divide K."""
    D, H, E = wq_DHE.shape
    shape = (D, K, H // K, E)
    if active() is None or active().auto:
        return wq_DHE.reshape(shape)
    d, h, e = jax.typeof(wq_DHE).sharding.spec
    return jnp.reshape(wq_DHE, shape, out_sharding=PartitionSpec(d, h, None, e))


def _qkv(c: ModelConfig, h_BSD, w):
    """Queries [B, S, H, E] (placed by ATTN_Q), keys and values [B, S, K, E] (ATTN_KV) of the normed residual h.

    Fused (`_fuses`: training and prefill): the stored q, k and v weights are stacked by kv head into
    [D, K, G + 2, E] (each kv head's G query heads, then its key, then its value), used (cast, gathered) as one
    weight and multiplied in one GEMM. Stacking by kv head keeps the stack local wherever a layout splits query
    heads and kv heads over the same mesh axes (every layout except flat_tp with fewer kv heads than devices, which
    copies kv heads); there, and when not fused (decode), three GEMMs run, or with 8-bit weights on the weight-only
    kernel one launch of all three (`_projections`). Either way under the named scope "qkv"."""
    H, E, K = c.n_heads, c.head_dim, c.n_kv_heads
    G = H // K
    if not (_fuses(c, h_BSD) and _same_split([w["wq"], w["wk"], w["wv"]], 1)):
        wq_DHE = _used("qkv", c, w, "wq", ("embed", "heads", "head_dim"))
        wk_DKE = _used("qkv", c, w, "wk", ("embed", "kv_heads", "head_dim"))
        wv_DKE = _used("qkv", c, w, "wv", ("embed", "kv_heads", "head_dim"))
        h_scale = _fp8_scale(c, h_BSD)
        h_BSD = shared_input(h_BSD, [_values(wq_DHE), _values(wk_DKE), _values(wv_DKE)])
        return tuple(_projections("qkv", h_BSD, [("bsd,dhe->bshe", wq_DHE, ATTN_Q), ("bsd,dke->bske", wk_DKE, ATTN_KV),
                                                 ("bsd,dke->bske", wv_DKE, ATTN_KV)], c, h_scale))
    with jax.named_scope("qkv"):
        stacked_DKCE = jnp.concatenate([_by_kv_head(w["wq"], K), w["wk"][:, :, None], w["wv"][:, :, None]], axis=2)
        w_DKCE = _weight_at_use(c, stacked_DKCE, ("embed", "kv_heads", None, "head_dim"), "wq|wk|wv")
        h_scale = _fp8_scale(c, h_BSD)
        h_BSD = shared_input(h_BSD, [_values(w_DKCE)])
        qkv_BSKCE = _matmul("bsd,dkce->bskce", h_BSD, w_DKCE, (*ATTN_KV[:3], None, ATTN_KV[3]), "qkv", h_scale)
    B, S = h_BSD.shape[:2]
    q_BSHE = constrain(qkv_BSKCE[:, :, :, :G].reshape(B, S, H, E), ATTN_Q, "queries")
    return q_BSHE, qkv_BSKCE[:, :, :, G], qkv_BSKCE[:, :, :, G + 1]


def _gate_up(c: ModelConfig, h_BSD, w):
    """The SwiGLU gate and up projections of h [B, S, D]: [B, S, F] each, over `mlp`.

    Fused (`_fuses`: training and prefill): the stored gate and up weights [D, F] are stacked on a new axis right
    after `embed` ([D, 2, F]), which no layout splits, so the stack is local; it is used (cast, gathered) as one
    weight in one GEMM. Otherwise two GEMMs, or with 8-bit weights on the weight-only kernel one launch of both
    (`_projections`). Either way under the named scope "gate_up". (A routed mixture of
    experts runs its own grouped gate and up matmuls, `moe.routed_mlp`.)"""
    names, out = ("embed", "mlp"), ("batch", "seq", "mlp")
    if not _fuses(c, h_BSD):
        w_gate, w_up = _used("gate_up", c, w, "w_gate", names), _used("gate_up", c, w, "w_up", names)
        h_scale = _fp8_scale(c, h_BSD)
        h_BSD = shared_input(h_BSD, [_values(w_gate), _values(w_up)])
        return tuple(_projections("gate_up", h_BSD, [("bsd,df->bsf", w_gate, out), ("bsd,df->bsf", w_up, out)], c,
                                  h_scale))
    with jax.named_scope("gate_up"):
        stacked_DTF = jnp.stack([w["w_gate"], w["w_up"]], axis=1)
        used_DTF = _weight_at_use(c, stacked_DTF, ("embed", None, "mlp"), "w_gate|w_up")
        h_scale = _fp8_scale(c, h_BSD)
        h_BSD = shared_input(h_BSD, [_values(used_DTF)])
        both_BSTF = _matmul("bsd,dtf->bstf", h_BSD, used_DTF, ("batch", "seq", None, "mlp"), "gate_up", h_scale)
    return both_BSTF[:, :, 0], both_BSTF[:, :, 1]


def _dense_mlp(c: ModelConfig, h_BSD, w):
    """SwiGLU: down(silu(h @ gate) * (h @ up)), [B, S, D] -> [B, S, D] with the hidden [B, S, F] over `mlp`; GeGLU
    (GELU's tanh approximation in silu's place) where `c.mlp_activation` is "gelu_tanh"."""
    gate_BSF, up_BSF = _gate_up(c, h_BSD, w)
    w_down_FD = _used("down", c, w, "w_down", ("mlp", "embed"))
    gelu = c.mlp_activation == "gelu_tanh"
    activated_BSF = jax.nn.gelu(gate_BSF, approximate=True) if gelu else jax.nn.silu(gate_BSF)
    return _project("down", "bsf,fd->bsd", activated_BSF * up_BSF, w_down_FD, RESIDUAL, c)


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


def next_token_loss(model: Transformer, tokens_BS: jax.Array) -> jax.Array:
    """Mean cross entropy (nats) of predicting tokens[:, 1:] from tokens[:, :-1]; vocab-parallel under a layout;
    plus `load_balance_weight` times the load-balancing loss for a mixture of experts. tokens [B, S + 1] int32,
    placed like a token batch (`batch_sharding`)."""
    logits_BSV, _, balance = model(tokens_BS[:, :-1])
    targets_BS = constrain(tokens_BS[:, 1:], TOKENS, "targets")
    with jax.named_scope("loss"):
        loss = token_mean(cross_entropy(logits_BSV, targets_BS), TOKENS)
    weight = model.config.load_balance_weight
    return loss + weight * balance if weight else loss


def abstract_model(config: ModelConfig) -> Transformer:
    """A Transformer of `config` with no array allocated (jax.ShapeDtypeStruct leaves), its variables marked as
    `create_sharded` marks them (Flax's own placement off), so abstract and created states have one tree structure
    and a step compiled for one runs the other."""
    with nnx.use_eager_sharding(False):
        return nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))


def create_sharded_model(config: ModelConfig, layout: Layout | str, mesh, seed: int = 0) -> Transformer:
    """A Transformer whose parameters are created already sharded by the layout's params rules."""
    return create_sharded(lambda: Transformer(config, rngs=nnx.Rngs(seed)), layout, mesh)


def quantize_model(model: Transformer, weight_format: str, granularity: str = "channel", layout: Layout | str = None,
                   mesh=None) -> Transformer:
    """`model` with the weights of QUANTIZED_INPUTS in `weight_format` (8 bits, float32 scales per output channel
    or per layer: `quantize.quantize`), computed in one jitted program straight into `layout`'s params placement
    on `mesh` (unsharded without them); every other parameter kept as it is."""
    config = model.config.replace(weight_format=weight_format, weight_scales=granularity)
    graphdef, abstract, rest = nnx.split(abstract_model(config), nnx.Param, ...)
    stored = {path_name(path): variable for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param))}

    def convert(arrays: dict) -> dict:
        converted = {}
        for path, value in arrays.items():
            key = path.rsplit("/", 1)[-1]
            if key not in QUANTIZED_INPUTS:
                converted[path] = value
                continue
            converted[path], converted[path + SCALE_SUFFIX] = quantize(value, key, logical_names(stored[path]),
                                                                       weight_format, granularity)
        return converted

    flat = nnx.to_flat_state(abstract)
    shardings = None
    if mesh is not None:
        placed = nnx.to_flat_state(param_shardings(abstract, layout, mesh))
        shardings = {path_name(path): sharding for path, sharding in placed}
    with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
        arrays = jax.jit(convert, out_shardings=shardings)({path: v.get_value() for path, v in stored.items()})
    state = nnx.from_flat_state([(path, variable.replace(arrays[path_name(path)])) for path, variable in flat])
    return nnx.merge(graphdef, state, rest)


def to_fnuz(model: Transformer) -> Transformer:
    """`model` with its float8_e4m3fn weights held as float8_e4m3fnuz with doubled scales (`quantize.ocp_to_fnuz`:
    exact), each array kept where it is; for a chip that computes FNUZ fp8 only (MI300X) loading an OCP checkpoint."""
    config = model.config.replace(weight_format=OCP_TO_FNUZ[model.config.weight_format])
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    layers = params["layers"]

    @jax.jit
    def convert(stored: dict) -> dict:
        converted = {}
        for key in QUANTIZED_INPUTS:
            weight = ocp_to_fnuz(Scaled(stored[key], stored[key + SCALE_SUFFIX]))
            converted[key], converted[key + SCALE_SUFFIX] = weight.values, weight.scale
        return converted

    names = [name for key in QUANTIZED_INPUTS for name in (key, key + SCALE_SUFFIX)]
    converted = convert({name: layers[name].get_value() for name in names})
    for name in names:
        layers[name] = layers[name].replace(converted[name])
    model = nnx.merge(graphdef, params, rest)
    model.config = config
    return model
