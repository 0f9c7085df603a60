"""The OpenAI-compatible HTTP server over an `EngineThread` (FastAPI on uvicorn).

Routes: POST /v1/completions and /v1/chat/completions (the tokenizer's chat template), both streaming by
server-sent events with `"stream": true`; GET /v1/models, /health and /metrics (Prometheus text). Bad requests get
OpenAI's error object ({"error": {"message", "type", "param", "code"}}) with a 4xx status: 400 for malformed JSON,
bad parameter values and prompts beyond the context, 404 for an unknown model, 429 when `max_pending` requests are
already in flight, 503 while shutting down. A client that disconnects has its request cancelled (its pages freed).
On SIGTERM uvicorn stops accepting connections and lets open ones finish; the engine then drains and stops.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from ..errors import StarscreamError
from .engine import EngineThread, TokenEvent
from .scheduler import SamplingParams, check_fits

HTTP_BAD_REQUEST, HTTP_NOT_FOUND, HTTP_TOO_MANY, HTTP_UNAVAILABLE = 400, 404, 429, 503
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


class _Sampling(BaseModel):
    """The sampling fields both routes share (OpenAI's names; top_k as vLLM adds it)."""

    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = Field(default=None, ge=0, lt=2 ** 31)
    stop: str | list[str] | None = None
    stream: bool = False
    n: int = Field(default=1, ge=1, le=1)
    ignore_eos: bool = False


class CompletionRequest(_Sampling):
    prompt: str | list[int]
    logprobs: int | None = Field(default=None, ge=0, le=1)


class ChatMessage(BaseModel):
    role: str
    content: str


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False


@dataclass
class ServerMetrics:
    """The Prometheus series /metrics serves (a registry of its own, so that several servers can share a process)."""

    registry: CollectorRegistry
    running: Gauge
    waiting: Gauge
    pages_used: Gauge
    pages_total: Gauge
    tokens_per_second: Gauge
    prompt_tokens: Counter
    generated_tokens: Counter
    prefix_hit_pages: Gauge
    requests: Counter
    ttft: Histogram
    tpot: Histogram

    @classmethod
    def create(cls) -> ServerMetrics:
        registry = CollectorRegistry()
        gauge = lambda name, text: Gauge(f"starscream_{name}", text, registry=registry)  # noqa: E731
        return cls(registry, gauge("requests_running", "requests being prefilled or decoded"),
                   gauge("requests_waiting", "requests queued for admission"),
                   gauge("kv_pages_used", "KV-cache pages held by a sequence"),
                   gauge("kv_pages_total", "KV-cache pages that sequences can hold"),
                   gauge("generation_tokens_per_second", "tokens generated per second over the last 10 s"),
                   Counter("starscream_prompt_tokens", "prompt tokens received", registry=registry),
                   Counter("starscream_generation_tokens", "tokens generated", registry=registry),
                   gauge("prefix_cache_hit_pages", "full prompt pages found in the prefix cache"),
                   Counter("starscream_requests", "requests ended", ["finish_reason"], registry=registry),
                   Histogram("starscream_time_to_first_token_seconds", "TTFT", buckets=LATENCY_BUCKETS,
                             registry=registry),
                   Histogram("starscream_time_per_output_token_seconds", "TPOT: mean time per token after the first",
                             buckets=LATENCY_BUCKETS, registry=registry))


class ApiError(Exception):
    """A request refused with an HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


@dataclass
class _Text:
    """The text of a stream so far, with what was already sent: held back while it may end in a partial
    character or the start of a stop string, cut where a stop string begins."""

    detokenize: object
    stop: tuple[str, ...]
    sent: int = 0
    stopped: bool = False

    def advance(self, tokens: list[int], final: bool) -> str:
        text = self.detokenize(tokens)
        cut = min((text.find(stop) for stop in self.stop if stop in text), default=-1)
        if cut >= 0:
            text, final, self.stopped = text[:cut], True, True
        hold = 0 if final else max([len(stop) - 1 for stop in self.stop] + [int(text.endswith("\ufffd"))])
        end = max(self.sent, len(text) - hold)
        delta, self.sent = text[self.sent:end], end
        return delta


class Server:
    """The routes over one engine thread (see the module docstring)."""

    def __init__(self, engine: EngineThread, tokenizer, model_name: str, max_pending: int = 256):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.max_pending = max_pending
        self.pending = 0
        self.metrics = ServerMetrics.create()
        self.context = engine.engine.context
        self._ids = itertools.count()
        self._recent: list[tuple[float, int]] = []
        self.shutting_down = False

    def app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(_):
            yield
            self.shutting_down = True
            await asyncio.to_thread(self.engine.stop, True)

        app = FastAPI(title="starscream", lifespan=lifespan)
        app.add_exception_handler(ApiError, lambda _, err: err.response())
        app.add_exception_handler(RequestValidationError, lambda _, err: _validation_error(err).response())
        app.post("/v1/completions")(self.completions)
        app.post("/v1/chat/completions")(self.chat)
        app.get("/v1/models")(self.models)
        app.get("/health")(self.health)
        app.get("/metrics")(self.prometheus)
        return app

    async def models(self):
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "starscream"}]}

    async def health(self):
        if self.engine.error is not None or self.shutting_down:
            reason = "shutting down" if self.engine.error is None else f"the engine stopped: {self.engine.error}"
            raise ApiError(HTTP_UNAVAILABLE, reason, "server_error")
        return {"status": "ok"}

    async def prometheus(self):
        stats = self.engine.stats
        if stats is not None:
            m = self.metrics
            m.running.set(stats.running)
            m.waiting.set(stats.waiting)
            m.pages_used.set(stats.pages_used)
            m.pages_total.set(stats.pages_total)
            m.prefix_hit_pages.set(stats.prefix_hit_pages)
        self.metrics.tokens_per_second.set(self._tokens_per_second())
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def completions(self, body: CompletionRequest, request: Request):
        prompt = body.prompt if isinstance(body.prompt, list) else self.tokenizer.encode(body.prompt).tolist()
        return await self._serve(body, prompt, request, chat=False, logprobs=body.logprobs is not None)

    async def chat(self, body: ChatRequest, request: Request):
        messages = [message.model_dump() for message in body.messages]
        try:
            text = self.tokenizer.render_chat(messages, add_generation_prompt=True)
        except StarscreamError as err:
            raise ApiError(HTTP_BAD_REQUEST, str(err), param="messages") from None
        prompt = self.tokenizer.encode(text, special_tokens=False).tolist()
        return await self._serve(body, prompt, request, chat=True, logprobs=body.logprobs)

    async def _serve(self, body: _Sampling, prompt: list[int], request: Request, chat: bool, logprobs: bool):
        params = self._params(body, prompt, logprobs)
        if self.shutting_down:
            raise ApiError(HTTP_UNAVAILABLE, "the server is shutting down; send the request to another one",
                           "server_error")
        if self.pending >= self.max_pending:
            raise ApiError(HTTP_TOO_MANY, f"{self.pending} requests are in flight, the most this server queues; "
                                          "retry later", "rate_limit_error")
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{next(self._ids)}"
        events = self._events(request_id, prompt, params)
        first = await _first(events)  # a refusal surfaces here, before any response is sent
        self.metrics.prompt_tokens.inc(len(prompt))
        stream = _Stream(self, request_id, body.model, chat, len(prompt), params, first, events, time.monotonic())
        if body.stream:
            return StreamingResponse(stream.sse(), media_type="text/event-stream")
        return await stream.whole(request)

    def _params(self, body: _Sampling, prompt: list[int], logprobs: bool) -> SamplingParams:
        if body.model != self.model_name:
            raise ApiError(HTTP_NOT_FOUND, f"the model {body.model!r} does not exist; this server serves "
                                           f"{self.model_name!r}", param="model", code="model_not_found")
        max_tokens = body.max_completion_tokens or body.max_tokens or max(1, min(16, self.context - len(prompt)))
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        eos = getattr(self.tokenizer, "eos_id", None)
        try:
            check_fits(len(prompt), max_tokens, self.context)
            if any(not 0 <= token < self.engine.engine.model_config.vocab_size for token in prompt):
                raise StarscreamError("the prompt holds token ids outside the model's vocabulary")
            return SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                                  top_k=body.top_k, seed=body.seed, stop=tuple(s for s in stop if s),
                                  stop_tokens=() if eos is None or body.ignore_eos else (eos,), logprobs=logprobs)
        except StarscreamError as err:
            raise ApiError(HTTP_BAD_REQUEST, str(err)) from None

    async def _events(self, request_id: str, prompt: list[int], params: SamplingParams):
        """The request's TokenEvents as they come; the request is cancelled if the consumer stops early."""
        loop, inbox = asyncio.get_running_loop(), asyncio.Queue()
        self.pending += 1
        self.engine.submit(request_id, prompt, params, lambda event: loop.call_soon_threadsafe(inbox.put_nowait, event))
        finished = False
        try:
            while not finished:
                event = await inbox.get()
                if isinstance(event, BaseException):
                    finished = True
                    status = HTTP_BAD_REQUEST if isinstance(event, StarscreamError) else HTTP_UNAVAILABLE
                    raise ApiError(status, str(event), "invalid_request_error" if status < 500 else "server_error")
                finished = event.finish_reason is not None
                yield event
        finally:
            self.pending -= 1
            if not finished:
                self.engine.cancel(request_id)

    def _count(self, tokens: int) -> None:
        now = time.monotonic()
        self._recent = [(at, count) for at, count in self._recent if at > now - 10.0] + [(now, tokens)]
        self.metrics.generated_tokens.inc(tokens)

    def _tokens_per_second(self) -> float:
        now = time.monotonic()
        return sum(count for at, count in self._recent if at > now - 10.0) / 10.0


async def _first(events):
    """The first event of a request (a refusal raises its ApiError here)."""
    return await events.__anext__()


class _Stream:
    """One request's response: every event turned into OpenAI's JSON, whole or as server-sent events."""

    def __init__(self, server: Server, request_id: str, model: str, chat: bool, prompt_tokens: int,
                 params: SamplingParams, first: TokenEvent, events, started: float):
        self.server, self.request_id, self.model, self.chat = server, request_id, model, chat
        self.prompt_tokens, self.params, self.first, self.events = prompt_tokens, params, first, events
        self.started, self.created = started, int(time.time())
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.text = _Text(server.tokenizer.decode, params.stop)
        self.finish_reason: str | None = None
        self.first_at: float | None = None

    async def _all(self):
        yield self.first
        async for event in self.events:
            yield event

    async def _deltas(self):
        """(text delta, token ids and log-probabilities of this delta) as tokens arrive; the last has the finish
        reason set on self."""
        async for event in self._all():
            if self.first_at is None:
                self.first_at = time.monotonic()
                self.server.metrics.ttft.observe(self.first_at - self.started)
            self.server._count(1)
            final = event.finish_reason is not None
            counted = event.token not in self.params.stop_tokens
            if counted:
                self.tokens.append(event.token)
                self.logprobs.append(event.logprob)
            delta = self.text.advance(self.tokens, final)
            if final or self.text.stopped:
                self.finish_reason = "stop" if self.text.stopped else event.finish_reason
                self._finished()
                yield delta, event
                if not final:
                    await self.events.aclose()
                return
            yield delta, event

    def _finished(self) -> None:
        metrics = self.server.metrics
        metrics.requests.labels(self.finish_reason).inc()
        if len(self.tokens) > 1 and self.first_at is not None:
            metrics.tpot.observe((time.monotonic() - self.first_at) / (len(self.tokens) - 1))

    async def whole(self, request: Request) -> dict:
        text = []
        async for delta, _ in self._deltas():
            text.append(delta)
            if await request.is_disconnected():
                await self.events.aclose()
                raise ApiError(HTTP_BAD_REQUEST, "the client disconnected")
        return self._body("".join(text))

    async def sse(self):
        try:
            if self.chat:
                yield _sse(self._chunk({"role": "assistant", "content": ""}, None))
            async for delta, event in self._deltas():
                logprobs = self._logprobs([event.token], [event.logprob]) if self.params.logprobs else None
                yield _sse(self._chunk(delta, self.finish_reason, logprobs))
            yield "data: [DONE]\n\n"
        finally:
            await self.events.aclose()

    def _usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": len(self.tokens),
                "total_tokens": self.prompt_tokens + len(self.tokens)}

    def _logprobs(self, tokens: list[int], values: list[float]) -> dict:
        decode = self.server.tokenizer.decode
        if self.chat:
            return {"content": [{"token": decode([t]), "logprob": v, "bytes": None, "top_logprobs": []}
                                for t, v in zip(tokens, values)]}
        return {"tokens": [decode([t]) for t in tokens], "token_logprobs": values, "top_logprobs": None,
                "text_offset": None}

    def _body(self, text: str) -> dict:
        logprobs = self._logprobs(self.tokens, self.logprobs) if self.params.logprobs else None
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                      "finish_reason": self.finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": self.finish_reason}
        return {"id": self.request_id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice], "usage": self._usage()}

    def _chunk(self, delta, finish_reason, logprobs=None) -> dict:
        if self.chat:
            content = delta if isinstance(delta, dict) else {"content": delta}
            choice = {"index": 0, "delta": content, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        chunk = {"id": self.request_id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                 "created": self.created, "model": self.model, "choices": [choice]}
        if finish_reason is not None:
            chunk["usage"] = self._usage()
        return chunk


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _validation_error(err: RequestValidationError) -> ApiError:
    """FastAPI's validation error (malformed JSON, a missing or bad field) as OpenAI's 400."""
    first = err.errors()[0]
    if first.get("type") == "json_invalid":
        return ApiError(HTTP_BAD_REQUEST, "the request body is not valid JSON; send a JSON object")
    where = ".".join(str(part) for part in first.get("loc", ())[1:]) or "body"
    return ApiError(HTTP_BAD_REQUEST, f"{where}: {first.get('msg', 'invalid value')}", param=where)
