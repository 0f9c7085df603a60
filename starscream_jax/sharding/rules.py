"""Logical axis names -> mesh axes: the one strict resolver the whole library uses.

A `Rules` table is ordered (logical name, mesh axes) pairs; the first pair naming a logical name wins. Resolving a
tensor's logical names gives its PartitionSpec, or a ShardingRuleError naming the tensor, its shape and the rule when:
  - a logical name is not in the table (unknown name),
  - the table maps to a mesh axis the mesh lacks,
  - one mesh axis would shard two dimensions of the tensor,
  - the mesh axes do not divide the dimension. Only names listed in `may_replicate` (e.g. kv heads fewer than
    devices) fall back to the longest leading part of their axes that divides, i.e. are replicated on purpose;
    such a name also leaves out the axes an earlier dimension of the tensor took (an expert's hidden dimension
    takes the GPUs only where the experts are too few to).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from jax.sharding import PartitionSpec

from ..errors import ShardingRuleError
from ..hardware.axes import MeshAxes, axes_of

LogicalNames = tuple[str | None, ...]


@dataclass(frozen=True)
class Rules:
    """An ordered table from logical names to mesh axes (None = replicated, by explicit choice)."""

    table: tuple[tuple[str, MeshAxes], ...]
    may_replicate: frozenset[str] = field(default_factory=frozenset)

    def lookup(self, name: str) -> tuple[bool, tuple[str, ...]]:
        for logical, axes in self.table:
            if logical == name:
                return True, axes_of(axes)
        return False, ()

    def names(self) -> list[str]:
        return list(dict.fromkeys(logical for logical, _ in self.table))


def _axes_size(mesh, axes: tuple[str, ...]) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def resolve(names: LogicalNames, shape: tuple[int, ...], rules: Rules, mesh, tensor: str = "tensor",
            table_name: str = "rules") -> PartitionSpec:
    """The PartitionSpec of a tensor of `shape` whose dimensions carry the logical `names` (None = unsharded)."""
    where = f"{tensor} {tuple(shape)} with logical axes {tuple(names)}"
    if len(names) != len(shape):
        raise ShardingRuleError(f"{where}: {len(names)} logical names for {len(shape)} dimensions; "
                                f"give one name (or None) per dimension")
    used: dict[str, str] = {}
    spec = []
    for name, size in zip(names, shape):
        axes = _resolve_dim(name, size, rules, mesh, where, table_name, frozenset(used))
        for axis in axes:
            if axis in used:
                raise ShardingRuleError(
                    f"{where}: mesh axis {axis!r} would shard both {used[axis]!r} and {name!r}; change the "
                    f"{table_name} so each mesh axis appears once per tensor")
            used[axis] = name
        spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*spec)


def _resolve_dim(name: str | None, size: int, rules: Rules, mesh, where: str, table_name: str,
                 taken: frozenset[str]) -> tuple[str, ...]:
    if name is None:
        return ()
    found, axes = rules.lookup(name)
    if name in rules.may_replicate:
        axes = tuple(axis for axis in axes if axis not in taken)
    if not found:
        raise ShardingRuleError(f"{where}: unknown logical name {name!r} in the {table_name}; known names: "
                                f"{', '.join(rules.names())}; add a rule for it or rename the dimension")
    missing = [a for a in axes if a not in mesh.shape]
    if missing:
        raise ShardingRuleError(f"{where}: rule {name!r} -> {axes} in the {table_name} names mesh axes {missing} "
                                f"the mesh lacks (mesh axes: {tuple(mesh.shape)}); build the mesh with build_mesh")
    if size % _axes_size(mesh, axes) == 0:
        return axes
    if name in rules.may_replicate:
        for keep in range(len(axes) - 1, -1, -1):
            if size % _axes_size(mesh, axes[:keep]) == 0:
                return axes[:keep]
    raise ShardingRuleError(
        f"{where}: dimension {name!r} of size {size} is not divisible by mesh axes {axes} (size "
        f"{_axes_size(mesh, axes)}) of rule {name!r} in the {table_name}; pick a size that is a multiple of "
        f"{_axes_size(mesh, axes)} or a smaller mesh")
