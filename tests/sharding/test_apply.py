"""Applying a layout: parameter specs (optimizer state included), the activation and weight helpers, sharded
creation, and a property test over random small models and meshes (most of them placeable): each one shards and
matches the unsharded model, or is refused with a ShardingRuleError whose stated reason is checked true, never
another exception."""
import contextlib
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import flax.linen as nn
from flax import nnx
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from flax.core import spmd as flax_spmd
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from starscream_jax.analysis.report import inspect_compiled
from starscream_jax.errors import ShardingRuleError
from starscream_jax.hardware.axes import AXES
from starscream_jax.hardware.mesh import auto_axes, build_mesh
from starscream_jax.model.config import ModelConfig
from starscream_jax.model.decoder import Transformer, next_token_loss
from starscream_jax.sharding.apply import (
    Placement,
    activation_spec,
    active,
    amax,
    constrain,
    einsum,
    jit,
    param,
    param_shardings,
    param_specs,
    placed_by,
    placed_explicitly,
    scale,
    shared_input,
    shift,
    token_mean,
    use_layout,
    weight,
)
from starscream_jax.sharding.at_use import create_sharded
from starscream_jax.sharding.layouts import LAYOUTS, fit_batch
from starscream_jax.sharding.rules import resolve

ABSTRACT_2x4 = AbstractMesh((1, 2, 4), AXES)
FP32_TOLERANCE = 2e-5
"""Largest absolute difference between sharded and unsharded float32 logits and loss (tests/model/test_decoder.py)."""


class Mlp(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.w_in = param(jax.random.normal(rngs.params(), (16, 32)), ("embed", "mlp"))
        self.w_out = param(jax.random.normal(rngs.params(), (32, 16)), ("mlp", "embed"))
        self.scale = param(jnp.ones((16,)), ("norm",))


def test_param_specs_follow_the_params_rules():
    specs = param_specs(nnx.state(Mlp(nnx.Rngs(0))), "starscream_tp", ABSTRACT_2x4)
    assert specs["w_in"] == P("xcd", "gpu")
    assert specs["w_out"] == P("gpu", "xcd")
    assert specs["scale"] == P(None)


def test_optimizer_state_is_placed_like_the_parameters_and_counters_are_scalars():
    model = Mlp(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    specs = param_specs(nnx.state(optimizer), "starscream_tp", ABSTRACT_2x4)
    adam = specs["opt_state"][0]
    assert adam["mu"]["w_in"] == adam["nu"]["w_in"] == P("xcd", "gpu")
    assert adam["count"] == specs["step"] == P()


def test_an_unnamed_parameter_is_an_error_not_a_silent_replica():
    class Unnamed(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones((4, 8)))

    with pytest.raises(ShardingRuleError, match=r"^w \(4, 8\) has no logical axis names; create it with "
                                                r"starscream_jax.param\(value, names\) or "
                                                r"nnx.with_partitioning\(init, names\)$"):
        param_specs(nnx.state(Unnamed()), "gpu_tp", ABSTRACT_2x4)


class Normalized(nnx.Module):
    """A kernel [8, 4] and Flax's BatchNorm over its 4 outputs, whose statistics the layer takes no names for."""

    def __init__(self, name_statistics: bool):
        named = {"out_sharding": ("mlp",)}
        self.up = nnx.Linear(8, 4, use_bias=False, kernel_metadata={"out_sharding": ("embed", "mlp")},
                             rngs=nnx.Rngs(0))
        self.norm = nnx.BatchNorm(4, scale_metadata=named, bias_metadata=named, rngs=nnx.Rngs(0))
        if name_statistics:
            for statistic in (self.norm.mean, self.norm.var):
                statistic.set_metadata(**named)


def test_an_unnamed_layer_statistic_is_refused_with_a_fix_that_works():
    """BatchNorm's mean and var are created by the layer without metadata, so the fix for a parameter (name it at
    creation) cannot reach them; the error gives the one that does, and the statistics then split as `mlp` does."""
    with nnx.use_eager_sharding(False):  # (Flax would place the named variables as it creates them)
        unnamed, named = (nnx.state(Normalized(name_statistics)) for name_statistics in (False, True))
    with pytest.raises(ShardingRuleError, match=r"^norm/mean \(4,\) has no logical axis names; name this BatchStat "
                                                r"once .*variable.set_metadata\(out_sharding=names\)$"):
        param_specs(unnamed, "gpu_tp", ABSTRACT_2x4)
    specs = param_specs(named, "gpu_tp", ABSTRACT_2x4)
    assert specs["norm"]["mean"] == specs["norm"]["scale"] == P("gpu")


def test_param_needs_one_name_per_dimension():
    with pytest.raises(ShardingRuleError, match=r"parameter of shape \(4, 8\) given logical names \('embed',\); "
                                                r"give a tuple of 2 names"):
        param(jnp.ones((4, 8)), ("embed",))
    with pytest.raises(ShardingRuleError, match=r"given logical names 'embed'; give a tuple of 1 names"):
        param(jnp.ones((5,)), "embed")  # a string is no tuple of names, whatever its length


def test_the_public_functions_refuse_arguments_of_the_wrong_kind_in_one_line():
    """build_mesh's grouping of ints per GPU, fit_batch's mesh and counts, batch_sharding's batch size, jit's
    placement and einsum's explicit form: each a one-line error of the library's, naming what to pass."""
    from starscream_jax.errors import TopologyError
    from starscream_jax.sharding.apply import batch_sharding
    from starscream_jax.sharding.layouts import fit_batch
    for grouping, simulate in (([0, 1, 2, 3], False), ("0123", False), ([jax.devices()[:4], jax.devices()[4:]], False),
                               ([0, 1, 2, 3], True)):
        with pytest.raises(TopologyError, match="expected device ids .* in one list per physical GPU"):
            build_mesh(grouping=grouping, simulate=simulate)
    mesh = build_mesh("2x4")
    for args, message in (((None, 2, 16), "mesh None"), ((mesh, "2", 16), "batch '2'"),
                          ((mesh, 2, 16.0), "positions 16.0")):
        with pytest.raises(ShardingRuleError, match=message):
            fit_batch("starscream_tp", *args)
    for size in (0, -4, 2.0, True):
        with pytest.raises(ShardingRuleError, match=f"batch_size {size!r}: expected the number of sequences"):
            batch_sharding("starscream_tp", mesh, size)
    with pytest.raises(ShardingRuleError, match=r"jit\(under='starscream_tp'\): expected a Placement"):
        jit(lambda x: x, under="starscream_tp")
    with use_layout("starscream_tp", mesh), pytest.raises(ShardingRuleError, match="give the explicit form"):
        einsum("bd,df", jnp.ones((8, 4)), jnp.ones((4, 4)), ("batch", "mlp"))


def test_param_errors_name_the_parameter_path_and_the_table():
    class Odd(nnx.Module):
        def __init__(self):
            self.w_up = param(jnp.ones((16, 6)), ("embed", "mlp"))

    with pytest.raises(ShardingRuleError, match=r"^w_up \(16, 6\) with logical axes \('embed', 'mlp'\): dimension "
                                                r"'mlp' of size 6 is not divisible by mesh axes \('gpu', 'xcd'\)"):
        param_specs(nnx.state(Odd()), "flat_tp", ABSTRACT_2x4)


def test_outside_a_layout_every_helper_is_the_identity():
    x, w = jnp.arange(8.0).reshape(2, 4), jnp.ones((4, 3))
    assert active() is None
    assert constrain(x, ("batch", "embed")) is x
    assert weight(w, ("embed", "mlp")) is w
    assert weight(w, ("embed", "mlp"), jnp.bfloat16).dtype == jnp.bfloat16
    np.testing.assert_array_equal(einsum("bd,df->bf", x, w, out=("batch", "mlp")), x @ w)
    assert activation_spec(("batch",), (2,)) is None


def test_use_layout_is_active_only_inside_its_block():
    mesh = build_mesh("2x4")
    with use_layout("starscream_tp", mesh):
        assert active().layout.name == "starscream_tp" and active().mesh is mesh
        with use_layout("flat_tp", mesh):
            assert active().layout.name == "flat_tp"
        assert active().layout.name == "starscream_tp"
    assert active() is None


def test_on_auto_axes_the_layout_is_installed_as_flax_logical_axis_rules():
    """Inside use_layout on an Auto mesh, Flax's logical constraints place activations by the layout (weights at
    use and activations in one table); the helpers constrain instead of resharding; outside, no rules remain."""
    mesh = auto_axes(build_mesh("2x4"))
    x, w = jnp.ones((8, 16)), jnp.ones((16, 32))

    def step(x_BD, w_DF):
        h_BF = einsum("bd,df->bf", nn.with_logical_constraint(x_BD, ("batch", "embed")), weight(w_DF, ("embed", "mlp")),
                      out=("batch", "mlp"))
        return h_BF, constrain(h_BF, ("batch", None))

    with use_layout("starscream_tp", mesh):
        rules = dict(flax_spmd.get_logical_axis_rules())
        hidden, constrained = jax.jit(step)(x, w)
    assert (rules["batch"], rules["embed"], rules["mlp"]) == (("data", "xcd"), None, "gpu")
    assert hidden.sharding.is_equivalent_to(jax.NamedSharding(mesh, P(("data", "xcd"), "gpu")), 2)
    assert constrained.sharding.is_equivalent_to(jax.NamedSharding(mesh, P(("data", "xcd"))), 2)
    assert flax_spmd.get_logical_axis_rules() == ()


def test_on_auto_axes_weight_gathers_at_use_and_places_the_gradient_as_stored():
    """`weight` (so `weights_at_use`) on Auto axes: the gradient equals the unsharded one and comes back split as the
    weight is stored, not whole."""
    mesh = auto_axes(build_mesh("2x4"))
    w_DF = jnp.arange(16 * 32.0).reshape(16, 32) / 100
    x_BD = jnp.ones((8, 16))

    def loss(w):
        return jnp.sum(jnp.tanh(constrain(x_BD, ("batch", "embed")) @ weight(w, ("embed", "mlp"))))

    expected = jax.grad(loss)(w_DF)
    stored = jax.NamedSharding(mesh, P("xcd", "gpu"))
    with use_layout("starscream_tp", mesh):
        gradient = jax.jit(jax.grad(loss))(jax.device_put(w_DF, stored))
    np.testing.assert_allclose(gradient, expected, rtol=1e-6)
    assert gradient.sharding.is_equivalent_to(stored, 2)


def test_a_mesh_mixing_auto_and_explicit_axes_is_refused():
    mesh = build_mesh("2x4")
    mixed = jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Explicit, AxisType.Auto,
                                                                         AxisType.Auto))
    with pytest.raises(ShardingRuleError, match="all Explicit .build_mesh. or all Auto .auto_axes"):
        with use_layout("starscream_tp", mixed):
            pass


def test_one_jitted_function_called_under_two_layouts_is_traced_for_each():
    """A plain `jax.jit` function traced under starscream_tp (batch over xcd), then called under flat_tp (batch over
    data alone) and under no layout: each call runs its own layout's program; `jit` bound to starscream_tp runs its
    program under any of them."""
    mesh = build_mesh("2x4")
    traces = []

    def placed(x):
        traces.append(None if active() is None else active().layout.name)
        return constrain(x, ("batch", "embed")) * 2

    plain, bound = jax.jit(placed), jit(placed, under=Placement.of("starscream_tp", mesh))
    x = jnp.arange(32.0).reshape(8, 4)
    specs = {}
    for name in ("starscream_tp", "flat_tp", None):
        with use_layout(name, mesh) if name else contextlib.nullcontext():
            specs[name] = (plain(x).sharding, bound(x).sharding)
            np.testing.assert_array_equal(plain(x), 2 * x)
    assert specs["starscream_tp"][0].spec == P(("data", "xcd"), None) and specs["flat_tp"][0].spec == P("data", None)
    assert specs[None][0].is_fully_replicated and len(specs[None][0].device_set) == 1
    assert {bound_sharding.spec for _, bound_sharding in specs.values()} == {P(("data", "xcd"), None)}
    assert traces == ["starscream_tp", "flat_tp", None]  # one trace per layout, which `bound` shares with `plain`


def test_weights_are_gathered_inside_the_gpu_before_use_and_outputs_placed_by_einsum():
    """starscream_tp stores w_in as P('xcd', 'gpu') and uses it as P(None, 'gpu'); tokens go over (data, xcd)."""
    mesh = build_mesh("2x4")
    model = create_sharded(lambda: Mlp(nnx.Rngs(0)), "starscream_tp", mesh)
    assert model.w_in.sharding.spec == P("xcd", "gpu")

    def forward(w_in, x):
        used = weight(w_in, ("embed", "mlp"))
        hidden = einsum("bd,df->bf", constrain(x, ("batch", "embed")), used, out=("batch", "mlp"))
        return used, hidden

    with use_layout("starscream_tp", mesh):
        used, hidden = jax.jit(forward)(model.w_in[...], jnp.ones((8, 16)))
    assert used.sharding.spec == P(None, "gpu")
    assert hidden.sharding.spec == P(("data", "xcd"), "gpu")
    # the same float32 sums as the unsharded product, perhaps in another order: entries near zero differ by ulps
    np.testing.assert_allclose(hidden, jnp.ones((8, 16)) @ model.w_in[...], rtol=1e-6, atol=1e-5)


def _kv_projection(x_BSD, w_DKE, through_einsum: bool):
    """The k projection of decode under starscream_decode: tokens split over xcd by embed, kv heads fewer than the
    GPUs (each one's projection whole on every GPU), the result's batch over xcd."""
    x_BSD = constrain(x_BSD, ("batch", "seq", "embed"))
    w_DKE = weight(w_DKE, ("embed", "kv_heads", "head_dim"))
    out = ("attn_batch", "seq", "kv_heads", "head_dim")
    if through_einsum:
        return einsum("bsd,dke->bske", x_BSD, w_DKE, out=out)
    return jnp.einsum("bsd,dke->bske", x_BSD, w_DKE, out_sharding=activation_spec(out, (8, 1, 2, 4)))


@pytest.mark.parametrize("through_einsum", [True, False])
def test_a_reduce_scatter_to_kv_heads_copied_over_gpus_stays_hierarchical(through_einsum):
    """2 kv heads on 4 GPUs of 2 partitions: einsum sums the product inside the GPU and scatters it there (the
    result equals the unsharded one); the same product placed by jnp.einsum's own out_sharding alone compiles to
    flat collective-permutes, which einsum avoids."""
    mesh = build_mesh("4x2")
    x, w = jax.random.normal(jax.random.key(0), (8, 1, 16)), jax.random.normal(jax.random.key(1), (16, 2, 4))
    stored = resolve(("embed", "kv_heads", "head_dim"), w.shape, LAYOUTS["starscream_decode"].params, mesh)
    placed_w = jax.device_put(w, NamedSharding(mesh, stored))
    with use_layout("starscream_decode", mesh):
        compiled = jax.jit(lambda x, w: _kv_projection(x, w, through_einsum)).lower(x, placed_w).compile()
        result = compiled(x, placed_w)
    scopes = {collective.scope for collective in inspect_compiled(compiled, mesh).collectives}
    assert ("flat" not in scopes) == through_einsum, scopes
    np.testing.assert_allclose(result, jnp.einsum("bsd,dke->bske", x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout, batch", [("flat_fsdp", 1), ("starscream_fsdp", 2), ("starscream_fsdp", 8)])
def test_token_mean_sums_inside_each_gpu_before_across_gpus(layout, batch):
    """Per-token values [B, S] whose tokens are split inside GPUs and across them, by the batch (8 sequences over
    gpu x xcd), the sequence (1 sequence of flat_fsdp+seq: positions over gpu x xcd) or both (2 sequences of
    starscream_fsdp+seq: batch over gpu, positions over xcd): the mean and its gradient equal the unsharded ones,
    and no collective of the step and its gradient spans both levels (a flat all-reduce of the sequence's sum
    before)."""
    mesh = build_mesh("2x4")
    fitted = fit_batch(layout, mesh, batch, 16)
    values = jax.random.normal(jax.random.key(0), (batch, 16))
    with use_layout(fitted, mesh):
        values = jax.device_put(values, NamedSharding(mesh, activation_spec(("batch", "seq"), values.shape)))
        step = jax.jit(jax.value_and_grad(lambda x: token_mean(x, ("batch", "seq"))))
        compiled = step.lower(values).compile()
        mean, gradient = compiled(values)
    assert "flat" not in {c.scope for c in inspect_compiled(compiled, mesh).collectives}
    np.testing.assert_allclose(mean, jnp.mean(values), rtol=1e-6)
    np.testing.assert_allclose(gradient, np.full(values.shape, 1 / values.size), rtol=1e-6)


def _two_projections(x, w_a, w_b, shared: bool):
    """sum(x @ w_a) + sum(x @ w_b)^2 with both weights' outputs split over gpu (tensor parallelism)."""
    x = constrain(x, ("batch", "embed"))
    used_a, used_b = weight(w_a, ("embed", "mlp")), weight(w_b, ("embed", "mlp"))
    if shared:
        x = shared_input(x, [used_a, used_b])
    a = einsum("bd,df->bf", x, used_a, out=("batch", "mlp"))
    b = einsum("bd,df->bf", x, used_b, out=("batch", "mlp"))
    return jnp.sum(a) + jnp.sum(b * b)


@pytest.mark.parametrize("layout", ["starscream_tp", "gpu_tp"])
def test_shared_input_sums_the_gradients_of_its_matmuls_once(layout):
    """Two projections of one input whose outputs are split over GPUs: without shared_input the input gradient is
    all-reduced over gpu once per projection (XLA may combine them into one call, the bytes stay); with it, once.
    The gradients equal the unsharded ones either way."""
    mesh = build_mesh("2x4")
    keys = jax.random.split(jax.random.key(0), 3)
    x, w_a, w_b = (jax.random.normal(keys[0], (8, 16)), jax.random.normal(keys[1], (16, 32)),
                   jax.random.normal(keys[2], (16, 32)))
    expected = jax.grad(_two_projections, argnums=(0, 1, 2))(x, w_a, w_b, False)
    inter_gpu_buffers = {}
    for shared in (False, True):
        with use_layout(layout, mesh):
            step = jax.jit(jax.grad(_two_projections, argnums=(0, 1, 2)), static_argnums=3)
            compiled = step.lower(x, w_a, w_b, shared).compile()
            gradients = compiled(x, w_a, w_b)
        for got, want in zip(gradients, expected):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        inter_gpu_buffers[shared] = sum(c.buffer_bytes * c.count for c in inspect_compiled(compiled, mesh).collectives
                                        if c.scope == "inter_gpu")
    x_gradient_block = gradients[0].addressable_shards[0].data.nbytes
    assert inter_gpu_buffers == {False: 2 * x_gradient_block, True: x_gradient_block}


def test_shared_input_is_the_identity_where_the_weights_split_different_axes():
    """flat_tp splits w_a's output over (gpu, xcd); a weight replicated there cannot share the reduction."""
    mesh = build_mesh("2x4")
    with use_layout("flat_tp", mesh):
        x = constrain(jnp.ones((8, 16)), ("batch", "embed"))
        split = weight(jnp.ones((16, 32)), ("embed", "mlp"))
        replicated = weight(jnp.ones((16, 32)), ("embed", None))
        assert shared_input(x, [split, replicated]) is x
        assert jax.typeof(shared_input(x, [split, split])).sharding.spec.reduced == {"gpu", "xcd"}


def test_create_sharded_places_every_parameter_by_the_params_rules():
    mesh = build_mesh("2x4")
    model = create_sharded(lambda: Mlp(nnx.Rngs(0)), "flat_tp", mesh)
    state = nnx.state(model)
    for value, sharding in zip(jax.tree.leaves(state), jax.tree.leaves(param_shardings(state, "flat_tp", mesh))):
        assert value.sharding == sharding
    np.testing.assert_array_equal(model.w_out[...], Mlp(nnx.Rngs(0)).w_out[...])


def test_activation_errors_name_the_activation_and_the_layout():
    message = (r"hidden \(6, 4\) with logical axes \('batch', 'mlp'\): dimension 'batch' of size 6 is not divisible "
               r"by mesh axes \('data', 'gpu', 'xcd'\) \(size 8\) of rule 'batch' in the activation rules of flat_fsdp")
    with use_layout("flat_fsdp", build_mesh("2x4")), pytest.raises(ShardingRuleError, match=message):
        constrain(jnp.ones((6, 4)), ("batch", "mlp"), "hidden")


# Property: random small models on random meshes.

MESH_SHAPES = [(1, 1, 2), (1, 2, 2), (1, 2, 4), (2, 2, 2), (1, 4, 2), (1, 1, 8), (2, 1, 4)]


@st.composite
def model_configs(draw) -> ModelConfig:
    """Small Llama configurations: most (4 in 5) with every size a multiple of 8, which every mesh here divides; the
    rest with sizes mostly, not always, multiples of a power of two."""
    if draw(st.integers(0, 4)) > 0:
        n_kv_heads = 8
        return ModelConfig(name="aligned", vocab_size=8 * draw(st.integers(1, 6)), d_model=8 * draw(st.integers(1, 3)),
                           n_layers=1, n_heads=n_kv_heads * draw(st.sampled_from([1, 2])), n_kv_heads=n_kv_heads,
                           head_dim=2 * draw(st.integers(1, 4)), d_ff=8 * draw(st.integers(1, 4)))

    def size(multiples_of: int, most: int) -> int:
        return draw(st.integers(1, most).map(lambda n: n * multiples_of) | st.integers(1, most * multiples_of))

    n_kv_heads = draw(st.sampled_from([1, 2, 4, 8]))
    return ModelConfig(name="random", vocab_size=size(8, 6), d_model=size(8, 3), n_layers=1,
                       n_heads=n_kv_heads * draw(st.sampled_from([1, 2, 3, 4])), n_kv_heads=n_kv_heads,
                       head_dim=2 * draw(st.integers(1, 4)), d_ff=size(8, 4))


INDIVISIBLE = re.compile(r"dimension '(\w+)' of size (\d+) is not divisible by mesh axes \(([^)]*)\) \(size (\d+)\)")
UNEVEN_HEADS = re.compile(r"(\d+) query heads over (\d+) devices gives (\d+) per device, which splits groups of (\d+)")


def check_refusal(message: str, config: ModelConfig, mesh, sizes: set[int]) -> None:
    """A refusal must state a fact about this model and mesh that is true: a dimension of one of the model's sizes
    that the named mesh axes (of the product named) do not divide, or query heads whose per-device share splits
    the groups that share a kv head."""
    indivisible, uneven = INDIVISIBLE.search(message), UNEVEN_HEADS.search(message)
    if indivisible:
        size, axes, axes_size = int(indivisible[2]), re.findall(r"'(\w+)'", indivisible[3]), int(indivisible[4])
        assert size in sizes, (size, sizes, message)
        assert axes_size == math.prod(mesh.shape[axis] for axis in axes), message
        assert size % axes_size != 0, message
    elif uneven:
        heads, devices, local, group = map(int, uneven.groups())
        assert (heads, group) == (config.n_heads, config.n_heads // config.n_kv_heads), message
        assert local == heads // devices and local % group and group % local, message
    else:
        raise AssertionError(f"refused for a reason the test cannot check: {message}")


def random_params(config: ModelConfig):
    """(graphdef, parameter state of random host arrays): the model's shapes without running (and compiling, once per
    shape) its initialiser."""
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(0)
    return graphdef, jax.tree.map(lambda x: 0.3 * rng.standard_normal(x.shape, np.float32), abstract)


def forward_and_loss(graphdef, params, tokens_BS):
    model = nnx.merge(graphdef, params)
    return model(tokens_BS).logits, next_token_loss(model, tokens_BS)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=model_configs(), mesh_shape=st.sampled_from(MESH_SHAPES), layout=st.sampled_from(list(LAYOUTS)),
       batch=st.sampled_from([2, 4, 8, 8, 8]))
def test_random_models_shard_and_match_or_are_refused_for_a_true_reason(config, mesh_shape, layout, batch):
    """Each case either matches the unsharded model or is refused with a ShardingRuleError whose stated reason
    `check_refusal` finds true; `--hypothesis-show-statistics` shows how many cases of each kind ran."""
    graphdef, params = random_params(config)
    seq = 8
    tokens = np.random.default_rng(1).integers(0, config.vocab_size, (batch, seq), dtype=np.int32)
    expected_logits, expected_loss = jax.jit(lambda p, t: forward_and_loss(graphdef, p, t))(params, tokens)
    data, gpu, xcd = mesh_shape
    mesh = build_mesh(f"{data * gpu}x{xcd}", data=data)
    try:
        placed = jax.device_put(params, param_shardings(params, layout, mesh))
        with use_layout(layout, mesh):
            logits, loss = jax.jit(lambda p, t: forward_and_loss(graphdef, p, t))(placed, tokens)
    except ShardingRuleError as refusal:
        sizes = {config.vocab_size, config.d_model, config.n_heads, config.n_kv_heads, config.head_dim, config.d_ff,
                 batch, seq, seq - 1}
        check_refusal(str(refusal), config, mesh, sizes)
        event(f"{config.name} model refused")
        return
    event(f"{config.name} model sharded")
    np.testing.assert_allclose(logits, expected_logits, rtol=0, atol=FP32_TOLERANCE)
    np.testing.assert_allclose(loss, expected_loss, rtol=0, atol=FP32_TOLERANCE)


def test_a_refusal_with_a_false_reason_is_caught():
    """The refusal check can fail: a claim that 16 is not divisible by 8, or a size the model does not have."""
    config, mesh = ModelConfig(name="aligned", vocab_size=16, d_model=8, n_layers=1, n_heads=8, n_kv_heads=8,
                               head_dim=2, d_ff=8), build_mesh("2x4")
    true = "dimension 'mlp' of size 6 is not divisible by mesh axes ('gpu', 'xcd') (size 8) of rule 'mlp'"
    check_refusal(true, config, mesh, {6, 8})
    for false in (true.replace("size 6", "size 16"), true.replace("(size 8)", "(size 4)")):
        with pytest.raises(AssertionError):
            check_refusal(false, config, mesh, {6, 8, 16})
    with pytest.raises(AssertionError):
        check_refusal(true, config, mesh, {8})


def test_use_layout_names_a_mesh_of_the_wrong_kind():
    with pytest.raises(ShardingRuleError, match=r"mesh None \(NoneType\): expected a jax.sharding.Mesh"):
        with use_layout("starscream_tp", None):
            pass


@pytest.mark.parametrize("topology", ["2x1", "2x4"])
def test_amax_is_the_whole_arrays_on_every_device_whatever_axes_split_it(topology):
    """max |x| of an array split over gpu and xcd, one of them possibly of a single device (the cpu preset's 2 x 1),
    which the shard's type still varies over."""
    mesh = build_mesh(topology)
    x = jax.random.normal(jax.random.key(0), (8, 16)).at[3, 5].set(-40.0)
    with use_layout("starscream_tp", mesh):
        placed = jax.device_put(x, jax.sharding.NamedSharding(mesh, P("gpu", "xcd")))
        result = jax.jit(amax)(placed)
    assert result.sharding.is_fully_replicated and float(result) == 40.0



def test_a_batch_the_layout_does_not_divide_is_refused_with_how_to_fit_the_layout_to_it():
    """use_layout takes a layout as given (the commands fit theirs to the batch): starscream_tp splits the batch over
    data x xcd (4 on 2 GPUs x 4 partitions), so a batch of 2 is refused, and the refusal says how to call fit_batch,
    whose layout places it. A refusal that is not the batch's names no fit."""
    import starscream_jax as ss

    mesh = build_mesh("2x4")
    call = "use_layout(fit_batch('starscream_tp', mesh, batch=2, positions=P), mesh)"
    with use_layout("starscream_tp", mesh), pytest.raises(ShardingRuleError, match=re.escape(call)):
        activation_spec(("batch", "embed"), (2, 64))
    with use_layout(ss.fit_batch("starscream_tp", mesh, batch=2, positions=1), mesh):
        assert activation_spec(("batch", "embed"), (2, 64)) == P("data", None)
    with use_layout("starscream_tp", mesh), pytest.raises(ShardingRuleError) as refused:
        activation_spec(("batch", "mlp"), (4, 3))
    assert "fit_batch" not in str(refused.value)


def test_a_placement_answers_what_the_active_layout_answers_with_no_layout_active():
    """Host code (a server placing its cache, a step's inputs) asks a Placement where an array goes: the same spec
    the layout gives inside use_layout, its refusals with the same fix, nothing made active."""
    mesh = build_mesh("2x4")
    placement = Placement.of("starscream_decode", mesh)
    names, shape = ("attn_batch", "kv_heads", "head_dim"), (8, 4, 16)
    with use_layout("starscream_decode", mesh):
        inside = activation_spec(names, shape)
    assert active() is None and placement.activation_spec(names, shape) == inside != P()
    assert placement.sharding(names, shape) == NamedSharding(mesh, inside)
    with pytest.raises(ShardingRuleError, match=re.escape("fit_batch('starscream_tp', mesh, batch=2")):
        Placement.of("starscream_tp", mesh).activation_spec(("batch", "embed"), (2, 64))


def test_an_array_says_whether_its_type_carries_its_placement():
    """Read from the traced array: False outside a mesh and on Auto axes, True on Explicit ones."""
    seen = []

    def record(x):
        seen.append(placed_explicitly(x))
        return x

    x = np.ones((8, 4), np.float32)
    jax.jit(record)(x)
    for mesh in (build_mesh("2x4"), auto_axes(build_mesh("2x4"))):
        with jax.set_mesh(mesh):
            jax.jit(record)(jax.device_put(x, NamedSharding(mesh, P("gpu"))))
    assert seen == [False, True, False]


def test_batch_sharding_refuses_a_batch_the_layout_does_not_divide_with_how_to_fit_the_layout_to_it():
    """batch_sharding (where a script places its token batch) refuses a batch of 2 under starscream_tp on 2 GPUs x
    4 partitions as use_layout does, naming fit_batch; the fitted layout's batch sharding places it."""
    import starscream_jax as ss

    mesh = build_mesh("2x4")
    call = "layout = fit_batch('starscream_tp', mesh, batch=2, positions=P)"
    with pytest.raises(ShardingRuleError, match=re.escape(call)):
        ss.batch_sharding("starscream_tp", mesh, 2)
    fitted = ss.fit_batch("starscream_tp", mesh, batch=2, positions=16)
    assert ss.batch_sharding(fitted, mesh, 2).spec == P("data", None)


def test_a_model_function_takes_a_placement_or_the_active_one_and_refuses_anything_else():
    mesh = build_mesh("2x4")
    assert placed_by(None).placed is False  # no layout active: nothing placed
    with use_layout("starscream_tp", mesh):
        assert placed_by(None) == Placement.of("starscream_tp", mesh)
    given = Placement.of("gpu_tp", mesh)
    assert placed_by(given) is given
    with pytest.raises(ShardingRuleError, match="'starscream_tp' is not a Placement; pass Placement.of"):
        placed_by("starscream_tp")


def test_a_step_handed_its_placement_is_traced_once_whatever_is_active_and_refuses_ambient_reads():
    """`jit(..., ambient=False)`, as the library's steps are bound: the function places by the placement it holds,
    is traced once under any active layout (none of them part of its cache key), runs on its mesh, and a read of the
    active layout inside it (a helper handed no placement) is refused in one line."""
    mesh = build_mesh("2x4")
    tp = Placement.of("starscream_tp", mesh)
    traces = []

    def handed(x):
        traces.append(jax.sharding.get_abstract_mesh().shape_tuple)
        return tp.constrain(x, ("batch", "embed")) * 2

    bound = jit(handed, under=tp, ambient=False)
    x = jnp.arange(32.0).reshape(8, 4)
    for name in ("starscream_tp", "flat_tp", None):
        with use_layout(name, mesh) if name else contextlib.nullcontext():
            out = bound(x)
        assert out.sharding.spec == P(("data", "xcd"), None)
        np.testing.assert_array_equal(out, 2 * x)
    assert len(traces) == 1 and dict(traces[0]) == dict(mesh.shape)
    asks = jit(lambda x: constrain(x, ("batch", "embed")), under=tp, ambient=False)
    with pytest.raises(ShardingRuleError, match="asked for the active layout; pass it the step's placement"):
        asks(x)
    with pytest.raises(ShardingRuleError, match="ambient='no': pass True"):
        jit(handed, under=tp, ambient="no")


def test_a_mesh_without_the_layouts_axes_is_the_resolvers_one_line_error():
    """A mesh built without build_mesh's axes: placing a batch names the axes the mesh lacks (the fit_batch hint,
    which reads the batch axes' sizes, steps aside)."""
    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Explicit,) * 2)
    with use_layout("starscream_tp", mesh), pytest.raises(ShardingRuleError, match=r"names mesh axes \['data', "
                                                                                    r"'xcd'\] the mesh lacks"):
        constrain(jnp.ones((8, 8)), ("batch", "embed"))


class Elementwise(nnx.Module):
    """x [B, S, 16] plus a learned position table [S, 16] and a bias [32], times a gain [1, 1, 16]: parameters read
    elementwise (`shift`, `scale`) around one matmul; `raw=True` adds the table as stored."""

    def __init__(self, rngs: nnx.Rngs, raw: bool = False):
        self.raw = raw
        self.pos = param(jax.random.normal(rngs.params(), (4, 16)), (None, "embed"))
        self.gain = param(1 + jax.random.normal(rngs.params(), (1, 1, 16)) / 4, (None, None, "embed"))
        self.w = param(jax.random.normal(rngs.params(), (16, 32)) / 4, ("embed", "mlp"))
        self.bias = param(jax.random.normal(rngs.params(), (32,)), ("mlp",))

    def __call__(self, x_BSD):
        x_BSD = constrain(x_BSD, ("batch", "seq", "embed"))
        x_BSD = x_BSD + self.pos[...] if self.raw else shift(x_BSD, self.pos[...], (None, "embed"))
        x_BSD = scale(x_BSD, self.gain[...], (None, None, "embed"))
        h_BSF = einsum("bsd,df->bsf", x_BSD, weight(self.w[...], ("embed", "mlp")), out=("batch", "seq", "mlp"))
        return jnp.sum(jnp.tanh(shift(h_BSF, self.bias[...], ("mlp",))) ** 2)


def test_parameters_read_elementwise_through_shift_and_scale_take_the_unsharded_gradients(layout="starscream_tp"):
    """On 2 x 2 x 2 the tokens split inside GPUs and across them, where `weight` types a weight for the two-stage
    reduction, which no elementwise op takes; `shift` and `scale` place the parameter as x is placed and give the
    unsharded loss and gradients (a leading dimension of size 1 broadcasts)."""
    x_BSD = jax.random.normal(jax.random.key(1), (8, 4, 16))
    mesh = build_mesh("4x2", data=2)
    expected_loss, expected = nnx.value_and_grad(lambda m: m(x_BSD))(Elementwise(nnx.Rngs(0)))
    model = create_sharded(lambda: Elementwise(nnx.Rngs(0)), layout, mesh)
    with use_layout(layout, mesh):
        loss, grads = nnx.jit(nnx.value_and_grad(lambda m, x: m(x)))(model, x_BSD)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
    for name in ("pos", "gain", "w", "bias"):
        np.testing.assert_allclose(grads[name][...], expected[name][...], rtol=1e-5, atol=1e-5)


def test_a_parameter_read_raw_in_an_elementwise_op_is_refused_with_the_fix():
    """A position table added as stored (embed over xcd) to tokens over xcd: JAX's type error becomes one line that
    names shift and scale."""
    mesh = build_mesh("2x4")
    model = create_sharded(lambda: Elementwise(nnx.Rngs(0), raw=True), "starscream_tp", mesh)
    with pytest.raises(ShardingRuleError, match=r"illegally sharded.*starscream_jax\.shift\(x, value, names\)"):
        with use_layout("starscream_tp", mesh):
            nnx.jit(lambda m, x: m(x))(model, jnp.ones((8, 4, 16)))
    with pytest.raises(ShardingRuleError, match="does not broadcast"):
        shift(jnp.ones((8, 4, 16)), jnp.ones((3, 16)), (None, "embed"))
