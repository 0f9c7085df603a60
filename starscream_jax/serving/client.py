"""The API process' end of the engine: requests sent as messages, one message back per engine step, each request's
outputs handed to its own collector.

`EngineClient` binds the two ZeroMQ sockets of `protocol` (the engine connects to them), sends `SubmitRequest` and
`CancelRequests`, and runs one asyncio task that receives every `StepOutputs`, puts each request's output in its
`RequestStream` and passes the step to `on_step` (the metrics). A `RequestStream` merges everything its consumer
has not taken yet: a client that reads slowly gets several steps' tokens in one chunk, so a lagging stream costs
one wake-up, not one per token. When the engine fails (an `EngineFailed` message, or its process or thread gone)
every open stream ends with the error and every later request is refused (`failed`).
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from . import protocol
from .scheduler import PromptLogprobs, SamplingParams

WATCH_S = 0.5
"""How often the client checks that the engine's process (or thread) is still alive."""


@dataclass(kw_only=True)
class Delta:
    """What a stream's consumer takes at once: the tokens (and log-probabilities) of one or more steps, the finish
    reason once finished, the engine's refusal or failure, (in the first) the seconds it queued and the prompt's
    log-probabilities where the request asks, and with top_logprobs each token's likeliest ids and their
    log-probabilities."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_tokens: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    queued_s: float | None = None
    prompt: PromptLogprobs | None = None


class RequestStream:
    """One request's outputs as they arrive, merged until its consumer takes them."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self._delta = Delta()
        self._ready = asyncio.Event()
        self.done = False

    def put(self, output: protocol.RequestOutput) -> None:
        delta = self._delta
        delta.tokens += output.tokens
        delta.logprobs += output.logprobs
        delta.top_tokens += output.top_tokens
        delta.top_logprobs += output.top_logprobs
        delta.finish_reason = output.finish_reason or delta.finish_reason
        delta.error = output.error or delta.error
        delta.queued_s = output.queued_s if output.queued_s is not None else delta.queued_s
        delta.prompt = output.prompt or delta.prompt
        self.done = self.done or output.finish_reason is not None or output.error is not None
        self._ready.set()

    def fail(self, message: str) -> None:
        self._delta.error, self.done = message, True
        self._ready.set()

    async def take(self) -> Delta:
        """Everything that arrived since the last take (waits for something)."""
        await self._ready.wait()
        self._ready.clear()
        delta, self._delta = self._delta, Delta()
        return delta


class EngineClient:
    """Sends requests to an engine loop (`serving.core`) and collects its outputs (see the module docstring).
    `alive()` tells whether the engine's process or thread still runs; `on_step(StepOutputs)` is called once per
    step."""

    def __init__(self, addresses: protocol.Addresses, alive: Callable[[], bool],
                 on_step: Callable[[protocol.StepOutputs], None] = lambda step: None):
        self.addresses, self.alive, self.on_step = addresses, alive, on_step
        self.failed: str | None = None
        """Why the engine stopped, once it has (every request is then refused)."""
        self.load: protocol.EngineStats | None = None
        self._streams: dict[str, RequestStream] = {}
        self._tasks: list[asyncio.Task] = []
        self._stopping = False

    async def start(self) -> None:
        """Binds the sockets and starts receiving (call on the event loop that serves the requests)."""
        self._context = zmq.asyncio.Context()
        self._inputs = self._context.socket(zmq.PUSH)
        self._inputs.setsockopt(zmq.SNDHWM, 0)
        self._inputs.bind(self.addresses.inputs)
        self._outputs = self._context.socket(zmq.PULL)
        self._outputs.setsockopt(zmq.RCVHWM, 0)
        self._outputs.bind(self.addresses.outputs)
        self._encoder, self._decoder = protocol.encoder(), protocol.output_decoder()
        self._tasks = [asyncio.create_task(self._receive()), asyncio.create_task(self._watch())]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._inputs.close(linger=0)
        self._outputs.close(linger=0)
        self._context.term()

    @property
    def pending(self) -> int:
        """Requests sent and not yet finished."""
        return len(self._streams)

    def submit(self, request_id: str, prompt: list[int], params: SamplingParams) -> RequestStream:
        """Sends a request to the engine; its outputs arrive in the stream returned."""
        stream = RequestStream(request_id)
        if self.failed is not None:
            stream.fail(self.failed)
            return stream
        self._streams[request_id] = stream
        self._send(protocol.SubmitRequest(request_id, prompt, params))
        return stream

    def cancel(self, request_id: str) -> None:
        """Ends a request early (its consumer is gone or its text is complete); nothing more arrives for it."""
        if self._streams.pop(request_id, None) is not None and self.failed is None:
            self._send(protocol.CancelRequests([request_id]))

    async def stop(self, drain: bool, timeout: float) -> None:
        """Asks the engine loop to stop (after the running requests, with `drain`) and waits for it to end."""
        self._stopping = True
        if self.failed is None and self.alive():
            self._send(protocol.StopEngine(drain))
        deadline = asyncio.get_running_loop().time() + timeout
        while self.alive() and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)

    def _send(self, message) -> None:
        """Queues `message` for the engine at once (no high-water mark: the send never waits)."""
        self._inputs.send(self._encoder.encode(message), copy=False)

    async def _receive(self) -> None:
        while True:
            message = self._decoder.decode(await self._outputs.recv(copy=False))
            if isinstance(message, protocol.EngineFailed):
                self._fail(message.message)
                return
            self.load = message.stats
            for output in message.outputs:
                stream = self._streams.get(output.request_id)
                if stream is None:
                    continue  # cancelled here after the engine's step began
                stream.put(output)
                if stream.done:
                    del self._streams[output.request_id]
            self.on_step(message)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(WATCH_S)
            if not self.alive():
                if not self._stopping or self._streams:
                    self._fail("the engine stopped unexpectedly")
                return

    def _fail(self, message: str) -> None:
        if self.failed is None:
            self.failed = message
        for stream in self._streams.values():
            stream.fail(self.failed)
        self._streams.clear()
