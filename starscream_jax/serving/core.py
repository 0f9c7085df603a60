"""The engine loop, apart from HTTP: in a process of its own for a server (as vLLM's engine core and SGLang's
scheduler run), or on a thread where a test or a program holds the engine itself.

    API process (uvicorn, FastAPI)                    engine process
      tokenize, detokenize, stop strings,   ipc://     EngineCore.run():
      SSE / JSON, metrics                   ------>      take every queued message (submit, cancel, stop)
      EngineClient: one task receives       <------      one engine step (scheduler, compiled program)
      each step's outputs                                one StepOutputs message: every request's new tokens

What crosses per step is one MessagePack message holding each running request's new token ids, log-probabilities
and finish reason, and the engine's counters (`protocol.StepOutputs`); per request one `SubmitRequest` (its token
ids and sampling) and at most one `CancelRequests`. The engine process shares no interpreter lock with the HTTP
server, so no request's JSON, text or socket work can stall the thread that feeds the device.

`EngineProcess` starts the engine process with `multiprocessing`'s spawn method (a fresh interpreter: nothing of
the parent's JAX state is inherited, and `XLA_PYTHON_CLIENT_MEM_FRACTION` is set before JAX starts), waits for it to
load the model and compile its programs, and receives `protocol.EngineInfo` and the tokenizer over the start-up
pipe. A process of a mesh spanning several hosts that is not process 0 runs the leader's steps instead
(`multihost.follow`) and reports that it follows. Ctrl-C reaches the whole process group: the engine process
ignores it and lets the API process drain it.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from ..errors import StarscreamError
from . import protocol
from .multihost import follow

KEEP_ALIVE_S = 10.0
"""How often an idle engine loop tells the followers of a mesh spanning processes that it is alive: well within
the collectives' timeouts (40 s for the CPU's)."""
FLUSH_MS = 2000
"""How long closing the engine's output socket waits for its last messages to leave."""


class EngineCore:
    """Runs an engine (`serving.engine.Engine`, or any object with its submit / cancel / step / busy / stats /
    refused) against the API's sockets until told to stop (see the module docstring)."""

    def __init__(self, engine, addresses: protocol.Addresses):
        self.engine = engine
        self._context = zmq.Context()
        self._inputs = self._context.socket(zmq.PULL)
        self._inputs.connect(addresses.inputs)
        self._outputs = self._context.socket(zmq.PUSH)
        self._outputs.setsockopt(zmq.SNDHWM, 0)
        self._outputs.connect(addresses.outputs)
        self._encoder, self._decoder = protocol.encoder(), protocol.input_decoder()
        self._refused: list[protocol.RequestOutput] = []
        self._load_changed = False  # a cancel changed the load of an engine that has no step to run
        self.stopping = False

    def run(self) -> None:
        """The loop: messages, a step, its outputs; ends after a stop (once drained) or on an error, which it
        reports to the API as `EngineFailed` before raising it."""
        try:
            while True:
                self._receive(wait=not self.engine.busy and not self._refused)
                if self.engine.busy or self._refused or self._load_changed:
                    self._step()
                if self.stopping and not self.engine.busy:
                    return
        except Exception as err:
            self._outputs.send(self._encoder.encode(protocol.EngineFailed(f"{type(err).__name__}: {err}")))
            raise
        finally:
            self.engine.stop_followers()
            self._inputs.close(linger=0)
            self._outputs.close(linger=FLUSH_MS)
            self._context.term()

    def _step(self) -> None:
        """One engine step where it is busy, and a message of its outputs, refusals and load (also sent with no
        step: refusals, or the load after a cancel left it idle, so the API's gauges read 0)."""
        started = time.perf_counter()
        events = self.engine.step() if self.engine.busy else []
        refused = [refusal(request_id, "refused", why) for request_id, why in self.engine.refused()]
        outputs = self._refused + refused + [output_of(event) for event in events]
        self._refused, self._load_changed = [], False
        message = protocol.StepOutputs(outputs, self.engine.stats(), time.perf_counter() - started)
        self._outputs.send(self._encoder.encode(message), copy=False)

    def _receive(self, wait: bool) -> None:
        """Applies every queued message, waiting for one first when `wait` (while waiting, the followers of a mesh
        spanning processes hear from the leader every KEEP_ALIVE_S, so their wait in a collective never times
        out)."""
        while wait and not self._inputs.poll(KEEP_ALIVE_S * 1000):
            self.engine.keep_followers()
        while True:
            try:
                frame = self._inputs.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._handle(self._decoder.decode(frame))

    def _handle(self, message: protocol.EngineInput) -> None:
        if isinstance(message, protocol.SubmitRequest):
            try:
                if self.stopping:
                    raise StarscreamError("the server is shutting down; send the request to another one")
                self.engine.submit(message.request_id, message.prompt, message.params)
            except StarscreamError as err:
                reason = "unavailable" if self.stopping else "refused"
                self._refused.append(refusal(message.request_id, reason, str(err)))
        elif isinstance(message, protocol.CancelRequests):
            for request_id in message.request_ids:
                self.engine.cancel(request_id)
            self._load_changed = True
        else:
            self.stopping = True
            if not message.drain:
                for request_id in list(self.engine.running_ids()):
                    self.engine.cancel(request_id)


def output_of(event) -> protocol.RequestOutput:
    """An engine's `TokenEvent` as the message the API process reads: its token, its log-probability, its
    likeliest tokens and their log-probabilities as one entry per token (none without top_logprobs), and the
    prompt's log-probabilities where it carries them."""
    top_tokens, top_logprobs = ([list(event.top_tokens)], [list(event.top_logprobs)]) if event.top_tokens else ([], [])
    return protocol.RequestOutput(request_id=event.request_id, tokens=[event.token], logprobs=[event.logprob],
                                  finish_reason=event.finish_reason, queued_s=event.queued_s, top_tokens=top_tokens,
                                  top_logprobs=top_logprobs, prompt=event.prompt)


def refusal(request_id: str, reason: str, error: str) -> protocol.RequestOutput:
    """The one message of a request the engine did not take: no tokens, `reason` and why (`error`)."""
    return protocol.RequestOutput(request_id=request_id, tokens=[], logprobs=[], finish_reason=reason, error=error)


@dataclass(frozen=True, kw_only=True)
class ReadyEngine:
    """What an engine builder gives the loop: the engine, its tokenizer, and what the API needs to know of it;
    `follows` on a process of a multi-process mesh other than process 0, which runs that process' steps."""

    engine: object
    tokenizer: object = None
    info: protocol.EngineInfo | None = None
    follows: bool = False


def new_addresses() -> protocol.Addresses:
    """Fresh ipc:// endpoints: in Linux's abstract socket namespace (no file to leave behind, whatever ends the
    process), elsewhere in a fresh private directory."""
    if sys.platform.startswith("linux"):
        name = f"@starscream-{os.getpid()}-{uuid.uuid4().hex}"
    else:
        name = tempfile.mkdtemp(prefix="starscream-") + "/socket"
    return protocol.Addresses(f"ipc://{name}-inputs", f"ipc://{name}-outputs")


class EngineThread:
    """An engine loop on a thread of this process, for tests and programs that hold the engine themselves."""

    def __init__(self, engine):
        self.addresses = new_addresses()
        self.core = EngineCore(engine, self.addresses)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="starscream-engine", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.core.run()
        except Exception as err:  # already reported to the API as EngineFailed
            self.error = err

    def alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)


class EngineProcess:
    """The engine loop in a process of its own (see the module docstring). `build()` runs in that process: it
    loads the model and returns a `ReadyEngine`."""

    def __init__(self, build: Callable[[], ReadyEngine], memory_fraction: float | None = None):
        self.addresses = new_addresses()
        context = multiprocessing.get_context("spawn")
        self._pipe, child_end = context.Pipe(duplex=False)
        self.process = context.Process(target=_engine_main, name="starscream-engine", daemon=True,
                                       args=(build, self.addresses, child_end, memory_fraction, os.getpid()))

    def start(self) -> tuple[protocol.EngineInfo, object] | None:
        """Starts the process and waits until its engine is ready: (EngineInfo, tokenizer), or None when it only
        follows another process' steps. StarscreamError (its one line) when it could not start."""
        self.process.start()
        while not self._pipe.poll(0.2):
            if not self.process.is_alive():
                raise StarscreamError(f"the engine process exited with status {self.process.exitcode} while "
                                      "starting; its error is printed above")
        kind, payload = self._pipe.recv()
        if kind == "failed":
            self.process.join(10)
            raise StarscreamError(payload)
        return None if kind == "follower" else payload

    def alive(self) -> bool:
        return self.process.is_alive()

    def stop(self, timeout: float) -> int | None:
        """Waits up to `timeout` seconds for the process to end, then ends it; its exit status."""
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        return self.process.exitcode


def _engine_main(build, addresses: protocol.Addresses, pipe, memory_fraction: float | None, parent: int) -> None:
    """The engine process: build the engine, report it ready over `pipe`, run the loop (or follow); it ends with
    the process `parent` that started it, however that one ended."""
    exit_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if memory_fraction is not None:
        os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{memory_fraction:.3f}"
    try:
        ready = build()
    except StarscreamError as err:
        pipe.send(("failed", str(err)))
        sys.exit(2)
    except BaseException as err:
        traceback.print_exc()
        pipe.send(("failed", f"the engine failed to start: {type(err).__name__}: {err}"))
        sys.exit(1)
    if ready.follows:
        pipe.send(("follower", None))
        follow(ready.engine)
        return
    pipe.send(("ready", (ready.info, ready.tokenizer)))
    try:
        EngineCore(ready.engine, addresses).run()
    except Exception:
        traceback.print_exc()
        sys.exit(1)


PARENT_CHECK_S = 0.5
"""Seconds between the engine process' checks that the process that started it is still there."""


def exit_with_parent(parent: int) -> None:
    """Ends this process within PARENT_CHECK_S of process `parent` ending (this one then belongs to another
    parent), however it ended: killed, or stopped by a SIGTERM before the server installed its handlers, while the
    engine still loads or compiles. An engine left behind would hold the devices' memory and compile on."""
    def watch():
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK_S)
        os._exit(1)

    threading.Thread(target=watch, name="starscream-parent-watch", daemon=True).start()
