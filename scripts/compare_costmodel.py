"""The cost model beside every stored H200 measurement, on CPU: for each stored memory_analysis() the GPU memory
estimate (`analysis.memory.gpu_memory`) and for each stored step time the cost model's estimate of the same step
(compiled here for simulated devices of the h200 preset, `costmodel.estimate_step`), with their ratios. Each row
names the file it was read from and whether the model's terms were read from it ("set"), or not: timed for the check
("heldout"), or timed after the terms were set, of a program they were not read from ("new").

    python scripts/compare_costmodel.py --out benchmarks/results/h200_costmodel_check.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
MEMORY_FILES = {"h200_memory_inplace_cache.json": "set", "h200_costmodel_heldout.json": "heldout"}
"""Stored memory_analysis() figures: the decode terms were read from the first (the in-place cache's program)."""
STEP_FILES = {"h200_costmodel.json": "set", "h200_steps_inplace_cache.json": "set",
              "h200_costmodel_heldout.json": "heldout",
              "superseded/decode_llama3-8b_1gpu_run4_unrolled_xla_attention.json": "set",
              "superseded/decode_llama3-8b_1gpu_run2_cache_in_place.json": "set",
              "superseded/decode_llama3-8b_1gpu_run9_cache_per_layer.json": "new",
              "decode_llama3-8b_1gpu.json": "new", "mfu_llama3.2-1b_1gpu.json": "new"}
"""Stored step times. h200_costmodel.json's decode row timed the program before the cache was written in place
(superseded by h200_steps_inplace_cache.json's); the two superseded decode_llama3-8b files time the decode step of
runs 2 and 4 (benchmarks/NOTES.md) with the layer loop rolled and unrolled (`--unroll 32`), XLA's attention over a
stacked cache (the profile of the rolled one, run 4, showed the copies `memory.decode_cache_copies` counts).
h200_costmodel_heldout.json's runs were timed for the check: no term was read from them. The run 9 and run 13 decode
files time the decode step generation runs (`CURRENT_DECODE`; run 13 with k and v on padded rows), and
mfu_llama3.2-1b_1gpu.json (run 12) the library's training step with and without the layer loop (bench_mfu.py's
library rows: "unroll N" in a row's name is its scan_unroll; plain JAX's rows are not the library's program)."""
CURRENT_DECODE = frozenset({"decode_llama3-8b_1gpu.json", "superseded/decode_llama3-8b_1gpu_run9_cache_per_layer.json"})
"""The stored decode runs of the program generation runs today: no layer loop (`scan_unroll` 0), the KV cache one
array per layer, attention through cuDNN. They are checked as `inspect` and `plan` judge decode (the cache's form
from the model, the attention from the preset's chip, `memory.reads_cache_in_place`). Every other stored decode run
predates cuDNN's decode attention (run 6): each is checked as the program it was, XLA's attention over a stacked
cache."""


def stored_memory() -> list[dict]:
    rows = []
    for name, role in MEMORY_FILES.items():
        for case in json.loads((RESULTS / name).read_text())["memory"]:
            if "error" not in case:
                rows.append({**case, "source": name, "role": role})
    return rows


def stored_steps() -> list[dict]:
    """Every stored step time as {name, model, phase, layout, mesh, batch, seq, remat, grad_accum, scan_unroll,
    step_s, source, role}."""
    cases = []
    for name, role in STEP_FILES.items():
        stored = json.loads((RESULTS / name).read_text())
        if "steps" in stored:
            for row in stored["steps"]:
                if name == "h200_costmodel.json" and row["phase"] == "decode":
                    continue  # the program before the in-place cache, re-timed in h200_steps_inplace_cache.json
                cases.append({"remat": "none", "grad_accum": 1, "scan_unroll": 1, **row, "source": name,
                              "role": role})
            continue
        meta = stored["meta"]
        if "seq_len" in meta:  # a training run of bench_mfu.py
            cases += training_cases(name, role, meta, stored["rows"])
            continue
        for row in stored["rows"]:
            unroll = meta.get("scan_unroll", 1)
            program = "no loop" if name in CURRENT_DECODE else "unrolled" if unroll > 1 else "rolled"
            cases.append({"name": f"{meta['model']} decode batch {row['batch']} {program}",
                          "model": meta["model"], "phase": "decode", "layout": meta["layout"], "mesh": meta["mesh"],
                          "batch": row["batch"], "seq": row["cache_length"], "remat": "none", "grad_accum": 1,
                          "scan_unroll": unroll, "step_s": row["step_s"], "source": name, "role": role})
    return cases


def training_cases(name: str, role: str, meta: dict, rows: list[dict]) -> list[dict]:
    """The library's rows of one bench_mfu.py file (layout name, optionally " unroll N") as step cases."""
    cases = []
    for row in rows:
        layout, _, unroll = row["name"].partition(" unroll ")
        if layout.startswith("plain") or " " in layout:
            continue
        cases.append({"name": f"{meta['model']} train {row['name']}", "model": meta["model"], "phase": "train",
                      "layout": layout, "mesh": meta["mesh"], "batch": meta["batch_size"], "seq": meta["seq_len"],
                      "remat": "full" if meta.get("remat") else "none", "grad_accum": 1,
                      "scan_unroll": int(unroll or 0), "step_s": row["step_s"], "source": name, "role": role})
    return cases


def memory_rows(measured: list[dict]) -> list[dict]:
    from starscream_jax.analysis.compile import abstract_args, abstract_cache
    from starscream_jax.analysis.memory import gpu_memory, held_bytes
    from starscream_jax.hardware.mesh import build_topology_mesh
    from starscream_jax.model.catalog import load_model_config
    from starscream_jax.sharding.apply import use_layout
    from starscream_jax.sharding.layouts import get_layout

    _, mesh = build_topology_mesh("h200", gpus=1, simulate=True)
    rows = []
    for case in measured:
        config = load_model_config(case["model"]).replace(remat=case["remat"])
        layout = get_layout(case["layout"])
        with use_layout(layout, mesh):
            _, args = abstract_args(config, layout, mesh, case["phase"], case["batch"], case["seq"])
        cache = abstract_cache(config, layout, mesh, case["batch"], case["seq"]) if case["phase"] != "train" else None
        groups = {"params": args.params, "optimizer_state": getattr(args, "opt_state", None), "kv_cache": cache}
        persistent = {name: held_bytes(tree) for name, tree in groups.items()}
        micro_batches = case.get("grad_accum", 1)
        estimate = gpu_memory(config, layout, mesh, case["phase"], case["batch"], case["seq"], persistent,
                              micro_batches)
        rows.append({**{k: case[k] for k in ("model", "phase", "batch", "seq", "remat", "source", "role")},
                     "grad_accum": micro_batches, "measured_bytes": case["peak_bytes"],
                     "estimated_bytes": estimate["total"], "ratio": estimate["total"] / case["peak_bytes"],
                     "estimate": estimate})
        print(f"{case['role']:8} {case['model']:13} {case['phase']:7} {case['batch']:3} x {case['seq']:5} "
              f"{case['remat']:5} accum {micro_batches}  measured {case['peak_bytes'] / 2**30:7.1f} GiB  "
              f"estimated {estimate['total'] / 2**30:7.1f} GiB  ratio {rows[-1]['ratio']:.2f}", flush=True)
    return rows


def step_rows(measured: list[dict]) -> list[dict]:
    """The cost model's estimate of each measured step, compiled here on simulated devices of the h200 preset (with
    gradient accumulation: one micro-step compiled, `StepEstimate.accumulated`) as it ran: its layer loop's unroll,
    and in decode its cache's form and attention (`CURRENT_DECODE`), which its memory passes follow."""
    import dataclasses

    import numpy as np

    from starscream_jax.analysis.compile import make_settings
    from starscream_jax.analysis.costmodel import estimate_step
    from starscream_jax.analysis.json_form import to_json
    from starscream_jax.analysis.layout_report import inspect_layouts
    from starscream_jax.analysis.memory import memory_passes, reads_cache_in_place
    from starscream_jax.hardware.mesh import build_topology_mesh

    rows = []
    for case in measured:
        gpus = case["mesh"]["data"] * case["mesh"]["gpu"]
        topology, mesh = build_topology_mesh("h200", gpus=gpus, data=case["mesh"]["data"], simulate=True)
        micro_batches = case["grad_accum"]
        settings = make_settings(case["model"], case["phase"], case["batch"] // micro_batches, case["seq"],
                                 case["layout"], 2)
        current = case["source"] in CURRENT_DECODE
        settings = dataclasses.replace(settings, config=settings.config.replace(
            remat=case["remat"], scan_unroll=case["scan_unroll"]), cache_per_layer=None if current else False)
        result = inspect_layouts(settings, topology, mesh, reference=False)[case["layout"]]
        config = settings.config.replace(n_layers=settings.full_layers)
        in_place = current and reads_cache_in_place(topology.preset.chip, config.dtype)
        passes = memory_passes(config, case["layout"], mesh, settings.phase, settings.batch, settings.seq,
                               result.memory_per_device.persistent_parts(), settings.holds_cache_per_layer, in_place)
        micro = estimate_step(result.matmuls, result.collectives, topology, np.dtype(config.dtype).itemsize, passes,
                              phase=result.phase, tokens=result.estimate.tokens, full_layers=result.layers.full)
        estimate = to_json(micro.accumulated(micro_batches))
        rows.append({**{k: case[k] for k in ("name", "model", "phase", "batch", "seq", "remat", "grad_accum",
                                             "scan_unroll", "mesh", "source", "role")},
                     "cache_per_layer": settings.holds_cache_per_layer, "cache_read_in_place": in_place,
                     "measured_s": case["step_s"], "estimated_s": estimate["serial_s"],
                     "ratio": estimate["serial_s"] / case["step_s"], "estimate": estimate})
        passes = ", ".join(f"{kind} {seconds * 1e3:.1f}" for kind, seconds in estimate["passes_s"].items()
                           if kind != "accumulate" or micro_batches > 1)
        print(f"{case['role']:8} {case['name']:30} measured {case['step_s'] * 1e3:7.2f} ms  estimated "
              f"{estimate['serial_s'] * 1e3:7.2f} ms  ratio {rows[-1]['ratio']:.2f}  (matmuls "
              f"{estimate['compute_s'] * 1e3:.1f}, collectives {estimate['total_communication_s'] * 1e3:.1f}, "
              f"passes {estimate['total_passes_s'] * 1e3:.1f}: {passes})", flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--parts", default="memory,steps")
    args = parser.parse_args(argv)
    from starscream_jax.hardware.simulation import simulate_cpu_devices
    simulate_cpu_devices(2)
    result = {"command": "python " + " ".join(sys.argv), "memory_files": MEMORY_FILES, "step_files": STEP_FILES}
    if "memory" in args.parts:
        result["memory"] = memory_rows(stored_memory())
    if "steps" in args.parts:
        result["steps"] = step_rows(stored_steps())
    for part in ("memory", "steps"):
        ratios = [row["ratio"] for row in result.get(part, [])]
        if ratios:
            print(f"{part}: estimate / measured from {min(ratios):.2f} to {max(ratios):.2f} over {len(ratios)} runs")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
