"""The planner: a layout for each phase (train, prefill, decode), chosen with the cost model.

For each phase every candidate layout is compiled as `starscream inspect` compiles it (`layout_report.inspect_layouts`:
simulated devices, abstract inputs, a few layers) and once more one layer deeper, which gives the growth of the
compiler's temporary memory per layer. Each is then
  - estimated by `costmodel.estimate_step` (matmul rooflines + collectives, full depth),
  - sized: parameters, optimizer state and KV cache per device at full depth, plus the temporaries extrapolated to
    full depth (temp at L layers + (N - L) x growth per layer),
  - judged by the three principles, as `starscream inspect` judges them.
The plan for the phase is the layout with the shortest serial step among those that fit the partition's HBM. A layout
that cannot place the model on the mesh (a batch smaller than the devices it must split over, say) is listed with the
reason. Every layer of these models is alike, so the layout chosen for a phase is the choice for each of its layers.
The memory figures come from the CPU compile, which holds bfloat16 temporaries as float32 and stores attention's score
matrix (a fused GPU kernel does not): they overstate what a GPU needs.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from .compile import Settings, compile_step
from .layout_report import PRINCIPLES, inspect_layouts

REMAT = "+remat"
"""Suffix of a candidate that recomputes each layer's activations in the backward pass."""


def plan_phase(settings: Settings, topology, mesh) -> dict[str, Any]:
    """{"phase", "model", "batch", "seq", "hbm_per_device", "candidates": {layout: candidate}, "refused": {layout:
    reason}, "choice": the fastest layout that fits, or None}; a candidate holds the cost model's "estimate",
    "memory_per_device" at full depth, "fits", the principle verdicts ("principles": {name: ok}) and the bytes per
    device its copies over xcd hold ("copied_bytes", principle 2's figures).

    In training, a layout that does not fit is tried again with rematerialization (each layer's activations
    recomputed in the backward pass instead of kept), as the candidate "<layout>+remat"."""
    refused: dict[str, str] = {}
    candidates = _candidates(settings, topology, mesh, refused)
    too_big = tuple(name for name, candidate in candidates.items() if not candidate["fits"])
    if settings.phase == "train" and too_big and not settings.config.remat:
        remat = dataclasses.replace(settings, config=settings.config.replace(remat=True), layouts=too_big)
        candidates |= {f"{name}{REMAT}": candidate for name, candidate in _candidates(remat, topology, mesh).items()}
    fitting = [name for name, candidate in candidates.items() if candidate["fits"]]
    choice = min(fitting, key=lambda name: candidates[name]["estimate"]["serial_s"], default=None)
    return {"phase": settings.phase, "model": settings.config.name, "batch": settings.batch, "seq": settings.seq,
            "hbm_per_device": topology.hbm_bytes, "candidates": candidates, "refused": refused, "choice": choice}


def _candidates(settings: Settings, topology, mesh, refused: dict[str, str] | None = None) -> dict[str, dict]:
    """Each layout of `settings` that places the model: its estimate, memory at full depth, fit and verdicts."""
    results = inspect_layouts(settings, topology, mesh, refused)
    deeper = dataclasses.replace(settings, config=settings.config.replace(n_layers=settings.layers + 1))
    candidates = {}
    for name, result in results.items():
        compiled_temp = result["memory_per_device"]["compiled"]["temp_bytes"]
        growth = _temp_bytes(compile_step(deeper, name, mesh)) - compiled_temp
        memory = full_depth_memory(result["memory_per_device"], settings.full_layers, settings.layers, growth)
        candidates[name] = {"estimate": result["estimate"], "memory_per_device": memory,
                            "fits": memory <= topology.hbm_bytes,
                            "principles": {p: result["principles"][p]["ok"] for p in PRINCIPLES},
                            "copied_bytes": result["principles"]["no_redundancy"]["copied_bytes"]}
    return candidates


def full_depth_memory(memory: dict[str, Any], full_layers: int, compiled_layers: int, temp_per_layer: float) -> float:
    """Bytes per device at full depth: the persistent arrays (exact at full depth) plus the compiled temporaries
    extrapolated from `compiled_layers` to `full_layers` at `temp_per_layer` (never below the compiled figure)."""
    temp = memory["compiled"]["temp_bytes"] + (full_layers - compiled_layers) * max(temp_per_layer, 0.0)
    return memory["persistent"] + temp


def _temp_bytes(step) -> int:
    return step.compiled.memory_analysis().temp_size_in_bytes
