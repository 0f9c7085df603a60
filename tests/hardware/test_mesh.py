"""The mesh builder on the 64 simulated CPU devices, and its ROCm branch on fake devices with a fake sysfs reading."""
import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import jax
import pytest
from fixtures.sysfs import published_nodes, write_machine
from jax.sharding import AxisType

from starscream_jax.cli import arguments
from starscream_jax.cli.arguments import add_mesh_arguments, mesh_from_args, prepare_simulation
from starscream_jax.errors import PresetError, TopologyError
from starscream_jax.hardware import detect, simulation
from starscream_jax.hardware.axes import AXES
from starscream_jax.hardware.detect import detect_rocm_topology
from starscream_jax.hardware.mesh import build_mesh, build_topology_mesh, detect_topology, device_table
from starscream_jax.hardware.topology import OVERRIDE_ENV, Topology, parse_override


@pytest.fixture(autouse=True)
def no_override(monkeypatch):
    monkeypatch.delenv(OVERRIDE_ENV, raising=False)


def consecutive_rows(gpus, partitions, first=0):
    """[[ids of GPU 0], [ids of GPU 1], ...] for GPUs made of consecutive device ids."""
    return [list(range(first + g * partitions, first + (g + 1) * partitions)) for g in range(gpus)]


def test_mesh_has_the_three_explicit_axes_and_one_gpu_per_xcd_row():
    mesh = build_mesh("8x8")
    assert mesh.axis_names == AXES == ("data", "gpu", "xcd")
    assert mesh.axis_types == (AxisType.Explicit,) * 3
    assert mesh.devices.shape == (1, 8, 8)
    assert device_table(mesh) == [consecutive_rows(8, 8)]


def test_unpartitioned_preset_has_an_xcd_axis_of_one():
    mesh = build_mesh("h200:4")
    assert dict(mesh.shape) == {"data": 1, "gpu": 4, "xcd": 1}


def test_subset_of_gpus():
    topology, mesh = build_topology_mesh("mi300x-cpx-nps1", gpus=2)
    assert (topology.gpus_per_node, topology.partitions_per_gpu) == (2, 8)
    assert device_table(mesh) == [consecutive_rows(2, 8)]


def test_data_axis_splits_the_gpus():
    mesh = build_mesh("8x8", data=2)
    assert mesh.devices.shape == (2, 4, 8)
    assert device_table(mesh) == [consecutive_rows(4, 8), consecutive_rows(4, 8, first=32)]


@pytest.mark.parametrize("data", [0, 3])
def test_data_that_does_not_divide_the_gpus_is_an_error(data):
    expected = rf"data={data} \(--data-parallel\) does not divide the 8 GPUs; pick a divisor of 8"
    with pytest.raises(TopologyError, match=expected):
        build_mesh("8x8", data=data)


def test_explicit_grouping_sets_the_partitions_and_their_order():
    topology, mesh = build_topology_mesh(grouping=[[5, 4], [1, 0], [7, 6]])
    assert (topology.preset.name, topology.gpus_per_node, topology.partitions_per_gpu) == ("cpu", 3, 2)
    assert device_table(mesh) == [[[5, 4], [1, 0], [7, 6]]]


@pytest.mark.parametrize("grouping, message", [
    ([[0, 1], [2, 99]], r"grouping names device ids \[99\] that JAX does not have"),
    ([[0, 1], [1, 2]], r"grouping lists device\(s\) \[1\] more than once; each device belongs to one GPU"),
    ([[0, 1], [2, 3, 4]], r"grouping has GPUs with \[2, 3\] partitions; every GPU must have the same number"),
    ([[0, 1], []], r"has an empty GPU; give one non-empty list of device ids per GPU"),
    ([], r"grouping \[\] has an empty GPU"),
])
def test_bad_grouping_is_an_error(grouping, message):
    with pytest.raises(TopologyError, match=message):
        build_mesh(grouping=grouping)


def test_grouping_that_contradicts_the_preset_is_an_error():
    with pytest.raises(TopologyError, match=r"found GPUs with \[2\] partitions each, expected 8 \(CPX\)"):
        build_mesh("mi300x-cpx-nps1", grouping=consecutive_rows(8, 2))


def test_too_few_devices_says_what_was_found_and_how_to_fix_it():
    expected = (r"the topology needs 16 GPUs x 8 partitions = 128 devices, 16 GPUs from each of 1 process\(es\), but "
                r"process 0 shows 64 devices \(8 whole GPUs\); ask for fewer GPUs \(--gpus\) or simulate 128 devices")
    with pytest.raises(TopologyError, match=expected):
        build_mesh("16x8")
    with pytest.raises(TopologyError, match=r"= 8 devices, .* but process 0 shows 6 devices \(1 whole GPUs\)"):
        build_mesh("2x4", devices=jax.devices()[:6])


@pytest.mark.parametrize("make", [lambda: build_mesh("mi300x-cpx-nps1", gpus=16),
                                  lambda: parse_override("mi300x-cpx-nps1:16")])
def test_more_gpus_than_a_node_of_the_chip_holds_are_refused_with_how_to_spread_them(make):
    with pytest.raises(TopologyError, match=r"16 GPUs per node, but a node of mi300x holds 8; spread them over nodes "
                                            r"\(2 nodes of 8 GPUs"):
        make()


def test_unknown_preset_and_malformed_override_are_errors():
    with pytest.raises(TopologyError, match="topology override 'mi400x': unknown preset 'mi400x'; known presets"):
        build_mesh("mi400x")
    with pytest.raises(TopologyError, match="topology override '8x': a shape is two or three integers"):
        build_mesh("8x")
    with pytest.raises(TopologyError, match="gpus=0; ask for a positive number of gpus"):
        build_mesh("8x8", gpus=0)


def test_detection_on_cpu_gives_one_gpu_per_device():
    topology, mesh = build_topology_mesh()
    assert (topology.preset.name, topology.gpus_per_node, topology.partitions_per_gpu) == ("cpu", 64, 1)
    assert mesh.devices.shape == (1, 64, 1)


def test_environment_override_wins_over_detection_and_an_argument_over_it(monkeypatch):
    monkeypatch.setenv(OVERRIDE_ENV, "2x4")
    assert build_mesh().devices.shape == (1, 2, 4)
    assert build_mesh(simulate=True).devices.shape == (1, 2, 4)
    assert build_mesh("4x2").devices.shape == (1, 4, 2)
    assert build_mesh(gpus=1).devices.shape == (1, 1, 4)
    monkeypatch.setenv(OVERRIDE_ENV, "4y4")
    with pytest.raises(TopologyError, match=r"^\$STARSCREAM_TOPOLOGY: topology override '4y4': unknown preset"):
        build_mesh()


def test_simulated_mesh_defaults_to_the_cpu_preset():
    topology, mesh = build_topology_mesh(simulate=True)
    assert (topology.preset.name, mesh.devices.shape) == ("cpu", (1, 8, 1))
    assert build_mesh("mi300x-dpx-nps2", simulate=True).devices.shape == (1, 8, 2)


@pytest.mark.parametrize("argv, env, shape", [
    ([], None, (1, 2, 4)),
    (["--gpus", "4"], None, (1, 4, 4)),
    (["--preset", "mi300x-cpx-nps1"], None, (1, 2, 8)),
    (["--preset", "h200", "--gpus", "3", "--data-parallel", "3"], None, (3, 1, 1)),
    ([], "8x8", (1, 8, 8)),
    (["--preset", "mi300x-dpx-nps1"], "8x8", (1, 2, 2)),
    (["--topology", "4x2"], "8x8", (1, 4, 2)),
    (["--topology", "mi300x-cpx-nps1"], None, (1, 8, 8)),
])
def test_command_line_precedence(monkeypatch, argv, env, shape):
    """--topology, then --preset, then $STARSCREAM_TOPOLOGY, then the command's default preset and GPU count."""
    if env is not None:
        monkeypatch.setenv(OVERRIDE_ENV, env)
    parser = argparse.ArgumentParser()
    add_mesh_arguments(parser, default_preset="mi300x-qpx-nps1", default_gpus=2, default_simulate=True)
    args = parser.parse_args(argv)
    prepare_simulation(args)
    assert mesh_from_args(args)[1].devices.shape == shape


@pytest.mark.parametrize("platforms, present", [("cpu", False), ("cuda", True), ("rocm,cpu", True), (" cpu , ", False)])
def test_jax_platforms_decides_whether_an_accelerator_is_present(monkeypatch, platforms, present):
    monkeypatch.setenv("JAX_PLATFORMS", platforms)
    assert simulation.accelerator_present() is present


@pytest.mark.parametrize("plugins, nodes, present", [
    ([], ["/dev/kfd", "/dev/nvidiactl"], False),       # CPU-only jax on a GPU machine: JAX sees no GPU
    (["xla_rocm7"], [], False),                        # jax[rocm7-local] installed, no amdgpu driver
    (["xla_rocm7"], ["/dev/kfd"], True),
    (["xla_cuda13"], ["/dev/kfd"], False),             # the CUDA plugin on an AMD machine
    (["xla_cuda13"], ["/dev/nvidiactl"], True),
])
def test_without_jax_platforms_a_gpu_plugin_and_its_driver_are_both_needed(monkeypatch, plugins, nodes, present):
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    entry_points = [importlib.metadata.EntryPoint(name, f"{name}_module", "jax_plugins") for name in plugins]
    monkeypatch.setattr(simulation.importlib.metadata, "entry_points",
                        lambda group: entry_points if group == "jax_plugins" else [])
    monkeypatch.setattr(simulation, "Path", lambda path: Path("/" if path in nodes else "/nonexistent-device-node"))
    assert simulation.accelerator_present() is present


@pytest.mark.parametrize("gpu_present, argv, simulate, shape", [
    (False, [], True, (1, 2, 4)),                                # no GPU: the command's default preset, simulated
    (True, [], False, (1, 64, 1)),                               # GPUs: the detected devices (here 64 CPU devices)
    (True, ["--simulate"], True, (1, 2, 4)),
    (False, ["--no-simulate", "--topology", "8x8"], False, (1, 8, 8)),
])
def test_simulation_follows_the_presence_of_gpus_unless_forced(monkeypatch, gpu_present, argv, simulate, shape):
    monkeypatch.delenv(OVERRIDE_ENV, raising=False)
    monkeypatch.setattr(arguments, "accelerator_present", lambda: gpu_present)
    parser = argparse.ArgumentParser()
    add_mesh_arguments(parser, default_preset="mi300x-qpx-nps1", default_gpus=2, default_simulate=None)
    args = parser.parse_args(argv)
    prepare_simulation(args)
    assert args.simulate is simulate
    assert mesh_from_args(args)[1].devices.shape == shape


@pytest.mark.parametrize("simulate", [True, False])
def test_grouping_on_the_command_line_replaces_detection_and_the_default_preset(monkeypatch, simulate):
    """Four devices named as 2 GPUs x 2 partitions give a (1, 2, 2) mesh whose xcd rows are the groups, whether the
    devices are simulated or the ones JAX already has, and whatever the command's default preset says."""
    monkeypatch.delenv(OVERRIDE_ENV, raising=False)
    parser = argparse.ArgumentParser()
    add_mesh_arguments(parser, default_preset="mi300x-qpx-nps1", default_gpus=2, default_simulate=None)
    args = parser.parse_args(["--grouping", "5,4", "1,0", "--simulate" if simulate else "--no-simulate"])
    prepare_simulation(args)
    topology, built = mesh_from_args(args)
    assert (topology.gpus_per_node, topology.partitions_per_gpu) == (2, 2)
    assert device_table(built) == [[[5, 4], [1, 0]]]


@pytest.mark.parametrize("text", ["0,x", "", "0;1"])
def test_grouping_that_is_not_device_ids_is_refused_by_the_parser(text, capsys):
    parser = argparse.ArgumentParser()
    add_mesh_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--grouping", text])
    assert "expected comma-separated device ids" in capsys.readouterr().err


@pytest.mark.parametrize("import_jax_first, flag_count, devices", [(False, 4, 6), (True, 4, 6), (False, 64, 64),
                                                                   (True, 64, 64)])
def test_simulate_cpu_devices_before_jax_starts(import_jax_first, flag_count, devices):
    """In a fresh process, simulate_cpu_devices(6) raises the count XLA_FLAGS asks for to 6 (and never lowers it),
    before or after jax is imported."""
    code = "\n".join([
        "import jax" if import_jax_first else "",
        "from starscream_jax import simulate_cpu_devices",
        "simulate_cpu_devices(6)",
        "import jax",
        "print(len(jax.devices()), jax.devices()[0].platform)",
    ])
    env = {name: value for name, value in os.environ.items() if name != "JAX_PLATFORMS"}
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={flag_count}"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert result.stdout.split() == [str(devices), "cpu"], result.stderr[-2000:]


@pytest.mark.parametrize("given, expected", [("", "300"),
                                             ("--xla_cpu_collective_call_terminate_timeout_seconds=7", "7")])
def test_simulated_collectives_wait_for_slow_devices_unless_xla_flags_say_otherwise(given, expected):
    """simulate_cpu_devices gives the simulated devices' collectives 300 s (XLA's 40 s ended a generate run beside
    other jobs on 2 cores), unless XLA_FLAGS sets the timeout itself."""
    code = "\n".join(["import os", "from starscream_jax import simulate_cpu_devices", "simulate_cpu_devices(2)",
                      "print(os.environ['XLA_FLAGS'])"])
    env = {name: value for name, value in os.environ.items() if name != "JAX_PLATFORMS"}
    env["XLA_FLAGS"] = given
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert f"--xla_cpu_collective_call_terminate_timeout_seconds={expected}" in result.stdout, result.stderr[-2000:]
    assert result.stdout.count("terminate_timeout") == 1


def test_simulated_mesh_larger_than_the_running_backend_is_an_error():
    expected = (r"a simulated mesh needs 128 CPU devices but JAX already started with 64; call "
                r"simulate_cpu_devices\(128\) before any JAX computation")
    with pytest.raises(TopologyError, match=expected):
        build_mesh("2x8x8", simulate=True)


@dataclass(frozen=True)
class FakeClient:
    platform_version: str = "PJRT C API\nrocm 70000"


@dataclass(frozen=True, kw_only=True)
class FakeRocmDevice:
    """What the mesh builder reads of a JAX device on ROCm."""

    id: int
    process_index: int
    local_hardware_id: int
    platform: str = "gpu"
    device_kind: str = "AMD Instinct MI300X"
    compute_capability: str = "gfx942"
    client: FakeClient = FakeClient()


def fake_devices(processes, per_process, **fields):
    return [FakeRocmDevice(id=p * per_process + i, process_index=p, local_hardware_id=i, **fields)
            for p in range(processes) for i in range(per_process)]


def fake_detection(ordinals_per_gpu, compute_mode="QPX", memory_mode="NPS1"):
    """A detection result whose GPU g holds the partitions with HIP ordinals ordinals_per_gpu[g], in order."""
    groups = tuple(
        tuple(detect.GpuPartition(hip_ordinal=ordinal, kfd_node=2 + ordinal, gpu_id=f"0000:{g + 1:02x}:00",
                                  partition=index, kfd_gpu_id=1000 + ordinal, unique_id=ordinal, num_xcc=2,
                                  simd_count=304, drm_render_minor=128 + ordinal)
              for index, ordinal in enumerate(ordinals))
        for g, ordinals in enumerate(ordinals_per_gpu))
    return detect.RocmTopology(groups=groups, compute_mode=compute_mode, memory_mode=memory_mode)


@pytest.fixture
def sysfs(monkeypatch):
    """Sets what detect_rocm_topology returns; None (no KFD GPU nodes) until a test sets it."""
    reading = {"result": None}
    monkeypatch.setattr(detect, "detect_rocm_topology", lambda: reading["result"])
    return reading


def test_rocm_grouping_comes_from_sysfs_not_from_device_order(sysfs):
    sysfs["result"] = fake_detection([[0, 2, 4, 6], [1, 3, 5, 7]])
    topology, mesh = build_topology_mesh(devices=fake_devices(1, 8))
    assert (topology.preset.name, topology.gpus_per_node, topology.partitions_per_gpu) == ("mi300x-qpx-nps1", 2, 4)
    assert device_table(mesh) == [[[0, 2, 4, 6], [1, 3, 5, 7]]]


def test_rocm_gpu_axis_spans_processes_and_xcd_stays_inside_one(sysfs):
    sysfs["result"] = fake_detection([[0, 1], [2, 3]], compute_mode="DPX", memory_mode="NPS2")
    topology, mesh = build_topology_mesh(devices=fake_devices(2, 4))
    assert (topology.nodes, topology.gpus_per_node, topology.preset.name) == (2, 2, "mi300x-dpx-nps2")
    assert device_table(mesh) == [[[0, 1], [2, 3], [4, 5], [6, 7]]]
    assert [[d.process_index for d in row] for row in mesh.devices[0]] == [[0, 0], [0, 0], [1, 1], [1, 1]]


def test_each_process_gives_its_first_gpus(sysfs):
    sysfs["result"] = fake_detection([[0, 1], [2, 3]], compute_mode="DPX", memory_mode="NPS2")
    mesh = build_mesh("mi300x-dpx-nps2:1", nodes=2, devices=fake_devices(2, 4))
    assert device_table(mesh) == [[[0, 1], [4, 5]]]


def test_gpus_that_do_not_split_over_the_processes_are_an_error(sysfs):
    sysfs["result"] = fake_detection([[0, 1], [2, 3]], compute_mode="DPX", memory_mode="NPS2")
    with pytest.raises(TopologyError, match=r"1 node\(s\) x 3 GPUs do not split evenly over 2 processes"):
        build_mesh("mi300x-dpx-nps2:3", devices=fake_devices(2, 4))


def test_grouping_across_processes_is_an_error():
    with pytest.raises(TopologyError, match=r"grouping puts devices of different processes in one GPU \(\[2, 4\]\)"):
        build_mesh(devices=fake_devices(2, 4), grouping=[[0, 1], [2, 4]])


def test_rocm_mode_the_driver_does_not_report_follows_from_the_partitions(sysfs):
    sysfs["result"] = fake_detection([[0, 1, 2, 3]], compute_mode=None, memory_mode=None)
    topology = detect_topology(fake_devices(1, 4, device_kind="AMD Instinct MI355X", compute_capability="gfx950"))
    assert topology.preset.name == "mi355x-qpx-nps2"


def test_rocm_detected_mode_the_chip_lacks_names_the_valid_pairs(sysfs):
    sysfs["result"] = fake_detection([[0, 1, 2, 3]], compute_mode="QPX", memory_mode="NPS4")
    with pytest.raises(PresetError, match=r"MI355X cannot run QPX\+NPS4; valid compute\+memory pairs: SPX\+NPS1"):
        detect_topology(fake_devices(1, 4, device_kind="AMD Instinct MI355X", compute_capability="gfx950"))


def test_rocm_ragged_partitions_are_an_error(sysfs):
    sysfs["result"] = fake_detection([[0, 1, 2, 3], [4, 5]])
    with pytest.raises(TopologyError, match=r"found GPUs with \[2, 4\] partitions each, expected 4 \(QPX\)"):
        build_mesh(devices=fake_devices(1, 6))


def test_rocm_partition_without_a_jax_device_is_an_error(sysfs):
    sysfs["result"] = fake_detection([[0, 1, 2, 3], [4, 5, 6, 7]])
    with pytest.raises(TopologyError, match=r"no JAX device for \[6, 7\]; make every partition visible"):
        build_mesh("2x4", devices=fake_devices(1, 6))


def test_rocm_devices_jax_was_limited_to_give_their_own_gpus(sysfs):
    """JAX_LOCAL_DEVICE_IDS (or JAX_ROCM_VISIBLE_DEVICES) limits the devices JAX makes, not what HIP or sysfs show:
    one process per GPU, each given its GPU's HIP ordinals, uses that GPU rather than failing on the others."""
    sysfs["result"] = fake_detection([[0, 1, 2, 3], [4, 5, 6, 7]])
    devices = [FakeRocmDevice(id=i, process_index=i // 4, local_hardware_id=i) for i in range(8)]
    topology, mesh = build_topology_mesh(devices=devices)
    assert (topology.nodes, topology.gpus_per_node, topology.partitions_per_gpu) == (2, 1, 4)
    assert device_table(mesh) == [[[0, 1, 2, 3], [4, 5, 6, 7]]]
    assert device_table(build_mesh(devices=fake_devices(1, 8)[4:])) == [[[4, 5, 6, 7]]]


def test_rocm_gpu_given_only_in_part_is_still_an_error(sysfs):
    sysfs["result"] = fake_detection([[0, 1, 2, 3], [4, 5, 6, 7]])
    with pytest.raises(TopologyError, match=r"no JAX device for \[0, 1\]; make every partition visible"):
        build_mesh("mi300x-qpx-nps1:1", devices=fake_devices(1, 8)[2:6])


@pytest.mark.parametrize("topology", ["mi300x-spx-nps1:2", "2x1"])
def test_rocm_whole_gpu_topology_on_a_partitioned_node_is_an_error(sysfs, topology):
    """Asking for whole GPUs on a node in QPX would put four partitions of one GPU on the gpu axis as four GPUs."""
    sysfs["result"] = fake_detection([[0, 1, 2, 3], [4, 5, 6, 7]])
    with pytest.raises(TopologyError, match=r"found GPUs with \[4\] partitions each, expected 1 \(SPX\)"):
        build_mesh(topology, devices=fake_devices(1, 8))


def test_rocm_mode_the_driver_does_not_report_follows_from_xcds_when_partitions_are_hidden(sysfs, tmp_path):
    """The published CPX capture (a driver without mode files) with two partitions of each of two GPUs visible: the
    partitions hold one XCD each, so CPX (a 24 GB partition), not DPX."""
    root = write_machine(tmp_path, published_nodes("mi300x_cpx_k8s_device_plugin")[:2 + 7 * 8])
    sysfs["result"] = detect_rocm_topology(root, env={"ROCR_VISIBLE_DEVICES": "0,1,8,9"})
    topology = detect_topology(fake_devices(1, 4))
    assert (topology.preset.name, topology.partitions_per_gpu) == ("mi300x-cpx-nps1", 2)
    assert topology.hbm_bytes == pytest.approx(24e9)


def test_rocm_detection_error_names_a_way_past_it_that_works(monkeypatch, tmp_path):
    """The published CPX capture, whose last GPU lacks a partition: a grouping alone still detects (and fails); the
    preset with the grouping, as the error says, builds the mesh of the seven whole GPUs."""
    root = write_machine(tmp_path, published_nodes("mi300x_cpx_k8s_device_plugin"))
    monkeypatch.setattr(detect, "detect_rocm_topology", lambda: detect_rocm_topology(root, env={}))
    devices, grouping = fake_devices(1, 63), consecutive_rows(7, 8)
    with pytest.raises(TopologyError, match=r"partition\(s\) \[7\] missing: .* pass the preset and the grouping"):
        build_mesh(devices=devices, grouping=grouping)
    assert device_table(build_mesh("mi300x-cpx-nps1:7", devices=devices, grouping=grouping)) == [grouping]


def test_rocm_without_sysfs_needs_an_explicit_grouping(sysfs):
    devices = fake_devices(1, 8)
    with pytest.raises(TopologyError, match="JAX runs on ROCm but /sys/class/kfd shows no GPU nodes"):
        build_mesh("2x4", devices=devices)
    assert device_table(build_mesh(devices=devices, grouping=[[0, 4], [1, 5]])) == [[[0, 4], [1, 5]]]
    assert build_mesh(devices=devices).devices.shape == (1, 8, 1)


WORKER = Path(__file__).with_name("multihost_worker.py")



@pytest.mark.multiprocess
def test_mesh_across_two_processes_reduces_over_gpu_and_xcd(free_port, local_processes):
    """Two local processes of 4 simulated devices each form a 2 nodes x 2 GPUs x 2 partitions mesh through
    `starscream topology` (process 0 prints the report) and `build_topology_mesh`; the worker checks psum over 'gpu'
    (across processes) and over 'xcd' (inside one GPU) and reports its mesh."""
    coordinator = f"127.0.0.1:{free_port()}"
    env = {name: value for name, value in os.environ.items() if name not in (OVERRIDE_ENV, "XLA_FLAGS")}
    outputs = local_processes([[sys.executable, str(WORKER), coordinator, str(process)] for process in range(2)], env,
                              timeout=240)  # generous: CI runs two test files at once on two cores
    # stdout also holds gloo's connection messages: the report is the JSON object, the check the "ok" line.
    reports = [json.loads(line.removeprefix("ok ")) for stdout, _ in outputs for line in stdout.splitlines()
               if line.startswith("ok ")]
    assert [report["process"] for report in reports] == [0, 1]
    for report in reports:
        assert (report["shape"], report["nodes"]) == ([1, 4, 2], 2)
        assert report["devices"] == reports[0]["devices"]
    first, second = (stdout for stdout, _ in outputs)
    command_report, _ = json.JSONDecoder().raw_decode(first[first.index("{"):])
    assert command_report["mesh"] == {"axes": ["data", "gpu", "xcd"], "shape": [1, 4, 2]}
    assert command_report["devices"] == reports[0]["devices"][0]
    assert '"mesh"' not in second


@pytest.mark.parametrize("fields, named", [
    ({"device_kind": "AMD Instinct MI250X", "compute_capability": "gfx90a"}, "AMD Instinct MI250X"),
    ({"device_kind": "AMD Instinct MI325X", "compute_capability": "gfx942"}, "AMD Instinct MI325X"),
    ({"device_kind": "AMD Instinct MI300A", "compute_capability": "gfx942"}, "AMD Instinct MI300A"),
    ({"device_kind": "NVIDIA H100 80GB HBM3", "platform": "gpu", "client": FakeClient("PJRT C API\ncuda 12080")},
     "NVIDIA H100 80GB HBM3"),
    ({"device_kind": "NVIDIA GH200 480GB", "platform": "gpu", "client": FakeClient("PJRT C API\ncuda 12080")},
     "NVIDIA GH200 480GB"),
])
def test_a_gpu_no_preset_describes_is_named_with_the_presets(sysfs, fields, named):
    """Neither another chip's figures nor a silent fallback: an MI250X, an MI325X or MI300A (same architecture as the
    MI300X, other figures), an H100 and a GH200 (whose name contains "h200") are refused with the presets listed."""
    sysfs["result"] = fake_detection([[0, 1, 2, 3]])
    with pytest.raises(TopologyError, match=rf"detected {named}.*which no preset describes \(known: cpu, h200, "):
        detect_topology(fake_devices(1, 4, **fields))


def test_a_rocm_gpu_without_kfd_partitions_is_its_chips_whole_gpu(sysfs):
    topology = detect_topology(fake_devices(1, 4))
    assert (topology.preset.name, topology.partitions_per_gpu) == ("mi300x-spx-nps1", 1)


@pytest.mark.parametrize("topology, options, message", [
    (12345, {}, r"topology 12345 \(int\): expected a Topology, an override string"),
    ("2x4", {"gpus": "2"}, r"gpus '2': expected a whole number"),
    ("2x4", {"data": 1.0}, r"data 1.0: expected a whole number"),
])
def test_arguments_of_the_wrong_kind_are_named(topology, options, message):
    with pytest.raises(TopologyError, match=message):
        build_mesh(topology, **options)


def test_a_machine_without_gpus_is_told_to_simulate():
    """No GPU among the devices (a CPU-only machine, --no-simulate): one line that says so and names --simulate,
    not a partition count of []."""
    from starscream_jax.hardware.mesh import _choose_gpus
    with pytest.raises(TopologyError, match=r"found no GPU \(JAX sees cpu devices\); .* pass --simulate"):
        _choose_gpus([], Topology.from_preset("mi300x-cpx-nps1", gpus=8), jax.devices("cpu"))
