"""ROCm topology detection: which logical GPU devices share one physical GPU, read from KFD sysfs (and amd-smi).

What this relies on, each point read in public sources:
- Every GPU compute partition is a KFD topology node, /sys/class/kfd/kfd/topology/nodes/N: a `properties` file of
  "name value" lines and a `gpu_id` file (0 on CPU nodes). ROCr treats a node as a GPU when its simd_count is not 0
  and numbers the GPU agents in node order (ROCR-Runtime amd_topology.cpp).
- The thunk (libhsakmt topology.c) skips a GPU node whose /dev/dri/renderD<drm_render_minor> does not open, and the
  kernel refuses to show a node the process's device cgroup does not allow (EPERM): both hide partitions in
  containers.
- location_id = PCI bus << 8 | device << 3 | function, `domain` is the PCI domain; on a GPU with several partitions
  the kernel adds the partition index in bits 31:28 (kfd_topology.c), older drivers in bits 2:0 (ROCm SMI changelog,
  ROCm 6.2). unique_id is per partition since ROCm 7, so it never names the physical GPU.
- ROCR_VISIBLE_DEVICES picks and orders GPU agents by index or UUID (amd_filter_device.cpp); HIP_VISIBLE_DEVICES, or
  CUDA_VISIBLE_DEVICES when that is empty, picks among those (CLR rocdevice.cpp). The position that results is the
  HIP ordinal, which XLA makes a JAX device's local_hardware_id.
- amdgpu shows current_compute_partition and current_memory_partition on the GPU's PCI device.
- `amd-smi list --json` gives gpu, bdf, uuid, kfd_id, node_id and partition_id per logical GPU, `amd-smi static
  --json` a `partition` section; newer releases wrap the list as {"gpu_data": [...]}. Current drivers print every
  partition with function 0 in the bdf and the partition in partition_id; older ones put it in the function digit.
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import TopologyError

KFD_NODES = "sys/class/kfd/kfd/topology/nodes"
RENDER_NODES = "dev/dri"
NOT_AVAILABLE = "N/A"
# Compute modes whose partition count does not depend on the chip; CPX is one partition per XCD.
PARTITIONS_PER_FIXED_MODE = {"SPX": 1, "DPX": 2, "TPX": 3, "QPX": 4}
GPU_NODE_FIELDS = ("location_id", "domain", "drm_render_minor")
EXPLICIT = "pass the preset and the grouping explicitly (--preset with --grouping: detection then does not run)"
"""The way past a machine detection cannot read: a grouping alone still detects the mode, so it meets the same error."""
_BDF = re.compile(r"([0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2})\.[0-7]")


@dataclass(frozen=True, kw_only=True)
class GpuPartition:
    """One compute partition of a physical GPU: one KFD GPU node, one logical HIP device.

    hip_ordinal: index among the GPU agents this process sees, which is jax Device.local_hardware_id on ROCm; None
      when the runtime hides the node (visible-device variables, or its render node does not open).
    kfd_node: the KFD topology node number. gpu_id: the physical GPU as PCI "dddd:bb:dd" (function dropped).
    partition: the partition's index inside its GPU. kfd_gpu_id: the node's KFD gpu_id (amd-smi's kfd_id).
    unique_id: the node's unique_id (each partition has its own since ROCm 7). num_xcc: XCDs in the partition (None
      where the kernel does not say). simd_count, drm_render_minor: as KFD reports them.
    """

    hip_ordinal: int | None
    kfd_node: int
    gpu_id: str
    partition: int
    kfd_gpu_id: int
    unique_id: int
    num_xcc: int | None
    simd_count: int
    drm_render_minor: int


@dataclass(frozen=True, kw_only=True)
class AmdSmiGpu:
    """One logical GPU as `amd-smi list --json` or `amd-smi static --json` reports it; None where it says N/A.

    index: amd-smi's own GPU number. gpu_id: the bdf without its function digit. kfd_node, kfd_gpu_id: "node_id" and
    "kfd_id" (list only). partition: "partition_id". compute_mode, memory_mode: the static `partition` section
    (only partition 0 of a GPU reports them).
    """

    index: int
    bdf: str
    gpu_id: str
    kfd_node: int | None
    kfd_gpu_id: int | None
    partition: int | None
    compute_mode: str | None
    memory_mode: str | None


@dataclass(frozen=True)
class RocmTopology:
    """What detection found on this machine.

    groups: one tuple per physical GPU, ordered by PCI address, holding the partitions this process sees in partition
      order; every GPU has the same number. compute_mode, memory_mode: e.g. "CPX", "NPS1"; None when unknown.
    """

    groups: tuple[tuple[GpuPartition, ...], ...]
    compute_mode: str | None
    memory_mode: str | None


def read_properties(path: Path) -> dict[str, int]:
    """A KFD `properties` file as {name: value}; each line is "name value" with a decimal value."""
    values = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        words = line.split()
        if not words:
            continue
        if len(words) != 2 or not words[1].isdigit():
            raise TopologyError(f"{path} line {number} reads {line!r}, expected 'name value' with a decimal value; "
                                f"point detection at a KFD topology nodes directory")
        values[words[0]] = int(words[1])
    return values


def physical_gpu_id(location_id: int, domain: int) -> str:
    """PCI "dddd:bb:dd" of the GPU a KFD node belongs to: location_id bits 15:8 are the bus, 7:3 the device."""
    return f"{domain:04x}:{(location_id >> 8) & 0xFF:02x}:{(location_id >> 3) & 0x1F:02x}"


def read_kfd_partitions(nodes_dir: str | Path = "/" + KFD_NODES, rocr_visible_devices: str | None = None,
                        hip_visible_devices: str | None = None,
                        render_dir: str | Path | None = "/" + RENDER_NODES) -> list[GpuPartition]:
    """Every GPU node of the KFD topology this process may read, in node order, with its HIP ordinal.

    rocr_visible_devices / hip_visible_devices: the values of ROCR_VISIBLE_DEVICES and HIP_VISIBLE_DEVICES (None:
    unset). render_dir: where renderD<minor> devices live; None skips the check that they open.
    """
    nodes = _read_gpu_nodes(Path(nodes_dir))
    partition_of = _partition_indices(nodes)
    partitions = [_partition(number, props, kfd_gpu_id, partition_of[number])
                  for number, props, kfd_gpu_id in nodes]
    agents = [p for p in partitions if _render_node_opens(render_dir, p.drm_render_minor)]
    if rocr_visible_devices is not None:
        agents = _select_devices(rocr_visible_devices, agents, "ROCR_VISIBLE_DEVICES")
    if hip_visible_devices:
        agents = _select_devices(hip_visible_devices, agents, "HIP_VISIBLE_DEVICES (or CUDA_VISIBLE_DEVICES)")
    ordinal = {p.kfd_node: index for index, p in enumerate(agents)}
    return [replace(p, hip_ordinal=ordinal.get(p.kfd_node)) for p in partitions]


def _read_gpu_nodes(nodes_dir: Path) -> list[tuple[int, dict[str, int], int]]:
    """(node number, properties, KFD gpu_id) of each GPU node in numeric node order; nodes the kernel refuses to show
    (EPERM: outside this container's device cgroup) are left out, as the thunk leaves them out."""
    numbers = sorted(int(entry.name) for entry in nodes_dir.iterdir() if entry.name.isdigit())
    nodes = []
    for number in numbers:
        node_dir = nodes_dir / str(number)
        try:
            props = read_properties(node_dir / "properties")
            kfd_gpu_id = int((node_dir / "gpu_id").read_text())
        except PermissionError:
            continue
        if props.get("simd_count", 0) == 0:
            continue
        missing = [name for name in GPU_NODE_FIELDS if name not in props]
        if missing:
            raise TopologyError(f"{node_dir}/properties has no {', '.join(missing)}; a GPU node needs "
                                f"{', '.join(GPU_NODE_FIELDS)}; this amdkfd is older than detection supports: "
                                f"{EXPLICIT}")
        nodes.append((number, props, kfd_gpu_id))
    return nodes


def _refused_nodes(nodes_dir: Path) -> bool:
    """Whether the kernel refuses this process some KFD node (EPERM: a GPU partition outside the container's device
    cgroup; a CPU node is never refused). A device plugin may give a container some partitions of a GPU, so then a
    GPU's other partitions are hidden, not missing."""
    for entry in (entry for entry in nodes_dir.iterdir() if entry.name.isdigit()):
        try:
            (entry / "gpu_id").read_text()
        except PermissionError:
            return True
    return False


def _partition_indices(nodes: Sequence[tuple[int, dict[str, int], int]]) -> dict[int, int]:
    """Node number -> partition index: location_id bits 31:28, or bits 2:0 on a GPU whose nodes all have 0 there."""
    gpu_of = {number: physical_gpu_id(props["location_id"], props["domain"]) for number, props, _ in nodes}
    high_bits_used = {gpu_of[number] for number, props, _ in nodes if (props["location_id"] >> 28) & 0xF}
    return {number: ((props["location_id"] >> 28) & 0xF) if gpu_of[number] in high_bits_used
            else props["location_id"] & 0x7 for number, props, _ in nodes}


def _partition(number: int, props: dict[str, int], kfd_gpu_id: int, partition: int) -> GpuPartition:
    return GpuPartition(
        hip_ordinal=None, kfd_node=number, gpu_id=physical_gpu_id(props["location_id"], props["domain"]),
        partition=partition, kfd_gpu_id=kfd_gpu_id, unique_id=props.get("unique_id", 0), num_xcc=props.get("num_xcc"),
        simd_count=props["simd_count"], drm_render_minor=props["drm_render_minor"])


def _render_node_opens(render_dir: str | Path | None, minor: int) -> bool:
    return render_dir is None or os.access(Path(render_dir) / f"renderD{minor}", os.R_OK | os.W_OK)


def _select_devices(value: str, agents: list[GpuPartition], variable: str) -> list[GpuPartition]:
    """The agents a visible-devices list picks, in the list's order (which becomes the HIP order).

    Tokens are indices into `agents` or UUIDs "GPU-<unique_id as 16 hex digits>" (a unique prefix will do). An empty
    ROCR_VISIBLE_DEVICES shows no GPU. Where the runtimes silently drop a bad or repeated token (ROCr also every token
    after it), this raises.
    """
    if not value:
        return []
    chosen: list[int] = []
    for token in (t.strip() for t in value.split(",")):
        index = _token_index(token, agents)
        if index is None or index in chosen:
            raise TopologyError(
                f"{variable}={value!r}: {token!r} is not a new device index (0-{len(agents) - 1}) or GPU-<unique id> "
                f"of this machine, and the runtime would drop it; list each visible device once, by index or UUID")
        chosen.append(index)
    return [agents[i] for i in chosen]


def _token_index(token: str, agents: list[GpuPartition]) -> int | None:
    if token.upper().startswith("GPU-"):
        matches = [i for i, p in enumerate(agents) if f"GPU-{p.unique_id:016X}".startswith(token.upper())]
        return matches[0] if len(matches) == 1 else None
    if token.isdigit() and token == str(int(token)) and int(token) < len(agents):
        return int(token)
    return None


def group_by_gpu(partitions: Iterable[GpuPartition], hidden: bool = False) -> list[list[GpuPartition]]:
    """The partitions grouped by physical GPU: groups ordered by gpu_id, each in partition order.

    Every GPU must show partitions 0..P-1 for one P, one KFD node each; TopologyError otherwise. hidden: the kernel
    refuses this process some GPU nodes, so a GPU may show only some of its partitions (one node each still).
    """
    groups: dict[str, list[GpuPartition]] = {}
    for p in sorted(partitions, key=lambda p: (p.gpu_id, p.partition)):
        groups.setdefault(p.gpu_id, []).append(p)
    if not groups:
        return []
    for group in groups.values():
        _check_one_node_per_partition(group)
    if hidden:
        return list(groups.values())
    count = 1 + max(p.partition for group in groups.values() for p in group)
    complete = next((gpu for gpu, group in groups.items() if len(group) == count), None)
    for gpu, group in groups.items():
        found = [p.partition for p in group]
        if found != list(range(count)):
            missing = sorted(set(range(count)) - set(found))
            example = f" as GPU {complete} does" if complete else ""
            raise TopologyError(
                f"GPU {gpu} shows partitions {found} in KFD sysfs, expected 0-{count - 1}{example}; partition(s) "
                f"{missing} missing: check dmesg for amdgpu errors and set every GPU to the same compute mode "
                f"(amd-smi set --compute-partition MODE); in a container, pass all of a GPU's render nodes; or "
                f"{EXPLICIT}")
    return list(groups.values())


def _check_one_node_per_partition(group: list[GpuPartition]) -> None:
    for first, second in zip(group, group[1:]):
        if first.partition == second.partition:
            raise TopologyError(
                f"KFD nodes {first.kfd_node} and {second.kfd_node} both claim partition {first.partition} of GPU "
                f"{first.gpu_id}, expected one node per partition; this driver encodes location_id in a way detection "
                f"does not know: {EXPLICIT}, and report both nodes' properties files")


def visible_groups(groups: Sequence[Sequence[GpuPartition]]) -> tuple[tuple[GpuPartition, ...], ...]:
    """Each GPU's partitions that have a HIP ordinal; GPUs with none are dropped. Every GPU left must show as many."""
    visible = [tuple(p for p in group if p.hip_ordinal is not None) for group in groups]
    visible = [group for group in visible if group]
    if not visible:
        total = sum(len(group) for group in groups)
        raise TopologyError(
            f"KFD shows {total} GPU partitions but this process can use none of them; check ROCR_VISIBLE_DEVICES / "
            f"HIP_VISIBLE_DEVICES, that the user is in the render group, and that the container gets /dev/dri")
    counts = {group[0].gpu_id: len(group) for group in visible}
    if len(set(counts.values())) > 1:
        raise TopologyError(
            f"visible partitions per GPU differ ({counts}), expected the same number on every GPU; make whole GPUs "
            f"or equal shares of each visible (ROCR_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES)")
    return tuple(visible)


def read_partition_modes(gpu_id: str, sys_root: str | Path = "/sys") -> tuple[str, str] | None:
    """(compute mode, memory mode), e.g. ("CPX", "NPS1"), from the GPU's PCI device; None if the driver has neither.

    gpu_id is "dddd:bb:dd"; the GPU is PCI function 0.
    """
    device = Path(sys_root) / "bus" / "pci" / "devices" / f"{gpu_id}.0"
    try:
        return ((device / "current_compute_partition").read_text().strip().upper(),
                (device / "current_memory_partition").read_text().strip().upper())
    except FileNotFoundError:
        return None


def _common_modes(groups: Sequence[Sequence[GpuPartition]], sys_root: Path) -> tuple[str | None, str | None]:
    modes = {group[0].gpu_id: read_partition_modes(group[0].gpu_id, sys_root) for group in groups}
    distinct = set(modes.values()) - {None}
    if len(distinct) > 1:
        shown = {gpu: "/".join(pair) for gpu, pair in modes.items() if pair}
        raise TopologyError(f"GPUs are in different partition modes ({shown}), expected one mode on every GPU; set "
                            f"them alike (amd-smi set --compute-partition MODE --memory-partition NPSn)")
    return distinct.pop() if distinct else (None, None)


def _check_compute_mode(groups: Sequence[Sequence[GpuPartition]], compute_mode: str | None,
                        hidden: bool = False) -> None:
    """The partition count per GPU must fit the mode: SPX/DPX/TPX/QPX 1/2/3/4 (unless partitions are hidden, see
    `group_by_gpu`), CPX one XCD per partition."""
    if compute_mode is None:
        return
    per_gpu = len(groups[0])
    xcds = sorted({p.num_xcc for group in groups for p in group if p.num_xcc is not None})
    expected = PARTITIONS_PER_FIXED_MODE.get(compute_mode)
    miscounted = expected is not None and per_gpu != expected and not hidden
    if miscounted or (compute_mode == "CPX" and xcds not in ([], [1])):
        raise TopologyError(
            f"the driver reports compute mode {compute_mode} but KFD shows {per_gpu} partition(s) per GPU with {xcds} "
            f"XCD(s) each; a partition change is still pending: reload amdgpu (or reboot) and check "
            f"`amd-smi static --partition`")


def parse_amd_smi(json_text: str) -> list[AmdSmiGpu]:
    """The logical GPUs of `amd-smi list --json` or `amd-smi static --json`: a list, {"gpu_data": [...]}, or the bare
    object of one GPU (amd-smi of ROCm 6.0 prints a single GPU so)."""
    try:
        data = json.loads(json_text)
    except json.JSONDecodeError as error:
        raise TopologyError(f"amd-smi output is not JSON ({error}); run amd-smi with --json") from error
    if isinstance(data, dict) and "gpu" in data:
        data = [data]
    entries = data.get("gpu_data") if isinstance(data, dict) else data
    if not isinstance(entries, list):
        raise TopologyError(f"amd-smi JSON is a {type(data).__name__} without a GPU list, expected a list of GPUs or "
                            f"{{'gpu_data': [...]}}; pass the output of `amd-smi list --json`")
    return [_amd_smi_gpu(entry) for entry in entries]


def _amd_smi_gpu(entry: Mapping) -> AmdSmiGpu:
    bus = entry.get("bus") if isinstance(entry.get("bus"), Mapping) else {}
    partition = entry.get("partition") if isinstance(entry.get("partition"), Mapping) else {}
    bdf = str(entry.get("bdf", bus.get("bdf")))
    match = _BDF.fullmatch(bdf)
    if match is None:
        raise TopologyError(f"amd-smi GPU {entry.get('gpu')} has bdf {bdf!r}, expected dddd:bb:dd.f; pass the output "
                            f"of `amd-smi list --json` or `amd-smi static --json`")
    return AmdSmiGpu(
        index=int(entry["gpu"]), bdf=bdf, gpu_id=match.group(1).lower(), kfd_node=_known_int(entry.get("node_id")),
        kfd_gpu_id=_known_int(entry.get("kfd_id")),
        partition=_known_int(entry.get("partition_id", partition.get("partition_id"))),
        compute_mode=_known_text(partition.get("compute_partition", partition.get("accelerator_partition"))),
        memory_mode=_known_text(partition.get("memory_partition")))


def _known_int(value) -> int | None:
    return None if value in (None, NOT_AVAILABLE) else int(value)


def _known_text(value) -> str | None:
    return None if value in (None, NOT_AVAILABLE) else str(value).upper()


def check_against_amd_smi(partitions: Sequence[GpuPartition], amd_smi_gpus: Sequence[AmdSmiGpu],
                          modes: tuple[str | None, str | None] = (None, None)) -> None:
    """Every GPU amd-smi shows must be the KFD node it names, on the same physical GPU and partition; where amd-smi
    reports partition modes they must equal `modes` (compute, memory). TopologyError names the first disagreement."""
    for gpu in amd_smi_gpus:
        node = _kfd_match(gpu, partitions)
        said = f"amd-smi GPU {gpu.index} ({gpu.bdf}, KFD node {gpu.kfd_node}, partition {gpu.partition})"
        if node is None:
            raise TopologyError(f"{said} matches no KFD GPU node, expected one; amd-smi and the driver disagree: use "
                                f"the amd-smi of the driver's ROCm release, or {EXPLICIT}")
        facts = [("physical GPU", gpu.gpu_id, node.gpu_id), ("partition", gpu.partition, node.partition),
                 ("kfd_id", gpu.kfd_gpu_id, node.kfd_gpu_id), ("compute mode", gpu.compute_mode, modes[0]),
                 ("memory mode", gpu.memory_mode, modes[1])]
        for name, theirs, ours in facts:
            if theirs is not None and ours is not None and theirs != ours:
                raise TopologyError(
                    f"{said} says {name} {theirs} but KFD sysfs says {ours} for node {node.kfd_node}; amd-smi and the "
                    f"driver disagree: use the amd-smi of the driver's ROCm release, or {EXPLICIT}")


def _kfd_match(gpu: AmdSmiGpu, partitions: Sequence[GpuPartition]) -> GpuPartition | None:
    """The KFD node amd-smi names (node_id), else the one at its GPU and partition, else any node of its GPU."""
    if gpu.kfd_node is not None:
        return next((p for p in partitions if p.kfd_node == gpu.kfd_node), None)
    return next((p for p in partitions if p.gpu_id == gpu.gpu_id and gpu.partition in (None, p.partition)), None)


def detect_rocm_topology(root: str | Path = "/", env: Mapping[str, str] | None = None,
                         amd_smi_json: str | None = None) -> RocmTopology | None:
    """The physical GPUs of this ROCm machine and the partitions of each this process sees; None without KFD GPUs.

    root: where sys/ and dev/ are (a fake tree in tests). env: the environment (default os.environ), for
    ROCR_VISIBLE_DEVICES, HIP_VISIBLE_DEVICES and CUDA_VISIBLE_DEVICES. amd_smi_json: output of `amd-smi list --json`
    or `amd-smi static --json` to cross-check against. Raises TopologyError when the machine's facts disagree.
    """
    root = Path(root)
    nodes_dir = root / KFD_NODES
    if not nodes_dir.is_dir():
        return None
    env = os.environ if env is None else env
    partitions = read_kfd_partitions(
        nodes_dir, env.get("ROCR_VISIBLE_DEVICES"),
        env.get("HIP_VISIBLE_DEVICES") or env.get("CUDA_VISIBLE_DEVICES"), root / RENDER_NODES)
    if not partitions:
        return None
    hidden = _refused_nodes(nodes_dir)
    groups = group_by_gpu(partitions, hidden)
    modes = _common_modes(groups, root / "sys")
    _check_compute_mode(groups, modes[0], hidden)
    if amd_smi_json is not None:
        check_against_amd_smi(partitions, parse_amd_smi(amd_smi_json), modes)
    return RocmTopology(groups=visible_groups(groups), compute_mode=modes[0], memory_mode=modes[1])
