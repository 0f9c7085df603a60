"""Layouts for models written with Flax's own layers and logical-axis annotations.

A Flax model names its dimensions in its own vocabulary: NNX variables carry logical names in their `out_sharding`
metadata (`nnx.with_partitioning(init, ("embed", "mlp"))`, or a layer's `kernel_metadata`), Linen parameters in
`nn.with_logical_partitioning`, activations in `nn.with_logical_constraint`. A vocabulary maps those names to this
library's (`embed`, `mlp`, `heads`, `kv_heads`, `head_dim`, `vocab`, `norm`, `layers`, `experts`, `batch`,
`attn_batch`, `seq`): `STARSCREAM` is the identity, `MAXTEXT` MaxText's names (`activation_batch`,
`activation_length`, `activation_embed`, `kv`, `exp`, ...), any dict {your name: library name} is a vocabulary, and a
`Vocabulary` maps weights' and activations' names apart; a name mapped to None is a dimension no layout splits.
On a mesh with Auto axes `use_layout` installs the layout's "use" table as Flax's rule context itself, so a model
written for Flax's GSPMD guide needs none of these calls in its own code.

  `in_vocabulary(layout, vocabulary)`  the layout with every rule also under your names (yours first), so that
                                       `create_sharded`, `use_layout`, `constrain` and `weight` read your names;
  `flax_rules(layout, table, vocabulary)`  a rule table as the (name, mesh axes) pairs `nnx.logical_axis_rules` and
                                       `nn.logical_axis_rules` take: "params" (at rest), "weights" (at use),
                                       "activations", or "use" (weights and activations together, for Linen's
                                       apply, where parameters are constrained to their rule as they are read);
  `weights_at_use(model)`              the model with every named parameter as a matmul uses it (`apply.weight`):
                                       gathered inside the GPU and its gradient reduced in two stages. Flax's layers
                                       read their kernels themselves and never call `weight`; this one call in the
                                       loss function gives them what `weight` gives this library's layers.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import jax
from flax import nnx

from ..errors import ShardingRuleError
from ..hardware.axes import axes_of
from .apply import Placement, active, logical_names, path_name, weight
from .at_use import ParamAtUse
from .layouts import ACTIVATION_NAMES, RULE_TABLES, WEIGHT_NAMES, FlaxRules, Layout, flax_table, get_layout
from .rules import LogicalNames, Rules

STARSCREAM: dict[str, str] = {name: name for name in dict.fromkeys((*WEIGHT_NAMES, *ACTIVATION_NAMES))}
"""This library's own names."""

@dataclass(frozen=True)
class Vocabulary:
    """A model's logical names mapped to the library's, separately for weights (the params and weights tables) and
    activations, for a vocabulary that names a dimension differently in each (MaxText's `embed` and
    `activation_embed`). A plain dict {your name: library name} serves every table."""

    weights: Mapping[str, str]
    activations: Mapping[str, str]


MAXTEXT = Vocabulary(
    weights={"layers": "layers", "embed": "embed", "mlp": "mlp", "heads": "heads", "q_heads": "heads",
             "kv_heads": "kv_heads", "kv": "head_dim", "kv_head_dim": "head_dim", "vocab": "vocab", "norm": "norm",
             "exp": "experts"},
    activations={"activation_batch": "batch", "activation_embed_and_logits_batch": "batch",
                 "activation_kv_batch": "attn_batch", "activation_length": "seq", "activation_q_length": "seq",
                 "activation_kv_length": "seq", "activation_embed": "embed", "activation_mlp": "mlp",
                 "activation_heads": "heads", "activation_kv_heads": "kv_heads", "activation_kv": "head_dim",
                 "activation_kv_head_dim": "head_dim", "activation_vocab": "vocab", "activation_exp": "experts"},
)
"""MaxText's logical names (its base.yml `logical_axis_rules`), mapped to this library's."""
VocabularyLike = Vocabulary | Mapping[str, str]


def _for_table(vocabulary: VocabularyLike, table: str) -> Mapping[str, str]:
    """The part of `vocabulary` that names the dimensions of `table`'s tensors."""
    if not isinstance(vocabulary, Vocabulary):
        return vocabulary
    return vocabulary.activations if table == "activations" else vocabulary.weights


def in_vocabulary(layout: Layout | str, vocabulary: VocabularyLike = STARSCREAM) -> Layout:
    """`layout` whose rule tables also answer to the names of `vocabulary` ({your name: library name}): each of your
    names gets the rule of the library name it maps to, ahead of the library's own rules (yours win where a name is
    both). A name mapped to a name no layout knows is an error."""
    layout = get_layout(layout)
    named = _known(vocabulary)
    tables = {kind: _renamed(getattr(layout, kind), named[kind]) for kind in RULE_TABLES}
    replicated_ok = layout.replicated_ok | {yours for names in named.values() for yours, ours in names.items()
                                            if ours in layout.replicated_ok}
    return Layout(name=layout.name, description=layout.description, **tables, replicated_ok=frozenset(replicated_ok))


def _known(vocabulary: VocabularyLike) -> dict[str, Mapping[str, str]]:
    """`vocabulary` for each rule table; a ShardingRuleError where it maps a name to one no layout knows (a
    dimension it names would otherwise be silently left whole)."""
    named = {kind: _for_table(vocabulary, kind) for kind in RULE_TABLES}
    unknown = sorted({f"{yours} -> {ours}" for names in named.values() for yours, ours in names.items()
                      if ours is not None and ours not in STARSCREAM})
    if unknown:
        raise ShardingRuleError(f"vocabulary maps to names no layout knows: {', '.join(unknown)}; map each name to "
                                f"one of {', '.join(STARSCREAM)}, or to None for a dimension never split")
    return named


def _renamed(rules: Rules, vocabulary: Mapping[str, str]) -> Rules:
    yours = tuple((name, None if ours is None else rules.lookup(ours)[1] or None) for name, ours in vocabulary.items()
                  if (ours is None or rules.lookup(ours)[0]) and name != ours)
    may_replicate = {name for name, ours in vocabulary.items() if ours in rules.may_replicate}
    return Rules(yours + rules.table, rules.may_replicate | frozenset(may_replicate))


def flax_rules(layout: Layout | str, table: str = "params", vocabulary: VocabularyLike | None = None) -> FlaxRules:
    """The layout's `table` as the (logical name, mesh axes) pairs Flax's `logical_axis_rules` contexts take, under
    the names of `vocabulary` only (default: every name the layout's table knows, yours too after `in_vocabulary`),
    each name once, so Flax's Linen and NNX resolvers read it alike.

    "params" (at rest), "weights" (at use), "activations", or "use": the weights table and the activations table
    together, for a step where one context places both (see `layouts.flax_table`); a name the two place differently
    is an error there."""
    names = None if vocabulary is None else _known(vocabulary)
    return flax_table(get_layout(layout), table, names)


def weights_at_use(model: nnx.Module) -> nnx.Module:
    """A view of `model` whose named parameters are as a matmul uses them under the active layout (`weight`): a
    layout that stores a weight split inside the GPU gathers it here, and its gradient is reduce-scattered inside the
    GPU before it is summed across GPUs. Call it in the loss function, on the model being differentiated; the
    original parameters receive the gradients. Identity outside `use_layout`.

    Parameters named by one of the layout's `replicated_ok` names (norm scales) are left as they are. Only the
    weights Flax's layers contract in a matmul (`MATMUL_LAYERS`: the `kernel` of `nnx.Linear`, `nnx.LinearGeneral`
    and `nnx.Einsum`, an `nnx.Embed` table) are typed for the two-stage reduction; every other named parameter,
    Flax's elementwise ones (biases, norm scales), a convolution's kernel (JAX's convolution takes no operand typed
    so) and a model's own (a class token, a learned position table, a layer scale: read by code this function
    cannot see, elementwise as often as not), is only placed as it is used: a weight typed for the two-stage reduction
    enters nothing but a matmul (`apply.scale` and `apply.shift` are the library's elementwise forms), so XLA sums
    their gradients itself, over every token axis at once. So is a lookup table whose rows the layout does not
    split (`_looked_up_by_position`: positions, segments).
    Parameters that `create_sharded` made `ParamAtUse`s (on Auto axes) read at use already and are left as they
    are."""
    current = active()
    if current is None:
        return model
    matmuls = _matmul_weights(model)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def at_use(path, variable):
        names = logical_names(variable)
        if names is None or current.layout.replicated_ok & set(names) or isinstance(variable, ParamAtUse):
            return variable  # a ParamAtUse reads at use already
        value = variable.get_value()
        if _keys(path) not in matmuls or _looked_up_by_position(path, value, names, current):
            return variable.replace(current.placed_at_use(value, names, path_name(path)))
        return variable.replace(weight(value, names, tensor=path_name(path)))

    used = jax.tree.map_with_path(at_use, params, is_leaf=lambda node: isinstance(node, nnx.Variable))
    return nnx.merge(graphdef, used, rest)


MATMUL_LAYERS = {nnx.Linear: "kernel", nnx.LinearGeneral: "kernel", nnx.Einsum: "kernel", nnx.Embed: "embedding"}
"""Flax's layers that contract a parameter in a matmul (dot_general; `nnx.Embed`'s `attend`), and its name."""


def _keys(path) -> tuple[str, ...]:
    return tuple(str(getattr(key, "key", key)) for key in path)


def _matmul_weights(model: nnx.Module) -> set[tuple[str, ...]]:
    """The paths of the parameters `MATMUL_LAYERS` contract in a matmul, in `model` (subclasses of those layers
    too)."""
    return {(*_keys(path), name) for path, node in nnx.iter_graph(model) for layer, name in MATMUL_LAYERS.items()
            if isinstance(node, layer)}


LOOKUP_TABLE = "embedding"
"""The name of the table `nnx.Embed` gathers rows from (and `attend` multiplies by)."""


def _looked_up_by_position(path, value: jax.Array, names: LogicalNames, placement: Placement) -> bool:
    """Whether the parameter at `path` is a lookup table [rows, D] (`LOOKUP_TABLE`) whose rows the layout leaves
    whole at use on `placement`'s mesh: a table of positions or segments, not the vocabulary (split over GPUs).

    Such a table is read by indices the same on every partition (positions 0..S-1), not by the tokens the layout
    splits. `nnx.Embed` gathers through `auto_axes`, which drops a table's `reduced` type, and the gather's transpose
    then marks the gradient, already summed over the token axes, as still to be summed: typed for `weight`'s
    two-stage reduction, the table's gradient would come back multiplied by the number of token shards. Only placed
    at use, XLA sums it once. A vocabulary's rows are looked up by the tokens, which split as the gradient sums."""
    if str(getattr(path[-1], "key", path[-1])) != LOOKUP_TABLE or not names:
        return False
    rows = placement.weight_spec(names, value.shape, path_name(path))[0]
    return math.prod(placement.mesh.shape[axis] for axis in axes_of(rows)) == 1
