"""One HTTP request's response: each of its choices (an engine request) turned into text as its tokens come, and
the whole as OpenAI's JSON or as server-sent events, with each choice's metrics once it ends.

A response reads its choices' deltas through a `FanIn` (one choice straight from its stream; several through one
queue), turns each into text (`detokenize.IncrementalText`, which ends a choice at a stop string), and when it ends,
for whatever reason (finished, a stop string, the client gone, an engine failure), cancels in the engine every
choice still running.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
from fastapi import Request

from .client import Delta, EngineClient, RequestStream
from .detokenize import IncrementalText, spaced_special
from .metrics import RequestTimes, ServerMetrics
from .requests import HTTP_BAD_REQUEST, ApiError, Sampling, unavailable
from .scheduler import PromptLogprobs, SamplingParams
from .tools import ToolMode, ToolStream


@dataclass(frozen=True, kw_only=True)
class Serving:
    """What every response of a server uses: the tokenizer's decode, the engine client (to cancel a choice), the
    metrics and the JSON encoder."""

    decode: Callable[[list[int]], str]
    client: EngineClient
    metrics: ServerMetrics
    json: msgspec.json.Encoder
    decode_special: Callable[[list[int]], str] | None = None
    """The tokenizer's decode with special tokens kept, for the text a tool-call parser reads (default `decode`)."""
    special_ids: frozenset[int] = frozenset()
    """The tokenizer's special token ids (`spaces_between_special_tokens` sets them apart in kept text)."""


def _decode_of(serving: Serving, skip_special: bool, spaced: bool, tools: ToolMode | None):
    """The decode of a choice's text (see `Choice`)."""
    if not skip_special:
        keeping = serving.decode_special or serving.decode
        return spaced_special(keeping, serving.special_ids) if spaced and serving.special_ids else keeping
    if tools is not None and tools.kind == "auto":
        return serving.decode_special or serving.decode
    return serving.decode


class Choice:
    """One engine request of a response (a choice): its tokens turned into text as they come, its end, and its
    metrics once it ends; `echo` is text its answer begins with (a completions prompt, or chat's last message,
    echoed), and with `echo_only` (max_tokens 0) its whole answer: the one token the engine generates is dropped.
    Special tokens' text is left out of its text unless `skip_special` is False (vLLM's skip_special_tokens; then
    `spaced`, vLLM's spaces_between_special_tokens, sets each one apart by a space), or a tool-call parser reads it
    (tool_choice auto: the parsers' markers are special tokens). As in vLLM, the token that ends it (an EOS id, or
    one of the request's `stop_ids`) is one of its tokens (usage, token ids, log-probabilities) and its text is
    left out unless `include_stop`; a stop string ends its tokens at the one that completed it."""

    def __init__(self, serving: Serving, index: int, request_id: str, prompt: list[int], params: SamplingParams,
                 stop: tuple[str, ...], include_stop: bool, stream: RequestStream, tools: ToolMode | None = None,
                 echo: str = "", echo_only: bool = False, skip_special: bool = True, spaced: bool = True,
                 stop_ids: tuple[int, ...] = ()):
        self.serving, self.index, self.request_id, self.params, self.stream = serving, index, request_id, params, stream
        self.include_stop, self.stop_ids = include_stop, frozenset(stop_ids)
        self.echo, self.echo_only = echo, echo_only
        self.prompt_scores: PromptLogprobs | None = None  # the prompt's log-probabilities, from the first delta
        self.offset = 0  # characters of the token texts its completions logprobs gave so far (text_offset)
        self.prompt = prompt
        self.prompt_tokens = len(prompt)
        self.tools = tools
        self.tool_stream = ToolStream(tools) if tools is not None else None
        self.text = IncrementalText(_decode_of(serving, skip_special, spaced, tools), prompt, stop, include_stop,
                                    params.min_tokens)
        self.parts: list[str] = []
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.tops: list[tuple[list[int], list[float]] | None] = []  # each token's likeliest (ids, log-probabilities)
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        """vLLM's stop_reason: the stop string or the request's stop token id (not an EOS id) that ended it."""
        self.engine_done = False
        self.first_at = self.last_at = self.queued_s = None

    def advance(self, delta: Delta) -> tuple[str, list[int], list[float], list]:
        """(new text, its token ids, log-probabilities and likeliest tokens) of `delta`; sets finish_reason on the
        last."""
        if self.echo_only:
            delta = Delta(finish_reason=delta.finish_reason and "length", error=delta.error, queued_s=delta.queued_s)
        now = time.monotonic()
        if delta.tokens:
            self.first_at = self.first_at or now
            self.last_at = now
        self.queued_s = delta.queued_s if delta.queued_s is not None else self.queued_s
        self.engine_done = delta.finish_reason is not None or delta.error is not None
        tokens, values = list(delta.tokens), list(delta.logprobs)
        tops = list(zip(delta.top_tokens, delta.top_logprobs)) or [None] * len(tokens)
        stop_token = delta.finish_reason == "stop" and bool(tokens) and tokens[-1] in self.params.stop_tokens
        text = self.text.add(tokens[:-1] if stop_token and not self.include_stop else tokens, final=self.engine_done)
        if self.text.stopped:  # a stop string: the tokens end at the one that completed it
            tokens, values, tops = tokens[:self.text.taken], values[:self.text.taken], tops[:self.text.taken]
            self.finish_reason, self.stop_reason = "stop", self.text.stopped
            self._end_in_engine()  # now: the response's other choices may run a while yet
        elif delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.stop_reason = tokens[-1] if stop_token and tokens[-1] in self.stop_ids else None
        self.tokens += tokens
        self.logprobs += values
        self.tops += tops
        return text, tokens, values, tops

    def split(self, text: str) -> tuple[str, list[dict]]:
        """(content, tool-call deltas) of the choice's new `text` while streaming (`tools.ToolStream`)."""
        if self.tool_stream is None:
            return text, []
        return self.tool_stream.add(text, final=self.finish_reason is not None)

    def outcome(self) -> tuple[str | None, list[dict], str | None]:
        """The whole choice's (content, OpenAI tool_calls, finish_reason): "tool_calls" when it ended by itself
        ("stop") with calls; the echo begins the content (the calls are read from the generated text alone)."""
        text = "".join(self.parts)
        if self.tools is None:
            return self.echo + text, [], self.finish_reason
        content, calls = self.tools.calls(text)
        content = self.echo + (content or "") if self.echo else content
        return content, [call.openai() for call in calls], self._reason(bool(calls))

    def streamed_reason(self) -> str | None:
        """The finish reason of a streamed choice (after its last `split`)."""
        return self._reason(bool(self.tool_stream and self.tool_stream.calls))

    def _reason(self, called: bool) -> str | None:
        return "tool_calls" if called and self.finish_reason == "stop" else self.finish_reason

    def _end_in_engine(self) -> None:
        """Cancels the request in the engine if it still runs (its pages freed; nothing more arrives for it)."""
        if not self.engine_done:
            self.serving.client.cancel(self.request_id)
            self.engine_done = True

    def finished(self, arrival: float) -> None:
        """Cancels the request in the engine if it still runs (the client gone, another choice failed) and records
        its metrics."""
        self._end_in_engine()
        self.serving.metrics.observe_request(RequestTimes(
            first_token_s=None if self.first_at is None else self.first_at - arrival,
            last_token_s=None if self.last_at is None else self.last_at - arrival, queued_s=self.queued_s,
            prompt_tokens=self.prompt_tokens, generated_tokens=len(self.tokens),
            finish_reason=self.finish_reason or "abort"))


class FanIn:
    """Each choice's deltas as they come, in arrival order: the first ones given, then what the streams give. One
    choice is read from its stream directly; several through one queue, filled by a task per choice (a wake-up per
    step and choice, none per token)."""

    def __init__(self, choices: list[Choice], firsts: list[Delta]):
        self._choices, self._first = choices, firsts[0] if len(choices) == 1 else None
        self._queue: asyncio.Queue | None = None
        self._pumps: list[asyncio.Task] = []
        if len(choices) > 1:
            self._queue = asyncio.Queue()
            for choice, first in zip(choices, firsts):
                self._queue.put_nowait((choice, first))
            self._pumps = [asyncio.create_task(self._pump(choice)) for choice in choices]

    async def _pump(self, choice: Choice) -> None:
        while True:
            delta = await choice.stream.take()
            self._queue.put_nowait((choice, delta))
            if delta.finish_reason is not None or delta.error is not None:
                return

    async def next(self) -> tuple[Choice, Delta]:
        if self._queue is not None:
            return await self._queue.get()
        delta, self._first = self._first, None
        return self._choices[0], delta if delta is not None else await self._choices[0].stream.take()

    def close(self) -> None:
        for pump in self._pumps:
            pump.cancel()


class CompletionResponse:
    """One HTTP request's response: its choices' text as OpenAI's JSON, whole or as server-sent events (chunks of
    every choice interleaved as they come, each naming its choice's index)."""

    def __init__(self, serving: Serving, response_id: str, body: Sampling, chat: bool, prompt_tokens: int,
                 arrival: float, choices: list[Choice], firsts: list[Delta]):
        self.serving, self.response_id, self.body, self.chat = serving, response_id, body, chat
        self.model, self.prompt_tokens, self.arrival = body.model, prompt_tokens, arrival
        self.choices, self.firsts, self.created = choices, firsts, int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        for choice, first in zip(choices, firsts):
            choice.prompt_scores = first.prompt
        self.echoes_logprobs = not chat and body.echo and body.logprobs is not None
        """Whether a choice's completions logprobs begin with its prompt's (echo with logprobs, as lm-eval asks)."""

    def _finished(self, fan_in: FanIn) -> None:
        fan_in.close()
        for choice in self.choices:
            choice.finished(self.arrival)

    async def whole(self, request: Request) -> dict:
        watcher = asyncio.create_task(hang_up(request, [choice.stream for choice in self.choices]))
        fan_in = FanIn(self.choices, self.firsts)
        try:
            running = len(self.choices)
            while running:
                choice, delta = await fan_in.next()
                if choice.finish_reason is not None:
                    continue  # what came after its stop string
                if delta.error is not None:
                    raise (ApiError(HTTP_BAD_REQUEST, "the client disconnected") if delta.error == _HUNG_UP
                           else unavailable(delta.error))
                choice.parts.append(choice.advance(delta)[0])
                running -= choice.finish_reason is not None
            return self._body()
        finally:
            watcher.cancel()
            self._finished(fan_in)

    async def sse(self):
        encode, options = self.serving.json.encode, self.body.stream_options
        fan_in = FanIn(self.choices, self.firsts)
        try:
            for choice in self.choices:
                if self.chat:
                    first = self._chunk(choice, {"role": "assistant", "content": ""}, None)
                    yield _sse(encode({**first, **self._ids("prompt_token_ids", choice.prompt),
                                       **self._prompt_logprobs(choice)}))
                    if choice.echo:
                        yield _sse(encode(self._chunk(choice, choice.echo, None)))
                elif choice.echo or self.body.return_token_ids or self.body.prompt_logprobs is not None:
                    logprobs = self._logprobs(choice, [], [], []) if self.echoes_logprobs else None
                    first = self._chunk(choice, choice.echo, None, logprobs)
                    first["choices"][0].update({**self._ids("prompt_token_ids", choice.prompt),
                                                **self._prompt_logprobs(choice)})
                    yield _sse(encode(first))
            failed, running = False, len(self.choices)
            while running:
                choice, delta = await fan_in.next()
                if choice.finish_reason is not None:
                    continue
                if delta.error is not None:
                    yield _sse(encode(unavailable(delta.error).body()))
                    failed = True
                    break
                text, tokens, values, tops = choice.advance(delta)
                text, calls = choice.split(text) if self.chat else (text, [])
                if text or tokens or calls or choice.finish_reason is not None:
                    logprobs = self._logprobs(choice, tokens, values, tops, streamed=True) \
                        if choice.params.logprobs else None
                    part = ({"content": text or None, "tool_calls": calls} if calls else {"content": text}) \
                        if self.chat else text
                    chunk = self._chunk(choice, part, choice.streamed_reason(), logprobs)
                    chunk["choices"][0].update(self._ids("token_ids", tokens))
                    if options is not None and options.include_usage and options.continuous_usage_stats:
                        chunk["usage"] = self._usage()
                    yield _sse(encode(chunk))
                running -= choice.finish_reason is not None
            if options is not None and options.include_usage and not failed:
                yield _sse(encode({"id": self.response_id, "object": self._chunk_object(), "created": self.created,
                                   "model": self.model, "choices": [], "usage": self._usage()}))
            yield b"data: [DONE]\n\n"
        finally:
            self._finished(fan_in)

    def _usage(self) -> dict:
        completion = sum(len(choice.tokens) for choice in self.choices)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}

    def _logprobs(self, choice: Choice, tokens: list[int], values: list[float], tops: list,
                  streamed: bool = False) -> dict:
        """OpenAI's logprobs object of `tokens`: chat's content entries, each with its `top_logprobs` list, or
        completions' parallel lists, whose `top_logprobs` holds per token a dict of the likeliest tokens' text
        and the chosen one's (as vLLM gives it), and `text_offset` each token's first character in the choice's
        text. A completions choice that echoes its prompt with logprobs begins with the prompt's tokens (the
        first without a log-probability: null, as vLLM and OpenAI give it), in its first chunk when streamed."""
        decode = self._token_text
        tops = [top or ((), ()) for top in tops]
        if self.chat:
            def entry(token: int, value: float) -> dict:
                text = decode([token])
                return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8", "replace"))}

            return {"content": [{**entry(t, v), "top_logprobs": [entry(i, lp) for i, lp in zip(*top)]}
                                for t, v, top in zip(tokens, values, tops)]}
        entries = list(zip(tokens, values, tops))
        if self.echoes_logprobs and not streamed:
            entries = self._prompt_entries(choice) + entries
        texts = [decode([token]) for token, _, _ in entries]
        offsets = list(itertools.accumulate(map(len, texts[:-1]), initial=choice.offset)) if texts else []
        choice.offset += sum(map(len, texts))
        return {"tokens": texts, "token_logprobs": [value for _, value, _ in entries],
                "top_logprobs": [None if value is None else {**{decode([i]): lp for i, lp in zip(*top)}, text: value}
                                 for (_, value, top), text in zip(entries, texts)],
                "text_offset": offsets}

    def _prompt_entries(self, choice: Choice) -> list[tuple]:
        """(token, log-probability, (likeliest ids, theirs)) of each prompt token of `choice`, the request's
        `logprobs` likeliest of each; the first token's log-probability None (nothing precedes it)."""
        scores, count = choice.prompt_scores, self.body.logprobs
        return [(choice.prompt[0], None, ((), ()))] + [
            (token, value, (ids[:count], values[:count])) for token, value, ids, values in
            zip(choice.prompt[1:], scores.logprobs, scores.top_tokens, scores.top_logprobs)]

    def _prompt_logprobs(self, choice: Choice) -> dict:
        """{"prompt_logprobs": ...} where the request asks (vLLM's field; else {}): per prompt token None for the
        first, then a dict of the token and the request's `prompt_logprobs` likeliest at its position, each id ->
        {"logprob", "rank" (1: the likeliest), "decoded_token"}."""
        count, scores = self.body.prompt_logprobs, choice.prompt_scores
        if count is None or scores is None:
            return {}
        decode, entries = self._token_text, [None]
        for token, value, rank, ids, values in zip(choice.prompt[1:], scores.logprobs, scores.ranks,
                                                   scores.top_tokens, scores.top_logprobs):
            entry = {token: {"logprob": value, "rank": rank, "decoded_token": decode([token])}}
            for place, (other, other_value) in enumerate(zip(ids[:count], values[:count]), 1):
                entry.setdefault(other, {"logprob": other_value, "rank": place, "decoded_token": decode([other])})
            entries.append(entry)
        return {"prompt_logprobs": entries}

    def _token_text(self, ids: list[int]) -> str:
        """One token's text in a logprobs object: decoded, or `token_id:N` (`return_tokens_as_token_ids`)."""
        return f"token_id:{ids[0]}" if self.body.return_tokens_as_token_ids else self.serving.decode(ids)

    def _body(self) -> dict:
        choices = []
        for choice in self.choices:
            text, calls, reason = choice.outcome()
            logprobs = self._logprobs(choice, choice.tokens, choice.logprobs, choice.tops) \
                if choice.params.logprobs else None
            if self.chat:
                message = {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}
                choices.append({"index": choice.index, "message": message, "logprobs": logprobs,
                                "finish_reason": reason, "stop_reason": choice.stop_reason,
                                **self._ids("token_ids", choice.tokens)})
            else:
                choices.append({"index": choice.index, "text": text, "logprobs": logprobs, "finish_reason": reason,
                                "stop_reason": choice.stop_reason, **self._ids("prompt_token_ids", choice.prompt),
                                **self._ids("token_ids", choice.tokens), **self._prompt_logprobs(choice)})
        first = self.choices[0]
        prompt = {**self._ids("prompt_token_ids", first.prompt), **self._prompt_logprobs(first)} if self.chat else {}
        return {"id": self.response_id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": self._usage(), **prompt}

    def _ids(self, name: str, tokens: list[int]) -> dict:
        """{name: tokens} where the request asks for token ids (vLLM's `return_token_ids`: a choice's generated
        ids, and its prompt's, in a completions choice or at the top of a chat response or its first chunk)."""
        return {name: list(tokens)} if self.body.return_token_ids else {}

    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _chunk(self, choice: Choice, delta, finish_reason, logprobs=None) -> dict:
        stop_reason = choice.stop_reason if finish_reason is not None else None
        if self.chat:
            content = delta if isinstance(delta, dict) else {"content": delta}
            part = {"index": choice.index, "delta": content, "logprobs": logprobs, "finish_reason": finish_reason,
                    "stop_reason": stop_reason}
        else:
            part = {"index": choice.index, "text": delta, "logprobs": logprobs, "finish_reason": finish_reason,
                    "stop_reason": stop_reason}
        return {"id": self.response_id, "object": self._chunk_object(), "created": self.created,
                "model": self.model, "choices": [part]}


_HUNG_UP = "the client disconnected"


async def hang_up(request: Request, streams: list[RequestStream]) -> None:
    """Ends `streams` once the client of a whole (not streamed) response disconnects: one waiting task per
    request, no poll per token."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    for stream in streams:
        stream.fail(_HUNG_UP)


def _sse(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"
