"""The mesh builder: every logical device placed at (data, gpu, xcd), each `xcd` row one physical GPU.

The grouping of logical devices into physical GPUs is read from the machine (ROCm: KFD sysfs and amd-smi, see
`detect`), given explicitly (`grouping=`), or simulated on CPU (consecutive devices form one GPU). JAX itself does not
expose it. The mesh always has the three axes ('data', 'gpu', 'xcd'), Explicit, so every rule sees the same names.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import numpy as np

from .errors import TopologyError
from .presets import list_presets, load_preset, preset_for
from .topology import Topology, override_from_env, parse_override

AXES = ("data", "gpu", "xcd")
DEFAULT_SIMULATED = "cpu"


def simulated_device_flag(count: int) -> str:
    return f"--xla_force_host_platform_device_count={count}"


def simulate_cpu_devices(count: int) -> None:
    """Makes JAX expose `count` CPU devices. Call before the first use of any device.

    Before jax is imported this sets XLA_FLAGS and JAX_PLATFORMS; after the import (but before the backend starts)
    it sets the equivalent jax.config options. Once the backend runs it only checks that enough CPU devices exist.
    """
    if "jax" not in sys.modules:
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
        os.environ["XLA_FLAGS"] = " ".join([*flags, simulated_device_flag(count)])
        os.environ["JAX_PLATFORMS"] = "cpu"
        return
    import jax
    from jax._src import xla_bridge

    if not xla_bridge.backends_are_initialized():
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", count)
        return
    cpus = jax.devices("cpu") if "cpu" in {d.platform for d in jax.devices()} else []
    if len(cpus) < count:
        raise TopologyError(
            f"a simulated mesh needs {count} CPU devices but JAX already started with {len(cpus)}; call "
            f"simulate_cpu_devices({count}) before any JAX computation, or set "
            f"XLA_FLAGS={simulated_device_flag(count)} before importing jax")


def resolve_topology(topology: Topology | str | None = None, *, gpus: int | None = None,
                     nodes: int | None = None, devices: Sequence | None = None) -> Topology:
    """Picks the topology: an explicit argument, then $STARSCREAM_TOPOLOGY, then what the machine shows."""
    if isinstance(topology, str):
        topology = parse_override(topology)
    topology = topology or override_from_env()
    if topology is None:
        topology = detect_topology(devices)
    if gpus is not None or nodes is not None:
        partitions = topology.partitions_per_gpu if topology.preset.chip.name == "cpu" else None
        topology = Topology.from_preset(topology.preset, gpus=gpus or topology.gpus_per_node,
                                        nodes=nodes or topology.nodes, partitions=partitions)
    return topology


def _platform(device) -> str:
    version = getattr(device.client, "platform_version", "").lower()
    return "rocm" if "rocm" in version or device.platform == "rocm" else device.platform


def detect_topology(devices: Sequence | None = None) -> Topology:
    """The topology of the devices JAX sees: ROCm partitions from sysfs, otherwise one device per GPU."""
    import jax

    devices = list(devices or jax.devices())
    platform = _platform(devices[0])
    per_process = len(devices) // max(1, jax.process_count())
    if platform == "rocm":
        from .detect import detect_rocm_topology

        found = detect_rocm_topology()
        if found is not None:
            partitions = len(found.groups[0])
            chip = "mi355x" if "gfx95" in str(getattr(devices[0], "compute_capability", "")) else "mi300x"
            preset = preset_for(chip, found.compute_mode, found.memory_mode)
            return Topology.from_preset(preset, gpus=per_process // partitions, nodes=jax.process_count())
    if platform == "cpu":
        return Topology.from_preset("cpu", gpus=per_process, nodes=jax.process_count(), partitions=1)
    kind = devices[0].device_kind.lower()
    preset = load_preset("h200" if "h200" in kind or "h100" in kind else "cpu")
    return Topology(preset=preset, nodes=jax.process_count(), gpus_per_node=per_process, partitions_per_gpu=1)


def physical_gpu_groups(devices: Sequence, topology: Topology,
                        grouping: Sequence[Sequence[int]] | None = None) -> list[list]:
    """The devices grouped by physical GPU, each group in partition order, groups ordered by (process, first id).

    `grouping` (lists of device ids, one list per GPU) overrides detection. On ROCm the grouping is read from sysfs;
    on CPU consecutive devices of one process form a GPU; elsewhere each device is its own GPU.
    """
    by_id = {d.id: d for d in devices}
    if grouping is not None:
        return _explicit_groups(by_id, grouping)
    platform = _platform(devices[0])
    if platform == "rocm" and topology.partitions_per_gpu > 1:
        return _rocm_groups(devices)
    if platform == "cpu":
        return _consecutive_groups(devices, topology.partitions_per_gpu)
    if topology.partitions_per_gpu != 1:
        raise TopologyError(
            f"{platform} devices are whole GPUs, but the topology asks for {topology.partitions_per_gpu} partitions "
            f"per GPU; pass grouping=[[ids of GPU 0], [ids of GPU 1], ...] to treat devices as partitions")
    return [[d] for d in sorted(devices, key=lambda d: (d.process_index, d.id))]


def _explicit_groups(by_id: dict, grouping: Sequence[Sequence[int]]) -> list[list]:
    flat = [i for group in grouping for i in group]
    unknown = sorted(set(flat) - set(by_id))
    if unknown:
        raise TopologyError(f"grouping names device ids {unknown} that JAX does not have (ids: {sorted(by_id)})")
    if len(flat) != len(set(flat)):
        raise TopologyError(f"grouping {list(map(list, grouping))} lists a device twice; each device belongs to one GPU")
    sizes = sorted({len(g) for g in grouping})
    if len(sizes) != 1:
        raise TopologyError(f"grouping has GPUs with {sizes} partitions; every GPU must have the same number")
    return [[by_id[i] for i in group] for group in grouping]


def _consecutive_groups(devices: Sequence, partitions: int) -> list[list]:
    groups = []
    processes = sorted({d.process_index for d in devices})
    for process in processes:
        local = sorted((d for d in devices if d.process_index == process), key=lambda d: d.id)
        if len(local) % partitions:
            raise TopologyError(
                f"process {process} has {len(local)} devices, not a multiple of {partitions} partitions per GPU; "
                f"simulate a multiple of {partitions} devices per process")
        groups += [local[i:i + partitions] for i in range(0, len(local), partitions)]
    return groups


def _rocm_groups(devices: Sequence) -> list[list]:
    """Groups ROCm devices by the physical GPU sysfs names (KFD location_id / PCI domain:bus:device).

    Every process reads its own node's sysfs; nodes are assumed alike (same GPUs, same mode), which the device
    count check in `build_mesh` backs up.
    """
    from .detect import detect_rocm_topology

    found = detect_rocm_topology()
    if found is None:
        raise TopologyError("JAX runs on ROCm but /sys/class/kfd shows no GPU nodes; run on the host (or mount /sys "
                            "into the container), or pass grouping=[[...], ...] / STARSCREAM_TOPOLOGY explicitly")
    groups = []
    for process in sorted({d.process_index for d in devices}):
        by_ordinal = {d.local_hardware_id: d for d in devices if d.process_index == process}
        for gpu in found.groups:
            missing = [p.hip_ordinal for p in gpu if p.hip_ordinal not in by_ordinal]
            if missing:
                raise TopologyError(
                    f"sysfs shows GPU {gpu[0].gpu_id} with HIP ordinals {[p.hip_ordinal for p in gpu]}, but process "
                    f"{process} has no JAX device for {missing}; make every partition visible "
                    f"(check ROCR_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES)")
            groups.append([by_ordinal[p.hip_ordinal] for p in gpu])
    return groups


def build_mesh(topology: Topology | str | None = None, **options):
    """A `jax.sharding.Mesh` of shape (data, gpu, xcd) with Explicit axes; options as `build_topology_mesh`."""
    return build_topology_mesh(topology, **options)[1]


def build_topology_mesh(topology: Topology | str | None = None, *, gpus: int | None = None,
                        nodes: int | None = None, data: int = 1, grouping: Sequence[Sequence[int]] | None = None,
                        devices: Sequence | None = None, simulate: bool = False):
    """(Topology, Mesh): the mesh has shape (data, gpu, xcd), Explicit axes, and each xcd row is one physical GPU.

    topology: a Topology, an override string ("8x8", "2x8x8", "mi300x-cpx-nps1:4") or None (env, then detection).
    gpus / nodes: use this many GPUs per node / nodes (a subset of what the machine has is fine).
    data: the size of the outer data-parallel axis; it must divide the number of GPUs.
    grouping: device ids per physical GPU, overriding detection. simulate: build on simulated CPU devices.
    """
    import jax
    from jax.sharding import AxisType, Mesh

    if simulate:
        topology = resolve_topology(topology or DEFAULT_SIMULATED, gpus=gpus, nodes=nodes)
        simulate_cpu_devices(topology.num_devices)
        devices = devices or jax.devices("cpu")
    devices = list(devices or jax.devices())
    topology = resolve_topology(topology, gpus=gpus, nodes=nodes, devices=devices)
    groups = physical_gpu_groups(devices, topology, grouping)
    if grouping is not None and len(groups[0]) != topology.partitions_per_gpu:
        topology = Topology(topology.preset, topology.nodes, len(groups) // topology.nodes, len(groups[0]))
    chosen = _choose_gpus(groups, topology)
    if topology.num_gpus % data:
        raise TopologyError(f"data={data} does not divide the {topology.num_gpus} GPUs; pick a divisor of "
                            f"{topology.num_gpus}")
    cells = np.empty((topology.num_gpus, topology.partitions_per_gpu), dtype=object)
    for row, group in enumerate(chosen):
        cells[row, :] = group
    grid = cells.reshape(data, topology.num_gpus // data, topology.partitions_per_gpu)
    return topology, Mesh(grid, AXES, axis_types=(AxisType.Explicit,) * 3)


def _choose_gpus(groups: list[list], topology: Topology) -> list[list]:
    """The first gpus_per_node GPUs of each of the first `nodes` processes (or of this host when single-process)."""
    partitions = {len(g) for g in groups}
    if partitions != {topology.partitions_per_gpu}:
        raise TopologyError(
            f"found GPUs with {sorted(partitions)} partitions each, expected {topology.partitions_per_gpu} "
            f"({topology.compute_mode}); check the partition mode (amd-smi) or pick the preset that matches it")
    processes = sorted({g[0].process_index for g in groups})
    if len(processes) == 1:
        if len(groups) < topology.num_gpus:
            raise TopologyError(
                f"found {len(groups)} GPUs x {topology.partitions_per_gpu} partitions "
                f"({len(groups) * topology.partitions_per_gpu} devices), but the topology needs {topology.num_gpus} "
                f"GPUs ({topology.num_devices} devices); ask for fewer GPUs (--gpus) or simulate "
                f"{topology.num_devices} devices")
        return groups[:topology.num_gpus]
    if len(processes) % topology.nodes:
        raise TopologyError(f"{len(processes)} processes cannot form {topology.nodes} nodes; launch a multiple")
    if len(groups) != topology.num_gpus:
        raise TopologyError(
            f"{len(processes)} processes show {len(groups)} GPUs in all, the topology needs {topology.num_gpus} "
            f"({topology.nodes} nodes x {topology.gpus_per_node}); make --nodes / --gpus match the launch")
    return groups


def device_table(mesh) -> list[list[list[int]]]:
    """Device ids at each (data, gpu, xcd) of the mesh."""
    return [[[int(d.id) for d in row] for row in plane] for plane in mesh.devices]


def add_mesh_arguments(parser: argparse.ArgumentParser, *, default_preset: str | None = None,
                       default_gpus: int | None = None, default_simulate: bool = False) -> None:
    """Adds --preset --topology --gpus --nodes --data --simulate to a command's parser."""
    group = parser.add_argument_group("mesh")
    group.add_argument("--preset", default=default_preset, help=f"hardware preset ({', '.join(list_presets())})")
    group.add_argument("--topology", help="override: GPUSxPARTITIONS (8x8), NODESxGPUSxPARTITIONS or PRESET:GPUS")
    group.add_argument("--gpus", type=int, default=default_gpus, help="GPUs per node to use")
    group.add_argument("--nodes", type=int, default=None, help="nodes (processes joined by jax.distributed)")
    group.add_argument("--data", type=int, default=1, help="size of the outer data-parallel axis")
    group.add_argument("--simulate", action=argparse.BooleanOptionalAction, default=default_simulate,
                       help="simulate the devices on CPU")


def _topology_from_args(args) -> Topology | None:
    if args.topology:
        return resolve_topology(args.topology, gpus=args.gpus, nodes=args.nodes)
    if args.preset:
        return Topology.from_preset(args.preset, gpus=args.gpus, nodes=args.nodes or 1)
    return None


def prepare_simulation(args) -> None:
    """With --simulate, makes JAX expose the simulated devices. Runs before jax is imported where it can."""
    if args.simulate:
        topology = _topology_from_args(args) or resolve_topology(DEFAULT_SIMULATED, gpus=args.gpus, nodes=args.nodes)
        simulate_cpu_devices(topology.num_devices)


def mesh_from_args(args):
    """(Topology, Mesh) from the mesh arguments."""
    import jax

    topology = _topology_from_args(args)
    devices = jax.devices("cpu") if args.simulate else None
    if args.simulate and topology is None:
        topology = resolve_topology(DEFAULT_SIMULATED, gpus=args.gpus, nodes=args.nodes)
    return build_topology_mesh(topology, data=args.data, devices=devices)
