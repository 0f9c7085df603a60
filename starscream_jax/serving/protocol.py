"""What crosses between the API process and the engine process: typed messages, MessagePack on ZeroMQ sockets.

    API process  --EngineInput-->   engine process      (SubmitRequest, CancelRequests, StopEngine)
    API process  <--EngineOutput--  engine process      (StepOutputs once per step, EngineFailed once)

Messages are `msgspec.Struct`s (encoded as MessagePack: a step's outputs for 256 requests are a few KB and
encode in tens of microseconds, where pickle takes several times longer and accepts any object); the sockets are
ZeroMQ PUSH/PULL pairs over `ipc://` paths (no copy through the kernel's TCP stack, message framing and queueing
for free, asyncio support for the API side). `EngineInfo` is sent once, when the engine is ready, over the
process' start-up pipe, beside the tokenizer.
"""
from __future__ import annotations

import msgspec

from .scheduler import PromptLogprobs, SamplingParams


class SubmitRequest(msgspec.Struct, tag="submit", frozen=True):
    """A new request: its id (unique among running ones), prompt token ids and sampling."""

    request_id: str
    prompt: list[int]
    params: SamplingParams


class CancelRequests(msgspec.Struct, tag="cancel", frozen=True):
    """End these requests now (a client hung up, or a stop string was met): their pages are freed."""

    request_ids: list[str]


class StopEngine(msgspec.Struct, tag="stop", frozen=True):
    """Stop the engine loop: with `drain`, after every running and waiting request has finished."""

    drain: bool = True


EngineInput = SubmitRequest | CancelRequests | StopEngine


class RequestOutput(msgspec.Struct, array_like=True, frozen=True, kw_only=True):
    """What one request got in one step: its new token ids and their log-probabilities, the finish reason on its
    last ("stop": a stop token, "length": max_tokens or the context, "abort": cancelled), `error` when the engine
    refused it (nothing else follows), on its first output the seconds it waited before its first step (and, where
    the request asks, its prompt's log-probabilities), and for a request of `top_logprobs` each new token's
    likeliest ids and their log-probabilities (one list per token)."""

    request_id: str
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str | None = None
    error: str | None = None
    queued_s: float | None = None
    top_tokens: list[list[int]] = msgspec.field(default_factory=list)
    top_logprobs: list[list[float]] = msgspec.field(default_factory=list)
    prompt: PromptLogprobs | None = None


class EngineStats(msgspec.Struct, frozen=True, kw_only=True):
    """Counters of an engine after a step: sequences running and waiting, pages held and in all, prefix-cache
    look-ups and hits (full prompt pages), preemptions, programs compiled (in all, and since the warm-up), tokens
    generated. Built by keyword (`Engine.stats`)."""

    running: int
    waiting: int
    pages_used: int
    pages_total: int
    prefix_queried_pages: int
    prefix_hit_pages: int
    preemptions: int
    programs: int
    programs_after_start: int
    generated_tokens: int


class StepOutputs(msgspec.Struct, tag="step", frozen=True):
    """Every request's output of one step, the engine's load after it and the step's seconds on the engine."""

    outputs: list[RequestOutput]
    stats: EngineStats
    step_s: float


class EngineFailed(msgspec.Struct, tag="failed", frozen=True):
    """The engine loop stopped on an error: every running request fails with `message`, and nothing follows."""

    message: str


EngineOutput = StepOutputs | EngineFailed


class Addresses(msgspec.Struct, frozen=True):
    """The ZeroMQ endpoints: the engine's inputs (the API pushes) and outputs (the engine pushes)."""

    inputs: str
    outputs: str


class EngineInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What the API process needs to know of a ready engine: the context (most positions of a sequence), the
    vocabulary, the most sequences at once, the cache's pages and their size, the programs compiled at start, the
    model's name in the API, and whether it computes prompt log-probabilities (`EngineConfig.prompt_logprobs`)."""

    context: int
    vocab_size: int
    max_num_seqs: int
    pages_total: int
    page_size: int
    programs: int
    model_name: str = ""
    prompt_logprobs: bool = False


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def input_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(EngineInput)


def output_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(EngineOutput)
