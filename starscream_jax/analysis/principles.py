"""The three principles, judged on a layout's Report (`report`) against the gpu_tp reference's.

  1. shape preservation: no local kernel smaller on its weight side than gpu_tp's (`check_principles`), or, for
     memory-bound decode, every weight and K/V byte read once per GPU (`reads_once_per_gpu`);
  2. no redundancy: no large input or activation copied over the partitions of a GPU;
  3. hierarchical collectives: none spans several partitions and several GPUs at once.
"""
from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable
from fnmatch import fnmatchcase
from typing import Any

from jax.sharding import Mesh

from ..hardware.axes import XCD
from ..sharding.apply import logical_names
from .hlo import Matmul, without_subscripts
from .report import AttentionReport, KernelReport, Report, inspect_compiled, is_attention_key, is_recomputed, matmul_key


@dataclasses.dataclass(frozen=True)
class AttentionRatio:
    """Principle 1 for attention alone: the layout's figure over the reference's (work per token, or for decode K/V
    reads per GPU) at its worst across the attention ops both have, and whether it passes; both None when there is
    nothing to compare."""

    ratio: float | None = None
    ok: bool | None = None


NO_COUNTERPART = "no counterpart in the reference"
"""Why an op was not judged: the reference program has no op of its named scope (`matmul_key`) and direction."""
ATTENTION_WORK_NOT_SHOWN = "a fused attention kernel whose work the program text does not give"
KERNEL_WEIGHT_UNKNOWN = "a custom kernel whose weight-side operands are unknown: name them in principles.KERNEL_WEIGHTS"


@dataclasses.dataclass(frozen=True)
class UnjudgedOp:
    """An op principle 1 did not judge: its name (an instruction; in decode the op's named scope) and why."""

    name: str
    reason: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelVerdict:
    """Principle 1: `violations` (one line per op whose kernels shrank, or read more than once per GPU), the ops
    left `unjudged` with their reasons (no counterpart in the reference, or work the text does not show), how many
    ops were judged (`judged_ops`) and attention's ratio to the reference.

    `ok` is True only when every op was judged and none shrank; False when one shrank, whatever was left unjudged (a
    FAIL stands); None otherwise: nothing judged (no reference, or no op the reference has too) or partly judged
    (the judged ops pass, others were left out). Unjudged ops never count as passing; `not_judged` then says which,
    why and how to judge them."""

    ok: bool | None
    violations: tuple[str, ...]
    unjudged: tuple[UnjudgedOp, ...] = ()
    attention: AttentionRatio = AttentionRatio()
    not_judged: str = ""
    judged_ops: int = 0

    @property
    def judged(self) -> bool:
        """Whether the verdict holds for the whole program: every op judged (a program without matmuls is: nothing
        shrank), or one failed."""
        return self.ok is not None

    @property
    def compared(self) -> bool:
        """Whether the program was compared with a reference at all: judged, or partly judged (a cached result
        without it is judged again, one with it would only give the same verdict)."""
        return self.judged or self.judged_ops > 0


@dataclasses.dataclass(frozen=True)
class CopiedBytes:
    """Per device, the bytes of all copies over xcd (large or not) beyond the 1/xcd share a split would hold."""

    inputs: float
    outputs: float
    activations: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class RedundancyVerdict:
    """Principle 2: `violations` (one line per large copy), the thresholds that made a copy large (the layer
    stack's None without one), the rule in words and the bytes copied."""

    ok: bool
    violations: tuple[str, ...]
    threshold_bytes: float
    layer_threshold_bytes: float | None
    rule: str
    copied_bytes: CopiedBytes


@dataclasses.dataclass(frozen=True)
class CollectiveVerdict:
    """Principle 3: `violations`, one line per flat or unknown collective with the reason."""

    ok: bool
    violations: tuple[str, ...]


Verdict = KernelVerdict | RedundancyVerdict | CollectiveVerdict


@dataclasses.dataclass(frozen=True)
class Principles:
    """The three verdicts of one program (see `check_principles`)."""

    shape_preservation: KernelVerdict
    no_redundancy: RedundancyVerdict
    hierarchical_collectives: CollectiveVerdict

    @property
    def ok(self) -> bool:
        """Whether all three principles hold; a principle not judged (`KernelVerdict.ok` None) does not."""
        return all(verdict.ok is True for _, verdict in self.verdicts())

    def verdicts(self) -> tuple[tuple[str, Verdict], ...]:
        """(name, verdict) of the three principles, in their order."""
        return tuple((field.name, getattr(self, field.name)) for field in dataclasses.fields(self))


@dataclasses.dataclass(frozen=True)
class Check:
    """What `check_compiled` found: the program's Report and the three verdicts (see `check_principles`)."""

    report: Report
    principles: Principles

    @property
    def ok(self) -> bool:
        """Whether all three principles hold (one not judged does not)."""
        return self.principles.ok


def check_compiled(compiled: Any, mesh: Mesh, *, reference: Any = None, args: Any = None,
                   lowered_text: str | None = None, token_dims: tuple[int, ...] | None = None,
                   replicated_ok: set[str] | Callable[[str], bool] = frozenset(),
                   gpus_per_node: int | None = None,
                   layer_stack: set[str] | Callable[[str], bool] = frozenset()) -> Check:
    """Read a compiled program over a ('data', 'gpu', 'xcd') `mesh` and judge it by the three principles, in one call.

    `compiled` is `jax.jit(f).lower(*args).compile()`, from real or abstract (ShapeDtypeStruct) arguments.
    `reference`, the same function compiled under plain tensor parallelism over `gpu` (replicated over `xcd`), is
    what principle 1 compares kernel shapes with; without it no op is judged (all are listed as unjudged, and
    the verdict's `ok` is None: not judged).
    `args` names the inputs ("0/layers/wq"); `lowered_text` (`lowered.as_text(debug_info=True)`) with `token_dims`
    (the model's (batch, seq)) adds the activations to principle 2. Other options as `check_principles` and
    `report.inspect_compiled`.
    """
    report = inspect_compiled(compiled, mesh, args=args, gpus_per_node=gpus_per_node, lowered_text=lowered_text,
                              token_dims=token_dims)
    reference_report = None if reference is None else inspect_compiled(reference, mesh, gpus_per_node=gpus_per_node)
    return Check(report, check_principles(report, reference_report, replicated_ok=replicated_ok,
                                          layer_stack=layer_stack))


NO_REFERENCE = ("no reference program was given, so no kernel shape was compared; pass the same step compiled "
                "under gpu_tp as the reference")
"""Why principle 1 was not judged, where the caller gave no reason of its own."""

LARGE_SHARE = 0.01
"""Principle 2's default rule: a copy is large when each device holds more of it than this share of what it is
weighed against: for an array of the layer stack, the layer stack's state per device (what a layer copies against
what a layer holds, the same at any compiled depth); for anything else, the compiled step's working set per device
(its arguments, outputs and temporaries)."""


def check_principles(
    report: Report,
    reference: Report | None,
    *,
    replicated_ok: set[str] | Callable[[str], bool] = frozenset(),
    large_bytes: float | None = None,
    layer_stack: set[str] | Callable[[str], bool] = frozenset(),
    no_reference: str = NO_REFERENCE,
) -> Principles:
    """Judge a layout's report against the three principles; `reference` is the gpu_tp program's report.

    Returns the three verdicts, each with `ok` and `violations` (one line per offending op, input or collective);
    shape_preservation also lists as `unjudged` (with the reason) the layout's matmuls, fused attention kernels and
    custom kernels that have no counterpart in the reference (all of them when `reference` is None), fused
    attention kernels whose work the program text does not give and custom kernels whose weight side is not known
    (`KERNEL_WEIGHTS`). Its `ok` is True only when nothing was left unjudged; False when an op shrank; else None:
    nothing judged (`reference` None: `no_reference` says why; or no op has a counterpart) or partly judged, with
    `not_judged` naming the ops left out (see `KernelVerdict`).

    1. shape_preservation: each op keeps per device at least the weight-side elements of the reference, summed over
       its matmuls per direction (`weight_side_elements`, from each report's `tokens_per_device`): a layout may
       divide only the tokens; where a program recomputes its forward pass (`jax.checkpoint`), the forward and
       recomputed ops are held to their smallest kernel run (`_shared_between_passes`). Ops that the reference lacks
       are left unjudged. Custom kernels (Pallas: the grouped matmul, the 8-bit weight-only matmul, paged and 8-bit
       attention) are judged by their weight-side operands (`kernel_weight_elements`) against the reference's
       kernels of the same op and kind. Kernels whose work is split into several matmuls of the same op under the
       layout alone are not told apart from one whole kernel (except in the ops held to their smallest run, where
       they read as shrunk).
       Attention is one op per direction (its scores and values matmuls, or its fused kernel): per token it must keep
       the reference's heads x head_dim x keys, so heads per device equal gpu_tp's heads per GPU and head_dim and the
       key length stay whole; `attention` gives the smallest ratio of its work per token to the reference's
       (`AttentionRatio`; None figures when neither program has attention in a scope named "attention").
    2. no_redundancy: no large input or output array (the persistent state a step reads and leaves behind) is
       replicated over `xcd`, unless its name is allowed by `replicated_ok`: a callable taking the name, or a set of
       names or fnmatch patterns ("*/scale"); and no large activation is replicated over `xcd` or held there as
       whole-size partial sums (when the report has activations, see `inspect_activations`). Large: each device
       holds more than `large_bytes` of it. By default (`LARGE_SHARE`): an input or output of the layer stack
       (`layer_stack`, names or patterns as `replicated_ok`: arrays with a leading layers dimension, the weights,
       their optimizer state and the KV cache) is large above 1% of the layer stack's inputs per device, so what a
       layer copies is weighed against what a layer holds, and two compiled layers judge as the full depth does;
       anything else above 1% of the step's working set per device: the compiled program's arguments, outputs and
       temporaries (`report.memory`), which copies of embedding, head and activations share with it.
       The verdict also states `threshold_bytes` and `layer_threshold_bytes` (None without a layer stack), `rule`
       (the rule in words) and `copied_bytes` (per device, the bytes of all copies, large or not, beyond the 1/xcd
       share a split would hold, of inputs, outputs and activations).
    3. hierarchical_collectives: no collective has scope "flat" or "unknown" (a kind the reader does not know, or no
       replica groups): each violation says why.
    """
    in_stack = _matcher(layer_stack)
    large_bytes, layer_bytes, rule = _thresholds(report, large_bytes, in_stack)
    return Principles(_shape_preservation(report, reference, no_reference),
                      _no_redundancy(report, _matcher(replicated_ok), large_bytes, in_stack, layer_bytes, rule),
                      _hierarchical_collectives(report))


def _thresholds(report: Report, large_bytes: float | None,
                in_stack: Callable[[str], bool]) -> tuple[float, float | None, str]:
    """(principle 2's threshold, the layer stack's threshold or None, the rule in words); see `check_principles`."""
    if large_bytes is not None:
        return large_bytes, None, f"large: above {large_bytes:.0f} bytes per device"
    large_bytes = LARGE_SHARE * (report.memory.working_set_bytes if report.memory else 0.0)  # no figures: all large
    rule = f"large: above {LARGE_SHARE:.0%} of the step's working set per device ({large_bytes:.0f} bytes)"
    stack_bytes = sum(entry.shard_bytes for entry in report.inputs if in_stack(entry.name))
    if not stack_bytes:
        return large_bytes, None, rule
    layer_bytes = LARGE_SHARE * stack_bytes
    return large_bytes, layer_bytes, rule + (
        f"; an array of the layer stack above {LARGE_SHARE:.0%} of the layer stack's inputs per device "
        f"({layer_bytes:.0f} bytes): what a layer copies against what a layer holds")


OpKey = tuple[str, bool]
"""An op and direction, as `matmul_key` gives them."""


def weight_side_elements(matmuls: list[Matmul], tokens_per_device: int, attention: list[AttentionReport] = (),
                         smallest: Collection[OpKey] = frozenset()) -> dict[OpKey, float]:
    """Weight-side elements per device of each op and direction (`matmul_key`), summed over its matmuls and runs.

    Every matmul of a transformer step, forward, input gradient and weight gradient alike, is tokens x weight, so its
    weight side holds batch x M x K x N / tokens elements whichever operand XLA put first, however it split the
    contraction (split-K) and whichever matmuls of an op it merged (q/k/v, gate/up) or ran in which order.
    Attention's matmuls (one op per direction, `matmul_key`; with them the fused kernels of `attention` whose work is
    known) are tokens x (heads x head_dim x keys): per token, the kernel's shape on the weight side.
    The ops in `smallest` (`_shared_between_passes`) are held to their smallest kernel run instead.
    """
    runs = [(matmul_key(matmul.op_name), matmul.flops // 2, matmul.count) for matmul in matmuls]
    runs += [(matmul_key(call.op_name), call.flops // 2, call.count) for call in attention if call.flops is not None]
    work: dict[OpKey, float] = {}
    for key, elements, count in runs:
        _gathered(work, key, elements if key in smallest else elements * count, key in smallest)
    return {key: total / tokens_per_device for key, total in work.items()}


def _shared_between_passes(*reports: Report) -> set[OpKey]:
    """The ops whose kernels XLA may run once for two passes: where a program recomputes its forward pass in the
    backward one (`jax.checkpoint`: ops under `report.RECOMPUTED_SCOPE`), those of the forward pass and the recomputed
    ones, of every program in `reports` (the layout's and the reference's, judged alike).

    Where the two passes share a computation (a layer loop unrolled, as at 2 compiled layers), XLA computes a
    recomputed kernel's result once (CSE), under either op's name: under --remat-policy dots starscream_cp's
    recomputed attention ran its values matmul alone on 2 GPUs x 4 partitions (its scores shared with the forward
    pass), its forward attention its values matmul alone on 4 GPUs x 2; gpu_tp's ran both in both. Such an op's
    total says which results XLA shared; its smallest kernel run, how large its kernels are."""
    names = [call.op_name for report in reports for call in (*report.matmuls, *report.attention)]
    if not any(is_recomputed(name) for name in names):
        return set()
    return {matmul_key(name) for name in names if is_recomputed(name) or "transpose(" not in name}


def _gathered(totals: dict[OpKey, float], key: OpKey, elements: float, smallest: bool) -> None:
    """Add a kernel's (or an op's) weight-side `elements` to the op `key` of `totals`: summed, or where `smallest`
    the smallest kept (`_shared_between_passes`)."""
    held = totals.get(key)
    totals[key] = elements if held is None else min(held, elements) if smallest else held + elements


def _shape_preservation(report: Report, reference: Report | None,
                        no_reference: str = NO_REFERENCE) -> KernelVerdict:
    """Principle 1 by kernel shapes (train, prefill): see `check_principles`."""
    if reference is None:
        return _no_reference(report, no_reference)
    judged_attention = [call for call in report.attention if call.flops is not None]
    unjudged = [UnjudgedOp(call.name, ATTENTION_WORK_NOT_SHOWN) for call in report.attention if call.flops is None]
    shared = _shared_between_passes(report, reference)
    elements = weight_side_elements(report.matmuls, report.tokens_per_device, judged_attention, shared)
    reference_elements = weight_side_elements(reference.matmuls, reference.tokens_per_device, reference.attention,
                                              shared)
    key_of = _pairing(elements, reference_elements)
    shared = {key_of(key) for key in shared}
    elements, reference_elements = _rekeyed(elements, key_of, shared), _rekeyed(reference_elements, key_of, shared)
    violations = []
    ops = [(m.name, key_of(matmul_key(m.op_name))) for m in (*report.matmuls, *judged_attention)]
    for (key, backward), held in elements.items():
        reference_held = reference_elements.get((key, backward))
        if reference_held is not None and held < reference_held:
            names = [name for name, op in ops if op == (key, backward)]
            has = "has in its smallest kernel" if (key, backward) in shared else "has"
            violations.append(
                f"op {key or '(unnamed)'} ({'backward' if backward else 'forward'}, {', '.join(names)}) {has} "
                f"{held:g} weight-side elements per device at {report.tokens_per_device} tokens, fewer than the "
                f"reference's {reference_held:g} at {reference.tokens_per_device} tokens: its local kernels shrank"
            )
    paired = [name for name, op in ops if op in reference_elements]
    unjudged += [UnjudgedOp(name, NO_COUNTERPART) for name, op in ops if op not in reference_elements]
    kernels = _judge_kernels(report.kernels, reference.kernels)
    return kernel_verdict(violations + kernels.violations, unjudged + kernels.unjudged,
                          len(paired) + kernels.judged, _attention_summary(elements, reference_elements))


def _pairing(layout: Iterable[OpKey], reference: Iterable[OpKey]) -> Callable[[OpKey], OpKey]:
    """The key each op is judged under: its own (`matmul_key`) where every op of its scopes of code pairs so; else,
    for every op of those scopes in both programs, the key without einsum subscripts (`_code_scopes`).

    XLA drops the name of a dot it rewrites (every matrix-vector product: one token per device in decode), and the
    name the reader gives it from its neighbours holds the op's scopes ("qkv") but not the subscripts its
    counterpart carries ("qkv/bsd,dke->bske"); its whole op is then compared at once, its products summed on both
    sides, and one program's subscripts never pair with another's part of the op alone."""
    reference = set(reference)
    merged = {_code_scopes(key) for key in layout if key not in reference}
    return lambda key: _code_scopes(key) if _code_scopes(key) in merged else key


def _code_scopes(key: OpKey) -> OpKey:
    """An op key without its einsum subscripts (`hlo.without_subscripts`)."""
    scopes = (without_subscripts(scope) for scope in key[0].split("/"))
    return "/".join(scope for scope in scopes if scope), key[1]


def _rekeyed(totals: dict[OpKey, float], key_of: Callable[[OpKey], OpKey],
             smallest: Collection[OpKey] = frozenset()) -> dict[OpKey, float]:
    """Per-op totals under the keys `key_of` gives (`_pairing`), summed where several fall on one, or for the ops
    in `smallest` the smallest kept (see `weight_side_elements`)."""
    found: dict[OpKey, float] = {}
    for key, total in totals.items():
        _gathered(found, key_of(key), total, key_of(key) in smallest)
    return found


def _no_reference(report: Report, why: str) -> KernelVerdict:
    """The verdict of a program judged without a reference: every op listed, none judged, `why` the reason."""
    names = [*(m.name for m in report.matmuls), *(call.name for call in report.attention),
             *(_kernel_name(kernel) for kernel in report.kernels)]
    return KernelVerdict(ok=None, violations=(),
                         unjudged=tuple(UnjudgedOp(name, "no reference program") for name in names), not_judged=why)


def kernel_verdict(violations: list[str], unjudged: list[UnjudgedOp], judged_ops: int,
                   attention: AttentionRatio = AttentionRatio()) -> KernelVerdict:
    """FAIL where an op shrank, whatever was left unjudged; ok only where every op was judged; otherwise not judged
    (`ok` None), `not_judged` naming the ops left out and why: passing the ops judged says nothing of the others."""
    why = _why_unjudged(unjudged, judged_ops) if unjudged else ""
    if violations:
        return KernelVerdict(ok=False, violations=tuple(violations), unjudged=tuple(unjudged), attention=attention,
                             not_judged=why, judged_ops=judged_ops)
    return KernelVerdict(ok=None if unjudged else True, violations=(), unjudged=tuple(unjudged), attention=attention,
                         not_judged=why, judged_ops=judged_ops)


SHOWN_UNJUDGED = 4
"""How many unjudged ops `KernelVerdict.not_judged` names (the verdict's `unjudged` lists them all)."""


def _why_unjudged(unjudged: list[UnjudgedOp], judged_ops: int) -> str:
    """`not_judged` in words: how many ops of how many were left out, the first ones with their reasons, and the fix
    where the reference lacked counterparts."""
    total = len(unjudged) + judged_ops
    named = ", ".join(f"{op.name} ({op.reason})" for op in unjudged[:SHOWN_UNJUDGED])
    more = f" and {len(unjudged) - SHOWN_UNJUDGED} more" if len(unjudged) > SHOWN_UNJUDGED else ""
    fix = ("; principle 1 pairs ops by the named scope of their op (`matmul_key`): compile the reference under the "
           "same names" if any(op.reason == NO_COUNTERPART for op in unjudged) else "")
    return f"{len(unjudged)} of {total} op(s) left out: {named}{more}{fix}"


def _kernel_name(kernel: KernelReport) -> str:
    """A custom kernel as the unjudged list names it: its instruction and the kernel's name (or target)."""
    return f"{kernel.name} ({kernel.kernel or kernel.target})"


KERNEL_WEIGHTS: dict[str, Callable[[list[list[int]], list[list[int]]], list[list[int]]]] = {
    "grouped_matmul": lambda operands, results: operands[-1:],
    "grouped_matmul_t": lambda operands, results: operands[-1:],
    "grouped_matmul_dw": lambda operands, results: results[:1],
    "weight_only_matmul": lambda operands, results: operands[1:2],
    "weight_only_group": lambda operands, results: operands[1: 1 + (len(operands) - 1) // 2],
    "eight_bit_decode": lambda operands, results: operands[1:3],
    "paged_attention*": lambda operands, results: [shape for shape in operands[1:] if len(shape) == 4],
}
"""The weight side of each custom kernel the library runs, by its name (fnmatch patterns): (operand shapes, result
shapes) -> the shapes of the arrays the kernel multiplies the device's tokens with, the arrays a layout may not shrink:
  grouped_matmul(_t)  (tile groups, live tiles, tokens x [R, K], expert weights [G, K, F]): the expert weights;
  grouped_matmul_dw   (offsets, tokens x [R, K], output gradient [R, F]) -> [G, K, F]: the weight gradient it writes;
  weight_only_matmul  (tokens x [M, K], 8-bit weight [K, N], scales): the 8-bit weight;
  weight_only_group   (tokens x, 8-bit weights..., their scales...): the 8-bit weights;
  eight_bit_decode    (queries, 8-bit K and V caches, scales, lengths): K and V, what decode attention reads;
  paged_attention*    (queries, K pages, [K scales,] V pages, [V scales,] page table, lengths): the page pools (the
                      only operands of four dimensions after the queries), K and V.
A kernel not named here is left unjudged: the text gives its operands but not which of them is the weight."""


@dataclasses.dataclass(frozen=True)
class KernelJudgement:
    """Principle 1 over a program's custom kernels: violations, kernels left unjudged, and how many were judged."""

    violations: list[str]
    unjudged: list[UnjudgedOp]
    judged: int


def kernel_weight_elements(kernel: KernelReport) -> int | None:
    """Weight-side elements per device of one custom kernel over its runs (`KERNEL_WEIGHTS`); None for a kernel whose
    weight side is not known, or where its rule finds no such operand (a call whose operands are not in the order
    the rule expects is never judged as holding nothing). A kernel multiplies the device's tokens with these, so
    they are its work per token on the weight side, the figure matmuls are compared by (`weight_side_elements`)."""
    select = next((rule for pattern, rule in KERNEL_WEIGHTS.items() if fnmatchcase(kernel.kernel, pattern)), None)
    shapes = [] if select is None else select(kernel.operand_shapes, kernel.result_shapes)
    return sum(math.prod(shape) for shape in shapes) * kernel.count if shapes else None


def _kernel_key(kernel: KernelReport) -> tuple[tuple[str, bool], str]:
    """What pairs a custom kernel with the reference's: its op (`matmul_key`) and the `KERNEL_WEIGHTS` pattern its name
    matches (block sizes in a name differ between layouts)."""
    pattern = next((pattern for pattern in KERNEL_WEIGHTS if fnmatchcase(kernel.kernel, pattern)), kernel.kernel)
    return matmul_key(kernel.op_name), pattern


def _judge_kernels(kernels: list[KernelReport], reference_kernels: list[KernelReport],
                   partitions: int | None = None) -> KernelJudgement:
    """Each custom kernel against the reference's kernels of the same op and kind (`_kernel_key`), their weight-side
    elements per device (`kernel_weight_elements`) summed per pair. By kernel shapes (`partitions` None: train,
    prefill) the layout's must reach the reference's; by bytes read (decode) `partitions` times the layout's, what
    one GPU reads, must not exceed the reference's. A kernel whose weight side is unknown, or which the reference
    lacks, is left unjudged with the reason."""
    def totals(group: list[KernelReport]) -> dict[tuple[tuple[str, bool], str], int]:
        found: dict[tuple[tuple[str, bool], str], int] = defaultdict(int)
        for kernel in group:
            found[_kernel_key(kernel)] += kernel_weight_elements(kernel)
        return found

    known = [kernel for kernel in kernels if kernel_weight_elements(kernel) is not None]
    layout = totals(known)
    reference = totals([kernel for kernel in reference_kernels if kernel_weight_elements(kernel) is not None])
    unjudged = [UnjudgedOp(_kernel_name(kernel), KERNEL_WEIGHT_UNKNOWN) for kernel in kernels if kernel not in known]
    unjudged += [UnjudgedOp(_kernel_name(kernel), NO_COUNTERPART) for kernel in known
                 if _kernel_key(kernel) not in reference]
    violations = []
    for pair, held in layout.items():
        if pair not in reference:
            continue
        (key, backward), kind = pair
        names = ", ".join(kernel.name for kernel in known if _kernel_key(kernel) == pair)
        where = f"kernel {kind} of op {key or '(unnamed)'} ({'backward' if backward else 'forward'}, {names})"
        if partitions is None and held < reference[pair]:
            violations.append(f"{where} has {held} weight-side elements per device, fewer than the reference's "
                              f"{reference[pair]}: its local kernel shrank")
        elif partitions is not None and partitions * held > reference[pair]:
            violations.append(f"{where}: the {partitions} partitions of a GPU read "
                              f"{partitions * held / reference[pair]:.2f}x the weight-side elements gpu_tp reads "
                              f"once per GPU ({partitions} x {held} vs {reference[pair]})")
    return KernelJudgement(violations, unjudged, sum(_kernel_key(kernel) in reference for kernel in known))


def _attention_summary(layout: dict[tuple[str, bool], float], reference: dict[tuple[str, bool], float],
                       at_least: bool = True) -> AttentionRatio:
    """Principle 1 for attention alone: the smallest (`at_least`: the work per token must reach the reference's)
    or largest (K/V reads must not exceed it) ratio of the layout's attention figure to the reference's over the
    attention ops (`matmul_key`) and directions both have; None figures when there is none to compare."""
    ratios = [held / reference[key] for key, held in layout.items()
              if is_attention_key(key[0]) and reference.get(key)]
    if not ratios:
        return AttentionRatio()
    ratio = min(ratios) if at_least else max(ratios)
    return AttentionRatio(ratio, ratio >= 1 - 1e-9 if at_least else ratio <= 1 + 1e-9)


def decode_reads(matmul: Matmul) -> int:
    """Elements one run of a decode matmul reads on its weight side: its operand that the program reads from its
    arguments (`Matmul.weight_operand`: batch x M x K or batch x K x N), else batch x the two dimensions beside the
    smallest, which counts its tokens. The operand decides where it is known, since a layout may cut a weight's
    dimension below the tokens per device (the tiny model's 128 embed over 8 partitions: 16, against 64 sequences),
    which the sizes alone would take for the tokens."""
    if matmul.weight_operand == "lhs":
        return matmul.batch * matmul.m * matmul.k
    if matmul.weight_operand == "rhs":
        return matmul.batch * matmul.k * matmul.n
    return matmul.batch * (matmul.m * matmul.k * matmul.n // min(matmul.m, matmul.k, matmul.n))


def reads_once_per_gpu(matmuls: list[Matmul], reference_matmuls: list[Matmul], partitions: int,
                       kernels: list[KernelReport] = (), reference_kernels: list[KernelReport] = ()) -> KernelVerdict:
    """Principle 1 for memory-bound decode: every weight (and K/V) byte is read once per GPU per step.

    A decode matmul multiplies a few new tokens (one per sequence; for attention, the query heads that share a kv
    head) with a weight or the cached keys or values: each device reads that operand's elements (`decode_reads`).
    Summed per op (`matmul_key`: attention's matmuls are one op, those XLA left unnamed named by their neighbours,
    see `hlo`), `partitions` times a device's reads is what one GPU reads; it must not exceed what a gpu_tp device
    reads, which is the GPU's share read once. For attention this says every kernel keeps together the query heads
    that share a kv head: a layout that spreads them over the partitions reads each kv head once per query head.
    Custom `kernels` (the weight-only 8-bit matmul, paged or 8-bit attention) read their weight-side operands
    (`KERNEL_WEIGHTS`), judged the same way against the `reference_kernels` of the same op and kind; ops and kernels
    the reference lacks, or whose weight side is not known, are left unjudged, and the verdict is then not ok (see
    `KernelVerdict`).
    """
    def reads(group) -> dict[tuple[str, bool], int]:
        totals: dict[tuple[str, bool], int] = defaultdict(int)
        for m in group:
            totals[matmul_key(m.op_name)] += decode_reads(m) * m.count
        return totals

    layout_reads, reference_reads = reads(matmuls), reads(reference_matmuls)
    key_of = _pairing(layout_reads, reference_reads)
    layout_reads, reference_reads = _rekeyed(layout_reads, key_of), _rekeyed(reference_reads, key_of)
    violations = [
        f"{key[0] or '(unnamed)'}: the {partitions} partitions of a GPU read "
        f"{partitions * count / reference_reads[key]:.2f}x the weight-side elements gpu_tp reads once per GPU "
        f"({partitions} x {count} vs {reference_reads[key]})"
        for key, count in layout_reads.items()
        if key in reference_reads and partitions * count > reference_reads[key]
    ]
    unjudged = [UnjudgedOp(key[0] or "(unnamed)", NO_COUNTERPART) for key in layout_reads if key not in reference_reads]
    judged = sum(key in reference_reads for key in layout_reads)
    custom = _judge_kernels(list(kernels), list(reference_kernels), partitions)
    per_gpu = {key: partitions * count for key, count in layout_reads.items()}
    return kernel_verdict(violations + custom.violations, unjudged + custom.unjudged, judged + custom.judged,
                           _attention_summary(per_gpu, reference_reads, at_least=False))


def arrays_named_by(named_variables: Iterable[tuple[str, Any]], names: frozenset[str]) -> set[str]:
    """The array names among `named_variables` ((name, nnx Variable) pairs, each name as the report names that input
    or output) whose variable's logical names include one of `names`: a layout's `replicated_ok` names for
    `check_principles`' `replicated_ok` (norm scales, and the optimizer's moments of them), {"layers"} for its
    `layer_stack`."""
    return {name for name, variable in named_variables if names & set(logical_names(variable) or ())}


def _matcher(names: set[str] | Callable[[str], bool]) -> Callable[[str], bool]:
    """A test of array names: the callable itself, or whether a name matches one of the names or fnmatch patterns."""
    if callable(names):
        return names
    return lambda name: any(fnmatchcase(name, pattern) for pattern in names)


def _no_redundancy(report: Report, allowed: Callable[[str], bool], large_bytes: float,
                   in_stack: Callable[[str], bool], layer_bytes: float | None, rule: str) -> RedundancyVerdict:
    """Principle 2's verdict: copies above `large_bytes`, or above `layer_bytes` for the arrays of the layer stack
    (`in_stack`) when that is not None; `rule` says so in words."""
    def stacked(name: str) -> bool:
        return layer_bytes is not None and in_stack(name)

    def threshold(name: str) -> float:
        return layer_bytes if stacked(name) else large_bytes

    arrays = [entry for entry in (*report.inputs, *report.outputs) if not allowed(entry.name)]
    violations = [
        f"{'output' if entry.name.startswith('output/') else 'input'} {entry.name} {entry.shape} ({entry.shard_bytes} "
        f"bytes per device, spec {entry.spec}) is replicated {entry.replication_xcd}x over xcd"
        + (" (an array of the layer stack)" if stacked(entry.name) else "")
        for entry in arrays
        if entry.replication_xcd > 1 and entry.shard_bytes > threshold(entry.name)
    ]
    violations += [
        f"activation {entry.name or '(unnamed)'} {entry.shape} {entry.dtype} ({entry.shard_bytes} bytes per device, "
        f"spec {entry.spec}) is {_how_held(entry)} over xcd ({entry.count} value(s))"
        for entry in report.activations
        if entry.replication_xcd > 1 and entry.shard_bytes > large_bytes
    ]
    copied = CopiedBytes(_copied_bytes(entry for entry in arrays if not entry.name.startswith("output/")),
                         _copied_bytes(entry for entry in arrays if entry.name.startswith("output/")),
                         _copied_bytes(report.activations))
    return RedundancyVerdict(ok=not violations, violations=tuple(violations), threshold_bytes=large_bytes,
                             layer_threshold_bytes=layer_bytes, rule=rule, copied_bytes=copied)


def _how_held(entry) -> str:
    """How an activation sits over xcd: whole partial sums on each partition, or copies (with the axes, if any, over
    which each copy is itself a partial sum)."""
    if XCD in entry.unreduced:
        return f"held whole as {entry.replication_xcd} partial sums"
    partial = f" (partial sums over {entry.unreduced})" if entry.unreduced else ""
    return f"replicated {entry.replication_xcd}x{partial}"


def _copied_bytes(entries) -> float:
    """Per device, the bytes held beyond the 1/xcd share a split over xcd would hold, each entry once per value."""
    return sum(entry.shard_bytes * (1 - 1 / entry.replication_xcd) * getattr(entry, "count", 1) for entry in entries)


def _hierarchical_collectives(report: Report) -> CollectiveVerdict:
    violations = [
        f"{c.kind} {c.name} ({c.op_name or 'no op name'}) is {c.scope}: {c.reason}; groups {c.groups[:2]}"
        + (" ..." if len(c.groups) > 2 else "")
        for c in report.collectives
        if c.scope in ("flat", "unknown")
    ]
    return CollectiveVerdict(not violations, tuple(violations))
