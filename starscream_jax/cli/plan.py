"""`starscream plan`: search mesh shapes, layouts, micro-batches and remat policies per phase
(`starscream_jax.analysis.plan`), print each phase's candidates with the reason each lost, what would fit when
nothing does, and the commands that run the plan."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
from pathlib import Path

from tqdm import tqdm

from ..analysis.compile import PHASES, SERVE, make_settings
from ..analysis.format import clip, format_bytes, format_seconds
from ..analysis.json_form import to_json
from ..analysis.plan import JUDGED, plan_phase
from ..analysis.serve_plan import ServePlan, ServeWorkload, choose_serving, price_serving, serve_batches
from ..errors import StarscreamError
from ..hardware.topology import OVERRIDE_ENV
from ..model.catalog import load_model_config
from ..sharding.layouts import EXPERT_LAYOUTS, LAYOUTS, PHASE_DEFAULTS, get_layout
from .arguments import (
    add_cache_arguments,
    add_precision_arguments,
    eight_bit_format,
    mesh_from_args,
    output_file,
    prepare_simulation,
    result_cache,
)
from .inspect import DEFAULT_LAYERS, add_study_arguments

REASON_WIDTH = 160
SHOWN_LOSERS = 12
PLANNED = (*PHASES, SERVE)
SERVE_BATCH = 256
"""The largest decode batch `--phases serve` prices unless --batch says."""
SERVE_DEFAULTS = {"tpot_ms": 50.0, "prompt": 1024, "output": 256, "prefill_layout": PHASE_DEFAULTS["prefill"]}
"""The serving workload's flags (dests) and their values when not given; only `--phases serve` reads them."""
NOTHING_FITS = 2
"""The exit status of a plan in which some phase has nothing that fits."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `starscream plan`: the (simulated) mesh, model, phases, candidate layouts, shapes, output."""
    group = add_study_arguments(parser, "planning")
    group.add_argument("--phases", default=",".join(PHASES),
                       help=f"comma-separated phases to plan, of {', '.join(PLANNED)} (serve: a serving workload "
                            "priced at a TPOT target, see --tpot-ms)")
    group.add_argument("--layout", default=None, help="comma-separated candidate layouts (default: all; the expert "
                       "layouts only for a mixture-of-experts model)")
    group.add_argument("--batch", type=int, default=None,
                       help="sequences per step, every phase (default: 8 for train and prefill, 64 for decode)")
    group.add_argument("--seq", type=int, default=None,
                       help="tokens per sequence, every phase (default: 2048 train, 4096 prefill, 8192 decode)")
    group.add_argument("--layers", type=int, default=DEFAULT_LAYERS, help="layers to compile (at least 2)")
    group.add_argument("--json", action="store_true", help="print one JSON object with a key per phase")
    group.add_argument("--plot", type=output_file, default=None, metavar="FILE.png",
                       help="draw each candidate's step time and memory, the chosen one marked")
    add_precision_arguments(group)
    add_cache_arguments(group)
    serve = parser.add_argument_group("serving workload (--phases serve; --batch is the largest decode batch priced)")
    serve.add_argument("--tpot-ms", type=float, help=f"most milliseconds per output token (default "
                                                     f"{SERVE_DEFAULTS['tpot_ms']:g})")
    serve.add_argument("--prompt", type=int, help=f"prompt tokens per request (default {SERVE_DEFAULTS['prompt']})")
    serve.add_argument("--output", type=int, help=f"output tokens per request (default {SERVE_DEFAULTS['output']})")
    serve.add_argument("--prefill-layout", help=f"layout of the prompts' prefill (default "
                                                f"{SERVE_DEFAULTS['prefill_layout']})")


def run(args: argparse.Namespace) -> int:
    """`starscream plan`: plan every phase asked for and print the tables (or JSON). Returns 0, or NOTHING_FITS
    (2) when nothing fits some phase (the tables say what would)."""
    if not args.simulate:
        raise StarscreamError("--no-simulate given, but plan always compiles on simulated CPU devices; drop "
                              "--no-simulate (the preset supplies the hardware figures)")
    if args.data_parallel != 1:
        raise StarscreamError(f"--data-parallel {args.data_parallel}: plan searches every data x gpu split of the "
                              "GPUs itself; drop --data-parallel")
    phases = [phase.strip() for phase in args.phases.split(",") if phase.strip()]
    unknown = [phase for phase in phases if phase not in PLANNED]
    if unknown or not phases:
        raise StarscreamError(f"--phases {args.phases!r}: expected some of {', '.join(PLANNED)}, separated by commas")
    refuse_other_phases_flags(args, phases)
    prepare_simulation(args)
    topology, _ = mesh_from_args(args)
    cache = result_cache(args)
    eight_bit = {"weight_format": eight_bit_format(args.quantize, topology.preset.chip),
                 "weight_scales": args.quantize_scales,
                 "kv_format": eight_bit_format(args.kv_cache, topology.preset.chip)}
    plans = {}
    for phase in phases:
        if phase == SERVE:
            plans[phase] = plan_serving(args, topology, cache, eight_bit)
            continue
        settings = make_settings(args.model, phase, args.batch, args.seq, candidate_layouts(args.model, args.layout),
                                 args.layers)
        if phase != "train":  # 8-bit weights and cache serve; training keeps float32 master weights
            settings = dataclasses.replace(settings, config=settings.config.replace(**eight_bit))
        with tqdm(desc=f"plan {phase}", unit="candidate", file=sys.stderr, dynamic_ncols=True) as bar:
            plans[phase] = plan_phase(settings, topology, cache=cache, progress=_progress(bar))
        plans[phase]["commands"] = commands(plans[phase], args, topology)
    serving = plans.pop(SERVE, None)
    generate = generate_command(plans, args, topology)
    if generate is not None:
        plans["decode"]["commands"].append(generate)
    if args.plot is not None and plans:
        from ..analysis.plots import plot_plans

        plot_plans(plans, args.plot)
    if args.json:
        print(json.dumps({**plans, **({SERVE: to_json(serving)} if serving else {})}, indent=2))
    else:
        text = [format_plans(plans)] if plans else []
        text += format_serving(serving) if serving else []
        print("\n".join(text) + (f"\nplot: {args.plot}" if args.plot and plans else ""))
    unfit = [phase for phase, plan in plans.items() if plan["choice"] is None]
    if unfit:
        print(f"starscream plan: nothing fits for {', '.join(unfit)}; the plan says what would", file=sys.stderr)
        return NOTHING_FITS
    return 0


def refuse_other_phases_flags(args: argparse.Namespace, phases: list[str]) -> None:
    """A StarscreamError for flags that only phases left out of --phases read: --seq when serve alone is planned
    (a request's positions are --prompt + --output), --quantize and --kv-cache when train alone is (training keeps
    float32 master weights and no KV cache), the serving workload's flags without serve."""
    eight_bit = [flag for flag, value in (("--quantize", args.quantize), ("--kv-cache", args.kv_cache)) if value]
    if eight_bit and phases == ["train"]:
        both = len(eight_bit) > 1
        raise StarscreamError(f"{' and '.join(eight_bit)} {'are' if both else 'is'} for inference, which --phases "
                              "train leaves out; add prefill, decode or serve to --phases, or drop "
                              f"{'them' if both else 'it'}")
    if args.seq is not None and phases == [SERVE]:
        raise StarscreamError(f"--seq {args.seq} sets the sequence of train, prefill and decode, which --phases serve "
                              "leaves out; a served request's tokens are --prompt and --output: drop --seq")
    given = [f"--{dest.replace('_', '-')}" for dest in SERVE_DEFAULTS if getattr(args, dest, None) is not None]
    if given and SERVE not in phases:
        raise StarscreamError(f"{', '.join(given)} describe the serving workload, which --phases {','.join(phases)} "
                              f"leaves out; add serve to --phases, or drop {'them' if len(given) > 1 else 'it'}")


def serve_setting(args: argparse.Namespace, dest: str):
    """The serving workload's flag `dest` as given, else its default (SERVE_DEFAULTS)."""
    value = getattr(args, dest, None)
    return SERVE_DEFAULTS[dest] if value is None else value


def plan_serving(args: argparse.Namespace, topology, cache, eight_bit: dict) -> ServePlan:
    """The serving workload of --tpot-ms, --prompt and --output priced over decode batches up to --batch
    (`analysis.serve_plan`), decode candidates the layouts that serve from a paged cache. A request longer than
    the model's max_seq_len is refused naming --prompt and --output (the serve phase reads no --seq)."""
    prompt, output, prefill_layout = (serve_setting(args, dest) for dest in ("prompt", "output", "prefill_layout"))
    workload = ServeWorkload(prompt, output, serve_setting(args, "tpot_ms"))
    longest = load_model_config(args.model).max_seq_len
    if workload.context > longest:
        raise StarscreamError(f"--prompt {prompt} + --output {output} = {workload.context} tokens per request exceed "
                              f"the model's max_seq_len {longest}; pass a --prompt and --output that sum to {longest} "
                              "or less")
    layouts = ",".join(name for name in candidate_layouts(args.model, args.layout).split(",")
                       if not get_layout(name).splits_sequence)
    if not layouts:
        raise StarscreamError(f"--layout {args.layout}: every layout named splits the sequence and cannot decode from "
                              "a paged cache; name a decode layout such as starscream_decode")
    decode = make_settings(args.model, SERVE, 1, workload.context, layouts, args.layers)
    prefill = make_settings(args.model, "prefill", 1, prompt, prefill_layout, args.layers)
    decode, prefill = (dataclasses.replace(s, config=s.config.replace(**eight_bit)) for s in (decode, prefill))
    largest = SERVE_BATCH if args.batch is None else args.batch  # --batch 0 is refused, not read as unset
    points = price_serving(decode, prefill, topology, workload, serve_batches(largest), cache)
    return choose_serving(points, workload, decode.config.name, prefill_layout)


def format_serving(plan: ServePlan) -> list[str]:
    """The serving plan's table (one row per decode batch, the chosen marked *) and its choice."""
    workload, chosen = plan.workload, plan.chosen
    lines = [f"serve: {plan.model}, {workload.prompt} prompt + {workload.output} output tokens per request, TPOT "
             f"target {workload.tpot_ms:g} ms; prefill under {plan.prefill_layout}"]
    header = ("  batch", "decode candidate", "decode step", "prefill/request", "TPOT", "output tokens/s",
              "requests/s")
    rows = [header]
    for point in plan.points:
        marker = "* " if point == chosen else "  "
        if not point.priced:
            rows.append((marker + str(point.batch), clip(point.reason, REASON_WIDTH // 2), "", "", "", "", ""))
            continue
        meets = "" if point.tpot_s <= workload.tpot_ms / 1e3 else " (over)"
        rows.append((marker + str(point.batch), point.candidate, format_seconds(point.decode_s),
                     format_seconds(point.prefill_s), format_seconds(point.tpot_s) + meets,
                     f"{point.output_tokens_per_s:,.0f}", f"{point.requests_per_s:,.2f}"))
    widths = [max(len(row[column]) for row in rows) for column in range(len(header))]
    lines += ["  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    lines.append(f"plan: serve batch {chosen.batch} under {chosen.candidate}: {chosen.requests_per_s:,.2f} requests/s, "
                 f"{chosen.output_tokens_per_s:,.0f} output tokens/s at {chosen.tpot_s * 1e3:.3g} ms per token")
    return lines


def _progress(bar):
    def update(done: int, total: int, elapsed: float) -> None:
        bar.total = total
        bar.n = done
        bar.set_postfix_str(f"{done} of {total} judged, {elapsed:.0f} s")
        bar.refresh()

    return update


def _mesh_flags(args: argparse.Namespace, topology, data: int) -> str:
    """The flags that build the planned mesh again: the topology as given (--topology, or $STARSCREAM_TOPOLOGY where
    no --preset overrode it) with the --gpus and --nodes given, else the preset with its GPUs and nodes."""
    given = args.topology or (None if args.preset else os.environ.get(OVERRIDE_ENV, "").strip() or None)
    if given:
        flags = f"--topology {shlex.quote(given)}" + (f" --gpus {args.gpus}" if args.gpus else "") + (
            f" --nodes {args.nodes}" if args.nodes else "")
    else:
        flags = f"--preset {topology.preset.name} --gpus {topology.gpus_per_node}" + (
            f" --nodes {topology.nodes}" if topology.nodes > 1 else "")
    return flags + (f" --data-parallel {data}" if data > 1 else "")


def _chosen(plan: dict) -> dict | None:
    """The fastest compiled candidate the commands can run: the chosen one; in training, where that pads the query
    heads (which `inspect` and `generate` do with --pad-heads, `train` not), the fastest with the model's own."""
    runnable = sorted((entry for entry in plan["candidates"] if entry["estimate"] is not None
                       and not (entry["heads"] and plan["phase"] == "train")),
                      key=lambda entry: entry["estimate"]["serial_s"])
    return runnable[0] if runnable else None


def _heads_flag(entry: dict) -> str:
    """--pad-heads N for a candidate whose query heads are padded to N, else nothing."""
    return f" --pad-heads {entry['heads']}" if entry["heads"] else ""


def commands(plan: dict, args: argparse.Namespace, topology) -> list[str]:
    """The command lines that run the phase's plan (train), or check it (`inspect` of the chosen candidate)."""
    chosen = _chosen(plan)
    if chosen is None:
        return []
    mesh = _mesh_flags(args, topology, chosen["mesh"]["data"])
    shape = f"--model {shlex.quote(args.model)} --layout {chosen['layout']}"  # the model as given: a name or a path
    micro = plan["batch"] // chosen["micro_batches"]
    inspect = (f"starscream inspect {mesh} {shape} --phase {plan['phase']} --batch {micro} --seq {plan['seq']}"
               + (f" --remat-policy {chosen['remat']}" if chosen["remat"] != "none" else "") + _heads_flag(chosen))
    if plan["phase"] != "train":
        return [inspect + precision_flags(args)]
    return [f"starscream train {mesh} {shape} --batch-size {plan['batch']} --seq-len {plan['seq']} --grad-accum "
            f"{chosen['micro_batches']} --remat-policy {chosen['remat']} --dtype {plan['dtype']}", inspect]


def generate_command(plans: dict, args: argparse.Namespace, topology) -> str | None:
    """`starscream generate` on the decode plan's mesh (generation runs both phases on one mesh) with the chosen
    decode layout and the fastest prefill candidate compiled on that same mesh with the same query heads (one model
    runs both phases)."""
    decode = _chosen(plans["decode"]) if "decode" in plans else None
    if decode is None or "prefill" not in plans:
        return None
    same_mesh = [entry for entry in plans["prefill"]["candidates"] if entry["estimate"] is not None
                 and (entry["mesh"], entry["heads"]) == (decode["mesh"], decode["heads"])]
    if not same_mesh:
        return None
    prefill = min(same_mesh, key=lambda entry: entry["estimate"]["serial_s"])
    return (f"starscream generate {_mesh_flags(args, topology, decode['mesh']['data'])} {_weights_flag(args.model)} "
            f"--prefill-layout {prefill['layout']} --decode-layout {decode['layout']}" + precision_flags(args)
            + _heads_flag(decode))


def _weights_flag(model: str) -> str:
    """Where `generate` reads the weights: a Hugging Face directory's own, else the checkpoints the printed train
    command writes (its default --run-dir, runs/train)."""
    if (Path(model) / "config.json").is_file():
        return f"--model-dir {shlex.quote(model)}"
    return "--checkpoint runs/train/checkpoints"


def precision_flags(args: argparse.Namespace) -> str:
    """The 8-bit flags of the plan (--quantize, --quantize-scales, --kv-cache) for the commands of its inference
    phases."""
    flags = f" --quantize {args.quantize} --quantize-scales {args.quantize_scales}" if args.quantize else ""
    return flags + (f" --kv-cache {args.kv_cache}" if args.kv_cache else "")


def candidate_layouts(model: str, layouts: str | None) -> str:
    """`layouts` as given, or by default every layout, the expert layouts only for a mixture-of-experts `model`."""
    if layouts:
        return layouts
    experts = load_model_config(model).n_experts
    return ",".join(name for name in LAYOUTS if experts or name not in EXPERT_LAYOUTS)


def format_plans(plans: dict[str, dict]) -> str:
    """One table per phase (candidates that compiled, fastest first, the chosen marked *), then why the others
    lost, advice when nothing fits, and the commands."""
    lines = []
    for plan in plans.values():
        lines += _phase_lines(plan)
    lines.append("plan: " + ", ".join(f"{phase} {plan['choice'] or 'nothing fits'}" for phase, plan in plans.items()))
    for plan in plans.values():
        lines += [f"  {command}" for command in plan.get("commands", [])]
    return "\n".join(lines)


def _phase_lines(plan: dict) -> list[str]:
    lines = [f"{plan['phase']}: {plan['model']}, batch {plan['batch']} x seq {plan['seq']} on {plan['gpus']} GPUs x "
             f"{plan['partitions_per_gpu']} partitions, {format_bytes(plan['hbm_per_device'])} HBM per device; "
             f"{plan['compiled']} compiled of {len(plan['candidates'])} candidates in {plan['elapsed_s']:.0f} s"]
    compiled = sorted((entry for entry in plan["candidates"] if entry["estimate"] is not None),
                      key=lambda entry: entry["estimate"]["serial_s"])
    header = ("  candidate", "step (serial)", "matmuls", "memory passes", "collectives", "tokens/s", "memory/device",
              "principles 2, 3")
    rows = [header] + [_row(entry) for entry in compiled]
    widths = [max(len(row[column]) for row in rows) for column in range(len(header))]
    lines += ["  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    losers = [entry for entry in plan["candidates"] if entry["estimate"] is None]
    by_status: dict[str, list[dict]] = {}
    for entry in losers:
        by_status.setdefault(entry["status"], []).append(entry)
    for status, entries in by_status.items():
        lines.append(f"  {status} ({len(entries)}):")
        lines += [f"    {entry['name']}: {clip(entry['reason'], REASON_WIDTH)}" for entry in entries[:SHOWN_LOSERS]]
        if len(entries) > SHOWN_LOSERS:
            lines.append(f"    ... and {len(entries) - SHOWN_LOSERS} more (--json lists them all)")
    if plan["advice"]:
        lines.append("  nothing fits; what would:")
        lines += [f"    {line}" for line in plan["advice"]]
    lines.append("")
    return lines


def _row(entry: dict) -> tuple[str, ...]:
    estimate = entry["estimate"]
    marker = "* " if entry["status"] == "chosen" else "  "
    cost = entry["padding_cost"]
    padding = (f" (+{cost['extra_flops']:.3g} FLOP, +{format_bytes(cost['extra_param_bytes'])} of zero heads)"
               if cost else "")
    verdicts = " ".join("ok" if entry["principles"][name] else "FAIL" for name in JUDGED)
    return (marker + entry["name"] + padding, format_seconds(estimate["serial_s"]), format_seconds(estimate["compute_s"]),
            format_seconds(estimate["total_passes_s"]), format_seconds(estimate["total_communication_s"]),
            f"{estimate['tokens_per_s']:,.0f}",
            format_bytes(entry["memory"]["total"]), verdicts)
