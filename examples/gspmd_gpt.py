"""A GPT-2-style model written the way Flax's GSPMD guide writes models: nothing here knows about starscream_jax.

Parameters carry logical names through `nnx.with_partitioning` (Flax's `out_sharding` metadata), activations through
Linen's `nn.with_logical_constraint` (which reads the `logical_axis_rules` context NNX shares; none with
`Config(constraints=False)`, as many GSPMD models are written), and the loss is optax's. The names are the model's
own: `embed`, `hidden`, `heads`, `head_dim`, `vocab`, `qkv`; `batch`, `length` for the tokens. Flax's layers as they
ship: `nnx.Embed` (tied: the output head is `attend`), `nnx.LayerNorm` with scale and bias, `nnx.Linear` and
`nnx.LinearGeneral` with biases, GELU, and q/k/v fused in one projection or three.
"""
from __future__ import annotations

from dataclasses import dataclass

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx

RESIDUAL = ("batch", "length", "embed")
HEADS = ("batch", "length", "heads", "head_dim")
HIDDEN = ("batch", "length", "hidden")
LOGITS = ("batch", "length", "vocab")


@dataclass(frozen=True, kw_only=True)
class Config:
    vocab: int = 64
    d_model: int = 32
    heads: int = 4
    d_ff: int = 128
    layers: int = 2
    fused_qkv: bool = True
    constraints: bool = True  # False: no activation constraint anywhere, as many GSPMD models are written

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads


def constrained(config: Config, x: jax.Array, names: tuple[str, ...]) -> jax.Array:
    """x placed by the logical `names` through Flax's rules, or x itself for a model written without constraints."""
    return nn.with_logical_constraint(x, names) if config.constraints else x


def named(initializer, *names):
    return nnx.with_partitioning(initializer, names)


KERNEL = nnx.initializers.lecun_normal()
ZEROS = nnx.initializers.zeros_init()
ONES = nnx.initializers.ones_init()


def layer_norm(config: Config, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(config.d_model, scale_init=named(ONES, "embed"), bias_init=named(ZEROS, "embed"), rngs=rngs)


class Attention(nnx.Module):
    """Causal self-attention, x [B, S, D] -> [B, S, D]; q/k/v from one [D, 3, H, E] projection or three [D, H, E]."""

    def __init__(self, config: Config, rngs: nnx.Rngs):
        self.config = config
        heads = (config.heads, config.head_dim)
        if config.fused_qkv:
            self.qkv = nnx.LinearGeneral(config.d_model, (3, *heads),
                                         kernel_init=named(KERNEL, "embed", "qkv", "heads", "head_dim"),
                                         bias_init=named(ZEROS, "qkv", "heads", "head_dim"), rngs=rngs)
        else:
            self.q, self.k, self.v = (nnx.LinearGeneral(config.d_model, heads,
                                                        kernel_init=named(KERNEL, "embed", "heads", "head_dim"),
                                                        bias_init=named(ZEROS, "heads", "head_dim"), rngs=rngs)
                                      for _ in range(3))
        self.out = nnx.LinearGeneral(heads, config.d_model, axis=(-2, -1),
                                     kernel_init=named(KERNEL, "heads", "head_dim", "embed"),
                                     bias_init=named(ZEROS, "embed"), rngs=rngs)

    def __call__(self, x_BSD: jax.Array) -> jax.Array:
        if hasattr(self, "qkv"):
            q, k, v = (self.qkv(x_BSD)[:, :, i] for i in range(3))
        else:
            q, k, v = self.q(x_BSD), self.k(x_BSD), self.v(x_BSD)
        q, k, v = (constrained(self.config, t, HEADS) for t in (q, k, v))
        attended_BSHE = constrained(self.config, nnx.dot_product_attention(q, k, v, is_causal=True), HEADS)
        return self.out(attended_BSHE)


class Block(nnx.Module):
    """Pre-norm block: x + attention(ln(x)), then x + mlp(ln(x)); x [B, S, D]."""

    def __init__(self, config: Config, rngs: nnx.Rngs):
        self.config = config
        self.ln_1 = layer_norm(config, rngs)
        self.attention = Attention(config, rngs)
        self.ln_2 = layer_norm(config, rngs)
        self.up = nnx.Linear(config.d_model, config.d_ff, kernel_init=named(KERNEL, "embed", "hidden"),
                             bias_init=named(ZEROS, "hidden"), rngs=rngs)
        self.down = nnx.Linear(config.d_ff, config.d_model, kernel_init=named(KERNEL, "hidden", "embed"),
                               bias_init=named(ZEROS, "embed"), rngs=rngs)

    def __call__(self, x_BSD: jax.Array) -> jax.Array:
        x_BSD = constrained(self.config, x_BSD + self.attention(self.ln_1(x_BSD)), RESIDUAL)
        hidden_BSF = constrained(self.config, jax.nn.gelu(self.up(self.ln_2(x_BSD))), HIDDEN)
        return constrained(self.config, x_BSD + self.down(hidden_BSF), RESIDUAL)


class GPT(nnx.Module):
    """tokens [B, S] int32 -> logits [B, S, V], the output head tied to the embedding table."""

    def __init__(self, config: Config, rngs: nnx.Rngs):
        self.config = config
        self.embed = nnx.Embed(config.vocab, config.d_model,
                               embedding_init=named(nnx.initializers.normal(0.5), "vocab", "embed"), rngs=rngs)
        self.blocks = nnx.List([Block(config, rngs) for _ in range(config.layers)])
        self.ln_f = layer_norm(config, rngs)

    def embed_tokens(self, tokens_BS: jax.Array) -> jax.Array:
        """The rows of the embedding table for tokens [B, S]: [B, S, D]."""
        return self.embed(tokens_BS)

    def __call__(self, tokens_BS: jax.Array) -> jax.Array:
        x_BSD = constrained(self.config, self.embed_tokens(tokens_BS), RESIDUAL)
        for block in self.blocks:
            x_BSD = block(x_BSD)
        return constrained(self.config, self.embed.attend(self.ln_f(x_BSD)), LOGITS)


def loss_fn(model: GPT, tokens_BS: jax.Array) -> jax.Array:
    """Mean next-token cross entropy (nats) of tokens [B, S]."""
    logits_BSV = model(tokens_BS[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits_BSV, tokens_BS[:, 1:]).mean()


def train_step(model: GPT, optimizer: nnx.Optimizer, tokens_BS: jax.Array) -> jax.Array:
    """One optimizer step; returns the loss."""
    loss, grads = nnx.value_and_grad(loss_fn)(model, tokens_BS)
    optimizer.update(model, grads)
    return loss


def batch(step: int, size: int = 8, length: int = 9, vocab: int = 64) -> jax.Array:
    """Token sequences [B, S] counting up by one modulo the vocabulary from a random start: learnable."""
    starts = jax.random.randint(jax.random.fold_in(jax.random.key(0), step), (size, 1), 0, vocab)
    return (starts + jnp.arange(length)) % vocab
