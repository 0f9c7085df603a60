"""Which params rule placed each parameter among a step's arguments, and which parameters carry no logical names:
NNX modules (Flax's `out_sharding` metadata and this library's `param`), an optimizer's state (not a parameter) and
Linen's variables (boxed by `nn.with_logical_partitioning` or plain)."""
import flax.linen as nn
import jax.numpy as jnp
import optax
from flax import nnx

from starscream_jax.analysis.placement import format_placements, parameter_placements
from starscream_jax.sharding.apply import param
from starscream_jax.sharding.flax_rules import in_vocabulary
from starscream_jax.sharding.layouts import get_layout


class Partly(nnx.Module):
    def __init__(self):
        self.up = nnx.Param(jnp.zeros((32, 64)), out_sharding=("embed", "hidden"))
        self.head = param(jnp.zeros((32, 16)), ("embed", None))
        self.gain = nnx.Param(jnp.ones((32,)))


def test_named_parameters_show_their_rules_and_unnamed_ones_are_listed():
    layout = in_vocabulary("starscream_tp", {"hidden": "mlp"})
    with nnx.use_eager_sharding(False):
        model = Partly()
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    placements = {p.path: p for p in parameter_placements((model, optimizer, jnp.zeros((4, 8))), layout)}
    assert set(placements) == {"0/up", "0/head", "0/gain"}  # optimizer moments and the batch are no parameters
    assert placements["0/up"].rules == ("embed -> xcd", "hidden -> gpu")
    assert placements["0/head"].rules == ("embed -> xcd", "-")
    assert not placements["0/gain"].named
    rows = dict(format_placements(tuple(placements.values())))
    assert rows["parameters placed by the layout's rules"] == "2 of 3"
    assert rows["  embed -> xcd, hidden -> gpu"] == "1: 0/up"
    assert rows["without logical names (left replicated)"] == "1: 0/gain"


def test_linen_parameters_are_read_from_their_boxes():
    variables = {"params": {"Dense_0": {"kernel": nn.LogicallyPartitioned(jnp.zeros((8, 4)), ("embed", "mlp")),
                                        "bias": jnp.zeros((4,))}}}
    placements = parameter_placements((variables, jnp.zeros(3)), get_layout("flat_tp"))
    assert [(p.path, p.rules) for p in placements] == [("0/params/Dense_0/bias", ()),
                                                       ("0/params/Dense_0/kernel", ("embed -> whole",
                                                                                    "mlp -> (gpu, xcd)"))]
    assert not placements[0].named
