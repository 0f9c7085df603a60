"""ROCm topology detection on fake machines: sysfs trees built from the kernel's documented format
(fixtures/sysfs.py) and amd-smi JSON in the shape amd-smi prints (fixtures/amd_smi/)."""
import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
from fixtures.sysfs import (
    FIRST_RENDER_MINOR,
    KFD_NODES,
    MI300X_BUSES,
    cpu_node,
    gpu_node,
    gpu_nodes,
    mi300x_node,
    published_nodes,
    unique_id,
    write_machine,
    write_modes,
)

from starscream_jax.errors import TopologyError
from starscream_jax.hardware.detect import (
    check_against_amd_smi,
    detect_rocm_topology,
    group_by_gpu,
    parse_amd_smi,
    read_kfd_partitions,
    read_partition_modes,
    read_properties,
)

AMD_SMI = Path(__file__).parent / "fixtures" / "amd_smi"


@pytest.fixture(scope="module")
def cpx_machine(tmp_path_factory) -> Path:
    """A CPX + NPS1 8 x MI300X machine that tests read but never change."""
    return mi300x_node(tmp_path_factory.mktemp("cpx"))


def amd_smi(name: str) -> str:
    return (AMD_SMI / name).read_text()


def kfd_nodes(topology) -> list[list[int]]:
    return [[p.kfd_node for p in group] for group in topology.groups]


def hip_ordinals(topology) -> list[list[int]]:
    return [[p.hip_ordinal for p in group] for group in topology.groups]


def consecutive(count: int, size: int, start: int = 0) -> list[list[int]]:
    return [list(range(start + size * i, start + size * (i + 1))) for i in range(count)]


def test_cpx_nps1_groups_64_partitions_into_8_gpus_by_pci_address(cpx_machine):
    topology = detect_rocm_topology(cpx_machine, env={}, amd_smi_json=amd_smi("mi300x_cpx_list.json"))
    assert [group[0].gpu_id for group in topology.groups] == list(MI300X_BUSES)
    assert [[p.partition for p in group] for group in topology.groups] == [list(range(8))] * 8
    assert kfd_nodes(topology) == consecutive(8, 8, start=2)      # nodes 0 and 1 are CPUs; node 10 follows 9
    assert hip_ordinals(topology) == consecutive(8, 8)
    assert {p.num_xcc for group in topology.groups for p in group} == {1}
    assert (topology.compute_mode, topology.memory_mode) == ("CPX", "NPS1")


def test_cpx_nps4_reads_the_memory_mode_and_agrees_with_amd_smi_static(tmp_path):
    root = mi300x_node(tmp_path, modes=("CPX", "NPS4"))
    topology = detect_rocm_topology(root, env={}, amd_smi_json=amd_smi("mi300x_cpx_nps4_static.json"))
    assert (topology.compute_mode, topology.memory_mode) == ("CPX", "NPS4")
    assert hip_ordinals(topology) == consecutive(8, 8)


def test_amd_smi_reporting_another_memory_mode_is_an_error(tmp_path):
    root = mi300x_node(tmp_path, modes=("CPX", "NPS1"))
    with pytest.raises(TopologyError, match=r"amd-smi GPU 0 .* memory mode NPS4 but KFD sysfs says NPS1"):
        detect_rocm_topology(root, env={}, amd_smi_json=amd_smi("mi300x_cpx_nps4_static.json"))


@pytest.mark.parametrize("fixture", ["mi300x_dpx_list.json", "mi300x_dpx_nps2_static.json"])
def test_dpx_gives_two_partitions_of_four_xcds_per_gpu(tmp_path, fixture):
    root = mi300x_node(tmp_path, partitions=2, modes=("DPX", "NPS2"))
    topology = detect_rocm_topology(root, env={}, amd_smi_json=amd_smi(fixture))
    assert kfd_nodes(topology) == consecutive(8, 2, start=2)
    assert hip_ordinals(topology) == consecutive(8, 2)
    assert {p.num_xcc for group in topology.groups for p in group} == {4}
    assert (topology.compute_mode, topology.memory_mode) == ("DPX", "NPS2")


def test_spx_gives_one_partition_per_gpu(tmp_path):
    root = mi300x_node(tmp_path, partitions=1, modes=("SPX", "NPS1"))
    topology = detect_rocm_topology(root, env={}, amd_smi_json=amd_smi("mi300x_spx_list.json"))
    assert [group[0].gpu_id for group in topology.groups] == list(MI300X_BUSES)
    assert kfd_nodes(topology) == consecutive(8, 1, start=2)
    assert [[p.partition for p in group] for group in topology.groups] == [[0]] * 8
    assert topology.compute_mode == "SPX"


def test_cpu_node_among_gpu_nodes_is_skipped(tmp_path):
    two_gpus = gpu_nodes(MI300X_BUSES[:2])
    root = write_machine(tmp_path, [cpu_node(), *two_gpus[:8], cpu_node(), *two_gpus[8:]], ("CPX", "NPS1"))
    topology = detect_rocm_topology(root, env={})
    assert kfd_nodes(topology) == [list(range(1, 9)), list(range(10, 18))]
    assert hip_ordinals(topology) == consecutive(2, 8)


def test_gpus_are_ordered_by_pci_address_not_by_kfd_node(tmp_path):
    two_gpus = gpu_nodes(MI300X_BUSES[:2])
    root = write_machine(tmp_path, [cpu_node(), *two_gpus[8:], *two_gpus[:8]], ("CPX", "NPS1"))
    topology = detect_rocm_topology(root, env={})
    assert [group[0].gpu_id for group in topology.groups] == list(MI300X_BUSES[:2])
    assert hip_ordinals(topology) == [list(range(8, 16)), list(range(8))]
    assert kfd_nodes(topology) == [list(range(9, 17)), list(range(1, 9))]


def test_missing_partition_is_a_clear_error(tmp_path):
    root = mi300x_node(tmp_path)
    shutil.rmtree(root / KFD_NODES / str(2 + 8 * 2 + 5))      # partition 5 of the third GPU
    with pytest.raises(TopologyError, match=r"GPU 0000:46:00 shows partitions \[0, 1, 2, 3, 4, 6, 7\] .*expected "
                                            r"0-7 as GPU 0000:05:00 does; partition\(s\) \[5\] missing"):
        detect_rocm_topology(root, env={})


def test_missing_partition_on_a_single_gpu_is_found_too(tmp_path):
    nodes = gpu_nodes(MI300X_BUSES[:1])
    root = write_machine(tmp_path, [cpu_node(), *nodes[:5], *nodes[6:]])
    with pytest.raises(TopologyError, match=r"partitions \[0, 1, 2, 3, 4, 6, 7\] in KFD sysfs, expected 0-7;"):
        group_by_gpu(read_kfd_partitions(root / KFD_NODES, render_dir=None))


def test_two_nodes_claiming_one_partition_is_an_error(tmp_path):
    nodes = gpu_nodes(MI300X_BUSES[:1])
    root = write_machine(tmp_path, [cpu_node(), nodes[0], *nodes[2:], nodes[0]])
    with pytest.raises(TopologyError, match="KFD nodes 1 and 8 both claim partition 0 of GPU 0000:05:00"):
        detect_rocm_topology(root, env={})


def test_fallback_encoding_in_location_id_bits_2_to_0_groups_the_same(tmp_path):
    high = detect_rocm_topology(mi300x_node(tmp_path / "high"), env={})
    low_root = mi300x_node(tmp_path / "low", encoding="low")
    low = detect_rocm_topology(low_root, env={})
    assert read_properties(low_root / KFD_NODES / "5" / "properties")["location_id"] == 0x05 << 8 | 3
    assert read_properties(tmp_path / "high" / KFD_NODES / "5" / "properties")["location_id"] == 0x05 << 8 | 3 << 28
    assert low.groups == high.groups


def test_rocr_visible_devices_picks_partition_0_of_three_gpus(cpx_machine):
    topology = detect_rocm_topology(cpx_machine, env={"ROCR_VISIBLE_DEVICES": "0,8,16"})
    assert [group[0].gpu_id for group in topology.groups] == list(MI300X_BUSES[:3])
    assert [[p.partition for p in group] for group in topology.groups] == [[0], [0], [0]]
    assert kfd_nodes(topology) == [[2], [10], [18]]
    assert hip_ordinals(topology) == [[0], [1], [2]]


def test_rocr_visible_devices_order_sets_the_hip_order(cpx_machine):
    topology = detect_rocm_topology(cpx_machine, env={"ROCR_VISIBLE_DEVICES": "16, 0,8"})
    assert kfd_nodes(topology) == [[2], [10], [18]]
    assert hip_ordinals(topology) == [[1], [2], [0]]


def test_hip_visible_devices_picks_among_the_rocr_visible_ones(cpx_machine):
    topology = detect_rocm_topology(cpx_machine, env={"ROCR_VISIBLE_DEVICES": "0,1,8,9,16,17", "HIP_VISIBLE_DEVICES": "2,3"})
    assert kfd_nodes(topology) == [[10, 11]]
    assert hip_ordinals(topology) == [[0, 1]]
    topology = detect_rocm_topology(cpx_machine, env={"HIP_VISIBLE_DEVICES": "", "CUDA_VISIBLE_DEVICES": "9"})
    assert kfd_nodes(topology) == [[11]]


def test_a_uuid_in_rocr_visible_devices_selects_that_partition(cpx_machine):
    uuid = f"GPU-{unique_id(gpu=1, partition=3):016X}"
    topology = detect_rocm_topology(cpx_machine, env={"ROCR_VISIBLE_DEVICES": f"{uuid.lower()},0"})
    assert kfd_nodes(topology) == [[2], [13]]
    assert hip_ordinals(topology) == [[1], [0]]


@pytest.mark.parametrize("value, token", [("0,64", "64"), ("0,0", "0"), ("0,x", "x"), ("07", "07"),
                                          ("GPU-5A3C", "GPU-5A3C"), ("GPU-FFFF", "GPU-FFFF")])
def test_bad_visible_device_tokens_are_errors(cpx_machine, value, token):
    with pytest.raises(TopologyError, match=rf"ROCR_VISIBLE_DEVICES='{value}': '{token}' is not a new device index "
                                            r"\(0-63\)"):
        detect_rocm_topology(cpx_machine, env={"ROCR_VISIBLE_DEVICES": value})


def test_empty_rocr_visible_devices_leaves_no_usable_partition(cpx_machine):
    with pytest.raises(TopologyError, match="KFD shows 64 GPU partitions but this process can use none of them"):
        detect_rocm_topology(cpx_machine, env={"ROCR_VISIBLE_DEVICES": ""})


def test_unequal_visible_shares_of_gpus_are_an_error(cpx_machine):
    with pytest.raises(TopologyError,
                       match=r"visible partitions per GPU differ \(\{'0000:05:00': 2, '0000:26:00': 1\}"):
        detect_rocm_topology(cpx_machine, env={"ROCR_VISIBLE_DEVICES": "0,1,8"})


def test_a_gpu_whose_render_nodes_do_not_open_is_hidden(tmp_path):
    closed = tuple(range(FIRST_RENDER_MINOR + 56, FIRST_RENDER_MINOR + 64))
    root = write_machine(tmp_path, [cpu_node(), cpu_node(), *gpu_nodes()], ("CPX", "NPS1"), closed)
    partitions = read_kfd_partitions(root / KFD_NODES, render_dir=root / "dev" / "dri")
    assert [p.hip_ordinal for p in partitions] == list(range(56)) + [None] * 8
    topology = detect_rocm_topology(root, env={})
    assert [group[0].gpu_id for group in topology.groups] == list(MI300X_BUSES[:7])


def test_nodes_the_kernel_refuses_to_show_are_left_out(cpx_machine, monkeypatch):
    read_text = Path.read_text

    def refuse_last_gpu(path, *args, **kwargs):
        if path.parent.name.isdigit() and int(path.parent.name) >= 2 + 7 * 8:
            raise PermissionError(1, "Operation not permitted", str(path))
        return read_text(path, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", refuse_last_gpu)
    topology = detect_rocm_topology(cpx_machine, env={})
    assert [group[0].gpu_id for group in topology.groups] == list(MI300X_BUSES[:7])
    assert hip_ordinals(topology) == consecutive(7, 8)


@pytest.mark.parametrize("modes", [("CPX", "NPS1"), None])
def test_a_container_given_some_partitions_of_a_gpu_sees_those(tmp_path, monkeypatch, modes):
    """A pod that the device plugin gave partitions 4-7 of the second GPU: the kernel refuses every other GPU node
    (EPERM), so partitions 0-3 are hidden, not missing."""
    nodes = published_nodes("mi300x_cpx_k8s_device_plugin")[:2 + 7 * 8]
    root = write_machine(tmp_path, nodes, modes)
    read_text = Path.read_text

    def refuse_other_nodes(path, *args, **kwargs):
        if path.parent.parent.name == "nodes" and int(path.parent.name) not in range(2 + 8 + 4, 2 + 16):
            if nodes[int(path.parent.name)]["simd_count"]:
                raise PermissionError(1, "Operation not permitted", str(path))
        return read_text(path, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", refuse_other_nodes)
    topology = detect_rocm_topology(root, env={})
    assert [[(p.gpu_id, p.partition, p.hip_ordinal) for p in group] for group in topology.groups] == [
        [(PUBLISHED_CPX_BUSES[1], partition, partition - 4) for partition in range(4, 8)]]


def test_no_kfd_gpu_nodes_means_not_a_rocm_machine(tmp_path):
    assert detect_rocm_topology(tmp_path / "empty", env={}) is None
    assert detect_rocm_topology(write_machine(tmp_path / "cpus", [cpu_node(), cpu_node()]), env={}) is None


def test_kfd_and_amd_smi_disagreeing_is_an_error_naming_the_node(cpx_machine):
    with pytest.raises(TopologyError, match=r"amd-smi GPU 7 \(0000:05:00.0, KFD node 10, partition 7\) says physical "
                                            r"GPU 0000:05:00 but KFD sysfs says 0000:26:00 for node 10"):
        detect_rocm_topology(cpx_machine, env={}, amd_smi_json=amd_smi("mi300x_cpx_list_disagree.json"))


def test_amd_smi_naming_a_node_kfd_lacks_is_an_error(cpx_machine):
    partitions = read_kfd_partitions(cpx_machine / KFD_NODES, render_dir=None)
    gpus = parse_amd_smi(amd_smi("mi300x_cpx_list.json"))
    check_against_amd_smi(partitions, gpus)
    with pytest.raises(TopologyError, match=r"amd-smi GPU 0 \(0000:05:00.0, KFD node 99, partition 0\) matches no KFD"):
        check_against_amd_smi(partitions, [dataclasses.replace(gpus[0], kfd_node=99)])
    with pytest.raises(TopologyError, match="says kfd_id 1 but KFD sysfs says 16838 for node 2"):
        check_against_amd_smi(partitions, [dataclasses.replace(gpus[0], kfd_gpu_id=1)])


def test_parse_amd_smi_reads_list_and_static_output():
    listed = parse_amd_smi(amd_smi("mi300x_cpx_list.json"))
    assert len(listed) == 64
    assert (listed[9].gpu_id, listed[9].kfd_node, listed[9].partition, listed[9].compute_mode) == \
        ("0000:26:00", 11, 1, None)
    wrapped = parse_amd_smi(json.dumps({"gpu_data": json.loads(amd_smi("mi300x_cpx_list.json"))}))
    assert wrapped == listed
    static = parse_amd_smi(amd_smi("mi300x_dpx_nps2_static.json"))
    assert [(g.gpu_id, g.partition, g.compute_mode, g.memory_mode) for g in static[:3]] == [
        ("0000:05:00", 0, "DPX", "NPS2"), ("0000:05:00", 1, None, None), ("0000:26:00", 0, "DPX", "NPS2")]
    assert {g.kfd_node for g in static} == {None}


def test_parse_amd_smi_reads_the_bare_object_of_a_single_gpu():
    """amd-smi of ROCm 6.0 prints one GPU (a one-GPU machine, or --gpu N) as a bare object, not a list of one."""
    one_gpu = json.loads(amd_smi("mi300x_spx_list.json"))[0]
    assert parse_amd_smi(json.dumps(one_gpu)) == parse_amd_smi(json.dumps([one_gpu]))


@pytest.mark.parametrize("text, message", [
    ("not json", "amd-smi output is not JSON"),
    ('{"cpu_data": []}', "amd-smi JSON is a dict without a GPU list"),
    ('[{"gpu": 0, "bdf": "N/A"}]', "amd-smi GPU 0 has bdf 'N/A', expected dddd:bb:dd.f"),
])
def test_parse_amd_smi_rejects_what_it_cannot_read(text, message):
    with pytest.raises(TopologyError, match=message):
        parse_amd_smi(text)


def test_read_partition_modes_reads_the_pci_device(tmp_path):
    write_modes(tmp_path, "0000:05:00", "CPX", "NPS4")
    assert read_partition_modes("0000:05:00", tmp_path / "sys") == ("CPX", "NPS4")
    assert read_partition_modes("0000:26:00", tmp_path / "sys") is None


def test_modes_are_unknown_when_the_driver_does_not_show_them(tmp_path):
    topology = detect_rocm_topology(mi300x_node(tmp_path, modes=None), env={})
    assert (topology.compute_mode, topology.memory_mode) == (None, None)
    assert hip_ordinals(topology) == consecutive(8, 8)


def test_gpus_in_different_modes_are_an_error(tmp_path):
    root = mi300x_node(tmp_path, modes=("CPX", "NPS1"))
    write_modes(root, MI300X_BUSES[3], "CPX", "NPS4")
    with pytest.raises(TopologyError, match=r"GPUs are in different partition modes .*'0000:65:00': 'CPX/NPS4'"):
        detect_rocm_topology(root, env={})


@pytest.mark.parametrize("partitions, modes, message", [
    (8, ("DPX", "NPS1"), r"compute mode DPX but KFD shows 8 partition\(s\) per GPU with \[1\] XCD"),
    (2, ("CPX", "NPS1"), r"compute mode CPX but KFD shows 2 partition\(s\) per GPU with \[4\] XCD"),
])
def test_a_mode_that_does_not_fit_the_partitions_is_an_error(tmp_path, partitions, modes, message):
    with pytest.raises(TopologyError, match=message):
        detect_rocm_topology(mi300x_node(tmp_path, partitions=partitions, modes=modes), env={})


def test_malformed_properties_are_named_with_file_and_line(tmp_path):
    root = mi300x_node(tmp_path)
    path = root / KFD_NODES / "3" / "properties"
    path.write_text("simd_count 152\nlocation_id 0x500\n")
    with pytest.raises(TopologyError, match=r"nodes/3/properties line 2 reads 'location_id 0x500'"):
        detect_rocm_topology(root, env={})


def test_gpu_node_without_location_is_an_error(tmp_path):
    root = mi300x_node(tmp_path)
    (root / KFD_NODES / "4" / "properties").write_text("simd_count 152\ndomain 0\ndrm_render_minor 130\n")
    with pytest.raises(TopologyError, match=r"nodes/4/properties has no location_id; a GPU node needs"):
        detect_rocm_topology(root, env={})


# A published capture of a real MI300X node in CPX mode (fixtures/kfd/README.md).

PUBLISHED_CPX_BUSES = ["0000:05:00", "0000:27:00", "0000:47:00", "0000:65:00", "0000:85:00", "0000:a7:00",
                       "0000:c7:00", "0000:e5:00"]
"""The buses of its location_ids (1280 = 0x0500, 9984 = 0x2700, ... 58624 = 0xe500), read by hand."""


def test_published_cpx_capture_groups_eight_partitions_per_gpu_by_pci_bus(tmp_path):
    """Its first seven GPUs (nodes 2-57): KFD node 2 + 8 g + p is partition p of GPU g, the partition read from
    location_id bits 2:0 as this driver writes it."""
    nodes = published_nodes("mi300x_cpx_k8s_device_plugin")
    topology = detect_rocm_topology(write_machine(tmp_path, nodes[:2 + 7 * 8]), env={})
    assert [group[0].gpu_id for group in topology.groups] == PUBLISHED_CPX_BUSES[:7]
    assert [[(p.kfd_node, p.partition, p.num_xcc) for p in group] for group in topology.groups] == [
        [(2 + 8 * gpu + partition, partition, 1) for partition in range(8)] for gpu in range(7)]
    assert [p.hip_ordinal for group in topology.groups for p in group] == list(range(56))
    assert (topology.compute_mode, topology.memory_mode) == (None, None)


def test_published_cpx_capture_with_a_partition_missing_names_the_gpu_and_partition(tmp_path):
    """The whole capture: the GPU at bus 0xe5 shows partitions 0-6 only."""
    nodes = published_nodes("mi300x_cpx_k8s_device_plugin")
    assert sum(node["simd_count"] > 0 for node in nodes) == 63
    with pytest.raises(TopologyError, match=r"GPU 0000:e5:00 shows partitions \[0, 1, 2, 3, 4, 5, 6\] in KFD sysfs, "
                                            r"expected 0-7 as GPU 0000:05:00 does; partition\(s\) \[7\] missing"):
        detect_rocm_topology(write_machine(tmp_path, nodes), env={})


# Published rocm-smi output of four MI300X GPUs in SPX mode (fixtures/rocm_smi/README.md).

def rocm_smi_facts(name: str) -> dict[str, dict[int, str]]:
    """{field: {GPU index: value}} of the "GPU[i] : field: value" lines of a rocm-smi capture."""
    facts: dict[str, dict[int, str]] = {}
    for line in (Path(__file__).parent / "fixtures" / "rocm_smi" / name).read_text().splitlines():
        found = re.fullmatch(r"GPU\[(\d+)\]\s*: ([^:]+):\s*(.*)", line)
        if found:
            facts.setdefault(found.group(2), {})[int(found.group(1))] = found.group(3).strip()
    return facts


def test_published_spx_rocm_smi_output_is_detected_as_four_whole_gpus(tmp_path):
    facts = rocm_smi_facts("mi300x_spx_x4_rocm_smi_a.txt")
    buses = [facts["PCI Bus"][gpu].removesuffix(".0") for gpu in range(4)]
    modes = {(facts["Compute Partition"][gpu], facts["Memory Partition"][gpu]) for gpu in range(4)}
    assert modes == {("SPX", "NPS1")}
    nodes = [{**gpu_node(bus, gpu, 0, 1), "device_id": int(facts["Device ID"][gpu], 16),
              "unique_id": int(facts["Unique ID"][gpu], 16)} for gpu, bus in enumerate(buses)]
    topology = detect_rocm_topology(write_machine(tmp_path, [cpu_node(), cpu_node(), *nodes], modes.pop()), env={})
    assert [group[0].gpu_id for group in topology.groups] == ["0000:26:00", "0000:46:00", "0000:65:00", "0000:85:00"]
    assert [[(p.kfd_node, p.partition, p.num_xcc) for p in group] for group in topology.groups] == [
        [(2 + gpu, 0, 8)] for gpu in range(4)]
    assert (topology.compute_mode, topology.memory_mode) == ("SPX", "NPS1")
