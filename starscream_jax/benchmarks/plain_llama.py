"""The plain JAX Llama the benchmarks run beside the library: pure functions over a params dict, the way a JAX user
writes the model without this library.

params: {"embedding" [V, D], "final_norm" [D], "layers": {"attn_norm" [L, D], "wq" [L, D, H, E], "wk" / "wv"
[L, D, K, E], "wo" [L, H, E, D], "mlp_norm" [L, D], "w_gate" / "w_up" [L, D, F], "w_down" [L, F, D]}, and
"lm_head" [D, V] unless the embeddings are tied} (`nnx.to_pure_dict` of the library model's parameters); matrices
are used in the compute dtype, norm scales in float32.

  `plain_loss`          training's next-token loss, `lax.scan` over the stacked layers, with ordinary sharding
                        annotations for plain data, tensor (Megatron) or fully sharded data parallelism
                        (`plain_param_specs`, `with_sharding_constraint` on one flat mesh axis, PLAIN_AXIS);
  `plain_decode_step`   one greedy decode step over a dense KV cache of one [B, T, K, E] pair per layer
                        (`plain_cache`), written in place (`lax.dynamic_update_slice`, the cache donated), the
                        layers a Python loop over the weights split per layer once (`plain_decode_weights`): what a
                        JAX user writes for decode, where a scan over stacked weights and a stacked cache has XLA
                        copy each layer's slice out of its stack every step.
Attention is `jax.nn.dot_product_attention` with the implementation the caller names (cuDNN on NVIDIA GPUs).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec

PLAIN_AXIS = "devices"
PLAIN_ACTIVATIONS = {"tp": {"heads": (None, None, PLAIN_AXIS, None), "hidden": (None, None, PLAIN_AXIS),
                            "residual": ()},
                     "fsdp": {"weight": ()}}
"""The constraints each plain parallelism puts on activations (by kind) and on weights at use ("weight")."""


PLAIN_LLAMA = {"n_experts": 0, "qkv_bias": False, "qk_norm": False, "rope_scaling": "", "mlp_activation": "silu",
               "norm_plus_one": False, "post_norms": False, "scale_embedding": False, "attn_softcap": 0.0,
               "logit_softcap": 0.0, "query_pre_attn_scalar": 0.0, "sliding_window": 0}
"""The model options the plain Llama computes: each at this value (the library's other models differ in one)."""


def plain_differences(config) -> list[str]:
    """The options of `config` the plain Llama does not compute (`PLAIN_LLAMA`), as "name = value"; empty for a
    plain Llama, the only model its figures stand beside."""
    return [f"{name} = {getattr(config, name)!r}" for name, plain in PLAIN_LLAMA.items()
            if getattr(config, name) != plain]


def plain_rms_norm(x_BSD, scale_D, eps: float):
    """RMSNorm in float32, returned in x's dtype."""
    x32 = x_BSD.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps) * scale_D).astype(x_BSD.dtype)


def plain_rope(x_BSNE, cos_BSE, sin_BSE):
    """Rotate-half rotary embedding in float32; cos / sin are [B or 1, S, E/2]."""
    half = x_BSNE.shape[-1] // 2
    cos, sin = cos_BSE[:, :, None, :], sin_BSE[:, :, None, :]
    x1, x2 = x_BSNE[..., :half].astype(jnp.float32), x_BSNE[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_BSNE.dtype)


def plain_angles(config, positions_BS):
    """(cos, sin) [B, S, E/2] of the rotary embedding at `positions` [B, S]."""
    half = config.head_dim // 2
    inv_freq = config.rope_theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles_BSE = positions_BS.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles_BSE), jnp.sin(angles_BSE)


def _plain_mlp(h_BSD, w):
    """SwiGLU's hidden [B, S, F]: silu(h @ gate) * (h @ up) (the down projection is the caller's)."""
    return jax.nn.silu(jnp.einsum("bsd,df->bsf", h_BSD, w["w_gate"])) * jnp.einsum("bsd,df->bsf", h_BSD, w["w_up"])


def _plain_logits(params: dict, x_BSD, table_VD, config):
    """The final norm and the vocabulary projection (the tied table, or lm_head), float32 logits [B, S, V]."""
    x_BSD = plain_rms_norm(x_BSD, params["final_norm"], config.norm_eps)
    if config.tie_embeddings:
        return jnp.einsum("bsd,vd->bsv", x_BSD, table_VD).astype(jnp.float32)
    return jnp.einsum("bsd,dv->bsv", x_BSD, params["lm_head"].astype(table_VD.dtype)).astype(jnp.float32)


def _compute_layers(params: dict, dtype) -> dict:
    """The stacked layer weights as the layers use them: matrices in `dtype`, norm scales as stored."""
    return {name: w if "norm" in name else w.astype(dtype) for name, w in params["layers"].items()}


def plain_loss(params: dict, tokens_BS1, config, attention_impl: str | None, parallelism: str = "dp"):
    """Mean next-token cross entropy (nats) of the Llama `config` on tokens [B, S+1] int32.

    parallelism (ordinary sharding annotations, `jax.lax.with_sharding_constraint` on the mesh axis PLAIN_AXIS; the
    parameters are placed by `plain_param_specs`): "dp" none (data parallelism: the batch placed over the devices);
    "tp" Megatron tensor parallelism (heads and the MLP hidden over the devices, the residual stream replicated);
    "fsdp" each weight gathered whole just before its layer uses it (stored split over the devices)."""
    dtype = jnp.dtype(config.dtype)
    tokens_BS, targets_BS = tokens_BS1[:, :-1], tokens_BS1[:, 1:]
    cos_BSE, sin_BSE = plain_angles(config, jnp.arange(tokens_BS.shape[1])[None, :])
    place = functools.partial(_plain_place, parallelism)

    def block(x_BSD, w):
        w = {name: place(value, "weight") for name, value in w.items()}
        h = plain_rms_norm(x_BSD, w["attn_norm"], config.norm_eps)
        q = place(plain_rope(jnp.einsum("bsd,dhe->bshe", h, w["wq"]), cos_BSE, sin_BSE), "heads")
        k = place(plain_rope(jnp.einsum("bsd,dke->bske", h, w["wk"]), cos_BSE, sin_BSE), "heads")
        v = place(jnp.einsum("bsd,dke->bske", h, w["wv"]), "heads")
        attended = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=attention_impl)
        x_BSD = place(x_BSD + jnp.einsum("bshe,hed->bsd", place(attended, "heads"), w["wo"]), "residual")
        h = plain_rms_norm(x_BSD, w["mlp_norm"], config.norm_eps)
        hidden = place(_plain_mlp(h, w), "hidden")
        return place(x_BSD + jnp.einsum("bsf,fd->bsd", hidden, w["w_down"]), "residual"), None

    if config.remat:
        block = jax.checkpoint(block, policy=jax.checkpoint_policies.nothing_saveable)

    table_VD = place(params["embedding"].astype(dtype), "weight")
    x_BSD, _ = jax.lax.scan(block, place(table_VD[tokens_BS], "residual"), _compute_layers(params, dtype),
                            unroll=config.scan_unroll or 1)
    if not config.tie_embeddings:
        params = {**params, "lm_head": place(params["lm_head"].astype(dtype), "weight")}
    logits_BSV = _plain_logits(params, x_BSD, table_VD, config)
    return optax.softmax_cross_entropy_with_integer_labels(logits_BSV, targets_BS).mean()


def plain_cache(config, batch: int, length: int) -> list[dict]:
    """An empty dense KV cache: per layer {"k", "v"}, [B, T, K, E] each, in the compute dtype."""
    shape = (batch, length, config.n_kv_heads, config.head_dim)
    return [{name: jnp.zeros(shape, jnp.dtype(config.dtype)) for name in ("k", "v")} for _ in range(config.n_layers)]


def plain_decode_weights(params: dict, dtype) -> dict:
    """`params` as the plain decode step takes them: "layers" a list of per-layer dicts (each stack split once),
    matrices in `dtype`, norm scales as stored. The stacked arrays are no longer referenced by the result."""
    layers = _compute_layers(params, dtype)
    count = next(iter(layers.values())).shape[0]
    per_layer = [{name: w[index] for name, w in layers.items()} for index in range(count)]
    held = {name: w.astype(dtype) if name in ("embedding", "lm_head") else w
            for name, w in params.items() if name != "layers"}
    return {**held, "layers": per_layer}


def plain_decode_step(config, attention_impl: str | None):
    """step(weights, cache, token [B] int32, position [] int32) -> (the greedy next token [B], the cache with the
    token's keys and values written at `position`), jitted, the cache donated. `weights`: `plain_decode_weights`;
    `cache`: `plain_cache`. Every row is at the same position; attention reads the cache's first position + 1
    entries (`key_value_seq_lengths`)."""

    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(weights, cache, token_B, position):
        batch = token_B.shape[0]
        cos_BSE, sin_BSE = plain_angles(config, jnp.full((batch, 1), position))
        lengths_B = jnp.full((batch,), position + 1, jnp.int32)
        table_VD = weights["embedding"]
        x_BSD, written = table_VD[token_B][:, None], []
        for w, layer_cache in zip(weights["layers"], cache):
            h = plain_rms_norm(x_BSD, w["attn_norm"], config.norm_eps)
            q = plain_rope(jnp.einsum("bsd,dhe->bshe", h, w["wq"]), cos_BSE, sin_BSE)
            k = plain_rope(jnp.einsum("bsd,dke->bske", h, w["wk"]), cos_BSE, sin_BSE)
            v = jnp.einsum("bsd,dke->bske", h, w["wv"])
            k_BTKE = jax.lax.dynamic_update_slice(layer_cache["k"], k, (0, position, 0, 0))
            v_BTKE = jax.lax.dynamic_update_slice(layer_cache["v"], v, (0, position, 0, 0))
            attended = jax.nn.dot_product_attention(q, k_BTKE, v_BTKE, key_value_seq_lengths=lengths_B,
                                                    implementation=attention_impl)
            x_BSD = x_BSD + jnp.einsum("bshe,hed->bsd", attended, w["wo"])
            h = plain_rms_norm(x_BSD, w["mlp_norm"], config.norm_eps)
            x_BSD = x_BSD + jnp.einsum("bsf,fd->bsd", _plain_mlp(h, w), w["w_down"])
            written.append({"k": k_BTKE, "v": v_BTKE})
        logits_BV = _plain_logits(weights, x_BSD, table_VD, config)[:, 0]
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32), written

    return step


def _plain_place(parallelism: str, x, kind: str):
    """`x` constrained to the PartitionSpec `PLAIN_ACTIVATIONS` gives its kind (unchanged where none is given)."""
    spec = PLAIN_ACTIVATIONS.get(parallelism, {}).get(kind)
    if spec is None or (kind == "weight" and x.ndim < 2):
        return x
    return jax.lax.with_sharding_constraint(x, PartitionSpec(*spec))


def plain_param_specs(params: dict, parallelism: str) -> dict:
    """PartitionSpecs of the plain params dict: replicated ("dp"); Megatron's split ("tp": q/k/v and gate/up by
    output, o and down by input, the vocabulary of the embedding and head); the embed (d_model) dimension of every
    matrix ("fsdp")."""
    tp = {"embedding": (PLAIN_AXIS, None), "lm_head": (None, PLAIN_AXIS), "wq": (None, None, PLAIN_AXIS, None),
          "wk": (None, None, PLAIN_AXIS, None), "wv": (None, None, PLAIN_AXIS, None),
          "wo": (None, PLAIN_AXIS, None, None), "w_gate": (None, None, PLAIN_AXIS),
          "w_up": (None, None, PLAIN_AXIS), "w_down": (None, PLAIN_AXIS, None)}
    fsdp = {"embedding": (None, PLAIN_AXIS), "lm_head": (PLAIN_AXIS, None), "wq": (None, PLAIN_AXIS, None, None),
            "wk": (None, PLAIN_AXIS, None, None), "wv": (None, PLAIN_AXIS, None, None),
            "wo": (None, None, None, PLAIN_AXIS), "w_gate": (None, PLAIN_AXIS, None),
            "w_up": (None, PLAIN_AXIS, None), "w_down": (None, None, PLAIN_AXIS)}
    table = {"tp": tp, "fsdp": fsdp}.get(parallelism, {})

    def spec(path, _):
        name = str(getattr(path[-1], "key", path[-1]))
        return PartitionSpec(*table.get(name, ()))

    return jax.tree_util.tree_map_with_path(spec, params)
