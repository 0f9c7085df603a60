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
    names = _thread_names(events)
    devices = _devices(names)
    kernels = []
    for event in events:
        if event.get("ph") != "X" or event["pid"] not in devices:
            continue
        if not names.get((event["pid"], event.get("tid")), "").startswith("Stream"):
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
    return _host_events(_trace_events(latest_trace(directory)), top)


def _host_events(events: list[dict], top: int) -> list[HostEvent]:
    devices = _devices(_thread_names(events))
    by_thread: dict[tuple, list[dict]] = defaultdict(list)
    for event in events:
        if event.get("ph") == "X" and event["pid"] not in devices:
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


@dataclasses.dataclass(frozen=True)
class IdleCause:
    """What one host thread was doing while the device sat idle: the innermost of its events open then, and the idle
    seconds it covered (summed over the trace's gaps between device kernels)."""
    thread: str
    name: str
    seconds: float


def idle_causes(directory: str | Path, min_gap_s: float = 50e-6, top: int = 20) -> list[IdleCause]:
    """The `top` (host thread, innermost event) pairs of the newest trace under `directory` by the device-idle time
    they cover: every gap of at least `min_gap_s` between the device's kernels (all devices' streams merged, within
    the span from the first kernel to the last), attributed on each host thread to the innermost event open during
    it ("(no event)" where none was). Read beside `host_events`: a launch that waits, or Python work between a
    step's tokens and the next launch, shows up here as what held the device idle."""
    return _idle_causes(_trace_events(latest_trace(directory)), min_gap_s, top)


def _idle_causes(events: list[dict], min_gap_s: float, top: int) -> list[IdleCause]:
    names = _thread_names(events)
    devices = _devices(names)
    busy, by_thread = [], defaultdict(list)
    for event in events:
        if event.get("ph") != "X":
            continue
        span = (float(event["ts"]), float(event["ts"]) + float(event.get("dur", 0.0)))
        if event["pid"] in devices:
            if names.get((event["pid"], event.get("tid")), "").startswith("Stream"):
                busy.append(span)
        else:
            by_thread[(event["pid"], event.get("tid"))].append((*span, event["name"][:160]))
    gaps = [gap for gap in _gaps(busy) if gap[1] - gap[0] >= min_gap_s * 1e6]
    covered: dict[tuple[str, str], float] = defaultdict(float)
    for key, thread_events in by_thread.items():
        label = names.get(key, f"{key[0]}/{key[1]}")
        for start, end, name in _overlaps(gaps, _innermost(thread_events)):
            covered[(label, name)] += end - start
    ranked = sorted(covered.items(), key=lambda item: -item[1])[:top]
    return [IdleCause(thread, name, microseconds * 1e-6) for (thread, name), microseconds in ranked]


def _trace_events(path: Path) -> list[dict]:
    """The events of a perfetto_trace.json.gz (a trace of a whole serving run holds millions: read it once)."""
    with gzip.open(path, "rt") as handle:
        trace = json.load(handle)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def _thread_names(events) -> dict[tuple, str]:
    """{(pid, None): process name, (pid, tid): thread name} from a trace's metadata events."""
    names = {}
    for event in events:
        if event.get("ph") == "M" and event.get("name") == "process_name":
            names[(event["pid"], None)] = event["args"]["name"]
        if event.get("ph") == "M" and event.get("name") == "thread_name":
            names[(event["pid"], event.get("tid"))] = event["args"]["name"]
    return names


def _devices(names: dict[tuple, str]) -> set:
    """The pids of the device processes ("/device:GPU:0", ...) among `_thread_names`."""
    return {pid for (pid, tid), name in names.items() if tid is None and name.startswith("/device:")}


def _gaps(busy: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The holes between the union of the `busy` spans (start, end), within their overall span."""
    gaps, reached = [], None
    for start, end in sorted(busy):
        if reached is not None and start > reached:
            gaps.append((reached, start))
        reached = end if reached is None else max(reached, end)
    return gaps


def _innermost(thread_events: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """One thread's (start, end, name) events, nested, cut into disjoint spans each named by the innermost event open
    in it, "(no event)" between them."""
    spans, stack, at = [], [], float("-inf")  # stack: (end, name) of the open events

    def advance(to: float) -> None:
        nonlocal at
        while at < to:
            while stack and stack[-1][0] <= at:
                stack.pop()
            until = min(to, stack[-1][0]) if stack else to
            spans.append((at, until, stack[-1][1] if stack else "(no event)"))
            at = until

    for start, end, name in sorted(thread_events, key=lambda e: (e[0], -e[1])):
        advance(start)
        stack.append((end, name))
    advance(max((end for _, end, _ in thread_events), default=at))
    return [span for span in spans if span[1] > span[0] and span[0] > float("-inf")]


def _overlaps(gaps, spans):
    """The pieces (start, end, name) of the named `spans` that fall inside the `gaps`, both sorted and disjoint."""
    pieces, index = [], 0
    for gap_start, gap_end in gaps:
        while index < len(spans) and spans[index][1] <= gap_start:
            index += 1
        probe = index
        while probe < len(spans) and spans[probe][0] < gap_end:
            start, end, name = spans[probe]
            pieces.append((max(start, gap_start), min(end, gap_end), name))
            probe += 1
    return pieces


def time_breakdown(directory: str | Path, steps: int, hlo_text: str = "") -> dict:
    """{"per_step_s": {category: seconds per step per device}, "devices", "steps", "kernels", "top_kernels",
    "top_host_events", "idle_causes"} from the newest trace under `directory`, which holds `steps` steps.
    `hlo_text`: the traced program's compiled text. `top_kernels` lists the 25 kernels that took longest in all
    (name, HLO instruction, category, seconds and launches per step: XLA runs one kernel for every fusion of the same
    computation, so a kernel launched once per layer shows it); `top_host_events` the 25 host event names of most own time
    over all the steps (`host_events`), `idle_causes` what the host threads were doing while the device sat idle
    (`idle_causes`), each as a dict."""
    path = latest_trace(directory)
    events = _trace_events(path)
    kernels = device_kernels(events)
    if not kernels:
        raise StarscreamError(f"{path} holds no device kernels (was the step run on a GPU while tracing?)")
    categories = hlo_categories(hlo_text)
    devices = len({kernel["device"] for kernel in kernels})
    totals: dict[str, float] = dict.fromkeys(CATEGORIES, 0.0)
    by_kernel: dict[tuple[str, str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    for kernel in kernels:
        category = _kernel_category(kernel["name"], kernel["hlo_op"], categories)
        totals[category] += kernel["seconds"]
        kept = by_kernel[(kernel["name"][:120], kernel["hlo_op"], category)]
        kept[0] += kernel["seconds"]
        kept[1] += 1
    scale = 1.0 / (steps * devices)
    top = sorted(by_kernel.items(), key=lambda item: -item[1][0])[:25]
    return {"per_step_s": {category: seconds * scale for category, seconds in totals.items()},
            "devices": devices, "steps": steps, "kernels": len(kernels), "trace": str(path),
            "top_kernels": [{"name": name, "hlo_op": op, "category": category, "per_step_s": seconds * scale,
                             "launches_per_step": launches * scale} for (name, op, category), (seconds, launches) in top],
            "top_host_events": [dataclasses.asdict(event) for event in _host_events(events, 25)],
            "idle_causes": [dataclasses.asdict(cause) for cause in _idle_causes(events, 50e-6, 25)]}


def breakdown_table(rows: dict[str, dict]) -> str:
    """A markdown table: one row per implementation, milliseconds per step (and share) of each category."""
    lines = ["| implementation | " + " | ".join(CATEGORIES) + " | sum |", "|---" * (len(CATEGORIES) + 2) + "|"]
    for name, breakdown in rows.items():
        per_step = breakdown["per_step_s"]
        total = sum(per_step.values())
        cells = [f"{1e3 * per_step[c]:.1f} ms ({100 * per_step[c] / total:.0f}%)" for c in CATEGORIES]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {1e3 * total:.1f} ms |")
    return "\n".join(lines)
