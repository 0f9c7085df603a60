"""ROCm topology detection on the live machine (run with `pytest -m rocm` on an MI300X / MI355X node; skipped where
KFD sysfs shows no GPU).

What KFD sysfs says (`detect.detect_rocm_topology`) is checked against amd-smi (`amd-smi list --json` and
`amd-smi static --json`, run here when amd-smi is on PATH) and against the devices JAX shows. Every message starts
with the compute / memory mode the node is in, so a failure says which mode it was seen in.
"""
import functools
import os
import shutil
import subprocess
from collections import defaultdict

import pytest

from starscream_jax.errors import TopologyError
from starscream_jax.hardware.detect import (
    PARTITIONS_PER_FIXED_MODE,
    detect_rocm_topology,
    group_by_gpu,
    parse_amd_smi,
    read_kfd_partitions,
)

pytestmark = pytest.mark.rocm

VISIBILITY_VARIABLES = ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")


def amd_smi_json(command: str) -> str:
    """The output of `amd-smi COMMAND --json`."""
    if shutil.which("amd-smi") is None:
        pytest.skip("needs amd-smi on PATH (ROCm's amd-smi package) to compare with")
    done = subprocess.run(["amd-smi", command, "--json"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"`amd-smi {command} --json` exited with {done.returncode}: {done.stderr.strip()}"
    return done.stdout


@functools.cache
def detected():
    """What detection reads from this machine's sysfs, without amd-smi."""
    topology = detect_rocm_topology()
    assert topology is not None, "KFD sysfs shows GPU nodes but detect_rocm_topology found none"
    return topology


def mode_line(topology) -> str:
    """e.g. 'compute mode CPX, memory mode NPS1: 8 GPUs x 8 partitions visible'."""
    compute = topology.compute_mode or "not reported by the driver"
    memory = topology.memory_mode or "not reported by the driver"
    return (f"compute mode {compute}, memory mode {memory}: {len(topology.groups)} GPU(s) x "
            f"{len(topology.groups[0])} partition(s) visible")


def cross_checked(amd_smi_output: str):
    """Detection cross-checked against amd-smi output; a disagreement fails with the mode in the message."""
    try:
        return detect_rocm_topology(amd_smi_json=amd_smi_output)
    except TopologyError as error:
        pytest.fail(f"{mode_line(detected())}; {error}")


def all_partitions_visible() -> bool:
    return not any(os.environ.get(name) for name in VISIBILITY_VARIABLES)


def test_sysfs_shows_whole_gpus_in_one_mode():
    topology = detected()
    mode = mode_line(topology)
    print(mode)
    gpu_ids = [group[0].gpu_id for group in topology.groups]
    assert gpu_ids == sorted(set(gpu_ids)), f"{mode}; GPUs {gpu_ids} should be distinct and ordered by PCI address"
    for group in topology.groups:
        indices = [p.partition for p in group]
        assert indices == sorted(set(indices)), f"{mode}; GPU {group[0].gpu_id} lists partitions {indices}"
    ordinals = sorted(p.hip_ordinal for group in topology.groups for p in group)
    assert ordinals == list(range(len(ordinals))), f"{mode}; HIP ordinals {ordinals} should be 0..N-1"
    expected = PARTITIONS_PER_FIXED_MODE.get(topology.compute_mode)
    if all_partitions_visible() and expected is not None:
        assert len(topology.groups[0]) == expected, f"{mode}; {topology.compute_mode} means {expected} per GPU"
    if topology.compute_mode == "CPX":
        xcds = {p.num_xcc for group in topology.groups for p in group} - {None}
        assert xcds <= {1}, f"{mode}; CPX partitions should hold one XCD each, sysfs shows {sorted(xcds)}"


def test_grouping_matches_amd_smi_list():
    listing = amd_smi_json("list")
    mode = mode_line(detected())
    sysfs = {group[0].gpu_id: sorted(p.kfd_node for p in group)
             for group in group_by_gpu(read_kfd_partitions(render_dir=None))}
    amd_smi = defaultdict(list)
    for gpu in parse_amd_smi(listing):
        amd_smi[gpu.gpu_id].append(gpu.kfd_node)
    nodes_known = all(None not in nodes for nodes in amd_smi.values())
    amd_smi_view = {gpu: sorted(nodes) if nodes_known else len(nodes) for gpu, nodes in amd_smi.items()}
    sysfs_view = {gpu: nodes if nodes_known else len(nodes) for gpu, nodes in sysfs.items()}
    assert amd_smi_view == sysfs_view, (f"{mode}; amd-smi groups KFD nodes by GPU as {amd_smi_view}, sysfs as "
                                        f"{sysfs_view}")
    assert cross_checked(listing).groups == detected().groups, mode


def test_modes_match_amd_smi_static():
    static = amd_smi_json("static")
    topology = cross_checked(static)
    reported = {(gpu.compute_mode, gpu.memory_mode) for gpu in parse_amd_smi(static) if gpu.compute_mode}
    print(mode_line(topology))
    if topology.compute_mode is not None:
        assert reported <= {(topology.compute_mode, topology.memory_mode)}, (
            f"{mode_line(topology)}; amd-smi static reports (compute, memory) modes {sorted(reported)}")


def test_jax_mesh_follows_the_detected_grouping():
    import jax

    from starscream_jax.hardware.mesh import build_mesh

    if "rocm" not in jax.devices()[0].client.platform_version.lower():
        pytest.skip(f"needs JAX with the ROCm plugin (jax[rocm7-local]); JAX runs on {jax.devices()[0].platform}")
    if jax.process_count() > 1:
        pytest.skip("compares the mesh with this node's sysfs: run it in one process")
    topology = detected()
    mesh = build_mesh()
    mode = mode_line(topology)
    assert dict(mesh.shape) == {"data": 1, "gpu": len(topology.groups), "xcd": len(topology.groups[0])}, mode
    ordinals = [[device.local_hardware_id for device in row] for row in mesh.devices[0]]
    expected = [[p.hip_ordinal for p in group] for group in topology.groups]
    assert ordinals == expected, f"{mode}; mesh rows hold HIP ordinals {ordinals}, sysfs groups them as {expected}"
