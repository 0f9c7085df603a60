"""Read the text of a compiled XLA program: its collectives, matmuls and attention kernels.

The input is what `jax.jit(f).lower(*args).compile().as_text()` prints: the program one device runs after SPMD
partitioning, so every shape here is a per-device shape.

What is read:
- Collectives: every instruction that the compiler made a collective, whatever its kind: the kinds of
  `COLLECTIVE_KINDS` (all-reduce, all-gather, reduce-scatter, all-to-all, ragged-all-to-all, collective-broadcast,
  collective-permute, send, recv) and any other instruction that carries replica groups, source-target pairs or a
  channel id (its kind is then not in `COLLECTIVE_KINDS`, and the report calls it unknown rather than drop it). Each
  in its synchronous form or as an asynchronous `-start` / `-done` pair (read from the `-start`, counted once), also
  inside fusions, async wrappers, called computations and loop bodies. Their result shapes and their replica groups
  (or the source-target pairs of a collective-permute, send or recv), as lists of partition ids; `grouped` says
  whether the instruction printed any, so a collective without them is never mistaken for a local one.
- Matmuls: every `dot`, every `convolution` that is a matmul in disguise (1x1 window, no feature groups) and every
  cuBLAS gemm custom-call, as per-device (batch, M, K, N). XLA drops the op_name metadata of a dot it rewrites (one
  with a dimension of size 1 it removes or adds: attention's batched matmuls at one kv head or one query per device,
  every matrix-vector product); such a dot gets the op name of the most deeply scoped named instruction next to it in
  the data flow (`Matmul.inferred_name`): a matmul's inputs and outputs are made and used by the function it belongs to
  (softmax for attention's), whose ops sit deeper in the named scopes than the code around it. So is a dot named by
  a transpose of an elementwise einsum (`_borrowed_name`), a name XLA gave it that is not its own. Which of its
  operands the program reads from its arguments by moves alone (`Matmul.weight_operand`: a weight or a KV cache, as
  `_StoredValues` traces it) tells its weight side from its tokens' whatever their sizes.
- Attention: custom-calls to cuDNN's fused attention (targets starting with `__cudnn$fmha`), with their work read
  from the operand shapes and the dimension numbers of their backend config.
- Kernels: custom-calls of kernels written for the program (Pallas's Triton and Mosaic backends, `KERNEL_TARGETS`),
  with their name and operand shapes. Their work is not in the text (a grouped matmul's live rows are known only at
  run time), so they are read to be listed as work no principle judged, never to be dropped.

Replica groups come in three printed forms, all returned as `list[list[int]]`:
- explicit: `{{0,1},{2,3}}` (an empty `{}` means one group of every partition);
- iota: `[G,S]<=[d0,d1,...]` optionally followed by `T(p0,p1,...)`: the ids 0..N-1 laid out with shape `d`, transposed
  by `p`, then read row by row as G groups of S;
- mesh axes (Shardy): `mesh['a'=2,'b'=4] {'b'}`, optionally with `, device_ids=(...)` after the mesh, where the ids are
  either listed (`3,1,7,5,...`) or given in the iota form `[2,4]T(1,0)`. Axis names may be quoted or bare. A group axis
  may be a sub-axis `'a':(pre)size`: the axis of size A is split into (pre, size, A / (pre*size)) and the middle factor
  is the one grouped. Each group lists its members with the first named group axis varying slowest.
In an SPMD program these ids are partition ids: positions in the flattened device assignment of the program, which for
a program jitted over a `Mesh` is `mesh.devices.flat`, not `Device.id`.

How often each op runs: an op in a `while` body counts `known_trip_count` times (read from the loop's backend_config;
1 when XLA did not record a trip count), multiplied through nested loops; an op in a computation called from several
places counts once per call site; both branches of a conditional count as if each ran.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
from collections import defaultdict
from collections.abc import Iterator

import numpy as np

from starscream_jax.errors import StarscreamError

COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all",
                    "collective-broadcast", "collective-permute", "send", "recv")
"""The collective kinds whose groups and bytes the reader understands; others are read as unknown collectives."""
_COLLECTIVE_ATTRIBUTES = re.compile(r"\b(?:replica_groups|source_target_pairs|channel_id)=")
GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul")
ATTENTION_TARGET_PREFIX = "__cudnn$fmha"
KERNEL_TARGETS = ("__gpu$xla.gpu.triton", "triton_kernel_call", "mosaic_gpu", "tpu_custom_call")
"""Custom-call targets of kernels a program brings along (Pallas on NVIDIA and AMD GPUs through Triton, on NVIDIA
through Mosaic GPU, on TPUs)."""

_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([<=\d,]*)\]")
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s+\(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_OPCODE = re.compile(r"\s*([\w\-]+)\(")
_NUM_PARTITIONS = re.compile(r"\bnum_partitions=(\d+)")
_KERNEL_NAME = re.compile(r'\bname\\?"?\s*[=:]\s*\\?"([\w.\-]+)')
"""The kernel's name in a custom-call's backend config (`name = "k"`, `name="k"` or `"name":"k"`)."""
_OP_NAME = re.compile(r'\bop_name="((?:[^"\\]|\\.)*)"')
_TARGET = re.compile(r'\bcustom_call_target="([^"]*)"')
_CALLEE = re.compile(r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_CALLEE_LIST = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_IOTA_GROUPS = re.compile(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_MESH_GROUPS = re.compile(
    r"mesh\[([^\]]*)\](?:,\s*device_ids=\((\[[\d,]+\](?:T\([\d,]+\))?|[\d,\s]+)\))?\s*\{([^}]*)\}"
)
_MESH_AXIS = re.compile(r"(?:'([^']*)'|([\w.\-]+))=(\d+)")
_GROUP_AXIS = re.compile(r"(?:'([^']*)'|([\w.\-]+))(?::\((\d+)\)(\d+))?")


@dataclasses.dataclass(frozen=True)
class ArrayShape:
    """One array type from the program text: element type (`bf16`, `f32`, ...) and per-device dimensions."""

    dtype: str
    dims: tuple[int, ...]

    @property
    def bytes(self) -> int:
        """Size in bytes (sub-byte types rounded up to whole bytes)."""
        return math.ceil(math.prod(self.dims) * dtype_bits(self.dtype) / 8)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Collective:
    """One collective instruction.

    `results` are the arrays it produces on one device (several when XLA combined collectives into one); for a
    ragged-all-to-all, whose result is a receive buffer sized for the worst case, the array it sends (its first
    operand, of which the rows its send sizes name leave the device: all of them at most).
    `groups` are the replica groups as partition ids; for a collective-permute, send or recv `groups` is empty and
    `source_target_pairs` holds the (source, target) partition ids instead. `grouped` is False when the instruction
    printed neither (then nothing says which partitions it joins). `count` is how many times it runs per call of the
    program.
    """

    name: str
    kind: str
    op_name: str
    results: tuple[ArrayShape, ...]
    groups: list[list[int]]
    source_target_pairs: list[tuple[int, int]]
    count: int
    grouped: bool = True

    @property
    def known(self) -> bool:
        """Whether the kind is one of `COLLECTIVE_KINDS`."""
        return self.kind in COLLECTIVE_KINDS

    @property
    def result_bytes(self) -> int:
        return sum(shape.bytes for shape in self.results)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Matmul:
    """One local matmul on one device: out[batch, M, N] = lhs[batch, M, K] @ rhs[batch, K, N], as `parse_hlo` reads
    it, the report judges it and a layout's result prices it.

    M, K and N are products of the free, contracting and free dimensions of the operands. `split_k` > 1 when XLA split
    the contraction into a batch of partial products (split-K); K is reported whole and `batch` without that split.
    `dtype` is the left operand's element type, `bytes` those of the two operands and the result, `intensity` FLOPs
    per byte. `below_ridge` says whether the intensity is under the device's peak FLOP/s over HBM bytes/s (None when
    those were not given, `report.inspect_compiled`). `inferred_name`: XLA left the matmul without an op name and
    `op_name` is its nearest named neighbour's (see the module). `weight_operand` ("lhs" or "rhs"): the one operand
    the program reads from its arguments by moves alone (`_StoredValues`: a weight, a KV cache), the other carrying
    the tokens; "" where both or neither are. A layout's result (`layout_report.priced_matmul`) gives `dtype`,
    `bytes`, `intensity` and `below_ridge` at the model's compute dtype and the preset's ridge point, and
    `in_layer_loop` and `full_depth_runs` (whether it runs in the layer loop, its runs in the full-depth step),
    None otherwise. `count` is how many times it runs per call of the program.
    """

    name: str
    op_name: str
    batch: int
    m: int
    k: int
    n: int
    dtype: str
    flops: int
    bytes: int
    intensity: float
    below_ridge: bool | None
    count: int
    inferred_name: bool = False
    split_k: int = 1
    weight_operand: str = ""
    in_layer_loop: bool | None = None
    full_depth_runs: float | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class CustomCall:
    """One custom-call the reader understands: its target and operand and result arrays."""

    name: str
    op_name: str
    target: str
    operands: tuple[ArrayShape, ...]
    results: tuple[ArrayShape, ...]
    count: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionCall(CustomCall):
    """One fused attention kernel (a cuDNN fMHA custom-call).

    `flops` is its matmul work on one device (None when its backend config gives no dimension numbers): each of its
    matmuls (two forward: scores and values; four backward) multiplies a query-shaped by a key-shaped array or the
    score matrix between them, so each does 2 x (batch x heads) x queries x head_dim x keys, read from the queries
    (operand 0), the keys (operand 1) and the first matmul's dimension numbers (`attention_flops`).
    """

    flops: int | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelCall(CustomCall):
    """One custom kernel (`KERNEL_TARGETS`), with the name its backend config gives it ('' when none)."""

    kernel: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class HloProgram:
    """Everything `parse_hlo` reads from one program, each list in execution order of first appearance."""

    num_partitions: int
    collectives: list[Collective]
    dots: list[Matmul]
    attention: list[AttentionCall]
    kernels: list[KernelCall] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Instruction:
    name: str
    opcode: str
    result_type: str
    operands: list[str]
    attrs: str
    root: bool = False


def dtype_bits(dtype: str) -> int:
    """Bits per element of an HLO element type: `pred` 8, `token` 0, otherwise the first number in the name."""
    if dtype == "pred":
        return 8
    match = re.search(r"\d+", dtype)
    return int(match.group()) if match else 0


def parse_shapes(type_text: str) -> tuple[ArrayShape, ...]:
    """All arrays in an HLO type, flattened in order: `(f32[2,3]{1,0}, bf16[4])` -> two shapes."""
    return tuple(
        ArrayShape(dtype, tuple(int(d.removeprefix("<=")) for d in dims.split(",") if d))
        for dtype, dims in _ARRAY.findall(type_text)
        if dtype != "token"
    )


def parse_replica_groups(text: str, num_partitions: int) -> list[list[int]]:
    """Replica groups from the text that follows `replica_groups=` (any of the three forms), as partition ids."""
    text = text.lstrip()
    if text.startswith("mesh["):
        groups = _mesh_groups(text)
    elif text.startswith("["):
        groups = _iota_groups(text)
    elif text.startswith("{"):
        groups = _int_lists(_braced(text)) or [list(range(num_partitions))]
    else:
        raise StarscreamError(f"replica groups {text[:60]!r} are in no known form; expected {{{{0,1}},...}}, "
                              "[G,S]<=[N] or mesh[...] {...}")
    _check_ids(groups, num_partitions, f"replica groups {text[:60]!r}")
    return groups


def _check_ids(groups: list[list[int]], num_partitions: int, what: str, distinct: bool = True) -> None:
    """Every id a partition id of the program and, when `distinct` (replica groups; not source-target pairs, where a
    partition may send to itself), none twice in one group; StarscreamError otherwise."""
    for group in groups:
        if any(not 0 <= member < num_partitions for member in group) or (distinct and len(set(group)) != len(group)):
            once = ", each once per group" if distinct else ""
            raise StarscreamError(f"{what} name partitions {group}, but the program has {num_partitions} partitions "
                                  f"(ids 0-{num_partitions - 1}{once}); the text is damaged or was cut from another "
                                  "program: pass the whole compiled text")


def parse_hlo(text: str) -> HloProgram:
    """Read the collectives, matmuls and attention kernels of a compiled program's text, with per-call run counts."""
    computations, entry = _split_computations(text)
    if entry is None:
        raise StarscreamError("the text holds no HLO computation; pass the output of `compiled.as_text()`")
    header = _NUM_PARTITIONS.search(text)
    reader = _ProgramReader(computations, entry, int(header.group(1)) if header else 1)
    reader.visit(entry, 1)
    return HloProgram(
        num_partitions=reader.num_partitions,
        collectives=list(reader.collectives.values()),
        dots=list(reader.dots.values()),
        attention=list(reader.attention.values()),
        kernels=list(reader.kernels.values()),
    )


class _ProgramReader:
    """Walks the call graph from the entry computation, counting each recorded op once per execution."""

    def __init__(self, computations: dict[str, list[_Instruction]], entry: str, num_partitions: int):
        self.computations = computations
        self.num_partitions = num_partitions
        self.types = {inst.name: inst.result_type for body in computations.values() for inst in body}
        self.flow = _DataFlow(computations)
        self.stored = _StoredValues(computations, entry)
        self.collectives: dict[str, Collective] = {}
        self.dots: dict[str, Matmul] = {}
        self.attention: dict[str, AttentionCall] = {}
        self.kernels: dict[str, KernelCall] = {}

    def visit(self, computation: str, times: int) -> None:
        for inst in self.computations.get(computation, []):
            self._record(inst, times)
            if inst.opcode.endswith(("-done", "-update")):
                continue
            repeat = _trip_count(inst.attrs) if inst.opcode == "while" else 1
            for callee in _callees(inst.attrs):
                self.visit(callee, times * repeat)

    def _record(self, inst: _Instruction, times: int) -> None:
        kind = inst.opcode.removesuffix("-start")
        if _is_collective(inst, kind):
            _add(self.collectives, inst.name, times, lambda: self._collective(inst, kind))
        elif inst.opcode in ("dot", "convolution") or (
            inst.opcode == "custom-call" and _target(inst.attrs).startswith(GEMM_TARGETS)
        ):
            _add(self.dots, inst.name, times, lambda: self._dot(inst))
        elif inst.opcode == "custom-call" and _target(inst.attrs).startswith(ATTENTION_TARGET_PREFIX):
            _add(self.attention, inst.name, times, lambda: self._attention(inst))
        elif inst.opcode == "custom-call" and _target(inst.attrs).startswith(KERNEL_TARGETS):
            _add(self.kernels, inst.name, times, lambda: self._kernel(inst))

    def _collective(self, inst: _Instruction, kind: str) -> Collective:
        results = parse_shapes(inst.result_type)
        if inst.opcode == "all-gather-start":
            results = results[len(results) // 2 :]
        elif inst.opcode == "collective-permute-start":
            results = results[1:2]
        elif kind in ("send", "recv"):
            results = results[:1]
        elif kind == "ragged-all-to-all":  # its result is a receive buffer sized for the worst case: read what it sends
            results = parse_shapes(self.types[inst.operands[0]])[:1]
        pairs_text = (_attribute(inst.attrs, "source_target_pairs")
                      or _attribute(inst.attrs, "_xla_send_recv_source_target_pairs"))
        groups_text = _attribute(inst.attrs, "replica_groups")
        pairs = [] if pairs_text is None else [tuple(p) for p in _int_lists(_braced(pairs_text))]
        _check_ids([list(pair) for pair in pairs], self.num_partitions, "source-target pairs", distinct=False)
        return Collective(
            name=inst.name,
            kind=kind,
            op_name=_op_name(inst.attrs),
            results=results,
            groups=[] if groups_text is None else parse_replica_groups(groups_text, self.num_partitions),
            source_target_pairs=pairs,
            count=0,
            grouped=groups_text is not None or pairs_text is not None,
        )

    def _operand(self, inst: _Instruction, index: int) -> ArrayShape:
        return parse_shapes(self.types[inst.operands[index]])[0]

    def _dot(self, inst: _Instruction) -> Matmul | None:
        lhs, rhs = self._operand(inst, 0), self._operand(inst, 1)
        out = parse_shapes(inst.result_type)[0]
        if inst.opcode == "convolution":
            dims = _convolution_dims(inst.attrs, lhs, rhs)
        else:
            dims = _dot_dims(_dot_numbers(inst), lhs, rhs)
        if dims is None:
            return None
        batch, m, k, n, split_k = dims
        op_name = self.flow.op_names[inst.name]
        inferred = "" if op_name else self.flow.nearest_op_name(inst.name)
        flops, moved = 2 * batch * m * k * n, lhs.bytes + rhs.bytes + out.bytes
        stored = tuple(self.stored.stored(operand) for operand in inst.operands[:2])
        return Matmul(name=inst.name, op_name=op_name or inferred, batch=batch, m=m, k=k, n=n, dtype=lhs.dtype,
                      flops=flops, bytes=moved, intensity=flops / moved, below_ridge=None,
                      count=0, inferred_name=bool(inferred), split_k=split_k,
                      weight_operand={(True, False): "lhs", (False, True): "rhs"}.get(stored, ""))

    def _attention(self, inst: _Instruction) -> AttentionCall:
        operands = tuple(self._operand(inst, index) for index in range(len(inst.operands)))
        return AttentionCall(name=inst.name, op_name=_op_name(inst.attrs), target=_target(inst.attrs),
                             operands=operands, results=parse_shapes(inst.result_type), count=0,
                             flops=attention_flops(inst.attrs, operands))

    def _kernel(self, inst: _Instruction) -> KernelCall:
        operands = tuple(self._operand(inst, index) for index in range(len(inst.operands)))
        name = _KERNEL_NAME.search(inst.attrs)
        return KernelCall(name=inst.name, op_name=_op_name(inst.attrs), target=_target(inst.attrs), operands=operands,
                          results=parse_shapes(inst.result_type), count=0, kernel=name.group(1) if name else "")


def attention_flops(attrs: str, operands: tuple[ArrayShape, ...]) -> int | None:
    """Matmul FLOPs of one cuDNN fused attention call from its attributes' backend config and its operands (queries
    first, keys second): the number of matmuls its config describes (`*_dot_dimension_numbers`: bmm1 and bmm2
    forward, four gradient matmuls backward), each 2 x batch x M x K x N of the queries against the keys under the
    first one's dimension numbers (the forward scores' bmm1, the backward dO x V^T with the same shapes). None
    without them."""
    config = _backend_config(attrs).get("cudnn_fmha_backend_config", {})
    numbers = [value for key, value in sorted(config.items()) if key.endswith("dot_dimension_numbers")]
    first = config.get("bmm1_dot_dimension_numbers") or config.get("bmm2_grad_gemm2_dot_dimension_numbers")
    if not numbers or first is None or len(operands) < 2:
        return None
    queries, keys = operands[0].dims, operands[1].dims

    def dims(key: str) -> list[int]:
        return [int(v) for v in first.get(key, [])]

    q_batch, q_contract, k_batch, k_contract = (dims(f"{side}_{kind}_dimensions") for side in ("lhs", "rhs")
                                                for kind in ("batch", "contracting"))
    batch = math.prod(queries[i] for i in q_batch)
    m = math.prod(size for i, size in enumerate(queries) if i not in q_batch + q_contract)
    k = math.prod(queries[i] for i in q_contract)
    n = math.prod(size for i, size in enumerate(keys) if i not in k_batch + k_contract)
    return len(numbers) * 2 * batch * m * k * n


class _DataFlow:
    """Which instructions feed and use which, across the program, for naming the ops XLA left unnamed.

    Op names are kept without the names no matmul owns (`_borrowed_name`). An instruction of a fused computation is
    connected to the fusion that calls it: a parameter to the fusion's operand at its index, an instruction no other
    one in its computation uses (the root) to the fusion's users.
    `fused_users` lists, per value, the instructions inside the fusions it enters that read it (those of the
    parameter it is passed as).
    """

    def __init__(self, computations: dict[str, list[_Instruction]]):
        self.op_names: dict[str, str] = {}
        self.neighbours: dict[str, list[str]] = defaultdict(list)
        self.fused_users: dict[str, list[str]] = defaultdict(list)
        fusion_of = {callee: inst for body in computations.values() for inst in body if inst.opcode == "fusion"
                     for callee in _callees(inst.attrs)}
        for computation, body in computations.items():
            names = {inst.name for inst in body}
            used = set()
            for inst in body:
                self.op_names[inst.name] = _own_op_name(inst.attrs)
                for operand in inst.operands:
                    if operand in names:
                        used.add(operand)
                        self._connect(inst.name, operand)
            fusion = fusion_of.get(computation)
            if fusion is None:
                continue
            for inst in body:
                if inst.opcode == "parameter" and inst.operands and inst.operands[0].isdigit():
                    index = int(inst.operands[0])
                    if index < len(fusion.operands):
                        self.fused_users[fusion.operands[index]] += self.neighbours[inst.name]
                        self._connect(inst.name, fusion.operands[index])
                elif inst.name not in used:
                    self._connect(inst.name, fusion.name)

    def _connect(self, a: str, b: str) -> None:
        self.neighbours[a].append(b)
        self.neighbours[b].append(a)

    def nearest_op_name(self, name: str, max_steps: int = 4) -> str:
        """The op name of the best named instruction among the nearest named ones to `name` (through unnamed ones,
        up to `max_steps` steps away) that lie in a scope of the model's code; empty when there is none.

        Best: the most scopes of code (`_code_depth`), then a `dot_general`'s (XLA keeps a rewritten dot's own name
        on the reshapes it puts around it). A name in no scope of code (the sampling's `jit(_where)/select_n` after
        the logits, a norm's einsum at the top level) says nothing of the dot: the search goes one step further, and
        takes the nearest such name only where it finds no other. An op name XLA merged from several (joined by
        ";") offers each of them. So a matrix-vector product beside a norm's scale
        (an einsum of its own) and its weight's gather in the projection's scope takes the projection's name, and
        the logits' product beside the sampling's masking takes the logits'.

        Before all that, a name in code ending in `dot_general` on an op that reads the dot's result inside a fusion
        it enters (`fused_users`) is taken: a reshape XLA fused there, keeping the dot's own name. Two steps away,
        it lost to the norm's `mul` one step away, feeding the dot: gpu_tp's k and v products written into the
        KV cache in decode, and its gate and up, had no counterpart, and decode of one sequence read "not judged
        (2 of 6 ops)"."""
        own = [op_name for user in self.fused_users[name] for op_name in self.op_names.get(user, "").split(";")
               if op_name.endswith("/dot_general") and _code_depth(op_name)]
        if own:
            return max(own, key=_code_depth)
        seen, frontier, fallback = {name}, [name], ""
        for _ in range(max_steps):
            frontier = [other for current in frontier for other in self.neighbours[current] if other not in seen]
            seen.update(frontier)
            named = [part for other in frontier for part in self.op_names.get(other, "").split(";") if part]
            in_code = [op_name for op_name in named if _code_depth(op_name)]
            if in_code:
                return max(in_code, key=lambda op_name: (_code_depth(op_name), op_name.endswith("/dot_general")))
            fallback = fallback or next(iter(named), "")
            frontier = list(dict.fromkeys(frontier))
        return fallback


MOVES = frozenset({
    "all-gather", "all-gather-done", "all-gather-start", "all-to-all", "bitcast", "bitcast-convert", "broadcast",
    "collective-permute", "collective-permute-done", "collective-permute-start", "convert", "copy", "copy-done",
    "copy-start", "dynamic-slice", "dynamic-update-slice", "gather", "reshape", "reverse", "scatter", "slice",
    "transpose"})
"""Opcodes whose result holds elements of their first operand, moved, re-laid or converted, none computed from
others: what a weight or a KV cache passes through between the step's arguments and the matmul reading it (a layer's
slice of a stacked weight, the expert weights gathered per tile, a cache with the new token's keys written in, a
weight's shards gathered)."""
_CALLED_ROOT = re.compile(r"\b(?:calls|to_apply|body)=%?([\w.\-]+)")


class _StoredValues:
    """Which values of a program are its arguments moved by `MOVES` alone, through fusions, loops and calls, tuple
    element by tuple element: in decode, a matmul's operand that is stored is the weight or the KV cache it reads
    and the other carries the tokens (a norm, a sum or a product computed them), whatever the sizes of the two."""

    def __init__(self, computations: dict[str, list[_Instruction]], entry: str):
        self.entry = entry
        self.where = {inst.name: (computation, inst) for computation, body in computations.items() for inst in body}
        self.roots = {computation: next((inst for inst in body if inst.root), body[-1])
                      for computation, body in computations.items() if body}
        self.callers: dict[str, list[_Instruction]] = defaultdict(list)
        for callee, inst in [(callee, inst) for body in computations.values() for inst in body
                             if inst.opcode in ("fusion", "while", "call") for callee in _callees(inst.attrs)]:
            self.callers[callee].append(inst)
        self.known: dict[tuple[str, tuple[int, ...]], bool] = {}

    def stored(self, name: str, path: tuple[int, ...] = ()) -> bool:
        """Whether value `name` (its tuple element at `path`) is a program argument moved without arithmetic."""
        key = (name, path)
        if key not in self.known:
            mark = len(self.known)
            self.known[key] = True  # a value that reaches itself (a loop's state) is taken as stored while traced
            found = self._stored(name, path)
            if not found:  # what was found stored under that assumption is traced again when asked
                added = list(itertools.islice(reversed(self.known), len(self.known) - mark))
                for other in [other for other in added if self.known[other]]:
                    del self.known[other]
            self.known[key] = found
        return self.known[key]

    def _stored(self, name: str, path: tuple[int, ...]) -> bool:
        """`stored` for one instruction: a parameter asks its callers, a tuple element its source, a fusion, loop or
        call the root of what it calls, a move its first operand, a product all its operands (a mixture's 8-bit expert
        weights dequantized before their grouped matmul: read by their sizes, the 8 embed rows a CPX partition holds
        of the tiny mixture's 64 were taken for its tokens, and 8-bit decode read 2x gpu_tp's); anything else
        computes its value."""
        if name not in self.where:
            return False
        computation, inst = self.where[name]
        if inst.opcode == "parameter":
            return self._parameter(computation, inst, path)
        if inst.opcode == "get-tuple-element":
            index = re.search(r"\bindex=(\d+)", inst.attrs)
            return index is not None and self.stored(inst.operands[0], (int(index.group(1)), *path))
        if inst.opcode == "tuple":
            return bool(path) and path[0] < len(inst.operands) and self.stored(inst.operands[path[0]], path[1:])
        if inst.opcode in ("fusion", "while", "call"):
            callee = _CALLED_ROOT.search(inst.attrs)
            return callee is not None and callee.group(1) in self.roots and self.stored(
                self.roots[callee.group(1)].name, path)
        if inst.opcode == "multiply":  # an 8-bit weight times its scales, both read from the arguments
            return all(self.stored(operand) for operand in inst.operands)
        return inst.opcode in MOVES and bool(inst.operands) and self.stored(inst.operands[0])

    def _parameter(self, computation: str, inst: _Instruction, path: tuple[int, ...]) -> bool:
        """An argument of the entry computation is stored; a called computation's parameter is what each of its
        callers (fusions, calls) passes at that index; a loop's state is stored where both the loop's initial value
        and the value each trip leaves are (a weight passed through, a cache written in place, not an activation)."""
        if computation == self.entry:
            return True
        callers = self.callers.get(computation, [])
        if not callers or not inst.operands or not inst.operands[0].isdigit():
            return False
        index = int(inst.operands[0])
        return all(index < len(caller.operands) and self.stored(caller.operands[index], path)
                   and (caller.opcode != "while" or self.stored(caller.name, path)) for caller in callers)


def is_einsum_scope(scope: str) -> bool:
    """Whether a scope is the one `jnp.einsum` names by its subscripts ("bsd,dke->bske", or wrapped, as
    "jvp(bsd,dke->bske)"): the name of one product, not a scope of the model's code. A dot XLA left unnamed takes
    its name from its neighbours by their scopes of code (`_DataFlow.nearest_op_name`), and may then lack the
    subscripts its counterpart in another program carries (`principles` pairs such ops by their scopes of code)."""
    return "->" in scope


_SUBSCRIPTS = re.compile(r"[\w.]*(?:,[\w.]*)*->[\w.]*")


def without_subscripts(scope: str) -> str:
    """A scope without the einsum subscripts in it, its transformations kept: "jvp(vmap(BTNH,BSNH->BNTS))" ->
    "jvp(vmap())", "bsd,dke->bske" -> ""."""
    return _SUBSCRIPTS.sub("", scope)


def _borrowed_name(op_name: str) -> bool:
    """Whether an op name is that of a transpose in an elementwise einsum, one that contracts nothing
    ("jit(step)/transpose(jvp(closed_call))/...ab,ab->...ab/transpose": `Placement.scale`'s bias or norm scale).

    Such an einsum's transposes only lay out its weight's gradient, a sum over the tokens of the gradient of its
    result, and no matmul is theirs: a dot named so took the name of one XLA folded into the dot that made that
    gradient. Qwen2's value bias so named the value-gradient matmul of attention under starscream_fsdp, which then
    had no counterpart in gpu_tp. The subscripts may carry an ellipsis ("...ab") or wrappers ("jvp(a,a->a)")."""
    *scopes, primitive = op_name.split("/")
    subscripts = _SUBSCRIPTS.search(scopes[-1]) if scopes and primitive == "transpose" else None
    if subscripts is None:
        return False
    inputs, output = subscripts.group().split("->")
    return set(inputs.replace(",", "")) <= set(output)


def _own_op_name(attrs: str) -> str:
    """An instruction's op name (`_op_name`) without the parts, of one XLA merged from several (joined by ";"), that
    are `_borrowed_name`s."""
    return ";".join(part for part in _op_name(attrs).split(";") if part and not _borrowed_name(part))


def _code_depth(op_name: str) -> int:
    """How many scopes of the model's code an op name holds: its scopes inside the outermost jit(...) and before the
    primitive, without einsum subscripts (`is_einsum_scope`) and the jit(...) wrappers of library functions
    (`jit(_where)`, `jit(silu)`)."""
    scopes = op_name.split("/")[1:-1] if op_name.startswith("jit(") else op_name.split("/")[:-1]
    return sum(not is_einsum_scope(scope) and not scope.startswith("jit(") for scope in scopes)


def _is_collective(inst: _Instruction, kind: str) -> bool:
    """A collective of a known kind, or any other instruction carrying replica groups, source-target pairs or a
    channel id (the `-done` halves of asynchronous pairs excepted: their `-start` is the one read)."""
    if inst.opcode.endswith(("-done", "-update")):
        return False
    return kind in COLLECTIVE_KINDS or _COLLECTIVE_ATTRIBUTES.search(inst.attrs) is not None


def instructions_in_loops(text: str, trip_count: int) -> frozenset[str]:
    """Names of the instructions in the computations reached from every `while` whose known trip count is
    `trip_count` (its body and condition, and what they call); empty when there is no such loop."""
    computations, _ = _split_computations(text)
    pending = [callee for body in computations.values() for inst in body
               if inst.opcode == "while" and _trip_count(inst.attrs) == trip_count for callee in _callees(inst.attrs)]
    reached: set[str] = set()
    while pending:
        name = pending.pop()
        if name in reached or name not in computations:
            continue
        reached.add(name)
        pending += [callee for inst in computations[name] for callee in _callees(inst.attrs)]
    return frozenset(inst.name for name in reached for inst in computations[name])


def scope_shares(text: str, scope: str) -> dict[str, float]:
    """{name: share} of the instructions whose op name has `scope` among its scopes: 1.0, except for a collective XLA
    combined from several ops (its op name "prefix/(a:b:...)" joins theirs after the scopes they share, one per
    result): the share of its result bytes whose ops have `scope`. A dot XLA left unnamed is judged by the op name
    `parse_hlo` gives it."""
    computations, _ = _split_computations(text)
    flow = _DataFlow(computations)
    shares = {}
    for body in computations.values():
        for inst in body:
            op_name = ((flow.op_names[inst.name] or flow.nearest_op_name(inst.name)) if inst.opcode == "dot"
                       else _op_name(inst.attrs))
            share = _scope_share(op_name, parse_shapes(inst.result_type), scope)
            if share:
                shares[inst.name] = share
    return shares


def _scope_share(op_name: str, results: tuple[ArrayShape, ...], scope: str) -> float:
    """The share of an op's results that belong to `scope` (see `scope_shares`)."""
    combined = re.fullmatch(r"(.*?/)?\((.*)\)", op_name)
    parts = combined.group(2).split(":") if combined else []
    if combined and len(parts) == len(results) > 1 and sum(shape.bytes for shape in results):
        inside = [scope in re.split(r"[/()]", (combined.group(1) or "") + part) for part in parts]
        return sum(shape.bytes for shape, chosen in zip(results, inside) if chosen) / sum(s.bytes for s in results)
    return 1.0 if scope in re.split(r"[/():]", op_name) else 0.0


def _add(records: dict, name: str, times: int, build) -> None:
    """Add `times` runs to the record of instruction `name`, building the record on first sight (None: not recorded)."""
    if name not in records:
        record = build()
        if record is None:
            return
        records[name] = record
    records[name] = dataclasses.replace(records[name], count=records[name].count + times)


def _split_computations(text: str) -> tuple[dict[str, list[_Instruction]], str | None]:
    """Map each computation's name to its instructions; also return the entry computation's name (the one marked
    ENTRY, else the last one)."""
    computations: dict[str, list[_Instruction]] = {}
    entry = current = None
    for line in text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            current = header.group(2)
            computations[current] = []
            entry = current if header.group(1) else entry
        elif line.startswith("}"):
            current = None
        elif current is not None:
            inst = _parse_instruction(line)
            if inst is not None:
                computations[current].append(inst)
    return computations, entry or next(reversed(computations), None)


def _parse_instruction(line: str) -> _Instruction | None:
    head = _INSTRUCTION.match(line)
    if head is None:
        return None
    rest = line[head.end() :]
    if rest.startswith("("):
        end = _closing(rest, 0, "(", ")")
        result_type, rest = rest[: end + 1], rest[end + 1 :]
    else:
        result_type, _, rest = rest.partition(" ")
    opcode = _OPCODE.match(rest)
    if opcode is None:
        return None
    open_at = opcode.end() - 1
    close_at = _closing(rest, open_at, "(", ")")
    operands = [_operand_name(token) for token in _split_top(rest[open_at + 1 : close_at])]
    return _Instruction(name=head.group(1), opcode=opcode.group(1), result_type=result_type, operands=operands,
                        attrs=rest[close_at + 1 :], root=line.lstrip().startswith("ROOT "))


def _operand_name(token: str) -> str:
    token = re.sub(r"/\*.*?\*/", "", token).strip()
    return token.split()[-1].lstrip("%") if token else ""


def _split_top(text: str) -> list[str]:
    """Split on commas that are not inside brackets, braces or parentheses."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += char in "([{"
        depth -= char in ")]}"
        if char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [part for part in parts if part.strip()]


def _closing(text: str, open_at: int, opener: str, closer: str) -> int:
    depth = 0
    for i in range(open_at, len(text)):
        depth += text[i] == opener
        depth -= text[i] == closer
        if depth == 0:
            return i
    raise StarscreamError(f"unbalanced {opener}{closer} in HLO text {text[:80]!r}; pass the whole line as printed")


def _braced(text: str) -> str:
    """The text inside the first balanced pair of braces."""
    start = text.index("{")
    return text[start + 1 : _closing(text, start, "{", "}")]


def _attribute(attrs: str, key: str) -> str | None:
    """The raw text after `key=` (to the end of the attributes), or None when the attribute is absent."""
    match = re.search(rf"\b{key}=", attrs)
    return attrs[match.end() :] if match else None


def _int_lists(text: str) -> list[list[int]]:
    return [[int(v) for v in group.split(",") if v.strip()] for group in re.findall(r"\{([\d,\s]*)\}", text)]


def _op_name(attrs: str) -> str:
    match = _OP_NAME.search(attrs)
    return match.group(1) if match else ""


def _target(attrs: str) -> str:
    match = _TARGET.search(attrs)
    return match.group(1) if match else ""


def _backend_config(attrs: str) -> dict:
    raw = _attribute(attrs, "backend_config")
    if raw is None or not raw.startswith("{"):
        return {}
    return json.loads(raw[: _closing(raw, 0, "{", "}") + 1])


def _trip_count(attrs: str) -> int:
    return int(_backend_config(attrs).get("known_trip_count", {}).get("n", 1))


def _callees(attrs: str) -> Iterator[str]:
    for _, name in _CALLEE.findall(attrs):
        yield name
    for names in _CALLEE_LIST.findall(attrs):
        yield from (name.strip().lstrip("%") for name in names.split(",") if name.strip())


def _iota_ids(reshape: list[int], transpose: list[int] | None, text: str) -> np.ndarray:
    if transpose and sorted(transpose) != list(range(len(reshape))):
        raise StarscreamError(f"iota ids in {text[:60]!r}: T{tuple(transpose)} is not a permutation of the "
                              f"{len(reshape)} dimensions {reshape}; the text is damaged")
    ids = np.arange(math.prod(reshape)).reshape(reshape)
    return ids.transpose(transpose) if transpose else ids


def _numbers(text: str | None) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()] if text else []


def _iota_groups(text: str) -> list[list[int]]:
    match = _IOTA_GROUPS.match(text)
    if match is None:
        raise StarscreamError(f"iota replica groups {text[:60]!r} do not read as [G,S]<=[dims]T(perm)")
    shape, reshape, transpose = _numbers(match.group(1)), _numbers(match.group(2)), _numbers(match.group(3))
    if len(shape) != 2 or math.prod(shape) != math.prod(reshape):
        raise StarscreamError(f"iota replica groups {text[:60]!r}: {' x '.join(map(str, shape))} groups and members "
                              f"do not hold the {math.prod(reshape)} ids of {reshape}; the text is damaged")
    return _iota_ids(reshape, transpose or None, text).reshape(shape).tolist()


def _mesh_groups(text: str) -> list[list[int]]:
    match = _MESH_GROUPS.match(text)
    if match is None:
        raise StarscreamError(f"mesh replica groups {text[:80]!r} do not read as mesh[axis=size,...] {{axes}}")
    axes = [(quoted or bare, int(size)) for quoted, bare, size in _MESH_AXIS.findall(match.group(1))]
    names = [name for name, _ in axes]
    grouped = []
    for quoted, bare, pre, size in _GROUP_AXIS.findall(match.group(3)):
        if (quoted or bare) not in names:
            raise StarscreamError(f"group axis {quoted or bare!r} is not in the mesh {names} of {text[:80]!r}")
        grouped.append((names.index(quoted or bare), int(pre) if pre else None, int(size) if size else None))
    factor_sizes, factor_keys = [], []
    for axis, (_, size) in enumerate(axes):
        for factor, key in _axis_factors(size, [(pre, sub) for a, pre, sub in grouped if a == axis]):
            factor_sizes.append(factor)
            factor_keys.append((axis, key))
    if math.prod(factor_sizes) != math.prod(size for _, size in axes):
        raise StarscreamError(f"mesh replica groups {text[:80]!r}: the sub-axes do not divide their mesh axes; the "
                              "text is damaged")
    group_dims = [factor_keys.index((axis, pre)) for axis, pre, _ in grouped]
    other_dims = [i for i in range(len(factor_keys)) if i not in group_dims]
    ids = _mesh_device_ids(match.group(2), math.prod(factor_sizes), text)
    ordered = ids.reshape(factor_sizes).transpose(other_dims + group_dims)
    return ordered.reshape(-1, math.prod(factor_sizes[i] for i in group_dims)).tolist()


def _axis_factors(size: int, subaxes: list[tuple[int | None, int | None]]) -> list[tuple[int, object]]:
    """Split one mesh axis into factors, major first, each with a key: a grouped sub-axis is keyed by its pre-size,
    a whole grouped axis by None, and the ungrouped rest by ("rest", position), which matches no group axis."""
    if not subaxes or any(pre is None for pre, _ in subaxes):
        return [(size, None)]
    factors: list[tuple[int, object]] = []
    covered = 1
    for pre, sub in sorted(subaxes):
        if pre > covered:
            factors.append((pre // covered, ("rest", len(factors))))
        factors.append((sub, pre))
        covered = pre * sub
    if covered < size:
        factors.append((size // covered, ("rest", len(factors))))
    return factors


def _mesh_device_ids(ids_text: str | None, count: int, text: str) -> np.ndarray:
    """The mesh's `count` devices as partition ids, from its `device_ids=` text (None: 0..count-1)."""
    if ids_text is None:
        return np.arange(count)
    ids_text = ids_text.strip()
    if ids_text.startswith("["):
        reshape, _, transpose = ids_text[1:].partition("]")
        ids = _iota_ids(_numbers(reshape), _numbers(transpose.strip("T()")) or None, text).reshape(-1)
    else:
        ids = np.array(_numbers(ids_text))
    if ids.size != count:
        raise StarscreamError(f"mesh replica groups {text[:80]!r} list {ids.size} device ids for a mesh of {count} "
                              "devices; the text is damaged")
    return ids


def _dot_numbers(inst: _Instruction) -> dict[str, list[int]]:
    """Dot dimension numbers, from the instruction's attributes or, for a gemm custom-call, its backend_config."""
    if inst.opcode == "custom-call":
        numbers = _backend_config(inst.attrs)["gemm_backend_config"]["dot_dimension_numbers"]
        return {key.removesuffix("ensions") + "s": [int(v) for v in value] for key, value in numbers.items()}
    keys = ("lhs_batch_dims", "lhs_contracting_dims", "rhs_batch_dims", "rhs_contracting_dims")
    found = {key: re.search(rf"\b{key}=\{{([\d,]*)\}}", inst.attrs) for key in keys}
    return {key: _numbers(match.group(1)) if match else [] for key, match in found.items()}


def _dot_dims(numbers: dict[str, list[int]], lhs: ArrayShape, rhs: ArrayShape) -> tuple[int, int, int, int, int]:
    """(batch, M, K, N, split_k) of a dot; a batch dim that XLA's split-K inserted is folded back into K.

    Split-K cuts K into (split, K / split) and makes the split a batch dim: it stands just before a contracting dim
    in both operands, and after a free dim in at least one of them (the activations' tokens, or the weight's other
    dim when XLA puts the weight first). A batch dim of the source op stands first in both operands.
    """
    lhs_batch, lhs_contract = numbers["lhs_batch_dims"], numbers["lhs_contracting_dims"]
    rhs_batch, rhs_contract = numbers["rhs_batch_dims"], numbers["rhs_contracting_dims"]
    lhs_free = [i for i in range(len(lhs.dims)) if i not in lhs_batch + lhs_contract]
    rhs_free = [i for i in range(len(rhs.dims)) if i not in rhs_batch + rhs_contract]
    split_k = 1
    for lhs_dim, rhs_dim in zip(lhs_batch, rhs_batch):
        is_split = (
            lhs_dim + 1 in lhs_contract
            and rhs_dim + 1 in rhs_contract
            and (any(free < lhs_dim for free in lhs_free) or any(free < rhs_dim for free in rhs_free))
        )
        split_k *= lhs.dims[lhs_dim] if is_split else 1
    batch = math.prod(lhs.dims[i] for i in lhs_batch) // split_k
    k = math.prod(lhs.dims[i] for i in lhs_contract) * split_k
    m = math.prod(lhs.dims[i] for i in lhs_free)
    n = math.prod(rhs.dims[i] for i in rhs_free)
    return batch, m, k, n, split_k


def _convolution_dims(attrs: str, lhs: ArrayShape, rhs: ArrayShape) -> tuple[int, int, int, int, int] | None:
    """(batch, M, K, N, 1) of a convolution that is a matmul (1x1 window, no groups); None for a real convolution."""
    window = re.search(r"\bwindow=\{size=([\dx]+)", attrs)
    grouped = re.search(r"\b(?:feature|batch)_group_count=(\d+)", attrs)
    labels = re.search(r"\bdim_labels=(\w+)_(\w+)->(\w+)", attrs)
    if labels is None or (window and set(window.group(1).split("x")) != {"1"}) or (grouped and grouped.group(1) != "1"):
        return None
    lhs_labels, rhs_labels = labels.group(1), labels.group(2)
    m = math.prod(size for label, size in zip(lhs_labels, lhs.dims) if label != "f")
    k = lhs.dims[lhs_labels.index("f")]
    n = rhs.dims[rhs_labels.index("o")]
    return 1, m, k, n, 1
