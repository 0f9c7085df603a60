"""Read the program JAX hands to XLA: every value's global shape and the sharding the partitioner must give it.

The input is `jax.jit(f).lower(*args).as_text(debug_info=True)`: StableHLO with Shardy shardings. Under explicit
sharding JAX follows each op with an `sdy.sharding_constraint` that fixes its result's placement, and the SPMD
partitioner honours them, so these constraints say where every intermediate value (every activation) lives, with its
global shape, which the compiled per-device program no longer shows.

    %3 = sdy.sharding_constraint %2 <@mesh, [{"data", "xcd"}, {}, {}], unreduced={"gpu"}> : tensor<8x32x128xf32>
         loc(#loc37)                               (one line in the text)
    #loc37 = loc("bsd,df->bsf/dot_general"(#loc30))

Each dimension lists the mesh axes that split it (a sub-axis `"xcd":(1)2` splits by its size, 2); `unreduced` axes hold
partial sums: each device a whole-size buffer of its own part of the sum, as much memory as a copy. Values inside
`sdy.manual_computation` bodies (shard_map) have per-device shapes and are skipped, and so are those of the helpers
through which a scan reads and writes one layer of a stacked array (`dynamic_index_in_dim`,
`dynamic_update_index_in_dim`): they are that layer's slice with a leading axis of one, a copy of a value the loop body
shows, and for a weight its shape can mimic an activation's. Names come from the location table (`loc("name"(...))`,
following `callsite(callee at caller)` to the callee).
"""
from __future__ import annotations

import dataclasses
import math
import re

_CONSTRAINT = re.compile(
    r"sdy\.sharding_constraint\s+%[\w#.]+\s+<@[\w.]+,\s*\[(?P<dims>.*?)\]"
    r"(?:,\s*unreduced=\{(?P<unreduced>[^}]*)\})?[^>]*>\s*:\s*tensor<(?P<type>[^>]*)>"
    r"(?:.*\bloc\((?P<loc>#loc\d+|\"[^\"]*\"))?"
)
_FUNCTION = re.compile(r"^\s*func\.func\s+(?:public|private)\s+@([\w.$-]+)")
_SCAN_SLICE_HELPERS = ("dynamic_index_in_dim", "dynamic_update_index_in_dim")
_DIM = re.compile(r"\{([^}]*)\}")
_AXIS = re.compile(r"\"([^\"]+)\"(?::\((\d+)\)(\d+))?")
_LOC_DEFINITION = re.compile(r"^(#loc\d+) = loc\((.*)\)\s*$")
_LOC_NAME = re.compile(r"^\"([^\"]*)\"")
_LOC_CALLSITE = re.compile(r"^callsite\((#loc\d+) at ")
_DTYPE_BYTES = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "i64": 8, "i32": 4, "ui32": 4, "i16": 2, "i8": 1,
                "ui8": 1, "i1": 1, "f8E4M3FN": 1, "f8E5M2": 1}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardedValue:
    """One value of the program: its op name, global shape and element type, and for each dimension the mesh axes
    that split it as (axis, split factor) pairs (the factor is the axis size unless a sub-axis is used)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    dims: tuple[tuple[tuple[str, int | None], ...], ...]
    unreduced: frozenset[str]

    @property
    def bytes(self) -> int:
        """Global bytes of the value (1 byte per element for an unknown element type)."""
        return math.prod(self.shape) * _DTYPE_BYTES.get(self.dtype, 1)

    def split(self, axis: str, size: int) -> int:
        """How many ways the value is divided over mesh `axis` of `size` devices: by a dimension split over it (the
        sub-axis factor when only part of it is used). Partial sums over `axis` divide nothing: each device there
        holds a whole-size buffer of its own partial sum, so the axis holds `size` full-size copies of the memory."""
        factors = [factor or size for dim in self.dims for name, factor in dim if name == axis]
        return math.prod(factors) if factors else 1


def sharded_values(text: str) -> list[ShardedValue]:
    """Every `sdy.sharding_constraint` result outside shard_map bodies and scan slice helpers, in program order."""
    names = _location_names(text)
    values = []
    manual_indent: int | None = None
    in_slice_helper = False
    for line in text.splitlines():
        function = _FUNCTION.match(line)
        if function:
            in_slice_helper = function[1].startswith(_SCAN_SLICE_HELPERS)
        if in_slice_helper:
            continue
        indent = len(line) - len(line.lstrip())
        if manual_indent is not None:
            if indent > manual_indent:
                continue
            manual_indent = None
        if "sdy.manual_computation" in line and line.rstrip().endswith("{"):
            manual_indent = indent
            continue
        found = _CONSTRAINT.search(line)
        if found:
            values.append(_value(found, names))
    return values


def _value(found: re.Match, names: dict[str, str]) -> ShardedValue:
    *sizes, dtype = found["type"].split("x")
    dims = tuple(tuple((axis, int(size) if size else None) for axis, _, size in _AXIS.findall(dim))
                 for dim in _DIM.findall(found["dims"]))
    unreduced = frozenset(re.findall(r"\"([^\"]+)\"", found["unreduced"] or ""))
    location = found["loc"] or ""
    name = names.get(location, location.strip('"'))
    return ShardedValue(name=name, shape=tuple(int(size) for size in sizes), dtype=dtype, dims=dims,
                        unreduced=unreduced)


def _location_names(text: str) -> dict[str, str]:
    """{"#locN": op name} from the location table at the end of the text."""
    definitions = {}
    for line in text.splitlines():
        found = _LOC_DEFINITION.match(line)
        if found:
            definitions[found[1]] = found[2]

    def name_of(label: str, depth: int = 0) -> str:
        body = definitions.get(label, "")
        named = _LOC_NAME.match(body)
        if named:
            return named[1]
        callsite = _LOC_CALLSITE.match(body)
        return name_of(callsite[1], depth + 1) if callsite and depth < 64 else ""

    return {label: name_of(label) for label in definitions}
