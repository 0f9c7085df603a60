"""The pictures' data (what each plot draws) and that each file is written: topology, layouts, plans."""
import numpy as np
import pytest

from starscream_jax.analysis.plots import layout_plot_data, plot_layouts, plot_topology, topology_data
from starscream_jax.hardware.mesh import build_topology_mesh


@pytest.fixture(scope="module")
def inspected(tiny_decode):
    """flat_tp and starscream_decode (`conftest.tiny_decode`): topology, mesh, results."""
    return tiny_decode[1:]


def test_topology_data_places_every_device_at_its_mesh_coordinates(tmp_path):
    topology, mesh = build_topology_mesh("mi300x-cpx-nps1", gpus=2, simulate=True, data=2)
    gpus = topology_data(mesh)
    assert [(gpu["data"], gpu["gpu"]) for gpu in gpus] == [(0, 0), (1, 0)]
    for gpu in gpus:
        for device in gpu["devices"]:
            assert mesh.devices[gpu["data"], gpu["gpu"], device["xcd"]].id == device["id"]
    assert plot_topology(topology, mesh, tmp_path / "topology.png").stat().st_size > 10_000


def test_traffic_matrix_rows_add_up_to_each_devices_bytes_and_stay_hierarchical_under_starscream(inspected,
                                                                                                    tmp_path):
    topology, mesh, results = inspected
    data = layout_plot_data(results, mesh, topology)
    for name, result in results.items():
        traffic = data[name]["traffic"]
        sent = sum(value for scope, value in result.bytes_per_device.by_scope.items() if scope != "local")
        assert traffic.sum(axis=1).mean() == pytest.approx(sent)  # every device takes part in every collective here
        assert data[name]["gpu_boundaries"] == [4]
    hierarchical = data["starscream_decode"]["traffic"]
    crossing = hierarchical[:4, 4:]  # GPU 0 to GPU 1: only between same-index partitions
    assert np.count_nonzero(crossing - np.diag(np.diag(crossing))) == 0
    assert np.count_nonzero(data["flat_tp"]["traffic"][:4, 4:] - np.diag(np.diag(data["flat_tp"]["traffic"][:4, 4:])))
    roofline = data["starscream_decode"]["roofline"]
    assert roofline["ridge_point"] == topology.ridge_point
    for point in roofline["points"]:
        assert point["attainable"] == pytest.approx(min(topology.peak_flops,
                                                        point["intensity"] * topology.hbm_bandwidth))
    assert plot_layouts(results, mesh, topology, tmp_path / "layouts.png").stat().st_size > 10_000
