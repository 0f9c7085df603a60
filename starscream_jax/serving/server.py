"""The OpenAI-compatible HTTP server (FastAPI on uvicorn), the API process' half of a server; the engine runs apart
(`serving.core`) and is reached through an `EngineClient`.

Routes: POST /v1/completions and /v1/chat/completions (the tokenizer's chat template), both streaming by
server-sent events with `"stream": true`; GET /v1/models, /health and /metrics (Prometheus text, `serving.metrics`).
Per request the API process tokenizes (on a worker thread, after a length check, so a huge prompt stalls no other
stream), hands the token ids to the engine, and turns each batch of new tokens into text incrementally
(`detokenize.IncrementalText`, which also ends the text at a stop string and then cancels the request in the
engine). Errors are OpenAI's object ({"error": {"message", "type", "param", "code"}}) for every status, the
framework's own included: 400 for malformed JSON, bad parameter values and prompts beyond the context, 404 for an
unknown model or route, 405, 413 for a body beyond the limit, 429 when `max_pending` requests are in flight, 503
while shutting down or once the engine has failed (running streams then end with an error event). A client that
disconnects has its request cancelled (its pages freed). On SIGTERM uvicorn stops accepting connections and lets
open ones finish; the engine then drains and stops.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from contextlib import asynccontextmanager

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from ..errors import StarscreamError
from .client import Delta, EngineClient, RequestStream
from .detokenize import IncrementalText
from .metrics import RequestTimes, ServerMetrics
from .protocol import EngineInfo
from .requests import (
    HTTP_BAD_REQUEST,
    HTTP_NOT_FOUND,
    HTTP_TOO_LARGE,
    HTTP_TOO_MANY,
    ApiError,
    ChatRequest,
    CompletionRequest,
    Sampling,
    unavailable,
)
from .scheduler import SamplingParams, check_fits

MAX_CHARS_PER_TOKEN = 256
"""A prompt longer than the context times this many characters cannot fit whatever the tokenizer, and is refused
before it is tokenized."""
MIN_BODY_BYTES = 8 * 2 ** 20
"""The request body limit is this, or four bytes per character of the longest prompt that could fit if more."""
DRAIN_S = 600.0
"""How long a shutdown waits for the engine to finish its running requests."""


class Server:
    """The routes over one engine client (see the module docstring). `on_engine_failure` is called once when the
    engine stops unexpectedly (the command then ends the process with a non-zero status)."""

    def __init__(self, client: EngineClient, tokenizer, model_name: str, info: EngineInfo, max_pending: int = 256,
                 on_engine_failure: Callable[[], None] = lambda: None):
        self.client, self.tokenizer, self.model_name, self.info = client, tokenizer, model_name, info
        self.max_pending = max_pending
        self.metrics = ServerMetrics(model_name, info.page_size)
        client.on_step = self.metrics.observe_step
        self._on_engine_failure = on_engine_failure
        self._ids = itertools.count()
        self._json = msgspec.json.Encoder()
        self.shutting_down = False

    @property
    def context(self) -> int:
        return self.info.context

    def app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(_):
            await self.client.start()
            watcher = asyncio.create_task(self._watch_engine())
            yield
            self.shutting_down = True
            watcher.cancel()
            await self.client.stop(drain=True, timeout=DRAIN_S)
            await self.client.close()

        app = FastAPI(title="starscream", lifespan=lifespan)
        app.add_exception_handler(ApiError, lambda _, err: err.response())
        app.add_exception_handler(RequestValidationError, lambda _, err: _validation_error(err).response())
        app.add_exception_handler(HTTPException, lambda _, err: _framework_error(err).response())
        app.post("/v1/completions")(self.completions)
        app.post("/v1/chat/completions")(self.chat)
        app.get("/v1/models")(self.models)
        app.get("/health")(self.health)
        app.get("/metrics")(self.prometheus)
        limit = max(MIN_BODY_BYTES, 4 * self.context * MAX_CHARS_PER_TOKEN)
        return BodyLimit(app, limit)

    async def _watch_engine(self) -> None:
        """Calls `on_engine_failure` once the engine has failed (after a second, so that waiting requests get
        their 503 first)."""
        while self.client.failed is None:
            await asyncio.sleep(0.2)
        await asyncio.sleep(1.0)
        self._on_engine_failure()

    async def models(self):
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "starscream", "max_model_len": self.context}]}

    async def health(self):
        if self.client.failed is not None:
            raise unavailable(f"the engine stopped: {self.client.failed}")
        if self.shutting_down:
            raise unavailable("shutting down")
        return {"status": "ok"}

    async def prometheus(self):
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def completions(self, body: CompletionRequest, request: Request):
        arrival = request.state.arrival
        if isinstance(body.prompt, list):
            prompt = body.prompt
        else:
            prompt = await self._tokenize(body.prompt, "prompt",
                                          lambda: self.tokenizer.encode(body.prompt, body.add_special_tokens))
        return await self._serve(body, prompt, request, arrival, chat=False, logprobs=body.logprobs is not None)

    async def chat(self, body: ChatRequest, request: Request):
        arrival = request.state.arrival
        messages = [message.for_template() for message in body.messages]

        def encode():
            text = self.tokenizer.render_chat(messages, add_generation_prompt=body.add_generation_prompt)
            self._check_length(text, "messages")
            return self.tokenizer.encode(text, special_tokens=body.add_special_tokens)

        self._check_length("".join(message["content"] for message in messages), "messages")
        prompt = await self._tokenize(None, "messages", encode)
        return await self._serve(body, prompt, request, arrival, chat=True, logprobs=body.logprobs)

    def _check_length(self, text: str, field: str) -> None:
        if len(text) > self.context * MAX_CHARS_PER_TOKEN:
            raise ApiError(HTTP_BAD_REQUEST, f"{field} holds {len(text)} characters, more than a context of "
                                             f"{self.context} tokens can hold; shorten it", param=field)

    async def _tokenize(self, text: str | None, field: str, encode) -> list[int]:
        """Token ids of a prompt, encoded on a worker thread (the event loop keeps serving); a StarscreamError
        (invalid text, a template that fails) is a 400 naming `field`."""
        if text is not None:
            self._check_length(text, field)
        try:
            return (await asyncio.to_thread(encode)).tolist()
        except StarscreamError as err:
            raise ApiError(HTTP_BAD_REQUEST, str(err), param=field) from None

    async def _serve(self, body: Sampling, prompt: list[int], request: Request, arrival: float, chat: bool,
                     logprobs: bool):
        params = self._params(body, prompt, logprobs, chat)
        if self.client.failed is not None:
            raise unavailable(f"the engine stopped: {self.client.failed}")
        if self.shutting_down:
            raise unavailable("the server is shutting down; send the request to another one")
        if self.client.pending >= self.max_pending:
            raise ApiError(HTTP_TOO_MANY, f"{self.client.pending} requests are in flight, the most this server "
                                          "queues; retry later", "rate_limit_error")
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{next(self._ids)}"
        stream = self.client.submit(request_id, prompt, params)
        first = await stream.take()  # a refusal surfaces here, before any response is sent
        if first.error is not None:
            raise (ApiError(HTTP_BAD_REQUEST, first.error) if first.finish_reason == "refused"
                   else unavailable(first.error))
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        response = _Response(self, request_id, body, chat, prompt, params, arrival, stop, stream)
        if body.stream:
            return StreamingResponse(response.sse(first), media_type="text/event-stream")
        return await response.whole(first, request)

    def _params(self, body: Sampling, prompt: list[int], logprobs: bool, chat: bool) -> SamplingParams:
        if body.model != self.model_name:
            raise ApiError(HTTP_NOT_FOUND, f"the model {body.model!r} does not exist; this server serves "
                                           f"{self.model_name!r}", param="model", code="model_not_found")
        room = max(1, self.context - len(prompt))
        max_tokens = body.max_completion_tokens or body.max_tokens or (room if chat else min(16, room))
        eos = () if body.ignore_eos else tuple(getattr(self.tokenizer, "eos_ids", ()))
        try:
            check_fits(len(prompt), max_tokens, self.context)
            vocab = self.info.vocab_size
            for field, ids in (("prompt", prompt), ("stop_token_ids", body.stop_token_ids or ())):
                if any(not 0 <= token < vocab for token in ids):
                    raise StarscreamError(f"{field} holds token ids outside the model's vocabulary of {vocab}")
            return SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                                  top_k=max(body.top_k, 0), seed=body.seed,
                                  stop_tokens=eos + tuple(body.stop_token_ids or ()), logprobs=logprobs)
        except StarscreamError as err:
            raise ApiError(HTTP_BAD_REQUEST, str(err)) from None


class _Response:
    """One request's response: each batch of new tokens turned into text and OpenAI's JSON, whole or as
    server-sent events, and the request's metrics once it ends."""

    def __init__(self, server: Server, request_id: str, body: Sampling, chat: bool, prompt: list[int],
                 params: SamplingParams, arrival: float, stop: tuple[str, ...], stream: RequestStream):
        self.server, self.request_id, self.body, self.chat = server, request_id, body, chat
        self.model, self.prompt_tokens, self.params, self.arrival = body.model, len(prompt), params, arrival
        self.stream, self.created = stream, int(time.time())
        self.text = IncrementalText(server.tokenizer.decode, prompt, stop, body.include_stop_str_in_output)
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.finish_reason: str | None = None
        self.engine_done = False
        self.first_at = self.last_at = self.queued_s = None

    def _advance(self, delta: Delta) -> tuple[str, list[int], list[float]]:
        """(new text, its token ids and log-probabilities) of `delta`; sets finish_reason on the last."""
        now = time.monotonic()
        if delta.tokens:
            self.first_at = self.first_at or now
            self.last_at = now
        self.queued_s = delta.queued_s if delta.queued_s is not None else self.queued_s
        self.engine_done = delta.finish_reason is not None or delta.error is not None
        kept = [(token, value) for token, value in zip(delta.tokens, delta.logprobs)
                if token not in self.params.stop_tokens]  # a stop token ends the text and is not part of it
        tokens, values = [token for token, _ in kept], [value for _, value in kept]
        self.tokens += tokens
        self.logprobs += values
        text = self.text.add(tokens, final=self.engine_done)
        if self.text.stopped or delta.finish_reason is not None:
            self.finish_reason = "stop" if self.text.stopped else delta.finish_reason
        return text, tokens, values

    def _finished(self) -> None:
        """Cancels the request in the engine if it still runs (a stop string, or the client gone) and records its
        metrics."""
        if not self.engine_done:
            self.server.client.cancel(self.request_id)
        start = self.arrival
        self.server.metrics.observe_request(RequestTimes(
            first_token_s=None if self.first_at is None else self.first_at - start,
            last_token_s=None if self.last_at is None else self.last_at - start, queued_s=self.queued_s,
            prompt_tokens=self.prompt_tokens, generated_tokens=len(self.tokens),
            finish_reason=self.finish_reason or "abort"))

    async def whole(self, first: Delta, request: Request) -> dict:
        watcher = asyncio.create_task(_hang_up(request, self.stream))
        try:
            parts, delta = [], first
            while True:
                if delta.error is not None:
                    raise (ApiError(HTTP_BAD_REQUEST, "the client disconnected") if delta.error == _HUNG_UP
                           else unavailable(delta.error))
                parts.append(self._advance(delta)[0])
                if self.finish_reason is not None:
                    return self._body("".join(parts))
                delta = await self.stream.take()
        finally:
            watcher.cancel()
            self._finished()

    async def sse(self, first: Delta):
        encode = self.server._json.encode
        try:
            if self.chat:
                yield _sse(encode(self._chunk({"role": "assistant", "content": ""}, None)))
            delta = first
            while True:
                if delta.error is not None:
                    yield _sse(encode(unavailable(delta.error).body()))
                    break
                text, tokens, values = self._advance(delta)
                if text or tokens or self.finish_reason is not None:
                    logprobs = self._logprobs(tokens, values) if self.params.logprobs else None
                    yield _sse(encode(self._chunk(text, self.finish_reason, logprobs)))
                if self.finish_reason is not None:
                    break
                delta = await self.stream.take()
            options = self.body.stream_options
            if options is not None and options.include_usage and delta.error is None:
                yield _sse(encode(self._usage_chunk()))
            yield b"data: [DONE]\n\n"
        finally:
            self._finished()

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
        return {"id": self.request_id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice]}

    def _usage_chunk(self) -> dict:
        return {"id": self.request_id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [], "usage": self._usage()}


_HUNG_UP = "the client disconnected"


async def _hang_up(request: Request, stream: RequestStream) -> None:
    """Ends `stream` once the client of a whole (not streamed) response disconnects: one waiting task per request,
    no poll per token."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    stream.fail(_HUNG_UP)


def _sse(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


class BodyLimit:
    """ASGI middleware at the door: notes each request's arrival (`request.state.arrival`, where TTFT and latency
    are measured from, before its body is read and parsed), and refuses a body beyond `limit` bytes with 413 as it
    arrives (declared by content-length or counted while chunks come)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope.setdefault("state", {})["arrival"] = time.monotonic()
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await ApiError(HTTP_TOO_LARGE, self._message()).response()(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise ApiError(HTTP_TOO_LARGE, self._message())
            return message

        return await self.app(scope, counted, send)

    def _message(self) -> str:
        return f"the request body exceeds {self.limit} bytes, more than any prompt that fits the context; shorten it"


def _validation_error(err: RequestValidationError) -> ApiError:
    """FastAPI's validation error (malformed JSON, a missing or bad field) as OpenAI's 400."""
    first = err.errors()[0]
    if first.get("type") == "json_invalid":
        return ApiError(HTTP_BAD_REQUEST, "the request body is not valid JSON; send a JSON object")
    where = ".".join(str(part) for part in first.get("loc", ())[1:]) or "body"
    return ApiError(HTTP_BAD_REQUEST, f"{where}: {first.get('msg', 'invalid value')}", param=where)


def _framework_error(err: HTTPException) -> ApiError:
    """The framework's own refusals (an unknown route, a method it does not take) as OpenAI's error object."""
    kind = "invalid_request_error" if err.status_code < 500 else "server_error"
    if err.status_code == HTTP_BAD_REQUEST:  # a body FastAPI could not read: not UTF-8, compressed, nested too deep
        return ApiError(HTTP_BAD_REQUEST, "the request body could not be read as JSON; send one JSON object in UTF-8, "
                                          "without a content encoding")
    return ApiError(err.status_code, str(err.detail), kind)
