"""The OpenAI-compatible HTTP server (FastAPI on uvicorn), the API process' half of a server; the engine runs apart
(`serving.core`) and is reached through an `EngineClient`.

Routes: POST /v1/completions and /v1/chat/completions (the request's chat template, else the server's, else the
tokenizer's, with the request's chat_template_kwargs), both streaming by
server-sent events with `"stream": true`, each request's choices (`n` per prompt, and a batch of prompts for
completions) served as engine requests of their own; GET /v1/models; and as vLLM's, GET /health and /ping,
/version, /metrics (Prometheus text, `serving.metrics`), POST /tokenize and /detokenize. /v1/embeddings is a 404
saying that this server generates only. With an API key every /v1/ route asks for it (401 otherwise); CORS
answers browsers from the origins allowed.
Per request the API process tokenizes (on a worker thread, after a length check, so a huge prompt stalls no other
stream), hands the token ids to the engine, and turns each batch of new tokens into text incrementally
(`detokenize.IncrementalText`, which also ends the text at a stop string and then cancels the request in the
engine). A request's structured output becomes one grammar, validated here and applied by the engine
(`serving.guided`); chat `tools` reach the template and the answer becomes tool calls as `tool_choice` says
(`serving.tools`). Errors are OpenAI's object ({"error": {"message", "type", "param", "code"}}) for every status, the
framework's own included: 400 for malformed JSON, bad parameter values and prompts beyond the context, 401 without
the API key, 404 for an unknown model or route, 405, 413 for a body beyond the limit, 429 when `max_pending`
requests are in flight, 503 while shutting down or once the engine has failed (running streams then end with an
error event). A client that disconnects has its request cancelled (its pages freed). On SIGTERM uvicorn stops
accepting connections and lets open ones finish; the engine then drains and stops. While the engine is busy a
line of its load is logged every `STATS_INTERVAL_S`.
"""
from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from ..errors import StarscreamError
from ..text.tokenizer import check_template, continued
from .client import EngineClient
from .metrics import ServerMetrics
from .middleware import ApiKey, BodyLimit
from .protocol import EngineInfo
from .requests import (
    HTTP_BAD_REQUEST,
    HTTP_NOT_FOUND,
    HTTP_TOO_MANY,
    ApiError,
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    Sampling,
    TemplateOptions,
    TokenizeRequest,
    unavailable,
)
from .responses import Choice, CompletionResponse, Serving
from .guided import Grammar, checked
from .scheduler import SamplingParams, check_fits, engine_seed, sample_seeds
from .tools import PARSERS, ToolMode

MAX_CHARS_PER_TOKEN = 256
"""A prompt longer than the context times this many characters cannot fit whatever the tokenizer, and is refused
before it is tokenized."""
MIN_BODY_BYTES = 8 * 2 ** 20
"""The request body limit is this, or four bytes per character of the longest prompt that could fit if more."""
DRAIN_S = 600.0
"""How long a shutdown waits for the engine to finish its running requests."""
STATS_INTERVAL_S = 10.0
"""How often a line of the engine's load is logged while it is busy (as vLLM logs its own)."""
LOG = logging.getLogger("starscream.serve")


def package_version() -> str:
    """The installed package's version (/version); "0+source" when the package runs from a source tree on the path
    without being installed."""
    try:
        return importlib.metadata.version("starscream-jax")
    except importlib.metadata.PackageNotFoundError:
        return "0+source"


VERSION = package_version()


class Server:
    """The routes over one engine client (see the module docstring). `on_engine_failure` is called once when the
    engine stops unexpectedly (the command then ends the process with a non-zero status). `api_key`: every /v1/
    route then asks for `Authorization: Bearer <api_key>`. `allowed_origins` (with `allowed_methods` and
    `allowed_headers`): the browser origins CORS lets in ("*": any; none by default). `sampling_defaults`: the
    temperature / top_p / top_k a request that leaves them out gets (a model's generation_config.json).
    `tool_parser`: the `serving.tools.PARSERS` name that reads calls out of an answer under tool_choice "auto"
    (None: such requests are refused). `chat_template`: a Jinja template rendering chats instead of the
    tokenizer's (vLLM's --chat-template; a request's chat_template replaces either, where
    `trust_request_chat_template`: as in vLLM a request's template is refused otherwise, since a template can
    loop or grow its output until the worker thread or the memory is spent)."""

    def __init__(self, client: EngineClient, tokenizer, model_name: str, info: EngineInfo, max_pending: int = 256,
                 on_engine_failure: Callable[[], None] = lambda: None, api_key: str | None = None,
                 allowed_origins: Sequence[str] = (), allowed_methods: Sequence[str] = ("*",),
                 allowed_headers: Sequence[str] = ("*",), sampling_defaults: dict | None = None,
                 stats_interval_s: float = STATS_INTERVAL_S, tool_parser: str | None = None,
                 chat_template: str | None = None, trust_request_chat_template: bool = False):
        self.client, self.tokenizer, self.model_name, self.info = client, tokenizer, model_name, info
        self.max_pending = max_pending
        self.metrics = ServerMetrics(model_name, info.page_size)
        self.metrics.programs_at_start.set(info.programs)  # compiled before the engine reported ready
        client.on_step = self.metrics.observe_step
        self._on_engine_failure = on_engine_failure
        self.api_key = api_key
        self.cors = (tuple(allowed_origins), tuple(allowed_methods), tuple(allowed_headers))
        self.sampling_defaults = dict(sampling_defaults or {})
        self.stats_interval_s = stats_interval_s
        if tool_parser is not None and tool_parser not in PARSERS:
            raise StarscreamError(f"unknown tool-call parser {tool_parser!r}; choose one of {', '.join(PARSERS)}")
        self.tool_parser = tool_parser
        self.chat_template = None if chat_template is None else check_template(chat_template, "the chat template")
        self.trust_request_chat_template = trust_request_chat_template
        self._ids = itertools.count()
        self.serving = Serving(decode=tokenizer.decode, client=client, metrics=self.metrics,
                               json=msgspec.json.Encoder(),
                               decode_special=functools.partial(tokenizer.decode, skip_special_tokens=False),
                               special_ids=tokenizer.special_ids)
        self.shutting_down = False
        self.started = int(time.time())
        self.prompt_tokens_submitted = 0
        """Prompt tokens sent to the engine so far (for the periodic stats line)."""
        self._stats_since: tuple[float, int, int] | None = None

    @property
    def context(self) -> int:
        return self.info.context

    def app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(_):
            await self.client.start()
            tasks = [asyncio.create_task(self._watch_engine()), asyncio.create_task(self._log_stats())]
            yield
            self.shutting_down = True
            for task in tasks:
                task.cancel()
            await self.client.stop(drain=True, timeout=DRAIN_S)
            await self.client.close()

        app = FastAPI(title="starscream", lifespan=lifespan)
        app.add_exception_handler(ApiError, lambda _, err: err.response())
        app.add_exception_handler(RequestValidationError, lambda _, err: _validation_error(err).response())
        app.add_exception_handler(HTTPException, lambda _, err: _framework_error(err).response())
        app.post("/v1/completions")(self.completions)
        app.post("/v1/chat/completions")(self.chat)
        app.get("/v1/models")(self.models)
        app.post("/v1/embeddings")(self.embeddings)
        app.get("/health")(self.health)
        app.api_route("/ping", methods=["GET", "POST"])(self.health)
        app.get("/version")(self.version)
        app.post("/tokenize")(self.tokenize)
        app.post("/detokenize")(self.detokenize)
        app.get("/metrics")(self.prometheus)
        if self.api_key:
            app.add_middleware(ApiKey, key=self.api_key)
        origins, methods, headers = self.cors
        if origins:  # outside the key's check: a preflight carries no key, and a 401 still reaches the page
            app.add_middleware(CORSMiddleware, allow_origins=list(origins), allow_methods=list(methods),
                               allow_headers=list(headers))
        limit = max(MIN_BODY_BYTES, 4 * self.context * MAX_CHARS_PER_TOKEN)
        return BodyLimit(app, limit)

    async def _watch_engine(self) -> None:
        """Calls `on_engine_failure` once the engine has failed (after a second, so that waiting requests get
        their 503 first)."""
        while self.client.failed is None:
            await asyncio.sleep(0.2)
        await asyncio.sleep(1.0)
        self._on_engine_failure()

    async def _log_stats(self) -> None:
        """Logs `stats_line()` every `stats_interval_s` while the engine is busy."""
        self.stats_line(time.monotonic())
        while True:
            await asyncio.sleep(self.stats_interval_s)
            line = self.stats_line(time.monotonic())
            if line is not None:
                LOG.info(line)

    def stats_line(self, now: float) -> str | None:
        """The engine's load since the last call, from the counters of its latest step (nothing per token):
        prompt and generation tokens/s over the interval, requests running and waiting, KV-cache use; None while
        idle (nothing ran, nothing waits), before the first step and on the first call (which starts the
        interval)."""
        load = self.client.load
        generated_in_all = 0 if load is None else load.generated_tokens
        last, self._stats_since = self._stats_since, (now, generated_in_all, self.prompt_tokens_submitted)
        if load is None or last is None or now <= last[0]:
            return None
        generated, prompt = load.generated_tokens - last[1], self.prompt_tokens_submitted - last[2]
        if not (generated or prompt or load.running or load.waiting):
            return None
        seconds = now - last[0]
        return (f"prompt throughput: {prompt / seconds:.1f} tokens/s, generation throughput: "
                f"{generated / seconds:.1f} tokens/s, running: {load.running} reqs, waiting: {load.waiting} reqs, "
                f"KV cache usage: {100 * load.pages_used / max(load.pages_total, 1):.1f}%")

    async def models(self):
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.started,
                                            "owned_by": "starscream", "max_model_len": self.context}]}

    async def health(self):
        if self.client.failed is not None:
            raise unavailable(f"the engine stopped: {self.client.failed}")
        if self.shutting_down:
            raise unavailable("shutting down")
        return {"status": "ok"}

    async def version(self):
        return {"version": VERSION}

    async def embeddings(self):
        raise ApiError(HTTP_NOT_FOUND, f"this server serves generation only: {self.model_name!r} is a decoder "
                                       "and its pooled hidden state is not offered as an embedding; use "
                                       "/v1/completions or /v1/chat/completions, or an embedding model's server",
                       code="model_not_found")

    async def prometheus(self):
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def tokenize(self, body: TokenizeRequest):
        self._check_model(body.model)
        if body.messages is not None:
            tokens = await self._chat_tokens(body.messages, body.template_options(), bool(body.add_special_tokens),
                                             body.tools)
        else:
            special = True if body.add_special_tokens is None else body.add_special_tokens
            tokens = await self._tokenize(body.prompt, "prompt", lambda: self.tokenizer.encode(body.prompt, special))
        decode = self.tokenizer.decode
        strings = [decode([token]) for token in tokens] if body.return_token_strs else None
        return {"count": len(tokens), "max_model_len": self.context, "tokens": tokens, "token_strs": strings}

    async def detokenize(self, body: DetokenizeRequest):
        self._check_model(body.model)
        self._check_vocabulary("tokens", body.tokens)
        return {"prompt": await asyncio.to_thread(self.tokenizer.decode, body.tokens)}

    async def completions(self, body: CompletionRequest, request: Request):
        arrival = request.state.arrival
        self._check_model(body.model)
        prompts = body.prompts()
        self._admit(len(prompts) * body.n)
        texts = [prompt for prompt in prompts if isinstance(prompt, str)]
        for text in texts:
            self._check_length(text, "prompt")
        encoded = iter(await asyncio.gather(*(
            self._tokenize(text, "prompt", functools.partial(self.tokenizer.encode, text, body.add_special_tokens))
            for text in texts)))
        echoes = [(prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)) if body.echo else ""
                  for prompt in prompts]
        prompts = [next(encoded) if isinstance(prompt, str) else prompt for prompt in prompts]
        grammar = await self._grammar(body)
        return await self._serve(body, prompts, request, arrival, chat=False, logprobs=body.logprobs is not None,
                                 grammar=grammar, echoes=echoes)

    async def chat(self, body: ChatRequest, request: Request):
        arrival = request.state.arrival
        self._check_model(body.model)
        self._admit(body.n)
        tools = body.tool_mode(self.tool_parser)
        grammar = await self._grammar(body)
        options = body.template_options()
        prompt = await self._chat_tokens(body.messages, options, body.add_special_tokens, body.tools)
        return await self._serve(body, [prompt], request, arrival, chat=True, logprobs=body.logprobs,
                                 grammar=grammar, tools=tools, echoes=[body.echoed(options)])

    @staticmethod
    async def _grammar(body: Sampling) -> Grammar | None:
        """The request's structured output (`Sampling.grammar`), validated by llguidance on a worker thread (a
        large schema takes a while); a 400 naming its field when it is not valid."""
        grammar = body.grammar()
        if grammar is None:
            return None
        try:
            return await asyncio.to_thread(checked, grammar)
        except StarscreamError as err:
            raise ApiError(HTTP_BAD_REQUEST, str(err), param=grammar.field) from None

    async def _chat_tokens(self, messages: list[ChatMessage], options: TemplateOptions, add_special_tokens: bool,
                           tools: list | None = None) -> list[int]:
        """The token ids of `messages` rendered as `options` say (the request's template, else the server's, else
        the tokenizer's; cut after the final message where it is continued), on a worker thread. A template that
        fails is a 400 naming chat_template where the request gave one (else messages); a final message the
        rendered text does not hold, one naming continue_final_message."""
        if options.template is not None and not self.trust_request_chat_template:
            raise ApiError(HTTP_BAD_REQUEST, "chat_template: this server renders only its own chat template; leave "
                           "chat_template out, or start the server with --trust-request-chat-template",
                           param="chat_template")
        turns = [message.for_template() for message in messages]
        field = "messages" if options.template is None else "chat_template"

        def encode():
            try:
                text = self.tokenizer.render_chat(turns, add_generation_prompt=options.add_generation_prompt,
                                                  **({"tools": tools} if tools else {}),
                                                  template=options.template or self.chat_template,
                                                  variables=options.variables)
            except StarscreamError as err:
                raise ApiError(HTTP_BAD_REQUEST, str(err), param=field) from None
            if options.continue_final:
                try:
                    text = continued(text, turns[-1]["content"])
                except StarscreamError as err:
                    raise ApiError(HTTP_BAD_REQUEST, str(err), param="continue_final_message") from None
            self._check_length(text, "messages")
            return self.tokenizer.encode(text, special_tokens=add_special_tokens)

        self._check_length("".join(turn["content"] for turn in turns), "messages")
        return await self._tokenize(None, "messages", encode)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(HTTP_NOT_FOUND, f"the model {model!r} does not exist; this server serves "
                                           f"{self.model_name!r}", param="model", code="model_not_found")

    def _check_vocabulary(self, field: str, ids) -> None:
        vocab = self.info.vocab_size
        if any(not 0 <= token < vocab for token in ids):
            raise ApiError(HTTP_BAD_REQUEST, f"{field} holds token ids outside the model's vocabulary of {vocab}",
                           param=field)

    def _admit(self, count: int) -> None:
        """Refuses new work (`count` engine requests) while the engine has failed, the server shuts down, or the
        requests in flight would pass `max_pending`."""
        if self.client.failed is not None:
            raise unavailable(f"the engine stopped: {self.client.failed}")
        if self.shutting_down:
            raise unavailable("the server is shutting down; send the request to another one")
        if count > self.max_pending:
            raise ApiError(HTTP_BAD_REQUEST, f"this request needs {count} engine requests (prompts x n), more than the "
                           f"{self.max_pending} this server queues; send fewer prompts or a smaller n", param="n")
        if self.client.pending + count > self.max_pending:
            raise ApiError(HTTP_TOO_MANY, f"{self.client.pending} requests are in flight and this one needs "
                                          f"{count}, beyond the {self.max_pending} this server queues; retry later",
                           "rate_limit_error")

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

    async def _serve(self, body: Sampling, prompts: list[list[int]], request: Request, arrival: float, chat: bool,
                     logprobs: bool, grammar: Grammar | None = None, tools: ToolMode | None = None,
                     echoes: list[str] | None = None):
        """Submits `body.n` engine requests per prompt (choice `p * n + i` is prompt p's i-th, seeded seed + i
        when a seed is given) and answers with all their choices, whole or streamed; each follows `grammar`
        (structured output), its text becomes tool calls as `tools` says, and begins with its prompt's echo (is
        only that with max_tokens 0: the engine's one token is dropped)."""
        if body.model is None:  # the served model, named in the answer as vLLM names it
            body = body.model_copy(update={"model": self.model_name})
        prompts = [body.truncated(prompt, self.context) for prompt in prompts]
        params = [replace(self._params(body, prompt, logprobs, chat), grammar=grammar) for prompt in prompts]
        self._admit(len(prompts) * body.n)
        kind = "chatcmpl" if chat else "cmpl"
        engine_id, named = f"{kind}-{next(self._ids)}", _client_request_id(body, request)
        response_id = f"{kind}-{named}" if named else engine_id
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        choices = []
        echoes = echoes or [""] * len(prompts)
        for number, (prompt, base, echo) in enumerate(zip(prompts, params, echoes)):
            for i, seed in enumerate(sample_seeds(base.seed, body.n)):
                index = number * body.n + i
                request_id = engine_id if len(prompts) * body.n == 1 else f"{engine_id}-{index}"
                seeded = replace(base, seed=seed)
                stream = self.client.submit(request_id, prompt, seeded)
                choices.append(Choice(self.serving, index, request_id, prompt, seeded, stop,
                                      body.include_stop_str_in_output, stream, tools, echo, body.max_tokens == 0,
                                      body.skip_special_tokens, body.spaces_between_special_tokens,
                                      self._stop_reasons(body)))
            self.prompt_tokens_submitted += len(prompt) * body.n
        firsts = await asyncio.gather(*(choice.stream.take() for choice in choices))  # refusals surface here
        refused = next((first for first in firsts if first.error is not None), None)
        if refused is not None:
            for choice in choices:
                self.client.cancel(choice.request_id)
            raise (ApiError(HTTP_BAD_REQUEST, refused.error) if refused.finish_reason == "refused"
                   else unavailable(refused.error))
        response = CompletionResponse(self.serving, response_id, body, chat, sum(map(len, prompts)), arrival, choices,
                                      firsts)
        if body.stream:
            return StreamingResponse(response.sse(), media_type="text/event-stream")
        return await response.whole(request)

    def _stop_reasons(self, body: Sampling) -> tuple[int, ...]:
        """The request's stop token ids a choice names as its stop_reason when one ends it: an EOS id among them
        stops the choice as EOS does (no stop_reason, as vLLM checks EOS first) unless the request ignores EOS."""
        eos = () if body.ignore_eos else tuple(getattr(self.tokenizer, "eos_ids", ()))
        return tuple(token for token in body.stop_token_ids or () if token not in eos)

    def _params(self, body: Sampling, prompt: list[int], logprobs: bool, chat: bool) -> SamplingParams:
        self._check_model(body.model)
        room = max(1, self.context - len(prompt))
        max_tokens = 1 if body.max_tokens == 0 else \
            body.max_completion_tokens or body.max_tokens or (room if chat else min(16, room))
        eos = () if body.ignore_eos else tuple(getattr(self.tokenizer, "eos_ids", ()))
        given = body.model_fields_set

        def sampling(field: str):
            value = getattr(body, field)
            return value if field in given else self.sampling_defaults.get(field, value)

        self._check_vocabulary("prompt", prompt)
        self._check_vocabulary("stop_token_ids", body.stop_token_ids or ())
        bias = body.bias_pairs()
        self._check_vocabulary("logit_bias", [token for token, _ in bias])
        self._check_vocabulary("allowed_token_ids", body.allowed_token_ids or ())
        bad_words = body.bad_word_ids(lambda text: self.tokenizer.encode(text, special_tokens=False).tolist())
        self._check_vocabulary("bad_words", [token for word in bad_words for token in word])
        top = (body.top_logprobs if chat else body.logprobs or 0) if logprobs else 0
        scored = self._prompt_logprobs(body, chat)
        try:
            check_fits(len(prompt), max_tokens, self.context)
            return SamplingParams(max_tokens=max_tokens, temperature=sampling("temperature"),
                                  top_p=sampling("top_p"), top_k=max(sampling("top_k"), 0),
                                  seed=engine_seed(body.seed), stop_tokens=eos + tuple(body.stop_token_ids or ()), logprobs=logprobs,
                                  top_logprobs=top, min_tokens=body.min_tokens, min_p=body.min_p,
                                  presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                                  repetition_penalty=body.repetition_penalty, logit_bias=bias,
                                  allowed_token_ids=tuple(body.allowed_token_ids or ()), bad_words=bad_words,
                                  prompt_logprobs=scored, cache_salt=body.cache_salt)
        except StarscreamError as err:
            raise ApiError(HTTP_BAD_REQUEST, str(err)) from None

    def _prompt_logprobs(self, body: Sampling, chat: bool) -> int | None:
        """The likeliest tokens the engine gives at each prompt position (`SamplingParams.prompt_logprobs`): the
        larger of vLLM's prompt_logprobs and completions' logprobs N where echo shows the prompt's; None where
        neither asks. A 400 naming the field that asks when the engine computes none (started without
        --enable-prompt-logprobs)."""
        asked = {"prompt_logprobs": body.prompt_logprobs,
                 "echo": body.logprobs if not chat and body.echo else None}
        asked = {field: count for field, count in asked.items() if count is not None}
        if asked and not self.info.prompt_logprobs:
            field = next(iter(asked))
            raise ApiError(HTTP_BAD_REQUEST, f"{field} asks for the prompt's log-probabilities, which this server "
                           "computes only when started with --enable-prompt-logprobs", param=field)
        return max(asked.values(), default=None)


def _client_request_id(body: Sampling, request: Request) -> str | None:
    """The id the client names its request by, which names the response as vLLM names it ("cmpl-" or "chatcmpl-"
    and the id): the X-Request-Id header, else the body's request_id; None where neither is given. The engine's
    own request ids stay the server's (two clients may send one id)."""
    return request.headers.get("x-request-id") or body.request_id


def _validation_error(err: RequestValidationError) -> ApiError:
    """FastAPI's validation error (malformed JSON, a missing or bad field) as OpenAI's 400."""
    first = err.errors()[0]
    if first.get("type") == "json_invalid":
        return ApiError(HTTP_BAD_REQUEST, "the request body is not valid JSON; send a JSON object")
    if tuple(first.get("loc", ())) == ("body",):  # no body, or one not read as a JSON object (another content type)
        return ApiError(HTTP_BAD_REQUEST, "the request body is not a JSON object; send one, with the header "
                                          "'Content-Type: application/json'")
    where = ".".join(str(part) for part in first.get("loc", ())[1:]) or "body"
    return ApiError(HTTP_BAD_REQUEST, f"{where}: {first.get('msg', 'invalid value')}", param=where)


def _framework_error(err: HTTPException) -> ApiError:
    """The framework's own refusals (an unknown route, a method it does not take) as OpenAI's error object."""
    kind = "invalid_request_error" if err.status_code < 500 else "server_error"
    if err.status_code == HTTP_BAD_REQUEST:  # a body FastAPI could not read: not UTF-8, compressed, nested too deep
        return ApiError(HTTP_BAD_REQUEST, "the request body could not be read as JSON; send one JSON object in UTF-8, "
                                          "without a content encoding")
    return ApiError(err.status_code, str(err.detail), kind)
