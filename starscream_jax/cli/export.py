"""`starscream export`: a training run's parameters written as a Hugging Face model directory (safetensors shards and
their index, config.json, the tokenizer files of the run's tokenizer), readable by other tools
(`starscream_jax.model.hf_checkpoint.export_hf_model`)."""
from __future__ import annotations

import argparse
from pathlib import Path

from ..analysis.format import format_bytes
from ..hardware.distributed import is_main_process
from ..checks import finite_number
from ..errors import CheckpointError, StarscreamError
from ..model.hf_checkpoint import DEFAULT_SHARD_BYTES, SAVED_DTYPES, check_export_target, export_hf_model
from ..model.hf_config import CONFIG_FILE, read_hf_config
from ..training.checkpoint import restore_model
from ..training.config import TrainConfig
from .arguments import (
    RUN_MESH,
    add_distributed_arguments,
    add_mesh_arguments,
    checkpoint_dir,
    initialize_from_args,
    mesh_from_args,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `starscream export` (mesh, multi-process, run, output)."""
    add_mesh_arguments(parser, default_preset=RUN_MESH.preset, default_gpus=RUN_MESH.gpus, default_simulate=None)
    add_distributed_arguments(parser)
    group = parser.add_argument_group("export")
    group.add_argument("--checkpoint", required=True, metavar="RUN_DIR",
                       help="a training run's directory (or its checkpoints directory)")
    group.add_argument("--out", required=True, metavar="HF_DIR", help="the model directory to write")
    group.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    group.add_argument("--dtype", default="float32", choices=tuple(SAVED_DTYPES), help="dtype of the saved tensors")
    group.add_argument("--shard-size", type=shard_size, default=DEFAULT_SHARD_BYTES / 2**30, metavar="GIB",
                       help="largest safetensors file, in GiB")
    group.add_argument("--replace", action="store_true",
                       help="replace whatever --out holds, entirely (without it a non-empty --out is refused)")
    group.add_argument("--layout", help="layout to gather the parameters from (default: the run's)")


def shard_size(text: str) -> float:
    """--shard-size: a finite number of GiB above zero."""
    try:
        return finite_number(float(text), "--shard-size", positive=True)
    except ValueError as error:  # float() failed, or StarscreamError (a ValueError) from finite_number
        message = str(error) if isinstance(error, StarscreamError) else f"{text!r}: expected a number of GiB"
        raise argparse.ArgumentTypeError(message) from None


def run(args: argparse.Namespace) -> int:
    """`starscream export`: restore the run's parameters, write the model directory, list its files. Returns 0.
    A checkpoint that cannot be read (its description or parameters damaged or missing) and a target that cannot
    be written (a full disk, a mount point, a directory this user cannot write) are one CheckpointError naming the
    path and the fix (`restore_model`, `export_hf_model`)."""
    initialize_from_args(args)
    echo = print if is_main_process() else (lambda *_: None)
    _, mesh = mesh_from_args(args)
    directory = checkpoint_dir(args.checkpoint)
    check_export_target(Path(args.out), args.replace, reads=[directory])
    model, description = restore_model(directory, args.layout, mesh, args.step)  # no --layout: the run's own
    run_config = TrainConfig.from_dict(description["train_config"])
    written = export_hf_model(model, args.out, args.dtype, tokenizer_dir=run_config.tokenizer_dir(),
                              source_config=source_config(run_config.init),
                              max_shard_bytes=max(1, int(args.shard_size * 2**30)), replace=args.replace)
    echo(f"{model.config.name} from step {description['step']} of {directory} written to {args.out}:")
    for path in written:
        echo(f"  {path.name} ({format_bytes(path.stat().st_size)})")
    return 0


def source_config(init: str) -> dict | None:
    """The config.json of the model directory a run was fine-tuned from (`init`; None for a run from scratch), whose
    other fields (token ids, ...) the export keeps; a CheckpointError naming the directory when it is gone."""
    if not init:
        return None
    if not (Path(init) / CONFIG_FILE).is_file():
        raise CheckpointError(f"the run was fine-tuned from {init}, whose {CONFIG_FILE} is gone; the export keeps its "
                              f"fields (token ids, ...): put that model directory back at {init}")
    return read_hf_config(init)
