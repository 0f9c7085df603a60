"""The Prometheus series of /metrics, under vLLM's names and with its `model_name` label, so that a dashboard made
for vLLM reads a starscream server; each is updated once per engine step or once per request, never per token.

Per step (`observe_step`): requests running and waiting, KV-cache use as a fraction of its pages, preemptions,
prefix-cache queries and hits (in tokens), programs compiled (at start and while serving). Per request
(`observe_request`): TTFT from the request's arrival at the server, time per output token after the first, end-to-end
latency, time queued in the engine, prompt and generated tokens, and the request's end by finish reason.
"""
from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .protocol import StepOutputs

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)


@dataclass(frozen=True, kw_only=True)
class RequestTimes:
    """One finished request: seconds from arrival to its first and last token, seconds queued in the engine, its
    prompt and generated tokens and how it ended."""

    first_token_s: float | None
    last_token_s: float | None
    queued_s: float | None
    prompt_tokens: int
    generated_tokens: int
    finish_reason: str


class ServerMetrics:
    """The series (a registry of their own, so that several servers can share a process)."""

    def __init__(self, model_name: str, page_size: int):
        self.registry = registry = CollectorRegistry()
        self.page_size = page_size
        label = {"labelnames": ["model_name"], "registry": registry}

        def gauge(name, text):
            return Gauge(name, text, **label).labels(model_name)

        def counter(name, text):
            return Counter(name, text, **label).labels(model_name)

        def histogram(name, text):
            return Histogram(name, text, buckets=LATENCY_BUCKETS, **label).labels(model_name)

        self.running = gauge("vllm:num_requests_running", "requests being prefilled or decoded")
        self.waiting = gauge("vllm:num_requests_waiting", "requests queued for admission")
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc", "fraction of KV-cache pages held (1 = full)")
        self.preemptions = counter("vllm:num_preemptions", "sequences preempted (pages freed, recomputed later)")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "prompt tokens found in the prefix cache")
        self.prompt_tokens = counter("vllm:prompt_tokens", "prompt tokens of finished requests")
        self.generation_tokens = counter("vllm:generation_tokens", "tokens generated")
        self.ttft = histogram("vllm:time_to_first_token_seconds", "arrival at the server to the first token")
        self.tpot = histogram("vllm:time_per_output_token_seconds", "mean seconds per token after the first")
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "arrival at the server to the last token")
        self.queue = histogram("vllm:request_queue_time_seconds", "seconds waiting in the engine before a step")
        self._success = Counter("vllm:request_success", "requests ended, by finish reason",
                                labelnames=["model_name", "finished_reason"], registry=registry)
        self._model_name = model_name
        programs = Gauge("starscream:programs_compiled", "programs compiled: at start (warm-up), and while serving "
                         "(nonzero means a request waited for a compile)", labelnames=["model_name", "when"],
                         registry=registry)
        self.programs_at_start = programs.labels(model_name, "start")
        self.programs_serving = programs.labels(model_name, "serving")
        self._last = None

    def observe_step(self, step: StepOutputs) -> None:
        stats = step.stats
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.kv_cache_usage.set(stats.pages_used / max(stats.pages_total, 1))
        self.programs_at_start.set(stats.programs - stats.programs_after_start)
        self.programs_serving.set(stats.programs_after_start)
        last = self._last
        if last is not None:
            self.preemptions.inc(max(stats.preemptions - last.preemptions, 0))
            self.prefix_queries.inc(max(stats.prefix_queried_pages - last.prefix_queried_pages, 0) * self.page_size)
            self.prefix_hits.inc(max(stats.prefix_hit_pages - last.prefix_hit_pages, 0) * self.page_size)
        self._last = stats

    def observe_request(self, times: RequestTimes) -> None:
        self.prompt_tokens.inc(times.prompt_tokens)
        self.generation_tokens.inc(times.generated_tokens)
        self._success.labels(self._model_name, times.finish_reason).inc()
        if times.first_token_s is not None:
            self.ttft.observe(times.first_token_s)
            self.e2e.observe(times.last_token_s)
            if times.generated_tokens > 1:
                self.tpot.observe((times.last_token_s - times.first_token_s) / (times.generated_tokens - 1))
        if times.queued_s is not None:
            self.queue.observe(times.queued_s)
