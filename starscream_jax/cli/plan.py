"""`starscream plan`: choose a layout per phase with the cost model (`starscream_jax.analysis.plan`), print the table
of candidates for each phase and the commands that use the plan."""
from __future__ import annotations

import argparse
import json

from ..analysis.compile import PHASES, make_settings
from ..analysis.layout_report import PRINCIPLES
from ..analysis.plan import REMAT, plan_phase
from ..errors import StarscreamError
from ..model.config import load_model_config
from ..sharding.layouts import EXPERT_LAYOUTS, LAYOUTS
from .arguments import add_mesh_arguments, mesh_from_args, prepare_simulation
from .format import clip, format_bytes, format_seconds
from .inspect import DEFAULT_GPUS, DEFAULT_LAYERS, DEFAULT_MODEL, DEFAULT_PRESET

REASON_WIDTH = 100


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `starscream plan`: the (simulated) mesh, model, phases, candidate layouts, shapes, output."""
    add_mesh_arguments(parser, default_preset=DEFAULT_PRESET, default_gpus=DEFAULT_GPUS, default_simulate=True)
    group = parser.add_argument_group("planning")
    group.add_argument("--model", default=DEFAULT_MODEL,
                       help="model configuration: a name in models/, a TOML path or a Hugging Face model directory "
                            "(its config.json; no weights are read)")
    group.add_argument("--phases", default=",".join(PHASES), help="comma-separated phases to plan")
    group.add_argument("--layout", default=None, help="comma-separated candidate layouts (default: all; the expert "
                       "layouts only for a mixture-of-experts model)")
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
    layouts = candidate_layouts(args.model, args.layout)
    plans = {phase: plan_phase(make_settings(args.model, phase, args.batch, args.seq, layouts, args.layers),
                               topology, mesh)
             for phase in phases}
    print(json.dumps(plans, indent=2) if args.json else format_plans(plans))
    return 0


def candidate_layouts(model: str, layouts: str | None) -> str:
    """`layouts` as given, or by default every layout, the expert layouts only for a mixture-of-experts `model`."""
    if layouts:
        return layouts
    experts = load_model_config(model).n_experts
    return ",".join(name for name in LAYOUTS if experts or name not in EXPERT_LAYOUTS)


def format_plans(plans: dict[str, dict]) -> str:
    """One table per phase (the chosen layout marked *), then the commands that use the plan."""
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
        lines += [f"  {name}: cannot place the model: {clip(reason, REASON_WIDTH)}" for name, reason in plan["refused"].items()]
        lines.append("")
    lines.append("plan: " + ", ".join(f"{phase} {plan['choice'] or 'none fits'}" for phase, plan in plans.items()))
    commands = _commands({phase: plan["choice"] for phase, plan in plans.items()})
    lines += [f"  {command}" for command in commands]
    return "\n".join(lines)


def _row(name: str, candidate: dict, chosen: bool) -> tuple[str, ...]:
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

