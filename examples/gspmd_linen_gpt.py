"""The GPT-2-style model of examples/gspmd_gpt.py in Linen, written the way Flax's GSPMD guide writes Linen models:
nothing here knows about starscream_jax.

Parameters carry logical names through `nn.with_logical_partitioning`, activations through
`nn.with_logical_constraint`, in the same names as the NNX model (`embed`, `hidden`, `heads`, `head_dim`, `vocab`,
`qkv`; `batch`, `length`); `nn.Embed` tied to the output head through `attend`, `nn.LayerNorm` with scale and bias,
`nn.Einsum` and `nn.Dense` with biases, q/k/v fused in one projection or three, optax's loss.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import optax

from gspmd_gpt import HEADS, HIDDEN, LOGITS, RESIDUAL, Config


def named(initializer, *names):
    return nn.with_logical_partitioning(initializer, names)


KERNEL = nn.initializers.lecun_normal()
ZEROS = nn.initializers.zeros_init()
ONES = nn.initializers.ones_init()


def layer_norm() -> nn.LayerNorm:
    return nn.LayerNorm(scale_init=named(ONES, "embed"), bias_init=named(ZEROS, "embed"))


class Attention(nn.Module):
    """Causal self-attention, x [B, S, D] -> [B, S, D]."""

    config: Config

    @nn.compact
    def __call__(self, x_BSD: jax.Array) -> jax.Array:
        config = self.config
        heads = (config.heads, config.head_dim)
        if config.fused_qkv:
            qkv = nn.Einsum((config.d_model, 3, *heads), "bsd,dthe->bsthe",
                            kernel_init=named(KERNEL, "embed", "qkv", "heads", "head_dim"),
                            bias_init=named(ZEROS, "qkv", "heads", "head_dim"))(x_BSD)
            q, k, v = (qkv[:, :, i] for i in range(3))
        else:
            q, k, v = (nn.Einsum((config.d_model, *heads), "bsd,dhe->bshe",
                                 kernel_init=named(KERNEL, "embed", "heads", "head_dim"),
                                 bias_init=named(ZEROS, "heads", "head_dim"))(x_BSD) for _ in range(3))
        q, k, v = (nn.with_logical_constraint(t, HEADS) for t in (q, k, v))
        causal = nn.make_causal_mask(x_BSD[..., 0])
        attended_BSHE = nn.with_logical_constraint(nn.dot_product_attention(q, k, v, mask=causal), HEADS)
        return nn.Einsum((*heads, config.d_model), "bshe,hed->bsd",
                         kernel_init=named(KERNEL, "heads", "head_dim", "embed"),
                         bias_init=named(ZEROS, "embed"))(attended_BSHE)


class Block(nn.Module):
    """Pre-norm block: x + attention(ln(x)), then x + mlp(ln(x)); x [B, S, D]."""

    config: Config

    @nn.compact
    def __call__(self, x_BSD: jax.Array) -> jax.Array:
        x_BSD = nn.with_logical_constraint(x_BSD + Attention(self.config)(layer_norm()(x_BSD)), RESIDUAL)
        up = nn.Dense(self.config.d_ff, kernel_init=named(KERNEL, "embed", "hidden"), bias_init=named(ZEROS, "hidden"))
        hidden_BSF = nn.with_logical_constraint(jax.nn.gelu(up(layer_norm()(x_BSD))), HIDDEN)
        down = nn.Dense(self.config.d_model, kernel_init=named(KERNEL, "hidden", "embed"),
                        bias_init=named(ZEROS, "embed"))
        return nn.with_logical_constraint(x_BSD + down(hidden_BSF), RESIDUAL)


class GPT(nn.Module):
    """tokens [B, S] int32 -> logits [B, S, V], the output head tied to the embedding table."""

    config: Config

    @nn.compact
    def __call__(self, tokens_BS: jax.Array) -> jax.Array:
        embed = nn.Embed(self.config.vocab, self.config.d_model,
                         embedding_init=named(nn.initializers.normal(0.5), "vocab", "embed"))
        x_BSD = nn.with_logical_constraint(embed(tokens_BS), RESIDUAL)
        for _ in range(self.config.layers):
            x_BSD = Block(self.config)(x_BSD)
        return nn.with_logical_constraint(embed.attend(layer_norm()(x_BSD)), LOGITS)


def loss_fn(params, model: GPT, tokens_BS: jax.Array) -> jax.Array:
    """Mean next-token cross entropy (nats) of tokens [B, S]."""
    logits_BSV = model.apply(params, tokens_BS[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits_BSV, tokens_BS[:, 1:]).mean()
