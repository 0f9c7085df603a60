"""The planner's price of a serving workload: requests/s and output tokens/s at a TPOT target.

A workload is `prompt` tokens in and `output` tokens out per request, served by continuous batching with a time
per output token (TPOT) of at most `tpot_ms`. For each decode batch B (powers of two up to the largest asked for):
  decode   `plan_phase` of the paged decode step as the server runs it (`inspect --phase serve`: B sequences, one
           token each, against a paged cache of prompt + output positions, so the estimate is the slowest step a
           request sees and its memory the pools at their fullest): the fastest mesh and layout that fits and
           places the page pools as the prefill layout does (the engine serves no other pair), and its step time
           d(B) by the cost model;
  prefill  the prefill step of the prompt under the prefill layout on that same mesh (the engine runs both phases
           on one mesh), compiled at the fewest sequences that place and divided by them: p seconds per request.
In steady state B requests finish every `output` steps and B new prompts are prefilled in the same time (chunked
prefill shares the steps), so a step takes d(B) + B * p / output: that is the TPOT. Output tokens/s are B / TPOT,
requests/s B / (output * TPOT). The choice is the batch of most output tokens/s among those meeting the target
(the smaller on a tie); a target below every batch's TPOT is refused naming the fastest TPOT possible.
"""
from __future__ import annotations

import dataclasses
import math

from ..errors import StarscreamError
from ..hardware.mesh import build_topology_mesh
from ..serving.steps import cache_shards, check_same_cache_placement
from ..sharding.layouts import get_layout
from .compile import Settings
from .layout_report import ResultCache, inspect_layouts
from .plan import plan_phase


@dataclasses.dataclass(frozen=True)
class ServeWorkload:
    """Per request: `prompt` tokens in, `output` tokens out; `tpot_ms` the most milliseconds per output token."""

    prompt: int
    output: int
    tpot_ms: float

    def __post_init__(self):
        if self.prompt < 1 or self.output < 1 or not self.tpot_ms > 0:
            raise StarscreamError(f"serving workload of {self.prompt} prompt and {self.output} output tokens at a "
                                  f"TPOT of {self.tpot_ms} ms: give at least 1 token each and a TPOT above 0 ms")

    @property
    def context(self) -> int:
        """Positions a request reaches: its prompt and its output."""
        return self.prompt + self.output


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServePoint:
    """One decode batch priced: the fastest decode candidate that fits (`plan.Candidate.name`, its layout and data
    x gpu mesh), its step `decode_s`, the prefill seconds per request `prefill_s` (under `prefill_layout`), the
    TPOT they give and the throughput at that TPOT. `reason` says why a batch has no price (nothing places or
    fits; then the figures are None)."""

    batch: int
    candidate: str | None
    layout: str | None
    data: int
    gpu: int
    decode_s: float | None
    prefill_s: float | None
    tpot_s: float | None
    output_tokens_per_s: float | None
    requests_per_s: float | None
    reason: str = ""

    @property
    def priced(self) -> bool:
        return self.candidate is not None


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServePlan:
    """The workload, the model, every batch priced (rising), the chosen one and why it was chosen."""

    workload: ServeWorkload
    model: str
    prefill_layout: str
    points: tuple[ServePoint, ...]
    chosen: ServePoint


def serve_batches(largest: int) -> tuple[int, ...]:
    """The decode batches priced: powers of two up to `largest` (and `largest` itself)."""
    if largest < 1:
        raise StarscreamError(f"--batch {largest}: give the largest decode batch to price, at least 1")
    return tuple(sorted({2 ** power for power in range(int(math.log2(largest)) + 1)} | {largest}))


def price_serving(decode: Settings, prefill: Settings, topology, workload: ServeWorkload,
                  batches: tuple[int, ...], cache: ResultCache | None = None) -> tuple[ServePoint, ...]:
    """Every batch of `batches` priced (see the module docstring). `decode` is the paged decode settings
    (`make_settings(..., "serve", ...)`: its layouts are the candidates), `prefill` the prefill settings with the one
    prefill layout (batch and sequence are set here: the workload's context and prompt)."""
    prefill_by_data: dict[int, float] = {}
    points = []
    for batch in batches:
        chosen, reason = fastest_decode(dataclasses.replace(decode, batch=batch, seq=workload.context), topology,
                                        prefill.layouts[0], cache)
        if chosen is None:
            points.append(_unpriced(batch, reason))
            continue
        data = chosen["mesh"]["data"]
        if data not in prefill_by_data:
            prefill_by_data[data] = prefill_seconds(prefill, topology, data, workload.prompt, cache)
        points.append(_priced(batch, chosen, prefill_by_data[data], workload))
    return tuple(points)


def fastest_decode(decode: Settings, topology, prefill_layout: str, cache) -> tuple[dict | None, str]:
    """(the plan entry of the fastest decode candidate whose layout places the page pools as `prefill_layout` does,
    which the engine requires, or None; why none when None). Each layout is planned on its own, so pruning by a
    faster layout that cannot serve beside the prefill layout never hides one that can."""
    best, reasons = None, []
    for layout in decode.layouts:
        plan = plan_phase(dataclasses.replace(decode, layouts=(layout,)), topology, cache=cache)
        entry = next((entry for entry in plan["candidates"] if entry["status"] == "chosen"), None)
        if entry is None:
            reasons += sorted({entry["reason"] for entry in plan["candidates"]})
            continue
        mesh = build_topology_mesh(topology, data=entry["mesh"]["data"], simulate=True)[1]
        try:
            check_same_cache_placement({"prefill": get_layout(prefill_layout), "decode": get_layout(layout)}, mesh,
                                       decode.config, cache_shards(layout, mesh))
        except StarscreamError as err:
            reasons.append(str(err))
            continue
        if best is None or entry["estimate"]["serial_s"] < best["estimate"]["serial_s"]:
            best = entry
    return best, (reasons[0] if reasons else "no candidate layout")


def prefill_seconds(prefill: Settings, topology, data: int, prompt: int, cache: ResultCache | None) -> float:
    """Seconds of prefill per request: the prefill step of `prompt` tokens under the prefill layout on the data x
    gpu mesh of `data`, at the fewest sequences (a power of two) that it places, divided by them."""
    mesh = build_topology_mesh(topology, data=data, simulate=True)[1]
    layout = prefill.layouts[0]
    refused: dict[str, str] = {}
    batch = 1
    while batch <= mesh.devices.size:
        settings = dataclasses.replace(prefill, batch=batch, seq=prompt, cache_length=None)
        results = inspect_layouts(settings, topology, mesh, refused, cache, reference=False)
        if layout in results:
            return results[layout].estimate.serial_s / batch
        batch *= 2
    raise StarscreamError(f"prefill layout {layout} cannot place a prompt of {prompt} tokens on mesh data {data}: "
                          f"{refused.get(layout, 'no batch places')}; choose another --prefill-layout")


def _priced(batch: int, entry: dict, prefill_s: float, workload: ServeWorkload) -> ServePoint:
    decode_s = entry["estimate"]["serial_s"]
    tpot_s = decode_s + batch * prefill_s / workload.output
    return ServePoint(batch=batch, candidate=entry["name"], layout=entry["layout"], data=entry["mesh"]["data"],
                      gpu=entry["mesh"]["gpu"], decode_s=decode_s, prefill_s=prefill_s, tpot_s=tpot_s,
                      output_tokens_per_s=batch / tpot_s, requests_per_s=batch / (workload.output * tpot_s))


def _unpriced(batch: int, reason: str) -> ServePoint:
    return ServePoint(batch=batch, candidate=None, layout=None, data=0, gpu=0, decode_s=None, prefill_s=None,
                      tpot_s=None, output_tokens_per_s=None, requests_per_s=None, reason=reason)


def choose_serving(points: tuple[ServePoint, ...], workload: ServeWorkload, model: str,
                   prefill_layout: str) -> ServePlan:
    """The plan choosing, among the priced batches whose TPOT meets the target, the one of most output tokens/s
    (the smaller batch on a tie). StarscreamError when no batch is priced or none meets the target."""
    priced = [point for point in points if point.priced]
    if not priced:
        reason = points[0].reason if points else "no batch was priced"
        raise StarscreamError(f"no decode batch of {model} places and fits for a context of {workload.context} "
                              f"positions: {reason}")
    target = workload.tpot_ms / 1e3
    meeting = [point for point in priced if point.tpot_s <= target]
    if not meeting:
        fastest = min(priced, key=lambda point: point.tpot_s)
        raise StarscreamError(f"TPOT target {workload.tpot_ms:g} ms is below the fastest the cost model gives, "
                              f"{fastest.tpot_s * 1e3:.3g} ms (batch {fastest.batch}, {fastest.candidate}); raise "
                              f"--tpot-ms to at least {math.ceil(fastest.tpot_s * 1e4) / 10:g}")
    chosen = max(meeting, key=lambda point: (point.output_tokens_per_s, -point.batch))
    return ServePlan(workload=workload, model=model, prefill_layout=prefill_layout, points=tuple(points), chosen=chosen)
