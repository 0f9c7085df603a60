"""The paper's comparisons (up to 4x for attention, 1.43x for fused GEMMs, hierarchical against chiplet-oblivious
layouts) as MODEL PREDICTIONS swept over batch and sequence on the MI300X CPX and MI355X CPX presets, beside the H200
measurements of the same kernel shapes (benchmarks/results/h200_kernel_shapes.json, `scripts/bench_kernels.py` on
one H200, 2026-11-29).

Per-device kernel shapes come from `bench_kernels.kernels` (the model configuration and the layouts' rules: flat_tp
against starscream_tp on 8 GPUs x 8 partitions). Each kernel's predicted time on one partition of the preset is the
cost model's roofline, max(FLOPs / peak, bytes / HBM bandwidth), with bf16 operands and results:
  matmul            FLOPs 2 M K N; bytes of both operands and the result, at the efficiency of the nearest shape
                    measured on the H200 (`costmodel.measurements("h200")`, a stand-in: no AMD partition was measured)
                    or at peak (column "at peak");
  decode attention  FLOPs 4 B H T E; bytes of q, the kv heads each device reads (the cache of B x T positions) and
                    the output.
The ratio is flat time / hierarchical time per device (above 1: the hierarchical layout is faster).

    python scripts/sweep_paper_comparisons.py --out benchmarks/results/paper_comparisons_model.json \\
        --plot docs/figures/paper_comparisons_model.png
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from bench_kernels import flops, kernels, layout_mesh

from starscream_jax.analysis.costmodel import measurements, shape_seconds
from starscream_jax.benchmarks import harness
from starscream_jax.hardware.topology import Topology
from starscream_jax.model.catalog import load_model_config
from starscream_jax.sharding.layouts import get_layout

PRESETS = ("mi300x-cpx-nps1", "mi355x-cpx-nps2")
BATCHES = (1, 4, 16, 64, 256)
SEQS = (1024, 2048, 4096, 8192)
GEMMS = ("qkv_fused", "gate_up_fused", "o_proj", "down")
MEASURED = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "h200_kernel_shapes.json"
BF16 = 2


def predicted_seconds(kernel: str, shape: list, topology, efficiency) -> float:
    """The roofline time of one kernel on one partition (see the module docstring)."""
    if kernel == "attn_decode":
        (b, s, h, e), (_, t, k, _) = shape
        moved = BF16 * (2 * b * s * h * e + 2 * b * t * k * e)
        return max(flops(kernel, shape) / topology.peak_flops, moved / topology.hbm_bandwidth)
    m, k, n = shape
    return shape_seconds(1, m, k, n, topology.peak_flops, topology.hbm_bandwidth, BF16, efficiency)


def sweep(preset: str, model: str = "llama3-70b") -> list[dict]:
    """Rows of kernel, batch, seq, shapes and predicted flat / hierarchical ratios for one preset (8 GPUs)."""
    topology = Topology.from_preset(preset, gpus=8)
    mesh = layout_mesh(f"{preset}:8")
    config = load_model_config(model)
    flat, hier = get_layout("flat_tp"), get_layout("starscream_tp")
    h200 = measurements("h200")
    rows = []
    for batch in BATCHES:
        for seq in SEQS:
            found = kernels(config, flat, hier, mesh, [batch * seq], [], [(batch, seq)] if batch >= 8 else [])
            for kernel in found:
                if kernel.kernel not in (*GEMMS, "attn_decode"):
                    continue
                times = {name: {layout: predicted_seconds(kernel.kernel, shape, topology, efficiency)
                                for layout, shape in (("flat", kernel.flat_shape), ("hier", kernel.hier_shape))}
                         for name, efficiency in (("h200_efficiency", h200), ("at_peak", None))}
                rows.append({"preset": preset, "kernel": kernel.kernel, "batch": batch, "seq": seq,
                             "flat_shape": kernel.flat_shape, "hier_shape": kernel.hier_shape,
                             **{f"ratio_{name}": t["flat"] / t["hier"] for name, t in times.items()}})
    return rows


def measured_rows() -> list[dict]:
    """The H200's flat / hierarchical time ratio per kernel of MEASURED, with its tokens (batch x seq; attention rows
    name theirs, "attn_decode B64 L8192")."""
    rows = []
    for row in json.loads(MEASURED.read_text()):
        kernel, *case = row["kernel"].split()
        tokens = row.get("tokens") or math.prod(int(part[1:]) for part in case)
        rows.append({"kernel": kernel, "tokens": tokens, "ratio": row["flat_us"] / row["hier_us"]})
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Per preset and kernel: the largest and smallest predicted ratio and where."""
    table = []
    for preset in dict.fromkeys(row["preset"] for row in rows):
        for kernel in dict.fromkeys(row["kernel"] for row in rows):
            mine = [row for row in rows if row["preset"] == preset and row["kernel"] == kernel]
            best = max(mine, key=lambda row: row["ratio_h200_efficiency"])
            worst = min(mine, key=lambda row: row["ratio_h200_efficiency"])
            table.append({"preset": preset, "kernel": kernel, "max": best["ratio_h200_efficiency"],
                          "at": f"B{best['batch']} S{best['seq']}", "min": worst["ratio_h200_efficiency"],
                          "max_at_peak": max(row["ratio_at_peak"] for row in mine)})
    return table


def plot(rows: list[dict], measured: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    kernels_shown = list(dict.fromkeys(row["kernel"] for row in rows))
    figure, axes = pyplot.subplots(1, len(kernels_shown), figsize=(4 * len(kernels_shown), 4), dpi=100, sharey=True)
    for ax, kernel in zip(axes, kernels_shown):
        for preset in PRESETS:
            mine = [row for row in rows if row["kernel"] == kernel and row["preset"] == preset]
            ax.scatter([row["batch"] * row["seq"] for row in mine], [row["ratio_h200_efficiency"] for row in mine],
                       label=f"{preset} (model prediction)", alpha=0.7, s=18)
        seen = [row for row in measured if row["kernel"] == kernel]
        if seen:
            ax.scatter([row["tokens"] for row in seen], [row["ratio"] for row in seen], marker="D", color="black",
                       label="H200 measured, same shapes")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set(title=kernel, xscale="log", yscale="log", xlabel="tokens (batch x seq; decode: batch x cache)")
        ax.legend(fontsize=6)
    axes[0].set_ylabel("flat_tp time / starscream_tp time per device")
    figure.suptitle("MODEL PREDICTIONS (cost model rooflines), not measurements: Llama 3 70B kernels on 8 GPUs x 8 "
                    "partitions", fontsize=10)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, bbox_inches="tight")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="write every row as JSON, with the run's metadata")
    parser.add_argument("--plot", type=Path, default=None, help="draw the ratios against tokens")
    args = parser.parse_args(argv)
    info = harness.run_info(__file__, argv)
    rows = [row for preset in PRESETS for row in sweep(preset)]
    table = summary(rows)
    print("MODEL PREDICTIONS: flat_tp / starscream_tp time per device (H200 shape efficiency; at peak in brackets)")
    for row in table:
        print(f"  {row['preset']:16} {row['kernel']:14} max {row['max']:5.2f} at {row['at']:11} (at peak "
              f"{row['max_at_peak']:5.2f}), min {row['min']:5.2f}")
    measured = measured_rows()
    print(f"H200 measured, same kernel shapes ({MEASURED.name}): flat time / hierarchical time")
    for row in measured:
        predicted = [r["ratio_h200_efficiency"] for r in rows if r["kernel"] == row["kernel"]
                     and r["batch"] * r["seq"] == row["tokens"] and r["preset"] == PRESETS[0]]
        beside = f"  (MI300X CPX prediction {predicted[0]:.2f})" if predicted else ""
        print(f"  {row['kernel']:14} {row['tokens']:>7} tokens  {row['ratio']:.2f}{beside}")
    harness.write_json(args.out, {**info.as_dict(), "kind": "model predictions", "summary": table, "rows": rows,
                                  "h200_measured": measured})
    if args.plot:
        plot(rows, measured, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
