"""Pictures of the mesh, of layouts and of plans (matplotlib, Agg backend, PNG). Each picture is drawn from a plain
data function that the tests check (`*_data`), so what is drawn is what was computed.

  topology  the node(s), each GPU a box, each partition inside it with its device id and (data, gpu, xcd).
  layouts   per layout, side by side: a device x device heatmap of the bytes each device sends to each other per
            step (a collective over a group of g devices spreads each member's ring bytes evenly over the g - 1
            others; a permute sends them to its target), with the GPU boundaries drawn; the bytes per device by
            scope; and the local matmuls on a roofline (arithmetic intensity against attainable FLOP/s, the ridge
            point marked).
  plans     per phase, each candidate's step time against its memory per device, the chosen one marked, those that
            do not fit at their cost-model lower bound, and the partition's HBM.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..hardware.mesh import device_table
from .layout_report import LayoutResult
from .report import SCOPES

GIB = 2 ** 30


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    return pyplot


def _save(figure, path: Path | str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, bbox_inches="tight")
    _pyplot().close(figure)
    return path


# ---- topology -------------------------------------------------------------------------------------------------------

def topology_data(mesh) -> list[dict[str, Any]]:
    """One record per physical GPU in mesh order: {"data", "gpu", "devices": [{"id", "xcd"}]}."""
    return [{"data": data, "gpu": gpu, "devices": [{"id": device, "xcd": xcd} for xcd, device in enumerate(row)]}
            for data, plane in enumerate(device_table(mesh)) for gpu, row in enumerate(plane)]


def plot_topology(topology, mesh, path: Path | str) -> Path:
    """The GPUs of the mesh as boxes (labelled with their (data, gpu) position), each partition a cell with its
    device id and mesh coordinates."""
    gpus = topology_data(mesh)
    partitions = len(gpus[0]["devices"])
    columns = min(len(gpus), 4)
    rows = -(-len(gpus) // columns)
    pyplot = _pyplot()
    figure, axes = pyplot.subplots(figsize=(3.2 * columns, 1.2 + 0.45 * partitions * rows), dpi=100)
    for index, gpu in enumerate(gpus):
        left, top = (index % columns) * 3.2, -(index // columns) * (0.45 * partitions + 0.9)
        axes.add_patch(pyplot.Rectangle((left, top - 0.45 * partitions - 0.1), 3.0, 0.45 * partitions + 0.5,
                                        fill=False, linewidth=2))
        axes.text(left + 0.1, top + 0.22, f"GPU (data {gpu['data']}, gpu {gpu['gpu']})", fontsize=9, weight="bold")
        for device in gpu["devices"]:
            y = top - 0.45 * (device["xcd"] + 1)
            axes.add_patch(pyplot.Rectangle((left + 0.1, y), 2.8, 0.4, color="tab:blue", alpha=0.25))
            axes.text(left + 0.2, y + 0.12, f"device {device['id']}  ({gpu['data']}, {gpu['gpu']}, {device['xcd']})",
                      fontsize=8)
    axes.set_xlim(-0.1, 3.2 * columns)
    axes.set_ylim(-(0.45 * partitions + 0.9) * rows, 0.6)
    axes.axis("off")
    axes.set_title(f"{topology.preset.chip.description} ({topology.preset.name}): mesh "
                   f"{dict(mesh.shape)}; device id and (data, gpu, xcd) of each partition")
    return _save(figure, path)


# ---- layouts --------------------------------------------------------------------------------------------------------

def traffic_matrix(result: LayoutResult, devices: int) -> np.ndarray:
    """[devices, devices] bytes device i sends device j in one full-depth step (partition ids in mesh order), from
    the collectives of one `inspect` result."""
    matrix = np.zeros((devices, devices))
    for collective in result.collectives:
        sent = collective.bytes_per_device * collective.full_depth_runs
        if collective.kind == "collective-permute":
            for source, target in collective.groups:
                matrix[source, target] += sent
            continue
        for group in collective.groups:
            for source in group:
                for target in group:
                    if source != target:
                        matrix[source, target] += sent / (len(group) - 1)
    return matrix


def roofline_points(result: LayoutResult, peak_flops: float, hbm_bandwidth: float) -> list[dict[str, float]]:
    """Each local matmul as {"name", "intensity" (FLOP/B), "attainable" (FLOP/s: min(peak, intensity x HBM
    bandwidth)), "flops" (in the full-depth step)}."""
    return [{"name": m.name, "intensity": m.intensity,
             "attainable": min(peak_flops, m.intensity * hbm_bandwidth), "flops": m.flops * m.full_depth_runs}
            for m in result.matmuls]


def layout_plot_data(results: dict[str, LayoutResult], mesh, topology) -> dict[str, dict]:
    """Per layout: "traffic" (the device x device matrix), "gpu_boundaries" (the partition indices where a new GPU
    starts), "by_scope" (bytes per device per step) and "roofline" (points, "ridge_point", "peak_flops")."""
    devices, partitions = mesh.devices.size, mesh.devices.shape[-1]
    return {name: {"traffic": traffic_matrix(result, devices),
                   "gpu_boundaries": list(range(partitions, devices, partitions)),
                   "by_scope": {scope: result.bytes_per_device.by_scope[scope] for scope in SCOPES},
                   "roofline": {"points": roofline_points(result, topology.peak_flops, topology.hbm_bandwidth),
                                "ridge_point": topology.ridge_point, "peak_flops": topology.peak_flops}}
            for name, result in results.items()}


def plot_layouts(results: dict[str, LayoutResult], mesh, topology, path: Path | str) -> Path:
    """One column per layout: traffic heatmap (GPU boundaries drawn), bytes by scope, roofline."""
    data = layout_plot_data(results, mesh, topology)
    pyplot = _pyplot()
    figure, axes = pyplot.subplots(3, len(data), figsize=(5 * len(data), 13), dpi=100, squeeze=False)
    for column, (name, layout) in enumerate(data.items()):
        heat = axes[0, column].imshow(layout["traffic"] / GIB, cmap="viridis")
        for boundary in layout["gpu_boundaries"]:
            axes[0, column].axhline(boundary - 0.5, color="white", linewidth=0.8)
            axes[0, column].axvline(boundary - 0.5, color="white", linewidth=0.8)
        figure.colorbar(heat, ax=axes[0, column], label="GiB sent per step")
        axes[0, column].set(title=f"{name}: bytes between devices", xlabel="to device (mesh order)",
                            ylabel="from device")
        scopes = [scope for scope in SCOPES if scope != "local"]
        axes[1, column].bar(scopes, [layout["by_scope"][scope] / GIB for scope in scopes],
                            color=["tab:green", "tab:orange", "tab:purple", "tab:red"][:len(scopes)])
        axes[1, column].set(title="bytes per device per step by scope", ylabel="GiB")
        _roofline(axes[2, column], layout["roofline"])
    figure.tight_layout()
    return _save(figure, path)


def _roofline(axes, roofline: dict) -> None:
    points, ridge, peak = roofline["points"], roofline["ridge_point"], roofline["peak_flops"]
    intensities = [p["intensity"] for p in points] or [ridge]
    span = np.logspace(np.log10(min(min(intensities), ridge) / 2), np.log10(max(max(intensities), ridge) * 2), 100)
    axes.loglog(span, np.minimum(peak, span * peak / ridge) / 1e12, color="black", linewidth=1)
    axes.axvline(ridge, color="grey", linestyle="--", label=f"ridge point {ridge:.0f} FLOP/B")
    total = sum(p["flops"] for p in points) or 1
    axes.scatter([p["intensity"] for p in points], [p["attainable"] / 1e12 for p in points],
                 s=[20 + 400 * p["flops"] / total for p in points], alpha=0.6)
    axes.set(title="local matmuls on the roofline (size: share of FLOPs)", xlabel="intensity (FLOP/B)",
             ylabel="attainable TFLOP/s per device")
    axes.legend(loc="lower right")


# ---- plans ----------------------------------------------------------------------------------------------------------

def plan_plot_data(plans: dict[str, dict]) -> dict[str, dict]:
    """Per phase: "compiled" [(name, memory GiB, step ms, chosen)], "too_big" [(name, memory GiB, lower bound ms)]
    and "hbm_gib"."""
    data = {}
    for phase, plan in plans.items():
        entries = plan["candidates"]
        data[phase] = {
            "compiled": [(e["name"], e["memory"]["total"] / GIB, e["estimate"]["serial_s"] * 1e3,
                          e["status"] == "chosen") for e in entries if e["estimate"] is not None],
            "too_big": [(e["name"], e["memory"]["total"] / GIB, e["lower_bound_s"] * 1e3)
                        for e in entries if e["status"] == "does not fit"],
            "hbm_gib": plan["hbm_per_device"] / GIB,
        }
    return data


def plot_plans(plans: dict[str, dict], path: Path | str) -> Path:
    """One panel per phase: step time against memory per device for each candidate, the chosen one a star."""
    data = plan_plot_data(plans)
    pyplot = _pyplot()
    figure, axes = pyplot.subplots(1, len(data), figsize=(6 * len(data), 4.5), dpi=100, squeeze=False)
    for ax, (phase, points) in zip(axes[0], data.items()):
        compiled = points["compiled"]
        ax.scatter([p[1] for p in compiled], [p[2] for p in compiled], label="compiled (cost model)", alpha=0.7)
        for name, memory, step, chosen in compiled:
            if chosen:
                ax.scatter([memory], [step], marker="*", s=300, color="tab:red", label=f"chosen: {name}", zorder=3)
        too_big = points["too_big"]
        if too_big:
            ax.scatter([p[1] for p in too_big], [p[2] for p in too_big], marker="x", color="grey",
                       label="does not fit (at its lower bound)")
        ax.axvline(points["hbm_gib"], color="black", linestyle="--", label="HBM per device")
        ax.set(title=plans[phase]["model"] + f": {phase}", xlabel="memory per device (GiB, GPU estimate)",
               ylabel="step (ms, serial)", xscale="log", yscale="log")
        ax.legend(fontsize=7)
    figure.tight_layout()
    return _save(figure, path)
