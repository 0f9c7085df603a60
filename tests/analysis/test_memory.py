"""The GPU memory estimate against H200 memory_analysis() of the same programs (benchmarks/results), and how it
moves with the remat policy, micro-batches and the layout."""
import json
from pathlib import Path

import pytest

from starscream_jax.analysis.compile import make_settings
from starscream_jax.analysis.layout_report import memory_per_device
from starscream_jax.analysis.memory import (
    activation_bytes,
    gpu_memory,
    layer_weight_elements,
    matmul_flops,
    memory_passes,
)
from starscream_jax.hardware.mesh import build_topology_mesh
from starscream_jax.model.config import load_model_config
from starscream_jax.sharding.layouts import get_layout

RESULTS = Path(__file__).parents[2] / "benchmarks" / "results"
MEASURED = [case for name in ("h200_memory_inplace_cache.json", "h200_costmodel_heldout.json")
            for case in json.loads((RESULTS / name).read_text())["memory"] if "error" not in case]
"""memory_analysis() of the programs the code compiles today (the decode step writes its KV cache in place): those
the terms were read from, then held-out ones (other models, batches, remat policies, accumulation, prefill)."""


@pytest.mark.parametrize("case", MEASURED, ids=lambda c: f"{c['model']}-{c['phase']}-{c['batch']}x{c['seq']}-"
                                                         f"{c['remat']}-accum{c.get('grad_accum', 1)}")
def test_estimate_is_within_15_percent_of_the_h200_compile(case):
    _, mesh = build_topology_mesh("h200", gpus=1, simulate=True)
    config = load_model_config(case["model"]).replace(remat=case["remat"])
    layout = get_layout(case["layout"])
    settings = make_settings(case["model"], case["phase"], case["batch"], case["seq"], layout.name, config.n_layers)
    persistent = memory_per_device(settings, layout, mesh, None, hbm_bytes=0)
    estimate = gpu_memory(config, layout, mesh, case["phase"], case["batch"], case["seq"], persistent,
                          case.get("grad_accum", 1))
    assert estimate["total"] == pytest.approx(case["peak_bytes"], rel=0.15)


def test_recomputation_and_micro_batches_shrink_the_activations_the_layout_spreads_them():
    _, mesh = build_topology_mesh("mi300x-qpx-nps1", gpus=2, simulate=True)
    config = load_model_config("tiny")
    layer = activation_bytes(config, "starscream_tp", mesh, 16, 64)
    assert layer["none"] > layer["dots"] > layer["full"] > 0
    persistent = {"params": 1000.0, "optimizer_state": 2000.0, "kv_cache": 0.0}
    dots = config.replace(remat="dots")  # "none" also keeps each layer's weights, whatever the micro-batch
    one, four = (gpu_memory(dots, "starscream_tp", mesh, "train", 16, 64, persistent, n) for n in (1, 4))
    assert four["saved_activations"] == pytest.approx(one["saved_activations"] / 4)
    assert one["gradients"] == 1000.0 and one["total"] == pytest.approx(sum(v for k, v in one.items() if k != "total"))
    assert four["gradients"] == 2000.0  # the running sum beside the micro-step's gradients
    copied = activation_bytes(config, "gpu_tp", mesh, 16, 64)  # tokens replicated over the 4 partitions
    assert copied["full"] == 4 * layer["full"]


def test_memory_passes_follow_the_program_remat_policy_and_layer_loop():
    _, mesh = build_topology_mesh("mi300x-qpx-nps1", gpus=2, simulate=True)
    config = load_model_config("tiny")
    persistent = {"params": 1000.0, "optimizer_state": 2000.0, "kv_cache": 4096.0}
    none, dots, full = (memory_passes(config.replace(remat=remat), "starscream_tp", mesh, "train", 16, 64, persistent)
                        for remat in ("none", "dots", "full"))
    assert none["update"] == 4 * 1000 + 2 * 2000 and none["accumulate"] == 3 * 1000
    assert none["saved"] > dots["saved"] > full["saved"] > 0
    assert dots["layers"] == full["layers"] == none["layers"] * 4 / 3  # the forward once more
    assert full["casts"] == none["casts"] * 3 / 2
    doubled = memory_passes(config, "starscream_tp", mesh, "train", 32, 64, persistent)
    assert doubled["layers"] == pytest.approx(2 * none["layers"]) and doubled["loss"] == pytest.approx(2 * none["loss"])
    rolled = memory_passes(config, "starscream_decode", mesh, "decode", 16, 64, persistent)
    unrolled = memory_passes(config.replace(scan_unroll=config.n_layers), "starscream_decode", mesh, "decode", 16, 64,
                             persistent)
    assert (rolled["cache_copies"], unrolled["cache_copies"]) == (6 * 4096, 2 * 4096)
    layer_weights = layer_weight_elements(config, get_layout("starscream_decode"), mesh)
    assert rolled["weight_copies"] == 2 * 4 * config.n_layers * layer_weights  # tiny computes in float32
    assert "weight_copies" not in unrolled


def test_matmul_flops_divide_by_the_devices_that_split_the_work():
    _, mesh = build_topology_mesh("mi300x-qpx-nps1", gpus=2, simulate=True)
    config = load_model_config("tiny")
    split = matmul_flops(config, "starscream_tp", mesh, 8, 64)  # heads over 2 GPUs, tokens over 4 partitions
    copied = matmul_flops(config, "gpu_tp", mesh, 8, 64)  # every partition computes its GPU's whole share
    assert copied == pytest.approx(4 * split)
    per_token = 2 * (config.n_layers * (config.d_model * config.head_dim * (2 * config.n_heads + 2 * config.n_kv_heads)
                                        + 3 * config.d_model * config.d_ff) + config.d_model * config.vocab_size)
    assert split == pytest.approx(per_token * 8 * 64 / 8)

