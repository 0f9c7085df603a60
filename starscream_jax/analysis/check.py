"""`check(step, *args, mesh=...)`: any user's jitted step compiled under a layout and judged by the three principles.

The step (`jax.jit` or `nnx.jit`) is traced with its arguments (arrays, ShapeDtypeStructs, NNX modules and
optimizers, Linen parameters: nothing runs) under the active layout (`use_layout`, or `layout=`), compiled, read
(`report`) and judged (`principles`) against the same step traced under `reference` (default gpu_tp: the NNX variables
and Linen parameters among the arguments placed by that layout's params rules, from their logical names, everything
else as it was given). Arguments holding Linen parameters are traced under Linen's rule context too, with each
layout's "use" table (`flax_rules`). Parameters whose logical names include one of the layout's `replicated_ok` names
(norm scales), and their optimizer moments, may be replicated over `xcd`. `StepCheck.table()` prints what `starscream
inspect` prints for the built-in model: memory, bytes by scope, collectives, kernel shapes and the verdicts, and which
params rules placed the step's parameters (`placement`), naming those without logical names, and for each flat
collective of a known cause the smallest fix (`advice`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import textwrap
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..errors import StarscreamError
from ..sharding.apply import abstract_placed, active, is_auto, logical_names, use_layout
from ..sharding.flax_rules import VocabularyLike, flax_rules, in_vocabulary
from ..sharding.layouts import Layout, get_layout
from ..sharding.rules import resolve
from .compile import COMPILER_OPTIONS, REFERENCE
from .format import clip, format_bytes, format_columns, principle_rows, violation_lines
from .advice import Advice, advise, advise_batch
from .placement import ParameterPlacement, format_placements, parameter_placements
from .principles import Check, arrays_named_by, check_principles
from .hlo import Matmul
from .report import Report, inspect_compiled

LINE_WIDTH = 120


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepCheck(Check):
    """`Check` (the report and the three verdicts) of a user's step, with the layouts it was judged under."""

    layout: str = ""
    reference: str | None = None
    placements: tuple[ParameterPlacement, ...] = ()
    """Each parameter among the step's arguments with the params rules that placed it, or none (no logical names:
    left as given, out of the layout's reach)."""

    advice: tuple[Advice, ...] = ()
    """For each flat collective of a known cause, and each token batch that enters whole on the partitions of a GPU
    with nothing in the step to split it, why it is there and the smallest fix (`advice`)."""

    def unnamed(self) -> tuple[str, ...]:
        """The paths of the parameters without logical names."""
        return tuple(placement.path for placement in self.placements if not placement.named)

    def table(self) -> str:
        """The verdicts and figures as lines of text, then the first violations of each failed principle."""
        return format_check(self)


def check(step: Callable, *args: Any, mesh: Mesh, layout: Layout | str | None = None,
          reference: Layout | str | None = REFERENCE, vocabulary: VocabularyLike | None = None,
          token_dims: tuple[int, ...] | None = None, gpus_per_node: int | None = None) -> StepCheck:
    """Compile `step(*args)` under `layout` (default: the active one) on `mesh` and judge it (see the module).

    `reference` (a layout, default gpu_tp; None: no kernel is judged, principle 1's `ok` None) is what principle 1
    compares kernel shapes with.
    `vocabulary` (see `flax_rules`): the model's logical names, when they are not the library's; the reference (and
    `layout`, when given by name) are read in them. `token_dims` (the model's (batch, seq)) adds the activations of
    which each device holds a copy to principle 2.
    """
    layout = _layout_of(layout if vocabulary is None or layout is None else in_vocabulary(layout, vocabulary), mesh)
    with _tracing_under(layout, mesh, args):
        traced = _traced(step, args)
        lowered = traced.lower()
        compiled = lowered.compile(compiler_options=COMPILER_OPTIONS)
    report = inspect_compiled(compiled, mesh, args=traced.args_info, outputs=traced.out_info,
                              gpus_per_node=gpus_per_node, token_dims=token_dims,
                              lowered_text=None if token_dims is None else lowered.as_text(debug_info=True))
    reference_report = None
    if reference is not None:
        reference = get_layout(reference) if vocabulary is None else in_vocabulary(reference, vocabulary)
        with _tracing_under(reference, mesh, args):
            reference_report = _reference_report(_traced(step, placed(args, reference, mesh)).lower(), mesh,
                                                 gpus_per_node)
    report, renamed = _with_argument_names(report, args, traced)
    variables = _named_variables(args) if renamed else []
    allowed = arrays_named_by(variables, layout.replicated_ok)
    layer_stack = arrays_named_by(variables, frozenset({"layers"}))  # stacked over a `layers` axis
    verdicts = check_principles(report, reference_report, replicated_ok=allowed, layer_stack=layer_stack,
                                no_reference="reference=None: no layout to compare kernel shapes with; leave "
                                             "reference at its default, gpu_tp, to judge principle 1")
    copied_batch = advise_batch(report, layout)
    return StepCheck(report=report, principles=_with_copied_batch(verdicts, copied_batch), layout=layout.name,
                     reference=None if reference is None else reference.name,
                     placements=parameter_placements(args, layout),
                     advice=advise(report, layout, is_auto(mesh)) + copied_batch)


def _with_copied_batch(verdicts, copied_batch: tuple[Advice, ...]):
    """`verdicts` with principle 2 failed for each token batch that enters whole on the partitions of a GPU and is
    never split (`advise_batch`): every partition then computes every token, each activation a copy over xcd, which
    the activations' own check sees only with `token_dims`."""
    if not copied_batch:
        return verdicts
    redundancy = verdicts.no_redundancy
    lines = tuple(f"{advice.why}: every activation is copied over xcd" for advice in copied_batch)
    return dataclasses.replace(verdicts, no_redundancy=dataclasses.replace(
        redundancy, ok=False, violations=(*redundancy.violations, *lines)))


_REFERENCE_REPORTS: dict[tuple[str, Mesh, int | None], Report] = {}
"""Reference programs compiled and read, by the hash of their lowered text: judging one step under several layouts
compiles its reference once."""
REFERENCE_REPORTS_KEPT = 8


def _reference_report(lowered, mesh: Mesh, gpus_per_node: int | None) -> Report:
    key = (hashlib.sha256(lowered.as_text().encode()).hexdigest(), mesh, gpus_per_node)
    if key not in _REFERENCE_REPORTS:
        if len(_REFERENCE_REPORTS) >= REFERENCE_REPORTS_KEPT:
            _REFERENCE_REPORTS.pop(next(iter(_REFERENCE_REPORTS)))
        compiled = lowered.compile(compiler_options=COMPILER_OPTIONS)
        _REFERENCE_REPORTS[key] = inspect_compiled(compiled, mesh, gpus_per_node=gpus_per_node)
    return _REFERENCE_REPORTS[key]


@contextlib.contextmanager
def _tracing_under(layout: Layout, mesh: Mesh, args: tuple):
    """`use_layout(layout, mesh)`, and for arguments holding Linen parameters (`nn.with_logical_partitioning`
    boxes) also Linen's rule context with the layout's "use" table (`flax_rules`)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(use_layout(layout, mesh))
        if any(isinstance(leaf, nn.LogicallyPartitioned) for leaf in jax.tree.leaves(args, is_leaf=_is_box)):
            rules = tuple(flax_rules(layout, "use"))
            stack.enter_context(_LINEN_RULES(rules))
            stack.enter_context(nn.logical_axis_rules(rules))
        yield


_LINEN_RULES = jax.make_user_context(None)
"""The Linen rules `_tracing_under` installs, in jit's cache key as the layout is: a step traced before without
them (or with others) is traced again."""


def _is_box(node) -> bool:
    return isinstance(node, nn.LogicallyPartitioned)


def _layout_of(layout: Layout | str | None, mesh: Mesh) -> Layout:
    if layout is not None:
        return get_layout(layout)
    current = active()
    if current is None:
        raise StarscreamError("check needs a layout: call it inside use_layout(layout, mesh) or pass layout=")
    if current.mesh != mesh:
        raise StarscreamError("check's mesh is not the active layout's mesh; pass the mesh given to use_layout")
    return current.layout


def _traced(step: Callable, args: tuple) -> Any:
    """The jax `Traced` of `step(*args)` under the active layout (part of jit's cache key, so a step traced before
    under another layout is traced again); nnx.jit's trace wraps jax's."""
    if not hasattr(step, "trace"):
        raise StarscreamError(f"check takes a jitted step (jax.jit or nnx.jit), got {type(step).__name__}; "
                              "wrap it with jax.jit or nnx.jit")
    traced = step.trace(*args)
    return getattr(traced, "traced", traced)


def placed(args: tuple, layout: Layout, mesh: Mesh) -> tuple:
    """`args` as abstract values: the NNX variables and Linen parameters with logical names placed by `layout`'s
    params rules, every other array as it was given (an array not placed on `mesh` replicated over it)."""
    args = jax.tree.map(lambda node: _placed_box(node, layout, mesh) if _is_box(node) else node, args, is_leaf=_is_box)
    graphdef, named, rest = nnx.split(list(args), _has_logical_names, ...)

    def abstract(node):
        value = node.get_value() if isinstance(node, nnx.Variable) else node
        if not hasattr(value, "shape"):
            return node
        value = jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=_on_mesh(value, mesh))
        return node.replace(value) if isinstance(node, nnx.Variable) else value

    rest = jax.tree.map(abstract, rest, is_leaf=lambda node: isinstance(node, nnx.Variable))
    return tuple(nnx.merge(graphdef, abstract_placed(named, layout, mesh), rest))


def _placed_box(box: nn.LogicallyPartitioned, layout: Layout, mesh: Mesh) -> nn.LogicallyPartitioned:
    """A Linen parameter's value as a ShapeDtypeStruct placed by `layout`'s params rules for its logical names."""
    value = box.value
    spec = resolve(tuple(box.names), tuple(value.shape), layout.params, mesh, f"Linen parameter {tuple(box.names)}",
                   f"param rules of {layout.name}")
    return box.replace_boxed(jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=NamedSharding(mesh, spec)))


def _has_logical_names(_path, node) -> bool:
    return isinstance(node, nnx.Variable) and logical_names(node) is not None


def _on_mesh(value, mesh: Mesh) -> NamedSharding:
    sharding = getattr(value, "sharding", None)
    if isinstance(sharding, NamedSharding) and sharding.mesh == mesh:
        return sharding
    return NamedSharding(mesh, PartitionSpec())


def _with_argument_names(report: Report, args: tuple, traced) -> tuple[Report, bool]:
    """`report` with its inputs and outputs named by where they live in `args` ("0/blocks/0/q/kernel": argument 0's
    variable; "output/1/opt_state/mu/..." its update; "output/result/0" the step's own result), and whether it was
    renamed: names stay as the program gives them when its arguments do not line up with `args` (a step that takes
    other than NNX objects and arrays)."""
    _, state = nnx.split(list(args))
    leaves = [("/".join(str(key) for key in path), leaf) for path, leaf in nnx.to_flat_state(state)]
    shapes = [tuple(_array(leaf).shape) for _, leaf in leaves]
    if [tuple(info.shape) for info in jax.tree.leaves(traced.args_info)] != shapes:
        return report, False
    names = [name for name, _ in leaves]
    outputs = [tuple(info.shape) for info in jax.tree.leaves(traced.out_info)]
    variables = [i for i, (_, leaf) in enumerate(leaves) if isinstance(leaf, nnx.Variable)]
    updated = len(variables) if outputs[: len(variables)] == [shapes[i] for i in variables] else 0
    output_names = ["output/" + names[i] for i in variables[:updated]]
    output_names += [f"output/result/{i}" for i in range(len(outputs) - updated)]
    renamed = dataclasses.replace(
        report, inputs=[dataclasses.replace(entry, name=name) for entry, name in zip(report.inputs, names)],
        outputs=[dataclasses.replace(entry, name=name) for entry, name in zip(report.outputs, output_names)])
    return renamed, True


def _array(leaf):
    return leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf


def _named_variables(args: tuple) -> list[tuple[str, nnx.Variable]]:
    """(input name, variable) and (output name, variable) of every NNX variable among `args`, named as
    `_with_argument_names` names them (its update is "output/" and its input name)."""
    _, state = nnx.split(list(args))
    named = [("/".join(str(key) for key in path), leaf) for path, leaf in nnx.to_flat_state(state)
             if isinstance(leaf, nnx.Variable)]
    return named + [("output/" + name, leaf) for name, leaf in named]


def _scope_cells(report) -> dict[str, str]:
    sent = report.bytes_by_scope()
    counts = {scope: sum(c.count for c in report.collectives if c.scope == scope) for scope in sent}
    return {scope: f"{format_bytes(sent[scope])} in {counts[scope]}" for scope in ("intra_gpu", "inter_gpu",
                                                                                   "inter_node", "flat")}


def _kernel(matmul: Matmul) -> str:
    """"op: batch x M x K x N", the op read from the matmul's op_name (its scope just above the primitive)."""
    op = matmul.op_name.split("/")[-2] if "/" in matmul.op_name else matmul.name
    return f"{op}: {matmul.batch}x{matmul.m}x{matmul.k}x{matmul.n}"


def format_check(result: StepCheck) -> str:
    """The lines `StepCheck.table` prints."""
    report = result.report
    axes = " x ".join(f"{axis} {size}" for axis, size in report.mesh_axes.items())
    copied = [entry.shard_bytes for entry in (*report.inputs, *report.outputs, *report.activations)
              if entry.replication_xcd > 1]
    rows = [("memory per device", ""),
            ("  arguments", format_bytes(report.memory.argument_bytes) if report.memory else "-"),
            ("  temporaries", format_bytes(report.memory.temp_bytes) if report.memory else "-"),
            ("  largest array copied over xcd", format_bytes(max(copied)) if copied else "none"),
            ("bytes per device per step (collectives)", "")]
    rows += [(f"  {scope.replace('_', '-')}", cell) for scope, cell in _scope_cells(report).items()]
    rows += [("local matmuls", f"{len(report.matmuls)} at {report.tokens_per_device} tokens per device"),
             ("  smallest (batch x M x K x N)",
              _kernel(min(report.matmuls, key=lambda m: m.flops)) if report.matmuls else "-"),
             *format_placements(result.placements),
             ("principles" + (f" (kernel shapes against {result.reference})" if result.reference else ""), ""),
             *principle_rows(result.principles)]
    lines = [f"step under {result.layout} on mesh {axes}", ""]
    lines += [clip(line, LINE_WIDTH) for line in format_columns({result.layout: rows}, names=False)]
    lines += violation_lines(result.layout, result.principles, LINE_WIDTH)
    for advice in result.advice:
        lines.append(clip(f"{advice.name}: {advice.why}", LINE_WIDTH))
        lines += textwrap.wrap(f"fix: {advice.fix}", LINE_WIDTH, initial_indent="  ", subsequent_indent="    ")
    return "\n".join(lines)

