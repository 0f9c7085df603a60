"""The `starscream` command: topology, train, generate, inspect.

Subcommand modules build their parsers without importing jax, so that --simulate can set up the simulated CPU
devices before jax starts.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys

from .errors import StarscreamError
from .mesh import add_mesh_arguments, prepare_simulation

# name -> (module with add_arguments(parser) and run(args) -> int, one-line help)
SUBCOMMANDS = {
    "topology": ("starscream_jax.cli", "print the topology and which device sits at each (gpu, xcd)"),
    "train": ("starscream_jax.train", "train a model under a layout (default: tiny Llama, simulated 2 x 4 mesh)"),
    "generate": ("starscream_jax.generate", "generate text from a checkpoint with prefill and decode layouts"),
    "inspect": ("starscream_jax.inspect_command", "compile layouts side by side and check the three principles"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `starscream topology`."""
    add_mesh_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args) -> int:
    """`starscream topology`: the topology and the device at each (gpu, xcd) of the mesh."""
    from .mesh import device_table, mesh_from_args

    topology, mesh = mesh_from_args(args)
    rows = [gpu_row for plane in device_table(mesh) for gpu_row in plane]
    summary = {**topology.describe(), "mesh": {"axes": list(mesh.axis_names), "shape": list(mesh.devices.shape)},
               "devices": rows}
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(f"{summary['chip']} ({summary['preset']}): {summary['compute_mode']} + {summary['memory_mode']}, "
          f"{topology.nodes} node(s) x {topology.gpus_per_node} GPUs x {topology.partitions_per_gpu} partitions "
          f"= {topology.num_devices} devices")
    part = summary["per_partition"]
    print(f"per partition: {part['peak_bf16_flops'] / 1e12:.1f} TFLOP/s bf16, {part['hbm_bytes'] / 1e9:.1f} GB HBM "
          f"at {part['hbm_bandwidth'] / 1e9:.0f} GB/s; ridge point {topology.ridge_point:.0f} FLOP/byte")
    print(f"mesh axes {tuple(mesh.axis_names)} shape {tuple(mesh.devices.shape)}; device ids:")
    width = max(len(str(i)) for row in rows for i in row)
    print("  data gpu | " + " ".join(f"x{x:<{width - 1}}" for x in range(topology.partitions_per_gpu)))
    per_data = mesh.devices.shape[1]
    for index, row in enumerate(rows):
        cells = " ".join(f"{i:>{width}}" for i in row)
        print(f"  {index // per_data:>4} {index % per_data:>3} | {cells}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="starscream", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        sub = commands.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(module=module)
        importlib.import_module(module).add_arguments(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        prepare_simulation(args)
        return importlib.import_module(args.module).run(args)
    except StarscreamError as err:
        print(f"starscream {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
