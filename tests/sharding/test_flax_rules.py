"""Layouts for Flax models: a model in MaxText's names is placed as one in the library's names, Flax's own resolver
reads the exported rule tables alike, a table Flax cannot hold is refused, and `weights_at_use` gives Flax's layers
their weights with the gradients of the unsharded model."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

from starscream_jax.errors import ShardingRuleError
from starscream_jax.hardware.mesh import build_mesh
from starscream_jax.sharding.apply import activation_spec, constrain, param_specs, use_layout
from starscream_jax.sharding.at_use import create_sharded
from starscream_jax.sharding.flax_rules import MAXTEXT, STARSCREAM, flax_rules, in_vocabulary, weights_at_use

MAXTEXT_NAMES = {"q": ("embed", "heads", "kv"), "o": ("heads", "kv", "embed"), "up": ("embed", "mlp"),
                 "table": ("vocab", "embed"), "scale": ("norm",)}
SHAPES = {"q": (32, 8, 4), "o": (8, 4, 32), "up": (32, 64), "table": (64, 32), "scale": (32,)}


class Named(nnx.Module):
    """One Flax-annotated variable per entry of `names` (logical names in `out_sharding` metadata)."""

    def __init__(self, names: dict):
        for key, logical in names.items():
            setattr(self, key, nnx.Param(nnx.initializers.zeros_init()(None, SHAPES[key]), out_sharding=logical))


def specs_of(names, layout, mesh):
    with nnx.use_eager_sharding(False):
        state = nnx.state(nnx.eval_shape(lambda: Named(names)))
    return dict(param_specs(state, layout, mesh).items())


@pytest.mark.parametrize("layout", ["starscream_tp", "flat_tp", "starscream_decode"])
def test_maxtext_names_get_the_placement_of_the_library_names(layout):
    mesh = build_mesh("2x4")
    library = {key: tuple(MAXTEXT.weights[name] for name in logical) for key, logical in MAXTEXT_NAMES.items()}
    assert specs_of(MAXTEXT_NAMES, in_vocabulary(layout, MAXTEXT), mesh) == specs_of(library, layout, mesh)


def test_flax_resolves_the_exported_params_table_as_the_layout_does():
    mesh = build_mesh("2x4")
    with nnx.use_eager_sharding(False):
        state = nnx.state(nnx.eval_shape(lambda: Named(MAXTEXT_NAMES)))
    with nnx.logical_axis_rules(flax_rules("starscream_tp", "params", MAXTEXT)):
        flax_specs = {key: variable.get_value() for key, variable in nnx.get_partition_spec(state).items()}
    ours = dict(param_specs(state, in_vocabulary("starscream_tp", MAXTEXT), mesh).items())
    assert flax_specs == ours
    assert ours["q"] == PartitionSpec("xcd", "gpu", None)


def test_every_exported_name_appears_once():
    for table in ("params", "weights", "activations", "use"):
        names = [name for name, _ in flax_rules("starscream_tp", table, MAXTEXT)]
        assert len(names) == len(set(names)) > 0


def test_a_use_table_that_would_place_one_name_two_ways_is_refused():
    layout = in_vocabulary("starscream_tp").with_rules(activations={"embed": "xcd"})
    with pytest.raises(ShardingRuleError, match=r"places weights and activations named \['embed'\] differently"):
        flax_rules(layout, "use", STARSCREAM)
    assert dict(flax_rules(layout, "use", MAXTEXT))["activation_embed"] == "xcd"


def test_a_vocabulary_naming_an_unknown_library_name_is_refused():
    """By `in_vocabulary` and by `flax_rules` alike: a misspelt name would leave its dimension whole."""
    with pytest.raises(ShardingRuleError, match="model_dim -> hidden"):
        in_vocabulary("starscream_tp", {"model_dim": "hidden"})
    with pytest.raises(ShardingRuleError, match="hidden -> mlpp"):
        flax_rules("starscream_tp", "params", {"feat": "embed", "hidden": "mlpp"})


def test_a_name_mapped_to_none_is_never_split_and_every_name_is_exported_by_default():
    layout = in_vocabulary("starscream_tp", {"qkv": None, "hidden": "mlp"})
    assert all(getattr(layout, table).lookup("qkv") == (True, ()) for table in ("params", "weights", "activations"))
    exported = dict(flax_rules(layout, "use"))
    assert exported["qkv"] is None and exported["hidden"] == "gpu" and exported["batch"] == ("data", "xcd")


class LearnedPositions(nnx.Module):
    """x [B, S, D] plus a learned position table [S, D] looked up by `nnx.Embed` at positions 0..S-1 (the same on
    every partition; the rows named None, never split)."""

    def __init__(self, rngs: nnx.Rngs):
        table_init = nnx.with_partitioning(nnx.initializers.normal(1.0), (None, "embed"))
        self.positions = nnx.Embed(4, 8, embedding_init=table_init, rngs=rngs)

    def __call__(self, x_BSD):
        S, D = x_BSD.shape[1:]
        return x_BSD + self.positions(jnp.arange(S), out_sharding=activation_spec((None, "embed"), (S, D)))


def test_a_table_looked_up_by_position_gets_the_unsharded_gradient():
    """On 2 x 2 x 2 the tokens split over data and xcd; the position table's gradient, a sum over every token, is
    summed once (typed for the two-stage reduction it came back data x xcd = 4 times too large)."""
    x_BSD = jax.random.normal(jax.random.key(1), (8, 4, 8))
    mesh = build_mesh("4x2", data=2)
    model = create_sharded(lambda: LearnedPositions(nnx.Rngs(0)), "starscream_tp", mesh)
    table_SD = np.asarray(model.positions.embedding[...])

    def grads(model):
        placed_BSD = constrain(x_BSD, ("batch", "seq", "embed"))
        return nnx.grad(lambda m: jnp.sum(weights_at_use(m)(placed_BSD) ** 2))(model)

    with use_layout("starscream_tp", mesh):
        got = nnx.jit(grads)(model)["positions"]["embedding"][...]
    expected = 2 * np.sum(np.asarray(x_BSD) + table_SD, axis=0)  # d/dp of sum((x + p)^2), over the batch
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


class OwnParameters(nnx.Module):
    """A class token [1, 1, D] concatenated and a position table [1, S + 1, D] added: parameters of the model's own
    (not Flax's layers'), read elementwise; a convolution's kernel and a Linear's."""

    def __init__(self, rngs: nnx.Rngs):
        self.cls_token = nnx.Param(jnp.full((1, 1, 8), 0.5), out_sharding=(None, None, "embed"))
        self.pos = nnx.Param(jax.random.normal(rngs.params(), (1, 5, 8)), out_sharding=(None, None, "embed"))
        self.proj = nnx.Linear(8, 8, use_bias=False, rngs=rngs,
                               kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp")))
        self.conv = nnx.Conv(8, 8, kernel_size=(2,), use_bias=False, rngs=rngs, kernel_init=nnx.with_partitioning(
            nnx.initializers.lecun_normal(), (None, "embed", "embed_out")))

    def __call__(self, x_BSD):
        B, S, D = x_BSD.shape
        cls = jnp.broadcast_to(self.cls_token[...], (B, 1, D), out_sharding=activation_spec(
            ("batch", "seq", "embed"), (B, 1, D)))
        x_BSD = constrain(jnp.concatenate([cls, x_BSD], axis=1) + self.pos[...], ("batch", "seq", "embed"))
        x_BSD = constrain(self.conv(x_BSD), ("batch", "seq", "embed"))
        return self.proj(x_BSD, out_sharding=activation_spec(("batch", "seq", "mlp"), (B, S + 1, 8)))


def test_weights_at_use_places_a_models_own_elementwise_parameters_as_used():
    """On 2 x 2 x 2 (tokens over data and xcd) a class token and a position table of the model's own, added and
    concatenated, and a convolution's kernel take their unsharded gradients: typed for the matmul's two-stage
    reduction, the first refused broadcast_to, the second the add and the third the convolution; only the kernels of
    Flax's matmul layers are."""
    x_BSD = jax.random.normal(jax.random.key(1), (8, 4, 8))
    mesh = build_mesh("4x2", data=2)
    layout = in_vocabulary("starscream_tp", {"embed_out": None})
    model = create_sharded(lambda: OwnParameters(nnx.Rngs(0)), layout, mesh)

    def loss(model, x_BSD):
        return jnp.sum(jnp.tanh(model(x_BSD)) ** 2)

    with nnx.use_eager_sharding(False):
        expected = nnx.grad(loss)(OwnParameters(nnx.Rngs(0)), x_BSD)
    with use_layout(layout, mesh):
        placed_BSD = jax.device_put(x_BSD, jax.sharding.NamedSharding(mesh, PartitionSpec(("data", "xcd"))))
        got = nnx.jit(nnx.grad(lambda m, x: loss(weights_at_use(m), x)))(model, placed_BSD)
    for path in (("cls_token",), ("pos",), ("conv", "kernel"), ("proj", "kernel")):
        want, have = expected, got
        for key in path:
            want, have = want[key], have[key]
        np.testing.assert_allclose(have[...], want[...], rtol=1e-5, atol=1e-5)
