"""Where a step's time goes: a JAX profiler trace's device kernels summed by category, and its host events by name.

`jax.profiler.start_trace(directory, create_perfetto_trace=True)` writes `perfetto_trace.json.gz` (Chrome trace
format) under `directory/plugins/profile/<run>/`. Its device processes ("/device:GPU:0", ...) hold one thread per
stream, whose events are the kernels that ran, each with its duration and, in `args`, the HLO instruction that
launched it (`hlo_op`; a command buffer's name for kernels XLA runs as a CUDA graph, whose kernels are named after
their instruction instead). Each kernel falls in one category:

  matmuls      cuBLAS / cuBLASLt / Triton GEMMs (an HLO dot or a GEMM custom call or fusion)
  attention    cuDNN's fused attention (custom calls whose target names fmha / sdpa)
  collectives  NCCL kernels and HLO all-reduce / all-gather / reduce-scatter / all-to-all / collective-permute
  optimizer    the rest of what runs under the named scope "optimizer" (clipping and AdamW: `training.steps`)
  other        everything else (norms, rotary embedding, softmax of the loss, casts, copies)

Categories are read from the compiled program's text (the instruction's opcode, custom-call target and op_name
metadata) where it is given, and from the kernel's name otherwise. Times are summed over every device and divided by
the number of traced steps and devices: seconds per step per device. Kernels that overlap (collectives beside
compute on another stream) are each counted in full, so the categories can sum to more than the step's wall time.
"""
from __future__ import annotations

import dataclasses
import gzip
import json
import re
from collections import defaultdict
from pathlib import Path

from ..errors import StarscreamError

CATEGORIES = ("matmuls", "attention", "collectives", "optimizer", "other")
_COLLECTIVE = re.compile(r"all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute|nccl", re.I)
_ATTENTION = re.compile(r"fmha|sdpa|flash|fprop.*attn|dot_product_attention|dot_do_o|convert_dq", re.I)
"""Attention kernels by name: XLA's and cuDNN's fused kernels, and the helpers cuDNN's backward pass launches beside
its flash kernel (the dO . O row sums, dQ's cast to 16 bits)."""
_GEMM = re.compile(r"gemm|xmma|nvjet|cutlass|cublas|matmul|triton_gemm|__cublas", re.I)
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*\S.*?\s([\w\-]+)\(")


def latest_trace(directory: str | Path) -> Path:
    """The newest perfetto_trace.json.gz under `directory` (as jax.profiler writes it)."""
    found = sorted(Path(directory).glob("**/perfetto_trace.json.gz"), key=lambda path: path.stat().st_mtime)
    if not found:
        raise StarscreamError(f"no perfetto_trace.json.gz under {directory}; trace with "
                              f"jax.profiler.start_trace(directory, create_perfetto_trace=True)")
    return found[-1]


def hlo_categories(hlo_text: str) -> dict[str, str]:
    """Category of every instruction of a compiled program's text, by its name (see the module docstring), and by
    the name its kernel carries ("loop_add_fusion.2" runs as kernel "loop_add_fusion_2")."""
    categories = {}
    for line in hlo_text.splitlines():
        match = _INSTRUCTION.match(line)
        if match is None:
            continue
        name, opcode = match.groups()
        target = re.search(r'custom_call_target="([^"]+)"', line)
        op_name = re.search(r'op_name="([^"]+)"', line)
        category = _category(opcode, target.group(1) if target else "", line if "kind=kCustom" in line else "",
                             op_name.group(1) if op_name else "")
        categories[name] = categories[name.replace(".", "_")] = category
    return categories


def _category(opcode: str, target: str, custom_fusion: str, op_name: str) -> str:
    if _COLLECTIVE.search(opcode):
        return "collectives"
    if _ATTENTION.search(target):
        return "attention"
    if opcode in ("dot", "convolution") or _GEMM.search(target) or _GEMM.search(custom_fusion):
        return "matmuls"
    if "optimizer" in op_name.split("/"):
        return "optimizer"
    return "other"


def _kernel_category(name: str, hlo_op: str, categories: dict[str, str]) -> str:
    """By the launching instruction, or by the kernel's own name where kernels run inside a command buffer (a CUDA
    graph, whose events name the buffer as `hlo_op`)."""
    for key in (hlo_op, name):
        if categories.get(key, "other") != "other":
            return categories[key]
    if _COLLECTIVE.search(name) or _COLLECTIVE.search(hlo_op):
        return "collectives"
    if _ATTENTION.search(name):
        return "attention"
    if _GEMM.search(name):
        return "matmuls"
    return categories.get(hlo_op, "other")


def device_kernels(trace: dict) -> list[dict]:
    """The kernel events of the device streams: {"name", "hlo_op", "seconds", "device"} each."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    processes, threads = {}, {}
    for event in events:
        if event.get("ph") == "M" and event.get("name") == "process_name":
            processes[event["pid"]] = event["args"]["name"]
        if event.get("ph") == "M" and event.get("name") == "thread_name":
            threads[(event["pid"], event.get("tid"))] = event["args"]["name"]
    devices = {pid for pid, name in processes.items() if name.startswith("/device:")}
    kernels = []
    for event in events:
        if event.get("ph") != "X" or event["pid"] not in devices:
            continue
        if not threads.get((event["pid"], event.get("tid")), "").startswith("Stream"):
            continue
        args = event.get("args", {})
        kernels.append({"name": event["name"], "hlo_op": str(args.get("hlo_op", "")), "device": event["pid"],
                        "seconds": float(event.get("dur", 0.0)) * 1e-6})
    return kernels


@dataclasses.dataclass(frozen=True)
class HostEvent:
    """One name of the host threads' events summed over a trace: Python functions (the profiler's Python tracer
    names them `file:line function`) and the runtime's own spans (a program's launch, a transfer)."""
    name: str
    count: int
    seconds: float
    """Inclusive: the events' whole durations."""
    self_seconds: float
    """Exclusive: less the events nested inside them on the same thread (what the name itself spent)."""


def host_events(directory: str | Path, top: int = 25) -> list[HostEvent]:
    """The `top` host event names of the newest trace under `directory` by their exclusive time, summed over the
    host processes' threads: where the host's time went while the device ran (or waited for it)."""
    with gzip.open(latest_trace(directory), "rt") as handle:
        trace = json.load(handle)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    hosts = {event["pid"] for event in events if event.get("ph") == "M" and event.get("name") == "process_name"
             and not event["args"]["name"].startswith("/device:")}
    by_thread: dict[tuple, list[dict]] = defaultdict(list)
    for event in events:
        if event.get("ph") == "X" and event["pid"] in hosts:
            by_thread[(event["pid"], event.get("tid"))].append(event)
    count, total, own = defaultdict(int), defaultdict(float), defaultdict(float)
    for thread in by_thread.values():
        stack: list[tuple[float, str]] = []  # (end, name) of the enclosing events
        for event in sorted(thread, key=lambda e: (float(e["ts"]), -float(e.get("dur", 0.0)))):
            start, seconds = float(event["ts"]), float(event.get("dur", 0.0))
            while stack and stack[-1][0] <= start:
                stack.pop()
            if stack:
                own[stack[-1][1]] -= seconds
            name = event["name"][:160]
            count[name] += 1
            total[name] += seconds
            own[name] += seconds
            stack.append((start + seconds, name))
    ranked = sorted(count, key=lambda name: -own[name])[:top]
    return [HostEvent(name, count[name], total[name] * 1e-6, own[name] * 1e-6) for name in ranked]


def time_breakdown(directory: str | Path, steps: int, hlo_text: str = "") -> dict:
    """{"per_step_s": {category: seconds per step per device}, "devices", "steps", "kernels", "top_kernels"} from
    the newest trace under `directory`, which holds `steps` steps. `hlo_text`: the traced program's compiled text.
    `top_kernels` lists the 25 kernels that took longest in all (name, HLO instruction, category, seconds per step)."""
    path = latest_trace(directory)
    with gzip.open(path, "rt") as handle:
        kernels = device_kernels(json.load(handle))
    if not kernels:
        raise StarscreamError(f"{path} holds no device kernels (was the step run on a GPU while tracing?)")
    categories = hlo_categories(hlo_text)
    devices = len({kernel["device"] for kernel in kernels})
    totals: dict[str, float] = dict.fromkeys(CATEGORIES, 0.0)
    by_kernel: dict[tuple[str, str, str], float] = defaultdict(float)
    for kernel in kernels:
        category = _kernel_category(kernel["name"], kernel["hlo_op"], categories)
        totals[category] += kernel["seconds"]
        by_kernel[(kernel["name"][:120], kernel["hlo_op"], category)] += kernel["seconds"]
    scale = 1.0 / (steps * devices)
    top = sorted(by_kernel.items(), key=lambda item: -item[1])[:25]
    return {"per_step_s": {category: seconds * scale for category, seconds in totals.items()},
            "devices": devices, "steps": steps, "kernels": len(kernels), "trace": str(path),
            "top_kernels": [{"name": name, "hlo_op": op, "category": category, "per_step_s": seconds * scale}
                            for (name, op, category), seconds in top]}


def breakdown_table(rows: dict[str, dict]) -> str:
    """A markdown table: one row per implementation, milliseconds per step (and share) of each category."""
    lines = ["| implementation | " + " | ".join(CATEGORIES) + " | sum |", "|---" * (len(CATEGORIES) + 2) + "|"]
    for name, breakdown in rows.items():
        per_step = breakdown["per_step_s"]
        total = sum(per_step.values())
        cells = [f"{1e3 * per_step[c]:.1f} ms ({100 * per_step[c] / total:.0f}%)" for c in CATEGORIES]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {1e3 * total:.1f} ms |")
    return "\n".join(lines)
