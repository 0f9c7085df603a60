"""Models created already sharded (`create_sharded`), and Flax parameters that read as a matmul uses them on Auto
axes, so that a model written for Flax's GSPMD guide needs no edit.

Flax NNX's layers read their parameters themselves (`self.kernel[...]`, `self.embedding[...]`) and never call
`weight`, so on a mesh with Auto axes each parameter enters the step as stored. Under `starscream_tp` that is a
kernel [D, F] split (D over `xcd`, F over `gpu`) and a table [V, D] split (V over `gpu`, D over `xcd`), and XLA's
sharding propagation carries the split of D into the model: a model without activation constraints gets kernels
split where only the tokens should be (principle 1), and `nnx.Embed`'s gather from the stored table, against tokens
split over `xcd`, moves rows between partitions of different GPUs (principle 3).

`create_sharded` on an Auto mesh gives every named `nnx.Param` the type `ParamAtUse` (a subclass, so `nnx.Param`
filters, optimizers and checkpoints see a Param). Read inside a step traced under `use_layout`, it is the weight
as the layout uses it (`apply.read_at_use`: gathered inside the GPU, [D, F] whole over `xcd`), and its gradient
comes back summed inside the GPU to the stored placement. Read anywhere else (no active layout, an Explicit mesh,
outside a trace) it is the stored value. Norm scales (the layout's `replicated_ok` names) are read as stored.
"""
from __future__ import annotations

import jax
from flax import nnx
from flax.typing import MISSING
from jax.sharding import NamedSharding

from .apply import current, is_auto, logical_names, param_shardings, path_name, read_at_use
from .layouts import Layout, get_layout
from .rules import resolve

LIBRARY = __name__.split(".")[0]
"""The package whose own modules read their weights through `weight` already: their parameters are left as they are."""


class ParamAtUse(nnx.Param):
    """An `nnx.Param` that reads, inside a step traced under `use_layout` on Auto axes, as the layout uses it."""

    def get_value(self, *, index=MISSING):
        value = super().get_value(index=index)
        return value if index not in (MISSING, ...) else _at_use(self, value)


def _at_use(variable: nnx.Variable, value):
    """`value` of `variable` as the active layout uses it (`read_at_use`), or as it is where none applies."""
    placement = current()
    names = logical_names(variable)
    if not placement.auto or not isinstance(value, jax.core.Tracer) or names is None:
        return value
    if placement.layout.replicated_ok & set(names):
        return value
    names = _one_layer(names, value, placement)
    return read_at_use(value, names, tensor=f"parameter {names}")


def _one_layer(names, value, placement):
    """The logical `names` of a stacked parameter read one layer at a time: a layer's slice of a parameter stacked
    by `nnx.vmap` with a `layers` axis (`transform_metadata={nnx.PARTITION_NAME: "layers"}`) and then scanned by
    `jax.lax.scan` over `nnx.split`'s state (`nnx.scan` strips the name itself) still carries the stacked names.
    The leading names in excess are dropped where the layout splits none of them (the layers' axis is never split:
    it is what a layer's slice lacks); otherwise `names` are returned as given, and the resolver says they do not
    fit."""
    extra = len(names) - jax.numpy.ndim(value)
    if extra <= 0 or any(name is not None and placement.layout.weights.lookup(name)[1] for name in names[:extra]):
        return names
    return names[extra:]


def read_params_at_use(model: nnx.Module) -> nnx.Module:
    """`model` with each of its named `nnx.Param`s turned into a `ParamAtUse` in place (shared parameters stay
    shared: the object keeps its identity); parameters of this library's own modules and Param subclasses of the
    model's own are left as they are. Returns `model`."""
    for variable in _user_params(model):
        object.__setattr__(variable, "__class__", ParamAtUse)
    return model


def _user_params(model: nnx.Module) -> list[nnx.Param]:
    """The named parameters of type exactly `nnx.Param` outside this library's modules."""
    nodes = list(nnx.iter_graph(model))
    library = [path for path, node in nodes
               if isinstance(node, nnx.Module) and type(node).__module__.split(".")[0] == LIBRARY]
    return [node for path, node in nodes if type(node) is nnx.Param and logical_names(node) is not None
            and not any(path[:len(owner)] == owner for owner in library)]


def create_sharded(factory, layout: Layout | str, mesh):
    """Builds the module `factory()` with every parameter created already sharded by the layout's params rules.

    The full model is never materialised on one device: parameters are initialised inside jit with those output
    shardings. `factory` takes no arguments (close over config and rngs seed). Flax's own placement of variables
    with `out_sharding` metadata as they are created is turned off here: the layout places them. On a mesh with
    Auto axes each named `nnx.Param` becomes a `ParamAtUse`, which Flax's layers read as the layout uses
    it inside `use_layout` (they never call `weight`), so an unedited Flax model is gathered at use as this
    library's layers are; on Explicit axes the parameters Flax's layers add or multiply elementwise are stored as
    they are used (`elementwise_at_use`).
    """
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(factory)
        graphdef, abstract_state = nnx.split(abstract)
        shardings = param_shardings(abstract_state, layout, mesh)
        if not is_auto(mesh):
            shardings = elementwise_at_use(abstract_state, shardings, layout, mesh)
        with jax.set_mesh(mesh):
            state = jax.jit(lambda: nnx.state(factory()), out_shardings=shardings)()
    model = nnx.merge(graphdef, state)
    return read_params_at_use(model) if is_auto(mesh) else model


ELEMENTWISE = ("bias", "scale")
"""Names of the parameters Flax's layers add or multiply elementwise into an activation (`nnx.Linear`'s and
`nnx.LayerNorm`'s `bias`, the norms' `scale`): under explicit sharding an elementwise operand must be placed as the
activation is, so they are kept as they are used, never split where their dimension is gathered at use."""


def is_elementwise(path) -> bool:
    """Whether the parameter at `path` (an nnx state path) is one of Flax's elementwise ones (`ELEMENTWISE`)."""
    return bool(path) and str(getattr(path[-1], "key", path[-1])) in ELEMENTWISE


def elementwise_at_use(state: nnx.State, shardings: nnx.State, layout: Layout | str, mesh) -> nnx.State:
    """`shardings` (the stored placement of `state`'s variables) with each of Flax's elementwise parameters
    (`is_elementwise`) placed by the layout's weights rules, as its layer uses it: a bias [D] that the params rules
    split over `xcd` is whole on each partition (a few kilobytes), as the activation it is added to is."""
    def placed(path, sharding, variable):
        names = logical_names(variable)
        if not is_elementwise(path) or names is None:
            return sharding
        shape = tuple(variable.get_value().shape)
        return NamedSharding(mesh, resolve(names, shape, get_layout(layout).weights, mesh, path_name(path),
                                           f"weight rules of {get_layout(layout).name}"))

    return jax.tree.map_with_path(placed, shardings, state, is_leaf=lambda x: isinstance(x, (NamedSharding,
                                                                                             nnx.Variable)))
