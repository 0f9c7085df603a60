"""Layouts as data: where each logical dimension of weights, optimizer state, activations and KV cache goes.

A layout has three rule tables over the mesh axes ('data', 'gpu', 'xcd'):
  params       weights and optimizer state at rest (what each device stores),
  weights      weights at the moment a matmul uses them (a difference from `params` = an all-gather just before use,
               whose transpose in the backward pass is a reduce-scatter of the weight gradient),
  activations  activations, logits and the KV cache.
Logical names: layers, vocab, embed, heads, kv_heads, head_dim, mlp, experts, norm (weights); batch (tokens of the
residual stream and MLP), attn_batch (tokens inside attention and the KV cache), seq, and the weight names
(activations).

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
                     split over xcd on the embed side): small at one token per sequence, so not for prefill.
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
Layouts that split the sequence (the _cp pair) run attention without a KV cache only (`Layout.splits_sequence`).
Every layout maps `data` to the batch (pure data parallelism across GPU groups or nodes).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import ShardingRuleError
from ..hardware.axes import AXES, DATA, GPU, XCD, MeshAxes
from .rules import Rules

WEIGHT_NAMES = ("layers", "vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "experts", "norm")
ACTIVATION_NAMES = ("layers", "batch", "attn_batch", "seq", "vocab", "embed", "heads", "kv_heads", "head_dim", "mlp",
                    "experts")
RULE_TABLES = ("params", "weights", "activations")


@dataclass(frozen=True)
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


def _rules(names: tuple[str, ...], mapping: dict[str, MeshAxes]) -> Rules:
    return Rules(tuple((n, mapping.get(n)) for n in names), may_replicate=frozenset({"kv_heads"}))


def _layout(name: str, description: str, params: dict, activations: dict, weights: dict | None = None) -> Layout:
    return Layout(name, description, _rules(WEIGHT_NAMES, params),
                  _rules(WEIGHT_NAMES, {**params, **(weights or {})}), _rules(ACTIVATION_NAMES, activations))


FLAT = (GPU, XCD)
_TP_WEIGHTS = lambda axes: {"vocab": axes, "heads": axes, "kv_heads": axes, "mlp": axes}  # noqa: E731
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
                activations={"batch": DATA, "attn_batch": DATA, "seq": FLAT}),
        _layout("starscream_cp", "TP over GPUs, the sequence over partitions (long sequences, train and prefill)",
                params={**_TP_WEIGHTS(GPU), "embed": XCD}, weights={"embed": None},
                activations={"batch": DATA, "attn_batch": DATA, "seq": XCD, **_TP_WEIGHTS(GPU)}),
    )
}

PHASE_DEFAULTS = {"train": "starscream_tp", "prefill": "starscream_tp", "decode": "starscream_decode"}


def get_layout(name: str | Layout) -> Layout:
    """A layout by name (a key of `LAYOUTS`); a Layout is returned as it is."""
    if isinstance(name, Layout):
        return name
    if name not in LAYOUTS:
        raise ShardingRuleError(f"unknown layout {name!r}; choose one of {', '.join(LAYOUTS)}")
    return LAYOUTS[name]
