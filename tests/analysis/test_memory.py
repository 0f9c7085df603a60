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
    reads_cache_in_place,
)
from starscream_jax.hardware.mesh import build_topology_mesh
from starscream_jax.hardware.presets import load_chip
from starscream_jax.model.catalog import load_model_config
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
    persistent = memory_per_device(settings, layout, mesh, None, hbm_bytes=0).persistent_parts()
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
    layer_weights = layer_weight_elements(config, get_layout("starscream_decode"), mesh)
    rolled = memory_passes(config.replace(scan_unroll=1), "starscream_decode", mesh, "decode", 16, 64, persistent)
    assert rolled["weight_copies"] == 2 * 4 * config.n_layers * layer_weights  # tiny computes in float32


@pytest.mark.parametrize("scan_unroll, per_layer, in_place, copies", [
    (1, False, False, 6),  # rolled over a stacked cache, XLA's attention: sliced, transposed per layer and whole
    (0, False, False, 2),  # no loop (scan_unroll 0 in decode), stacked cache: XLA's attention's transposed copy
    (0, False, True, 2),  # no loop, stacked cache, cuDNN: each layer's slice copied out for the library call
    (0, True, True, 0),  # as generation decodes on NVIDIA: per-layer arrays read in place
    (0, True, False, 2),  # per-layer arrays through XLA's attention (other chips)
])
def test_decode_cache_copies_follow_the_program(scan_unroll, per_layer, in_place, copies):
    """The decode step's whole-cache copies by its layer loop, its cache's form and its attention (benchmarks/NOTES.md
    runs 4, 6 and 9 profiled the first four on an H200); weights are copied out of their stacks only by a loop."""
    _, mesh = build_topology_mesh("mi300x-qpx-nps1", gpus=2, simulate=True)
    config = load_model_config("tiny").replace(scan_unroll=scan_unroll)
    persistent = {"params": 1000.0, "kv_cache": 4096.0}
    passes = memory_passes(config, "starscream_decode", mesh, "decode", 16, 64, persistent, per_layer, in_place)
    assert passes["cache_copies"] == copies * 4096
    assert ("weight_copies" in passes) == (scan_unroll == 1)


def test_decode_attention_reads_the_cache_in_place_where_the_model_calls_cudnn():
    """ops._cached_attention calls cuDNN on NVIDIA GPUs for 16-bit inputs, XLA's attention otherwise."""
    h200, mi300x, cpu = (load_chip(name) for name in ("h200", "mi300x", "cpu"))
    assert reads_cache_in_place(h200, "bfloat16") and reads_cache_in_place(h200, "float16")
    assert not reads_cache_in_place(h200, "float32")
    assert not reads_cache_in_place(mi300x, "bfloat16") and not reads_cache_in_place(cpu, "bfloat16")


def test_matmul_flops_divide_by_the_devices_that_split_the_work():
    _, mesh = build_topology_mesh("mi300x-qpx-nps1", gpus=2, simulate=True)
    config = load_model_config("tiny")
    split = matmul_flops(config, "starscream_tp", mesh, 8, 64)  # heads over 2 GPUs, tokens over 4 partitions
    copied = matmul_flops(config, "gpu_tp", mesh, 8, 64)  # every partition computes its GPU's whole share
    assert copied == pytest.approx(4 * split)
    per_token = 2 * (config.n_layers * (config.d_model * config.head_dim * (2 * config.n_heads + 2 * config.n_kv_heads)
                                        + 3 * config.d_model * config.d_ff) + config.d_model * config.vocab_size)
    assert split == pytest.approx(per_token * 8 * 64 / 8)



def test_decode_with_the_cache_per_layer_holds_no_part_of_it_in_flight():
    """Llama 3 8B decode as generation runs it (decode_llama3-8b_1gpu.json, one H200): the compiled step held its
    weights, its cache and temporaries of 34 MB (batch 1) and 86 MB (batch 64); the stacked cache's term (half a
    cache in flight) would overstate batch 64's by 17 GB."""
    _, mesh = build_topology_mesh("h200", gpus=1, simulate=True)
    stored = json.loads((RESULTS / "decode_llama3-8b_1gpu.json").read_text())
    config = load_model_config(stored["meta"]["model"])
    for row in stored["rows"]:
        persistent = {"params": row["bytes_per_step"]["weights"], "kv_cache": row["bytes_per_step"]["kv_cache"]}
        measured = persistent["params"] + persistent["kv_cache"] + row["temp_bytes"]
        per_layer, stacked = (gpu_memory(config, "starscream_decode", mesh, "decode", row["batch"], row["cache_length"],
                                         persistent, cache_per_layer=held) for held in (True, False))
        assert per_layer["total"] == pytest.approx(measured, rel=0.01)
    assert stacked["total"] > 1.3 * measured  # batch 64
