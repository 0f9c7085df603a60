"""`starscream train`: train a model under a layout on a mesh (`starscream_jax.training.loop`), then print the
compiled step's memory per device and collectives by scope. With no arguments: README's main command (the tiny
Llama on a simulated 2 GPU x 4 partition mesh where no GPU is present)."""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from ..analysis.format import format_bytes
from ..analysis.profile import breakdown_table, time_breakdown
from ..analysis.report import SCOPES, inspect_compiled
from ..errors import StarscreamError
from ..hardware.distributed import is_main_process
from ..hardware.presets import Chip, load_chip
from ..model.config import REMAT_POLICIES
from ..sharding.layouts import LAYOUTS
from ..training.config import TrainConfig
from ..training.loop import CHANGEABLE, fitted_layout, layout_label, train
from .arguments import (
    RUN_MESH,
    add_distributed_arguments,
    add_mesh_arguments,
    check_fp8_training,
    fp8_training_format,
    initialize_from_args,
    mesh_from_args,
    output_directory,
    seed,
)

EXCLUSIVE = (
    ("remat_full", "remat", "--remat is --remat-policy full"),
    ("init", "model", "--init's config.json is the model"),
    ("overwrite", "resume", "--overwrite starts the run afresh, --resume continues it"),
)
"""(flag, flag, why only one is honoured), as dests."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `starscream train` (mesh, multi-process, model, optimizer, data, run directory)."""
    defaults = TrainConfig()
    add_mesh_arguments(parser, default_preset=RUN_MESH.preset, default_gpus=RUN_MESH.gpus, default_simulate=None)
    add_distributed_arguments(parser)
    group = parser.add_argument_group("training")
    group.add_argument("--model", default=defaults.model, help="model configuration: a name in models/ or a path")
    group.add_argument("--layout", default=defaults.layout, help=f"layout by name ({', '.join(LAYOUTS)})")
    group.add_argument("--dtype", default=defaults.dtype, choices=("float32", "bfloat16"),
                       help="compute dtype (default: --init's torch_dtype, else the model's, float32 unless it says; "
                            "a resumed run keeps its own); parameters and optimizer state stay float32")
    group.add_argument("--fp8", action="store_true",
                       help="fp8 matmuls in the projections and MLP: e4m3 operands, e5m2 gradients, current "
                            "per-tensor scales, in the chip's formats (FNUZ on MI300X); weights stay float32")
    group.add_argument("--fp8-logits", action="store_true",
                       help="with --fp8, the vocabulary projection in fp8 too (kept in the compute dtype by default: "
                            "its rounding reaches the loss directly)")
    group.add_argument("--remat-policy", dest="remat", default=defaults.remat, choices=REMAT_POLICIES,
                       help="what the backward pass keeps of each layer: everything (none), the matmul outputs "
                            "(dots) or only the layer's input (full), recomputing the rest")
    group.add_argument("--remat", dest="remat_full", action="store_true", help="the same as --remat-policy full")
    group.add_argument("--grad-accum", type=int, default=defaults.grad_accum, metavar="N",
                       help="accumulate gradients over N micro-batches of batch-size / N sequences per step")
    group.add_argument("--steps", type=int, default=defaults.steps, help="optimizer steps in the whole run")
    group.add_argument("--batch-size", type=int, default=defaults.batch_size, help="sequences per step (global)")
    group.add_argument("--seq-len", type=int, default=defaults.seq_len, help="tokens (bytes) per sequence")
    group.add_argument("--learning-rate", type=float, default=defaults.learning_rate, help="peak learning rate")
    group.add_argument("--warmup-steps", type=int, default=None,
                       help=f"linear warm-up steps, at most --steps (default {defaults.warmup_steps})")
    group.add_argument("--weight-decay", type=float, default=defaults.weight_decay, help="AdamW weight decay")
    group.add_argument("--clip-norm", type=float, default=defaults.clip_norm, help="global gradient norm limit")
    group.add_argument("--seed", type=seed, default=defaults.seed, help="parameters and data order")
    group.add_argument("--eval-every", type=int, default=defaults.eval_every, help="steps between validations")
    group.add_argument("--eval-batches", type=int, default=defaults.eval_batches, help="batches per validation")
    group.add_argument("--checkpoint-every", type=int, default=defaults.checkpoint_every,
                       help="steps between checkpoints (one is always saved at the end)")
    group.add_argument("--log-every", type=int, default=defaults.log_every, help="steps between metric records")
    group.add_argument("--run-dir", default=defaults.run_dir, help="metrics, plot and checkpoints go here")
    group.add_argument("--data", nargs="+", default=[defaults.data], metavar="FILE",
                       help="training files: .txt (one document each) or .jsonl (a 'text' or chat 'messages' field "
                            "per line); byte-level tokens unless a tokenizer is given")
    group.add_argument("--init", default=defaults.init, metavar="HF_DIR",
                       help="start from this Hugging Face model directory (config.json, safetensors, tokenizer) "
                            "instead of random weights; it replaces --model")
    group.add_argument("--tokenizer", default=defaults.tokenizer, metavar="DIR",
                       help="directory with tokenizer.json (default: --init's, else byte-level)")
    group.add_argument("--token-cache", default=defaults.token_cache, metavar="DIR",
                       help="tokenized data files are cached here")
    group.add_argument("--resume", action="store_true",
                       help="continue from the newest intact checkpoint in --run-dir (start fresh in an empty one)")
    group.add_argument("--overwrite", action="store_true",
                       help="start afresh in a --run-dir that holds an earlier run's metrics.jsonl or loss.png but no "
                            "checkpoint (it stopped before its first), replacing them; checkpoints are never deleted")
    group.add_argument("--allow-change", type=_field_names, default=[],
                       metavar="FIELDS", help="with --resume: settings that may differ from the run's, recorded with "
                                              f"its checkpoints (some of {','.join(CHANGEABLE)})")
    group.add_argument("--no-progress", action="store_true", help="no progress bar")
    group.add_argument("--profile", metavar="DIR", type=output_directory,
                       help="write a JAX profiler trace of a few steps (from the run's second step; --steps 2 or more) "
                            "to DIR and, on a GPU, print where a step's time goes (matmuls, attention, collectives, "
                            "optimizer, other)")


def _field_names(text: str) -> list[str]:
    """TrainConfig field names from a flag's value: 'batch-size,learning_rate' -> ['batch_size', 'learning_rate']."""
    return [name.strip().replace("-", "_") for name in text.split(",")]


def config_from_args(args: argparse.Namespace, chip: Chip | None = None) -> TrainConfig:
    """The TrainConfig that the parsed arguments describe; --fp8 takes `chip`'s e4m3 format (`fp8_training_format`:
    float8_e4m3fnuz on MI300X; the simulated CPU's OCP one without a chip). A --warmup-steps given beyond --steps
    is refused (the run would never train at its peak learning rate); without it the warm-up is TrainConfig's default,
    which may be longer than a short run (a test, a demo)."""
    fields = {field.name for field in dataclasses.fields(TrainConfig)}
    values = {name: value for name, value in vars(args).items() if name in fields}
    if args.warmup_steps is None:
        del values["warmup_steps"]  # TrainConfig's
    matmul_format = fp8_training_format(chip or load_chip("cpu")) if args.fp8 else ""
    config = TrainConfig(**{**values, "data": ",".join(args.data), "remat": "full" if args.remat_full else args.remat,
                            "matmul_format": matmul_format})
    if args.warmup_steps is not None and config.warmup_steps > config.steps:
        raise StarscreamError(f"--warmup-steps {config.warmup_steps} exceeds --steps {config.steps}: the run would end "
                              "before its learning rate reaches --learning-rate; pass --warmup-steps "
                              f"{config.steps} or fewer")
    return config


def run(args: argparse.Namespace) -> int:
    """`starscream train`: join the processes, build the mesh, train, print the summary. Returns 0."""
    initialize_from_args(args)
    topology, mesh = mesh_from_args(args)
    config = config_from_args(args, topology.preset.chip)
    check_fp8_training(config.model_config().matmul_format, topology.preset.chip)
    echo = print if is_main_process() else (lambda *_: None)
    layout = layout_label(fitted_layout(config, mesh).name, config.layout)
    echo(f"{config.init or config.model} on mesh {dict(mesh.shape)} ({topology.preset.name}), layout {layout}, "
         f"{config.steps} steps of {config.batch_size} x {config.seq_len} tokens")
    result = train(config, mesh, resume=args.resume, allow_changes=args.allow_change,
                   device_memory_bytes=topology.hbm_bytes, show_progress=not args.no_progress,
                   profile_dir=args.profile, overwrite=args.overwrite)
    report = inspect_compiled(result.compiled_step, mesh, gpus_per_node=topology.gpus_per_node)  # (as inspect's)
    print_layout_summary(report.to_dict(), result.layout, echo)
    if args.profile:
        print_time_breakdown(args.profile, result, mesh, result.layout, echo)
    return 0


def print_time_breakdown(directory: str, result, mesh, layout_name: str, echo) -> None:
    """The traced steps' device time by category (GPU only: a CPU trace has no device kernels), also written to
    DIR/time_breakdown.json."""
    if mesh.devices.flat[0].platform != "gpu":
        echo(f"profiler trace of {result.profiled_steps} steps in {directory}; the time breakdown reads GPU kernels")
        return
    breakdown = time_breakdown(directory, result.profiled_steps, result.compiled_step.as_text())
    (Path(directory) / "time_breakdown.json").write_text(json.dumps(breakdown, indent=1) + "\n")
    echo(f"device time per step ({result.profiled_steps} steps traced in {directory}):")
    echo(breakdown_table({layout_name: breakdown}))


def print_layout_summary(summary: dict, layout_name: str, echo) -> None:
    """Memory per device and collectives by scope (count and bytes sent per device) of the compiled step."""
    echo(f"compiled training step under {layout_name}, per device:")
    memory = summary["memory"]
    if memory is not None:
        echo(f"  memory: arguments {format_bytes(memory['argument_bytes'])}, outputs "
             f"{format_bytes(memory['output_bytes'])} ({format_bytes(memory['alias_bytes'])} aliased to inputs), "
             f"temporaries {format_bytes(memory['temp_bytes'])}")
    counts = dict.fromkeys(SCOPES, 0)
    for collective in summary["collectives"]:
        counts[collective["scope"]] += collective["count"]
    sent = summary["bytes_by_scope"]
    echo("  collectives by scope: " + ", ".join(
        f"{scope} {counts[scope]} ({format_bytes(sent[scope])} sent)" for scope in SCOPES))
