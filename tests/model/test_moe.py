"""The routed mixture-of-experts block against the dense reference (every expert on every token, same top-k), alone
and under the layouts, the router's gates, the load-balancing loss and the collectives the expert layouts compile to.

The block's tests jit the block alone (its output and the gradients of a loss of it with respect to the tokens and
every weight) on tiny shapes, so each layout and mesh costs one small compile.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from starscream_jax.analysis.hlo import parse_hlo
from starscream_jax.analysis.principles import check_principles
from starscream_jax.analysis.report import inspect_compiled
from starscream_jax.errors import PresetError, ShardingRuleError
from starscream_jax.hardware.mesh import build_mesh
from starscream_jax.model import moe
from starscream_jax.model.catalog import load_model_config
from starscream_jax.model.layer_weights import RoutedMlpWeights
from starscream_jax.model.names import RESIDUAL
from starscream_jax.sharding.apply import activation_spec, use_layout
from starscream_jax.sharding.layouts import fit_batch, get_layout
from starscream_jax.sharding.rules import resolve

TOLERANCE = 2e-5
"""float32: the routed and dense blocks add the same products in another order."""
RELATIVE_TOLERANCE = 2e-6
"""float32, of each result's largest magnitude (gradients up to 42 here): about 16 ulps, for a layout that also
splits the contractions over embed into partial sums (starscream_decode)."""
D, F = 16, 32
MESHES = {"1x1x1": (1, 1, 1), "1x2x4": (1, 2, 4), "2x2x2": (2, 2, 2)}


def config(experts=4, k=2, **changes):
    return load_model_config("tiny-moe", d_model=D, d_ff=F, n_experts=experts, experts_per_token=k, **changes)


def block_inputs(experts=4, tokens=(8, 4), seed=0):
    rng = np.random.default_rng(seed)
    weights = {"router": rng.normal(size=(D, experts)), "w_gate": rng.normal(size=(experts, D, F)) / 4,
               "w_up": rng.normal(size=(experts, D, F)) / 4, "w_down": rng.normal(size=(experts, F, D)) / 6}
    return rng.normal(size=(*tokens, D)).astype(np.float32), RoutedMlpWeights(
        **{k: v.astype(np.float32) for k, v in weights.items()})


def placed_by(rules, mesh, w: RoutedMlpWeights) -> RoutedMlpWeights:
    """`w` with each weight placed on `mesh` by `rules` (a layout's params rules) for its logical names."""
    def put(value, names):
        return jax.device_put(value, NamedSharding(mesh, resolve(names, value.shape, rules, mesh)))
    return RoutedMlpWeights(router=put(w.router, ("embed", "experts")), w_gate=put(w.w_gate, moe.GATE_UP_NAMES),
                            w_up=put(w.w_up, moe.GATE_UP_NAMES), w_down=put(w.w_down, moe.DOWN_NAMES))


def dense_block(c, h_BSD, w):
    """The reference: the same routing, every expert run on every token (`moe.dense_experts`)."""
    h_TD = h_BSD.reshape(-1, D)
    gates, experts, _ = moe.route(h_TD, w.router, c.experts_per_token, c.normalize_gates)
    return moe.dense_experts(h_TD, gates, experts, w.w_gate, w.w_up, w.w_down).reshape(h_BSD.shape)


def loss_and_grads(block, c, h_BSD, w):
    """(output, d(sum of squares)/d(tokens, weights)): the block's forward and every gradient it gives."""
    def loss(h, w):
        out = block(c, h, w)
        return jnp.sum(out * out), out
    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(h_BSD, w)
    return out, grads


def routed_block(c, h_BSD, w):
    return moe.routed_mlp(c, h_BSD, w)[0]


def max_errors(actual, expected) -> list[float]:
    return [float(np.max(np.abs(np.asarray(a) - np.asarray(e)))) for a, e in
            zip(jax.tree.leaves(actual), jax.tree.leaves(expected))]


@functools.cache
def reference(experts=4, k=2):
    c = config(experts, k)
    h, w = block_inputs(experts)
    return jax.device_get(jax.jit(functools.partial(loss_and_grads, dense_block, c))(h, w))


def sharded(layout: str, mesh_name: str, experts=4, k=2, h_w=None):
    """The routed block's output and gradients under `layout` on `mesh_name`, its inputs placed by the layout, and
    the compiled program."""
    c = config(experts, k)
    h, w = h_w or block_inputs(experts)
    data, gpu, xcd = MESHES.get(mesh_name, (1, *map(int, mesh_name.split("x")[1:])))
    mesh = build_mesh(f"{data * gpu}x{xcd}", data=data)
    placed = placed_by(get_layout(layout).params, mesh, w)
    with use_layout(layout, mesh):
        tokens = jax.device_put(h, NamedSharding(mesh, activation_spec(RESIDUAL, h.shape)))
        compiled = jax.jit(functools.partial(loss_and_grads, routed_block, c)).lower(tokens, placed).compile()
        return compiled(tokens, placed), compiled, mesh, placed


def test_routed_block_equals_the_dense_reference_unsharded():
    c = config()
    h, w = block_inputs()
    routed = jax.jit(functools.partial(loss_and_grads, routed_block, c))(h, w)
    assert max(max_errors(routed, reference())) <= TOLERANCE
    assert float(np.max(np.abs(reference()[0]))) > 1.0  # the outputs are not all near zero


@pytest.mark.parametrize("layout,mesh_name", [("starscream_ep", mesh) for mesh in MESHES]
                         + [("flat_ep", "1x2x4"), ("flat_ep", "2x2x2")])
def test_routed_block_under_the_expert_layouts_equals_the_dense_reference(layout, mesh_name):
    (out, grads), _, _, _ = sharded(layout, mesh_name)
    errors = max_errors((out, grads), reference())
    assert max(errors) <= TOLERANCE, errors


@pytest.mark.parametrize("mesh_name", ["1x2x4", "2x2x2"])
def test_routed_block_under_starscream_decode_equals_the_dense_reference(mesh_name):
    """The weights stay split over embed (xcd) at use: the router's logits and the experts' gate and up are summed
    inside the GPU, the outputs across GPUs; forward and every gradient as the dense block gives them."""
    (out, grads), _, _, placed = sharded("starscream_decode", mesh_name)
    assert placed.w_gate.sharding.spec == P(None, "xcd", "gpu")
    scales = [float(np.max(np.abs(leaf))) for leaf in jax.tree.leaves(reference())]
    errors = [error / scale for error, scale in zip(max_errors((out, grads), reference()), scales)]
    assert max(errors) <= RELATIVE_TOLERANCE, errors


def decode_block(layout, experts=4, d_model=128, d_ff=256):
    """The routed block's forward alone under `layout` on 2 GPUs x 4 partitions, compiled, and its mesh: a decode
    step's expert block (one token of each of 16 sequences), wide enough that each device's share of a weight
    ([experts, 32, 64] under starscream_decode) has more rows and columns than a tile has tokens (16)."""
    c = load_model_config("tiny-moe", d_model=d_model, d_ff=d_ff, n_experts=experts, experts_per_token=2)
    rng = np.random.default_rng(0)
    shapes = {"router": (d_model, experts), "w_gate": (experts, d_model, d_ff), "w_up": (experts, d_model, d_ff),
              "w_down": (experts, d_ff, d_model)}
    w = RoutedMlpWeights(**{name: rng.normal(size=shape).astype(np.float32) for name, shape in shapes.items()})
    h = rng.normal(size=(16, 1, d_model)).astype(np.float32)
    mesh = build_mesh("2x4")
    placed = placed_by(get_layout(layout).params, mesh, w)
    with use_layout(layout, mesh):
        tokens = jax.device_put(h, NamedSharding(mesh, activation_spec(RESIDUAL, h.shape)))
        return jax.jit(functools.partial(routed_block, c)).lower(tokens, placed).compile(), mesh


def expert_reads(layout) -> dict[str, int]:
    """Weight-side elements each device's router, gate, up and down matmuls read in `decode_block`."""
    compiled, _ = decode_block(layout)
    reads = {}
    for dot in parse_hlo(compiled.as_text()).dots:
        scope = next((s for s in ("router", "gate", "up", "down") if f"/{s}/" in dot.op_name), None)
        if scope:
            weight_side = dot.m * dot.k * dot.n // min(dot.m, dot.k, dot.n)
            reads[scope] = reads.get(scope, 0) + dot.batch * weight_side * dot.count
    return reads


def test_starscream_decode_reads_each_expert_weight_once_per_gpu():
    """Each of a GPU's 4 partitions reads a quarter of what gpu_tp's device reads (the GPU's share, once); the same
    layout gathering the weights' embed dimension at use reads the GPU's whole share on every partition."""
    once, reference_reads = expert_reads("starscream_decode"), expert_reads("gpu_tp")
    gathered = expert_reads(get_layout("starscream_decode").with_rules(weights={"embed": None}))
    assert set(once) == set(reference_reads) == {"router", "gate", "up", "down"}
    assert {scope: 4 * count for scope, count in once.items()} == reference_reads
    assert all(gathered[scope] == reference_reads[scope] for scope in ("gate", "up", "down"))


def test_starscream_decode_block_collectives_stay_on_one_level():
    """Logits and gate / up summed inside the GPU, the outputs across GPUs; no weight is gathered."""
    compiled, mesh = decode_block("starscream_decode")
    report = inspect_compiled(compiled, mesh)
    verdict = check_principles(report, None).hierarchical_collectives
    assert verdict.ok, verdict.violations
    kinds = {(collective.kind, collective.scope) for collective in report.collectives}
    assert ("all-reduce", "intra_gpu") in kinds and ("all-reduce", "inter_gpu") in kinds
    assert not any(kind == "all-gather" for kind, _ in kinds), kinds


def test_an_embed_dimension_split_at_use_but_not_on_the_tokens_is_refused():
    layout = get_layout("starscream_decode").with_rules(activations={"embed": None})
    h, w = block_inputs()
    mesh = build_mesh("2x4")
    placed = placed_by(layout.params, mesh, w)
    with use_layout(layout, mesh), pytest.raises(ShardingRuleError, match=r"embed dimension split over \('xcd',\) "
                                                                          r"at use.*'tokens': \(\)"):
        jax.jit(lambda h, w: moe.routed_mlp(config(), h, w)).lower(h, placed)


def test_a_token_routed_to_another_gpus_experts_comes_back_to_its_place():
    """Every token chooses experts 2 and 3 (held by the second GPU under starscream_ep on 1 x 2 x 4), each with
    its own gates: the first GPU's partitions hold those tokens and must receive their outputs."""
    h, w = block_inputs()
    h[..., 0] = 4.0
    w.router[1:] *= 0.1
    w.router[0] = [-2.0, -2.0, 2.0, 2.0]
    c = config()
    gates, experts, _ = moe.route(h.reshape(-1, D), w.router, 2, True)
    assert set(np.unique(experts)) == {2, 3} and np.ptp(np.asarray(gates)) > 0.1
    (out, _), _, _, placed = sharded("starscream_ep", "1x2x4", h_w=(h, w))
    assert placed.w_gate.sharding.spec == P("gpu", "xcd", None)
    np.testing.assert_allclose(out, jax.jit(functools.partial(dense_block, c))(h, w), atol=TOLERANCE)


def test_experts_fewer_than_the_gpus_run_tensor_parallel_inside_each_expert():
    """2 experts on 4 GPUs: starscream_ep keeps each expert whole on every GPU and splits its hidden dimension
    over the GPUs instead, with the same result."""
    (out, grads), _, _, placed = sharded("starscream_ep", "1x4x2", experts=2, k=1)
    assert placed.w_gate.sharding.spec == P(None, "xcd", "gpu")
    assert placed.w_down.sharding.spec == P(None, "gpu", "xcd")
    assert max(max_errors((out, grads), reference(2, 1))) <= TOLERANCE


@pytest.mark.parametrize("layout,hierarchical", [("starscream_ep", True), ("flat_ep", False)])
def test_expert_layouts_collectives_on_2x2x2(layout, hierarchical):
    """starscream_ep sums the partial outputs across GPUs between same-index partitions, gathers each weight's embed
    dimension inside the GPU and reduces its gradient there, then across the data axis; flat_ep sums over every
    partition at once."""
    _, compiled, mesh, _ = sharded(layout, "2x2x2")
    report = inspect_compiled(compiled, mesh)
    verdict = check_principles(report, None).hierarchical_collectives
    assert verdict.ok == hierarchical, verdict.violations
    scopes = {collective.scope for collective in report.collectives}
    assert scopes >= ({"intra_gpu", "inter_gpu"} if hierarchical else {"flat"})


def test_tokens_and_experts_split_over_one_axis_are_refused():
    layout = get_layout("starscream_ep").with_rules(params={"experts": "xcd", "embed": None})
    h, w = block_inputs()
    mesh = build_mesh("2x4")
    placed = placed_by(layout.params, mesh, w)
    with use_layout(layout, mesh), pytest.raises(ShardingRuleError, match=r"both the tokens .* over mesh axes \['xcd'\]"):
        jax.jit(lambda h, w: moe.routed_mlp(config(), h, w)).lower(h, placed)


def test_gates_are_renormalised_top_k_probabilities_or_left_as_they_are():
    h, w = block_inputs()
    h_TD = h.reshape(-1, D)
    probabilities = jax.nn.softmax(h_TD @ w.router, axis=-1)
    chosen = np.sort(np.asarray(probabilities), axis=-1)[:, ::-1][:, :2]
    normalized, experts, _ = moe.route(h_TD, w.router, 2, True)
    plain, _, _ = moe.route(h_TD, w.router, 2, False)
    np.testing.assert_allclose(plain, chosen, rtol=1e-6)
    np.testing.assert_allclose(normalized, chosen / chosen.sum(-1, keepdims=True), rtol=1e-6)
    top_logits = np.take_along_axis(h_TD @ w.router, np.asarray(experts), axis=-1)  # Mixtral's form
    np.testing.assert_allclose(normalized, jax.nn.softmax(top_logits, axis=-1), rtol=1e-5)
    assert np.max(np.abs(np.asarray(plain).sum(-1) - 1)) > 0.05


def test_load_balance_loss_is_one_when_even_and_larger_when_not():
    even = moe.balance_loss(jnp.full((4,), 8.0), jnp.full((4,), 4.0), 2)  # 16 tokens, 2 experts each
    skewed = moe.balance_loss(jnp.array([16.0, 16.0, 0.0, 0.0]), jnp.array([7.0, 7.0, 1.0, 1.0]), 2)
    assert float(even) == pytest.approx(1.0)
    assert float(skewed) == pytest.approx(4 * (0.5 * 7 / 16 + 0.5 * 7 / 16))


@pytest.mark.parametrize("mesh_name", ["2x2x2"])
def test_load_balance_loss_under_starscream_ep_equals_the_unsharded_one(mesh_name):
    c = config(load_balance_weight=0.01)
    h, w = block_inputs()
    expected = moe.routed_mlp(c, h, w)[1]
    data, gpu, xcd = MESHES[mesh_name]
    mesh = build_mesh(f"{data * gpu}x{xcd}", data=data)
    placed = placed_by(get_layout("starscream_ep").params, mesh, w)
    with use_layout("starscream_ep", mesh):
        got = jax.jit(lambda h, w: moe.routed_mlp(c, h, w)[1])(
            jax.device_put(h, NamedSharding(mesh, activation_spec(RESIDUAL, h.shape))), placed)
    assert float(got) == pytest.approx(float(expected), rel=1e-5)
    assert float(expected) > 1.0


def test_a_negative_load_balance_weight_is_refused():
    with pytest.raises(PresetError, match="load_balance_weight -1.0 is negative"):
        config(load_balance_weight=-1.0)


def test_qwen3_config_has_many_small_experts():
    qwen = load_model_config("qwen3-30b-a3b")
    assert (qwen.n_experts, qwen.experts_per_token, qwen.d_ff) == (128, 8, 768)
    assert 30e9 < qwen.num_params() < 31e9


def test_the_compiled_block_does_the_routed_flops_plus_tile_padding():
    """8 experts, 2 per token, 256 tokens: the forward matmuls of gate, up and down do the routed FLOPs plus at most
    a quarter of padding rows; the dense reference does 4x the routed FLOPs."""
    c = config(experts=8, k=2)
    h, w = block_inputs(experts=8, tokens=(4, 64))
    routed_flops = 2 * 256 * 2 * 3 * D * F

    def expert_flops(block) -> int:
        text = jax.jit(functools.partial(block, c)).lower(h, w).compile().as_text()
        return sum(dot.flops * dot.count for dot in parse_hlo(text).dots  # not the gates' combine: XLA leaves it
                   if not dot.inferred_name  # unnamed, and it takes the down projection's name from its neighbour
                   and any(f"/{scope}/" in dot.op_name for scope in ("gate", "up", "down")))

    assert routed_flops <= expert_flops(routed_block) <= 1.25 * routed_flops
    assert expert_flops(dense_block) == 4 * routed_flops


def test_permute_rows_gradient_is_the_gather_by_its_inverse():
    """A partial permutation of rows (two rows of x go nowhere, two rows of y are padding) differentiated through
    its own rule equals the transpose JAX derives for the plain gather (a scatter-add)."""
    from starscream_jax.model.moe import permute_rows

    x_ND = jax.random.normal(jax.random.key(0), (6, 3))
    index_M = jnp.array([4, 6, 0, 2, 6, 5], jnp.int32)  # 6 (out of range): padding rows
    inverse_N = jnp.array([2, 6, 3, 6, 0, 5], jnp.int32)  # rows 1 and 3 of x are taken by no row
    weights_MD = jax.random.normal(jax.random.key(1), (6, 3))

    def loss(permute, x_ND):
        return jnp.sum(jnp.sin(permute(x_ND)) * weights_MD)

    plain = functools.partial(jnp.take, indices=index_M, axis=0, mode="fill", fill_value=0)
    ours = functools.partial(permute_rows, index_M=index_M, inverse_N=inverse_N)
    np.testing.assert_array_equal(ours(x_ND), plain(x_ND))
    np.testing.assert_allclose(jax.grad(functools.partial(loss, ours))(x_ND),
                               jax.grad(functools.partial(loss, plain))(x_ND), rtol=1e-6)


@pytest.mark.parametrize("layout", ["starscream_tp", "starscream_ep", "flat_cp"])
def test_routed_block_decoding_one_sequence_under_split_k_equals_the_dense_reference(layout):
    """One sequence decoding on 2 GPUs x 4 partitions: the layout fitted to the batch (`+split_k`) leaves the token
    whole on every partition of a GPU while the expert weights are gathered over them; the block then computes the
    same output on each, which shard_map refused as possibly varying over xcd (`starscream plan --phases decode`
    of a mixture of experts stopped with a traceback at its `starscream_cp` candidate)."""
    c = config()
    h, w = block_inputs(tokens=(1, 1))
    expected = jax.device_get(jax.jit(functools.partial(loss_and_grads, dense_block, c))(h, w))
    mesh = build_mesh("2x4")
    fitted = fit_batch(layout, mesh, batch=1, positions=1)
    assert fitted.name.endswith("+split_k")
    placed = placed_by(fitted.params, mesh, w)
    with use_layout(fitted, mesh):
        tokens = jax.device_put(h, NamedSharding(mesh, activation_spec(RESIDUAL, h.shape)))
        routed = jax.jit(functools.partial(loss_and_grads, routed_block, c))(tokens, placed)
    errors = max_errors(routed, expected)
    assert max(errors) <= TOLERANCE, errors
