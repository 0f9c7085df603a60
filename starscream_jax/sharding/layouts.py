"""Layouts as data: where each logical dimension of weights, optimizer state, activations and KV cache goes.

A layout has three rule tables over the mesh axes ('data', 'gpu', 'xcd'):
  params       weights and optimizer state at rest (what each device stores),
  weights      weights at the moment a matmul uses them (a difference from `params` = an all-gather just before use,
               whose transpose in the backward pass is a reduce-scatter of the weight gradient),
  activations  activations, logits and the KV cache.
Logical names: layers, vocab, embed, heads, kv_heads, head_dim, mlp, experts, expert_mlp (an expert's hidden
dimension), norm (weights); batch (tokens of the residual stream and MLP), attn_batch (tokens inside attention and
the KV cache), seq (the step's positions), cache_seq (the KV cache's positions), and the weight names (activations).

The layouts (X partitions per GPU, Y GPUs):
  flat_tp            the chiplet-oblivious baseline: heads / kv heads / mlp / vocab over (gpu, xcd) = X*Y-way TP;
                     activations replicated on every device; kv heads copied when fewer than X*Y. Collectives span
                     both axes (flat all-reduces), local matmuls have weight dims divided by X*Y.
  gpu_tp             plain TP over gpu, every partition of a GPU computing the same thing (replicated over xcd).
                     The reference for kernel shapes (what SPX mode gives).
  starscream_tp      TP over gpu for heads / kv heads / mlp / vocab; tokens (batch) over xcd; each weight's other
                     dimension (embed) over xcd at rest, all-gathered inside the GPU just before use, its gradient
                     reduce-scattered over xcd; optimizer state like the weights; KV cache kv heads over gpu, batch
                     over xcd; vocab-parallel logits and loss. Collectives: all-gather / reduce-scatter over xcd
                     (intra-GPU), all-reduce over gpu of B/X tokens (inter-GPU). For train and prefill.
  starscream_decode  2-D weight-stationary for decode: weights split over gpu (heads, mlp, vocab) and xcd (embed),
                     never gathered; the small activations move instead: residual stream embed over xcd, attention
                     tokens over xcd to match the KV cache (kv heads over gpu, batch over xcd), logits vocab over
                     (gpu, xcd) (reduce-scattered inside the GPU). Each weight byte is read once per GPU per step.
                     The MLP hidden and attention output are whole on every partition of a GPU (they meet weights
                     split over xcd on the embed side): small at one token per sequence, so not for prefill. A
                     mixture of experts' router and experts are placed alike (each expert whole on every GPU, its
                     hidden dim over gpu, embed over xcd) and never gathered either: the block sums each partition's
                     partial logits and gate / up inside the GPU (`model.moe`), so they too are read once per GPU.
  flat_fsdp          fully sharded data parallel over all devices: weights' embed over (gpu, xcd), gathered before
                     use by flat all-gathers; batch over (data, gpu, xcd); gradients reduce-scattered flat.
  starscream_fsdp    hierarchical FSDP: weights sharded inside each GPU (embed over xcd), replicated across GPUs;
                     batch over (data, gpu, xcd); gathers stay on-package, gradients reduce-scatter over xcd and then
                     all-reduce 1/X of the bytes over gpu.
  flat_cp            context parallelism stretched over every partition: the sequence over (gpu, xcd), weights
                     fully sharded over all devices (embed over (gpu, xcd)) and gathered by flat all-gathers before
                     use; attention gathers keys and values over the sequence axes. For long sequences, few of them.
  starscream_cp      TP over gpu (as starscream_tp) with the sequence, not the batch, over xcd: each partition
                     holds a stretch of every sequence, attention gathers keys and values inside the GPU, weights
                     are gathered inside the GPU. For training and uncached prefill of sequences too few to split the
                     batch over the partitions.
  starscream_ep      expert parallelism for mixture-of-experts models: experts over gpu, tokens over xcd (and data);
                     each expert weight's other dimension (embed) over xcd at rest, gathered inside the GPU at use,
                     its gradient reduce-scattered there. Attention and the rest as starscream_tp. The residual
                     stream is whole on every GPU (tensor-parallel attention leaves it so), so the tokens need no
                     dispatch: each partition runs the tokens of its batch shard that chose its GPU's experts, and
                     the combine sums the partial outputs across GPUs between same-index partitions (inter-GPU,
                     B/X tokens). Where the experts are fewer than the GPUs (or do not divide over them), each
                     expert is whole on every GPU and its hidden dimension (expert_mlp) goes over gpu instead:
                     tensor parallelism inside every expert, with the same collectives.
  flat_ep            the chiplet-oblivious expert parallelism: experts over every partition (gpu, xcd), attention
                     as flat_tp, tokens whole on every device; the combine is one all-reduce over all partitions.
                     Experts that do not divide over every partition go over the longest leading part of (gpu, xcd)
                     that divides them, their hidden dimension over the rest; so do query heads (Mixtral's and
                     Qwen3's 32 over 64 partitions: over the GPUs, each copied on every partition of its GPU).
Layouts that split the sequence (the _cp pair) split their KV cache's positions the same way (`cache_seq`), which
prefill writes from the keys its attention gathers and split-K decode reads (`model.split_k`).
Every layout maps `data` to the batch (pure data parallelism across GPU groups or nodes).

Any batch on any mesh (`fit_batch`): where the batch axes of a layout do not divide the batch, the longest leading
part of them that does splits it, and each axis left over goes to the positions instead: the step's sequence (`seq`,
training and prefill, as starscream_cp splits it) and the KV cache's positions (`cache_seq`: split-K decode, each
partition attending to its 1/X of every sequence's cache). The `data` axis is the exception: a batch too small for the
data-parallel groups is computed whole by each group (a stated replication across GPUs, never inside one).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from jax.sharding import AbstractMesh, Mesh

from ..checks import of_type
from ..errors import ShardingRuleError
from ..hardware.axes import AXES, DATA, GPU, XCD, MeshAxes
from .rules import Rules

WEIGHT_NAMES = ("layers", "vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "experts", "expert_mlp", "norm")
ACTIVATION_NAMES = ("layers", "batch", "attn_batch", "seq", "cache_seq", "vocab", "embed", "heads", "kv_heads",
                    "head_dim", "mlp", "experts")
RULE_TABLES = ("params", "weights", "activations")


@dataclass(frozen=True, kw_only=True)
class Layout:
    """Three rule tables (see the module docstring) and a one-line description."""

    name: str
    description: str
    params: Rules
    weights: Rules
    activations: Rules
    replicated_ok: frozenset[str] = frozenset({"norm"})

    @property
    def splits_sequence(self) -> bool:
        """Whether activations split the sequence over a mesh axis (context parallelism: no KV cache)."""
        return bool(self.activations.lookup("seq")[1])

    def with_rules(self, **tables: dict[str, MeshAxes]) -> Layout:
        """A copy with some rules changed, e.g. `layout.with_rules(activations={"batch": "data"})`. A table other
        than params / weights / activations, or a logical name the table lacks, is an error (a typo would otherwise
        leave the layout unchanged)."""
        updated = {}
        for kind, changes in tables.items():
            if kind not in RULE_TABLES:
                raise ShardingRuleError(f"layout {self.name} has no rule table {kind!r}; change one of "
                                        f"{', '.join(RULE_TABLES)}")
            old: Rules = getattr(self, kind)
            unknown = sorted(set(changes) - set(old.names()))
            if unknown:
                raise ShardingRuleError(f"{kind} rules of layout {self.name} have no logical name(s) {unknown}; "
                                        f"known names: {', '.join(old.names())}")
            updated[kind] = Rules(tuple((n, changes.get(n, a)) for n, a in old.table), old.may_replicate)
        return replace(self, **updated)


MAY_REPLICATE = frozenset({"kv_heads", "experts", "expert_mlp"})
"""Names that fall back to fewer mesh axes (replicated on purpose) where theirs do not divide them or an earlier
dimension of the tensor took them: kv heads fewer than the devices, experts fewer than the GPUs."""


def _rules(names: tuple[str, ...], mapping: dict[str, MeshAxes], may_replicate: frozenset[str]) -> Rules:
    return Rules(tuple((n, mapping.get(n)) for n in names), may_replicate=may_replicate)


def _layout(name: str, description: str, params: dict, activations: dict, weights: dict | None = None,
            may_replicate: frozenset[str] = MAY_REPLICATE) -> Layout:
    return Layout(name=name, description=description, params=_rules(WEIGHT_NAMES, params, may_replicate),
                  weights=_rules(WEIGHT_NAMES, {**params, **(weights or {})}, may_replicate),
                  activations=_rules(ACTIVATION_NAMES, activations, may_replicate))


FLAT = (GPU, XCD)
_TP_WEIGHTS = lambda axes: {  # noqa: E731
    "vocab": axes, "heads": axes, "kv_heads": axes, "mlp": axes, "expert_mlp": axes}
ALL_TOKENS = AXES

LAYOUTS: dict[str, Layout] = {
    layout.name: layout for layout in (
        _layout("flat_tp", "tensor parallelism stretched over every partition (the chiplet-oblivious baseline)",
                params=_TP_WEIGHTS(FLAT),
                activations={"batch": DATA, "attn_batch": DATA, **_TP_WEIGHTS(FLAT)}),
        _layout("gpu_tp", "tensor parallelism over GPUs, replicated over partitions (the kernel-shape reference)",
                params=_TP_WEIGHTS(GPU),
                activations={"batch": DATA, "attn_batch": DATA, **_TP_WEIGHTS(GPU)}),
        _layout("starscream_tp", "TP over GPUs, tokens and weight storage over partitions (train and prefill)",
                params={**_TP_WEIGHTS(GPU), "embed": XCD}, weights={"embed": None},
                activations={"batch": (DATA, XCD), "attn_batch": (DATA, XCD), **_TP_WEIGHTS(GPU)}),
        _layout("starscream_decode", "2-D weight-stationary over GPUs and partitions (decode)",
                params={**_TP_WEIGHTS(GPU), "embed": XCD},
                activations={"batch": DATA, "attn_batch": (DATA, XCD),
                             "embed": XCD, **_TP_WEIGHTS(GPU), "vocab": FLAT}),
        _layout("flat_fsdp", "fully sharded data parallelism over every partition, flat collectives",
                params={"embed": FLAT}, weights={"embed": None},
                activations={"batch": ALL_TOKENS, "attn_batch": ALL_TOKENS}),
        _layout("starscream_fsdp", "data parallelism across GPUs, weights sharded inside each GPU",
                params={"embed": XCD}, weights={"embed": None},
                activations={"batch": ALL_TOKENS, "attn_batch": ALL_TOKENS}),
        _layout("flat_cp", "context parallelism over every partition, weights fully sharded, flat collectives",
                params={"embed": FLAT}, weights={"embed": None},
                activations={"batch": DATA, "attn_batch": DATA, "seq": FLAT, "cache_seq": FLAT}),
        _layout("starscream_cp", "TP over GPUs, the sequence over partitions (long sequences, train and prefill)",
                params={**_TP_WEIGHTS(GPU), "embed": XCD}, weights={"embed": None},
                activations={"batch": DATA, "attn_batch": DATA, "seq": XCD, "cache_seq": XCD, **_TP_WEIGHTS(GPU)}),
        _layout("starscream_ep", "experts over GPUs, tokens and weight storage over partitions (mixture of experts)",
                params={**_TP_WEIGHTS(GPU), "experts": GPU, "embed": XCD}, weights={"embed": None},
                activations={"batch": (DATA, XCD), "attn_batch": (DATA, XCD), **_TP_WEIGHTS(GPU)}),
        _layout("flat_ep", "experts over every partition, attention as flat_tp (the chiplet-oblivious baseline)",
                params={**_TP_WEIGHTS(FLAT), "experts": FLAT},
                activations={"batch": DATA, "attn_batch": DATA, **_TP_WEIGHTS(FLAT)},
                may_replicate=MAY_REPLICATE | {"heads"}),
    )
}

EXPERT_LAYOUTS = ("starscream_ep", "flat_ep")
"""The layouts made for a mixture of experts (a dense model they place as starscream_tp and flat_tp do)."""

PHASE_DEFAULTS = {"train": "starscream_tp", "prefill": "starscream_tp", "decode": "starscream_decode"}
"""The layout each phase runs under unless told, in every command: `starscream train` (and `TrainConfig`),
`generate` (its prefill and its decode) and the layouts `inspect` judges."""
BASELINE = "flat_tp"
"""The chiplet-oblivious layout `inspect` judges beside each phase's default."""


def get_layout(name: str | Layout) -> Layout:
    """A layout by name (a key of `LAYOUTS`); a Layout is returned as it is."""
    if isinstance(name, Layout):
        return name
    if name not in LAYOUTS:
        raise ShardingRuleError(f"unknown layout {name!r}; choose one of {', '.join(LAYOUTS)}")
    return LAYOUTS[name]


FLAX_TABLES = (*RULE_TABLES, "use")
FlaxRules = tuple[tuple[str, MeshAxes], ...]
"""A rule table as the (logical name, mesh axes) pairs Flax's `logical_axis_rules` contexts take."""


def flax_table(layout: Layout, table: str, names: dict[str, dict[str, str | None]] | None = None) -> FlaxRules:
    """`layout`'s `table` (one of FLAX_TABLES) as (name, mesh axes) pairs, each name once, so that Flax's Linen and
    NNX resolvers read it alike. `names` gives per rule table {exported name: the layout's name} (default: every
    name the table knows, as itself; a name mapped to None is never split).

    "use" is the weights table and the activations table together: what a step reads where one context places both
    (Linen's apply constrains each parameter to its rule as a module reads it, and activations are constrained by
    name). A name the two tables place differently is an error there: give weights and activations distinct names
    (as MaxText's `activation_*` do)."""
    if table not in FLAX_TABLES:
        raise ShardingRuleError(f"no rule table {table!r}; choose one of {', '.join(FLAX_TABLES)}")
    if table != "use":
        return _pairs(getattr(layout, table), None if names is None else names[table])
    weights = _pairs(layout.weights, None if names is None else names["weights"])
    activations = _pairs(layout.activations, None if names is None else names["activations"])
    clashes = sorted(name for name, axes in weights if dict(activations).get(name, axes) != axes)
    if clashes:
        raise ShardingRuleError(f"layout {layout.name} places weights and activations named {clashes} differently, so "
                                "one Flax rule table cannot hold both; use a vocabulary whose activation names differ "
                                "from its weight names (MAXTEXT) or the 'weights' and 'activations' tables apart")
    return tuple(dict([*activations, *weights]).items())


def _pairs(rules: Rules, names: dict[str, str | None] | None) -> FlaxRules:
    names = {name: name for name in rules.names()} if names is None else names
    pairs = []
    for name, ours in names.items():
        found, axes = (True, ()) if ours is None else rules.lookup(ours)
        if found:
            pairs.append((name, None if not axes else axes[0] if len(axes) == 1 else axes))
    return tuple(pairs)


def fit_batch(layout: Layout | str, mesh, batch: int, positions: int | None) -> Layout:
    """The layout that places `batch` sequences of `positions` tokens on `mesh` (1: decode; None: a prefill, which
    pads its prompt to a multiple of the sequence split itself, `positions_multiple`): `layout` itself where its
    batch axes divide the batch, else the variant the module docstring describes (named `<layout>+seq` when the
    step's sequence takes axes, `<layout>+split_k` when only the cache's positions do, `+data` added when the data
    groups hold copies). A ShardingRuleError names the sequence length to use where the sequence split does not
    divide `positions` (training)."""
    layout = get_layout(layout)
    of_type(mesh, (Mesh, AbstractMesh), "mesh", "a jax.sharding.Mesh, as build_mesh gives", ShardingRuleError)
    for name, value in (("batch", batch), ("positions", 1 if positions is None else positions)):
        of_type(value, int, name, "a whole number", ShardingRuleError)
    prefill = positions is None
    positions = 2 if prefill else positions
    if batch < 1 or positions < 1:
        raise ShardingRuleError(f"a batch of {batch} sequences of {positions} tokens; both must be at least 1")
    changes: dict[str, MeshAxes] = {}
    dropped: set[str] = set()
    for name in ("batch", "attn_batch"):
        axes = layout.activations.lookup(name)[1]
        kept = _dividing_prefix(axes, mesh, batch)
        if kept != axes:
            changes[name] = kept or None
            dropped.update(axes[len(kept):])
    left_over = _in_mesh_order(tuple(dropped - {DATA}))
    # the residual stream's sequence takes the axes its embed dimension leaves (starscream_decode splits embed)
    to_seq = tuple(axis for axis in left_over if axis not in layout.activations.lookup("embed")[1])
    seq_axes = _in_mesh_order(layout.activations.lookup("seq")[1] + to_seq) if positions > 1 else ()
    cache_axes = _in_mesh_order(layout.activations.lookup("cache_seq")[1] + left_over)
    if seq_axes != layout.activations.lookup("seq")[1]:
        changes["seq"] = seq_axes or None  # decode: one token per sequence, whole on the partitions of its cache
    if not changes:
        return layout
    changes["cache_seq"] = cache_axes or None
    split = math.prod(mesh.shape[axis] for axis in seq_axes)
    if positions % split and not prefill:
        raise ShardingRuleError(
            f"layout {layout.name} places a batch of {batch} by splitting each sequence over {seq_axes} ({split} "
            f"parts), which {positions} tokens do not divide; use {-(-positions // split) * split} tokens per "
            f"sequence or a batch that is a multiple of {_batch_multiple(layout, mesh)}")
    suffix = ("+seq" if seq_axes else "+split_k") if left_over or "seq" in changes else ""
    suffix += "+data" if DATA in dropped else ""
    over = " x ".join(seq_axes or cache_axes)
    where = ("each sequence over " if seq_axes else "the KV cache's positions over ") + over if over else ""
    copied = "copied over data" if DATA in dropped else ""
    return replace(layout.with_rules(activations=changes), name=layout.name + suffix,
                   description=f"{layout.description}; a batch of {batch}: {', '.join(filter(None, (where, copied)))}")


def positions_multiple(layout: Layout | str, mesh, name: str = "seq") -> int:
    """The number of parts `layout` splits the positions into on `mesh`: of a step's sequence (`seq`, which a
    prefill pads its prompt to a multiple of), or of the KV cache (`cache_seq`, a multiple of which its length must
    be)."""
    return math.prod(mesh.shape[axis] for axis in get_layout(layout).activations.lookup(name)[1])


def _dividing_prefix(axes: tuple[str, ...], mesh, size: int) -> tuple[str, ...]:
    """The longest leading part of `axes` whose mesh sizes multiply to a divisor of `size`."""
    for keep in range(len(axes), -1, -1):
        if size % math.prod(mesh.shape[axis] for axis in axes[:keep]) == 0:
            return axes[:keep]
    return ()


def _in_mesh_order(axes: tuple[str, ...]) -> tuple[str, ...]:
    """`axes` without repeats, outermost first (data, gpu, xcd), as a PartitionSpec entry lists them."""
    return tuple(axis for axis in AXES if axis in axes)


def _batch_multiple(layout: Layout, mesh) -> int:
    """The smallest batch `layout`'s batch axes split without a fallback."""
    return math.lcm(*(math.prod(mesh.shape[axis] for axis in layout.activations.lookup(name)[1])
                      for name in ("batch", "attn_batch")))
