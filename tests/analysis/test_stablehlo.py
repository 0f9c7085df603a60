"""Reading sharding constraints from lowered programs: handwritten StableHLO in each printed form, and a real one."""
import jax
import jax.numpy as jnp
import pytest

from starscream_jax.analysis.stablehlo import ShardedValue, sharded_values
from starscream_jax.hardware.mesh import build_mesh
from starscream_jax.sharding.apply import constrain, einsum, use_layout, weight

PROGRAM = """\
module @jit_step attributes {mhlo.num_partitions = 8 : i32} {
  sdy.mesh @mesh = <["data"=1, "gpu"=2, "xcd"=4]> loc(#loc)
  func.func public @main(%arg0: tensor<8x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}) -> tensor<8x16xf32> {
    %0 = sdy.sharding_constraint %arg0 <@mesh, [{"data", "xcd"}, {}]> : tensor<8x16xf32> loc(#loc5)
    %1 = sdy.sharding_constraint %0 <@mesh, [{"data"}, {"gpu"}], unreduced={"xcd"}> : tensor<8x16xbf16> loc(#loc6)
    %2 = sdy.sharding_constraint %1 <@mesh, [{"xcd":(1)2}, {}]> : tensor<8x16xf32> loc(#loc7)
    %3:2 = sdy.manual_computation(%2) in_shardings=[<@mesh, [{"gpu"}, {}]>] out_shardings=[<@mesh, [{"gpu"}, {}]>] manual_axes={"data", "gpu", "xcd"} (%arg1: tensor<4x16xf32>) {
      %9 = sdy.sharding_constraint %arg1 <@mesh, []> : tensor<4x16xf32> loc(#loc5)
      sdy.return %9 : tensor<4x16xf32> loc(#loc5)
    } : (tensor<8x16xf32>) -> tensor<8x16xf32> loc(#loc5)
    %4 = sdy.sharding_constraint %cst <@mesh, []> : tensor<f32> loc(#loc8)
    return %3 : tensor<8x16xf32> loc(#loc)
  } loc(#loc)
} loc(#loc)
#loc = loc(unknown)
#loc1 = loc("/src/model.py":10:4 to :20)
#loc2 = loc("block"(#loc1))
#loc3 = loc("bsd,df->bsf/dot_general"(#loc2))
#loc5 = loc("jit(step)/jvp()/reshard"(#loc2))
#loc6 = loc(callsite(#loc3 at #loc2))
#loc7 = loc("add_any"(#loc1))
#loc8 = loc("jit(step)/broadcast_in_dim"(#loc1))
"""


def test_constraints_give_global_shapes_placements_and_names():
    values = sharded_values(PROGRAM)
    assert [value.name for value in values] == [
        "jit(step)/jvp()/reshard", "bsd,df->bsf/dot_general", "add_any", "jit(step)/broadcast_in_dim"]
    first, second, third, scalar = values
    assert (first.shape, first.dtype, first.dims, first.unreduced) == (
        (8, 16), "f32", ((("data", None), ("xcd", None)), ()), frozenset())
    assert (second.dtype, second.dims, second.unreduced) == ("bf16", ((("data", None),), (("gpu", None),)),
                                                             frozenset({"xcd"}))
    assert third.dims == ((("xcd", 2),), ())
    assert (scalar.shape, scalar.dims, scalar.bytes) == ((), (), 4)


def test_values_inside_shard_map_bodies_are_skipped():
    """The manual computation's body holds per-device shapes (4 x 16 here), which are not global placements."""
    assert all(value.shape != (4, 16) for value in sharded_values(PROGRAM))


SCAN_HELPER = """\
  func.func private @dynamic_update_index_in_dim_20(%arg0: tensor<2x64x128xf32>, %arg1: tensor<64x128xf32>) {
    %0 = stablehlo.broadcast_in_dim %arg1, dims = [1, 2] : (tensor<64x128xf32>) -> tensor<1x64x128xf32> loc(#loc5)
    %1 = sdy.sharding_constraint %0 <@mesh, [{}, {}, {"gpu"}]> : tensor<1x64x128xf32> loc(#loc5)
    return %1 : tensor<1x64x128xf32> loc(#loc5)
  } loc(#loc)
  func.func private @closed_call(%arg0: tensor<1x64x128xf32>) -> tensor<1x64x128xf32> {
    %0 = sdy.sharding_constraint %arg0 <@mesh, [{}, {"xcd"}, {"gpu"}]> : tensor<1x64x128xf32> loc(#loc5)
    return %0 : tensor<1x64x128xf32> loc(#loc5)
  } loc(#loc)
"""


def test_values_of_the_scan_slice_helpers_are_skipped():
    """A layer's slice of a stacked weight [L, 64, 128] looks like an activation [1, 64, 128] of one sequence of 64
    tokens; the helper that writes it is skipped, the function after it is read again."""
    text = PROGRAM.replace("} loc(#loc)\n#loc = loc(unknown)", SCAN_HELPER + "} loc(#loc)\n#loc = loc(unknown)")
    shaped = [value for value in sharded_values(text) if value.shape == (1, 64, 128)]
    assert [value.dims for value in shaped] == [((), (("xcd", None),), (("gpu", None),))]


@pytest.mark.parametrize("dims, unreduced, expected", [
    (((("data", None), ("xcd", None)), ()), frozenset(), {"xcd": 4, "gpu": 1}),
    (((("gpu", None),), ()), frozenset({"xcd"}), {"xcd": 1, "gpu": 2}),  # partial sums are whole on each device
    (((("xcd", 2),), ()), frozenset(), {"xcd": 2, "gpu": 1}),          # a sub-axis splits by its own size
])
def test_split_counts_the_ways_a_value_is_divided_over_an_axis(dims, unreduced, expected):
    value = ShardedValue(name="v", shape=(8, 16), dtype="f32", dims=dims, unreduced=unreduced)
    assert {axis: value.split(axis, {"xcd": 4, "gpu": 2}[axis]) for axis in expected} == expected


def test_a_lowered_program_lists_every_activation_of_the_layout():
    """Under starscream_tp the tokens of x and of the einsum's result go over (data, xcd), the hidden over gpu."""
    mesh = build_mesh("2x4")

    def step(x, w):
        x = constrain(x, ("batch", "embed"))
        return einsum("bd,df->bf", x, weight(w, ("embed", "mlp")), out=("batch", "mlp")).sum()

    with use_layout("starscream_tp", mesh):
        text = jax.jit(step).lower(jnp.ones((8, 16)), jnp.ones((16, 32))).as_text(debug_info=True)
    by_shape = {value.shape: value for value in sharded_values(text) if value.shape[:1] == (8,)}
    assert by_shape[(8, 16)].dims == ((("data", None), ("xcd", None)), ())
    assert by_shape[(8, 32)].dims == ((("data", None), ("xcd", None)), (("gpu", None),))
    assert by_shape[(8, 32)].name.endswith("bd,df->bf/dot_general")
