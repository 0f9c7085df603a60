"""A transformer made only of Flax NNX's own layers, annotated the standard Flax way, placed by a starscream layout.

The parameters carry logical names in Flax's `out_sharding` metadata (`nnx.with_partitioning(init, names)` given to
each layer as its `*_init`), in MaxText's vocabulary (`embed`, `mlp`, `heads`, `kv`, `vocab`, `norm`); activations
are placed by name through the `out_sharding` argument Flax's layers take (`activation_spec` of their logical names:
`activation_batch`, `activation_length`, `activation_embed`, ...) or `constrain`; both are the identity outside a
layout. Nothing else in the model knows about sharding: `nnx.Embed`, `nnx.RMSNorm`, `nnx.Einsum`,
`nnx.Linear` and `nnx.dot_product_attention` as Flax ships them.

What the layout adds is three lines: in `main`, the layout in MaxText's names (`in_vocabulary`) and the model created
already sharded (`create_sharded`); in the loss, `weights_at_use(model)`, which gathers each weight inside the GPU
as Flax's layers read it and reduces its gradient in two stages; and what explicit sharding itself asks for: the
`out_sharding` of each layer and the loss on vocabulary-split logits (`cross_entropy`; docs/flax_models.md).

    python examples/flax_nnx_model.py        # trains a few steps on 2 simulated GPUs x 4 partitions, then checks
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from starscream_jax import (
    MAXTEXT,
    activation_spec,
    build_mesh,
    check,
    constrain,
    create_sharded,
    cross_entropy,
    in_vocabulary,
    simulate_cpu_devices,
    use_layout,
    weights_at_use,
)

TOKENS = ("activation_batch", "activation_length")
RESIDUAL = ("activation_batch", "activation_length", "activation_embed")
HEADS = ("activation_batch", "activation_length", "activation_heads", "activation_kv")
HIDDEN = ("activation_batch", "activation_length", "activation_mlp")
LOGITS = ("activation_batch", "activation_length", "activation_vocab")


def placed(names: tuple[str, ...], *shape: int):
    """Where the layout puts an activation of `shape` whose dimensions carry the logical `names`: the `out_sharding`
    Flax's layers take (None, Flax's default, outside a layout)."""
    return activation_spec(names, shape)


def init(names: tuple[str, ...], initializer=nnx.initializers.lecun_normal()):
    """A Flax initializer whose variable carries the logical `names` (Flax's `out_sharding` metadata)."""
    return nnx.with_partitioning(initializer, names)


class Block(nnx.Module):
    """One pre-norm transformer block: x + attention(norm(x)), then x + mlp(norm(x)); x [B, S, D]."""

    def __init__(self, d_model: int, heads: int, head_dim: int, d_ff: int, *, rngs: nnx.Rngs):
        ones = nnx.initializers.ones_init()
        self.attn_norm = nnx.RMSNorm(d_model, scale_init=init(("norm",), ones), rngs=rngs)
        projection = dict(kernel_shape=(d_model, heads, head_dim), kernel_init=init(("embed", "heads", "kv")),
                          rngs=rngs)
        self.q = nnx.Einsum("bsd,dhe->bshe", **projection)
        self.k = nnx.Einsum("bsd,dhe->bshe", **projection)
        self.v = nnx.Einsum("bsd,dhe->bshe", **projection)
        self.o = nnx.Einsum("bshe,hed->bsd", (heads, head_dim, d_model), kernel_init=init(("heads", "kv", "embed")),
                            rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(d_model, scale_init=init(("norm",), ones), rngs=rngs)
        self.up = nnx.Linear(d_model, d_ff, use_bias=False, kernel_init=init(("embed", "mlp")), rngs=rngs)
        self.down = nnx.Linear(d_ff, d_model, use_bias=False, kernel_init=init(("mlp", "embed")), rngs=rngs)

    def __call__(self, x_BSD: jax.Array) -> jax.Array:
        B, S, D = x_BSD.shape
        heads, head_dim = self.q.kernel.shape[1:]
        h_BSD = self.attn_norm(x_BSD)
        q, k, v = (projection(h_BSD, out_sharding=placed(HEADS, B, S, heads, head_dim))
                   for projection in (self.q, self.k, self.v))
        attended_BSHE = constrain(nnx.dot_product_attention(q, k, v, is_causal=True), HEADS)
        x_BSD = x_BSD + self.o(attended_BSHE, out_sharding=placed(RESIDUAL, B, S, D))
        hidden_BSF = jax.nn.gelu(self.up(self.mlp_norm(x_BSD), out_sharding=placed(HIDDEN, B, S, self.up.out_features)))
        return x_BSD + self.down(hidden_BSF, out_sharding=placed(RESIDUAL, B, S, D))


class Transformer(nnx.Module):
    """tokens [B, S] int32 -> logits [B, S, V]."""

    def __init__(self, vocab: int = 64, d_model: int = 32, heads: int = 8, head_dim: int = 4, d_ff: int = 64,
                 layers: int = 2, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, d_model, embedding_init=init(("vocab", "embed"), nnx.initializers.normal(1.0)),
                               rngs=rngs)
        self.blocks = nnx.List([Block(d_model, heads, head_dim, d_ff, rngs=rngs) for _ in range(layers)])
        self.final_norm = nnx.RMSNorm(d_model, scale_init=init(("norm",), nnx.initializers.ones_init()), rngs=rngs)
        self.head = nnx.Linear(d_model, vocab, use_bias=False, kernel_init=init(("embed", "vocab")), rngs=rngs)

    def __call__(self, tokens_BS: jax.Array) -> jax.Array:
        B, S = tokens_BS.shape
        x_BSD = self.embed(tokens_BS, out_sharding=placed(RESIDUAL, B, S, self.embed.features))
        for block in self.blocks:
            x_BSD = block(x_BSD)
        return self.head(self.final_norm(x_BSD), out_sharding=placed(LOGITS, B, S, self.head.out_features))


def next_token_loss(logits_BSV: jax.Array, tokens_BS: jax.Array) -> jax.Array:
    """Mean cross entropy (nats) of logits [B, S - 1, V] against the next tokens, computed where the vocabulary-split
    logits live (`cross_entropy`: optax's gathers from them, which explicit sharding refuses)."""
    return jnp.mean(cross_entropy(logits_BSV, tokens_BS[:, 1:]))


def loss_fn(model: Transformer, tokens_BS: jax.Array) -> jax.Array:
    """The next-token loss of tokens [B, S], the weights taken as the layout uses them (`weights_at_use`)."""
    tokens_BS = constrain(tokens_BS, TOKENS)
    return next_token_loss(weights_at_use(model)(tokens_BS[:, :-1]), tokens_BS)


def train_step(model: Transformer, optimizer: nnx.Optimizer, tokens_BS: jax.Array) -> jax.Array:
    """One AdamW step; returns the loss."""
    loss, grads = nnx.value_and_grad(loss_fn)(model, tokens_BS)
    optimizer.update(model, grads)
    return loss


def batches(step: int, batch: int = 16, seq: int = 17, vocab: int = 64) -> jax.Array:
    """Token sequences [B, S] that count up by one modulo the vocabulary from a random start: learnable."""
    starts = jax.random.randint(jax.random.fold_in(jax.random.key(0), step), (batch, 1), 0, vocab)
    return (starts + jnp.arange(seq)) % vocab


def main(layout: str = "starscream_tp", steps: int = 6) -> tuple[list[float], object]:
    """Trains the transformer under `layout` (in MaxText's names) on 2 simulated GPUs x 4 partitions; returns the
    losses and `check`'s verdict on the train step."""
    simulate_cpu_devices(8)
    mesh = build_mesh("2x4")
    placed = in_vocabulary(layout, MAXTEXT)
    model = create_sharded(lambda: Transformer(rngs=nnx.Rngs(0)), placed, mesh)
    with use_layout(placed, mesh):
        optimizer = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)
        step = nnx.jit(train_step)
        losses = [float(step(model, optimizer, batches(i))) for i in range(steps)]
        verdict = check(step, model, optimizer, batches(0), mesh=mesh, vocabulary=MAXTEXT)
    return losses, verdict


if __name__ == "__main__":
    losses, verdict = main()
    print("losses", " ".join(f"{loss:.3f}" for loss in losses))
    print(verdict.table())
