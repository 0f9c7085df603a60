"""Read a compiled program over a ('data', 'gpu', 'xcd') mesh into a Report (`principles` judges it).

`inspect_compiled` reads what one device runs (collectives with their scope and bytes, matmuls with their per-device
shapes, attention kernels, memory, how each input array is laid out, and, given the lowered program too, how each
activation is laid out: `inspect_activations`); `inspect_text` reads the same from a program's text alone (a dump from
another machine), without inputs or memory. Everything works from abstract inputs: a program lowered from
`jax.ShapeDtypeStruct`s with shardings and compiled, never run.

Replica-group ids in the compiled text are partition ids: positions in `mesh.devices.flat`. A device's physical GPU is
given by its coordinates on every mesh axis but `xcd`; its node by `gpus_per_node` when given, else by the device's
`process_index` (one process per node).
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from ..compiled_memory import MemoryReport
from ..errors import TopologyError
from ..hardware.axes import GPU, XCD
from .hlo import Collective, Matmul, parse_hlo
from .json_form import to_json
from .stablehlo import sharded_values

SCOPES = ("local", "intra_gpu", "inter_gpu", "inter_node", "flat", "unknown")
"""Collective scopes, narrowest first: one device; partitions of one GPU; one partition from each of several GPUs of
one node; the same across nodes; partitions of one GPU together with other GPUs, or one partition from each GPU at
different partition indices (neither hierarchical level); a collective whose kind or groups the reader does not know
(never assumed narrow)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class CollectiveReport:
    """One collective: its widest group's scope, the full buffer it works on, and ring-formula bytes per device.

    `groups` holds the replica groups as partition ids (for a collective-permute, send or recv, its source-target
    pairs). `bytes_per_device` is for one run; the program runs it `count` times per call. `reason` says why the
    scope is "flat" or "unknown" (empty otherwise). `in_layer_loop` and `full_depth_runs` (whether it runs in the
    layer loop, and its runs in the full-depth step) are given where a layout's result scales the compiled program
    to the model's depth (`layout_report`), None otherwise.
    """

    name: str
    kind: str
    op_name: str
    scope: str
    groups: list[list[int]]
    group_size: int
    buffer_bytes: int
    bytes_per_device: float
    count: int
    reason: str = ""
    in_layer_loop: bool | None = None
    full_depth_runs: float | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionReport:
    """One fused attention kernel (cuDNN fMHA), the per-device shapes of its operands (q, k, v, ...) and its matmul
    FLOPs per run (None when the program text does not give them; see `hlo.attention_flops`)."""

    name: str
    op_name: str
    target: str
    operand_shapes: list[list[int]]
    count: int
    flops: int | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelReport:
    """One custom kernel of the program (`hlo.KernelCall`: a Pallas kernel, say): its name, target and per-device
    operand and result shapes. Its work is not in the program text; principle 1 judges a kernel it knows by the
    operands on its weight side (`principles.KERNEL_WEIGHTS`) and lists any other as unjudged."""

    name: str
    op_name: str
    target: str
    kernel: str
    operand_shapes: list[list[int]]
    count: int
    result_shapes: list[list[int]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True, kw_only=True)
class InputReport:
    """One input array: global shape, PartitionSpec (as a list, None when not a NamedSharding), global and per-device
    bytes, and how many devices along `xcd` and along `gpu` hold the same shard (1 = sharded over all of that axis)."""

    name: str
    shape: list[int]
    dtype: str
    spec: list | None
    bytes: int
    shard_bytes: int
    replication_xcd: int
    replication_gpu: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class ActivationReport:
    """One activation of the program (a value whose shape starts with the token dimensions): its op name, global
    shape and PartitionSpec-like placement (the mesh axes of each dimension, and `unreduced` axes holding partial
    sums), global bytes and bytes per device (a partial sum is whole on each device that holds a part of it), how many
    devices along `xcd` hold the same data or whole-size partial sums of it (1 = split over all of xcd), and how many
    values of the program share all of these (`count`)."""

    name: str
    shape: list[int]
    dtype: str
    spec: list[list[str]]
    unreduced: list[str]
    bytes: int
    shard_bytes: int
    replication_xcd: int
    count: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Report:
    """What one compiled program does on one device of `mesh_axes` (axis name -> size).

    `tokens_per_device` is how many tokens (batch rows x positions) each device's matmuls work on: given to
    `inspect_compiled`, else read from the matmuls by `infer_tokens_per_device`; None for a program without matmuls.
    """

    mesh_axes: dict[str, int]
    collectives: list[CollectiveReport]
    matmuls: list[Matmul]
    attention: list[AttentionReport]
    inputs: list[InputReport]
    memory: MemoryReport | None
    tokens_per_device: int | None = None
    activations: list[ActivationReport] = dataclasses.field(default_factory=list)
    outputs: list[InputReport] = dataclasses.field(default_factory=list)
    kernels: list[KernelReport] = dataclasses.field(default_factory=list)

    def bytes_by_scope(self) -> dict[str, float]:
        """Bytes each device moves per call of the program, summed by collective scope."""
        totals = dict.fromkeys(SCOPES, 0.0)
        for collective in self.collectives:
            totals[collective.scope] += collective.bytes_per_device * collective.count
        return totals

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict of the whole report, with `bytes_by_scope` added."""
        return {**to_json(self), "bytes_by_scope": self.bytes_by_scope()}


class _Placement:
    """For each partition id of a program over `mesh`: its xcd coordinate, its physical GPU and its node."""

    def __init__(self, mesh: Mesh, gpus_per_node: int | None = None):
        names = list(mesh.axis_names)
        missing = [axis for axis in (GPU, XCD) if axis not in names]
        if missing:
            raise TopologyError(
                f"mesh axes {names} lack {missing}; expected a ('data', 'gpu', 'xcd') mesh, so build it with those axes"
            )
        shape = mesh.devices.shape
        coords = np.stack(np.unravel_index(np.arange(mesh.devices.size), shape), axis=1)
        xcd_axis = names.index(XCD)
        gpu_axes = [axis for axis in range(len(names)) if axis != xcd_axis]
        self.size = mesh.devices.size
        self.xcd = coords[:, xcd_axis]
        self.gpu = np.ravel_multi_index(tuple(coords[:, gpu_axes].T), [shape[axis] for axis in gpu_axes])
        if gpus_per_node:
            self.node = self.gpu // gpus_per_node
        else:
            self.node = np.array([device.process_index for device in mesh.devices.flat])

    def scope(self, group: Iterable[int]) -> str:
        return self.describe(group)[0]

    def describe(self, group: Iterable[int]) -> tuple[str, str]:
        """(scope, why it is "flat"; empty for the other scopes) of one group of partition ids."""
        members = np.array(sorted(set(group)), dtype=int)
        if len(members) <= 1:
            return "local", ""
        if members.max() >= self.size:
            raise TopologyError(
                f"replica group {members.tolist()} names partition {members.max()} but the mesh has {self.size} "
                "devices; inspect the program with the mesh it was compiled for"
            )
        xcds, gpus = self.xcd[members], self.gpu[members]
        if len(set(xcds)) == 1:
            return ("inter_node" if len(set(self.node[members])) > 1 else "inter_gpu"), ""
        if len(set(gpus)) == 1:
            return "intra_gpu", ""
        if len(set(gpus)) == len(members):
            return "flat", (f"takes one partition from each of GPUs {sorted(set(gpus.tolist()))} but at different "
                            f"partition indices {sorted(set(xcds.tolist()))}: its traffic enters and leaves each "
                            "package at a different die, so it loads the on-package fabric and the inter-GPU links at "
                            "once")
        return "flat", (f"holds several partitions of one GPU (xcds {sorted(set(xcds.tolist()))}) together with other "
                        f"GPUs ({sorted(set(gpus.tolist()))}): one ring over both links")

    def widest(self, groups: list[list[int]]) -> tuple[str, str]:
        """(scope, reason) of the widest of `groups`."""
        return max((self.describe(group) for group in groups), key=lambda found: SCOPES.index(found[0]),
                   default=("local", ""))


def classify_scope(group: Iterable[int], mesh: Mesh, *, gpus_per_node: int | None = None) -> str:
    """Scope of one replica group of partition ids (positions in `mesh.devices.flat`); one of `SCOPES`.

    intra_gpu: every member on one physical GPU (same coordinates on all axes but xcd). inter_gpu: every member on the
    same xcd of different GPUs; inter_node when those GPUs are on different nodes (`gpus_per_node` consecutive GPUs per
    node, else the devices' process_index). flat: the group spans several xcds and several GPUs, including one
    partition of each GPU at different partition indices (see `_Placement.describe`). local: one member.
    """
    return _Placement(mesh, gpus_per_node).scope(group)


def ring_bytes_per_device(kind: str, buffer_bytes: int, group_size: int) -> float:
    """Bytes one device sends for one collective, by the ring formulas (the alpha-beta model of collectives).

    `buffer_bytes` is the full buffer: the gathered result of an all-gather, the unscattered operand of a
    reduce-scatter, the result of any other kind (for a ragged all-to-all, the array it sends, all of whose rows leave
    the device at most: an upper bound).
    all-gather, reduce-scatter, all-to-all and ragged all-to-all: (p-1)/p x buffer; all-reduce: 2(p-1)/p x buffer;
    collective-permute, collective-broadcast and send: the buffer; recv: nothing (its send is counted); a kind the
    reader does not know: the buffer.
    """
    if kind == "recv":
        return 0.0
    share = (group_size - 1) / group_size
    if kind == "all-reduce":
        return 2 * share * buffer_bytes
    if kind in ("all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all"):
        return share * buffer_bytes
    return float(buffer_bytes)


def inspect_compiled(
    compiled: Any,
    mesh: Mesh,
    *,
    peak_flops: float | None = None,
    hbm_bandwidth: float | None = None,
    args: Any = None,
    gpus_per_node: int | None = None,
    tokens_per_device: int | None = None,
    lowered_text: str | None = None,
    token_dims: tuple[int, ...] | None = None,
    outputs: Any = None,
) -> Report:
    """Read a compiled program (`jax.jit(f).lower(*args).compile()`) over `mesh` into a Report.

    `args` holds the arrays that were lowered (jax.Array or ShapeDtypeStruct leaves): the tuple of positional
    arguments, or any pytree with the same leaves in the same order; it names each input by its path ("0/w1").
    Without it the inputs are read from `compiled.args_info`. Their shardings always come from the compiled program.
    `peak_flops` (FLOP/s) and `hbm_bandwidth` (bytes/s) of one device give each matmul's `below_ridge`.
    `tokens_per_device`: the tokens each device's matmuls work on (batch rows held by the device x positions), which
    principle 1 divides the matmuls' work by; pass it, or let `infer_tokens_per_device` read it from the shapes.
    `lowered_text` (`lowered.as_text(debug_info=True)` of the same program) with `token_dims` (the model's token
    dimensions, (batch, seq)) adds the activations: see `inspect_activations`. `outputs` names the results (see
    `_output_reports`), which hold what a step leaves behind (updated state, a filled KV cache).
    """
    report = inspect_text(
        compiled.as_text(),
        mesh,
        peak_flops=peak_flops,
        hbm_bandwidth=hbm_bandwidth,
        gpus_per_node=gpus_per_node,
        tokens_per_device=tokens_per_device,
    )
    if (lowered_text is None) != (token_dims is None):
        raise TopologyError("activations need both lowered_text and token_dims (the model's (batch, seq))")
    activations = [] if lowered_text is None else inspect_activations(lowered_text, mesh, token_dims)
    return dataclasses.replace(
        report, inputs=_input_reports(compiled, mesh, args), memory=MemoryReport.of(compiled),
        activations=activations, outputs=_output_reports(compiled, mesh, outputs),
    )


def inspect_activations(lowered_text: str, mesh: Mesh, token_dims: tuple[int, ...]) -> list[ActivationReport]:
    """The activations of a lowered program (`lowered.as_text(debug_info=True)`): every value whose global shape
    starts with `token_dims` (e.g. (batch, seq)), with the placement its sharding constraint gives it (see
    `stablehlo`), grouped by name, shape and placement, largest first.

    These placements are binding: XLA's partitioner must honour every sharding constraint, so they say what each
    device holds of each activation in the compiled program (whose per-device shapes no longer show global ones).
    """
    xcd = mesh.shape.get(XCD, 1)
    counts = Counter(dataclasses.replace(value, name=_scope_name(value.name))
                     for value in sharded_values(lowered_text) if value.shape[: len(token_dims)] == tuple(token_dims))
    reports = [
        ActivationReport(name=value.name, shape=list(value.shape), dtype=value.dtype,
                         spec=[[axis for axis, _ in dim] for dim in value.dims],
                         unreduced=sorted(value.unreduced), bytes=value.bytes,
                         shard_bytes=value.bytes // math.prod(value.split(axis, size)
                                                              for axis, size in mesh.shape.items()),
                         replication_xcd=xcd // value.split(XCD, xcd), count=count)
        for value, count in counts.items()
    ]
    return sorted(reports, key=lambda entry: -entry.bytes)


def op_scopes(op_name: str) -> list[str]:
    """The scopes of an op name ("jit(step)/while/body/q/dot_general") without the outermost jit(...) scope."""
    scopes = op_name.split("/")
    return scopes[1:] if scopes and scopes[0].startswith("jit(") else scopes


def _scope_name(op_name: str) -> str:
    """An op name without its outermost jit(...) scope."""
    return "/".join(op_scopes(op_name))


def inspect_text(
    text: str,
    mesh: Mesh,
    *,
    peak_flops: float | None = None,
    hbm_bandwidth: float | None = None,
    gpus_per_node: int | None = None,
    tokens_per_device: int | None = None,
) -> Report:
    """Read a compiled program's text (`compiled.as_text()`, or a dump of it) over `mesh` into a Report without
    inputs and memory, which only the compiled program holds. Arguments as `inspect_compiled`."""
    program = parse_hlo(text)
    if program.num_partitions != mesh.devices.size:
        raise TopologyError(
            f"the program was compiled for {program.num_partitions} partitions but the mesh has {mesh.devices.size} "
            "devices; pass the mesh the program was lowered with"
        )
    placement = _Placement(mesh, gpus_per_node)
    ridge = peak_flops / hbm_bandwidth if peak_flops and hbm_bandwidth else None
    matmuls = [dataclasses.replace(matmul, below_ridge=None if ridge is None else matmul.intensity < ridge)
               for matmul in program.dots]
    return Report(
        mesh_axes=dict(mesh.shape),
        collectives=[_collective_report(collective, placement) for collective in program.collectives],
        matmuls=matmuls,
        attention=[
            AttentionReport(name=call.name, op_name=call.op_name, target=call.target,
                            operand_shapes=[list(s.dims) for s in call.operands], count=call.count, flops=call.flops)
            for call in program.attention
        ],
        kernels=[KernelReport(name=call.name, op_name=call.op_name, target=call.target, kernel=call.kernel,
                              operand_shapes=[list(s.dims) for s in call.operands], count=call.count,
                              result_shapes=[list(s.dims) for s in call.results]) for call in program.kernels],
        inputs=[],
        memory=None,
        tokens_per_device=tokens_per_device or infer_tokens_per_device(matmuls),
    )


def _collective_report(collective: Collective, placement: _Placement) -> CollectiveReport:
    groups = [list(pair) for pair in collective.source_target_pairs] or collective.groups
    group_size = max((len(group) for group in groups), default=1)
    buffer_bytes = collective.result_bytes * (group_size if collective.kind == "reduce-scatter" else 1)
    scope, reason = placement.widest(groups)
    if not collective.known:
        scope, reason = "unknown", f"its kind {collective.kind!r} is not one the reader understands"
    elif not collective.grouped:
        scope, reason = "unknown", "it prints no replica groups or source-target pairs, so its members are unknown"
    return CollectiveReport(
        name=collective.name,
        kind=collective.kind,
        op_name=collective.op_name,
        scope=scope,
        groups=groups,
        group_size=group_size,
        buffer_bytes=buffer_bytes,
        bytes_per_device=ring_bytes_per_device(collective.kind, buffer_bytes, group_size),
        count=collective.count,
        reason=reason,
    )


def _input_reports(compiled: Any, mesh: Mesh, args: Any) -> list[InputReport]:
    tree = compiled.args_info[0] if args is None else args
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    shardings = jax.tree_util.tree_leaves(compiled.input_shardings[0])
    if len(leaves) != len(shardings):
        raise TopologyError(
            f"args hold {len(leaves)} arrays but the program takes {len(shardings)}; pass the positional arguments "
            "exactly as they were given to lower()"
        )
    return [
        _input_report(jax.tree_util.keystr(path, simple=True, separator="/"), leaf, sharding, mesh)
        for (path, leaf), sharding in zip(leaves, shardings)
    ]


def _output_reports(compiled: Any, mesh: Mesh, outputs: Any) -> list[InputReport]:
    """The program's results, named "output/<path>" by `outputs` (the step's abstract result, e.g. from
    `jax.eval_shape`; None: no output is reported), laid out as the compiled program returns them."""
    if outputs is None:
        return []
    leaves = jax.tree_util.tree_flatten_with_path(outputs)[0]
    shardings = jax.tree_util.tree_leaves(compiled.output_shardings)
    if len(leaves) != len(shardings):
        raise TopologyError(f"outputs hold {len(leaves)} arrays but the program returns {len(shardings)}; pass the "
                            "step's result as jax.eval_shape gives it")
    return [_input_report("output/" + jax.tree_util.keystr(path, simple=True, separator="/"), leaf, sharding, mesh)
            for (path, leaf), sharding in zip(leaves, shardings)]


def _input_report(name: str, leaf: Any, sharding: Any, mesh: Mesh) -> InputReport:
    shape = tuple(leaf.shape)
    itemsize = np.dtype(leaf.dtype).itemsize
    spec = getattr(sharding, "spec", None)
    return InputReport(
        name=name,
        shape=list(shape),
        dtype=str(np.dtype(leaf.dtype)),
        spec=None if spec is None else [list(entry) if isinstance(entry, tuple) else entry for entry in spec],
        bytes=math.prod(shape) * itemsize,
        shard_bytes=math.prod(sharding.shard_shape(shape)) * itemsize,
        replication_xcd=replication(sharding, shape, mesh, XCD),
        replication_gpu=replication(sharding, shape, mesh, GPU),
    )


def replication(sharding: jax.sharding.Sharding, shape: tuple[int, ...], mesh: Mesh, axis: str) -> int:
    """How many devices along mesh `axis` hold the same shard of an array of `shape` laid out by `sharding`.

    Read from the devices' index map, so it holds for any sharding over the mesh's devices: the axis size when the
    array is not split over `axis`, 1 when it is split over all of it.
    """
    position = {device: i for i, device in enumerate(mesh.devices.flat)}
    axis_index = list(mesh.axis_names).index(axis)
    shards_per_line: dict[tuple[int, ...], set] = defaultdict(set)
    for device, index in sharding.devices_indices_map(shape).items():
        if device not in position:
            raise TopologyError(f"{device} holds part of an input but is not in the mesh; inspect with the mesh used")
        coords = np.unravel_index(position[device], mesh.devices.shape)
        line = tuple(int(c) for i, c in enumerate(coords) if i != axis_index)
        shards_per_line[line].add(tuple(s.indices(size) for s, size in zip(index, shape)))
    return mesh.shape[axis] // max(len(shards) for shards in shards_per_line.values())


ATTENTION_SCOPE = "attention"
"""The named scope (the model's, or one a user puts around an attention call) whose matmuls form one kernel."""


def matmul_key(op_name: str) -> tuple[str, bool]:
    """(key, backward) of a matmul's op_name metadata, such as "jit(step)/transpose(jvp(mlp))/dot_general".

    The key drops the outermost jit(...) and the final primitive name (which XLA may rewrite, e.g. to "transpose"),
    and unwraps "transpose(...)" from each scope, so a backward matmul shares its key with the forward one it
    differentiates; `backward` says whether any scope was a transpose. Inside a scope named `ATTENTION_SCOPE`
    (also wrapped, as "jvp(attention)") the key ends at that scope and `backward` is False: attention's matmuls
    (scores and values, forward and backward, or fused kernels) are one op, however XLA split, merged or named
    them. XLA leaves some of them unnamed, and the name a dot then gets from its neighbours (`hlo`) can carry the
    other direction's scope: in a program without a layer loop one backward dot per layer of gpu_tp's step came
    out named as a forward one, which per direction made flat_tp's attention 1/12 of gpu_tp's where it is 1/8.
    """
    scopes = op_scopes(op_name)[:-1]
    unwrapped = [scope[len("transpose(") : -1] if scope.startswith("transpose(") else scope for scope in scopes]
    attention = [index for index, scope in enumerate(unwrapped) if _bare_scope(scope) == ATTENTION_SCOPE]
    if attention:
        return "/".join(unwrapped[: attention[0] + 1]), False
    return "/".join(unwrapped), any(scope.startswith("transpose(") for scope in scopes)


def is_attention_key(key: str) -> bool:
    """Whether a `matmul_key` key is attention's (it ends at a scope named `ATTENTION_SCOPE`)."""
    return _bare_scope(key.rpartition("/")[2]) == ATTENTION_SCOPE


RECOMPUTED_SCOPE = "rematted_computation"
"""The scope JAX puts around a `jax.checkpoint`'s forward pass run again in the backward pass (`--remat-policy`)."""


def is_recomputed(name: str) -> bool:
    """Whether an op name, or a `matmul_key` key, is of an op `jax.checkpoint` recomputes (one of its scopes is
    `RECOMPUTED_SCOPE`)."""
    return any(_bare_scope(scope) == RECOMPUTED_SCOPE for scope in name.split("/"))


def _bare_scope(scope: str) -> str:
    """A scope without the transformations wrapped around it: "transpose(jvp(attention))" -> "attention"."""
    while (wrapped := re.fullmatch(r"[\w.]+\((.+)\)", scope)) is not None:
        scope = wrapped.group(1)
    return scope


def infer_tokens_per_device(matmuls: list[Matmul]) -> int | None:
    """The tokens per device a program's matmuls share, read from their shapes; None when there are no matmuls.

    A forward matmul of a transformer is tokens x weight with the tokens a free dimension: M, or N where XLA put the
    weight first. So the count is the free size (M or N) found in the most forward matmuls (in the most matmuls when
    none is forward); a tie goes to the size found more often as M, where JAX puts the activations, then to the
    smaller. A model whose weight dimensions recur as often as the tokens can mislead it: then pass
    `tokens_per_device` to `inspect_compiled`.
    """
    forward = [matmul for matmul in matmuls if not matmul_key(matmul.op_name)[1]] or matmuls
    sizes = sorted({size for matmul in forward for size in (matmul.m, matmul.n)})

    def score(size: int) -> tuple[int, int]:
        return sum(size in (m.m, m.n) for m in forward), sum(size == m.m for m in forward)

    return max(sizes, key=score, default=None)
