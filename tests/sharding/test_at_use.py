"""Flax parameters read as the layout uses them on Auto axes (`at_use.ParamAtUse`), which create_sharded gives an
unedited Flax model's named parameters."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from starscream_jax.hardware.mesh import auto_axes, build_mesh
from starscream_jax.sharding.apply import use_layout
from starscream_jax.sharding.at_use import ParamAtUse, create_sharded

KERNEL = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"))


class TiedMLP(nnx.Module):
    """x [B, 16] -> [B, 16] through one kernel [16, 32] used twice (up, then its transpose down), and an unnamed
    scale."""

    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(16, 32, use_bias=False, kernel_init=KERNEL, rngs=rngs)
        self.down_kernel = self.up.kernel  # the same Param, shared
        self.gain = nnx.Param(jnp.ones(()))

    def __call__(self, x_BD):
        return jnp.tanh(self.up(x_BD)) @ self.down_kernel[...].T * self.gain[...]


def loss(model, x_BD):
    return jnp.sum(model(x_BD) ** 2)


def test_on_auto_axes_named_params_read_at_use_and_stay_shared_and_stored():
    """On an Auto mesh the named kernel becomes a ParamAtUse (still an nnx.Param, still shared), the unnamed scale
    stays a Param; inside use_layout a traced read is the kernel gathered over xcd ([D, F] with F over gpu) while
    the stored array keeps D over xcd, and the loss and gradient equal the unsharded model's. On an Explicit mesh
    nothing changes type."""
    mesh = auto_axes(build_mesh("2x4"))
    model = create_sharded(lambda: TiedMLP(nnx.Rngs(0)), "starscream_tp", mesh)
    assert type(model.up.kernel) is ParamAtUse and model.down_kernel is model.up.kernel
    assert type(model.gain) is nnx.Param and isinstance(model.up.kernel, nnx.Param)
    assert model.up.kernel.sharding.spec == P("xcd", "gpu")
    x_BD = jax.device_put(jnp.linspace(-1, 1, 8 * 16).reshape(8, 16), NamedSharding(mesh, P(("data", "xcd"))))
    with nnx.use_eager_sharding(False):
        expected_loss, expected_grads = nnx.value_and_grad(loss)(TiedMLP(nnx.Rngs(0)), np.asarray(x_BD))
    def read(model):
        return model.up.kernel[...]

    with use_layout("starscream_tp", mesh):
        value, grads = nnx.jit(nnx.value_and_grad(loss))(model, x_BD)
        read_inside = nnx.jit(read)(model)
    np.testing.assert_allclose(value, expected_loss, rtol=1e-5)
    gradient = grads["down_kernel"][...]  # the shared kernel, at the first of its paths in attribute order
    np.testing.assert_allclose(gradient, expected_grads["down_kernel"][...], rtol=1e-5, atol=1e-6)
    assert gradient.sharding.is_equivalent_to(NamedSharding(mesh, P("xcd", "gpu")), 2)
    assert read_inside.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "gpu")), 2)
    assert model.up.kernel.sharding.spec == P("xcd", "gpu")  # read outside a trace: as stored
    explicit = create_sharded(lambda: TiedMLP(nnx.Rngs(0)), "starscream_tp", build_mesh("2x4"))
    assert type(explicit.up.kernel) is nnx.Param
