"""Which rule of a layout placed each parameter among a step's arguments, and which parameters it did not reach.

A parameter is an `nnx.Param` (of a module, or inside an optimizer's model) or a Linen parameter (a leaf under a
"params" collection, boxed by `nn.with_logical_partitioning` or not). One with logical names is placed at rest by
the layout's params rules, one rule per named dimension; one without names is outside the layout's reach: it stays
as it was given (replicated, unless placed by hand), which `check` lists so that a user sees what the layout missed.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import flax.linen as nn
import jax
from flax import nnx

from ..sharding.apply import logical_names
from ..sharding.layouts import Layout

SHOWN_PATHS = 3


@dataclass(frozen=True, kw_only=True)
class ParameterPlacement:
    """One parameter: its path among the step's arguments ("0/blocks/0/up/kernel": argument 0's variable; Linen's
    "1/params/Dense_0/kernel"), its shape, its logical names (None: it has none) and, per dimension, the params rule
    that placed it ("embed -> xcd"; "-" for a dimension named None)."""

    path: str
    shape: tuple[int, ...]
    names: tuple[str | None, ...] | None
    rules: tuple[str, ...]

    @property
    def named(self) -> bool:
        return self.names is not None


def parameter_placements(args: tuple, layout: Layout) -> tuple[ParameterPlacement, ...]:
    """Every parameter among `args`, in argument order (see the module)."""
    found = []
    for index, argument in enumerate(args):
        _, state = nnx.split(argument) if isinstance(argument, nnx.Pytree) else (None, None)
        if state is not None:
            found += [_placement(f"{index}/" + "/".join(str(key) for key in path), variable, layout)
                      for path, variable in nnx.to_flat_state(state) if isinstance(variable, nnx.Param)]
        else:
            found += _linen_placements(index, argument, layout)
    return tuple(found)


def _placement(path: str, variable, layout: Layout) -> ParameterPlacement:
    value = variable.get_value() if isinstance(variable, nnx.Variable) else variable
    names = logical_names(variable) if isinstance(variable, nnx.Variable) else None
    return _placed(path, tuple(value.shape), names, layout)


def _placed(path: str, shape: tuple[int, ...], names, layout: Layout) -> ParameterPlacement:
    if names is None:
        return ParameterPlacement(path=path, shape=shape, names=None, rules=())
    rules = tuple("-" if name is None else f"{name} -> {_axes(layout.params.lookup(name)[1])}" for name in names)
    return ParameterPlacement(path=path, shape=shape, names=tuple(names), rules=rules)


def _axes(axes: tuple[str, ...]) -> str:
    return "whole" if not axes else axes[0] if len(axes) == 1 else "(" + ", ".join(axes) + ")"


def _linen_placements(index: int, argument, layout: Layout) -> list[ParameterPlacement]:
    """The parameters of a Linen variables dict ({"params": ...}) among the arguments; nothing for other values."""
    if not isinstance(argument, dict) or "params" not in argument:
        return []
    leaves = jax.tree_util.tree_leaves_with_path(argument["params"], is_leaf=lambda x: isinstance(x, nn.Partitioned))
    found = []
    for path, leaf in leaves:
        where = f"{index}/params/" + "/".join(str(getattr(key, "key", key)) for key in path)
        if isinstance(leaf, nn.LogicallyPartitioned):
            found.append(_placed(where, tuple(leaf.value.shape), tuple(leaf.names), layout))
        else:
            found.append(_placed(where, tuple(getattr(leaf, "shape", ())), None, layout))
    return found


def format_placements(placements: tuple[ParameterPlacement, ...]) -> list[tuple[str, str]]:
    """(label, cell) rows: the parameters grouped by the rules that placed them, then those without names."""
    named = [p for p in placements if p.named]
    groups: dict[str, list[str]] = defaultdict(list)
    for placement in named:
        groups[", ".join(placement.rules)].append(placement.path)
    rows = [("parameters placed by the layout's rules", f"{len(named)} of {len(placements)}")]
    rows += [(f"  {rules}", _paths(paths)) for rules, paths in groups.items()]
    unnamed = [p.path for p in placements if not p.named]
    rows.append(("without logical names (left replicated)", _paths(unnamed) if unnamed else "none"))
    return rows


def _paths(paths: list[str]) -> str:
    shown = ", ".join(paths[:SHOWN_PATHS])
    return f"{len(paths)}: {shown}" + (", ..." if len(paths) > SHOWN_PATHS else "")
