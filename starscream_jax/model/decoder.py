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

Each phase's forward pass: training, `Transformer.__call__` without a cache (`next_token_loss` its loss); prefill and
static decode, `Transformer.__call__` over a dense KV cache (`dense_cache`); serving, `Transformer.paged` over the
paged cache (`paged`). All three run `_block` on one layer's typed weights (`layer_weights.LayerWeights`). What
they share sits in modules of its own: `projections` (the matmuls: plain, fp8, 8-bit on the weight-only kernel,
one-row ones padded), `layer_weights` (the layer weights' types, and the stacked weights as a step reads them, split
per layer) and `dense_cache`; `weight_formats` converts a built model's weights (8-bit quantization, fp8 held as
FNUZ).
"""
from __future__ import annotations

from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from ..errors import StarscreamError
from ..hardware.axes import dim_axes
from ..sharding.apply import Placement, param, placed_by
from ..sharding.at_use import create_sharded
from ..sharding.layouts import Layout
from .config import ModelConfig
from .dense_cache import DenseCache, cache_room
from .layer_weights import (STACKED_GATE_UP_NAMES, STACKED_QKV_NAMES, AttentionWeights, DenseMlpWeights, LayerWeights,
                            any_held_per_layer, layer_weights, quantize_in_place, stacked_gate_up, stacked_qkv,
                            unstacked)
from .moe import routed_mlp
from .names import ATTN_KV, ATTN_Q, LOGITS, POSITIONS, RESIDUAL, TOKENS
from .ops import AttentionOptions, attention, cross_entropy, embed_lookup, run_sharded
from .paged import PagedCache
from .projections import fp8_scale, project, projections, used, used_together, values, weight_at_use
from .quantize import fp8_einsum, fp8_weight

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


def rms_norm(x_BSD: jax.Array, scale_D: jax.Array, eps: float, plus_one: bool = False,
             placement: Placement | None = None) -> jax.Array:
    """RMSNorm in float32, returned in x's dtype; scaled by (1 + scale) with `plus_one` (Gemma), else by scale, the
    scale used as `placement` (None: `current()`) uses a weight (`Placement.scale`)."""
    x32 = x_BSD.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if plus_one:
        scale_D = 1.0 + scale_D.astype(jnp.float32)
    return placed_by(placement).scale(normed, scale_D, ("norm",), "norm scale").astype(x_BSD.dtype)


def _norm(c: ModelConfig, placement: Placement, x: jax.Array, scale_D: jax.Array) -> jax.Array:
    """`rms_norm` of x over its last axis as `c` computes it."""
    return rms_norm(x, scale_D, c.norm_eps, c.norm_plus_one, placement)


def attention_options(c: ModelConfig) -> AttentionOptions | None:
    """How attention departs from plain causal softmax(q k / sqrt(head_dim)) under `c` (Gemma 2's scale,
    soft-capping, sliding window); None where it does not, and attention runs as it always has."""
    if not (c.query_pre_attn_scalar or c.attn_softcap or c.sliding_window):
        return None
    return AttentionOptions(c.query_pre_attn_scalar ** -0.5 if c.query_pre_attn_scalar else None, c.attn_softcap,
                            bool(c.sliding_window))


def rope_frequencies(c: ModelConfig) -> jax.Array:
    """The rotary embedding's angular frequency of each of the head_dim / 2 pairs [E/2] float32: theta^(-2i/E),
    divided by `rope_factor` when `c.rope_scaling == "linear"`, stretched as Llama 3.1 does when it is "llama3":
    wavelengths longer than original_max_len / low_freq_factor divided by `rope_factor`, shorter than
    original_max_len / high_freq_factor kept, those between blended smoothly."""
    half = c.head_dim // 2
    inv_freq = c.rope_theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    if c.rope_scaling == "linear":
        return inv_freq / c.rope_factor
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
    """All L transformer blocks, each weight stacked on a leading `layers` axis. Each parameter is the field of its
    name of `layer_weights.LayerWeights` or of its attention's and MLP's weights, as the blocks read them."""

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
            quantize_in_place(c, self)


class ModelOutput(NamedTuple):
    """What `Transformer.__call__` returns, whatever it is asked."""

    logits: jax.Array
    """[B, S, V] float32, placed by LOGITS."""
    cache: DenseCache | None
    """The KV cache given (held as it was given: stacked or per layer), with the new keys and values written; None
    when none was given."""
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
                 cache: DenseCache | None = None, cache_index: jax.Array | int = 0,
                 placement: Placement | None = None) -> ModelOutput:
        """tokens [B, S] -> ModelOutput: logits [B, S, V] float32, the KV cache (`DenseCache`, stacked or held per
        layer) with the new keys and values written at
        `cache_index` (StarscreamError when they would not fit; every logit NaN when a traced index would not, see
        `cache_room`), None without a cache, and the mixture of experts' load-balancing loss (mean over layers; 0
        for a dense model). `placement`: where its arrays go (the library's steps pass theirs; None: `current()`,
        the layout `use_layout` makes active around a call of your own)."""
        c, placement = self.config, placed_by(placement)
        fits = None if cache is None else cache_room(cache, cache_index, tokens_BS.shape[1])
        if positions_BS is None:
            positions_BS = jnp.broadcast_to(jnp.arange(tokens_BS.shape[1]) + cache_index, tokens_BS.shape)
        table_VD, x_BSD = self._embed(placement, tokens_BS)
        stacked = layer_weights(c, self.layers)
        x_BSD, (new_cache, balance_L) = self._run_layers(placement, x_BSD, stacked, positions_BS, cache, cache_index)
        logits_BSV = self._logits(placement, x_BSD, table_VD)
        if fits is not None:
            logits_BSV = jnp.where(fits, logits_BSV, jnp.nan)
        return ModelOutput(logits_BSV, new_cache, jnp.mean(balance_L))

    def paged(self, tokens_BS: jax.Array, positions_BS: jax.Array, last_B: jax.Array, cache: PagedCache,
              every_position: bool = False, placement: Placement | None = None) -> tuple[jax.Array, ...]:
        """tokens [B, S] at `positions` [B, S] (-1: padding) through the model over a paged KV cache, each block
        writing its keys and values into its layer's pages (`paged.paged_attention`), the layers one after another
        (the pools are held per layer). Returns the logits [B, V] float32 of each row's token at index `last_B`
        [B] (only those rows reach the final norm and the vocabulary projection) and the updated cache; with
        `every_position` (a prompt's log-probabilities) also the logits [B, S, V] float32 of every position. A
        mixed step (`cache.split`, `paged.RowSplit`) passes each cache shard's stream of tokens as a row ([shards,
        n]) and `last_B` [shards, R]: the index in its stream of each of the shard's R rows' last token, whose
        logits come back [shards * R, V], each shard's rows in turn. `placement` as `__call__` takes it."""
        c, placement = self.config, placed_by(placement)
        table_VD, x_BSD = self._embed(placement, tokens_BS)
        positions_BS = placement.constrain(positions_BS, POSITIONS, "positions")
        layers = []
        for index, w in enumerate(unstacked(layer_weights(c, self.layers), c.n_layers)):
            with jax.named_scope(LAYER_SCOPE):
                x_BSD, layer, _ = _block(c, placement, x_BSD, w, positions_BS, cache.layer(index))
            layers.append(layer)
        x_R1D = _last_tokens(placement, x_BSD, last_B if last_B.ndim == 2 else last_B[:, None])
        logits_BV, cache = self._logits(placement, x_R1D, table_VD)[:, 0], cache.with_layers(layers)
        return (logits_BV, cache, self._logits(placement, x_BSD, table_VD)) if every_position else (logits_BV, cache)

    def _embed(self, placement: Placement, tokens_BS):
        """(the embedding table as used [V, D], the tokens' rows [B, S, D] placed by RESIDUAL)."""
        with jax.named_scope("embed"):
            table_VD = placement.weight(self.embedding[...], ("vocab", "embed"), jnp.dtype(self.config.dtype),
                                        "embedding")
            rows_BSD = embed_lookup(table_VD, tokens_BS, out=RESIDUAL, placement=placement)
            if self.config.scale_embedding:  # sqrt(D) rounded to the compute dtype first, as transformers does
                rows_BSD = rows_BSD * jnp.asarray(self.config.d_model ** 0.5, table_VD.dtype)
            return table_VD, rows_BSD

    def _logits(self, placement: Placement, x_BSD, table_VD):
        """The final norm of x [B, S, D], then the vocabulary projection: logits [B, S, V] float32 (LOGITS)."""
        c = self.config
        x_BSD = _norm(c, placement, x_BSD, self.final_norm[...])
        with jax.named_scope("logits"):
            if c.fp8_logits:
                logits_BSV = self._fp8_logits(placement, x_BSD)
            elif c.tie_embeddings:
                logits_BSV = placement.einsum("bsd,vd->bsv", x_BSD, table_VD, out=LOGITS, tensor="logits")
            else:
                head_DV = placement.weight(self.lm_head[...], ("embed", "vocab"), jnp.dtype(c.dtype), "lm_head")
                logits_BSV = placement.einsum("bsd,dv->bsv", x_BSD, head_DV, out=LOGITS, tensor="logits")
            logits_BSV = logits_BSV.astype(jnp.float32)
            if c.logit_softcap:
                logits_BSV = c.logit_softcap * jnp.tanh(logits_BSV / c.logit_softcap)
            if c.vocab_padding:  # rows that are no token (`model.vocabulary`): never sampled, no share of the loss
                ids_V = jnp.arange(c.vocab_size)
                logits_BSV = jnp.where(ids_V < c.vocab_tokens, logits_BSV, jnp.finfo(jnp.float32).min)
            return logits_BSV

    def _fp8_logits(self, placement: Placement, x_BSD):
        """The vocabulary projection of the final norm's x [B, S, D] as fp8 GEMMs (`ModelConfig.fp8_logits`): the
        head (or the tied embedding table, quantized apart from the lookup's copy, its gradient summed with the
        lookup's) in e4m3 where it is stored, x in e4m3 and the logits' gradient in e5m2, each with its current
        per-tensor scale (`quantize.fp8_einsum`); logits [B, S, V] in x's dtype, placed by LOGITS."""
        c = self.config
        if c.tie_embeddings:
            table = fp8_weight(placement, self.embedding[...], ("vocab", "embed"), c.matmul_format, c.dtype,
                               "embedding")
            return fp8_einsum(placement, "bsd,vd->bsv", x_BSD, table, LOGITS, "logits")
        head = fp8_weight(placement, self.lm_head[...], ("embed", "vocab"), c.matmul_format, c.dtype, "lm_head")
        return fp8_einsum(placement, "bsd,dv->bsv", x_BSD, head, LOGITS, "logits")

    def _run_layers(self, placement: Placement, x_BSD, stacked, positions_BS, cache, cache_index):
        """The L blocks over x [B, S, D] -> (x, (cache or None, load-balancing loss per layer [L])). Without a
        cache and without a rolled loop (`rolls_layers`), or with a cache held per layer, one after another
        (`_run_layers_apart`); otherwise a `jax.lax.scan`, a stacked KV cache travelling through it whole, each block
        writing its new keys and values into the stack in place (`DenseCache.layer` with the loop's index)."""
        c = self.config
        positions_BS = placement.constrain(positions_BS, ("attn_batch", "seq"), "positions")
        one_after_another = not rolls_layers(c) if cache is None else cache.held_per_layer
        if one_after_another:
            return self._run_layers_apart(placement, x_BSD, stacked, positions_BS, cache, cache_index)
        if any_held_per_layer(stacked):
            raise StarscreamError("weights held per layer (split_layer_weights) run only where the layers run one "
                                  "after another; hold the KV cache per layer too (split_cache), or keep the "
                                  "weights stacked for a layer loop")

        def block(carry, layer):
            x_BSD, cache = carry
            w, index = layer
            part = None if cache is None else cache.layer(index)
            x_BSD, part, balance = _block(c, placement, x_BSD, w, positions_BS, part, cache_index)
            return (x_BSD, None if cache is None else cache.with_layers([part])), balance

        if c.remat != "none":
            block = jax.checkpoint(block, policy=CHECKPOINT_POLICIES[c.remat])
        (x_BSD, cache), balance_L = jax.lax.scan(block, (x_BSD, cache), (stacked, jnp.arange(c.n_layers)),
                                                 unroll=layers_per_trip(c))
        return x_BSD, (cache, balance_L)

    def _run_layers_apart(self, placement: Placement, x_BSD, stacked, positions_BS, cache, cache_index):
        """The L blocks one after another (no loop in the program), with no KV cache (training and prefill without
        a layer loop) or one held per layer (`split_cache`, each layer's part read by `DenseCache.layer`): each block
        writes its new keys and values into its own cache array in place, and attention reads that array whole,
        where a layer's part of a stacked cache is copied out before a library call (cuDNN's attention) can read it.
        Without a loop nothing a layer saves for the backward pass is stacked (a rolled loop writes each layer's
        saved activations into [L, ...] arrays and copies them out again). Each layer runs under the named scope
        LAYER_SCOPE, as a layer of the scan does. -> (x, (cache or None, balance [L]))."""
        c = self.config

        def block(x_BSD, w, part):
            return _block(c, placement, x_BSD, w, positions_BS, part, cache_index)

        if c.remat != "none":
            block = jax.checkpoint(block, policy=CHECKPOINT_POLICIES[c.remat])
        written, balances = [], []
        for layer, w in enumerate(unstacked(stacked, c.n_layers)):
            with jax.named_scope(LAYER_SCOPE):
                x_BSD, part, balance = block(x_BSD, w, None if cache is None else cache.layer(layer))
            written.append(part)
            balances.append(balance)
        return x_BSD, (None if cache is None else cache.with_layers(written), jnp.stack(balances))


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


def _block(c: ModelConfig, placement: Placement, x_BSD, w: LayerWeights, positions_BS,
           cached: LayerCache | None = None, cache_index: jax.Array | int = 0):
    """One pre-norm block: x + attention(norm(x)), then + mlp(norm(x)); with `c.post_norms` (Gemma 2) the attention's
    and the MLP's outputs are normed again before they are added. x [B, S, D] placed by RESIDUAL; `w` this layer's
    weights. Attention follows `attention_options(c)`, each layer with its own window (`w.window`, `layer_windows`)
    in a sliding-window model.

    cached: None (no cache) or this layer's part of a KV cache (`LayerCache`: a dense one's, its new keys and values
    written in place at `cache_index`, the position of the first new token, or the paged one's, written at the
    tokens' own positions). Returns (x, the layer's part written, or None; the layer's load-balancing loss: 0 for a dense
    MLP)."""
    attn_out_BSD, cache = _self_attention(c, placement, _norm(c, placement, x_BSD, w.attn_norm), w.attention,
                                          positions_BS, cached, cache_index, w.window)
    if c.post_norms:
        attn_out_BSD = _norm(c, placement, attn_out_BSD, w.attn_post_norm)
    x_BSD = x_BSD + attn_out_BSD
    h_BSD = _norm(c, placement, x_BSD, w.mlp_norm)
    if c.n_experts:
        mlp_BSD, balance = routed_mlp(c, h_BSD, w.mlp, placement)
    else:
        mlp_BSD, balance = _dense_mlp(c, placement, h_BSD, w.mlp), jnp.zeros((), jnp.float32)
    if c.post_norms:
        mlp_BSD = _norm(c, placement, mlp_BSD, w.mlp_post_norm)
    return x_BSD + mlp_BSD, cache, balance


def _last_tokens(placement: Placement, x_BSD, last_BR) -> jax.Array:
    """The residual [B, S, D] at each row's R indices `last_BR` [B, R] as rows [B * R, 1, D] (RESIDUAL), each row's
    in turn: taken on each device from its own rows, so a mixed step's R rows of a shard stay on its devices."""
    def local(x_BSD, last_BR, specs):
        rows, count = last_BR.shape
        at_BRD = jnp.broadcast_to(last_BR[:, :, None], (rows, count, x_BSD.shape[2]))
        return jnp.take_along_axis(x_BSD, at_BRD, axis=1).reshape(rows * count, 1, x_BSD.shape[2])

    rows, count = last_BR.shape
    return run_sharded(local, [x_BSD, last_BR], [RESIDUAL, ("batch", None)],
                       [(RESIDUAL, (rows * count, 1, x_BSD.shape[2]))], "last tokens", placement=placement)


def _self_attention(c: ModelConfig, placement: Placement, h_BSD, w: AttentionWeights, positions_BS, cached,
                    cache_index, window):
    """The attention of the normed residual h [B, S, D] to itself and to the cached positions (`cached` and
    `cache_index` as `_block` takes them; `window` [] int32 this layer's, or None) -> (its output [B, S, D] placed by
    RESIDUAL, the layer's part of the cache with the new keys and values written, or None)."""
    q_BSHE, k_BSKE, v_BSKE = _qkv(c, placement, h_BSD, w)
    if c.qkv_bias:
        kv_names = ("kv_heads", "head_dim")
        q_BSHE, k_BSKE, v_BSKE = (_add_bias(placement, q_BSHE, w.bq, ("heads", "head_dim")),
                                  _add_bias(placement, k_BSKE, w.bk, kv_names),
                                  _add_bias(placement, v_BSKE, w.bv, kv_names))
    if c.qk_norm:
        q_BSHE, k_BSKE = _norm(c, placement, q_BSHE, w.q_norm), _norm(c, placement, k_BSKE, w.k_norm)
    inv_freq = rope_frequencies(c)
    q_BSHE, k_BSKE = rope(q_BSHE, positions_BS, inv_freq), rope(k_BSKE, positions_BS, inv_freq)
    attended_BSHE, cache = _attend(c, placement, q_BSHE, k_BSKE, v_BSKE, positions_BS, cached, cache_index, window)
    attended_BSHE = placement.constrain(attended_BSHE, ("batch", "seq", "heads", "head_dim"), "attention output")
    wo_HED = used("o", c, placement, w.wo, w.wo_scale, ("heads", "head_dim", "embed"), "wo")
    return project("o", "bshe,hed->bsd", attended_BSHE, wo_HED, RESIDUAL, c, placement), cache


class LayerCache(Protocol):
    """One layer's part of a KV cache, whatever its form: a dense cache's (`dense_cache.DenseLayer`, of a stacked
    cache or one held per layer) or the paged cache's (`paged.PagedLayer`). A cache hands each block its layer's
    part (`DenseCache.layer`, `PagedCache.layer`) and takes the written parts back (`with_layers`)."""

    def attend(self, q_BSHE: jax.Array, k_BSKE: jax.Array, v_BSKE: jax.Array, positions_BS: jax.Array, index,
               options: AttentionOptions | None, window, placement: Placement) -> tuple[jax.Array, LayerCache]:
        """Writes the new keys and values [B, S, K, E] of the tokens at `positions_BS` [B, S] (a dense cache at
        `index`, the first new token's position), then attends each query [B, S, H, E] to the cached positions up
        to its own, with the model's attention `options` and this layer's `window`, placed by `placement`.
        -> (out [B, S, H, E], this part with the new keys and values written)."""


def _attend(c: ModelConfig, placement: Placement, q_BSHE, k_BSKE, v_BSKE, positions_BS, cached: LayerCache | None,
            cache_index, window):
    """Attention of the queries [B, S, H, E] to the new keys and values [B, S, K, E] and, with a cache, the cached
    ones, the new ones first written into it (`LayerCache.attend`; `cached` and `cache_index` as `_block` takes
    them) -> (out [B, S, H, E], the layer's part of the cache or None)."""
    if cached is not None:
        return cached.attend(q_BSHE, k_BSKE, v_BSKE, positions_BS, cache_index, attention_options(c), window,
                             placement)
    with jax.named_scope("attention"):
        return attention(q_BSHE, k_BSKE, v_BSKE, positions_BS, None, None, attention_options(c), window,
                         placement), None


def _add_bias(placement: Placement, x_BSNE, bias_NE, names: tuple[str, ...]):
    """x [B, S, N, E] plus a projection's bias [N, E], the bias used as `weight` places it (`scale` of ones: its
    gradient summed over the token axes as a weight's is)."""
    return x_BSNE + placement.scale(jnp.ones_like(x_BSNE), bias_NE.astype(x_BSNE.dtype), names, "bias")


def _fuses(c: ModelConfig, h_BSD: jax.Array) -> bool:
    """Whether projections sharing the input h [B, S, D] run as one GEMM: with `c.fuse_projections`, where each
    sequence brings more than one position (training, prefill: compute-bound GEMMs). Decode (one position) is bound
    by reading the weights, and stacking them would copy them every step (read, write, read again), so it runs the
    stored weights in separate GEMMs; so do 8-bit weights, each with its own scales."""
    return c.fuse_projections and h_BSD.shape[1] > 1 and not c.weight_format


def _same_split(stored: list[jax.Array], dimension: int) -> bool:
    """Whether the stored weights `stored` split dimension `dimension` over the same mesh axes (always, unsharded:
    no axis splits any of them)."""
    return len({dim_axes(jax.typeof(value).sharding.spec, dimension) for value in stored}) == 1


def _qkv(c: ModelConfig, placement: Placement, h_BSD, w: AttentionWeights):
    """Queries [B, S, H, E] (placed by ATTN_Q), keys and values [B, S, K, E] (ATTN_KV) of the normed residual h.

    One GEMM where q, k and v are stacked by kv head into [D, K, G + 2, E] (each kv head's G query heads, then its
    key, then its value): as inference holds them (`w.wqkv`, `layer_weights.stack_projections`), or stacked here
    from the stored weights where `_fuses` (training, prefill). Stacking by kv head keeps the stack local wherever
    a layout splits query heads and kv heads over the same mesh axes (every layout except flat_tp with fewer kv
    heads than devices, which copies kv heads). Otherwise three GEMMs, or with 8-bit weights on the weight-only
    kernel one launch of all three (`projections`). Either way under the named scope "qkv"."""
    H, E, K = c.n_heads, c.head_dim, c.n_kv_heads
    G = H // K
    if w.wqkv is None and not (_fuses(c, h_BSD) and _same_split([w.wq, w.wk, w.wv], 1)):
        wq_DHE, wk_DKE, wv_DKE = used_together("qkv", c, placement, [
            (w.wq, w.wq_scale, ("embed", "heads", "head_dim"), "wq"),
            (w.wk, w.wk_scale, ("embed", "kv_heads", "head_dim"), "wk"),
            (w.wv, w.wv_scale, ("embed", "kv_heads", "head_dim"), "wv")])
        h_scale = fp8_scale(c, placement, h_BSD)
        h_BSD = placement.shared_input(h_BSD, [values(wq_DHE), values(wk_DKE), values(wv_DKE)])
        return tuple(projections("qkv", h_BSD, [("bsd,dhe->bshe", wq_DHE, ATTN_Q), ("bsd,dke->bske", wk_DKE, ATTN_KV),
                                                ("bsd,dke->bske", wv_DKE, ATTN_KV)], c, placement, h_scale))
    if w.wqkv is None:
        with jax.named_scope("qkv"):
            w_DKCE = weight_at_use(c, placement, stacked_qkv(w.wq, w.wk, w.wv), STACKED_QKV_NAMES, "wq|wk|wv")
    else:
        w_DKCE = used("qkv", c, placement, w.wqkv, w.wqkv_scale, STACKED_QKV_NAMES, "wqkv")
    with jax.named_scope("qkv"):
        h_scale = fp8_scale(c, placement, h_BSD)
        h_BSD = placement.shared_input(h_BSD, [values(w_DKCE)])
    qkv_BSKCE = project("qkv", "bsd,dkce->bskce", h_BSD, w_DKCE, (*ATTN_KV[:3], None, ATTN_KV[3]), c, placement,
                        h_scale)
    B, S = h_BSD.shape[:2]
    q_BSHE = placement.constrain(qkv_BSKCE[:, :, :, :G].reshape(B, S, H, E), ATTN_Q, "queries")
    return q_BSHE, qkv_BSKCE[:, :, :, G], qkv_BSKCE[:, :, :, G + 1]


def _gate_up(c: ModelConfig, placement: Placement, h_BSD, w: DenseMlpWeights):
    """The SwiGLU gate and up projections of h [B, S, D]: [B, S, F] each, over `mlp`.

    One GEMM where gate and up are stacked on a new axis right after `embed` ([D, 2, F], which no layout splits,
    so the stack is local): as inference holds them (`w.w_gate_up`, `layer_weights.stack_projections`), or stacked
    here from the stored weights where `_fuses` (training, prefill). Otherwise two GEMMs, or with 8-bit weights on
    the weight-only kernel one launch of both (`projections`). Either way under the named scope "gate_up". (A
    routed mixture of experts runs its own grouped gate and up matmuls, `moe.routed_mlp`.)"""
    names, out = ("embed", "mlp"), ("batch", "seq", "mlp")
    if w.w_gate_up is None and not _fuses(c, h_BSD):
        w_gate, w_up = used_together("gate_up", c, placement, [(w.w_gate, w.w_gate_scale, names, "w_gate"),
                                                               (w.w_up, w.w_up_scale, names, "w_up")])
        h_scale = fp8_scale(c, placement, h_BSD)
        h_BSD = placement.shared_input(h_BSD, [values(w_gate), values(w_up)])
        return tuple(projections("gate_up", h_BSD, [("bsd,df->bsf", w_gate, out), ("bsd,df->bsf", w_up, out)], c,
                                 placement, h_scale))
    if w.w_gate_up is None:
        with jax.named_scope("gate_up"):
            w_DTF = weight_at_use(c, placement, stacked_gate_up(w.w_gate, w.w_up), STACKED_GATE_UP_NAMES, "w_gate|w_up")
    else:
        w_DTF = used("gate_up", c, placement, w.w_gate_up, w.w_gate_up_scale, STACKED_GATE_UP_NAMES, "w_gate_up")
    with jax.named_scope("gate_up"):
        h_scale = fp8_scale(c, placement, h_BSD)
        h_BSD = placement.shared_input(h_BSD, [values(w_DTF)])
    both_BSTF = project("gate_up", "bsd,dtf->bstf", h_BSD, w_DTF, ("batch", "seq", None, "mlp"), c, placement,
                        h_scale)
    return both_BSTF[:, :, 0], both_BSTF[:, :, 1]


def _dense_mlp(c: ModelConfig, placement: Placement, h_BSD, w: DenseMlpWeights):
    """SwiGLU: down(silu(h @ gate) * (h @ up)), [B, S, D] -> [B, S, D] with the hidden [B, S, F] over `mlp`; GeGLU
    (GELU's tanh approximation in silu's place) where `c.mlp_activation` is "gelu_tanh"."""
    gate_BSF, up_BSF = _gate_up(c, placement, h_BSD, w)
    w_down_FD = used("down", c, placement, w.w_down, w.w_down_scale, ("mlp", "embed"), "w_down")
    gelu = c.mlp_activation == "gelu_tanh"
    activated_BSF = jax.nn.gelu(gate_BSF, approximate=True) if gelu else jax.nn.silu(gate_BSF)
    return project("down", "bsf,fd->bsd", activated_BSF * up_BSF, w_down_FD, RESIDUAL, c, placement)


def next_token_loss(model: Transformer, tokens_BS: jax.Array, placement: Placement | None = None) -> jax.Array:
    """Mean cross entropy (nats) of predicting tokens[:, 1:] from tokens[:, :-1]; vocab-parallel under a layout;
    plus `load_balance_weight` times the load-balancing loss for a mixture of experts. tokens [B, S + 1] int32,
    placed like a token batch (`batch_sharding`). `placement` as `Transformer.__call__` takes it."""
    placement = placed_by(placement)
    logits_BSV, _, balance = model(tokens_BS[:, :-1], placement=placement)
    targets_BS = placement.constrain(tokens_BS[:, 1:], TOKENS, "targets")
    with jax.named_scope("loss"):
        loss = placement.token_mean(cross_entropy(logits_BSV, targets_BS, placement), TOKENS)
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
