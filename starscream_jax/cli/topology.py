"""`starscream topology`: the topology and which device sits at each (data, gpu, xcd) of the mesh."""
from __future__ import annotations

import argparse
import json

from ..hardware.distributed import is_main_process
from ..hardware.mesh import device_table
from .arguments import (
    add_distributed_arguments,
    add_mesh_arguments,
    initialize_from_args,
    mesh_from_args,
    output_file,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `starscream topology`: the mesh, the multi-process launch, --json."""
    add_mesh_arguments(parser)
    add_distributed_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", type=output_file, default=None, metavar="FILE.png",
                        help="draw the GPUs and their partitions with device ids and mesh coordinates")


def run(args) -> int:
    """`starscream topology`: the topology and the device at each (data, gpu, xcd) of the mesh.

    --json prints one object: the topology's summary, "mesh" (axes, shape) and "devices" (one row of device ids per
    physical GPU, in mesh order); otherwise a readable header and table. Across processes only process 0 prints.
    """
    initialize_from_args(args)
    topology, mesh = mesh_from_args(args)
    if not is_main_process():
        return 0
    rows = [gpu_row for plane in device_table(mesh) for gpu_row in plane]
    if args.plot is not None:
        from ..analysis.plots import plot_topology

        plot_topology(topology, mesh, args.plot)
    if args.json:
        summary = {**topology.describe(), "mesh": {"axes": list(mesh.axis_names), "shape": list(mesh.devices.shape)},
                   "devices": rows}
        print(json.dumps(summary, indent=2))
        return 0
    _print_header(topology)
    print(f"mesh axes {tuple(mesh.axis_names)} shape {tuple(mesh.devices.shape)}; device ids:")
    _print_device_table(rows, gpus_per_data=mesh.devices.shape[1])
    if args.plot is not None:
        print(f"plot: {args.plot}")
    return 0


def _print_header(topology) -> None:
    preview = " (preview mode)" if topology.preset.preview else ""
    print(f"{topology.preset.chip.description} ({topology.preset.name}): {topology.compute_mode} + "
          f"{topology.memory_mode}{preview}, {topology.nodes} node(s) x {topology.gpus_per_node} GPUs x "
          f"{topology.partitions_per_gpu} partitions = {topology.num_devices} devices")
    print(f"per partition: {topology.peak_flops / 1e12:.1f} TFLOP/s bf16, {topology.hbm_bytes / 1e9:.1f} GB HBM "
          f"at {topology.hbm_bandwidth / 1e9:.0f} GB/s; ridge point {topology.ridge_point:.0f} FLOP/byte")


def _print_device_table(rows: list[list[int]], gpus_per_data: int) -> None:
    """One line per physical GPU: its (data, gpu) position, then the device id at each xcd."""
    width = max(len(f"x{len(rows[0]) - 1}"), *(len(str(i)) for row in rows for i in row))
    print("  data gpu | " + " ".join(f"{f'x{x}':>{width}}" for x in range(len(rows[0]))))
    for index, row in enumerate(rows):
        cells = " ".join(f"{i:>{width}}" for i in row)
        print(f"  {index // gpus_per_data:>4} {index % gpus_per_data:>3} | {cells}")
