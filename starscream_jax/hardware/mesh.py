"""The mesh builder: every logical device placed at (data, gpu, xcd), each `xcd` row one physical GPU.

The grouping of logical devices into physical GPUs is read from the machine (ROCm: KFD sysfs, see `detect`), given
explicitly (`grouping=`), or simulated on CPU (consecutive devices of one process form one GPU). JAX itself does not
expose it. The mesh always has the three axes ('data', 'gpu', 'xcd'), Explicit, so every rule sees the same names.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from ..checks import of_type
from ..errors import TopologyError
from ..jax_private import joined_processes
from . import detect
from .axes import AXES
from .presets import Preset, list_presets, load_chip, load_preset, preset_for
from .simulation import DEFAULT_SIMULATED, simulate_cpu_devices
from .topology import MODE_FOR_PARTITIONS, Topology, override_from_env, parse_override


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
    """The topology with gpus per node / nodes replaced where given (positive, and no more GPUs than a node of the
    chip holds)."""
    for name, value in (("gpus", gpus), ("nodes", nodes)):
        if value is not None and value < 1:
            raise TopologyError(f"{name}={value}; ask for a positive number of {name} (--{name})")
    counted = dataclasses.replace(topology, gpus_per_node=topology.gpus_per_node if gpus is None else gpus,
                                  nodes=topology.nodes if nodes is None else nodes)
    counted.validate()
    return counted


def _platform(device) -> str:
    version = getattr(device.client, "platform_version", "").lower()
    return "rocm" if "rocm" in version or device.platform == "rocm" else device.platform


ROCM_CHIPS = {"gfx942": "mi300x", "gfx950": "mi355x"}
"""The chip file of each GPU architecture a preset describes. Other parts of one architecture (MI300A, MI325X on
gfx942; MI350X on gfx950) have other figures and are refused by name."""
_PART_NAME = re.compile(r"\b(mi\d{3}[a-z]*)\b")
_FIXES = ("give the topology explicitly (STARSCREAM_TOPOLOGY=PRESET:GPUS uses that preset's figures knowingly) or "
          "add a chip file to meshes/chips/")


def _rocm_chip(device) -> str:
    """The chip of a ROCm device, by its architecture (compute_capability) and product name (device_kind):
    "mi300x" or "mi355x"; TopologyError naming the presets for any other part."""
    kind = str(getattr(device, "device_kind", ""))
    arch = str(getattr(device, "compute_capability", "")).lower().split(":")[0]
    chip = ROCM_CHIPS.get(arch)
    named = _PART_NAME.search(kind.lower())
    if chip is None or (named is not None and named.group(1) != chip):
        raise TopologyError(f"detected {kind or 'an AMD GPU'} ({arch or 'unknown architecture'}), which no preset "
                            f"describes (known: {', '.join(list_presets())}); {_FIXES}")
    return chip


def _other_gpu_preset(device) -> Preset:
    """The preset of a GPU that is not ROCm's: h200 for an H200 (by word: a GH200 has other figures); TopologyError
    naming the presets otherwise."""
    kind = device.device_kind
    if not re.search(r"\bh200\b", kind.lower()):
        raise TopologyError(f"detected {kind}, which no preset describes (known: {', '.join(list_presets())}); "
                            f"{_FIXES}")
    return load_preset("h200")


def detect_topology(devices: Sequence | None = None, groups: Sequence[Sequence] | None = None) -> Topology:
    """The topology of the devices JAX sees (default: all of them), one node per process.

    ROCm: the compute and memory mode and the partitions per GPU from sysfs (`detect.detect_rocm_topology`).
    CPU: the cpu preset, one device per GPU. Other GPUs: one device per GPU, an H200 with its preset; a GPU that no
    preset describes is a TopologyError (see `_rocm_chip`, `_other_gpu_preset`).
    `groups` (devices per physical GPU, given by the user) replace the partition and GPU counts.
    """
    devices = list(devices or jax.devices())
    processes = len({d.process_index for d in devices})
    platform = _platform(devices[0])
    found = _detect_rocm() if platform == "rocm" else None
    if found is not None:
        preset = _rocm_preset(_rocm_chip(devices[0]), found)
        partitions = len(found.groups[0])
    else:
        if platform == "rocm":  # no KFD partitions to read: whole GPUs
            preset = preset_for(_rocm_chip(devices[0]), "SPX", "NPS1")
        else:
            preset = load_preset("cpu") if platform == "cpu" else _other_gpu_preset(devices[0])
        partitions = 1
    if groups is not None:
        return Topology(preset=preset, nodes=processes, gpus_per_node=len(groups) // processes,
                        partitions_per_gpu=len(groups[0]))
    return Topology(preset=preset, nodes=processes, gpus_per_node=len(devices) // processes // partitions,
                    partitions_per_gpu=partitions)


def _detect_rocm():
    """What `detect.detect_rocm_topology` reads from this machine's sysfs (None without KFD GPU nodes)."""
    return detect.detect_rocm_topology()


def _rocm_preset(chip_name: str, found) -> Preset:
    """The preset of the detected modes; a mode the driver does not report follows from the partitions per GPU
    (compute) or is the chip's first valid one for that compute mode (memory: it changes no preset figure)."""
    chip = load_chip(chip_name)
    partitions = _partitions_per_gpu(found, chip.xcds)
    compute_mode = found.compute_mode or MODE_FOR_PARTITIONS.get(partitions)
    if compute_mode is None:
        raise TopologyError(f"sysfs shows {partitions} partitions per GPU and no compute mode, expected "
                            f"1, 2, 4 or 8; set a supported mode (amd-smi set --compute-partition) or pass "
                            f"STARSCREAM_TOPOLOGY explicitly")
    memory_mode = found.memory_mode or next(iter(chip.memory_modes(compute_mode)), "NPS1")
    return preset_for(chip_name, compute_mode, memory_mode)


def _partitions_per_gpu(found, xcds: int) -> int:
    """The partitions each GPU is split into: its XCDs over each partition's (KFD num_xcc), which holds when only
    some partitions are visible; the visible partitions where the kernel does not give num_xcc."""
    per_partition = found.groups[0][0].num_xcc
    return xcds // per_partition if per_partition else len(found.groups[0])


def physical_gpu_groups(devices: Sequence, topology: Topology) -> list[list]:
    """The devices grouped by physical GPU, each group in partition order, groups ordered by (process, first id).

    ROCm: read from sysfs (also for a topology of whole GPUs, so that the partitions of one GPU never pass for
    several GPUs). CPU: consecutive devices of one process form a GPU (devices left over after the last whole GPU are
    not used). Other platforms, and ROCm without KFD GPU nodes: each device is its own GPU.
    """
    platform = _platform(devices[0])
    if platform == "rocm" and (topology.partitions_per_gpu > 1 or _detect_rocm() is not None):
        return _rocm_groups(devices)
    if platform == "cpu":
        return _consecutive_groups(devices, topology.partitions_per_gpu)
    if topology.partitions_per_gpu != 1:
        raise TopologyError(
            f"{platform} devices are whole GPUs, but the topology asks for {topology.partitions_per_gpu} partitions "
            f"per GPU; pass grouping=[[ids of GPU 0], [ids of GPU 1], ...] to treat devices as partitions")
    return [[d] for d in sorted(devices, key=lambda d: (d.process_index, d.id))]


def _id_lists(grouping) -> list[list[int]]:
    """`grouping` as lists of device ids (ints), or a TopologyError saying what it should be."""
    try:
        groups = None if isinstance(grouping, (str, bytes)) else [list(group) for group in grouping]
    except TypeError:
        groups = None
    if groups is None or any(isinstance(i, bool) or not isinstance(i, (int, np.integer)) for g in groups for i in g):
        raise TopologyError(f"grouping {grouping!r}: expected device ids (ints, as jax.devices()[i].id) in one list "
                            "per physical GPU, e.g. [[0, 1], [2, 3]]")
    return [[int(i) for i in group] for group in groups]


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
    count check in `build_mesh` backs up. A GPU none of whose partitions is among a process' devices is not that
    process' (JAX_LOCAL_DEVICE_IDS, JAX_ROCM_VISIBLE_DEVICES or `devices` leave it out); one given in part is an error.
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
            if len(missing) == len(gpu):
                continue
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
    _check_options(topology, gpus, nodes, data)
    grouping = None if grouping is None else _id_lists(grouping)  # checked before the simulation reads it
    if simulate:
        topology, devices = _simulated(topology, gpus, nodes, grouping, devices)
    devices = list(devices or jax.devices())
    groups = _explicit_groups(devices, grouping) if grouping is not None else None
    topology = resolve_topology(topology, gpus=gpus, nodes=nodes, devices=devices, groups=groups)
    chosen = _choose_gpus(groups or physical_gpu_groups(devices, topology), topology, devices)
    return topology, _mesh(chosen, topology, data)


def _check_options(topology, gpus, nodes, data) -> None:
    """A TopologyError naming the first argument of `build_topology_mesh` of the wrong kind (each value's range is
    checked where it is used)."""
    of_type(topology, (Topology, str, type(None)), "topology",
            "a Topology, an override string such as '2x4' or 'mi300x-cpx-nps1:4', or None", TopologyError)
    for name, value in (("gpus", gpus), ("nodes", nodes), ("data", data)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TopologyError(f"{name} {value!r}: expected a whole number")


def _simulated(topology, gpus, nodes, grouping, devices) -> tuple:
    """(topology, CPU devices) for a simulated mesh; starts the simulated devices when JAX has not started yet."""
    if grouping is None:
        topology = resolve_topology(topology or override_from_env() or DEFAULT_SIMULATED, gpus=gpus, nodes=nodes)
        simulate_cpu_devices(-(-topology.num_devices // joined_processes()))
    else:
        simulate_cpu_devices(1 + max((i for group in grouping for i in group), default=0))
    return topology, devices or jax.devices("cpu")


def _choose_gpus(groups: list[list], topology: Topology, devices: Sequence) -> list[list]:
    """The first num_gpus / P GPUs of each of the P processes (a subset of each process' GPUs is fine)."""
    partitions = {len(g) for g in groups}
    if not groups:
        raise TopologyError(f"found no GPU (JAX sees {', '.join(sorted({d.platform for d in devices})) or 'no'} "
                            "devices); on a machine without GPUs pass --simulate for the mesh the preset gives")
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
    if data < 1 or len(chosen) % data:
        raise TopologyError(f"data={data} (--data-parallel) does not divide the {len(chosen)} GPUs; pick a "
                            f"divisor of {len(chosen)}")
    cells = np.empty((len(chosen), topology.partitions_per_gpu), dtype=object)
    for row, group in enumerate(chosen):
        cells[row, :] = group
    grid = cells.reshape(data, len(chosen) // data, topology.partitions_per_gpu)
    return Mesh(grid, AXES, axis_types=(AxisType.Explicit,) * len(AXES))


def auto_axes(mesh: Mesh) -> Mesh:
    """The same devices and axes with every axis Auto: XLA's sharding propagation places the arrays between the
    model's constraints, as models written for Flax's GSPMD guide (Linen's or NNX's logical constraints) expect."""
    of_type(mesh, Mesh, "mesh", "a jax.sharding.Mesh, as build_mesh gives", TopologyError)
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def device_table(mesh) -> list[list[list[int]]]:
    """Device ids at each (data, gpu, xcd) of the mesh."""
    return [[[int(d.id) for d in row] for row in plane] for plane in mesh.devices]


