"""The cost model's formulas on handmade figures, its link costs from the presets, accumulated steps against the
compiled accumulating program, and its estimates against stored H200 step times."""
import dataclasses
import json
import math
from pathlib import Path

import pytest

from starscream_jax.analysis.costmodel import LinkCost, StepEstimate, estimate_step, link_costs, matmul_seconds
from starscream_jax.analysis.json_form import from_json, to_json
from starscream_jax.analysis.hlo import Matmul
from starscream_jax.analysis.report import CollectiveReport
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
    seconds = matmul_seconds(matmul(m, k, n, batch=2), peak, bandwidth, itemsize=2)
    compute, memory = 2 * 2 * m * k * n / peak, 2 * 2 * (m * k + k * n + m * n) / bandwidth
    assert seconds == max(compute, memory)
    assert (compute > memory) == (bound == "compute")


def test_a_projection_reads_its_8_bit_weight_at_its_stored_byte():
    """Decode of 4 tokens per device through the qkv projection [K=4096, N=1024] with int8 weights: the weight costs
    1 byte per element, the activations and output the compute dtype's 2; attention and a float model pay 2."""
    from starscream_jax.analysis.layout_report import Depth, priced_matmul
    from starscream_jax.model.catalog import load_model_config

    config = load_model_config("tiny", dtype="bfloat16")
    qkv = dataclasses.replace(matmul(4, 4096, 1024), op_name="jit(step)/closed_call/qkv/bsd,dke->bske/dot_general")
    attention = dataclasses.replace(qkv, op_name="jit(step)/closed_call/attention/dot_general")
    depth = Depth(2, 2, {})
    price = {name: priced_matmul(m, depth, config.replace(weight_format="int8"), 1.0, 4).bytes
             for name, m in (("qkv", qkv), ("attention", attention))}
    assert price == {"qkv": 2 * (4 * 4096 + 4 * 1024) + 4096 * 1024,
                     "attention": 2 * (4 * 4096 + 4096 * 1024 + 4 * 1024)}
    assert priced_matmul(qkv, depth, config, 1.0, 4).bytes == price["attention"]
    priced = priced_matmul(qkv, depth, config.replace(weight_format="int8"), 1.0, 4)
    assert matmul_seconds(priced, 1e30, 1e12, 2) == pytest.approx(price["qkv"] / 1e12)


def matmul(m: int, k: int, n: int, batch: int = 1, below_ridge: bool | None = None,
           full_depth_runs: float | None = None) -> Matmul:
    return Matmul(name="dot", op_name="jit(step)/dot_general", batch=batch, m=m, k=k, n=n, dtype="bf16",
                  flops=2 * batch * m * k * n, bytes=0, intensity=0.0, below_ridge=below_ridge, count=1,
                  full_depth_runs=full_depth_runs)


def collective(scope: str, bytes_per_device: float, count: int, full_depth_runs: float,
               kind: str = "all-reduce", buffer_bytes: int = 0) -> CollectiveReport:
    return CollectiveReport(name="all-reduce.1", kind=kind, op_name="", scope=scope, groups=[], group_size=1,
                            buffer_bytes=buffer_bytes, bytes_per_device=bytes_per_device, count=count,
                            full_depth_runs=full_depth_runs)


MATMULS = (matmul(512, 1024, 1024, below_ridge=False, full_depth_runs=10),
           matmul(1, 1024, 1024, below_ridge=True, full_depth_runs=1))
"""A layout's matmuls as `layout_report.layout_result` gives them, 2 of 10 layers compiled, so what runs in the
layer loop counts 5 times (the runs each entry gives); `COLLECTIVES` likewise."""
COLLECTIVES = (collective("inter_gpu", 1e6, 2, 10), collective("intra_gpu", 4e6, 1, 1), collective("local", 0.0, 3, 15))


def estimate(topology=CPX, passes=None, phase="train", collectives=COLLECTIVES) -> StepEstimate:
    """The estimate of `MATMULS` and `collectives` in a step of 4 x 128 tokens of a 10-layer model."""
    return estimate_step(MATMULS, collectives, topology, 2, passes, phase=phase, tokens=4 * 128, full_layers=10)


def test_estimate_scales_the_layer_loop_to_full_depth_and_sums_by_scope():
    estimated = estimate()
    costs = link_costs(CPX)
    big, small = MATMULS
    big_s = matmul_seconds(big, CPX.peak_flops, CPX.hbm_bandwidth, 2)
    small_s = matmul_seconds(small, CPX.peak_flops, CPX.hbm_bandwidth, 2)
    assert estimated.compute_s == pytest.approx(10 * big_s + small_s)
    assert estimated.memory_bound_s == pytest.approx(small_s)
    assert estimated.communication_s["inter_gpu"] == pytest.approx(2 * 5 * costs["inter_gpu"].seconds(1e6))
    assert estimated.communication_s["intra_gpu"] == pytest.approx(costs["intra_gpu"].seconds(4e6))
    assert estimated.communication_s["flat"] == 0
    assert estimated.tokens == 4 * 128


def test_serial_and_overlapped_bounds():
    estimate = StepEstimate(compute_s=2.0, memory_bound_s=0.5, communication_s={"intra_gpu": 1.0, "inter_gpu": 0.5},
                            tokens=300)
    assert (estimate.serial_s, estimate.overlapped_s, estimate.tokens_per_s) == (3.5, 2.0, 300 / 3.5)
    as_dict = to_json(estimate)
    assert as_dict["total_communication_s"] == 1.5 and as_dict["serial_s"] == 3.5
    assert StepEstimate(compute_s=0.0, memory_bound_s=0.0, communication_s={}, tokens=10).tokens_per_s == math.inf
    passes = dataclasses.replace(estimate, passes_s={"layers": 1.0, "update": 0.25, "accumulate": 0.5})
    assert (passes.serial_s, passes.overlapped_s) == (4.75, 3.25)  # one micro-batch adds nothing up


def test_an_accumulated_step_is_n_micro_steps_n_additions_and_one_update():
    micro = StepEstimate(compute_s=1.0, memory_bound_s=0.5, communication_s={"inter_gpu": 0.25}, tokens=100,
                         passes_s={"layers": 0.5, "update": 0.25, "accumulate": 0.125})
    four = micro.accumulated(4)
    assert (four.compute_s, four.communication_s, four.tokens) == (4.0, {"inter_gpu": 1.0}, 400)
    assert four.passes_s == {"layers": 2.0, "update": 0.25, "accumulate": 0.5}
    assert four.serial_s == 4.0 + 1.0 + 2.0 + 0.25 + 0.5
    assert from_json(StepEstimate, to_json(four)) == four
    with pytest.raises(ValueError):
        four.accumulated(2)


def test_the_accumulating_program_reduces_gradients_every_micro_step_and_updates_once():
    """What `accumulated` assumes, read from the compiled step of the tiny model under FSDP on two devices (2
    layers, 4 micro-batches): every gradient collective runs once per micro-batch, and no optimizer instruction runs
    inside the loop over the micro-batches."""
    from starscream_jax.analysis.compile import make_settings, step_program
    from starscream_jax.analysis.hlo import instructions_in_loops, parse_hlo
    from starscream_jax.hardware.mesh import build_topology_mesh
    from starscream_jax.sharding.apply import use_layout
    from starscream_jax.sharding.layouts import get_layout

    _, mesh = build_topology_mesh("h200", gpus=2, simulate=True)
    layout = get_layout("starscream_fsdp")
    texts = {}
    for micro_batches in (1, 4):
        settings = make_settings("tiny", "train", 8, 32, layout.name, 2)
        settings = dataclasses.replace(settings, training=dataclasses.replace(settings.training, batch_size=8,
                                                                              grad_accum=micro_batches))
        with use_layout(layout, mesh):
            step, args = step_program(settings, layout, mesh)
            texts[micro_batches] = step.lower(*args).compile().as_text()
    one, four = (sum(c.count for c in parse_hlo(texts[n]).collectives) for n in (1, 4))
    assert one > 0 and four == 4 * one
    optimizer = {line.split("=")[0].strip().lstrip("%") for line in texts[4].splitlines()
                 if 'op_name="jit(step)/optimizer' in line}
    accumulation_loop = instructions_in_loops(texts[4], 4)
    assert optimizer and accumulation_loop and not optimizer & accumulation_loop


RESULTS = Path(__file__).parents[2] / "benchmarks" / "results"


def stored_step(source: str, name: str) -> dict:
    """One stored H200 step: a row of a file of `steps`, or (decode_llama3-8b_1gpu.json) the decode row of batch
    `name` with the file's model, layout and scan_unroll."""
    stored = json.loads((RESULTS / source).read_text())
    if "steps" in stored:
        return next(row for row in stored["steps"] if row["name"] == name)
    meta, row = stored["meta"], next(row for row in stored["rows"] if str(row["batch"]) == name)
    return {"model": meta["model"], "layout": meta["layout"], "phase": "decode", "batch": row["batch"],
            "seq": row["cache_length"], "scan_unroll": meta["scan_unroll"], "step_s": row["step_s"]}


@pytest.mark.parametrize("source, name, scan_unroll, today", [
    ("h200_steps_inplace_cache.json", "1 GPU", 1, False),
    ("h200_steps_inplace_cache.json", "1 GPU decode", 1, False),
    ("h200_costmodel_heldout.json", "1 GPU decode unrolled", 16, False),
    ("decode_llama3-8b_1gpu.json", "1", 0, True),
    ("decode_llama3-8b_1gpu.json", "64", 0, True),
])
def test_the_step_estimate_is_within_20_percent_of_the_h200_measurement(source, name, scan_unroll, today):
    """Llama 3.2 1B: the train step, and the decode step with the layer loop rolled and unrolled over a stacked
    cache with XLA's attention (before cuDNN's); Llama 3 8B: the decode step generation runs today (no layer loop,
    the cache per layer, cuDNN's attention), estimated as `inspect` estimates it. Each compiled as it ran."""
    import numpy as np

    from starscream_jax.analysis.compile import make_settings
    from starscream_jax.analysis.layout_report import inspect_layouts
    from starscream_jax.analysis.memory import memory_passes
    from starscream_jax.hardware.mesh import build_topology_mesh

    case = stored_step(source, name)
    topology, mesh = build_topology_mesh("h200", gpus=1, simulate=True)
    settings = make_settings(case["model"], case["phase"], case["batch"], case["seq"], case["layout"], 2)
    settings = dataclasses.replace(settings, config=settings.config.replace(scan_unroll=scan_unroll),
                                   cache_per_layer=None if today else False)
    assert settings.holds_cache_per_layer == today
    result = inspect_layouts(settings, topology, mesh, reference=False)[case["layout"]]
    if today:  # what inspect and plan estimate: the cache read in place, as on an NVIDIA chip it is
        estimated = result.estimate
        assert "cache_copies" in estimated.passes_s and estimated.passes_s["cache_copies"] == 0
    else:
        config = settings.config.replace(n_layers=settings.full_layers)
        passes = memory_passes(config, case["layout"], mesh, case["phase"], case["batch"], case["seq"],
                               result.memory_per_device.persistent_parts())
        estimated = estimate_step(result.matmuls, result.collectives, topology, np.dtype(config.dtype).itemsize,
                                  passes, phase=result.phase, tokens=result.estimate.tokens,
                                  full_layers=result.layers.full)
        assert estimated.total_passes_s > 0.1 * estimated.serial_s  # the passes matter: matmuls alone miss
    assert estimated.serial_s == pytest.approx(case["step_s"], rel=0.2)


def test_measured_chips_run_matmuls_at_the_nearest_measured_efficiency_and_collectives_at_measured_bandwidth():
    from starscream_jax.analysis.costmodel import LinkCost, collective_seconds, hbm_rate, matmul_seconds, measurements

    h200 = measurements("h200")
    assert measurements("mi300x") is None  # no AMD measurement: the preset's figures alone
    row = h200.matmul[-1]
    assert h200.efficiency(*row[:3]) == row[3]
    assert h200.efficiency(row[0] + 1, row[1], row[2]) == row[3]  # nearest in log space
    shape = matmul(*row[:3])
    at_peak = matmul_seconds(shape, 989e12, 4.8e12, 2)
    assert matmul_seconds(shape, 989e12, 4.8e12, 2, h200) == pytest.approx(at_peak / row[3])
    copy = h200.copy_rate()
    assert copy == max(h200.collectives["copy"])[1] and 2e12 < copy < 4.8e12  # below the datasheet's 4.8 TB/s
    vector = matmul(1, 8192, 8192)  # below the ridge: its bytes, no dispatch-bound efficiency
    assert matmul_seconds(vector, 989e12, copy, 2, h200) == pytest.approx(2 * (8192 + 8192 * 8192 + 8192) / copy)
    assert hbm_rate(Topology.from_preset("h200"), h200) == copy
    assert hbm_rate(CPX, measurements("mi300x")) == CPX.hbm_bandwidth
    sizes = sorted(h200.collectives["all-reduce"])
    (small, slow), (large, fast) = sizes[-2], sizes[-1]
    middle = (small * large) ** 0.5
    assert h200.bus_bandwidth("all-reduce", middle) == pytest.approx((slow * fast) ** 0.5)
    assert h200.bus_bandwidth("all-to-all", middle) is None
    between = collective("inter_gpu", large, 1, 1, buffer_bytes=large)
    assert collective_seconds(between, LinkCost(1e-6, 1.0), h200) == pytest.approx(large / fast)
    assert collective_seconds(dataclasses.replace(between, scope="intra_gpu"), LinkCost(1e-6, 1e9), h200) == \
        pytest.approx(1e-6 + large / 1e9)


def test_a_layers_passes_take_at_least_the_measured_floor_of_its_small_kernels():
    from starscream_jax.analysis.costmodel import hbm_rate, measurements

    h200, topology = measurements("h200"), Topology.from_preset("h200")
    floor = h200.layer_floor
    assert 1e-6 < floor < 1e-4
    tiny, large = {"layers": 1.0}, {"layers": 1e12}
    assert estimate(topology, tiny, "decode", ()).passes_s["layers"] == pytest.approx(10 * floor)
    assert estimate(topology, tiny, "train", ()).passes_s["layers"] == pytest.approx(3 * 10 * floor)
    rate = hbm_rate(topology, h200)
    assert estimate(topology, large, "decode", ()).passes_s["layers"] == pytest.approx(1e12 / rate)
    assert estimate(CPX, tiny, "decode", ()).passes_s["layers"] == pytest.approx(1.0 / CPX.hbm_bandwidth)  # no floor
