"""`starscream inspect`: compile layouts side by side on a simulated mesh and judge them by the three principles.

The compiling and judging live in `starscream_jax.analysis` (`layout_report.inspect_layouts`); this module parses the
arguments and prints the side-by-side table (one column per layout, then the first violations of each failed
principle; --json holds them all).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import textwrap
from pathlib import Path

from ..analysis.compile import PHASES, REFERENCE, SERVE, Settings, make_settings
from ..analysis.format import format_bytes, format_columns, format_seconds, principle_rows, violation_lines
from ..analysis.json_form import to_json
from ..analysis.layout_report import LayoutResult, inspect_layouts
from ..analysis.plan import with_heads
from ..errors import ShardingRuleError, StarscreamError
from ..hardware.presets import Chip
from ..model.config import REMAT_POLICIES
from ..model.heads import check_padded_heads, pad_heads_fix
from ..sharding.layouts import BASELINE, PHASE_DEFAULTS
from .arguments import (
    STUDY_MESH,
    add_cache_arguments,
    add_mesh_arguments,
    add_pad_heads_argument,
    add_precision_arguments,
    eight_bit_format,
    fp8_training_format,
    mesh_from_args,
    output_file,
    prepare_simulation,
    result_cache,
)

DEFAULT_LAYOUTS = {**{phase: f"{BASELINE},{layout}" for phase, layout in PHASE_DEFAULTS.items()},
                   SERVE: f"{BASELINE},{PHASE_DEFAULTS['decode']}"}
"""The layouts judged unless --layout names others: the baseline beside the phase's default (serve's step is a
decode step)."""
DEFAULT_MODEL = "llama3-70b"
DEFAULT_LAYERS = 2
LINE_WIDTH = 160


def add_study_arguments(parser: argparse.ArgumentParser, title: str):
    """The arguments `inspect` and `plan` share: the simulated mesh (STUDY_MESH unless told) and the model, the
    latter in a new group `title`, which is returned for the command's own arguments."""
    add_mesh_arguments(parser, default_preset=STUDY_MESH.preset, default_gpus=STUDY_MESH.gpus, default_simulate=True)
    group = parser.add_argument_group(title)
    group.add_argument("--model", default=DEFAULT_MODEL,
                       help="model configuration: a name in models/, a TOML path or a Hugging Face model directory "
                            "(its config.json; no weights are read)")
    return group


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `starscream inspect`: the (simulated) mesh, model, layouts, phase, shapes, output."""
    group = add_study_arguments(parser, "inspection")
    group.add_argument("--layout", default=None,
                       help=f"comma-separated layouts (default: {DEFAULT_LAYOUTS['train']}; "
                            f"{DEFAULT_LAYOUTS['decode']} for decode and serve)")
    group.add_argument("--phase", default="train", choices=(*PHASES, SERVE),
                       help="which step to compile (serve: decode as the server runs it, over a paged KV cache)")
    group.add_argument("--batch", type=int, default=None,
                       help="sequences per step (default: 8 for train and prefill, 64 for decode)")
    group.add_argument("--seq", type=int, default=None,
                       help="tokens per sequence; the KV cache length for prefill and decode (default: 2048 train, "
                            "4096 prefill, 8192 decode)")
    group.add_argument("--layers", type=int, default=DEFAULT_LAYERS,
                       help="layers to compile (at least 2); figures are scaled to the model's full depth")
    group.add_argument("--remat-policy", default="none", choices=REMAT_POLICIES,
                       help="train: what the backward pass keeps of each layer (none, dots: the matmul outputs, full)")
    group.add_argument("--fp8", action="store_true",
                       help="train: fp8 matmuls in the chip's formats (the weights gathered in 8 bits)")
    group.add_argument("--json", action="store_true", help="print one JSON object with a key per layout")
    group.add_argument("--plot", type=output_file, default=None, metavar="FILE.png",
                       help="draw, per layout, bytes moved between devices, bytes by scope and the matmuls on a "
                            "roofline")
    add_precision_arguments(group)
    add_pad_heads_argument(group)
    add_cache_arguments(group)
    group.add_argument("--dump-hlo", type=Path, default=None, metavar="DIR",
                       help="write each compiled program's HLO text to DIR")


def run(args: argparse.Namespace) -> int:
    """`starscream inspect`: compile, inspect and print a side-by-side table (or JSON). Returns 0, or 1 when
    principle 1 could not be judged, wholly or in part, for some layout (which ops, why, and the fix, on stderr)."""
    if not args.simulate:
        raise StarscreamError("--no-simulate given, but inspect always compiles on simulated CPU devices; drop "
                              "--no-simulate (the preset supplies the hardware figures)")
    prepare_simulation(args)
    topology, mesh = mesh_from_args(args)
    settings = settings_from_args(args, topology.preset.chip)
    refused: dict[str, str] = {}
    results = inspect_layouts(settings, topology, mesh, refused, result_cache(args))
    for name, reason in refused.items():
        fix = pad_heads_fix(settings.config, [name], mesh)
        refused[name] = f"{reason}; or {fix}" if fix else reason
    if not results:
        raise ShardingRuleError("no layout asked for can place the model on this mesh: " + "; ".join(
            f"{name}: {reason}" for name, reason in refused.items()))
    if args.plot is not None:
        from ..analysis.plots import plot_layouts

        plot_layouts(results, mesh, topology, args.plot)
    if args.json:
        cannot_place = {name: {"layout": name, "cannot_place": reason} for name, reason in refused.items()}
        print(json.dumps({**{name: to_json(result) for name, result in results.items()}, **cannot_place}, indent=2))
    else:
        print(format_table(results, refused) + (f"\nplot: {args.plot}" if args.plot else ""))
    return _report_unjudged(results, settings, mesh)


def _report_unjudged(results: dict[str, LayoutResult], settings: Settings, mesh) -> int:
    """1, after saying on stderr, one line per layout, for which layouts principle 1 was not judged or judged only
    in part (`KernelVerdict.ok` None: a verdict that failed stands, and is printed as FAIL), which ops, why and how
    to judge them; else 0."""
    unjudged = {name: result.principles.shape_preservation.not_judged for name, result in results.items()
                if not result.principles.shape_preservation.judged}
    fix = pad_heads_fix(settings.config, [REFERENCE], mesh)
    for name, reason in unjudged.items():
        print(f"starscream inspect: principle 1 (kernel shapes) was not judged for {name}: {reason}"
              + (f"; to judge it, {fix}" if fix else ""), file=sys.stderr)
    return 1 if unjudged else 0


def settings_from_args(args: argparse.Namespace, chip: Chip) -> Settings:
    """The checked Settings of the parsed arguments, 8-bit weights and cache (inference phases only: training keeps
    float32 master weights) or fp8 training matmuls in `chip`'s formats."""
    settings = make_settings(args.model, args.phase, args.batch, args.seq,
                             args.layout or DEFAULT_LAYOUTS[args.phase], args.layers, args.dump_hlo)
    if (args.quantize or args.kv_cache) and args.phase == "train":
        raise StarscreamError("--quantize and --kv-cache are for inference; inspect them with --phase prefill or "
                              "--phase decode")
    if args.remat_policy != "none" and args.phase != "train":
        raise StarscreamError(f"--remat-policy {args.remat_policy} sets what training's backward pass keeps; "
                              f"{args.phase} has no backward pass: inspect it with --phase train or leave it out")
    if args.fp8 and args.phase != "train":
        raise StarscreamError(f"--fp8 is fp8 training; inspect it with --phase train (or --quantize fp8 for "
                              f"{args.phase})")
    if args.pad_heads:
        check_padded_heads(settings.config, args.pad_heads)
    config = settings.config.replace(remat=args.remat_policy, weight_format=eight_bit_format(args.quantize, chip),
                                     weight_scales=args.quantize_scales, kv_format=eight_bit_format(args.kv_cache, chip),
                                     matmul_format=fp8_training_format(chip) if args.fp8 else "")
    return with_heads(dataclasses.replace(settings, config=config), args.pad_heads)


def _figure(value: float | None, form: str) -> str:
    """`value` in `form` ("{:.0f}"), or "-" when there is none (a program without matmuls)."""
    return "-" if value is None else form.format(value)


def _rows(result: LayoutResult) -> list[tuple[str, str]]:
    """(label, cell) rows of one layout's column."""
    full, compiled_layers = result.layers.full, result.layers.compiled
    memory, sent = result.memory_per_device, result.bytes_per_device
    intensity, estimate, verdicts = result.kernel_intensity, result.estimate, result.principles
    counts = {**result.collectives_per_layer}
    counts["inter_gpu"] += counts["inter_node"]
    phase = result.phase
    rows = [("memory per device", "")]
    rows.append((f"  params{' + optimizer' if phase == 'train' else ''} ({full} layers)",
                 format_bytes(memory.params + memory.optimizer_state)))
    if phase != "train":
        rows.append((f"  KV cache ({full} layers)", format_bytes(memory.kv_cache)))
    if memory.compiled is not None:
        rows.append((f"  compiled temp ({compiled_layers} layers)", format_bytes(memory.compiled.temp_bytes)))
    copied = [entry.shard_bytes for entry in result.activations if entry.replication_xcd > 1]
    rows.append(("  largest activation copied over xcd", format_bytes(max(copied)) if copied else "none"))
    redundancy = verdicts.no_redundancy
    rows.append(("  activation copies (large above)", f"{format_bytes(redundancy.copied_bytes.activations)} "
                 f"({format_bytes(redundancy.threshold_bytes)})"))
    rows += [
        ("bytes per device per step", ""),
        ("  inter-GPU per layer", format_bytes(sent.per_layer.inter_gpu)),
        ("    of which flat", format_bytes(sent.per_layer.flat)),
        ("  intra-GPU per layer", format_bytes(sent.per_layer.intra_gpu)),
        (f"  inter-GPU, {full} layers", format_bytes(sent.inter_gpu)),
        (f"  intra-GPU, {full} layers", format_bytes(sent.intra_gpu)),
        ("collectives per layer", " / ".join(f"{counts[scope]:g}"
                                             for scope in ("intra_gpu", "inter_gpu", "flat", "unknown"))),
        (f"kernel intensity ({intensity.dtype}, FLOP/B)", ""),
        ("  smallest", _figure(intensity.smallest, "{:.0f}")),
        ("  FLOP-weighted", _figure(intensity.flop_weighted, "{:.0f}")),
        (f"  FLOPs below ridge ({intensity.ridge_point:.0f})", _figure(intensity.below_ridge_flop_share, "{:.1%}")),
        ("estimated step, full depth", ""),
        ("  matmuls (roofline)", format_seconds(estimate.compute_s)),
        ("  memory passes", format_seconds(estimate.total_passes_s)),
        ("  collectives", format_seconds(estimate.total_communication_s)),
        ("  serial / overlapped", f"{format_seconds(estimate.serial_s)} / {format_seconds(estimate.overlapped_s)}"),
        ("  tokens/s (serial)", f"{estimate.tokens_per_s:,.0f}"),
        ("principles", ""),
        *principle_rows(verdicts, decode=phase == "decode"),
    ]
    return rows


def _header(result: LayoutResult) -> list[str]:
    """What was compiled: model, preset, mesh, phase and shapes, per-partition figures, depth."""
    mesh = " x ".join(f"{axis} {size}" for axis, size in zip(result.mesh.axes, result.mesh.shape))
    full, compiled = result.layers.full, result.layers.compiled
    hbm, ridge = result.memory_per_device.hbm, result.kernel_intensity.ridge_point
    shapes = f"batch {result.batch} x seq {result.seq}"
    return [
        f"{result.model} on {result.preset}, mesh {mesh}: {result.phase}"
        f"{' over a paged KV cache (as served)' if result.paged else ''}, {shapes}",
        f"per partition: {format_bytes(hbm)} HBM, ridge point {ridge:.0f} FLOP/B",
        f"compiled with {compiled} of {full} layers; {full} layers = outside the layer loop + {full} x per layer",
    ]


def _fitted(description: str) -> str:
    """What `layouts.fit_batch` added to a layout's description (after its last "; ")."""
    return description.rsplit("; ", 1)[-1]


def format_table(results: dict[str, LayoutResult], refused: dict[str, str] | None = None) -> str:
    """The side-by-side table of `inspect_layouts`' results (one column per layout), then the notes, the layouts
    the mesh cannot place with the reason, and the first violations of each failed principle."""
    refused = refused or {}
    first = next(iter(results.values()))
    lines = [*_header(first), "", *format_columns({name: _rows(result) for name, result in results.items()})]
    lines += [
        "",
        "collectives per layer: intra-GPU / inter-GPU / flat / unknown. Inter-GPU bytes include the flat and unknown",
        "collectives' (flat rings pass every byte over inter-GPU links). Activation copies: bytes per device held",
        "beyond a split over xcd; a copy is large above 1% of the step's working set, a copy of the layer stack",
        "(weights, optimizer state, KV cache) above 1% of what the layer stack holds per device. Attention: its work",
        "per token (decode: its K/V reads per GPU) over gpu_tp's. Unjudged: ops principle 1 could not compare with",
        "gpu_tp's, listed below; a verdict that left any out reads not judged (K of N ops), never ok, unless it",
        "failed. On the CPU backend bfloat16 moves as float32 and a",
        "reduce-scatter runs as all-reduce + slice, so bytes and compiled memory are up to 2x a GPU's (gradient",
        "reduce-scatters 4x); intensity is computed from each matmul's shape at the model's dtype. The estimate is the",
        "cost model's (starscream_jax.analysis.costmodel): matmul rooflines and collective latency + bytes / bus "
        "bandwidth.",
    ]
    lines += [f"{name} places batch {result.batch} as {result.placement}: {_fitted(result.description)}"
              for name, result in results.items() if result.placement != name]
    for name, reason in refused.items():  # whole: the reason ends with its fix
        lines += textwrap.wrap(f"{name}: cannot place the model on this mesh: {reason}", LINE_WIDTH,
                               subsequent_indent="  ")
    for name, result in results.items():
        lines += violation_lines(name, result.principles, LINE_WIDTH)
    return "\n".join(lines)
