"""`derive`: the built-in partition-aware layouts come out of their GPU-level tables, and what it refuses it names."""
import pytest

from starscream_jax.analysis.compile import compile_step, make_settings
from starscream_jax.analysis.principles import check_principles
from starscream_jax.analysis.report import inspect_compiled
from starscream_jax.errors import ShardingRuleError
from starscream_jax.hardware.mesh import build_mesh
from starscream_jax.sharding.derive import derive
from starscream_jax.sharding.flax_rules import in_vocabulary
from starscream_jax.sharding.layouts import LAYOUTS

TABLES = ("params", "weights", "activations")
FSDP = {"params": {"embed": "fsdp"}, "activations": {"batch": ("data", "fsdp"), "attn_batch": ("data", "fsdp")}}


@pytest.fixture(scope="module")
def mesh():
    return build_mesh("4x2", data=2)


def tables(layout):
    """Each rule table of `layout` with the names it may replicate (kv heads and experts fewer than the GPUs)."""
    return {kind: (getattr(layout, kind).table, getattr(layout, kind).may_replicate) for kind in TABLES}


@pytest.mark.parametrize("rules,decode,expected", [
    ("gpu_tp", False, "starscream_tp"),
    ("gpu_tp", True, "starscream_decode"),
    (FSDP, False, "starscream_fsdp"),
])
def test_the_built_in_layouts_are_derived_from_their_gpu_level_tables(mesh, rules, decode, expected):
    assert tables(derive(rules, mesh, decode=decode)) == tables(LAYOUTS[expected])


def test_a_tensor_axis_is_read_like_gpu(mesh):
    tensor = {"params": {"heads": "tensor", "kv_heads": "tensor", "mlp": "tensor", "expert_mlp": "tensor",
                         "vocab": "tensor"},
              "activations": {"batch": "data", "attn_batch": "data", "heads": "tensor", "kv_heads": "tensor",
                              "mlp": "tensor", "vocab": "tensor"}}
    assert tables(derive(tensor, mesh)) == tables(LAYOUTS["starscream_tp"])


@pytest.mark.parametrize("rules,decode,message", [
    ("flat_tp", False, "already splits over 'xcd'"),
    ({"params": {"mlp": "model"}, "activations": {}}, False, "of no known role"),
    ({"params": {"mlp": "tensor", "embed": "fsdp"}, "activations": {}}, False, "both want the gpu axis"),
    ({"params": {"embed": "tensor"}, "activations": {}}, False, "leaves no weight dimension"),
    (FSDP, True, "no tensor axis"),
    ({"params": {"mlp": "tensor", "hidden": "tensor"}, "activations": {}}, False,
     r"params table names \['hidden'\], which the library does not know.*in_vocabulary\(derive"),
    ({"params": {}, "activations": {"batch": "data", "tokens": "data"}}, False,
     r"activations table names \['tokens'\]"),
    ({"params": {"mlp": "tensor"}, "weights": {"mlp": None}, "activations": {}}, False,
     r"got tables \['activations', 'params', 'weights'\]; the weights at use are derived"),
    ({"params": {"mlp": 2}, "activations": {}}, False, r"params table {'mlp': 2} is not \(logical name, mesh axes"),
    ({"params": 3, "activations": {}}, False, "params table 3 is not"),
])
def test_what_derive_refuses_it_says_why(mesh, rules, decode, message):
    with pytest.raises(ShardingRuleError, match=message):
        derive(rules, mesh, decode=decode)


def test_the_derived_layout_passes_the_principles_on_the_built_in_model():
    mesh = build_mesh("2x4")
    settings = make_settings("tiny", "train", 8, 32, "gpu_tp", 2)
    derived = compile_step(settings, derive("gpu_tp", mesh), mesh)
    reference = compile_step(settings, "gpu_tp", mesh)
    report = inspect_compiled(derived.compiled, mesh, args=derived.args)
    verdicts = check_principles(report, inspect_compiled(reference.compiled, mesh), replicated_ok={"*norm*"})
    assert verdicts.ok, verdicts
    assert report.bytes_by_scope()["intra_gpu"] > 0


def test_context_and_expert_axes_stay_on_gpus_and_the_batch_goes_over_partitions(mesh):
    rules = {"params": {"experts": "expert"},
             "activations": {"batch": "data", "attn_batch": "data", "seq": "context", "experts": "expert"}}
    derived = derive(rules, mesh)
    assert derived.params.lookup("experts")[1] == ("gpu",) and derived.params.lookup("embed")[1] == ("xcd",)
    assert derived.weights.lookup("embed")[1] == ()
    assert derived.activations.lookup("seq")[1] == ("gpu",)
    assert derived.activations.lookup("batch")[1] == ("data", "xcd")


def test_a_model_s_own_names_are_mapped_after_deriving_not_dropped(mesh):
    """A layout in a model's own names is refused (its names' rules would be dropped, their dimensions left whole);
    derived from the library's names and then mapped, the model's `hidden` is placed as `mlp`."""
    with pytest.raises(ShardingRuleError, match=r"names \['hidden'\]"):
        derive(in_vocabulary("gpu_tp", {"hidden": "mlp"}), mesh)
    mapped = in_vocabulary(derive("gpu_tp", mesh), {"hidden": "mlp"})
    assert mapped.params.lookup("hidden") == (True, ("gpu",)) and mapped.weights.lookup("hidden") == (True, ("gpu",))
