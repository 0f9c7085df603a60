"""`starscream plan`: choose a layout for each phase (train, prefill, decode) with the cost model.

For each phase every candidate layout is compiled as `starscream inspect` compiles it (simulated devices, abstract
inputs, a few layers) and once more one layer deeper, which gives the growth of the compiler's temporary memory per
layer. Each is then
  - estimated by `costmodel.estimate_step` (matmul rooflines + collectives, full depth),
  - sized: parameters, optimizer state and KV cache per device at full depth, plus the temporaries extrapolated to
    full depth (temp at L layers + (N - L) x growth per layer),
  - judged by the three principles, as `starscream inspect` judges them.
The plan for the phase is the layout with the shortest serial step among those that fit the partition's HBM. A layout
that cannot place the model on the mesh (a batch smaller than the devices it must split over, say) is listed with the
reason. Every layer of these models is alike, so the layout chosen for a phase is the choice for each of its layers.
The memory figures come from the CPU compile, which holds bfloat16 temporaries as float32 and stores attention's score
matrix (a fused GPU kernel does not): they overstate what a GPU needs; see `inspect_command`.

This module imports jax only inside functions: the command line sets up the simulated devices before jax starts.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from starscream_jax.errors import StarscreamError
from starscream_jax.inspect_command import (
    DEFAULT_GPUS, DEFAULT_LAYERS, DEFAULT_MODEL, DEFAULT_PRESET, PHASES, PRINCIPLES, Settings, compile_step,
    inspect_layouts, make_settings,
)
from starscream_jax.mesh import add_mesh_arguments, mesh_from_args, prepare_simulation

ALL_LAYOUTS = "flat_tp,gpu_tp,starscream_tp,starscream_decode,flat_fsdp,starscream_fsdp,flat_cp,starscream_cp"
REASON_WIDTH = 100
REMAT = "+remat"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `starscream plan`: the (simulated) mesh, model, phases, candidate layouts, shapes, output."""
    add_mesh_arguments(parser, default_preset=DEFAULT_PRESET, default_gpus=DEFAULT_GPUS, default_simulate=True)
    group = parser.add_argument_group("planning")
    group.add_argument("--model", default=DEFAULT_MODEL, help="model configuration: a name in models/ or a TOML path")
    group.add_argument("--phases", default=",".join(PHASES), help="comma-separated phases to plan")
    group.add_argument("--layout", default=ALL_LAYOUTS, help="comma-separated candidate layouts (default: all)")
    group.add_argument("--batch", type=int, default=None,
                       help="sequences per step, every phase (default: 8 for train and prefill, 64 for decode)")
    group.add_argument("--seq", type=int, default=None,
                       help="tokens per sequence, every phase (default: 2048 train, 4096 prefill, 8192 decode)")
    group.add_argument("--layers", type=int, default=DEFAULT_LAYERS, help="layers to compile (at least 2)")
    group.add_argument("--json", action="store_true", help="print one JSON object with a key per phase")


def run(args: argparse.Namespace) -> int:
    """`starscream plan`: plan every phase asked for and print the table (or JSON). Returns 0."""
    if not args.simulate:
        raise StarscreamError("--no-simulate given, but plan always compiles on simulated CPU devices; drop "
                              "--no-simulate (the preset supplies the hardware figures)")
    phases = [phase.strip() for phase in args.phases.split(",") if phase.strip()]
    unknown = [phase for phase in phases if phase not in PHASES]
    if unknown or not phases:
        raise StarscreamError(f"--phases {args.phases!r}: expected some of {', '.join(PHASES)}, separated by commas")
    prepare_simulation(args)
    topology, mesh = mesh_from_args(args)
    plans = {phase: plan_phase(make_settings(args.model, phase, args.batch, args.seq, args.layout, args.layers),
                               topology, mesh)
             for phase in phases}
    print(json.dumps(plans, indent=2) if args.json else format_plans(plans))
    return 0


def plan_phase(settings: Settings, topology, mesh) -> dict[str, Any]:
    """{"phase", "model", "batch", "seq", "hbm_per_device", "candidates": {layout: candidate}, "refused": {layout:
    reason}, "choice": the fastest layout that fits, or None}; a candidate holds the cost model's "estimate",
    "memory_per_device" at full depth, "fits" and the principle verdicts ("principles": {name: ok}).

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
                            "principles": {p: result["principles"][p]["ok"] for p in PRINCIPLES}}
    return candidates


def full_depth_memory(memory: dict[str, Any], full_layers: int, compiled_layers: int, temp_per_layer: float) -> float:
    """Bytes per device at full depth: the persistent arrays (exact at full depth) plus the compiled temporaries
    extrapolated from `compiled_layers` to `full_layers` at `temp_per_layer` (never below the compiled figure)."""
    temp = memory["compiled"]["temp_bytes"] + (full_layers - compiled_layers) * max(temp_per_layer, 0.0)
    return memory["persistent"] + temp


def _temp_bytes(step) -> int:
    return step.compiled.memory_analysis().temp_size_in_bytes


def format_plans(plans: dict[str, dict]) -> str:
    """One table per phase (the chosen layout marked *), then the commands that use the plan."""
    from starscream_jax.metrics import format_bytes

    lines = []
    for plan in plans.values():
        lines.append(f"{plan['phase']}: {plan['model']}, batch {plan['batch']} x seq {plan['seq']}, "
                     f"{format_bytes(plan['hbm_per_device'])} HBM per device")
        header = ("  layout", "step (serial)", "matmuls", "collectives", "tokens/s", "memory/device", "principles")
        rows = [header] + [_row(name, candidate, name == plan["choice"])
                           for name, candidate in sorted(plan["candidates"].items(),
                                                         key=lambda item: item[1]["estimate"]["serial_s"])]
        widths = [max(len(row[column]) for row in rows) for column in range(len(header))]
        lines += ["  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
        lines += [f"  {name}: cannot place the model: {_clip(reason)}" for name, reason in plan["refused"].items()]
        lines.append("")
    lines.append("plan: " + ", ".join(f"{phase} {plan['choice'] or 'none fits'}" for phase, plan in plans.items()))
    commands = _commands({phase: plan["choice"] for phase, plan in plans.items()})
    lines += [f"  {command}" for command in commands]
    return "\n".join(lines)


def _row(name: str, candidate: dict, chosen: bool) -> tuple[str, ...]:
    from starscream_jax.metrics import format_bytes, format_seconds

    estimate = candidate["estimate"]
    memory = format_bytes(candidate["memory_per_device"]) + ("" if candidate["fits"] else " (too big)")
    kept = sum(candidate["principles"].values())
    return (("* " if chosen else "  ") + name, format_seconds(estimate["serial_s"]),
            format_seconds(estimate["compute_s"]), format_seconds(estimate["total_communication_s"]),
            f"{estimate['tokens_per_s']:,.0f}", memory,
            f"{kept}/{len(PRINCIPLES)}")


def _commands(choices: dict[str, str | None]) -> list[str]:
    """The command lines that use the chosen layouts."""
    commands = []
    if choices.get("train"):
        layout = choices["train"].removesuffix(REMAT)
        commands.append(f"starscream train --layout {layout}" + (" --remat" if layout != choices["train"] else ""))
    if choices.get("prefill") and choices.get("decode"):
        commands.append(f"starscream generate --prefill-layout {choices['prefill']} "
                        f"--decode-layout {choices['decode']}")
    return commands


def _clip(text: str) -> str:
    return text if len(text) <= REASON_WIDTH else text[: REASON_WIDTH - 3] + "..."
