"""An engine without a model, for measuring the server itself: `starscream serve --fake-engine STEP_MS`.

It keeps the `Engine`'s interface as the engine loop uses it (submit, cancel, step, busy, stats, info) and its
checks on requests, and gives every running request one token per step, a step every `step_s` seconds: what a
real engine gives at that step time, with no device work. The tokens are the request's prompt ids in turn, so the
text they decode to is real text of the tokenizer's. Whatever the server then does per token and per step is the
front end's own cost (`scripts/bench_serve.py --fake-engine`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..errors import StarscreamError
from .protocol import EngineInfo, EngineStats
from .scheduler import SamplingParams, TokenEvent, check_fits


@dataclass(kw_only=True)
class _Request:
    prompt: list[int]
    params: SamplingParams
    arrival: float
    generated: int = 0
    scheduled_at: float | None = None
    tokens: list[int] = field(default_factory=list)


class FakeEngine:
    """Emits tokens at a set step time (see the module docstring); at most `max_num_seqs` requests run, the rest
    wait in arrival order."""

    def __init__(self, vocab_size: int, context: int, max_num_seqs: int, step_s: float):
        self.vocab_size, self.context, self.max_num_seqs, self.step_s = vocab_size, context, max_num_seqs, step_s
        self._requests: dict[str, _Request] = {}
        self._next_step = time.perf_counter()
        self._generated = 0

    def submit(self, request_id: str, prompt: list[int], params: SamplingParams = SamplingParams()) -> None:
        if request_id in self._requests:
            raise StarscreamError(f"request id {request_id!r} is already running; give each request its own id")
        if any(not 0 <= token < self.vocab_size for token in prompt):
            raise StarscreamError(f"a prompt token id is outside the vocabulary of {self.vocab_size}")
        check_fits(len(prompt), params.max_tokens, self.context)
        self._requests[request_id] = _Request(prompt=list(prompt), params=params, arrival=time.monotonic())

    def cancel(self, request_id: str) -> bool:
        return self._requests.pop(request_id, None) is not None

    def refused(self) -> list[tuple[str, str]]:
        return []  # (it refuses at submit only)

    def running_ids(self) -> list[str]:
        return list(self._requests)

    @property
    def busy(self) -> bool:
        return bool(self._requests)

    def step(self) -> list:
        """Sleeps until the next step is due, then one token for each of the first `max_num_seqs` requests."""
        delay = self._next_step - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        self._next_step = max(self._next_step, time.perf_counter() - self.step_s) + self.step_s
        now, events = time.monotonic(), []
        for request_id, request in list(self._requests.items())[:self.max_num_seqs]:
            queued = None
            if request.scheduled_at is None:
                request.scheduled_at = now
                queued = now - request.arrival
            token = request.prompt[request.generated % len(request.prompt)]
            request.generated += 1
            self._generated += 1
            if token in request.params.stop_tokens:
                reason = "stop"
            elif request.generated >= request.params.max_tokens:
                reason = "length"
            else:
                reason = None
            if reason is not None:
                del self._requests[request_id]
            events.append(TokenEvent(request_id=request_id, token=token, logprob=-1.0, finish_reason=reason,
                                     queued_s=queued))
        return events

    def stats(self) -> EngineStats:
        running = min(len(self._requests), self.max_num_seqs)
        return EngineStats(running=running, waiting=len(self._requests) - running, pages_used=0, pages_total=1,
                           prefix_queried_pages=0, prefix_hit_pages=0, preemptions=0, programs=0,
                           programs_after_start=0, generated_tokens=self._generated)

    def info(self) -> EngineInfo:
        return EngineInfo(context=self.context, vocab_size=self.vocab_size, max_num_seqs=self.max_num_seqs,
                          pages_total=0, page_size=16, programs=0)

    def keep_followers(self) -> None:
        """No other processes follow a fake engine."""

    def stop_followers(self) -> None:
        """No other processes follow a fake engine."""
