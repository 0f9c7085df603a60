"""Arguments every command shares: the mesh (preset, topology, GPUs, grouping, simulation) and the multi-process
launch, and what they build. Importing JAX starts no backend, so `prepare_simulation` still decides the devices."""
from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from pathlib import Path

from ..analysis.layout_report import ResultCache
from ..checks import whole_number, writable_directory
from ..errors import PresetError, StarscreamError, TopologyError
from ..hardware.distributed import DEFAULT_JOIN_TIMEOUT, initialize
from ..hardware.mesh import build_topology_mesh, resolve_topology
from ..hardware.presets import list_presets
from ..hardware.simulation import DEFAULT_SIMULATED, accelerator_present, simulate_cpu_devices
from ..hardware.presets import FP8_PAIRS, Chip
from ..hardware.topology import OVERRIDE_ENV, Topology, override_from_env, parse_override
from ..model.quantize import SCALE_GRANULARITIES, gradient_format
from ..sharding.layouts import PHASE_DEFAULTS


def device_ids(text: str) -> list[int]:
    """"0,1" -> [0, 1]: the device ids of one physical GPU, as the command line gives them (--grouping)."""
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated device ids, e.g. 0,1") from None


def count(text: str) -> int:
    """A whole number of at least 1, as the command line gives it (--samples, --max-new-tokens)."""
    return _whole_number(text, minimum=1)


def count_or_zero(text: str) -> int:
    """A whole number of at least 0, as the command line gives it (--step, --mixed-chunks)."""
    return _whole_number(text, minimum=0)


SEED_RANGE = (-2**63, 2**63 - 1)
"""The seeds `jax.random.key` takes (a signed 64-bit integer); it raises OverflowError beyond them."""


def seed(text: str) -> int:
    """A random seed in SEED_RANGE, as the command line gives it (--seed), checked as the flag is read rather than
    when the first key is drawn."""
    value = _whole_number(text, minimum=SEED_RANGE[0])
    if value > SEED_RANGE[1]:
        raise argparse.ArgumentTypeError(f"value {value}: a seed is a 64-bit signed integer; pass one from "
                                         f"{SEED_RANGE[0]} to {SEED_RANGE[1]}, such as 0")
    return value


def output_directory(text: str) -> Path:
    """A directory this process can write into or create (--cache-dir, --profile), checked as the flag is read."""
    try:
        return writable_directory(text, "directory")
    except StarscreamError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def output_file(text: str) -> Path:
    """A plot's path (--plot), checked as the flag is read, before anything compiles: not a directory, a suffix
    matplotlib writes (or none: PNG), in a directory this process can write into or create."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; pass a file path such as {path / 'plot.png'}")
    if path.suffix:
        from matplotlib.backend_bases import FigureCanvasBase  # only when a plot is asked for (half a second)

        formats = FigureCanvasBase.get_supported_filetypes()
        if path.suffix[1:].lower() not in formats:
            raise argparse.ArgumentTypeError(f"{text}: matplotlib cannot write {path.suffix} files; end the name in "
                                             f"one of .{', .'.join(sorted(formats))} (.png, say)")
    output_directory(str(path.parent))
    return path


def _whole_number(text: str, minimum: int) -> int:
    try:
        return whole_number(int(text), "value", minimum)
    except ValueError as error:  # int() failed, or StarscreamError (a ValueError) from whole_number
        message = str(error) if isinstance(error, StarscreamError) else f"{text!r}: expected a whole number"
        raise argparse.ArgumentTypeError(message) from None


@dataclass(frozen=True)
class MeshDefault:
    """The simulated mesh a command builds when neither a preset nor a topology is given."""

    preset: str
    gpus: int


RUN_MESH = MeshDefault("mi300x-qpx-nps1", 2)
"""`train`, `generate` and `export` (which run the model) without GPUs: 2 GPUs of 4 partitions, 8 CPU devices, on
which the demo's training step runs in seconds."""
STUDY_MESH = MeshDefault("mi300x-cpx-nps1", 8)
"""`inspect` and `plan` (which only compile): a whole MI300X node in CPX mode, 64 partitions, the machine the
layouts are judged for."""


def add_mesh_arguments(parser: argparse.ArgumentParser, *, default_preset: str | None = None,
                       default_gpus: int | None = None, default_simulate: bool | None = False) -> None:
    """Adds --preset --topology --gpus --nodes --data-parallel --grouping --simulate to a command's parser.

    The topology is, first found: --topology, --preset, $STARSCREAM_TOPOLOGY, `default_preset` (only when
    simulating without --grouping), detection (shaped by --grouping when given). `default_gpus` is the GPU count of
    a preset (--preset or the default one) when --gpus is not given. `default_simulate=None` simulates exactly when
    no GPU is present (`accelerator_present`).
    """
    group = parser.add_argument_group("mesh")
    default = f"; default {default_preset}" if default_preset else ""
    group.add_argument("--preset", help=f"hardware preset ({', '.join(list_presets())}){default}")
    group.add_argument("--topology", help="override: GPUSxPARTITIONS (8x8), NODESxGPUSxPARTITIONS or PRESET:GPUS; "
                                          f"wins over --preset and ${OVERRIDE_ENV}")
    group.add_argument("--gpus", type=int, help="GPUs per node to use" + (
        f" (default for a preset: {default_gpus})" if default_gpus else ""))
    group.add_argument("--nodes", type=int, default=None,
                       help="nodes joined by jax.distributed (the GPUs split evenly over the processes)")
    group.add_argument("--data-parallel", type=int, default=1, metavar="N",
                       help="size of the outer 'data' mesh axis (data-parallel groups of GPUs)")
    group.add_argument("--grouping", type=device_ids, nargs="+", metavar="IDS",
                       help="device ids of each physical GPU, e.g. 0,1 2,3 (in place of detection; lets whole GPUs "
                            "stand in for the partitions of one)")
    automatic = " (default: when no GPU is present)" if default_simulate is None else ""
    group.add_argument("--simulate", action=argparse.BooleanOptionalAction, default=default_simulate,
                       help="simulate the devices on CPU" + automatic)
    parser.set_defaults(default_preset=default_preset, default_gpus=default_gpus)


def _topology_from_args(args) -> Topology | None:
    """--topology, --preset, $STARSCREAM_TOPOLOGY or the command's default preset (None: detect); --gpus and
    --nodes are applied later."""
    if args.topology:
        return _check_gpus_per_node(args, parse_override(args.topology))
    if args.preset:
        return _check_gpus_per_node(args, Topology.from_preset(args.preset, gpus=args.default_gpus))
    override = override_from_env()
    if override is not None or args.default_preset is None or args.grouping or not _simulating(args):
        return None if override is None else _check_gpus_per_node(args, override)
    return _check_gpus_per_node(args, Topology.from_preset(args.default_preset, gpus=args.default_gpus))


def _check_gpus_per_node(args, topology: Topology) -> Topology:
    """`topology`, when --gpus (GPUs per node) is within what one node of its preset holds."""
    per_node = topology.preset.chip.gpus_per_node
    if args.gpus is not None and args.gpus > per_node:
        raise TopologyError(f"--gpus {args.gpus} exceeds the {per_node} GPUs per node of {topology.preset.name}; "
                            f"--gpus counts GPUs per node: to span nodes pass --nodes {math.ceil(args.gpus / per_node)} "
                            f"--gpus {per_node} or fewer")
    return topology


def _simulating(args) -> bool:
    """--simulate / --no-simulate, or when neither was given and the command leaves it open, whether no GPU is
    present (decided once, before JAX starts)."""
    if args.simulate is None:
        args.simulate = not accelerator_present()
    return args.simulate


def prepare_simulation(args) -> None:
    """With --simulate, makes JAX expose the simulated devices. Runs before JAX's backend starts."""
    if _simulating(args) and args.grouping:
        simulate_cpu_devices(1 + max(i for group in args.grouping for i in group))
    elif _simulating(args):
        topology = _topology_from_args(args) or DEFAULT_SIMULATED
        simulate_cpu_devices(resolve_topology(topology, gpus=args.gpus, nodes=args.nodes).num_devices)


def mesh_from_args(args):
    """(Topology, Mesh) from the mesh arguments."""
    return build_topology_mesh(_topology_from_args(args), gpus=args.gpus, nodes=args.nodes,
                               data=args.data_parallel, grouping=args.grouping, simulate=_simulating(args))


EIGHT_BIT = ("int8", "fp8")
"""The 8-bit kinds the command line asks for; fp8 is the chip's e4m3 format (`eight_bit_format`)."""


def add_precision_arguments(group) -> None:
    """Add --quantize, --quantize-scales and --kv-cache (8-bit weights and KV cache for inference) to `group`."""
    group.add_argument("--quantize", choices=EIGHT_BIT,
                       help="store the layers' projection weights in 8 bits with float32 scales (fp8: the chip's "
                            "e4m3, float8_e4m3fnuz on MI300X); a pre-quantized checkpoint loads as it is")
    group.add_argument("--quantize-scales", choices=SCALE_GRANULARITIES, default="channel",
                       help="one scale per output channel (default) or per weight tensor of each layer")
    group.add_argument("--kv-cache", choices=EIGHT_BIT,
                       help="store the KV cache in 8 bits with a float32 scale per position and kv head")


def add_pad_heads_argument(group) -> None:
    """Add --pad-heads N: the model's query heads padded with zero heads to N (`model.heads.pad_query_heads_to`),
    as `starscream plan` prices it where the GPUs do not divide the heads."""
    group.add_argument("--pad-heads", type=int, default=0, metavar="N",
                       help="pad each kv head's group of query heads with zero heads to N query heads in all (a "
                            "multiple of the kv heads), so that GPUs the model's heads do not divide split them; the "
                            "logits are unchanged (default 0: the model's own heads)")


def add_model_source_arguments(group) -> None:
    """Add to `group` where `generate` and `serve` read the model from (`generate.load_request`): a training
    run's checkpoint (and step) or a Hugging Face directory, its compute dtype, the prefill and decode layouts, and
    the 8-bit formats (`add_precision_arguments`). `MODEL_SOURCE_EXCLUSIVE` lists the pairs that contradict."""
    group.add_argument("--checkpoint", default="runs/train/checkpoints",
                       help="a training run's directory (or its checkpoints directory)")
    group.add_argument("--model-dir", metavar="HF_DIR",
                       help="a Hugging Face model directory (config.json, safetensors, tokenizer) instead of "
                            "--checkpoint")
    group.add_argument("--step", type=count_or_zero, help="checkpoint step (default: the latest)")
    group.add_argument("--dtype", choices=("float32", "bfloat16"),
                       help="compute dtype (default: the model's; a checkpoint's: its training one)")
    group.add_argument("--prefill-layout", default=PHASE_DEFAULTS["prefill"], help="layout of the prompt (its chunks)")
    group.add_argument("--decode-layout", default=PHASE_DEFAULTS["decode"], help="layout of each decode step")
    add_precision_arguments(group)
    add_pad_heads_argument(group)


MODEL_SOURCE_EXCLUSIVE = (
    ("model_dir", "checkpoint", "--model-dir loads a Hugging Face directory instead of a run's checkpoint"),
    ("model_dir", "step", "--step picks a checkpoint of a run; a model directory holds one model"),
)
"""(flag, flag, why only one is honoured) of `add_model_source_arguments`, as dests."""


def eight_bit_format(kind: str | None, chip: Chip) -> str:
    """The format of an 8-bit kind on `chip` ("" for none): int8, or the chip's fp8 e4m3; PresetError naming the
    chip's formats when it has none such."""
    if not kind:
        return ""
    name = "int8" if kind == "int8" else chip.fp8_pair()[0]
    chip.check_format(name)
    return name


def fp8_training_format(chip: Chip) -> str:
    """The e4m3 format --fp8 trains in on `chip` (`Chip.fp8_pair`: float8_e4m3fn, float8_e4m3fnuz on MI300X; its
    gradients take the chip's e5m2); PresetError naming the chip's formats when it has no fp8."""
    if not any(all(name in chip.formats for name in pair) for pair in FP8_PAIRS):
        raise PresetError(f"--fp8: {chip.description} ({chip.name}) has no fp8 formats (its 8-bit formats: "
                          f"{', '.join(chip.formats)}); train without --fp8")
    return chip.fp8_pair()[0]


def check_fp8_training(matmul_format: str, chip: Chip) -> None:
    """PresetError naming the chip's formats when `chip` lacks `matmul_format` (a model file's, e.g. OCP fp8 on
    MI300X) or its e5m2 partner; nothing for "" (no fp8)."""
    if matmul_format:
        chip.check_format(matmul_format)
        chip.check_format(gradient_format(matmul_format))


def add_distributed_arguments(parser: argparse.ArgumentParser) -> None:
    """Add --coordinator, --num-processes, --process-id and --distributed to `parser`."""
    group = parser.add_argument_group("multi-process (jax.distributed)")
    group.add_argument("--coordinator", metavar="HOST:PORT",
                       help="address of process 0's coordination service, the same on every process")
    group.add_argument("--num-processes", type=int, metavar="N", help="number of processes in the run")
    group.add_argument("--process-id", type=int, metavar="I", help="this process' index, 0..N-1")
    group.add_argument("--distributed", action="store_true",
                       help="join the cluster that jax detects from the environment (SLURM, Open MPI, Kubernetes)")
    group.add_argument("--join-timeout", type=count, default=DEFAULT_JOIN_TIMEOUT, metavar="SECONDS",
                       help="how long each process waits for the others to join before naming the missing one")


def initialize_from_args(args: argparse.Namespace) -> bool:
    """Start jax.distributed as the arguments say; returns whether this run has joined several processes."""
    explicit_values = (args.coordinator, args.num_processes, args.process_id)
    if all(value is None for value in explicit_values):
        if args.distributed:
            return initialize(join_timeout=args.join_timeout)
        return False
    if any(value is None for value in explicit_values):
        raise StarscreamError(
            f"got --coordinator {args.coordinator} --num-processes {args.num_processes} --process-id "
            f"{args.process_id}; expected all three together; pass each one, or none with --distributed"
        )
    return initialize(args.coordinator, args.num_processes, args.process_id, args.join_timeout)


EXCLUSIVE = (
    ("distributed", "coordinator", "--distributed detects the coordinator from the environment"),
    ("distributed", "num_processes", "--distributed detects the process count from the environment"),
    ("distributed", "process_id", "--distributed detects each process' id from the environment"),
    ("topology", "preset", "--topology gives the whole topology (PRESET:GPUS names a preset in it)"),
    ("no_cache", "cache_dir", "--no-cache reads and keeps no compiled result"),
)
"""(flag, flag, why only one is honoured): pairs of the shared arguments that contradict each other, as dests."""


def explicit_options(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The dests of the options `argv` gives explicitly (even at their default values), for a parser with one
    level of subcommands: `argv` parsed again with every default suppressed."""
    for action in _all_actions(parser):
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv))) - {"command"}


def _all_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    actions = list(parser._actions)  # argparse keeps no public list of a parser's actions
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            actions += [nested for sub in action.choices.values() for nested in _all_actions(sub)]
    return actions


def refuse_contradictions(given: set[str], pairs, option_names: dict[str, str]) -> None:
    """A StarscreamError for the first pair of (dest, dest, why) given together: one of them would be ignored."""
    for first, second, why in pairs:
        if first in given and second in given:
            raise StarscreamError(f"{option_names[first]} contradicts {option_names[second]} ({why}); pass only "
                                  "one of them")


def option_names(parser: argparse.ArgumentParser) -> dict[str, str]:
    """dest -> its longest option string, over every subcommand."""
    return {action.dest: max(action.option_strings, key=len) for action in _all_actions(parser)
            if action.option_strings}


CACHE_ENV = "STARSCREAM_CACHE"
DEFAULT_CACHE = Path.home() / ".cache" / "starscream" / "compiled"


def add_cache_arguments(group) -> None:
    """--cache-dir and --no-cache: where `inspect` and `plan` keep compiled results."""
    group.add_argument("--cache-dir", type=output_directory, default=None,
                       help=f"where compiled results are kept (default: ${CACHE_ENV} or {DEFAULT_CACHE})")
    group.add_argument("--no-cache", action="store_true", help="compile afresh, reading no kept result")


def result_cache(args: argparse.Namespace) -> ResultCache | None:
    """The compiled-result cache the arguments name (None with --no-cache)."""
    if args.no_cache:
        return None
    return ResultCache(args.cache_dir or os.environ.get(CACHE_ENV) or DEFAULT_CACHE)


def checkpoint_dir(path: str) -> Path:
    """RUN_DIR/checkpoints when `path` is a training run's directory, else `path` (a checkpoints directory)."""
    return Path(path) / "checkpoints" if (Path(path) / "checkpoints").is_dir() else Path(path)
