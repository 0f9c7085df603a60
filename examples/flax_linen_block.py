"""A Linen transformer block annotated the standard Linen way, placed by a starscream layout's Flax rules.

Parameters are created with `nn.with_logical_partitioning(init, names)` and activations constrained with
`nn.with_logical_constraint(x, names)`, in MaxText's vocabulary (`embed`, `mlp`, `heads`, `kv`; `activation_batch`,
`activation_length`, `activation_embed`, ...). The layout enters as Flax's own rule tables (`flax_rules`): the params
table places the parameters when they are created, the "use" table (weights at use and activations) is the
`nn.logical_axis_rules` context of the step, in which Linen constrains each parameter to its rule as a module reads it
(so a weight stored split inside the GPU is gathered there before use). Linen's constraints are
`with_sharding_constraint`s, which need a mesh whose axes are Auto: XLA then chooses how to reduce the gradients.

    python examples/flax_linen_block.py      # trains a few steps on 2 simulated GPUs x 4 partitions, then checks
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding

from starscream_jax import MAXTEXT, auto_axes, build_mesh, check, flax_rules, simulate_cpu_devices

RESIDUAL = ("activation_batch", "activation_length", "activation_embed")
HEADS = ("activation_batch", "activation_length", "activation_heads", "activation_kv")
HIDDEN = ("activation_batch", "activation_length", "activation_mlp")


def kernel(names: tuple[str, ...]):
    return nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)


class Block(nn.Module):
    """x [B, S, D] -> x + attention(norm(x)), then + mlp(norm(x))."""

    heads: int = 4
    head_dim: int = 8
    d_ff: int = 64

    @nn.compact
    def __call__(self, x_BSD: jax.Array) -> jax.Array:
        D = x_BSD.shape[-1]
        norm_scale = nn.with_logical_partitioning(nn.initializers.ones_init(), ("norm",))
        x_BSD = nn.with_logical_constraint(x_BSD, RESIDUAL)
        h_BSD = nn.RMSNorm(scale_init=norm_scale)(x_BSD)
        projection = dict(shape=(D, self.heads, self.head_dim), einsum_str="bsd,dhe->bshe", use_bias=False,
                          kernel_init=kernel(("embed", "heads", "kv")))
        q, k, v = (nn.with_logical_constraint(nn.Einsum(**projection)(h_BSD), HEADS) for _ in range(3))
        attended_BSHE = nn.with_logical_constraint(nn.dot_product_attention(q, k, v), HEADS)
        x_BSD = x_BSD + nn.Einsum((self.heads, self.head_dim, D), "bshe,hed->bsd", use_bias=False,
                                  kernel_init=kernel(("heads", "kv", "embed")))(attended_BSHE)
        x_BSD = nn.with_logical_constraint(x_BSD, RESIDUAL)
        up = nn.Dense(self.d_ff, use_bias=False, kernel_init=kernel(("embed", "mlp")))
        hidden_BSF = nn.with_logical_constraint(jax.nn.gelu(up(nn.RMSNorm(scale_init=norm_scale)(x_BSD))), HIDDEN)
        down = nn.Dense(D, use_bias=False, kernel_init=kernel(("mlp", "embed")))
        return nn.with_logical_constraint(x_BSD + down(hidden_BSF), RESIDUAL)


def loss_fn(params, x_BSD: jax.Array, target_BSD: jax.Array) -> jax.Array:
    """Mean squared error of the block's output against `target_BSD`."""
    return jnp.mean((Block().apply(params, x_BSD) - target_BSD) ** 2)


def make_train_step(optimizer: optax.GradientTransformation):
    @jax.jit
    def train_step(params, opt_state, x_BSD, target_BSD):
        loss, grads = jax.value_and_grad(loss_fn)(params, x_BSD, target_BSD)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return train_step


def create_sharded(layout: str, mesh: Mesh, x_BSD: jax.Array):
    """The block's parameters created already placed by the layout's params table (Flax's own resolution)."""
    abstract = jax.eval_shape(Block().init, jax.random.key(0), x_BSD)
    specs = nn.get_partition_spec(abstract)
    shardings = nn.logical_to_mesh_sharding(specs, mesh, list(flax_rules(layout, "params", MAXTEXT)))
    return jax.jit(Block().init, out_shardings=shardings)(jax.random.key(0), x_BSD)


BATCH_NAMES = ("activation_batch", "activation_length", "activation_embed")


def batch(step: int, mesh: Mesh | None = None, layout: str = "starscream_tp", shape=(16, 8, 32)):
    """Inputs and targets [B, S, D]: the target is a fixed random linear map of the input, then tanh. With a mesh,
    placed as the layout places the residual stream (tokens split, not copied on every partition)."""
    x_BSD = jax.random.normal(jax.random.fold_in(jax.random.key(1), step), shape)
    target_BSD = jnp.tanh(x_BSD @ jax.random.normal(jax.random.key(2), shape[-1:] * 2) * shape[-1] ** -0.5)
    if mesh is not None:
        spec = nn.logical_to_mesh_axes(BATCH_NAMES, flax_rules(layout, "activations", MAXTEXT))
        x_BSD, target_BSD = jax.device_put((x_BSD, target_BSD), NamedSharding(mesh, spec))
    return x_BSD, target_BSD


def main(layout: str = "starscream_tp", steps: int = 6):
    """Trains the block under `layout` on 2 simulated GPUs x 4 partitions; returns the losses and `check`'s
    verdict on the train step."""
    simulate_cpu_devices(8)
    mesh = auto_axes(build_mesh("2x4"))
    optimizer = optax.adam(1e-2)
    with jax.set_mesh(mesh), nn.logical_axis_rules(flax_rules(layout, "use", MAXTEXT)):
        params = create_sharded(layout, mesh, batch(0)[0])
        opt_state = optimizer.init(params)
        train_step = make_train_step(optimizer)
        losses = []
        for i in range(steps):
            params, opt_state, loss = train_step(params, opt_state, *batch(i, mesh, layout))
            losses.append(float(loss))
        verdict = check(train_step, params, opt_state, *batch(0, mesh, layout), mesh=mesh, layout=layout,
                        vocabulary=MAXTEXT)
    return losses, verdict


if __name__ == "__main__":
    losses, verdict = main()
    print("losses", " ".join(f"{loss:.3f}" for loss in losses))
    print(verdict.table())
