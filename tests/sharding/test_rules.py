"""The strict resolver: first match wins, and every way a rule table can fail to place a tensor is an error that names
the tensor, its shape and the rule. Only the mesh's axis sizes matter, so an abstract (1, 2, 4) mesh is enough."""
import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from starscream_jax.errors import ShardingRuleError
from starscream_jax.hardware.axes import AXES
from starscream_jax.sharding.rules import Rules, resolve

MESH = AbstractMesh((1, 2, 4), AXES)
TP_RULES = Rules((("batch", "xcd"), ("embed", None), ("heads", "gpu"), ("kv_heads", ("gpu", "xcd")),
                  ("mlp", ("gpu", "xcd"))), may_replicate=frozenset({"kv_heads"}))


def test_single_axes_are_names_and_several_are_tuples():
    assert resolve(("batch", None, "heads"), (8, 3, 16), TP_RULES, MESH) == P("xcd", None, "gpu")
    assert resolve(("mlp", "embed"), (16, 3), TP_RULES, MESH) == P(("gpu", "xcd"), None)


def test_a_rule_to_none_replicates_by_choice():
    assert resolve(("embed", "heads"), (5, 4), TP_RULES, MESH) == P(None, "gpu")


def test_first_matching_rule_wins():
    rules = Rules((("mlp", "gpu"), ("mlp", "xcd")))
    assert resolve(("mlp",), (8,), rules, MESH) == P("gpu")
    assert rules.names() == ["mlp"]


def test_unknown_logical_name_names_tensor_shape_and_known_names():
    message = r"wq \(4, 8\) with logical axes \('heads', 'experts'\): unknown logical name 'experts' in the " \
              r"param rules; known names: batch, embed, heads, kv_heads, mlp"
    with pytest.raises(ShardingRuleError, match=message):
        resolve(("heads", "experts"), (4, 8), TP_RULES, MESH, "wq", "param rules")


def test_mesh_axis_the_mesh_lacks():
    rules = Rules((("mlp", ("gpu", "pipe")),))
    with pytest.raises(ShardingRuleError, match=r"w_up \(16,\) with logical axes \('mlp',\): rule 'mlp' -> "
                                                r"\('gpu', 'pipe'\) in the weight rules of x names mesh axes "
                                                r"\['pipe'\] the mesh lacks \(mesh axes: \('data', 'gpu', 'xcd'\)\)"):
        resolve(("mlp",), (16,), rules, MESH, "w_up", "weight rules of x")


def test_one_mesh_axis_used_for_two_dimensions():
    with pytest.raises(ShardingRuleError, match=r"x \(8, 16\) with logical axes \('batch', 'mlp'\): mesh axis 'xcd' "
                                                r"would shard both 'batch' and 'mlp'; change the rules"):
        resolve(("batch", "mlp"), (8, 16), TP_RULES, MESH, "x")


def test_indivisible_dimension_names_size_axes_and_fix():
    with pytest.raises(ShardingRuleError, match=r"w_down \(12, 5\) with logical axes \('mlp', 'embed'\): dimension "
                                                r"'mlp' of size 12 is not divisible by mesh axes \('gpu', 'xcd'\) "
                                                r"\(size 8\) of rule 'mlp' in the param rules of y; pick a size "
                                                r"that is a multiple of 8"):
        resolve(("mlp", "embed"), (12, 5), TP_RULES, MESH, "w_down", "param rules of y")


def test_wrong_number_of_names():
    with pytest.raises(ShardingRuleError, match=r"x \(8, 16\) with logical axes \('batch',\): 1 logical names for 2 "
                                                r"dimensions; give one name \(or None\) per dimension"):
        resolve(("batch",), (8, 16), TP_RULES, MESH, "x")


@pytest.mark.parametrize("kv_heads,spec", [(8, ("gpu", "xcd")), (4, "gpu"), (2, "gpu"), (1, None)])
def test_kv_heads_fewer_than_devices_keep_the_longest_leading_axes_that_divide(kv_heads, spec):
    assert resolve(("kv_heads",), (kv_heads,), TP_RULES, MESH) == P(spec)


def test_only_may_replicate_names_fall_back():
    strict = Rules(TP_RULES.table)
    with pytest.raises(ShardingRuleError, match="dimension 'kv_heads' of size 4 is not divisible"):
        resolve(("kv_heads",), (4,), strict, MESH)
    with pytest.raises(ShardingRuleError, match="dimension 'heads' of size 3 is not divisible by mesh axes"):
        resolve(("heads",), (3,), TP_RULES, MESH)


def test_fallback_keeps_a_leading_part_of_the_rule_in_its_order():
    rules = Rules((("kv_heads", ("xcd", "gpu")),), may_replicate=frozenset({"kv_heads"}))
    assert resolve(("kv_heads",), (6,), rules, MESH) == P(None)
    assert resolve(("kv_heads",), (4,), rules, MESH) == P("xcd")


@pytest.mark.parametrize("experts,spec", [(4, P("gpu", None)), (2, P("gpu", None)), (1, P(None, "gpu"))])
def test_a_may_replicate_name_leaves_out_the_axes_an_earlier_dimension_took(experts, spec):
    """An expert's hidden dimension goes over the GPUs only where the experts cannot (here: one expert)."""
    rules = Rules((("experts", "gpu"), ("expert_mlp", "gpu")), may_replicate=frozenset({"experts", "expert_mlp"}))
    assert resolve(("experts", "expert_mlp"), (experts, 8), rules, MESH) == spec
    strict = Rules(rules.table)
    with pytest.raises(ShardingRuleError, match="would shard both 'experts' and 'expert_mlp'"):
        resolve(("experts", "expert_mlp"), (2, 8), strict, MESH)
