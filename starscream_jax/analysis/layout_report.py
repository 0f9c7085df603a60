"""One layout's compiled step, read and judged: the `LayoutResult` that `starscream inspect` prints and `plan` ranks.

For each layout of `Settings` (and gpu_tp, the reference for kernel shapes, compiled as well and shown only when
asked for) the step is compiled (`compile`), read (`report.inspect_compiled`) and judged (`principles`); the result
holds the verdicts, bytes by scope, memory, collectives, matmuls, inputs, activations and the cost model's estimate.

Depth: per-layer figures are what the layer loop does in one trip, and full-depth figures are (everything outside the
loop: embedding, head, loss, optimizer) + N x (per layer). Parameter, optimizer-state and KV-cache bytes per device
are exact at full depth: they come from the shardings of the N-layer model.

Principles: `principles.check_principles` against the gpu_tp program of the same phase. Norm scales (the layout's
`replicated_ok` logical names) and their optimizer moments may be replicated over xcd. For decode, principle 1 is
judged by bytes read instead of kernel shapes (`principles.reads_once_per_gpu`).

Bytes per device per step are the ring-formula bytes of `report`. "inter_gpu" counts every byte that crosses the
inter-GPU links: collectives over one partition of each GPU (of one node or of several) and flat collectives, whose
rings run through partitions of several GPUs at once, so each of their inter-GPU links carries the full per-device
volume and sets their pace; collectives of unknown scope are counted there too, since nothing shows they stay inside
a GPU. "flat" is the flat part alone, "unknown" the unknown part.

The CPU backend computes and moves bfloat16 values as float32, and runs a reduce-scatter as an all-reduce followed by a
slice (which the reader counts as an all-reduce), so collective bytes and compiled memory are up to twice what a
bfloat16 program moves on a GPU, and gradient reduce-scatters up to four times; layouts are compared like for like.
Kernel intensity is taken from each local matmul's shape at the model's compute dtype, a projection's 8-bit weight
at its stored byte (`costmodel.matmul_work`, `eight_bit_weight`), compared with the preset's ridge point (peak FLOP/s
over HBM bytes/s of one partition).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import uuid
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from ..compiled_memory import MemoryReport
from ..errors import ShardingRuleError
from ..hardware.axes import XCD, spec_axes
from ..model.names import TOKENS
from ..model.vocabulary import padded_config
from ..resources import data_dir
from ..sharding.apply import activation_spec, use_layout
from ..sharding.layouts import get_layout, positions_multiple
from .compile import (
    REFERENCE,
    CompiledStep,
    DecodeArgs,
    PagedArgs,
    PrefillArgs,
    Settings,
    abstract_args,
    abstract_cache,
    cache_length,
    compile_step,
)
from .costmodel import StepEstimate, estimate_step, matmul_work
from .json_form import from_json, to_json
from .memory import held_bytes, memory_passes, reads_cache_in_place
from .principles import NO_REFERENCE, Principles, arrays_named_by, check_principles, reads_once_per_gpu
from .hlo import Matmul
from .report import SCOPES, ActivationReport, CollectiveReport, InputReport, inspect_compiled, matmul_key

SKIPPED = (f"{REFERENCE}, the reference of kernel shapes, was not compiled (the planner judges principles 2 and 3 "
           "only, to halve its compiles); `starscream inspect` compiles it and judges principle 1")
"""Why a result the planner compiled has principle 1 not judged."""


def inspect_layouts(settings: Settings, topology, mesh, refused: dict[str, str] | None = None,
                    cache: ResultCache | None = None, reference: bool = True) -> dict[str, LayoutResult]:
    """Compile every layout of `settings` and gpu_tp on `mesh`; {layout name: result} (see `layout_result`).

    A layout that cannot place the model on the mesh raises its ShardingRuleError, unless `refused` is given: then
    the error's message is recorded there under the layout's name and the layout left out. When gpu_tp, the
    reference of principle 1, cannot place the model either, the others are still compiled and judged by principles
    2 and 3 only; `reference=False` skips compiling it (the planner's choice: half the compiles). Either way
    principle 1 is then not judged, and its verdict says why (`KernelVerdict.not_judged`). `cache` returns results
    compiled before for the same settings and mesh without compiling again, and keeps the new ones; with
    `reference`, a cached result never compared with gpu_tp (one the planner kept) is compiled and judged again,
    so a principle skipped once is never shown as passing. With `settings.dump_hlo` every layout is compiled, the
    cache aside, so that each one's program is written. For prefill, decode and serve the model's vocabulary is
    padded as inference loads it (`vocabulary.padded_config`), to rows every layout compiled here splits alike."""
    if settings.phase != "train":
        settings = dataclasses.replace(settings, config=padded_config(settings.config, [*settings.layouts, REFERENCE],
                                                                      mesh))
    results = {}
    if settings.dump_hlo is not None:
        cache = None
    for name in settings.layouts:
        cached = cache.get(settings, topology, mesh, name) if cache is not None else None
        if cached is not None and (cached.principles.shape_preservation.compared or not reference):
            results[name] = cached
    missing = [name for name in settings.layouts if name not in results]
    if not missing:
        return results
    steps = {}
    no_reference = SKIPPED
    for name in dict.fromkeys((*missing, REFERENCE) if reference else missing):
        try:
            steps[name] = compile_step(settings, name, mesh)
        except ShardingRuleError as err:
            if refused is None:
                raise
            if name in missing:
                refused[name] = str(err)
            if name == REFERENCE:
                no_reference = f"{REFERENCE}, the reference of kernel shapes, cannot place the model: {err}"
    if settings.dump_hlo is not None:
        settings.dump_hlo.mkdir(parents=True, exist_ok=True)
        for name, step in steps.items():
            (settings.dump_hlo / f"{name}_{settings.phase}.hlo.txt").write_text(step.compiled.as_text())
    reports = {name: inspect_compiled(step.compiled, mesh, args=step.args, gpus_per_node=topology.gpus_per_node,
                                      lowered_text=step.lowered_text, token_dims=step_tokens(settings, step, mesh),
                                      outputs=step.outputs,
                                      tokens_per_device=tokens_per_device(step.layout, mesh,
                                                                          step_tokens(settings, step, mesh)))
               for name, step in steps.items()}
    for name in missing:
        if name in steps:
            results[name] = layout_result(settings, topology, mesh, steps[name], reports[name], reports.get(REFERENCE),
                                          no_reference)
            if cache is not None:
                cache.put(settings, topology, mesh, name, results[name])
    return {name: results[name] for name in settings.layouts if name in results}


@functools.cache
def _source_digest() -> str:
    """A digest of the package's source and the hardware data (presets, measurements): a cached result never
    outlives a change to the code or the figures that produced it."""
    digest = hashlib.sha256()
    package = sorted(Path(__file__).resolve().parent.parent.rglob("*.py"))
    for path in package + sorted(path for path in data_dir("meshes").rglob("*") if path.is_file()):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _canonical(value) -> list | str:
    """A key's value JSON cannot write, the same in every process: sets sorted (their order follows the process's
    string hashing), anything else as text."""
    return sorted(value) if isinstance(value, (set, frozenset)) else str(value)


class ResultCache:
    """Results of `layout_result` kept as JSON files in `directory`, one per (model, compiled depth, phase, shapes,
    remat policy, decode cache form (paged or not), training and sampling settings, preset, mesh shape, layout rules,
    package and JAX versions): a second `plan`, or an `inspect` of a planned candidate, reads them instead of
    compiling."""

    def __init__(self, directory: Path | str):
        self.directory = Path(directory)

    def _path(self, settings: Settings, topology, mesh, layout: str) -> Path:
        key = json.dumps({"config": dataclasses.asdict(settings.config), "full_layers": settings.full_layers,
                          "phase": settings.phase, "batch": settings.batch, "seq": settings.seq,
                          "cache": settings.cache, "cache_per_layer": settings.holds_cache_per_layer,
                          "paged": settings.paged,
                          "training": dataclasses.asdict(settings.training),
                          "sampling": dataclasses.asdict(settings.sampling), "topology": topology.describe(),
                          "mesh": dict(mesh.shape), "layout": dataclasses.asdict(get_layout(layout)),
                          "reference": dataclasses.asdict(get_layout(REFERENCE)), "source": _source_digest(),
                          "jax": jax.__version__},
                         sort_keys=True, default=_canonical)
        return self.directory / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"

    def get(self, settings: Settings, topology, mesh, layout: str) -> LayoutResult | None:
        path = self._path(settings, topology, mesh, layout)
        return from_json(LayoutResult, json.loads(path.read_text())) if path.is_file() else None

    def put(self, settings: Settings, topology, mesh, layout: str, result: LayoutResult) -> None:
        """Writes the result whole or not at all: into a temporary file of this writer's own, then renamed over the
        entry, so that writers of the same entry at once (several `plan` processes, a test suite's workers) never
        write into one file or rename one another's."""
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self._path(settings, topology, mesh, layout)
        partial = path.with_name(f"{path.stem}.{uuid.uuid4().hex}.tmp")
        partial.write_text(json.dumps(to_json(result)))
        partial.replace(path)


def step_tokens(settings: Settings, step: CompiledStep, mesh) -> tuple[int, int]:
    """(batch, positions) of the tokens the step's model runs on: one position per sequence in decode; in prefill
    the prompt padded to a multiple of the parts the fitted layout splits it into (`steps.prefill_step`)."""
    if settings.phase == "decode":
        return settings.batch, 1
    parts = positions_multiple(step.layout, mesh) if settings.phase == "prefill" else 1
    return settings.batch, -(-settings.seq // parts) * parts


def tokens_per_device(layout, mesh, token_dims: tuple[int, int]) -> int:
    """The tokens each device's matmuls work on: the (batch, seq) tokens over the mesh axes the layout splits them
    over (read from its rules, not guessed from the matmuls' shapes, which a d_model equal to the sequence length
    would mislead)."""
    with use_layout(layout, mesh):
        spec = activation_spec(TOKENS, token_dims, "tokens")
    return math.prod(token_dims) // math.prod(mesh.shape[axis] for axis in spec_axes(spec))


@dataclasses.dataclass(frozen=True)
class Depth:
    """Scales the compiled program to the full depth: an op in the layer loop runs `compiled` times per compiled
    step and `full` times per full-depth step. `loop_ops` maps each op of the layers to the share of its work that
    is the layers' (1; less for a collective XLA combined from ops inside and outside the layers of an unrolled
    program, see `compile.layer_loop_ops`)."""

    compiled: int
    full: int
    loop_ops: dict[str, float]

    def per_layer(self, name: str, runs: float) -> float:
        """The share of `runs` (a per-step total of one op) that one layer does; 0 for an op outside the loop."""
        return runs * self.loop_ops.get(name, 0.0) / self.compiled

    def full_depth(self, name: str, runs: float) -> float:
        """`runs` of one op in the compiled step, scaled to the full-depth step."""
        share = self.loop_ops.get(name, 0.0)
        return runs * (1 - share) + runs * share * self.full / self.compiled


@dataclasses.dataclass(frozen=True)
class LayerCounts:
    """The layers compiled and the model's full depth."""

    compiled: int
    full: int


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """The mesh's axis names, outermost first, and their sizes."""

    axes: tuple[str, ...]
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinkBytes:
    """Bytes one device sends per step over the links: inter_gpu (every byte over inter-GPU links, flat and unknown
    included), intra_gpu, and the flat and unknown parts alone."""

    inter_gpu: float
    intra_gpu: float
    flat: float
    unknown: float

    @classmethod
    def of(cls, by_scope: dict[str, float]) -> LinkBytes:
        """The link totals of bytes by collective scope (`report.SCOPES`)."""
        return cls(inter_gpu=by_scope["inter_gpu"] + by_scope["inter_node"] + by_scope["flat"] + by_scope["unknown"],
                   intra_gpu=by_scope["intra_gpu"], flat=by_scope["flat"], unknown=by_scope["unknown"])


@dataclasses.dataclass(frozen=True, kw_only=True)
class BytesPerDevice(LinkBytes):
    """Bytes one device sends per full-depth step (the link totals, and `by_scope`), per layer and outside the layer
    loop."""

    by_scope: dict[str, float]
    per_layer: LinkBytes
    outside_layers: LinkBytes


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompiledMemory(MemoryReport):
    """XLA's memory analysis of the compiled program, which holds `layers` layers."""

    layers: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryPerDevice:
    """Persistent bytes per device at full depth (params, optimizer state, KV cache and their sum, from the
    shardings of the full-depth model), the preset's HBM per device, and the compiled program's memory analysis at
    the compiled depth (None when the backend gives none)."""

    params: float
    optimizer_state: float
    kv_cache: float
    persistent: float
    hbm: float
    compiled: CompiledMemory | None

    def persistent_parts(self) -> dict[str, float]:
        """{params, optimizer_state, kv_cache}: the form `memory.gpu_memory` and `memory.memory_passes` read."""
        return {"params": self.params, "optimizer_state": self.optimizer_state, "kv_cache": self.kv_cache}


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelIntensity:
    """The local matmuls' intensity at the compute `dtype` (FLOP/B): the smallest, the FLOP-weighted mean and the
    share of FLOPs below the preset's `ridge_point`, each matmul weighted by its full-depth runs (None without
    matmuls)."""

    dtype: str
    ridge_point: float
    smallest: float | None
    flop_weighted: float | None
    below_ridge_flop_share: float | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayoutResult:
    """One layout's compiled step on a mesh, read and judged (see the module): what was compiled (`layout` as asked,
    `placement` the layout that placed it, fitted to the batch where it had to be), the verdicts, bytes, memory,
    the program's collectives and matmuls with their full-depth runs, its inputs, outputs and activations, and the
    cost model's estimate of the full-depth step. `to_json` / `from_json` (`json_form`) write and read it."""

    layout: str
    placement: str
    description: str
    model: str
    preset: str
    phase: str
    paged: bool
    batch: int
    seq: int
    layers: LayerCounts
    tokens_per_device: int | None
    mesh: MeshShape
    principles: Principles
    bytes_per_device: BytesPerDevice
    collectives_per_layer: dict[str, float]
    memory_per_device: MemoryPerDevice
    kernel_intensity: KernelIntensity
    collectives: tuple[CollectiveReport, ...]
    matmuls: tuple[Matmul, ...]
    inputs: tuple[InputReport, ...]
    outputs: tuple[InputReport, ...]
    activations: tuple[ActivationReport, ...]
    estimate: StepEstimate


def layout_result(settings: Settings, topology, mesh, step: CompiledStep, report, reference,
                  no_reference: str = NO_REFERENCE) -> LayoutResult:
    """The result of one layout: settings, mesh, principles (`no_reference`: why principle 1 is not judged when
    `reference` is None), bytes, memory, collectives, matmuls, inputs, outputs, activations, and the cost model's
    estimate of the full-depth step (`costmodel.estimate_step`)."""
    itemsize = np.dtype(settings.config.dtype).itemsize
    depth = Depth(settings.layers, settings.full_layers, step.loop_ops)
    matmuls = tuple(priced_matmul(m, depth, settings.config, topology.ridge_point, report.tokens_per_device)
                    for m in report.matmuls)
    collectives = tuple(dataclasses.replace(c, in_layer_loop=c.name in step.loop_ops,
                                            full_depth_runs=depth.full_depth(c.name, c.count))
                        for c in report.collectives)
    memory = memory_per_device(settings, step.layout, mesh, report.memory, topology.hbm_bytes)
    passes = memory_passes(settings.config.replace(n_layers=settings.full_layers), step.layout, mesh, settings.phase,
                           settings.batch, step_tokens(settings, step, mesh)[1], memory.persistent_parts(),
                           settings.holds_cache_per_layer, reads_cache_in_place(topology.preset.chip,
                                                                                settings.config.dtype))
    tokens = settings.batch * (1 if settings.phase == "decode" else settings.seq)
    return LayoutResult(
        layout=step.name, placement=step.layout.name, description=step.layout.description,
        model=settings.config.name, preset=topology.preset.name, phase=settings.phase, paged=settings.paged,
        batch=settings.batch, seq=settings.seq, layers=LayerCounts(settings.layers, settings.full_layers),
        tokens_per_device=report.tokens_per_device,
        mesh=MeshShape(tuple(mesh.axis_names), tuple(mesh.devices.shape)),
        principles=principles(settings, step, report, reference, mesh.shape[XCD], no_reference),
        bytes_per_device=bytes_per_device(report.collectives, depth),
        collectives_per_layer=collectives_per_layer(report.collectives, depth),
        memory_per_device=memory,
        kernel_intensity=kernel_intensity(matmuls, topology.ridge_point, settings.config.dtype),
        collectives=collectives, matmuls=matmuls, inputs=tuple(report.inputs), outputs=tuple(report.outputs),
        activations=tuple(report.activations),
        estimate=estimate_step(matmuls, collectives, topology, itemsize, passes, phase=settings.phase,
                               tokens=tokens, full_layers=settings.full_layers))


def bytes_per_device(collectives, depth: Depth) -> BytesPerDevice:
    """Bytes one device sends per step, at full depth (the link totals and by scope), per layer and outside the
    layer loop."""
    full, per_layer = dict.fromkeys(SCOPES, 0.0), dict.fromkeys(SCOPES, 0.0)
    for collective in collectives:
        sent = collective.bytes_per_device * collective.count
        full[collective.scope] += depth.full_depth(collective.name, sent)
        per_layer[collective.scope] += depth.per_layer(collective.name, sent)
    outside = {scope: full[scope] - depth.full * per_layer[scope] for scope in SCOPES}
    return BytesPerDevice(**dataclasses.asdict(LinkBytes.of(full)), by_scope=full,
                          per_layer=LinkBytes.of(per_layer), outside_layers=LinkBytes.of(outside))


def collectives_per_layer(collectives, depth: Depth) -> dict[str, float]:
    """How many collectives of each scope one layer runs (per step)."""
    counts = dict.fromkeys(SCOPES, 0.0)
    for collective in collectives:
        counts[collective.scope] += depth.per_layer(collective.name, collective.count)
    return counts


def memory_per_device(settings: Settings, layout, mesh, compiled_memory: MemoryReport | None,
                      hbm_bytes: float) -> MemoryPerDevice:
    """Persistent bytes per device at full depth (params, optimizer state, KV cache, from the shardings of the
    full-depth model) and the compiled program's memory analysis at the compiled depth."""
    full_model = settings.config.replace(n_layers=settings.full_layers)
    length = cache_length(settings, layout, mesh)
    with use_layout(layout, mesh):
        _, args = abstract_args(full_model, layout, mesh, settings.phase, settings.batch, settings.seq,
                                settings.training, length)
    cache = None if settings.phase == "train" else abstract_cache(full_model, layout, mesh, settings.batch, length)
    groups = {"params": args.params, "optimizer_state": getattr(args, "opt_state", None), "kv_cache": cache}
    persistent = {name: held_bytes(tree) for name, tree in groups.items()}
    compiled = None if compiled_memory is None else CompiledMemory(**dataclasses.asdict(compiled_memory),
                                                                   layers=settings.layers)
    return MemoryPerDevice(**persistent, persistent=sum(persistent.values()), hbm=hbm_bytes, compiled=compiled)


def priced_matmul(matmul: Matmul, depth: Depth, config, ridge_point: float,
                  tokens_per_device: int | None = None) -> Matmul:
    """One local matmul as a layout's result holds it: its bytes and intensity at the compute dtype of `config`
    (a ModelConfig), the 8-bit weight of a projection that reads one at its stored byte (`eight_bit_weight`),
    below the preset's ridge point or not, whether it runs in the layer loop and its runs in the full-depth step."""
    weight = eight_bit_weight(matmul, config, tokens_per_device)
    flops, moved = matmul_work(matmul.batch, matmul.m, matmul.k, matmul.n, np.dtype(config.dtype).itemsize,
                               weight, np.dtype(config.weight_format).itemsize if weight else None)
    intensity = flops / moved
    return dataclasses.replace(matmul, dtype=config.dtype, bytes=moved, intensity=intensity,
                               below_ridge=intensity < ridge_point, in_layer_loop=matmul.name in depth.loop_ops,
                               full_depth_runs=depth.full_depth(matmul.name, matmul.count))


EIGHT_BIT_SCOPES = ("qkv", "o", "gate_up", "down")
"""The named scopes (`model.decoder`) of the matmuls that read a layer's 8-bit weight (`ModelConfig.weight_format`)
as stored; a mixture's experts are dequantized before their matmuls, so only qkv and o count there."""


def eight_bit_weight(matmul: Matmul, config, tokens_per_device: int | None) -> int:
    """The elements of the 8-bit weight `matmul` reads (0 for none): a projection of EIGHT_BIT_SCOPES under
    `config.weight_format`, whose free dimension of `tokens_per_device` rows (M or N) tells the activation from the
    weight [K, the other]; 0 where neither holds the tokens."""
    scopes = EIGHT_BIT_SCOPES if not config.n_experts else EIGHT_BIT_SCOPES[:2]
    named = set(matmul_key(matmul.op_name)[0].split("/"))
    if not config.weight_format or not named & set(scopes) or tokens_per_device is None:
        return 0
    if matmul.m == tokens_per_device:
        return matmul.k * matmul.n
    return matmul.k * matmul.m if matmul.n == tokens_per_device else 0


def kernel_intensity(matmuls: tuple[Matmul, ...], ridge_point: float, dtype: str) -> KernelIntensity:
    """Smallest and FLOP-weighted intensity of the local matmuls and the share of their FLOPs below the ridge point,
    each matmul weighted by its runs in the full-depth step."""
    weights = [m.flops * m.full_depth_runs for m in matmuls]
    total = sum(weights)
    return KernelIntensity(
        dtype=dtype, ridge_point=ridge_point, smallest=min((m.intensity for m in matmuls), default=None),
        flop_weighted=sum(w * m.intensity for w, m in zip(weights, matmuls)) / total if total else None,
        below_ridge_flop_share=sum(w for w, m in zip(weights, matmuls) if m.below_ridge) / total if total else None)


def principles(settings: Settings, step: CompiledStep, report, reference, partitions: int,
               no_reference: str = NO_REFERENCE) -> Principles:
    """The three verdicts. Replicated inputs are allowed for parameters (and their optimizer state) whose logical
    names include one of the layout's `replicated_ok` names. A copy of the layer stack (the weights with a `layers`
    axis, their optimizer state, the KV cache) is large against what the layer stack holds, any other against the
    compiled step's working set (see `check_principles`). Decode judges principle 1 by bytes read
    (`reads_once_per_gpu`) instead of kernel shapes."""
    allowed = arrays_named_by(named_variables(step), step.layout.replicated_ok)
    verdicts = check_principles(report, reference, replicated_ok=allowed, layer_stack=layer_stack_names(step),
                                no_reference=no_reference)
    if settings.phase == "decode" and reference is not None:
        verdicts = dataclasses.replace(verdicts, shape_preservation=reads_once_per_gpu(
            report.matmuls, reference.matmuls, partitions, report.kernels, reference.kernels))
    return verdicts


def layer_stack_names(step: CompiledStep) -> set[str]:
    """Input and output names (as the report writes them) of the arrays stacked over the layers: the nnx Variables
    with a `layers` axis (weights, their optimizer state) and the KV cache a decode step reads and a prefill or
    decode step returns."""
    names = arrays_named_by(named_variables(step), frozenset({"layers"}))
    written = {DecodeArgs: 1, PrefillArgs: 1, PagedArgs: 2}.get(type(step.args))  # the output holding the cache
    caches = {"cache": getattr(step.args, "cache", None),
              f"output/{written}": None if written is None else step.outputs[written],
              "pages": getattr(step.args, "pages", None)}
    for prefix, cache in caches.items():
        for path, _ in jax.tree_util.tree_flatten_with_path(cache)[0] if cache is not None else []:
            names.add(prefix + "/" + jax.tree_util.keystr(path, simple=True, separator="/"))
    return names


def named_variables(step: CompiledStep) -> list[tuple[str, nnx.Variable]]:
    """(array name, variable) of each array of every nnx Variable in the step's arguments and outputs, named as the
    report names its inputs and outputs (the path in the arguments; "output/" and the path in the outputs)."""
    def is_variable(node) -> bool:
        return isinstance(node, nnx.Variable)

    named = []
    for prefix, tree in (("", step.args), ("output/", step.outputs)):
        for path, node in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_variable)[0]:
            if is_variable(node):
                named += [(prefix + jax.tree_util.keystr((*path, *inner), simple=True, separator="/"), node)
                          for inner, _ in jax.tree_util.tree_flatten_with_path(node)[0]]
    return named
