"""The mesh builder: every logical device placed at (data, gpu, xcd), each `xcd` row one physical GPU.

The grouping of logical devices into physical GPUs is read from the machine (ROCm: KFD sysfs, see `detect`), given
explicitly (`grouping=`), or simulated on CPU (consecutive devices of one process form one GPU). JAX itself does not
expose it. The mesh always has the three axes ('data', 'gpu', 'xcd'), Explicit, so every rule sees the same names.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .errors import TopologyError
from .presets import Preset, list_presets, load_chip, load_preset, preset_for
from .topology import MODE_FOR_PARTITIONS, OVERRIDE_ENV, Topology, override_from_env, parse_override

AXES = ("data", "gpu", "xcd")
DEFAULT_SIMULATED = "cpu"
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def simulated_device_flag(count: int) -> str:
    """The XLA flag that makes the CPU backend expose `count` devices."""
    return f"{_DEVICE_COUNT_FLAG}={count}"


def _flag_device_count() -> int:
    """The CPU device count XLA_FLAGS asks for (0 when it does not)."""
    found = re.search(rf"{_DEVICE_COUNT_FLAG}=(\d+)", os.environ.get("XLA_FLAGS", ""))
    return int(found.group(1)) if found else 0


def simulate_cpu_devices(count: int) -> None:
    """Makes JAX expose at least `count` CPU devices (never fewer than XLA_FLAGS already asks for). Call before the
    first use of any device.

    Before jax is imported this sets XLA_FLAGS and JAX_PLATFORMS; after the import (but before the backend starts)
    it sets the equivalent jax.config options. Once the backend runs it only checks that enough CPU devices exist.
    """
    if "jax" not in sys.modules:
        if _flag_device_count() < count:
            flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_COUNT_FLAG)]
            os.environ["XLA_FLAGS"] = " ".join([*flags, simulated_device_flag(count)])
        os.environ["JAX_PLATFORMS"] = "cpu"
        return
    import jax
    from jax._src import xla_bridge

    if not xla_bridge.backends_are_initialized():
        jax.config.update("jax_platforms", "cpu")
        if max(jax.config.jax_num_cpu_devices, _flag_device_count()) < count:
            jax.config.update("jax_num_cpu_devices", count)
        return
    available = len(jax.devices("cpu"))
    if available < count:
        raise TopologyError(
            f"a simulated mesh needs {count} CPU devices but JAX already started with {available}; call "
            f"simulate_cpu_devices({count}) before any JAX computation, or set "
            f"XLA_FLAGS={simulated_device_flag(count)} before importing jax")


def resolve_topology(topology: Topology | str | None = None, *, gpus: int | None = None,
                     nodes: int | None = None, devices: Sequence | None = None,
                     groups: Sequence[Sequence] | None = None) -> Topology:
    """Picks the topology: an explicit argument, then $STARSCREAM_TOPOLOGY, then what the machine shows.

    `gpus` / `nodes`, when given, replace the GPUs per node / node count. `groups` (devices per physical GPU, as
    given by the user) shape the detected topology.
    """
    if isinstance(topology, str):
        topology = parse_override(topology)
    topology = topology or override_from_env() or detect_topology(devices, groups)
    return _with_counts(topology, gpus, nodes)


def _with_counts(topology: Topology, gpus: int | None, nodes: int | None) -> Topology:
    """The topology with gpus per node / nodes replaced where given (positive)."""
    for name, value in (("gpus", gpus), ("nodes", nodes)):
        if value is not None and value < 1:
            raise TopologyError(f"{name}={value}; ask for a positive number of {name} (--{name})")
    return dataclasses.replace(topology, gpus_per_node=topology.gpus_per_node if gpus is None else gpus,
                               nodes=topology.nodes if nodes is None else nodes)


def _platform(device) -> str:
    version = getattr(device.client, "platform_version", "").lower()
    return "rocm" if "rocm" in version or device.platform == "rocm" else device.platform


def _rocm_chip(device) -> str:
    """"mi355x" for gfx950 devices, else "mi300x"."""
    kind = f"{getattr(device, 'compute_capability', '')} {getattr(device, 'device_kind', '')}".lower()
    return "mi355x" if "gfx95" in kind or "mi355" in kind else "mi300x"


def detect_topology(devices: Sequence | None = None, groups: Sequence[Sequence] | None = None) -> Topology:
    """The topology of the devices JAX sees (default: all of them), one node per process.

    ROCm: the compute and memory mode and the partitions per GPU from sysfs (`detect.detect_rocm_topology`).
    CPU: the cpu preset, one device per GPU. Other GPUs: one device per GPU (H200 figures for H100/H200).
    `groups` (devices per physical GPU, given by the user) replace the partition and GPU counts.
    """
    import jax

    devices = list(devices or jax.devices())
    processes = len({d.process_index for d in devices})
    platform = _platform(devices[0])
    found = _detect_rocm() if platform == "rocm" else None
    if found is not None:
        preset = _rocm_preset(_rocm_chip(devices[0]), found)
        partitions = len(found.groups[0])
    else:
        kind = devices[0].device_kind.lower()
        preset = load_preset("h200" if platform != "cpu" and ("h200" in kind or "h100" in kind) else "cpu")
        partitions = 1
    if groups is not None:
        return Topology(preset, nodes=processes, gpus_per_node=len(groups) // processes,
                        partitions_per_gpu=len(groups[0]))
    return Topology(preset, nodes=processes, gpus_per_node=len(devices) // processes // partitions,
                    partitions_per_gpu=partitions)


def _detect_rocm():
    """What `detect.detect_rocm_topology` reads from this machine's sysfs (None without KFD GPU nodes)."""
    from .detect import detect_rocm_topology

    return detect_rocm_topology()


def _rocm_preset(chip_name: str, found) -> Preset:
    """The preset of the detected modes; a mode the driver does not report follows from the partitions per GPU
    (compute) or is the chip's first valid one for that compute mode (memory: it changes no preset figure)."""
    compute_mode = found.compute_mode or MODE_FOR_PARTITIONS.get(len(found.groups[0]))
    if compute_mode is None:
        raise TopologyError(f"sysfs shows {len(found.groups[0])} partitions per GPU and no compute mode, expected "
                            f"1, 2, 4 or 8; set a supported mode (amd-smi set --compute-partition) or pass "
                            f"STARSCREAM_TOPOLOGY explicitly")
    memory_mode = found.memory_mode or next(iter(load_chip(chip_name).memory_modes(compute_mode)), "NPS1")
    return preset_for(chip_name, compute_mode, memory_mode)


def physical_gpu_groups(devices: Sequence, topology: Topology) -> list[list]:
    """The devices grouped by physical GPU, each group in partition order, groups ordered by (process, first id).

    ROCm: read from sysfs. CPU: consecutive devices of one process form a GPU (devices left over after the last
    whole GPU are not used). Other platforms: each device is its own GPU.
    """
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


def _explicit_groups(devices: Sequence, grouping: Sequence[Sequence[int]]) -> list[list]:
    """The devices named by `grouping` (device ids, one list per physical GPU), checked."""
    by_id = {d.id: d for d in devices}
    as_lists = [list(group) for group in grouping]
    if not as_lists or not all(as_lists):
        raise TopologyError(f"grouping {as_lists} has an empty GPU; give one non-empty list of device ids per GPU")
    flat = [i for group in as_lists for i in group]
    unknown = sorted(set(flat) - set(by_id))
    if unknown:
        raise TopologyError(f"grouping names device ids {unknown} that JAX does not have (ids: {sorted(by_id)}); "
                            f"use ids from jax.devices()")
    twice = sorted({i for i in flat if flat.count(i) > 1})
    if twice:
        raise TopologyError(f"grouping lists device(s) {twice} more than once; each device belongs to one GPU")
    sizes = sorted({len(g) for g in as_lists})
    if len(sizes) != 1:
        raise TopologyError(f"grouping has GPUs with {sizes} partitions; every GPU must have the same number")
    groups = [[by_id[i] for i in group] for group in as_lists]
    split = [[d.id for d in group] for group in groups if len({d.process_index for d in group}) > 1]
    if split:
        raise TopologyError(f"grouping puts devices of different processes in one GPU ({split[0]}); a GPU's "
                            f"partitions belong to one process")
    return groups


def _consecutive_groups(devices: Sequence, partitions: int) -> list[list]:
    """Each process' devices in id order, cut into GPUs of `partitions` devices."""
    groups = []
    for process in sorted({d.process_index for d in devices}):
        local = sorted((d for d in devices if d.process_index == process), key=lambda d: d.id)
        groups += [local[i:i + partitions] for i in range(0, len(local) - partitions + 1, partitions)]
    return groups


def _rocm_groups(devices: Sequence) -> list[list]:
    """Groups ROCm devices by the physical GPU that sysfs names (KFD location_id / PCI domain:bus:device).

    Every process reads its own node's sysfs; nodes are assumed alike (same GPUs, same mode), which the device
    count check in `build_mesh` backs up.
    """
    found = _detect_rocm()
    if found is None:
        raise TopologyError("JAX runs on ROCm but /sys/class/kfd shows no GPU nodes, so which partitions share a GPU "
                            "is unknown; run on the host (or mount /sys into the container), or pass "
                            "grouping=[[ids of GPU 0], [ids of GPU 1], ...]")
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
    """(Topology, Mesh): the mesh has shape (data, gpu // data, xcd), Explicit axes, and each xcd row is one GPU.

    topology: a Topology, an override string ("8x8", "2x8x8", "mi300x-cpx-nps1:4") or None ($STARSCREAM_TOPOLOGY,
        then detection; with simulate, $STARSCREAM_TOPOLOGY, then the cpu preset).
    gpus / nodes: use this many GPUs per node / nodes. The GPUs split evenly over the processes, each process
        giving its first ones (a subset of what a process has is fine).
    data: the size of the outer data-parallel axis; it must divide the number of GPUs.
    grouping: device ids per physical GPU, e.g. [[0, 1], [2, 3]], in place of detection.
    devices: the devices to use (default: all). simulate: build on simulated CPU devices.
    """
    import jax

    if simulate:
        topology, devices = _simulated(topology, gpus, nodes, grouping, devices)
    devices = list(devices or jax.devices())
    groups = _explicit_groups(devices, grouping) if grouping is not None else None
    topology = resolve_topology(topology, gpus=gpus, nodes=nodes, devices=devices, groups=groups)
    chosen = _choose_gpus(groups or physical_gpu_groups(devices, topology), topology, devices)
    return topology, _mesh(chosen, topology, data)


def _simulated(topology, gpus, nodes, grouping, devices) -> tuple:
    """(topology, CPU devices) for a simulated mesh; starts the simulated devices when JAX has not started yet."""
    import jax

    if grouping is None:
        topology = resolve_topology(topology or override_from_env() or DEFAULT_SIMULATED, gpus=gpus, nodes=nodes)
        simulate_cpu_devices(-(-topology.num_devices // _joined_processes()))
    else:
        simulate_cpu_devices(1 + max((i for group in grouping for i in group), default=0))
    return topology, devices or jax.devices("cpu")


def _joined_processes() -> int:
    """How many processes jax.distributed has joined (1 before or without it); does not start the backend."""
    from jax._src import distributed

    return distributed.global_state.num_processes


def _choose_gpus(groups: list[list], topology: Topology, devices: Sequence) -> list[list]:
    """The first num_gpus / P GPUs of each of the P processes (a subset of each process' GPUs is fine)."""
    partitions = {len(g) for g in groups}
    if partitions != {topology.partitions_per_gpu}:
        raise TopologyError(
            f"found GPUs with {sorted(partitions)} partitions each, expected {topology.partitions_per_gpu} "
            f"({topology.compute_mode}); check the partition mode (amd-smi) or pick the preset that matches it")
    processes = sorted({g[0].process_index for g in groups})
    if topology.num_gpus % len(processes):
        raise TopologyError(
            f"the topology's {topology.nodes} node(s) x {topology.gpus_per_node} GPUs do not split evenly over "
            f"{len(processes)} processes; make --nodes / --gpus match the launch")
    per_process = topology.num_gpus // len(processes)
    chosen = []
    for process in processes:
        local = [g for g in groups if g[0].process_index == process]
        if len(local) < per_process:
            shown = sum(d.process_index == process for d in devices)
            raise TopologyError(
                f"the topology needs {topology.num_gpus} GPUs x {topology.partitions_per_gpu} partitions = "
                f"{topology.num_devices} devices, {per_process} GPUs from each of {len(processes)} process(es), but "
                f"process {process} shows {shown} devices ({len(local)} whole GPUs); ask for fewer GPUs (--gpus) or "
                f"simulate {per_process * topology.partitions_per_gpu} devices per process (--simulate)")
        chosen += local[:per_process]
    return chosen


def _mesh(chosen: list[list], topology: Topology, data: int):
    """The Mesh of shape (data, gpus // data, partitions) whose row (d, g) holds one GPU's partitions in order."""
    from jax.sharding import AxisType, Mesh

    if data < 1 or len(chosen) % data:
        raise TopologyError(f"data={data} (--data-parallel) does not divide the {len(chosen)} GPUs; pick a "
                            f"divisor of {len(chosen)}")
    cells = np.empty((len(chosen), topology.partitions_per_gpu), dtype=object)
    for row, group in enumerate(chosen):
        cells[row, :] = group
    grid = cells.reshape(data, len(chosen) // data, topology.partitions_per_gpu)
    return Mesh(grid, AXES, axis_types=(AxisType.Explicit,) * len(AXES))


def device_table(mesh) -> list[list[list[int]]]:
    """Device ids at each (data, gpu, xcd) of the mesh."""
    return [[[int(d.id) for d in row] for row in plane] for plane in mesh.devices]


GPU_DEVICE_NODES = {"cuda": "/dev/nvidiactl", "rocm": "/dev/kfd"}
"""The device node each GPU driver creates; a JAX GPU plugin without it finds no GPU."""


def accelerator_present() -> bool:
    """Whether JAX will run on GPUs here, judged without starting JAX: $JAX_PLATFORMS when it is set, else an
    installed JAX GPU plugin (jax[cuda13], jax[rocm7-local]) whose driver's device node exists."""
    platforms = [name.strip() for name in os.environ.get("JAX_PLATFORMS", "").split(",") if name.strip()]
    if platforms:
        return any(name != "cpu" for name in platforms)
    plugins = [entry.name for entry in importlib.metadata.entry_points(group="jax_plugins")]
    return any(kind in plugin and Path(node).exists() for kind, node in GPU_DEVICE_NODES.items() for plugin in plugins)


def device_ids(text: str) -> list[int]:
    """"0,1" -> [0, 1]: the device ids of one physical GPU, as the command line gives them (--grouping)."""
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated device ids, e.g. 0,1") from None


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
        return parse_override(args.topology)
    if args.preset:
        return Topology.from_preset(args.preset, gpus=args.default_gpus)
    override = override_from_env()
    if override is not None or args.default_preset is None or args.grouping or not _simulating(args):
        return override
    return Topology.from_preset(args.default_preset, gpus=args.default_gpus)


def _simulating(args) -> bool:
    """--simulate / --no-simulate, or when neither was given and the command leaves it open, whether no GPU is
    present (decided once, before JAX starts)."""
    if args.simulate is None:
        args.simulate = not accelerator_present()
    return args.simulate


def prepare_simulation(args) -> None:
    """With --simulate, makes JAX expose the simulated devices. Runs before jax is imported where it can."""
    if _simulating(args) and args.grouping:
        simulate_cpu_devices(1 + max(i for group in args.grouping for i in group))
    elif _simulating(args):
        topology = _topology_from_args(args) or DEFAULT_SIMULATED
        simulate_cpu_devices(resolve_topology(topology, gpus=args.gpus, nodes=args.nodes).num_devices)


def mesh_from_args(args):
    """(Topology, Mesh) from the mesh arguments."""
    return build_topology_mesh(_topology_from_args(args), gpus=args.gpus, nodes=args.nodes,
                               data=args.data_parallel, grouping=args.grouping, simulate=_simulating(args))
