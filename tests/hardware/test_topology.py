"""Topology values: presets, override strings, $STARSCREAM_TOPOLOGY, per-partition figures."""
import dataclasses

import pytest

from starscream_jax.errors import TopologyError
from starscream_jax.hardware.presets import load_preset
from starscream_jax.hardware.topology import OVERRIDE_ENV, Topology, override_from_env, parse_override


def test_preset_defaults_to_the_chips_board_and_the_modes_partitions():
    topology = Topology.from_preset("mi300x-cpx-nps1")
    assert (topology.nodes, topology.gpus_per_node, topology.partitions_per_gpu) == (1, 8, 8)
    assert (topology.num_gpus, topology.num_devices) == (8, 64)
    assert (topology.compute_mode, topology.memory_mode) == ("CPX", "NPS1")
    assert Topology.from_preset("mi355x-qpx-nps2", gpus=2, nodes=3).num_devices == 24


@pytest.mark.parametrize("preset, flops, hbm_bytes", [
    ("mi300x-cpx-nps4", 1307.4e12 / 8, 24e9),
    ("mi300x-dpx-nps2", 1307.4e12 / 2, 96e9),
    ("mi355x-cpx-nps2", 2516.6e12 / 8, 36e9),
    ("h200", 989e12, 141e9),
])
def test_per_partition_figures_divide_the_chip_by_the_mode(preset, flops, hbm_bytes):
    topology = Topology.from_preset(preset)
    assert topology.peak_flops == pytest.approx(flops)
    assert topology.hbm_bytes == pytest.approx(hbm_bytes)
    chip = topology.preset.chip
    assert topology.ridge_point == pytest.approx(chip.peak_bf16_flops / chip.hbm_bandwidth)


def test_visible_subset_of_partitions_keeps_the_figures_of_one_partition():
    one_per_gpu = dataclasses.replace(Topology.from_preset("mi300x-cpx-nps1"), partitions_per_gpu=1)
    assert one_per_gpu.hbm_bytes == pytest.approx(24e9)
    assert one_per_gpu.num_devices == 8


def test_partition_count_that_contradicts_the_preset_is_an_error():
    with pytest.raises(TopologyError, match="preset mi300x-qpx-nps1 has 4 partitions per GPU, not 8"):
        Topology.from_preset("mi300x-qpx-nps1", partitions=8)


@pytest.mark.parametrize("text, preset, shape, mode", [
    ("8x8", "cpu", (1, 8, 8), "CPX"),
    ("2x4", "cpu", (1, 2, 4), "QPX"),
    ("2x8x8", "cpu", (2, 8, 8), "CPX"),
    ("4x3", "cpu", (1, 4, 3), "3-way"),
    ("mi300x-cpx-nps1", "mi300x-cpx-nps1", (1, 8, 8), "CPX"),
    ("mi300x-qpx-nps4:4", "mi300x-qpx-nps4", (1, 4, 4), "QPX"),
    ("  MI355X-DPX-NPS2:2 ", "mi355x-dpx-nps2", (1, 2, 2), "DPX"),
    ("h200", "h200", (1, 8, 1), "SPX"),
])
def test_override_forms(text, preset, shape, mode):
    topology = parse_override(text)
    assert topology.preset.name == preset
    assert (topology.nodes, topology.gpus_per_node, topology.partitions_per_gpu) == shape
    assert topology.compute_mode == mode


@pytest.mark.parametrize("text, problem", [
    ("8x", "a shape is two or three integers joined by 'x'"),
    ("8x8x8x8", "a shape is two or three integers joined by 'x'"),
    ("0x8", "gpus_per_node is 0; it must be a positive integer"),
    ("8x0", "partitions_per_gpu is 0; it must be a positive integer"),
    ("0x8x8", "nodes is 0; it must be a positive integer"),
    ("8x16", "16 partitions per GPU, but chip cpu has 8 XCDs; use at most 8"),
    ("mi300x-cpx-nps1:abc", "after ':' comes a GPU count, found 'abc'"),
    ("mi300x-cpx-nps1:0", "gpus_per_node is 0"),
    ("mi400x", "unknown preset 'mi400x'; known presets: cpu, h200"),
    ("mi300x-spx-nps4", "cannot run SPX+NPS4; valid compute+memory pairs: SPX+NPS1, DPX+NPS1"),
    ("mi355x-cpx-nps4", "cannot run CPX+NPS4; valid compute+memory pairs: SPX+NPS1, DPX+NPS2, QPX+NPS2, CPX+NPS2"),
])
def test_malformed_override_is_one_line_quoting_it_and_the_forms(text, problem):
    with pytest.raises(TopologyError) as caught:
        parse_override(text)
    message = str(caught.value)
    assert message.startswith(f"topology override {text.strip().lower()!r}: ")
    assert problem in message
    assert message.endswith("a preset name or PRESET:GPUS (mi300x-cpx-nps1:4)")
    assert "\n" not in message


def test_environment_override(monkeypatch):
    monkeypatch.delenv(OVERRIDE_ENV, raising=False)
    assert override_from_env() is None
    monkeypatch.setenv(OVERRIDE_ENV, "2x4")
    assert override_from_env() == parse_override("2x4")
    monkeypatch.setenv(OVERRIDE_ENV, "2x")
    with pytest.raises(TopologyError, match=r"^\$STARSCREAM_TOPOLOGY: topology override '2x': a shape is"):
        override_from_env()


def test_describe_is_a_json_ready_summary():
    summary = Topology.from_preset(load_preset("mi355x-cpx-nps2"), gpus=4).describe()
    assert summary["preset"] == "mi355x-cpx-nps2"
    assert summary["preview"] is True
    assert (summary["gpus_per_node"], summary["partitions_per_gpu"], summary["num_devices"]) == (4, 8, 32)
    assert summary["per_partition"]["hbm_bytes"] == pytest.approx(36e9)
    assert summary["links"]["inter_gpu_bandwidth"] == 376e9


def test_topology_is_hashable_and_compares_by_value():
    assert hash(parse_override("mi300x-cpx-nps1:4")) == hash(Topology.from_preset("mi300x-cpx-nps1", gpus=4))
    assert parse_override("2x4") != parse_override("4x2")


def test_an_override_that_is_not_text_is_named():
    with pytest.raises(TopologyError, match=r"topology override 5 \(int\): expected a string such as '8x8'"):
        parse_override(5)
