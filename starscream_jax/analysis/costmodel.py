"""A cost model of one compiled step: the roofline time of every local matmul and the alpha-beta time of every
collective, from what `starscream inspect` read in the compiled program and the preset's hardware figures, scaled to
the model's full depth.

- Matmul [batch, M, K, N] on one partition: max(2 batch M K N / peak FLOP/s, bytes / HBM bytes/s), with the operands
  and result at the compute dtype. Tile and wave quantization, and every op that is not a matmul (norms, rotary,
  softmax: memory-bound and mostly fused into neighbours), are not counted: the figure is a lower bound of compute.
- Collective: the latency floor of its scope plus its ring bytes per device over the bus bandwidth of its scope. The
  preset's bandwidths are RCCL / NCCL bus bandwidths, which already fold in the ring formulas' factors. Inside a GPU
  every partition group has the GPU's fabric; across GPUs (and nodes) the X partitions of a GPU run X rings at once
  over the same links, so each gets 1/X of the GPU's bandwidth. Flat collectives get the measured flat figures
  (bandwidth and latency floor of a 64-rank ring), and so do collectives of unknown scope (the reader could not tell
  their members: they are priced as the slowest kind). Every kind is priced so, by its bytes from
  `report.ring_bytes_per_device`: an all-to-all (ragged or not) by the (p-1)/p of its (send) buffer that leaves each
  device.
- Step: `serial` (compute then communication, no overlap: an upper bound) and `overlapped` (the larger of the two:
  a lower bound). Tokens per second use the serial time.
- Measured chips: where `meshes/measured/<chip>.json` exists (H200: `scripts/measure_costmodel.py`), a matmul runs
  at the efficiency measured for the nearest measured shape (log distance in M, K, N; the shape's batch folded into
  M) instead of at peak, and a collective between GPUs at the bus bandwidth measured for its kind at the nearest
  buffer size (log-interpolated) instead of the preset's figure; `Measurements` reads the file.

The figures come from programs compiled for simulated CPU devices, which move bfloat16 as float32 and run a
reduce-scatter as an all-reduce plus a slice: communication is overstated up to 2x (4x for reduce-scatters), more
for the layouts that reduce-scatter (starscream_tp, the FSDP pair), so comparisons err against them.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
from typing import Any

import numpy as np

from ..resources import data_dir
from .report import SCOPES

LINK_SCOPES = tuple(scope for scope in SCOPES if scope != "local")
"""The scopes whose collectives cross a link (a collective of one member costs nothing)."""


@dataclasses.dataclass(frozen=True)
class LinkCost:
    """Latency floor (s) and bus bandwidth per device (bytes/s) of collectives of one scope."""

    latency: float
    bandwidth: float

    def seconds(self, bytes_per_device: float) -> float:
        return self.latency + bytes_per_device / self.bandwidth


@dataclasses.dataclass(frozen=True)
class StepEstimate:
    """Seconds of one full-depth step on one device: matmul time (and the part of it in memory-bound matmuls) and
    collective time by scope; `tokens` is what one step processes across the mesh."""

    compute_s: float
    memory_bound_s: float
    communication_s: dict[str, float]
    tokens: int

    @property
    def total_communication_s(self) -> float:
        return sum(self.communication_s.values())

    @property
    def serial_s(self) -> float:
        return self.compute_s + self.total_communication_s

    @property
    def overlapped_s(self) -> float:
        return max(self.compute_s, self.total_communication_s)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.serial_s if self.serial_s else math.inf

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "total_communication_s": self.total_communication_s,
                "serial_s": self.serial_s, "overlapped_s": self.overlapped_s, "tokens_per_s": self.tokens_per_s}


@dataclasses.dataclass(frozen=True)
class Measurements:
    """Matmul efficiency per shape (rows of m, k, n, efficiency against the chip's peak) and collective bus bandwidth
    per kind and buffer size (rows of kind, bytes, bus_bandwidth), measured on one chip."""

    matmul: tuple[tuple[int, int, int, float], ...]
    collectives: dict[str, tuple[tuple[float, float], ...]]

    def efficiency(self, m: int, k: int, n: int) -> float:
        """The measured efficiency of the nearest measured shape (log distance)."""
        target = np.log([m, k, n])
        shapes = np.log([row[:3] for row in self.matmul])
        return self.matmul[int(np.argmin(((shapes - target) ** 2).sum(axis=1)))][3]

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
                        {kind: tuple(sorted(rows)) for kind, rows in collectives.items()})


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


def matmul_work(batch: int, m: int, k: int, n: int, itemsize: int) -> tuple[int, int]:
    """(FLOPs, bytes moved) of one matmul out[batch, M, N] = lhs[batch, M, K] @ rhs[batch, K, N], with both operands
    and the result at `itemsize` bytes per element. Their ratio is the matmul's arithmetic intensity (FLOP/B)."""
    return 2 * batch * m * k * n, itemsize * batch * (m * k + k * n + m * n)


def matmul_seconds(matmul: dict[str, Any], peak_flops: float, hbm_bandwidth: float, itemsize: int,
                   measured: Measurements | None = None) -> float:
    """Roofline seconds of one run of a local matmul {"batch", "m", "k", "n"} on one partition, at the measured
    efficiency of its shape when `measured` is given."""
    flops, moved = matmul_work(matmul["batch"], matmul["m"], matmul["k"], matmul["n"], itemsize)
    if measured is not None:
        peak_flops *= measured.efficiency(matmul["batch"] * matmul["m"], matmul["k"], matmul["n"])
    return max(flops / peak_flops, moved / hbm_bandwidth)


def collective_seconds(collective: dict[str, Any], cost: LinkCost, measured: Measurements | None) -> float:
    """Seconds of one run of a collective: its ring bytes per device over the bus bandwidth measured for its kind
    and buffer size (between GPUs, where measured), else the scope's latency floor plus bytes over its bandwidth."""
    bandwidth = None
    if measured is not None and collective["scope"] != "intra_gpu":
        bandwidth = measured.bus_bandwidth(collective["kind"], collective["buffer_bytes"])
    if bandwidth is None:
        return cost.seconds(collective["bytes_per_device"])
    return max(cost.latency, collective["bytes_per_device"] / bandwidth)


def estimate_step(result: dict[str, Any], topology, itemsize: int) -> StepEstimate:
    """The StepEstimate of one layout's result from `starscream inspect` (`layout_report.layout_result`): its
    matmuls and its collectives (with their scope) with their runs in the full-depth step. `itemsize`: bytes per
    element of the compute dtype."""
    compute = memory_bound = 0.0
    measured = measurements(topology.preset.chip.name)
    for matmul in result["matmuls"]:
        seconds = matmul_seconds(matmul, topology.peak_flops, topology.hbm_bandwidth, itemsize, measured)
        compute += seconds * matmul["full_depth_runs"]
        if matmul["below_ridge"]:
            memory_bound += seconds * matmul["full_depth_runs"]
    costs = link_costs(topology)
    communication = dict.fromkeys(LINK_SCOPES, 0.0)
    for collective in result["collectives"]:
        if collective["scope"] == "local":
            continue
        scope = collective["scope"]
        communication[scope] += collective["full_depth_runs"] * collective_seconds(collective, costs[scope], measured)
    tokens = result["batch"] * (1 if result["phase"] == "decode" else result["seq"])
    return StepEstimate(compute, memory_bound, communication, tokens)
