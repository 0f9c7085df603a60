"""A Llama-family decoder in Flax NNX whose every tensor carries logical axis names.

Shapes use letters: B batch, S query positions, T key positions (cache length), D d_model, H query heads, K kv heads,
G = H / K, E head_dim (and experts count in MoE), F d_ff, V vocab, L layers. Layers are stacked on a leading `layers`
axis and run with `jax.lax.scan`, so compile time does not grow with depth. Under `use_layout(layout, mesh)` every
weight, activation and the KV cache is placed by the layout; outside it the same code runs unsharded.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from .config import ModelConfig
from .layouts import Layout
from .ops import attention, cross_entropy, embed_lookup
from .sharding import (constrain, create_sharded, einsum, param, scale, shared_input, token_mean, use_layout,
                       weight)

ATTN_Q = ("attn_batch", "seq", "heads", "head_dim")
ATTN_KV = ("attn_batch", "seq", "kv_heads", "head_dim")
RESIDUAL = ("batch", "seq", "embed")


def _normal(rngs: nnx.Rngs, shape, fan_in: int) -> jax.Array:
    return jax.random.normal(rngs.params(), shape, jnp.float32) * fan_in ** -0.5


def rms_norm(x_BSD: jax.Array, scale_D: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in float32, returned in x's dtype."""
    x32 = x_BSD.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return scale(normed, scale_D, ("norm",), "norm scale").astype(x_BSD.dtype)


def rope(x_BSNE: jax.Array, positions_BS: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding (rotate-half form) of queries or keys at integer positions."""
    half = x_BSNE.shape[-1] // 2
    inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
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
        self.mlp_norm = param(jnp.ones((L, D)), ("layers", "norm"))
        if c.n_experts:
            X = c.n_experts
            self.router = param(_normal(rngs, (L, D, X), D), ("layers", "embed", "experts"))
            self.w_gate = param(_normal(rngs, (L, X, D, F), D), ("layers", "experts", "embed", "mlp"))
            self.w_up = param(_normal(rngs, (L, X, D, F), D), ("layers", "experts", "embed", "mlp"))
            self.w_down = param(_normal(rngs, (L, X, F, D), F), ("layers", "experts", "mlp", "embed"))
        else:
            self.w_gate = param(_normal(rngs, (L, D, F), D), ("layers", "embed", "mlp"))
            self.w_up = param(_normal(rngs, (L, D, F), D), ("layers", "embed", "mlp"))
            self.w_down = param(_normal(rngs, (L, F, D), F), ("layers", "mlp", "embed"))


class Transformer(nnx.Module):
    """tokens [B, S] int32 -> logits [B, S, V] float32 (and the updated KV cache when one is given)."""

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
                 cache: dict | None = None, cache_index: jax.Array | int = 0):
        c = self.config
        dtype = jnp.dtype(c.dtype)
        if positions_BS is None:
            positions_BS = jnp.broadcast_to(jnp.arange(tokens_BS.shape[1]) + cache_index, tokens_BS.shape)
        table = weight(self.embedding[...], ("vocab", "embed"), dtype, "embedding")
        x_BSD = embed_lookup(table, tokens_BS, out=RESIDUAL)
        stacked = {name: getattr(self.layers, name)[...] for name in _layer_weight_names(c)}
        x_BSD, new_cache = self._run_layers(x_BSD, stacked, positions_BS, cache, cache_index)
        x_BSD = rms_norm(x_BSD, self.final_norm[...], c.norm_eps)
        if c.tie_embeddings:
            logits = einsum("bsd,vd->bsv", x_BSD, table, out=("batch", "seq", "vocab"), tensor="logits")
        else:
            head = weight(self.lm_head[...], ("embed", "vocab"), dtype, "lm_head")
            logits = einsum("bsd,dv->bsv", x_BSD, head, out=("batch", "seq", "vocab"), tensor="logits")
        logits = logits.astype(jnp.float32)
        return logits if cache is None else (logits, new_cache)

    def _run_layers(self, x_BSD, stacked, positions_BS, cache, cache_index):
        c = self.config
        positions_BS = constrain(positions_BS, ("attn_batch", "seq"), "positions")

        def block(x_BSD, layer):
            w, layer_cache = layer
            x_BSD, layer_cache = _block(c, x_BSD, w, positions_BS, layer_cache, cache_index)
            return x_BSD, layer_cache

        if c.remat:
            block = jax.checkpoint(block, policy=jax.checkpoint_policies.nothing_saveable)
        return jax.lax.scan(block, x_BSD, (stacked, cache))


def _layer_weight_names(c: ModelConfig) -> list[str]:
    names = ["attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down"]
    return names + (["router"] if c.n_experts else [])


def _block(c: ModelConfig, x_BSD, w, positions_BS, layer_cache, cache_index):
    """One pre-norm block: x + attention(norm(x)), then + mlp(norm(x))."""
    dtype = jnp.dtype(c.dtype)
    h_BSD = rms_norm(x_BSD, w["attn_norm"], c.norm_eps)
    wq = weight(w["wq"], ("embed", "heads", "head_dim"), dtype, "wq")
    wk = weight(w["wk"], ("embed", "kv_heads", "head_dim"), dtype, "wk")
    wv = weight(w["wv"], ("embed", "kv_heads", "head_dim"), dtype, "wv")
    h_BSD = shared_input(h_BSD, [wq, wk, wv])
    q = einsum("bsd,dhe->bshe", h_BSD, wq, ATTN_Q, "q")
    k = einsum("bsd,dke->bske", h_BSD, wk, ATTN_KV, "k")
    v = einsum("bsd,dke->bske", h_BSD, wv, ATTN_KV, "v")
    q, k = rope(q, positions_BS, c.rope_theta), rope(k, positions_BS, c.rope_theta)
    attended, layer_cache = attention(q, k, v, positions_BS, layer_cache, cache_index)
    attended = constrain(attended, ("batch", "seq", "heads", "head_dim"), "attention output")
    wo = weight(w["wo"], ("heads", "head_dim", "embed"), dtype, "wo")
    x_BSD = x_BSD + einsum("bshe,hed->bsd", attended, wo, RESIDUAL, "attention projection")
    h_BSD = rms_norm(x_BSD, w["mlp_norm"], c.norm_eps)
    mlp = _moe_mlp(c, h_BSD, w) if c.n_experts else _dense_mlp(c, h_BSD, w)
    return x_BSD + mlp, layer_cache


def _dense_mlp(c: ModelConfig, h_BSD, w):
    """SwiGLU: down(silu(h @ gate) * (h @ up))."""
    dtype = jnp.dtype(c.dtype)
    w_gate = weight(w["w_gate"], ("embed", "mlp"), dtype, "w_gate")
    w_up = weight(w["w_up"], ("embed", "mlp"), dtype, "w_up")
    h_BSD = shared_input(h_BSD, [w_gate, w_up])
    gate = einsum("bsd,df->bsf", h_BSD, w_gate, ("batch", "seq", "mlp"), "mlp gate")
    up = einsum("bsd,df->bsf", h_BSD, w_up, ("batch", "seq", "mlp"), "mlp up")
    down = weight(w["w_down"], ("mlp", "embed"), dtype, "w_down")
    return einsum("bsf,fd->bsd", jax.nn.silu(gate) * up, down, RESIDUAL, "mlp down")


def _moe_mlp(c: ModelConfig, h_BSD, w):
    """Top-k routed SwiGLU experts, computed densely (every expert sees every token, weighted by its gate, zero for
    unrouted experts): exact and simple; FLOPs are n_experts / experts_per_token times a routed implementation."""
    dtype = jnp.dtype(c.dtype)
    router = weight(w["router"], ("embed", "experts"), jnp.float32, "router")
    logits_BSX = einsum("bsd,dx->bsx", h_BSD.astype(jnp.float32), router, ("batch", "seq", "experts"), "router")
    top_values, top_index = jax.lax.top_k(logits_BSX, c.experts_per_token)
    top_gates = jax.nn.softmax(top_values, axis=-1)
    chosen = top_index[..., None] == jnp.arange(c.n_experts)  # [B, S, k, X]
    gates_BSX = jnp.sum(jnp.where(chosen, top_gates[..., None], 0.0), axis=-2).astype(dtype)
    names = ("experts", "embed", "mlp")
    w_gate, w_up = weight(w["w_gate"], names, dtype, "w_gate"), weight(w["w_up"], names, dtype, "w_up")
    h_BSD = shared_input(h_BSD, [w_gate, w_up])
    gate = einsum("bsd,xdf->bsxf", h_BSD, w_gate, ("batch", "seq", "experts", "mlp"), "expert gate")
    up = einsum("bsd,xdf->bsxf", h_BSD, w_up, ("batch", "seq", "experts", "mlp"), "expert up")
    hidden = jax.nn.silu(gate) * up * gates_BSX[..., None]
    down = weight(w["w_down"], ("experts", "mlp", "embed"), dtype, "w_down")
    return einsum("bsxf,xfd->bsd", hidden, down, RESIDUAL, "expert down")


def init_cache(config: ModelConfig, batch: int, max_len: int) -> dict:
    """An empty KV cache {"k", "v"}: [L, B, T, K, E] each, in the compute dtype, placed by the active layout
    (kv heads over gpu and batch over xcd under the starscream layouts)."""
    shape = (config.n_layers, batch, max_len, config.n_kv_heads, config.head_dim)
    names = ("layers", "attn_batch", "seq", "kv_heads", "head_dim")
    zeros = jnp.zeros(shape, jnp.dtype(config.dtype))
    return {"k": constrain(zeros, names, "kv cache"), "v": constrain(zeros, names, "kv cache")}


def next_token_loss(model: Transformer, tokens_BS: jax.Array) -> jax.Array:
    """Mean cross entropy (nats) of predicting tokens[:, 1:] from tokens[:, :-1]; vocab-parallel under a layout."""
    logits_BSV = model(tokens_BS[:, :-1])
    targets = constrain(tokens_BS[:, 1:], ("batch", "seq"), "targets")
    return token_mean(cross_entropy(logits_BSV, targets), ("batch", "seq"))


def create_sharded_model(config: ModelConfig, layout: Layout | str, mesh, seed: int = 0) -> Transformer:
    """A Transformer whose parameters are created already sharded by the layout's params rules."""
    return create_sharded(lambda: Transformer(config, rngs=nnx.Rngs(seed)), layout, mesh)


def batch_sharding(layout: Layout | str, mesh, batch_size: int | None = None) -> jax.sharding.NamedSharding:
    """Where a [B, S] token batch goes under the layout: B over the layout's `batch` axes. With `batch_size` the
    divisibility is checked, so a batch the mesh cannot split is a clear error."""
    from .layouts import get_layout
    from .rules import resolve

    layout = get_layout(layout)
    found, axes = layout.activations.lookup("batch")
    spec = jax.sharding.PartitionSpec(axes or None, None)
    if batch_size is not None:
        spec = resolve(("batch", None), (batch_size, 1), layout.activations, mesh, "token batch",
                       f"activation rules of {layout.name}")
    return jax.sharding.NamedSharding(mesh, spec)


__all__ = ["Transformer", "LayerStack", "create_sharded_model", "init_cache", "next_token_loss", "batch_sharding",
           "use_layout", "rms_norm", "rope"]
