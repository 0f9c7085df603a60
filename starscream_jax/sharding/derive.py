"""`derive(rules, mesh)`: the partition-aware layout the three principles give for a strategy written for whole GPUs.

The input is a GPU-level layout: rule tables (this library's logical names) over the axes of a mesh of whole GPUs,
named by their role: `data` (data parallelism), `tensor` (tensor parallelism; `gpu` is read as `tensor`, so gpu_tp's
own tables are an input), `fsdp` (fully sharded data parallelism), `context` (the sequence split), `expert` (experts
split). The output places it on ('data', 'gpu', 'xcd'):
  - each GPU-level axis stays on GPUs: tensor, context and expert map to `gpu`; fsdp shards the batch over `gpu` and
    its weights inside each GPU (`xcd`) only, so their gathers stay on-package; data stays on `data`;
  - the partitions of a GPU get the orthogonal split: the batch over `xcd` too (the tokens); `embed`, each weight's
    other dimension, over `xcd` at rest and whole at use (gathered inside the GPU, its gradient reduce-scattered
    there); norm scales, tiny, stay whole.
`decode=True` gives the weight-stationary decode variant of a tensor-parallel table: weights stay split over `xcd`
(never gathered) and the small activations move instead (`embed` over `xcd`; attention's tokens over `xcd`, matching
the KV cache; the logits' vocabulary over (gpu, xcd)).

Refused, with the reason: a table that already names `xcd` (it is not GPU-level), an axis of no known role (derive
would not know which level it belongs to), `tensor` together with `fsdp` (both want the one `gpu` axis on the batch
or the weights), `embed` split by a GPU-level axis other than fsdp (no dimension is left for `xcd` to split at
rest), the decode variant of a table without tensor parallelism (there is nothing to keep stationary over GPUs), a
logical name the library does not know (derive places the library's names; a model's own names are mapped onto the
derived layout with `in_vocabulary`, else their rules would be dropped and their dimensions left whole), and a table
other than params and activations, or one that is not (logical name, mesh axes) pairs.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

from ..errors import ShardingRuleError
from ..hardware.axes import AXES, DATA, GPU, XCD, MeshAxes, axes_of
from .layouts import ACTIVATION_NAMES, MAY_REPLICATE, WEIGHT_NAMES, Layout, get_layout
from .rules import Rules

ROLES = {"data": DATA, "tensor": "tensor", "gpu": "tensor", "fsdp": "fsdp", "context": "context",
         "expert": "expert"}
"""GPU-level mesh axis name -> its role."""
STORAGE = "embed"
"""The weights' dimension the partitions of a GPU split at rest: the model width, in every matmul weight."""
TOKENS = ("batch", "attn_batch")
TP_NAMES = ("vocab", "heads", "kv_heads", "mlp")

Table = Rules | Mapping[str, MeshAxes] | Iterable[tuple[str, MeshAxes]]


def derive(rules: Layout | str | Mapping[str, Table], mesh, *, decode: bool = False, name: str | None = None) -> Layout:
    """The layout on `mesh` (axes data, gpu, xcd) that the three principles give for the GPU-level `rules`: a Layout
    (or a layout's name), or {"params": table, "activations": table} where a table is Rules, a dict or (logical name,
    mesh axes) pairs in the library's names (the weights at use are derived, not given). See the module for the
    mapping and for what is refused."""
    missing = [axis for axis in AXES if axis not in mesh.shape]
    if missing:
        raise ShardingRuleError(f"derive places layouts on a mesh with axes {AXES}; this mesh lacks {missing}: "
                                "build it with build_mesh")
    params, activations = _tables(rules)
    roles = _roles(params, activations)
    if "tensor" in roles and "fsdp" in roles:
        raise ShardingRuleError("derive: tensor and fsdp both want the gpu axis (one on the weights, one on the "
                                "batch); derive each alone, or keep fsdp on data")
    if decode and "tensor" not in roles:
        raise ShardingRuleError("derive: the decode variant keeps tensor-parallel weights still over GPUs, and these "
                                "rules have no tensor axis; derive the training layout instead")
    stored = {n: _on_gpus(params.get(n, ()), n, weight=True) for n in WEIGHT_NAMES}
    if stored[STORAGE] not in ((), (XCD,)):
        raise ShardingRuleError(f"derive: {STORAGE!r} is split over {params[STORAGE]} at the GPU level, which leaves "
                                "no weight dimension for the partitions of a GPU to split; keep embed unsplit (or on "
                                "fsdp)")
    stored[STORAGE] = (XCD,)
    placed = {n: _on_gpus(activations.get(n, ()), n, weight=False) for n in ACTIVATION_NAMES}
    for token_name in TOKENS:
        placed[token_name] = (*placed[token_name], XCD)
    at_use = {**stored, STORAGE: ()}
    if decode:
        at_use = stored
        placed |= {"batch": tuple(a for a in placed["batch"] if a != XCD), STORAGE: (XCD,),
                   "vocab": (*placed["vocab"], XCD)}
    suffix = "decode" if decode else "derived"
    return Layout(name=name or f"{_name(rules)}_{suffix}",
                  description=f"derived from {_name(rules)}: GPU-level axes on gpu, tokens and weight storage over xcd"
                  + (" (decode: weights stationary)" if decode else ""),
                  params=_rules(WEIGHT_NAMES, stored), weights=_rules(WEIGHT_NAMES, at_use),
                  activations=_rules(ACTIVATION_NAMES, placed))


def _tables(rules) -> tuple[dict[str, tuple[str, ...]], dict[str, tuple[str, ...]]]:
    """The GPU-level params and activations tables of `rules` as {library name: mesh axes}."""
    if isinstance(rules, (str, Layout)):
        layout = get_layout(rules)
        rules = {"params": layout.params, "activations": layout.activations}
    if not isinstance(rules, Mapping) or set(rules) != {"params", "activations"}:
        given = f"tables {sorted(map(str, rules))}" if isinstance(rules, Mapping) else type(rules).__name__
        raise ShardingRuleError(f"derive takes a Layout, a layout's name, or {{'params': table, 'activations': "
                                f"table}}, got {given}; the weights at use are derived (embed gathered inside the "
                                "GPU), not given")
    return (_as_dict(rules["params"], "params", WEIGHT_NAMES),
            _as_dict(rules["activations"], "activations", ACTIVATION_NAMES))


def _as_dict(table: Table, kind: str, known: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """`table` as {logical name: mesh axes}, the first rule of a name winning; a ShardingRuleError for a table that
    is not (name, axes) pairs or that names what the library does not know (its rule would be dropped)."""
    pairs = table.table if isinstance(table, Rules) else table.items() if isinstance(table, Mapping) else table
    try:
        found: dict[str, tuple[str, ...]] = {}
        for logical, axes in pairs:
            found.setdefault(logical, axes_of(axes))
    except (TypeError, ValueError):
        raise ShardingRuleError(f"derive: the {kind} table {table!r} is not (logical name, mesh axes) pairs; give a "
                                "dict such as {'mlp': 'tensor', 'embed': None}") from None
    unknown = sorted(map(str, set(found) - set(known)))
    if unknown:
        raise ShardingRuleError(f"derive: the {kind} table names {unknown}, which the library does not know; derive "
                                f"from the library's names ({', '.join(known)}), then map yours onto the result "
                                "with in_vocabulary(derive(...), {your name: library name})")
    return found


def _roles(*tables: dict[str, tuple[str, ...]]) -> set[str]:
    roles = set()
    for table in tables:
        for logical, axes in table.items():
            for axis in axes:
                if axis == XCD:
                    raise ShardingRuleError(f"derive: rule {logical!r} -> {axes} already splits over {XCD!r}; give "
                                            "the GPU-level rules (derive decides what the partitions split)")
                if axis not in ROLES:
                    raise ShardingRuleError(f"derive: rule {logical!r} -> {axes} names mesh axis {axis!r} of no "
                                            f"known role; name GPU-level axes {', '.join(ROLES)}")
                roles.add(ROLES[axis])
    return roles


def _on_gpus(axes: tuple[str, ...], logical: str, weight: bool) -> tuple[str, ...]:
    """A GPU-level rule's axes on (data, gpu, xcd): data stays, tensor / context / expert go to gpu; fsdp goes to
    gpu on activations (the batch) and, on weights, inside each GPU (xcd)."""
    placed = []
    for axis in axes:
        role = ROLES[axis]
        placed.append(DATA if role == DATA else XCD if (role == "fsdp" and weight) else GPU)
    return tuple(dict.fromkeys(placed))


def _rules(names: tuple[str, ...], mapping: dict[str, tuple[str, ...]]) -> Rules:
    return Rules(tuple((n, None if not mapping[n] else mapping[n][0] if len(mapping[n]) == 1 else mapping[n])
                       for n in names), may_replicate=MAY_REPLICATE)


def _name(rules) -> str:
    return rules if isinstance(rules, str) else rules.name if isinstance(rules, Layout) else "rules"
