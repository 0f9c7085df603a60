"""The planner: for each phase (train, prefill, decode), the fastest configuration that fits a partition's memory.

A candidate is a mesh shape, a layout and, in training, a number of gradient-accumulation micro-batches and a remat
policy:
  mesh       every factorisation of the GPUs into `data` x `gpu` (the layout's tensor / expert parallelism over
             `gpu`, data parallelism over `data`; the partitions of each GPU stay the `xcd` axis);
  layout     each layout asked for (default: all);
  heads      where a model's query heads do not split over `gpu` (Qwen2-7B: 28 heads, 4 kv heads, on 8 GPUs), the
             same candidates again with each kv head's group padded with zero heads (`model.heads.padded_heads`),
             priced beside the meshes of fewer GPUs per tensor-parallel group: the compiled step runs the zero
             heads' projections and attention, and `padding_cost` states their extra FLOPs and weight bytes;
  training   micro-batches n dividing the batch (the step runs n micro-batches of batch / n sequences, gradients
             accumulated) and remat policies none, dots, full (`model.config.REMAT_POLICIES`).
Every candidate is judged, in order, and none raises:
  cannot place   the layout cannot place the model's tensors on that mesh (the resolver's reason);
  does not fit   the GPU memory estimate (`analysis.memory.gpu_memory`: persistent state exact, activations
                 counted from shapes and placements) exceeds the partition's HBM (by how much);
  dominated      another candidate of the same mesh and layout fits with no more micro-batches and no more
                 recomputation, so it is at least as fast by the cost model (its matmuls and collectives scale with
                 the micro-batches, recomputation only adds);
  pruned         the cost model's lower bound for it (the FLOPs at peak over every device, or the bytes every device
                 must read in decode; or, once one candidate of its mesh and layout is compiled, that one's matmul
                 time scaled by recomputation) is already above the best step compiled;
  compiled       the rest, compiled as `starscream inspect` compiles them (`layout_report.inspect_layouts`, with
                 the result cache) and estimated by `costmodel.estimate_step`; with n micro-batches the step is n
                 compiled micro-steps (each one's matmuls, memory passes and collectives, the gradient reduction
                 included, as the accumulating step runs them), n additions of the micro-step's gradients into
                 their sum and one optimizer update (`StepEstimate.accumulated`).
The choice is the compiled candidate with the shortest serial step; the runner-up and every other candidate are
listed with the reason they lost. When nothing fits, `advice` says what would: more GPUs, a shorter sequence.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable

from ..errors import ShardingRuleError
from ..hardware.mesh import build_topology_mesh
from ..model.config import REMAT_POLICIES, ModelConfig
from ..model.heads import padded_heads
from ..sharding.layouts import Layout
from .compile import Settings, fitted_layout
from .json_form import to_json
from .format import format_bytes
from .layout_report import ResultCache, inspect_layouts, memory_per_device
from .memory import gpu_memory, matmul_flops

REMAT_COST = {"none": 1.0, "dots": 1.0, "full": 4 / 3}
"""Matmul work of a training step under each remat policy, relative to none: full reruns the forward (a third of
forward + backward); dots recomputes only elementwise work and attention, which the bound leaves out."""
JUDGED = ("no_redundancy", "hierarchical_collectives")
"""The principles the planner reports. Principle 1 needs gpu_tp compiled beside every candidate as its reference;
the planner skips that (half the compiles) and `starscream inspect` of the chosen candidate judges it."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Candidate:
    """One configuration: `layout` on a mesh of `data` x `gpu` GPUs (x the partitions of each), in training with
    `micro_batches` accumulated micro-batches and remat policy `remat`; `heads`: the query heads padded to this
    many (0: the model's own); `placed_as`: the name of the layout fitted to its micro-batch (`placed`), which
    `train`, `generate` and `inspect` run where the layout's batch split does not divide it ("" until fitted)."""

    layout: str
    data: int
    gpu: int
    micro_batches: int = 1
    remat: str = "none"
    heads: int = 0
    placed_as: str = ""

    @property
    def name(self) -> str:
        text = f"{self.layout} data {self.data} x gpu {self.gpu}"
        text += f" (as {self.placed_as})" if self.placed_as not in ("", self.layout) else ""
        if self.micro_batches > 1:
            text += f", {self.micro_batches} micro-batches"
        text += f", remat {self.remat}" if self.remat != "none" else ""
        return text + (f", heads padded to {self.heads}" if self.heads else "")

    def dominates(self, other: Candidate) -> bool:
        """Same mesh and layout, no more micro-batches and no more recomputation, and not the same candidate."""
        order = REMAT_POLICIES.index
        return (self != other and (self.layout, self.data, self.heads) == (other.layout, other.data, other.heads)
                and self.micro_batches <= other.micro_batches and order(self.remat) <= order(other.remat))


def divisors(count: int) -> list[int]:
    return [d for d in range(1, count + 1) if count % d == 0]


def plan_phase(settings: Settings, topology, *, cache: ResultCache | None = None,
               progress: Callable[[int, int, float], None] | None = None) -> dict[str, Any]:
    """The plan of one phase (see the module docstring) over the mesh shapes of `topology`'s GPUs and the layouts of
    `settings` (its batch, sequence and compiled depth). `progress(compiled or pruned, to judge, seconds)` is called
    as the search goes. Returns {"phase", "model", "batch", "seq", "gpus", "hbm_per_device", "candidates": [entry],
    "choice", "runner_up" (names or None), "advice": [lines], "compiled", "elapsed_s"}; an entry holds "name",
    "layout", "mesh", "micro_batches", "remat", "heads" (0, or the query heads padded to), "padding_cost" (None, or
    `padding_cost`'s figures), "status" (chosen, runner-up, slower, does not fit, cannot place,
    dominated, pruned), "reason", "memory" (the GPU estimate by component, bytes per device), "fits",
    "lower_bound_s", and when compiled "estimate" (serial_s etc., all micro-batches), "principles" and
    "copied_bytes" (what its copies over xcd hold per device, principle 2's figures)."""
    start = time.perf_counter()
    gpus = topology.gpus_per_node * topology.nodes
    meshes = {data: build_topology_mesh(topology, data=data, simulate=True)[1] for data in divisors(gpus)}
    entries = [entry for data, mesh in meshes.items() for heads in head_counts(settings.config, gpus // data)
               for layout in settings.layouts
               for entry in _sized(with_heads(settings, heads), topology, mesh,
                                   Candidate(layout=layout, data=data, gpu=gpus // data, heads=heads))]
    for entry in entries:
        if entry["heads"]:
            entry["padding_cost"] = padding_cost(settings, entry["heads"])
    fitting = [entry for entry in entries if entry["fits"]]
    for entry in fitting:
        better = next((other for other in fitting if other["candidate"].dominates(entry["candidate"])), None)
        if better is not None:
            entry.update(status="dominated", reason=f"{better['name']} fits with no more micro-batches and no more "
                                                    "recomputation")
    to_judge = [entry for entry in fitting if entry["status"] is None]
    compiled = _search(settings, topology, meshes, to_judge, cache, progress, start)
    _rank(compiled)
    choice = compiled[0]["name"] if compiled else None
    return {"phase": settings.phase, "model": settings.config.name, "dtype": settings.config.dtype,
            "batch": settings.batch, "seq": settings.seq, "gpus": gpus,
            "partitions_per_gpu": topology.partitions_per_gpu, "hbm_per_device": topology.hbm_bytes,
            "candidates": [_public(entry) for entry in entries], "choice": choice,
            "runner_up": compiled[1]["name"] if len(compiled) > 1 else None,
            "advice": [] if choice else advice(settings, topology, meshes, entries),
            "compiled": len(compiled), "elapsed_s": time.perf_counter() - start}


def head_counts(config: ModelConfig, gpu: int) -> tuple[int, ...]:
    """0 (the model's own heads), and the padded count where the query heads do not split over `gpu` GPUs. Only
    where the kv heads divide or are divided by `gpu`: otherwise each GPU's share of query heads splits some kv
    head's group unevenly whatever the group size (`model.ops` refuses it), and padding query heads cannot help."""
    kv = config.n_kv_heads
    padded = padded_heads(config, gpu)
    return (0, padded) if padded != config.n_heads and (gpu % kv == 0 or kv % gpu == 0) else (0,)


def with_heads(settings: Settings, heads: int) -> Settings:
    """`settings` with the query heads padded to `heads` (0: as they are)."""
    return dataclasses.replace(settings, config=settings.config.replace(n_heads=heads)) if heads else settings


def padding_cost(settings: Settings, heads: int) -> dict[str, float]:
    """What the zero heads add to a whole step (every device together): "extra_flops", their q and o projections
    and attention scores and mixing over `seq` positions (train: forward and backward, 3x), and "extra_param_bytes",
    their rows of wq, bq and wo at float32 in every layer. Attention counts every one of `seq` positions, as the
    compiled step's masked score matrix does. The compiled estimate already includes both."""
    config = settings.config
    extra = (heads - config.n_heads) * config.head_dim
    weights = 2 * extra * config.d_model + (extra if config.qkv_bias else 0)
    tokens = settings.batch * (1 if settings.phase == "decode" else settings.seq)
    per_token = 2 * 2 * extra * config.d_model + 2 * 2 * extra * settings.seq
    flops = per_token * tokens * settings.full_layers * (3 if settings.phase == "train" else 1)
    return {"extra_flops": float(flops), "extra_param_bytes": float(4 * weights * settings.full_layers)}


def _sized(settings: Settings, topology, mesh, base: Candidate) -> list[dict]:
    """The entries of one mesh and layout, one per micro-batch count and remat policy (train) or one, each with
    its GPU memory estimate and fit under the layout fitted to its micro-batch (`placed`), or a single "cannot
    place" entry per micro-batch count."""
    training = settings.phase == "train"
    entries = []
    full_model = settings.config.replace(n_layers=settings.full_layers)
    for micro_batches in divisors(settings.batch) if training else [1]:
        try:
            layout = placed(settings, base.layout, mesh, micro_batches)
            persistent = memory_per_device(settings, layout, mesh, None, topology.hbm_bytes).persistent_parts()
        except ShardingRuleError as err:
            entries.append(_entry(dataclasses.replace(base, micro_batches=micro_batches), "cannot place", str(err)))
            continue
        for remat in REMAT_POLICIES if training else ("none",):
            candidate = dataclasses.replace(base, micro_batches=micro_batches, remat=remat, placed_as=layout.name)
            try:
                memory = gpu_memory(full_model.replace(remat=remat), layout, mesh, settings.phase, settings.batch,
                                    settings.seq, persistent, micro_batches, settings.holds_cache_per_layer)
            except ShardingRuleError as err:
                entries.append(_entry(candidate, "cannot place", str(err)))
                break
            entry = _entry(candidate, None, "", memory=memory, fits=memory["total"] <= topology.hbm_bytes)
            entry["lower_bound_s"] = lower_bound(settings, topology, mesh, candidate, persistent)
            if not entry["fits"]:
                over = memory["total"] - topology.hbm_bytes
                entry.update(status="does not fit",
                             reason=f"needs {format_bytes(memory['total'])} of {format_bytes(topology.hbm_bytes)} "
                                    f"(over by {format_bytes(over)})")
            entries.append(entry)
    return entries


def placed(settings: Settings, layout: str, mesh, micro_batches: int, seq: int | None = None) -> Layout:
    """`layout` fitted to a micro-batch of `settings.batch / micro_batches` sequences of `seq` tokens (default the
    phase's), as `inspect` compiles it and `train` runs it (`compile.fitted_layout`: a sequence split in train and
    prefill, split-K in decode, where the layout's batch split does not divide the micro-batch)."""
    micro = dataclasses.replace(settings, batch=settings.batch // micro_batches, seq=seq or settings.seq)
    return fitted_layout(micro, layout, mesh)


def _entry(candidate: Candidate, status: str | None, reason: str, **fields) -> dict:
    return {"candidate": candidate, "name": candidate.name, "layout": candidate.layout,
            "mesh": {"data": candidate.data, "gpu": candidate.gpu}, "micro_batches": candidate.micro_batches,
            "remat": candidate.remat, "heads": candidate.heads, "padding_cost": None, "status": status,
            "reason": reason, "memory": None, "fits": False,
            "lower_bound_s": None, "estimate": None, "principles": None, "copied_bytes": None, **fields}


def lower_bound(settings: Settings, topology, mesh, candidate: Candidate, persistent: dict) -> float:
    """Seconds the cost model cannot go below for this candidate, from shapes alone: the projection and head matmuls
    each device runs (its tokens times its share of each weight at use, `memory.matmul_flops`; train 3x the
    forward, scaled by recomputation) at peak FLOP/s, and in decode at least the bytes each device must read once
    (its parameters and KV cache) at HBM bandwidth. Attention's own matmuls are left out, so the figure stays
    below the compiled estimate."""
    config = settings.config.replace(n_layers=settings.full_layers)
    rows = settings.batch // candidate.micro_batches
    layout = placed(settings, candidate.layout, mesh, candidate.micro_batches)
    flops = candidate.micro_batches * matmul_flops(config, layout, mesh, rows,
                                                   1 if settings.phase == "decode" else settings.seq)
    if settings.phase == "train":
        flops *= 3 * REMAT_COST[candidate.remat]
    compute = flops / topology.peak_flops
    reads = (persistent["params"] + (persistent["kv_cache"] or 0)) / topology.hbm_bandwidth
    return max(compute, reads) if settings.phase == "decode" else compute


def _search(settings: Settings, topology, meshes: dict, to_judge: list[dict], cache, progress, start) -> list[dict]:
    """Compile the entries in order of their lower bound, pruning those whose bound exceeds the best step found;
    returns the compiled entries."""
    compiled, remaining, best = [], list(to_judge), math.inf
    while remaining:
        entry = min(remaining, key=lambda e: _bound(e, compiled))
        remaining.remove(entry)
        bound = _bound(entry, compiled)
        if bound >= best:
            entry.update(status="pruned", reason=f"the cost model's lower bound, {bound * 1e3:.1f} ms, is above the "
                                                 f"best step found, {best * 1e3:.1f} ms")
        else:
            _compile(settings, topology, meshes[entry["candidate"].data], entry, cache)
            if entry["estimate"] is not None:
                compiled.append(entry)
                best = min(best, entry["estimate"]["serial_s"])
        if progress is not None:
            progress(len(to_judge) - len(remaining), len(to_judge), time.perf_counter() - start)
    return compiled


def _bound(entry: dict, compiled: list[dict]) -> float:
    """The entry's lower bound, raised to a compiled sibling's (same mesh and layout) matmul time scaled by
    recomputation when there is one."""
    candidate = entry["candidate"]
    siblings = [other["estimate"]["compute_s"] * REMAT_COST[candidate.remat] / REMAT_COST[other["remat"]]
                for other in compiled
                if (other["layout"], other["mesh"], other["heads"]) == (entry["layout"], entry["mesh"], entry["heads"])]
    return max([entry["lower_bound_s"], *siblings])


def _compile(settings: Settings, topology, mesh, entry: dict, cache) -> None:
    """Compile one micro-step of the entry and record its estimate for the whole step, or why it cannot place."""
    candidate = entry["candidate"]
    settings = with_heads(settings, candidate.heads)
    micro = dataclasses.replace(settings, config=settings.config.replace(remat=candidate.remat),
                                batch=settings.batch // candidate.micro_batches, layouts=(candidate.layout,))
    refused: dict[str, str] = {}
    results = inspect_layouts(micro, topology, mesh, refused, cache, reference=False)
    if candidate.layout in refused:
        entry.update(status="cannot place", reason=refused[candidate.layout])
        return
    result = results[candidate.layout]
    entry["estimate"] = to_json(result.estimate.accumulated(candidate.micro_batches))
    entry["principles"] = {name: getattr(result.principles, name).ok for name in JUDGED}
    entry["copied_bytes"] = to_json(result.principles.no_redundancy.copied_bytes)


def _rank(compiled: list[dict]) -> None:
    """Sort the compiled entries fastest first and mark them chosen, runner-up or slower (by how much)."""
    compiled.sort(key=lambda entry: entry["estimate"]["serial_s"])
    for index, entry in enumerate(compiled):
        ratio = entry["estimate"]["serial_s"] / compiled[0]["estimate"]["serial_s"]
        status = "chosen" if index == 0 else "runner-up" if index == 1 else "slower"
        entry.update(status=status, reason="" if index == 0 else f"{ratio:.2f}x the chosen step")


def _public(entry: dict) -> dict:
    return {key: value for key, value in entry.items() if key != "candidate"}


def advice(settings: Settings, topology, meshes: dict, entries: list[dict]) -> list[str]:
    """What would fit when nothing does: the smallest candidate's need, the GPUs that would hold it, and the
    longest sequence (halving) at which it fits."""
    sized = [entry for entry in entries if entry["memory"] is not None]
    if not sized:
        reasons = {entry["reason"] for entry in entries}
        return [f"no layout can place the model on any mesh of {topology.gpus_per_node * topology.nodes} GPUs; "
                f"the resolver says: {sorted(reasons)[0]}"]
    smallest = min(sized, key=lambda entry: entry["memory"]["total"])
    memory, hbm = smallest["memory"], topology.hbm_bytes
    persistent = memory["params"] + memory["optimizer_state"] + memory["kv_cache"] + memory.get("gradients", 0.0)
    transient = memory["total"] - persistent
    lines = [f"the smallest candidate, {smallest['name']}, needs {format_bytes(memory['total'])} per device of "
             f"{format_bytes(hbm)}"]
    gpus = topology.gpus_per_node * topology.nodes
    if transient < hbm:
        needed = math.ceil(gpus * persistent / (hbm - transient))
        lines.append(f"more GPUs: about {needed} GPUs would hold its parameters, optimizer state and gradients "
                     f"({format_bytes(persistent * gpus)} in all) beside its {format_bytes(transient)} of activations "
                     "per device")
    if settings.phase != "decode":
        shorter = _shorter_sequence(settings, topology, meshes[smallest["candidate"].data], smallest)
        if shorter is not None:
            lines.append(f"a shorter sequence: --seq {shorter[0]} fits ({format_bytes(shorter[1])})")
    lines.append("a smaller micro-batch: every micro-batch count down to 1 sequence was tried (see the candidates)"
                 if settings.phase == "train" else "a smaller batch: --batch fewer sequences")
    return lines


def _shorter_sequence(settings: Settings, topology, mesh, entry: dict) -> tuple[int, float] | None:
    """(seq, bytes) of the longest halving of the sequence at which `entry`'s configuration fits, or None."""
    candidate = entry["candidate"]
    full_model = settings.config.replace(n_layers=settings.full_layers, remat=candidate.remat)
    persistent = {key: entry["memory"][key] for key in ("params", "optimizer_state", "kv_cache")}
    seq = settings.seq // 2
    while seq >= 2:
        try:
            layout = placed(settings, candidate.layout, mesh, candidate.micro_batches, seq)
            memory = gpu_memory(full_model, layout, mesh, settings.phase, settings.batch, seq, persistent,
                                candidate.micro_batches, settings.holds_cache_per_layer)
        except ShardingRuleError:
            return None
        if memory["total"] <= topology.hbm_bytes:
            return seq, memory["total"]
        seq //= 2
    return None
