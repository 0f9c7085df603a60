"""The cost model's formulas on handmade figures, and its link costs from the presets."""
import math

import pytest

from starscream_jax.analysis.costmodel import LinkCost, StepEstimate, estimate_step, link_costs, matmul_seconds
from starscream_jax.hardware.topology import Topology

CPX = Topology.from_preset("mi300x-cpx-nps1")


def test_link_costs_share_the_inter_gpu_links_among_the_partitions_of_a_gpu():
    chip = CPX.preset.chip
    costs = link_costs(CPX)
    assert costs["intra_gpu"] == LinkCost(chip.intra_gpu_latency, chip.intra_gpu_bandwidth)
    assert costs["inter_gpu"] == LinkCost(chip.inter_gpu_latency, chip.inter_gpu_bandwidth / 8)
    assert costs["inter_node"].bandwidth == chip.inter_node_bandwidth / 8
    assert costs["flat"].bandwidth == chip.flat_bandwidth
    assert costs["local"].seconds(1e9) == 0
    whole_gpus = link_costs(Topology.from_preset("mi300x-spx-nps1"))
    assert whole_gpus["inter_gpu"].bandwidth == chip.inter_gpu_bandwidth


def test_link_cost_is_latency_plus_bytes_over_bandwidth():
    assert LinkCost(1e-5, 1e9).seconds(2e9) == pytest.approx(2.00001)


@pytest.mark.parametrize("m, k, n, bound", [(8192, 8192, 8192, "compute"), (1, 8192, 8192, "memory")])
def test_matmul_seconds_is_the_roofline(m, k, n, bound):
    peak, bandwidth = 100e12, 1e12
    seconds = matmul_seconds({"batch": 2, "m": m, "k": k, "n": n}, peak, bandwidth, itemsize=2)
    compute, memory = 2 * 2 * m * k * n / peak, 2 * 2 * (m * k + k * n + m * n) / bandwidth
    assert seconds == max(compute, memory)
    assert (compute > memory) == (bound == "compute")


def result(phase="train"):
    """A layout's result as `starscream inspect` writes it, with one matmul and three collectives; 2 of 10 layers
    compiled, so what runs in the layer loop counts 5 times (the runs each entry gives)."""
    return {
        "phase": phase, "batch": 4, "seq": 128, "layers": {"compiled": 2, "full": 10},
        "matmuls": [{"batch": 1, "m": 512, "k": 1024, "n": 1024, "below_ridge": False, "full_depth_runs": 10},
                    {"batch": 1, "m": 1, "k": 1024, "n": 1024, "below_ridge": True, "full_depth_runs": 1}],
        "collectives": [
            {"scope": "inter_gpu", "bytes_per_device": 1e6, "count": 2, "full_depth_runs": 10},
            {"scope": "intra_gpu", "bytes_per_device": 4e6, "count": 1, "full_depth_runs": 1},
            {"scope": "local", "bytes_per_device": 0.0, "count": 3, "full_depth_runs": 15},
        ],
    }


def test_estimate_scales_the_layer_loop_to_full_depth_and_sums_by_scope():
    estimate = estimate_step(result(), CPX, itemsize=2)
    costs = link_costs(CPX)
    big, small = result()["matmuls"]
    big_s = matmul_seconds(big, CPX.peak_flops, CPX.hbm_bandwidth, 2)
    small_s = matmul_seconds(small, CPX.peak_flops, CPX.hbm_bandwidth, 2)
    assert estimate.compute_s == pytest.approx(10 * big_s + small_s)
    assert estimate.memory_bound_s == pytest.approx(small_s)
    assert estimate.communication_s["inter_gpu"] == pytest.approx(2 * 5 * costs["inter_gpu"].seconds(1e6))
    assert estimate.communication_s["intra_gpu"] == pytest.approx(costs["intra_gpu"].seconds(4e6))
    assert estimate.communication_s["flat"] == 0
    assert estimate.tokens == 4 * 128
    assert estimate_step(result("decode"), CPX, itemsize=2).tokens == 4


def test_serial_and_overlapped_bounds():
    estimate = StepEstimate(compute_s=2.0, memory_bound_s=0.5, communication_s={"intra_gpu": 1.0, "inter_gpu": 0.5},
                            tokens=300)
    assert (estimate.serial_s, estimate.overlapped_s, estimate.tokens_per_s) == (3.5, 2.0, 300 / 3.5)
    as_dict = estimate.to_dict()
    assert as_dict["total_communication_s"] == 1.5 and as_dict["serial_s"] == 3.5
    assert StepEstimate(0.0, 0.0, {}, 10).tokens_per_s == math.inf


def test_measured_chips_run_matmuls_at_the_nearest_measured_efficiency_and_collectives_at_measured_bandwidth():
    from starscream_jax.analysis.costmodel import LinkCost, collective_seconds, matmul_seconds, measurements

    h200 = measurements("h200")
    assert measurements("mi300x") is None  # no AMD measurement: the preset's figures alone
    row = h200.matmul[-1]
    assert h200.efficiency(*row[:3]) == row[3]
    assert h200.efficiency(row[0] + 1, row[1], row[2]) == row[3]  # nearest in log space
    shape = {"batch": 1, "m": row[0], "k": row[1], "n": row[2]}
    at_peak = matmul_seconds(shape, 989e12, 4.8e12, 2)
    assert matmul_seconds(shape, 989e12, 4.8e12, 2, h200) == pytest.approx(at_peak / row[3])
    sizes = sorted(h200.collectives["all-reduce"])
    (small, slow), (large, fast) = sizes[-2], sizes[-1]
    middle = (small * large) ** 0.5
    assert h200.bus_bandwidth("all-reduce", middle) == pytest.approx((slow * fast) ** 0.5)
    assert h200.bus_bandwidth("all-to-all", middle) is None
    collective = {"scope": "inter_gpu", "kind": "all-reduce", "buffer_bytes": large, "bytes_per_device": large}
    assert collective_seconds(collective, LinkCost(1e-6, 1.0), h200) == pytest.approx(large / fast)
    assert collective_seconds({**collective, "scope": "intra_gpu"}, LinkCost(1e-6, 1e9), h200) == \
        pytest.approx(1e-6 + large / 1e9)
