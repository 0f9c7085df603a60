"""The cost model beside the H200 measurements (benchmarks/results/h200_costmodel.json), on CPU: for each stored
memory_analysis() the GPU memory estimate (`analysis.memory.gpu_memory`) and for each stored step time the cost
model's estimate of the same step (compiled here for simulated devices of the h200 preset), with their ratios.

    python scripts/compare_costmodel.py --out benchmarks/results/h200_costmodel_check.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

MEASURED = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "h200_costmodel.json"


def memory_rows(measured: list[dict]) -> list[dict]:
    import jax

    from starscream_jax.analysis.compile import abstract_args, abstract_cache
    from starscream_jax.analysis.layout_report import _shard_bytes
    from starscream_jax.analysis.memory import gpu_memory
    from starscream_jax.hardware.mesh import build_topology_mesh
    from starscream_jax.model.config import load_model_config
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
        persistent = {"params": sum(_shard_bytes(x) for x in jax.tree.leaves(args.params)),
                      "optimizer_state": sum(_shard_bytes(x) for x in jax.tree.leaves(getattr(args, "opt_state", None))),
                      "kv_cache": sum(_shard_bytes(x) for x in jax.tree.leaves(cache))}
        estimate = gpu_memory(config, layout, mesh, case["phase"], case["batch"], case["seq"], persistent)
        rows.append({**{k: case[k] for k in ("model", "phase", "batch", "seq", "remat")},
                     "measured_bytes": case["peak_bytes"], "estimated_bytes": estimate["total"],
                     "ratio": estimate["total"] / case["peak_bytes"], "estimate": estimate})
        print(f"{case['model']:12} {case['phase']:6} {case['batch']:3} x {case['seq']:5} {case['remat']:5} "
              f"measured {case['peak_bytes'] / 2**30:7.1f} GiB  estimated {estimate['total'] / 2**30:7.1f} GiB  "
              f"ratio {rows[-1]['ratio']:.2f}", flush=True)
    return rows


def step_rows(measured: list[dict]) -> list[dict]:
    """The cost model's estimate of each measured step, compiled here on simulated devices of the h200 preset."""
    from starscream_jax.analysis.compile import make_settings
    from starscream_jax.analysis.layout_report import inspect_layouts
    from starscream_jax.hardware.mesh import build_topology_mesh

    rows = []
    for case in measured:
        gpus = case["mesh"]["data"] * case["mesh"]["gpu"]
        topology, mesh = build_topology_mesh("h200", gpus=gpus, data=case["mesh"]["data"], simulate=True)
        settings = make_settings(case["model"], case["phase"], case["batch"], case["seq"], case["layout"], 2)
        estimate = inspect_layouts(settings, topology, mesh, reference=False)[case["layout"]]["estimate"]
        rows.append({"name": case["name"], "measured_s": case["step_s"], "estimated_s": estimate["serial_s"],
                     "ratio": estimate["serial_s"] / case["step_s"], "estimate": estimate})
        print(f"{case['name']:24} measured {case['step_s'] * 1e3:8.1f} ms  estimated {estimate['serial_s'] * 1e3:8.1f} ms"
              f"  (matmuls {estimate['compute_s'] * 1e3:.1f}, collectives {estimate['total_communication_s'] * 1e3:.1f})"
              f"  ratio {rows[-1]['ratio']:.2f}", flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--measured", type=Path, default=MEASURED)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--parts", default="memory,steps")
    args = parser.parse_args(argv)
    from starscream_jax.hardware.simulation import simulate_cpu_devices
    simulate_cpu_devices(2)
    measured = json.loads(args.measured.read_text())
    result = {"command": "python " + " ".join(sys.argv), "measured": str(args.measured)}
    if "memory" in args.parts:
        result["memory"] = memory_rows(measured["memory"])
    if "steps" in args.parts:
        result["steps"] = step_rows(measured["steps"])
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
