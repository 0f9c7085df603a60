"""A cost model of one compiled step: the roofline time of every local matmul, the bytes of the memory-bound passes
that are not matmuls, and the alpha-beta time of every collective, from what `starscream inspect` read in the
compiled program, the model's shapes and the preset's hardware figures, scaled to the model's full depth.

- Matmul [batch, M, K, N] on one partition: max(2 batch M K N / peak FLOP/s, bytes / HBM bytes/s), with the operands
  and result at the compute dtype, an 8-bit weight at its stored byte. Tile and wave quantization are not counted.
- Memory passes: what the step moves through HBM outside the matmuls, counted from the model's shapes and the
  layout's placement of each tensor (`memory.memory_passes`), priced at the HBM rate (the measured copy rate on a
  measured chip): the layers' elementwise and reduction passes (norms, rotary, residual adds, the gated MLP's
  product: reads and writes of each, the backward twice the forward, recomputation once more), the activations
  saved for the backward, the loss over the vocabulary, the training step's casts of the float32 weights, the
  optimizer update, and the copies the program makes: a rolled layer loop copies each layer's weights out of the
  stacked arrays before its matmuls read them, and decode copies its KV cache by the program's form
  (`memory.decode_cache_copies`: XLA's attention reads a transposed copy, a stacked cache is sliced for a rolled loop
  or a library call, a rolled loop transposes the whole cache; cuDNN's attention on the per-layer cache generation
  decodes with copies nothing; read from profiles of the decode step, benchmarks/NOTES.md). On a
  measured chip each layer's elementwise passes take at least the floor of its
  small kernels (`Measurements.layer_floor`, per layer and, in training, per forward and backward's two), which
  decode at small batches reaches.
- Collective: the latency floor of its scope plus its ring bytes per device over the bus bandwidth of its scope. The
  preset's bandwidths are RCCL / NCCL bus bandwidths, which already fold in the ring formulas' factors. Inside a GPU
  every partition group has the GPU's fabric; across GPUs (and nodes) the X partitions of a GPU run X rings at once
  over the same links, so each gets 1/X of the GPU's bandwidth. Flat collectives get the measured flat figures
  (bandwidth and latency floor of a 64-rank ring), and so do collectives of unknown scope (the reader could not tell
  their members: they are priced as the slowest kind). Every kind is priced so, by its bytes from
  `report.ring_bytes_per_device`: an all-to-all (ragged or not) by the (p-1)/p of its (send) buffer that leaves each
  device.
- Step: `serial` (matmuls, memory passes, then communication, no overlap: an upper bound) and `overlapped` (the
  larger of computation and communication: a lower bound). Tokens per second use the serial time. With gradient
  accumulation (`StepEstimate.accumulated`) the step is N micro-steps (matmuls, passes and collectives: the
  compiled accumulating step reduces the gradients in every micro-step), N additions of a micro-step's gradients
  into their sum, and one optimizer update.
- Measured chips: where `meshes/measured/<chip>.json` exists (H200: `scripts/measure_costmodel.py`), a matmul above
  the ridge point runs at the efficiency measured for the nearest measured shape (log distance in M, K, N; the
  shape's batch folded into M) instead of at peak (one below it is priced by its bytes: the measured small shapes
  time a host dispatch of 35-45 us per call, not the kernel); bytes (matmuls', memory passes') move at the copy
  rate measured on the chip (`Measurements.copy_rate`) instead of the datasheet's bandwidth; a collective between
  GPUs runs at the bus bandwidth measured for its kind at the nearest buffer size (log-interpolated) instead of the
  preset's figure; `Measurements` reads the file.

The figures come from programs compiled for simulated CPU devices, which move bfloat16 as float32 and run a
reduce-scatter as an all-reduce plus a slice: communication is overstated up to 2x (4x for reduce-scatters), more
for the layouts that reduce-scatter (starscream_tp, the FSDP pair), so comparisons err against them.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Sequence

import numpy as np

from ..resources import data_dir
from .hlo import Matmul
from .report import SCOPES, CollectiveReport

LINK_SCOPES = tuple(scope for scope in SCOPES if scope != "local")
"""The scopes whose collectives cross a link (a collective of one member costs nothing)."""


@dataclasses.dataclass(frozen=True)
class LinkCost:
    """Latency floor (s) and bus bandwidth per device (bytes/s) of collectives of one scope."""

    latency: float
    bandwidth: float

    def seconds(self, bytes_per_device: float) -> float:
        return self.latency + bytes_per_device / self.bandwidth


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepEstimate:
    """Seconds of one full-depth step on one device: matmul time (and the part of it in memory-bound matmuls),
    memory passes by kind (`memory.memory_passes`, priced; "accumulate" counts only with several micro-batches)
    and collective time by scope; `tokens` is what one step
    processes across the mesh, `micro_batches` how many micro-steps it runs."""

    JSON_PROPERTIES = ("total_communication_s", "total_passes_s", "serial_s", "overlapped_s", "tokens_per_s")

    compute_s: float
    memory_bound_s: float
    communication_s: dict[str, float]
    tokens: int
    passes_s: dict[str, float] = dataclasses.field(default_factory=dict)
    micro_batches: int = 1

    @property
    def total_communication_s(self) -> float:
        return sum(self.communication_s.values())

    @property
    def total_passes_s(self) -> float:
        """The memory passes the step runs ("accumulate" only with several micro-batches)."""
        return sum(seconds for kind, seconds in self.passes_s.items()
                   if kind != "accumulate" or self.micro_batches > 1)

    @property
    def serial_s(self) -> float:
        return self.compute_s + self.total_passes_s + self.total_communication_s

    @property
    def overlapped_s(self) -> float:
        return max(self.compute_s + self.total_passes_s, self.total_communication_s)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.serial_s if self.serial_s else math.inf

    def accumulated(self, micro_batches: int) -> StepEstimate:
        """The step of `micro_batches` micro-steps like this one (a step of one micro-batch): matmuls, collectives
        and the per-micro-step passes times n, the gradients' accumulation n times, the optimizer update once."""
        if self.micro_batches != 1:
            raise ValueError("accumulated() scales the estimate of one micro-step")
        n = micro_batches
        passes = {kind: seconds * (1 if kind == "update" else n) for kind, seconds in self.passes_s.items()}
        return StepEstimate(compute_s=n * self.compute_s, memory_bound_s=n * self.memory_bound_s,
                            communication_s={scope: n * seconds for scope, seconds in self.communication_s.items()},
                            tokens=n * self.tokens,
                            passes_s=passes, micro_batches=n)


@dataclasses.dataclass(frozen=True)
class Measurements:
    """Matmul efficiency per shape (rows of m, k, n, efficiency against the chip's peak), collective bus bandwidth
    per kind and buffer size (rows of kind, bytes, bus_bandwidth; kind "copy": one device's HBM copy rate), and
    `layer_floor`, the seconds a layer's small kernels take when their bytes are negligible (None: not measured),
    measured on one chip."""

    matmul: tuple[tuple[int, int, int, float], ...]
    collectives: dict[str, tuple[tuple[float, float], ...]]
    layer_floor: float | None = None

    def efficiency(self, m: int, k: int, n: int) -> float:
        """The measured efficiency of the nearest measured shape (log distance)."""
        target = np.log([m, k, n])
        shapes = np.log([row[:3] for row in self.matmul])
        return self.matmul[int(np.argmin(((shapes - target) ** 2).sum(axis=1)))][3]

    def copy_rate(self) -> float | None:
        """Bytes read plus written per second by an elementwise pass over HBM: the rate of the largest copy measured
        (smaller copies time the host's dispatch of one call, a 35-45 us floor that kernels inside one program do
        not pay); None when the chip's file has none."""
        rows = self.collectives.get("copy")
        return max(rows)[1] if rows else None

    def bus_bandwidth(self, kind: str, buffer_bytes: float) -> float | None:
        """The bus bandwidth measured for `kind` ("all-reduce", ...), log-interpolated at `buffer_bytes` (clamped
        to the measured sizes); None for a kind not measured."""
        rows = self.collectives.get(kind)
        if not rows:
            return None
        sizes, bandwidths = zip(*rows)
        return float(np.exp(np.interp(np.log(max(buffer_bytes, 1)), np.log(sizes), np.log(bandwidths))))


@functools.cache
def measurements(chip: str) -> Measurements | None:
    """The measurements of `chip` in meshes/measured/<chip>.json, or None when it has none."""
    path = data_dir("meshes") / "measured" / f"{chip}.json"
    if not path.is_file():
        return None
    raw = json.loads(path.read_text())
    collectives: dict[str, list] = {}
    for row in raw["collectives"]:
        collectives.setdefault(row["kind"].replace("_", "-"), []).append((row["bytes"], row["bus_bandwidth"]))
    return Measurements(tuple((r["m"], r["k"], r["n"], r["efficiency"]) for r in raw["matmul"]),
                        {kind: tuple(sorted(rows)) for kind, rows in collectives.items()},
                        raw.get("layer_kernel_floor_s"))


def link_costs(topology) -> dict[str, LinkCost]:
    """LinkCost per collective scope for `topology` (a collective of one member, scope "local", costs nothing)."""
    chip, sharing = topology.preset.chip, topology.partitions_per_gpu
    return {
        "local": LinkCost(0.0, math.inf),
        "intra_gpu": LinkCost(chip.intra_gpu_latency, chip.intra_gpu_bandwidth),
        "inter_gpu": LinkCost(chip.inter_gpu_latency, chip.inter_gpu_bandwidth / sharing),
        "inter_node": LinkCost(chip.inter_node_latency, chip.inter_node_bandwidth / sharing),
        "flat": LinkCost(chip.flat_latency, chip.flat_bandwidth),
        "unknown": LinkCost(chip.flat_latency, chip.flat_bandwidth),
    }


def matmul_work(batch: int, m: int, k: int, n: int, itemsize: int, weight_elements: int = 0,
                weight_itemsize: int | None = None) -> tuple[int, int]:
    """(FLOPs, bytes moved) of one matmul out[batch, M, N] = lhs[batch, M, K] @ rhs[batch, K, N], with both operands
    and the result at `itemsize` bytes per element, except an operand of `weight_elements` (a weight stored in 8
    bits) read at `weight_itemsize`. Their ratio is the matmul's arithmetic intensity (FLOP/B)."""
    moved = itemsize * batch * (m * k + k * n + m * n)
    if weight_itemsize is not None:
        moved -= (itemsize - weight_itemsize) * batch * weight_elements
    return 2 * batch * m * k * n, moved


def matmul_seconds(matmul: Matmul, peak_flops: float, hbm_bandwidth: float, itemsize: int,
                   measured: Measurements | None = None) -> float:
    """Roofline seconds of one run of a local matmul (its batch, M, K and N) on one partition: max(FLOPs / peak,
    bytes / `hbm_bandwidth`), its bytes as priced in the stored dtypes (`layout_report.priced_matmul`: an 8-bit
    weight at 1 byte per element), else at `itemsize`; with `measured`, a matmul above the ridge point runs at the
    measured efficiency of its shape (one below it streams its bytes: the measured small shapes time the host's
    dispatch, not the kernel)."""
    return shape_seconds(matmul.batch, matmul.m, matmul.k, matmul.n, peak_flops, hbm_bandwidth, itemsize, measured,
                         moved=matmul.bytes or None)


def shape_seconds(batch: int, m: int, k: int, n: int, peak_flops: float, hbm_bandwidth: float, itemsize: int,
                  measured: Measurements | None = None, moved: int | None = None) -> float:
    """`matmul_seconds` of a matmul given by its shape ([batch, M, K] @ [batch, K, N], every operand at `itemsize`
    unless `moved` gives its bytes)."""
    flops, at_itemsize = matmul_work(batch, m, k, n, itemsize)
    moved = moved or at_itemsize
    if measured is not None and flops / moved >= peak_flops / hbm_bandwidth:
        peak_flops *= measured.efficiency(batch * m, k, n)
    return max(flops / peak_flops, moved / hbm_bandwidth)


def collective_seconds(collective: CollectiveReport, cost: LinkCost, measured: Measurements | None) -> float:
    """Seconds of one run of a collective: its ring bytes per device over the bus bandwidth measured for its kind
    and buffer size (between GPUs, where measured), else the scope's latency floor plus bytes over its bandwidth."""
    bandwidth = None
    if measured is not None and collective.scope != "intra_gpu":
        bandwidth = measured.bus_bandwidth(collective.kind, collective.buffer_bytes)
    if bandwidth is None:
        return cost.seconds(collective.bytes_per_device)
    return max(cost.latency, collective.bytes_per_device / bandwidth)


def estimate_step(matmuls: Sequence[Matmul], collectives: Sequence[CollectiveReport], topology, itemsize: int,
                  passes: dict[str, float] | None = None, *, phase: str, tokens: int,
                  full_layers: int) -> StepEstimate:
    """The StepEstimate of one layout's full-depth step (`layout_report.layout_result`): its `matmuls` and its
    `collectives` (with their scope), each with its runs in the full-depth step (`full_depth_runs`), and the step's
    memory `passes` ({kind: bytes per device}, `memory.memory_passes`); `tokens` is what one step processes across
    the mesh, `full_layers` the model's depth. `itemsize`: bytes per element of the compute dtype."""
    compute = memory_bound = 0.0
    measured = measurements(topology.preset.chip.name)
    rate = hbm_rate(topology, measured)
    passes_s = {kind: moved / rate for kind, moved in (passes or {}).items()}
    if "layers" in passes_s and measured is not None and measured.layer_floor:
        runs = full_layers * (3 if phase == "train" else 1)
        passes_s["layers"] = max(passes_s["layers"], runs * measured.layer_floor)
    for matmul in matmuls:
        seconds = matmul_seconds(matmul, topology.peak_flops, rate, itemsize, measured)
        compute += seconds * matmul.full_depth_runs
        if matmul.below_ridge:
            memory_bound += seconds * matmul.full_depth_runs
    costs = link_costs(topology)
    communication = dict.fromkeys(LINK_SCOPES, 0.0)
    for collective in collectives:
        if collective.scope == "local":
            continue
        scope = collective.scope
        communication[scope] += collective.full_depth_runs * collective_seconds(collective, costs[scope], measured)
    return StepEstimate(compute_s=compute, memory_bound_s=memory_bound, communication_s=communication, tokens=tokens,
                        passes_s=passes_s)


def hbm_rate(topology, measured: Measurements | None) -> float:
    """Bytes per second (read plus written) of a memory-bound pass on one device: the measured copy rate where the
    chip has one, else the preset's HBM bandwidth."""
    return (measured.copy_rate() if measured is not None else None) or topology.hbm_bandwidth
