"""A model of your own under starscream layouts: a small residual MLP classifier written with the public API only.

Every parameter is created with `param(value, logical_names)`; every activation the layout should place goes through
`constrain`; every matmul takes its weight through `weight` (so a layout may store it split and gather it before use)
and runs through `einsum` with the logical names of its output. The logical names come from the library's
vocabulary (see `starscream_jax.LAYOUTS`): here `embed` is the feature width, `mlp` the hidden width, `vocab` the
classes, `batch` the examples. Outside `use_layout` the same code runs unsharded.

    python examples/custom_model.py        # trains it for a few steps on 2 simulated GPUs x 4 partitions
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from starscream_jax import (
    build_mesh,
    constrain,
    create_sharded,
    einsum,
    param,
    simulate_cpu_devices,
    use_layout,
    weight,
)


class Classifier(nnx.Module):
    """features [B, D] -> class logits [B, C]: x + W2 relu(W1 norm(x)), then a linear head."""

    def __init__(self, features: int, hidden: int, classes: int, *, rngs: nnx.Rngs):
        def normal(shape, fan_in):
            return jax.random.normal(rngs.params(), shape) * fan_in ** -0.5

        self.scale = param(jnp.ones((features,)), ("norm",))
        self.w_in = param(normal((features, hidden), features), ("embed", "mlp"))
        self.w_out = param(normal((hidden, features), hidden), ("mlp", "embed"))
        self.head = param(normal((features, classes), features), ("embed", "vocab"))

    def __call__(self, x_BD: jax.Array) -> jax.Array:
        x_BD = constrain(x_BD, ("batch", "embed"), "features")
        normed_BD = x_BD * jax.lax.rsqrt(jnp.mean(x_BD * x_BD, axis=-1, keepdims=True) + 1e-6) * self.scale[...]
        hidden_BF = einsum("bd,df->bf", normed_BD, weight(self.w_in[...], ("embed", "mlp"), tensor="w_in"),
                           out=("batch", "mlp"), tensor="hidden")
        x_BD = x_BD + einsum("bf,fd->bd", jax.nn.relu(hidden_BF),
                             weight(self.w_out[...], ("mlp", "embed"), tensor="w_out"),
                             out=("batch", "embed"), tensor="residual")
        return einsum("bd,dc->bc", x_BD, weight(self.head[...], ("embed", "vocab"), tensor="head"),
                      out=("batch", "vocab"), tensor="logits")


def loss_fn(model: Classifier, x_BD: jax.Array, labels_B: jax.Array) -> jax.Array:
    """Mean softmax cross entropy (nats). The one-hot labels are placed like the logits (classes split as the layout
    splits `vocab`), so the loss is computed where the logits live."""
    logits_BC = model(x_BD)
    one_hot_BC = constrain(jax.nn.one_hot(labels_B, logits_BC.shape[-1]), ("batch", "vocab"), "labels")
    return jnp.mean(jax.nn.logsumexp(logits_BC, axis=-1) - jnp.sum(logits_BC * one_hot_BC, axis=-1))


def synthetic_batch(step: int, batch: int, features: int, classes: int):
    """Features [B, D] and labels [B]: each class is a fixed random direction plus noise."""
    centers = jax.random.normal(jax.random.key(0), (classes, features))
    keys = jax.random.split(jax.random.fold_in(jax.random.key(1), step))
    labels = jax.random.randint(keys[0], (batch,), 0, classes)
    return centers[labels] + 0.5 * jax.random.normal(keys[1], (batch, features)), labels


def main(layout: str = "starscream_tp", steps: int = 20, batch: int = 32, features: int = 64, hidden: int = 256,
         classes: int = 16) -> list[float]:
    """Trains the classifier under `layout` on a simulated 2 GPU x 4 partition mesh; returns the losses."""
    simulate_cpu_devices(8)
    mesh = build_mesh("2x4")
    model = create_sharded(lambda: Classifier(features, hidden, classes, rngs=nnx.Rngs(0)), layout, mesh)
    losses = []
    with use_layout(layout, mesh):
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

        @nnx.jit
        def train_step(model, optimizer, x_BD, labels_B):
            loss, grads = nnx.value_and_grad(loss_fn)(model, x_BD, labels_B)
            optimizer.update(model, grads)
            return loss

        for step in range(steps):
            losses.append(float(train_step(model, optimizer, *synthetic_batch(step, batch, features, classes))))
    return losses


if __name__ == "__main__":
    for step, loss in enumerate(main(), start=1):
        print(f"step {step:2d}  loss {loss:.4f}")
