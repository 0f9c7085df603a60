"""Flax parameters read as the layout uses them on Auto axes (`at_use.ParamAtUse`), which create_sharded gives an
unedited Flax model's named parameters."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from starscream_jax.hardware.mesh import auto_axes, build_mesh
from starscream_jax.sharding.apply import activation_spec, constrain, use_layout
from starscream_jax.sharding.at_use import ParamAtUse, create_sharded
from starscream_jax.sharding.flax_rules import weights_at_use

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


class BiasedMLP(nnx.Module):
    """x [B, 16] -> [B, 16] through Flax's own Linear layers with biases named as their outputs (`mlp`, `embed`)
    and a LayerNorm whose scale and bias are named `embed`: elementwise parameters the layouts split at rest."""

    def __init__(self, rngs: nnx.Rngs):
        zeros = nnx.initializers.zeros_init()
        self.up = nnx.Linear(16, 32, kernel_init=KERNEL, bias_init=nnx.with_partitioning(zeros, ("mlp",)), rngs=rngs)
        self.down = nnx.Linear(32, 16, kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(),
                                                                         ("mlp", "embed")),
                               bias_init=nnx.with_partitioning(nnx.initializers.normal(0.1), ("embed",)), rngs=rngs)
        self.norm = nnx.LayerNorm(16, scale_init=nnx.with_partitioning(nnx.initializers.ones_init(), ("embed",)),
                                  bias_init=nnx.with_partitioning(zeros, ("embed",)), rngs=rngs)

    def __call__(self, x_BD):
        h = self.up(x_BD, out_sharding=activation_spec(("batch", "mlp"), (x_BD.shape[0], 32)))
        return self.norm(self.down(jax.nn.relu(h), out_sharding=activation_spec(("batch", "embed"), x_BD.shape)))


@pytest.mark.parametrize("layout, topology, data, at_use", [
    ("starscream_tp", "2x4", 1, False), ("starscream_tp", "4x2", 2, True), ("starscream_tp", "4x2", 2, False),
    ("starscream_fsdp", "2x4", 1, True)])
def test_flax_layers_with_biases_train_on_explicit_axes_as_unsharded(layout, topology, data, at_use):
    """Flax's Linear and LayerNorm add and multiply their bias and scale elementwise, which explicit sharding
    takes only placed as the activation is: create_sharded stores them as they are used (whole where the layout
    gathers their dimension at use) and `weights_at_use` places them so, not typed for the two-stage reduction; the
    loss and gradients equal the unsharded model's, with `weights_at_use` and without, at data 1 and 2."""
    x = jax.random.normal(jax.random.key(1), (16, 16))

    def value_and_grads(model):
        tokens = constrain(x, ("batch", "embed"))  # (identity unsharded)
        return nnx.value_and_grad(lambda m: jnp.mean((weights_at_use(m) if at_use else m)(tokens) ** 2))(model)

    with nnx.use_eager_sharding(False):  # (the unsharded model, built outside any mesh)
        expected_loss, expected = value_and_grads(BiasedMLP(nnx.Rngs(0)))
    mesh = build_mesh(topology, data=data)
    model = create_sharded(lambda: BiasedMLP(nnx.Rngs(0)), layout, mesh)
    with use_layout(layout, mesh):
        loss_value, grads = nnx.jit(value_and_grads)(model)
    np.testing.assert_allclose(loss_value, expected_loss, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


class Layer(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(16, 32, use_bias=False, kernel_init=KERNEL, rngs=rngs)

    def __call__(self, x_BD):
        return x_BD + jnp.tanh(self.up(x_BD)) @ self.up.kernel[...].T


class Stacked(nnx.Module):
    """Three layers stacked by `nnx.vmap` with a `layers` axis and run by `jax.lax.scan` over `nnx.split`'s state:
    each layer's kernel [16, 32] is read with the stacked names ('layers', 'embed', 'mlp')."""

    def __init__(self, rngs: nnx.Rngs):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def create(rngs):
            return Layer(rngs)

        self.layers = create(rngs)

    def __call__(self, x_BD):
        graphdef, state = nnx.split(self.layers)
        return jax.lax.scan(lambda x, layer: (nnx.merge(graphdef, layer)(x), None), x_BD, state)[0]


def test_a_stacked_parameter_read_one_layer_at_a_time_is_read_at_use():
    """A layer's slice of a vmapped kernel keeps the stacked names inside `jax.lax.scan` (nnx.scan strips them):
    read at use by the names less the unsplit `layers`, with the unsharded loss and gradient, not refused for one
    name too many."""
    mesh = auto_axes(build_mesh("2x4"))
    model = create_sharded(lambda: Stacked(nnx.Rngs(0)), "starscream_tp", mesh)
    assert model.layers.up.kernel.sharding.spec == P(None, "xcd", "gpu")
    x_BD = jax.random.normal(jax.random.key(1), (8, 16))
    with nnx.use_eager_sharding(False):
        expected_loss, expected = nnx.value_and_grad(loss)(Stacked(nnx.Rngs(0)), x_BD)
    with use_layout("starscream_tp", mesh):
        value, grads = nnx.jit(nnx.value_and_grad(loss))(model, x_BD)
    np.testing.assert_allclose(value, expected_loss, rtol=1e-5)
    want = np.asarray(expected["layers"]["up"]["kernel"][...])
    np.testing.assert_allclose(grads["layers"]["up"]["kernel"][...], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
