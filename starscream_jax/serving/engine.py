"""The serving engine: continuous batching of requests over a paged KV cache, placed by the layouts.

An `Engine` holds the parameters (placed once by the decode layout; the prefill layout stores them alike under the
starscream layouts, so nothing is copied between phases), one page pool per layer (`model.paged`), the scheduler
(`scheduler.Scheduler`) and the compiled paged steps (`steps.paged_step`, one per bucket, at most
`Buckets.programs()`). `step()` runs one scheduler plan: a prefill program for the planned prompt chunks under the
prefill layout, then a decode program for the decoding sequences under the decode layout, and returns each new
token as a `TokenEvent`. `EngineThread` runs steps on a thread of its own while requests come and go.

Memory: the pools hold 2 * L * K * pages * page_size * E values in the compute dtype, or in an 8-bit cache
(`EngineConfig.kv_format`) one byte each and a float32 scale per position and kv head (`Engine.pool_bytes`). The engine
reads the weights as stored: decode runs q, k, v and gate, up as separate GEMMs (`decoder._fuses`), so no fused copy
of any weight is held.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from ..errors import StarscreamError
from ..model.decoder import split_layer_weights
from ..model.paged import KERNELS, PAGES, SCALES, init_page_scales, init_pages
from ..model.quantize import WEIGHT_FORMATS, check_format, held_as_read
from ..sharding.apply import Placement, activation_spec, param_shardings, use_layout
from ..sharding.layouts import PHASE_DEFAULTS, get_layout
from .multihost import StepBroadcast
from .scheduler import Chunk, SamplingParams, Scheduler, SchedulerConfig, Sequence, check_fits
from .steps import Buckets, RowSampling, StepInputs, paged_step


KEEP_ALIVE_S = 10.0
"""How often an idle engine thread tells the followers of a mesh spanning processes that it is alive: well within
the collectives' timeouts (40 s for the CPU's)."""
STEPS_KEPT = 100_000
"""How many of the latest steps' (phase, rows, seconds) an engine keeps (`Engine.step_seconds`, for benchmarks)."""


@dataclass(frozen=True)
class EngineConfig:
    """page_size: positions per page; pages_per_shard: pages of each cache shard (one is its null page);
    rows_per_shard: most sequences a shard runs at once; token_budget: most tokens a step computes; chunk: most
    prompt tokens of one sequence per step; kernel: the paged decode attention (`model.paged.KERNELS`); buckets:
    the compiled shapes (default `Buckets.up_to` the limits: powers of two); prefix_caching: share full prompt pages
    by hash; kv_format: the pages' format, "" the compute dtype or an 8-bit one of `quantize.WEIGHT_FORMATS` (None:
    the model's `kv_format`, which `--kv-cache` sets)."""

    page_size: int = 16
    pages_per_shard: int = 256
    rows_per_shard: int = 16
    token_budget: int = 512
    chunk: int = 256
    kernel: str = "gather"
    buckets: Buckets | None = None
    prefix_caching: bool = True
    kv_format: str | None = None

    def __post_init__(self):
        if self.kernel not in KERNELS:
            raise StarscreamError(f"unknown paged-attention kernel {self.kernel!r}; choose one of {', '.join(KERNELS)}")
        if self.kv_format:
            check_format(self.kv_format, WEIGHT_FORMATS, "KV cache format")


@dataclass(frozen=True)
class TokenEvent:
    """A new token of request `request_id` ([its log-probability]); `finish_reason` "stop" (a stop token or string)
    or "length" (max_tokens or the context) on its last."""

    request_id: str
    token: int
    logprob: float
    finish_reason: str | None


@dataclass(frozen=True)
class EngineStats:
    """Counters of an engine: sequences running and waiting, pages held, prefix-cache look-ups and hits (full
    prompt pages), preemptions, programs compiled, tokens generated."""

    running: int
    waiting: int
    pages_used: int
    pages_total: int
    prefix_queried_pages: int
    prefix_hit_pages: int
    preemptions: int
    programs: int
    generated_tokens: int


def cache_shards(layout, mesh) -> int:
    """How many shards a layout splits the attention batch (and the page pool) into on `mesh` (1 without one)."""
    if mesh is None:
        return 1
    _, axes = get_layout(layout).activations.lookup("attn_batch")
    return math.prod(mesh.shape[axis] for axis in axes)


class Engine:
    """Continuous batching over a paged KV cache (see the module docstring)."""

    def __init__(self, model, config: EngineConfig = EngineConfig(), mesh=None,
                 prefill_layout=PHASE_DEFAULTS["prefill"], decode_layout=PHASE_DEFAULTS["decode"],
                 detokenize=None, channel: StepBroadcast | None = None):
        self.model_config = c = model.config
        self.kv_format = c.kv_format if config.kv_format is None else config.kv_format
        self.config = config
        self.mesh = mesh
        self.channel = channel  # a mesh spanning processes: the leader's broadcast of each step (`multihost`)
        self.layouts = {"prefill": get_layout(prefill_layout), "decode": get_layout(decode_layout)}
        self.shards = cache_shards(decode_layout, mesh)
        if mesh is not None:
            check_same_cache_placement(self.layouts, mesh, c, config, self.shards)
        max_pages = math.ceil(c.max_seq_len / config.page_size)
        self.buckets = config.buckets or Buckets.up_to(config.rows_per_shard, config.chunk, max_pages)
        _check_buckets(self.buckets, config)
        self.scheduler = Scheduler(SchedulerConfig(self.shards, config.pages_per_shard, config.page_size,
                                                   config.rows_per_shard, config.token_budget, config.chunk,
                                                   config.prefix_caching, self.buckets.rows_of("prefill")[-1]))
        self.graphdef, params, self.rest = nnx.split(model, nnx.Param, ...)
        params = held_as_read(params, c.dtype)  # float weights in the compute dtype, 8-bit ones as stored
        if mesh is not None:
            params = jax.device_put(params, param_shardings(params, self.layouts["decode"], mesh))
        self.params = split_layer_weights(params)  # the paged step runs the layers one after another
        self.pages = self._empty_pages()
        self._steps = {phase: paged_step(self.graphdef, config.kernel, decode=phase == "decode",
                                         under=None if mesh is None else Placement(self.layouts[phase], mesh))
                       for phase in ("prefill", "decode")}
        self._programs: dict[tuple, object] = {}
        self._sequences: dict[str, Sequence] = {}
        self._detokenize = detokenize
        self._seeds = np.random.default_rng()
        self._generated = self._preemptions = 0
        self.step_seconds: deque[tuple[str, int, float]] = deque(maxlen=STEPS_KEPT)  # (phase, rows, seconds)

    def _phase(self, phase: str):
        return use_layout(self.layouts[phase], self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def _empty_pages(self) -> dict:
        """Zeroed key and value page pools of every layer in the cache's format, placed by the decode layout (PAGES),
        and in an 8-bit cache their scales ("k_scale", "v_scale", SCALES)."""
        c, config = self.model_config, self.config
        shape = (c.n_kv_heads, config.pages_per_shard * self.shards, config.page_size, c.head_dim)
        sharding = scale_sharding = None
        if self.mesh is not None:
            with self._phase("decode"):
                sharding = NamedSharding(self.mesh, activation_spec(PAGES, shape, "kv pages"))
                scale_sharding = NamedSharding(self.mesh, activation_spec(SCALES, shape[:3], "kv page scales"))
        dtype = jnp.dtype(self.kv_format or c.dtype)
        pages = {name: init_pages(c.n_layers, *shape, dtype, sharding) for name in ("k", "v")}
        if self.kv_format:
            pages.update({name: init_page_scales(c.n_layers, *shape[:3], scale_sharding)
                          for name in ("k_scale", "v_scale")})
        return pages

    @property
    def pool_bytes(self) -> int:
        """Bytes the page pools hold over every device, in the stored dtype (and an 8-bit cache's scales)."""
        return sum(array.nbytes for array in jax.tree.leaves(self.pages))

    def submit(self, request_id: str, prompt: list[int], params: SamplingParams = SamplingParams()) -> None:
        """Queues a request; StarscreamError when its id is taken or it cannot fit the context or the cache."""
        if request_id in self._sequences:
            raise StarscreamError(f"request id {request_id!r} is already running; give each request its own id")
        check_fits(len(prompt), params.max_tokens, self.context)
        seed = params.seed if params.seed is not None else int(self._seeds.integers(2 ** 31))
        sequence = Sequence(request_id, [int(token) for token in prompt], params, seed, time.monotonic())
        self.scheduler.add(sequence)
        self._sequences[request_id] = sequence

    def cancel(self, request_id: str) -> bool:
        """Ends a request now, releasing its pages; False when it is not known (already finished)."""
        sequence = self._sequences.pop(request_id, None)
        if sequence is None:
            return False
        self.scheduler.finish(sequence)
        return True

    def use_prefix_caching(self, enabled: bool) -> None:
        """Turns prefix caching on or off (pages registered so far stay registered); only while idle."""
        if self.busy:
            raise StarscreamError("prefix caching can change only while no request is running or waiting")
        self.scheduler.config = dataclasses.replace(self.scheduler.config, prefix_caching=enabled)

    @property
    def context(self) -> int:
        """The most positions a sequence may reach: the model's max_seq_len, or less where the largest page bucket
        holds fewer."""
        return min(self.model_config.max_seq_len, self.buckets.pages[-1] * self.config.page_size)

    @property
    def busy(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    def stats(self) -> EngineStats:
        shards = self.scheduler.shards
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting), self.scheduler.pages_used,
                           sum(shard.pages - 1 for shard in shards),
                           sum(shard.stats.queried_pages for shard in shards),
                           sum(shard.stats.hit_pages for shard in shards),
                           self._preemptions, len(self._programs), self._generated)

    def step(self) -> list[TokenEvent]:
        """One scheduler plan run: prompt chunks prefilled, decoding sequences decoded; their new tokens."""
        plan = self.scheduler.schedule()
        self._preemptions += len(plan.preempted)
        events = []
        if plan.prefill:
            tokens, logprobs = self._run("prefill", list(plan.prefill))
            for chunk, token, logprob in zip(plan.prefill, tokens, logprobs):
                self.scheduler.computed(chunk)
                if chunk.last:
                    events.append(self._append(chunk.sequence, token, logprob))
        if plan.decode:
            chunks = [Chunk(sequence, sequence.length - 1, 1) for sequence in plan.decode]
            tokens, logprobs = self._run("decode", chunks)
            for chunk, token, logprob in zip(chunks, tokens, logprobs):
                chunk.sequence.computed += 1
                events.append(self._append(chunk.sequence, token, logprob))
        return events

    def generate(self, prompts: list[list[int]], params: SamplingParams = SamplingParams()) -> list[list[int]]:
        """Every prompt's generated tokens, all requests submitted at once and run to the end."""
        ids = [f"batch-{index}" for index in range(len(prompts))]
        for request_id, prompt in zip(ids, prompts):
            self.submit(request_id, prompt, params)
        outputs = {request_id: [] for request_id in ids}
        while self.busy:
            for event in self.step():
                outputs[event.request_id].append(event.token)
        return [outputs[request_id] for request_id in ids]

    def _append(self, sequence: Sequence, token: int, logprob: float) -> TokenEvent:
        sequence.generated.append(token)
        sequence.logprobs.append(logprob)
        self._generated += 1
        if sequence.first_token_time is None:
            sequence.first_token_time = time.monotonic()
        reason = self._finish_reason(sequence, token)
        if reason is not None:
            self._sequences.pop(sequence.request_id, None)
            self.scheduler.finish(sequence)
        return TokenEvent(sequence.request_id, token, logprob, reason)

    def _finish_reason(self, sequence: Sequence, token: int) -> str | None:
        params = sequence.params
        if token in params.stop_tokens:
            return "stop"
        if params.stop and self._detokenize is not None:
            text = self._detokenize(sequence.generated)
            if any(stop in text for stop in params.stop):
                return "stop"
        if len(sequence.generated) >= params.max_tokens or sequence.length >= self.context:
            return "length"
        return None

    def _run(self, phase: str, chunks: list[Chunk]) -> tuple[list[int], list[float]]:
        """One compiled step over `chunks` (rows grouped by shard, padded to the buckets), announced to the other
        processes first where the mesh spans several (`multihost`); each row's sampled token and log-probability,
        in the order of `chunks`."""
        inputs, rows = self._inputs(phase, chunks)
        if self.channel is not None:
            self.channel.send(phase, inputs)
        started = time.perf_counter()
        token_B, logprob_B = self.execute(phase, inputs)
        self.step_seconds.append((phase, len(chunks), time.perf_counter() - started))
        return [int(token_B[row]) for row in rows], [float(logprob_B[row]) for row in rows]

    def execute(self, phase: str, inputs: StepInputs) -> tuple[np.ndarray, np.ndarray]:
        """The compiled step of `phase` (compiled once per bucket) over host `inputs`, the pools updated in place;
        (tokens [B], log-probabilities [B]) on the host, gathered from every process where the mesh spans several.
        Every process of such a mesh runs it with the same inputs (`multihost.follow`)."""
        placed = self._placed(inputs)
        key = (phase, *inputs.tokens.shape, inputs.table.shape[1])
        with self._phase(phase):
            program = self._programs.get(key)
            if program is None:
                program = self._steps[phase].lower(self.params, self.rest, self.pages, placed).compile()
                self._programs[key] = program
            token_B, logprob_B, self.pages = program(self.params, self.rest, self.pages, placed)
        if jax.process_count() > 1:
            return tuple(multihost_utils.process_allgather((token_B, logprob_B), tiled=True))
        return np.asarray(token_B), np.asarray(logprob_B)

    def keep_followers(self) -> None:
        """Tells the other processes, waiting for the next step, that the leader is idle but alive (else nothing)."""
        if self.channel is not None:
            self.channel.idle()

    def stop_followers(self) -> None:
        """Ends the other processes' `multihost.follow` loops (leader of a mesh spanning processes; else nothing)."""
        if self.channel is not None:
            self.channel.stop()

    def _inputs(self, phase: str, chunks: list[Chunk]) -> tuple[StepInputs, list[int]]:
        """The padded step inputs for `chunks` (host arrays) and the row each chunk runs in."""
        by_shard = [[chunk for chunk in chunks if chunk.sequence.shard == shard] for shard in range(self.shards)]
        rows = Buckets.round_up(max(len(group) for group in by_shard), self.buckets.rows_of(phase), "rows per shard")
        width = 1 if phase == "decode" else Buckets.round_up(max(c.count for c in chunks), self.buckets.positions,
                                                             "prompt positions")
        pages = Buckets.round_up(max(len(c.sequence.pages) for c in chunks), self.buckets.pages, "pages per row")
        total = rows * self.shards
        tokens, positions = np.zeros((total, width), np.int32), np.full((total, width), -1, np.int32)
        table, last = np.zeros((total, pages), np.int32), np.zeros((total,), np.int32)
        temperature, top_p = np.zeros((total,), np.float32), np.ones((total,), np.float32)
        top_k, seed = np.zeros((total,), np.int32), np.zeros((total,), np.int32)
        where = {}
        for shard, group in enumerate(by_shard):
            for offset, chunk in enumerate(group):
                row, sequence = shard * rows + offset, chunk.sequence
                where[id(chunk)] = row
                tokens[row, :chunk.count] = sequence.token_slice(chunk.start, chunk.start + chunk.count)
                positions[row, :chunk.count] = np.arange(chunk.start, chunk.start + chunk.count)
                table[row, :len(sequence.pages)] = sequence.pages
                last[row] = chunk.count - 1
                params = sequence.params
                temperature[row], top_p[row], top_k[row] = params.temperature, params.top_p, params.top_k
                seed[row] = sequence.seed
        arrays = StepInputs(tokens, positions, table, last, RowSampling(temperature, top_p, top_k, seed))
        return arrays, [where[id(chunk)] for chunk in chunks]

    def _placed(self, inputs: StepInputs) -> StepInputs:
        """The step inputs on the devices, rows split as the attention batch (and the page pool) are."""
        if self.mesh is None:
            return jax.tree.map(jnp.asarray, inputs)
        _, axes = self.layouts["decode"].activations.lookup("attn_batch")
        rows = NamedSharding(self.mesh, PartitionSpec(axes or None))
        return jax.tree.map(lambda array: jax.make_array_from_callback(array.shape, rows, lambda at: array[at]),
                            inputs)


def _check_buckets(buckets: Buckets, config: EngineConfig) -> None:
    """The largest buckets must hold what the scheduler may plan: rows_per_shard decode rows, a whole chunk."""
    if buckets.rows[-1] < config.rows_per_shard or buckets.positions[-1] < config.chunk:
        raise StarscreamError(f"buckets of at most {buckets.rows[-1]} rows and {buckets.positions[-1]} positions "
                              f"cannot run {config.rows_per_shard} sequences per shard and chunks of {config.chunk}; "
                              "raise the largest buckets or lower rows_per_shard / chunk")


def check_same_cache_placement(layouts: dict, mesh, c, config: EngineConfig, shards: int) -> None:
    """The prefill and decode layouts must place the page pools alike (else every step would copy the cache)."""
    shape = (c.n_kv_heads, config.pages_per_shard * shards, config.page_size, c.head_dim)
    specs = {}
    for phase, layout in layouts.items():
        if layout.splits_sequence:
            raise StarscreamError(f"layout {layout.name} splits the sequence and cannot serve from a KV cache; prefill "
                                  f"with {PHASE_DEFAULTS['prefill']} and decode with {PHASE_DEFAULTS['decode']}")
        with use_layout(layout, mesh):
            specs[phase] = activation_spec(PAGES, shape, "kv pages")
    if specs["prefill"] != specs["decode"] or cache_shards(layouts["prefill"], mesh) != shards:
        raise StarscreamError(f"prefill layout {layouts['prefill'].name} places the KV pages as {specs['prefill']} and "
                              f"decode layout {layouts['decode'].name} as {specs['decode']}; serve with layouts that "
                              "place the cache alike (e.g. starscream_tp and starscream_decode)")


class EngineThread:
    """An engine stepping on a thread of its own. `submit` and `cancel` may be called from any thread; each request's
    events go to the callback given with it (called on the engine thread). `stop(drain=True)` lets running and
    waiting requests finish first."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._inbox: queue.Queue = queue.Queue()
        self._listeners: dict[str, object] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="starscream-engine", daemon=True)
        self.error: BaseException | None = None
        self.stats: EngineStats | None = None  # after the latest step, for readers on other threads
        self._thread.start()

    def submit(self, request_id: str, prompt: list[int], params: SamplingParams, listener) -> None:
        """Queues a request; `listener(event_or_error)` gets each TokenEvent, or the StarscreamError refusing it."""
        self._inbox.put(("submit", request_id, prompt, params, listener))

    def cancel(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id))

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        self._inbox.put(("stop", drain))
        self._thread.join(timeout)

    def _loop(self) -> None:
        try:
            while True:
                self._read_inbox(wait=not self.engine.busy)
                self.stats = self.engine.stats()
                if self._stopping.is_set() and not self.engine.busy:
                    return
                events = self.engine.step() if self.engine.busy else []
                self.stats = self.engine.stats()
                for event in events:
                    listener = self._listeners.get(event.request_id)
                    if event.finish_reason is not None:
                        self._listeners.pop(event.request_id, None)
                    if listener is not None:
                        listener(event)
        except Exception as err:  # the server reports it on /health and to every waiting client
            self.error = err
            for listener in self._listeners.values():
                listener(err)

    def _read_inbox(self, wait: bool) -> None:
        """Applies every queued message, waiting for one first when `wait` (while waiting, the followers of a mesh
        spanning processes hear from the leader every KEEP_ALIVE_S, so their wait in a collective never times
        out)."""
        while True:
            try:
                message = self._inbox.get(block=wait, timeout=KEEP_ALIVE_S if wait else None)
            except queue.Empty:
                if not wait:
                    return
                self.engine.keep_followers()
                continue
            wait = False
            self._handle(message)

    def _handle(self, message) -> None:
        kind = message[0]
        if kind == "submit":
            _, request_id, prompt, params, listener = message
            try:
                if self._stopping.is_set():
                    raise StarscreamError("the server is shutting down; send the request to another one")
                self.engine.submit(request_id, prompt, params)
                self._listeners[request_id] = listener
            except StarscreamError as err:
                listener(err)
        elif kind == "cancel":
            self.engine.cancel(message[1])
            self._listeners.pop(message[1], None)
        elif kind == "stop":
            self._stopping.set()
            if not message[1]:
                for request_id in list(self._listeners):
                    self.engine.cancel(request_id)
                self._listeners.clear()
