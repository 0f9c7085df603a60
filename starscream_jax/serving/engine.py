"""The serving engine: continuous batching of requests over a paged KV cache, placed by the layouts.

An `Engine` holds the parameters (placed once by the decode layout; the prefill layout stores them alike under the
starscream layouts, so nothing is copied between phases), one page pool per layer (`model.paged`), the scheduler
(`scheduler.Scheduler`) and the compiled paged steps (`steps.forward_step` per bucket and `steps.sample_step` per bucket
of rows and combination of sampling passes, all compiled by `warm_up`). `step()` runs one scheduler plan: its prompt
chunks and its decoding sequences as one mixed step under the prefill layout (`steps.MixedInputs`: each weight read once
for both), or where it has only one kind, or a chunk asks for its prompt's log-probabilities
(`EngineConfig.prompt_logprobs`: a scored prefill runs alone), or `EngineConfig.mixed_chunks` is 0, a prefill step under
the prefill layout and a decode step under the decode layout; it returns each new token as a `TokenEvent`. A server runs
it in a process of its own (`serving.core`). A request with a grammar (structured output, `serving.guided`) has its
matcher compiled beside the loop and its allowed tokens written to its slot before each step that samples it; it sits
out a step while its last token is still on the device (`Sequence.held`). A request's allowed_token_ids are bits of the
same slot, written once (and intersected with its grammar's, if it has one); its bad words are matched in the step
against the tokens the step itself keeps per slot.

Memory: the pools hold 2 * L * K * pages * page_size * E values in the compute dtype, or in an 8-bit cache (the model's
`ModelConfig.kv_format`, which `--kv-cache` sets) one byte each and a float32 scale per position and kv head
(`Engine.pool_bytes`); their pages follow from the device memory left after the weights (`serving.capacity`) unless
given. The engine holds its own copy of the weights as inference reads them (`layer_weights.inference_split`): float
weights in the compute dtype, and on one device q, k, v stacked as one weight and gate, up as another, so that every
step runs each group as one GEMM; a caller that keeps the model keeps its arrays too, which the cache is then sized
around (the server hands over a model already stacked, `inference.loading.load_for_inference`).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
import os
import time
import warnings
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from ..errors import StarscreamError
from ..hardware.backend import policy_of
from ..model.decoder import attention_options
from ..model.layer_weights import inference_split, split_layer_weights
from ..model.paged import KERNELS, PAGES, SCALES, init_page_scales, init_pages, pool_shape, reads_in_place
from ..sharding.apply import UNPLACED, Placement, jit, param_shardings
from ..sharding.layouts import PHASE_DEFAULTS, get_layout
from . import capacity
from .multihost import StepBroadcast
from .protocol import EngineInfo, EngineStats
from .scheduler import (
    PENDING,
    Chunk,
    PromptLogprobs,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    Sequence,
    TokenEvent,
    check_fits,
)
from .guided import Guide, MaskBuilder, allowed_bits, grammar_tokenizer
from .sampling import SLOT_TABLE, SlotReset, SlotState, reset_slot, write_masks
from .buckets import Bucket, Buckets
from .steps import (
    LAYOUT_OF,
    SLOTS,
    MixedInputs,
    MixedPacked,
    PackedInputs,
    PromptScores,
    Sampled,
    SamplerFeatures,
    StepInputs,
    cache_shards,
    check_same_cache_placement,
    forward_step,
    sample_step,
)

COMPILE_WAIT_S = 0.05
"""How long an engine step with nothing to run waits for a grammar to compile before it returns."""
STEPS_KEPT = 100_000
"""How many of the latest steps' times an engine keeps (`Engine.step_times`, for benchmarks)."""


@dataclass(frozen=True, kw_only=True)
class StepTime:
    """One engine step: its prompt-chunk rows and decode rows, the forward programs it launched (1 for a mixed
    step), the seconds from the previous step's outputs (or its own launch, if later) to its own, the host's
    seconds to schedule it and build its inputs, and the seconds its program calls took to return (placing the
    inputs and enqueueing the programs; a call that waits for the device, where the runtime makes it wait, counts
    here, not as host work)."""

    prefill_rows: int
    decode_rows: int
    programs: int
    seconds: float
    host_seconds: float
    call_seconds: float


class _Token(NamedTuple):
    """A PENDING token: its sequence, its index in the sequence's `generated`, its row in the step's outputs, and
    "length" when it is the sequence's last whatever its value. (A tuple: one is made per row of every step.)"""

    sequence: Sequence
    index: int
    row: int
    reason: str | None


@dataclass(frozen=True)
class _Scored:
    """Prompt positions a scored prefill computes for a sequence: `count` of them from index `first` of step row
    `row` (positions chunk.start + first onwards)."""

    sequence: Sequence
    row: int
    first: int
    count: int


@dataclass(frozen=True, kw_only=True)
class _Rows:
    """One launched program: its prompt-chunk rows and decode rows in use, its outputs (`steps.Sampled.packed`
    [B, F] int32, then in a scored prefill `steps.PromptScores.packed` of `width` positions a row: on the devices, or
    on the host where a mesh spans processes), the PENDING tokens they hold and the prompt positions they score."""

    prefill_rows: int
    decode_rows: int
    outputs: jax.Array | np.ndarray
    tokens: list[_Token]
    call_seconds: float
    width: int = 1
    scores: list[_Scored] = dataclasses.field(default_factory=list)


@dataclass(frozen=True)
class _Launched:
    """One engine step whose outputs are not read yet: its programs, when it began, the seconds its launch took."""

    rows: list[_Rows]
    started: float
    launch_seconds: float

    def time(self, seconds: float) -> StepTime:
        calls = sum(r.call_seconds for r in self.rows)
        return StepTime(prefill_rows=sum(r.prefill_rows for r in self.rows),
                        decode_rows=sum(r.decode_rows for r in self.rows), programs=len(self.rows),
                        seconds=seconds, host_seconds=self.launch_seconds - calls, call_seconds=calls)


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """page_size: positions per page; pages_per_shard: pages of each cache shard (one is its null page; None: as
    many as `memory_utilization` of the device memory holds after the weights, `serving.capacity`);
    rows_per_shard: most sequences a shard runs at once; token_budget: most prompt tokens a step prefills; chunk: most
    prompt tokens of one sequence per step; kernel: the paged decode attention (`model.paged.KERNELS`; "": the
    backend policy's, `BackendPolicy.paged_attention`: cuDNN's paged kernel on NVIDIA GPUs); buckets:
    the compiled shapes (default `Buckets.for_limits` these limits); prefix_caching: share full prompt pages by
    hash; max_model_len: most positions of a sequence (None: the model's context); overlap: launch each step
    before reading the previous step's tokens, so the host's work runs while the device computes (on a mesh within
    one process; a mesh spanning processes reads each step's tokens at once, since every process must gather them
    in the same order as its steps); prompt_logprobs: serve requests that ask for their prompt's log-probabilities
    (`SamplingParams.prompt_logprobs`) with a scored prefill of each prefill bucket, compiled at start beside the
    others (`steps` says why at start); off, such a request is refused; mixed_chunks: most prompt chunks per cache
    shard of a step whose chunks and decode rows run as one program (`Buckets.mixed_chunks`, where the buckets do not
    name them: the prefill rows buckets below it and itself, each with each decode bucket, compiled at start); 0: two
    programs a step, each reading every weight. The KV pages' format is the model's (`ModelConfig.kv_format`)."""

    page_size: int = 16
    pages_per_shard: int | None = None
    rows_per_shard: int = 16
    token_budget: int = 512
    chunk: int = 256
    kernel: str = ""
    buckets: Buckets | None = None
    prefix_caching: bool = True
    max_model_len: int | None = None
    memory_utilization: float = 0.9
    overlap: bool = True
    prompt_logprobs: bool = False
    mixed_chunks: int = 1

    def __post_init__(self):
        for name in ("page_size", "pages_per_shard", "rows_per_shard", "token_budget", "chunk", "max_model_len"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise StarscreamError(f"EngineConfig {name} is {value!r}; give a whole number of at least 1")
        if self.chunk > self.token_budget:
            raise StarscreamError(f"EngineConfig chunk {self.chunk} exceeds token_budget {self.token_budget}: no step "
                                  f"could prefill a whole chunk; give a chunk of at most {self.token_budget} (--chunk) "
                                  "or a larger token budget (--max-num-batched-tokens)")
        if not isinstance(self.mixed_chunks, int) or isinstance(self.mixed_chunks, bool) or self.mixed_chunks < 0:
            raise StarscreamError(f"EngineConfig mixed_chunks is {self.mixed_chunks!r}; give a whole number of at "
                                  "least 0 (0: a step's prompt chunks and decode rows as two programs)")
        for name in ("prefix_caching", "overlap", "prompt_logprobs"):
            if not isinstance(getattr(self, name), bool):
                raise StarscreamError(f"EngineConfig {name} is {getattr(self, name)!r}; give True or False")
        if self.pages_per_shard is not None and self.pages_per_shard < 2:
            raise StarscreamError(f"EngineConfig pages_per_shard is {self.pages_per_shard}; a shard needs its null "
                                  "page and at least one more: give 2 or more (--cache-pages)")
        if not 0.0 < self.memory_utilization <= 1.0:
            raise StarscreamError(f"memory utilization {self.memory_utilization} is outside (0, 1]; give the "
                                  "fraction of device memory the server may use, such as 0.9")
        if self.kernel and self.kernel not in KERNELS:
            raise StarscreamError(f"unknown paged-attention kernel {self.kernel!r}; choose one of {', '.join(KERNELS)}")


class Engine:
    """Continuous batching over a paged KV cache (see the module docstring)."""

    def __init__(self, model, config: EngineConfig = EngineConfig(), mesh=None,
                 prefill_layout=PHASE_DEFAULTS["prefill"], decode_layout=PHASE_DEFAULTS["decode"],
                 channel: StepBroadcast | None = None):
        self.model_config = c = model.config
        self.kv_format = c.kv_format  # the cache's format travels on the model's configuration
        self.config = config = _held_rows(config)
        self.mesh = mesh
        self.channel = channel  # a mesh spanning processes: the leader's broadcast of each step (`multihost`)
        self.layouts = {"prefill": get_layout(prefill_layout), "decode": get_layout(decode_layout)}
        # each phase's layout on the mesh (None without one): its programs are bound to it (`sharding.apply.jit`),
        # and the host asks it where an array it places goes
        self._placements = {phase: None if mesh is None else Placement(layout, mesh)
                            for phase, layout in self.layouts.items()}
        self.shards = cache_shards(decode_layout, mesh)
        if mesh is not None:
            check_same_cache_placement(self.layouts, mesh, c, self.shards)
        if config.max_model_len is not None and config.max_model_len > c.max_seq_len:
            raise StarscreamError(f"max model length {config.max_model_len} exceeds model {c.name}'s context of "
                                  f"{c.max_seq_len} positions; give at most {c.max_seq_len} (--max-model-len)")
        self.max_model_len = _held_length(config, config.max_model_len or c.max_seq_len)
        max_pages = math.ceil(self.max_model_len / config.page_size)
        prefill_rows = min(config.rows_per_shard, math.ceil(config.token_budget / config.chunk))
        self.kernel = _paged_kernel(config.kernel, mesh)
        in_place = reads_in_place(self.kernel, self.kv_format or c.dtype, attention_options(c))
        buckets = config.buckets or Buckets.for_limits(config.rows_per_shard, config.chunk, max_pages, prefill_rows,
                                                       in_place)
        self.buckets = dataclasses.replace(buckets, scored=config.prompt_logprobs, mixed_chunks=_mixed_buckets(
            buckets, min(config.mixed_chunks, buckets.rows_of("prefill")[-1])))  # (no step holds more chunks)
        _check_buckets(self.buckets, config)
        # float weights in the compute dtype, 8-bit ones as stored, projections sharing an input stacked
        self.graphdef, params, self.rest = inference_split(model, mesh, c.dtype)
        if mesh is not None:
            params = jax.device_put(params, param_shardings(params, self.layouts["decode"], mesh))
        self.params = split_layer_weights(params)  # the paged step runs the layers one after another
        jax.block_until_ready(self.params)  # held before the cache is sized by what memory is left
        self.cache_size = self._cache_size(max_pages)
        self.scheduler = Scheduler(SchedulerConfig(
            shards=self.shards, pages_per_shard=self.cache_size.pages_per_shard, page_size=config.page_size,
            rows_per_shard=config.rows_per_shard, token_budget=config.token_budget, chunk=config.chunk,
            prefix_caching=config.prefix_caching, prefill_rows=self.buckets.rows_of("prefill")[-1]))
        self._pages = None  # allocated after the warm-up: XLA's autotuning wants free device memory to compile
        self._steps = {phase: forward_step(self.graphdef, self.kernel, decode=phase == "decode", under=under,
                                           eight_bit_weights=bool(c.weight_format))
                       for phase, under in self._placements.items()}
        self._sample = {phase: sample_step(under=under) for phase, under in self._placements.items()}
        self._programs: dict[Bucket, object] = {}  # a bucket (rows of all shards) -> its forward program
        self._samplers: dict[tuple, object] = {}  # `_sampler_key` -> its sampler
        self._compiled_at_start = 0
        self._sequences: dict[str, Sequence] = {}
        self._seeds = np.random.default_rng()
        self._generated = self._preemptions = 0
        self._recent = None  # the slot tokens (`steps.SLOTS`), allocated with the pools
        self._slot_state: SlotState | None = None  # penalties' counts, logit bias, stop ids per slot (`sampling`)
        self._slot_holders: dict[tuple[int, int], Sequence] = {}  # (shard, slot) -> the sequence it was last set for
        slot_placement = self._placements["decode"]  # the slot state is placed as decode's rows are
        self._reset = jit(functools.partial(reset_slot, placement=slot_placement or UNPLACED), under=slot_placement,
                          ambient=False, donate_argnums=(0,))
        self._write = jit(functools.partial(write_masks, placement=slot_placement or UNPLACED), under=slot_placement,
                          ambient=False, donate_argnums=(0,))
        slots = self.shards * config.rows_per_shard
        self.mask_rows = tuple(sorted({min(2 ** power, slots) for power in range(slots.bit_length() + 1)}))
        """How many slots one grammar-mask write holds (`write_masks`'s K), each bucket compiled at start."""
        self._grammar_tokenizer = None  # the model's tokenizer for structured output (`use_tokenizer`)
        self._masks: MaskBuilder | None = None
        self._compiler: concurrent.futures.ThreadPoolExecutor | None = None  # compiles grammars off the loop
        self._compiling: dict[str, tuple[Sequence, concurrent.futures.Future]] = {}
        self._refusals: list[tuple[str, str]] = []
        self._overlap = config.overlap and jax.process_count() == 1
        self._mixed = bool(self.buckets.mixed_chunks)  # `use_mixed_steps`
        self._in_flight: _Launched | None = None
        self._last_resolved = 0.0
        self.step_times: deque[StepTime] = deque(maxlen=STEPS_KEPT)

    def _cache_size(self, max_pages: int) -> capacity.CacheSize:
        """The pages of each cache shard: as configured, or from the device memory left after the weights."""
        c, config = self.model_config, self.config
        shardings, shapes, dtypes = self._pool_layout(1)
        page_bytes = capacity.page_bytes_per_device(shardings, shapes, dtypes)
        if config.pages_per_shard is not None:
            return capacity.CacheSize(pages_per_shard=config.pages_per_shard, why="as configured",
                                      pool_bytes_per_device=config.pages_per_shard * page_bytes, reserve_bytes=0)
        kv_heads = shardings[0].shard_shape(shapes[0][1])[PAGES.index("kv_heads")] if shardings[0] is not None \
            else c.n_kv_heads
        kv_width = kv_heads * c.head_dim
        reserve = capacity.step_reserve_bytes(
            tokens=self.buckets.rows_of("prefill")[-1] * self.buckets.positions[-1],
            rows=self.buckets.rows[-1], table_positions=max_pages * config.page_size, d_model=c.d_model,
            d_ff=c.d_ff, vocab=c.vocab_size, kv_width=kv_width, itemsize=jnp.dtype(c.dtype).itemsize,
            scored=config.prompt_logprobs,
            mixed_tokens=self.buckets.mixed_chunks[-1] * self.buckets.positions[-1] if self.buckets.mixed_chunks else 0)
        reserve += self._slot_state_bytes()  # allocated beside the pools
        floor = self.config.rows_per_shard * max_pages + 1
        return capacity.agreed(capacity.size_from_memory(capacity.local_devices_of(self.mesh), page_bytes, reserve,
                                                         config.memory_utilization, floor))

    def _pool_layout(self, pages_per_shard: int) -> tuple[list, list, list]:
        """(shardings, (layers, shape) and dtypes) of the key/value pools and of an 8-bit cache's scales, for
        `pages_per_shard` pages of each shard (shardings None without a mesh)."""
        c, config = self.model_config, self.config
        shape = pool_shape(pages_per_shard * self.shards, config.page_size, c.n_kv_heads, c.head_dim)
        sharding = scale_sharding = None
        if self.mesh is not None:
            decode = self._placements["decode"]
            sharding = decode.sharding(PAGES, shape, "kv pages")
            scale_sharding = decode.sharding(SCALES, shape[:3], "kv page scales")
        layers = 2 * c.n_layers  # a key and a value pool per layer
        shardings, shapes, dtypes = [sharding], [(layers, shape)], [jnp.dtype(self.kv_format or c.dtype)]
        if self.kv_format:
            shardings, shapes, dtypes = shardings + [scale_sharding], shapes + [(layers, shape[:3])], \
                dtypes + [jnp.dtype(jnp.float32)]
        return shardings, shapes, dtypes

    def _empty_pages(self) -> dict:
        """Zeroed key and value page pools of every layer in the cache's format, placed by the decode layout (PAGES),
        and in an 8-bit cache their scales ("k_scale", "v_scale", SCALES)."""
        c = self.model_config
        capacity.check_room(capacity.local_devices_of(self.mesh), self.cache_size)
        shardings, shapes, dtypes = self._pool_layout(self.cache_size.pages_per_shard)
        (_, shape), sharding, dtype = shapes[0], shardings[0], dtypes[0]
        pages = {name: init_pages(c.n_layers, shape, dtype, sharding) for name in ("k", "v")}
        if self.kv_format:
            pages.update({name: init_page_scales(c.n_layers, shape, shardings[1])
                          for name in ("k_scale", "v_scale")})
        return pages

    @property
    def pages(self) -> dict:
        """The page pools (`_empty_pages`), allocated on first use."""
        if self._pages is None:
            self._pages = self._empty_pages()
        return self._pages

    @pages.setter
    def pages(self, pools: dict) -> None:
        self._pages = pools

    @property
    def recent(self) -> jax.Array:
        """The newest token of each shard's slots [shards * rows_per_shard] int32 (`steps.SLOTS`), allocated on
        first use."""
        if self._recent is None:
            abstract = self._abstract_recent()
            self._recent = jnp.zeros(abstract.shape, abstract.dtype, device=abstract.sharding)
        return self._recent

    @property
    def slot_state(self) -> SlotState:
        """Per slot of every shard, what the step's penalties, logit bias and min_tokens read (`sampling.SlotState`,
        [shards * rows_per_shard, ...]), allocated on first use."""
        if self._slot_state is None:
            self._slot_state = SlotState.empty(self.shards * self.config.rows_per_shard, self.model_config.vocab_size,
                                               self._slot_sharding())
        return self._slot_state

    def _slot_sharding(self) -> NamedSharding | None:
        """The slot state's placement: a shard's slots on the devices of its rows (`sampling.SLOT_TABLE`)."""
        if self.mesh is None:
            return None
        shape = (self.shards * self.config.rows_per_shard, self.model_config.vocab_size)
        return self._placements["decode"].sharding(SLOT_TABLE, shape, "slot state")

    def _slot_state_bytes(self) -> int:
        """Bytes of the slot state on each device (its shard's slots, `sampling.SlotState`)."""
        return sum(math.prod(array.sharding.shard_shape(array.shape) if array.sharding is not None else array.shape)
                   * array.dtype.itemsize for array in jax.tree.leaves(self._abstract_slot_state()))

    def _abstract_slot_state(self) -> SlotState:
        return SlotState.abstract(self.shards * self.config.rows_per_shard, self.model_config.vocab_size,
                                  self._slot_sharding())

    def _abstract_recent(self) -> jax.ShapeDtypeStruct:
        shape = (self.shards * self.config.rows_per_shard,)
        sharding = None
        if self.mesh is not None:
            sharding = self._placements["decode"].sharding(SLOTS, shape, "slot tokens")
        return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)

    def _abstract_pages(self) -> dict:
        """The page pools' shapes, types and placement, for compiling before they are allocated."""
        c = self.model_config
        shardings, shapes, dtypes = self._pool_layout(self.cache_size.pages_per_shard)
        names = (("k", "v"), ("k_scale", "v_scale"))
        return {name: tuple(jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for _ in range(c.n_layers))
                for kinds, sharding, (_, shape), dtype in zip(names, shardings, shapes, dtypes) for name in kinds}

    @property
    def pool_bytes(self) -> int:
        """Bytes the page pools hold over every device, in the stored dtype (and an 8-bit cache's scales)."""
        return sum(math.prod(pool.shape) * pool.dtype.itemsize for pool in jax.tree.leaves(self._abstract_pages()))

    def submit(self, request_id: str, prompt: list[int], params: SamplingParams = SamplingParams()) -> None:
        """Queues a request; StarscreamError when its id is taken, a token id is outside the vocabulary, or it
        cannot fit the context or the cache."""
        if request_id in self._sequences:
            raise StarscreamError(f"request id {request_id!r} is already running; give each request its own id")
        if not isinstance(params, SamplingParams):
            raise StarscreamError(f"params is a {type(params).__name__}; pass a serving.scheduler.SamplingParams")
        tokens = [int(token) for token in prompt]
        vocab = self.model_config.vocab_tokens
        outside = next((token for token in tokens if not 0 <= token < vocab), None)
        if outside is not None:
            raise StarscreamError(f"prompt token id {outside} is outside the model's vocabulary of {vocab}; give ids "
                                  f"from 0 to {vocab - 1}")
        check_fits(len(tokens), params.max_tokens, self.context)
        if params.prompt_logprobs is not None and not self.config.prompt_logprobs:
            raise StarscreamError("prompt_logprobs: this engine does not compute prompt log-probabilities; start it "
                                  "with EngineConfig prompt_logprobs (the server's --enable-prompt-logprobs)")
        self._check_ids(params)
        self._check_grammar(params)
        seed = params.seed if params.seed is not None else int(self._seeds.integers(2 ** 31))
        sequence = Sequence(request_id=request_id, prompt=tokens, params=params, seed=seed, arrival=time.monotonic())
        if params.prompt_logprobs is not None:
            sequence.prompt_scores = PromptLogprobs(logprobs=[], ranks=[], top_tokens=[], top_logprobs=[])
        self.scheduler.add(sequence)
        self._sequences[request_id] = sequence
        if params.grammar is not None:  # compiled off the loop; the sequence waits for it (`_take_compiled`)
            sequence.compiling = True
            self._compiling[request_id] = (sequence, self._compiler.submit(Guide, self._grammar_tokenizer,
                                                                           params.grammar))

    def use_tokenizer(self, tokenizer) -> None:
        """Serves structured output with `tokenizer` (the model's: `serving.guided.grammar_tokenizer`); until then a
        request with a grammar is refused."""
        self._grammar_tokenizer = grammar_tokenizer(tokenizer, self.model_config.vocab_size)
        self._masks = MaskBuilder(self.model_config.vocab_size)
        self._compiler = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="starscream-grammar")

    def _check_grammar(self, params: SamplingParams) -> None:
        """StarscreamError for a grammar this engine cannot serve (no tokenizer was given to it)."""
        if params.grammar is not None and self._grammar_tokenizer is None:
            raise StarscreamError(f"{params.grammar.field}: this engine serves no structured output (no tokenizer "
                                  "was given to it: Engine.use_tokenizer)")

    def _take_compiled(self) -> None:
        """Hands each grammar compiled since the last step to its sequence (`guided.Guide`), which may then be
        admitted; a grammar that failed to compile ends its request, refused (`refused`). When the queue's head
        waits for its grammar and nothing runs, waits up to COMPILE_WAIT_S for one (the loop would spin)."""
        if not self._compiling:
            return
        waiting = self.scheduler.waiting
        if waiting and waiting[0].compiling and not self.scheduler.running and self._in_flight is None:
            concurrent.futures.wait([future for _, future in self._compiling.values()], timeout=COMPILE_WAIT_S,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        for request_id, (sequence, future) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[request_id]
            if self._sequences.get(request_id) is not sequence:
                continue  # cancelled meanwhile
            try:
                sequence.guide = future.result()
            except StarscreamError as err:
                self.cancel(request_id)
                self._refusals.append((request_id, str(err)))
            sequence.compiling = False

    def refused(self) -> list[tuple[str, str]]:
        """(request id, why) of each request refused since the last call after it was submitted (a grammar that
        failed to compile against the tokenizer); it is no longer running."""
        refusals, self._refusals = self._refusals, []
        return refusals

    def _check_ids(self, params: SamplingParams) -> None:
        """StarscreamError naming the setting for a logit_bias, allowed_token_ids or bad_words id outside the
        vocabulary."""
        vocab = self.model_config.vocab_tokens
        for field, ids in (("logit_bias", [token for token, _ in params.logit_bias]),
                           ("allowed_token_ids", params.allowed_token_ids),
                           ("bad_words", [token for word in params.bad_words for token in word])):
            outside = next((token for token in ids if not 0 <= token < vocab), None)
            if outside is not None:
                raise StarscreamError(f"{field} token id {outside} is outside the model's vocabulary of {vocab}; "
                                      f"give ids from 0 to {vocab - 1}")

    def reset_slot(self, reset: SlotReset) -> None:
        """Writes one slot's state (`sampling.reset_slot`, in place), in order before the steps launched after it;
        every process of a mesh spanning several runs it (the leader announces it first, `multihost`)."""
        if self.mesh is not None and jax.process_count() > 1:
            everywhere = NamedSharding(self.mesh, PartitionSpec())
            reset = jax.tree.map(lambda array: jax.make_array_from_callback(array.shape, everywhere,
                                                                            lambda at: array[at]), reset)
        self._slot_state = self._reset(self.slot_state, reset)

    def cancel(self, request_id: str) -> bool:
        """Ends a request now, releasing its pages; False when it is not known (already finished)."""
        sequence = self._sequences.pop(request_id, None)
        if sequence is None:
            return False
        self.scheduler.finish(sequence)
        return True

    def use_mixed_steps(self, enabled: bool) -> None:
        """Turns mixed steps on or off from the next step on (a benchmark compares both on one engine); on needs
        the mixed programs compiled (`EngineConfig.mixed_chunks`)."""
        if enabled and not self.buckets.mixed_chunks:
            raise StarscreamError("this engine compiled no mixed steps (EngineConfig mixed_chunks=0, --mixed-chunks "
                                  "0); build it with mixed_chunks of 1 or more to run them")
        self._mixed = enabled

    def use_prefix_caching(self, enabled: bool) -> None:
        """Turns prefix caching on or off (pages registered so far stay registered); only while idle."""
        if self.busy:
            raise StarscreamError("prefix caching can change only while no request is running or waiting")
        self.scheduler.config = dataclasses.replace(self.scheduler.config, prefix_caching=enabled)

    @property
    def samplers(self) -> int:
        """How many samplers are compiled (`steps.sample_step`: one per bucket of rows and combination of passes)."""
        return len(self._samplers)

    @functools.cached_property
    def context(self) -> int:
        """The most positions a sequence may reach: the max model length, or less where the largest page bucket
        holds fewer (both fixed at construction; read for every row a step launches)."""
        return min(self.max_model_len, self.buckets.pages[-1] * self.config.page_size)

    def info(self) -> EngineInfo:
        """What the API process needs to know of this engine (`protocol.EngineInfo`)."""
        return EngineInfo(context=self.context, vocab_size=self.model_config.vocab_tokens,
                          max_num_seqs=self.config.rows_per_shard * self.shards,
                          pages_total=(self.cache_size.pages_per_shard - 1) * self.shards,
                          page_size=self.config.page_size, programs=len(self._programs),
                          model_name=self.model_config.name, prompt_logprobs=self.config.prompt_logprobs)

    def running_ids(self) -> list[str]:
        """The ids of every request running or waiting."""
        return list(self._sequences)

    @property
    def busy(self) -> bool:
        """Whether a request runs or waits, or a launched step holds a token of a request not yet ended."""
        return bool(self.scheduler.running or self.scheduler.waiting or self._in_flight is not None and any(
            self._sequences.get(token.sequence.request_id) is token.sequence
            for rows in self._in_flight.rows for token in rows.tokens))

    def stats(self) -> EngineStats:
        shards = self.scheduler.shards
        return EngineStats(running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
                           pages_used=self.scheduler.pages_used, pages_total=sum(shard.pages - 1 for shard in shards),
                           prefix_queried_pages=sum(shard.stats.queried_pages for shard in shards),
                           prefix_hit_pages=sum(shard.stats.hit_pages for shard in shards),
                           preemptions=self._preemptions, programs=len(self._programs),
                           programs_after_start=len(self._programs) + len(self._samplers) - self._compiled_at_start,
                           generated_tokens=self._generated)

    def step(self) -> list[TokenEvent]:
        """One scheduler plan launched (prompt chunks prefilled, decoding sequences decoded), then the new tokens of
        the step launched before it, read while this one runs (with `EngineConfig.overlap`; else this step's own).
        A sequence that the earlier step's token ends (a stop token) may have run one wasted row in this step; a
        sequence its length ends is finished when its last row launches."""
        started = time.perf_counter()
        self._take_compiled()
        plan = self.scheduler.schedule()
        self._preemptions += len(plan.preempted)
        for chunk in plan.prefill:
            if chunk.sequence.scheduled_at is None:
                chunk.sequence.scheduled_at = started
        launched = []
        decode = [Chunk(s, s.length - 1, 1) for s in plan.decode]
        scored = any(_scored_span(chunk) for chunk in plan.prefill)
        if plan.prefill and decode and self._mixed and not scored and self._chunks_fit_mixed(plan.prefill):
            launched.append(self._launch("mixed", list(plan.prefill), decode))
        else:
            if plan.prefill:
                launched.append(self._launch("scored" if scored else "prefill", list(plan.prefill), []))
            if decode:
                launched.append(self._launch("decode", [], decode))
        step = _Launched(launched, started, time.perf_counter() - started) if launched else None
        events = self._resolve(self._in_flight) if self._in_flight is not None else []
        self._in_flight = step
        if step is not None and (not self._overlap or self._only_guided()):
            events += self._resolve(step)
            self._in_flight = None
        return events

    def _chunks_fit_mixed(self, chunks: list[Chunk]) -> bool:
        """Whether every shard's prompt chunks fit the largest mixed step (`Buckets.mixed_chunks`); a step of more
        runs its chunks and its decode rows as two programs (many chunks make a step bound by its matmuls, where a
        second read of the weights costs little)."""
        per_shard = [0] * self.shards
        for chunk in chunks:
            per_shard[chunk.sequence.shard] += 1
        return max(per_shard) <= self.buckets.mixed_chunks[-1]

    def _only_guided(self) -> bool:
        """Whether every running sequence is guided and none waits: the next step could launch nothing before
        this one's tokens are read (each would sit out, `Sequence.held`), so they are read at once."""
        return not self.scheduler.waiting and all(s.guide is not None for s in self.scheduler.running)

    def generate(self, prompts: list[list[int]],
                 params: SamplingParams | list[SamplingParams] = SamplingParams()) -> list[list[int]]:
        """Every prompt's generated tokens, all requests submitted at once and run to the end; `params` for every
        prompt, or one each."""
        ids = [f"batch-{index}" for index in range(len(prompts))]
        each = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(each) != len(prompts):
            raise StarscreamError(f"{len(each)} SamplingParams for {len(prompts)} prompts; give one, or one each")
        try:
            for request_id, prompt, asked in zip(ids, prompts, each):
                self.submit(request_id, prompt, asked)
        except StarscreamError:
            for request_id in ids:  # none of the batch runs: the engine is left as it was
                self.cancel(request_id)
            raise
        outputs = {request_id: [] for request_id in ids}
        while self.busy:
            for event in self.step():
                outputs[event.request_id].append(event.token)
        return [outputs[request_id] for request_id in ids]

    def _launch(self, phase: str, prefill: list[Chunk], decode: list[Chunk]) -> _Rows:
        """One compiled step of `phase` over the prompt chunks `prefill` and the decode rows `decode` launched
        (announced to the other processes first where the mesh spans several, `multihost`); each chunk that ends
        its prompt, and each decode row, gets a PENDING token, and a sequence that token brings to its length limit
        is finished now."""
        inputs, rows = self._mixed_inputs(prefill, decode) if phase == "mixed" else \
            self._inputs(phase, prefill or decode)
        scores = self._scored(prefill, rows) if phase == "scored" else []
        if self.channel is not None:
            self.channel.send(phase, inputs)
        called = time.perf_counter()
        outputs = self.dispatch(phase, inputs)
        call_seconds = time.perf_counter() - called
        if jax.process_count() > 1:  # every process gathers right after the step, as `multihost.follow` does
            outputs = self._gathered(outputs)
        tokens = []
        for chunk, row in zip(prefill, rows):
            self.scheduler.computed(chunk)
            if chunk.last:
                tokens.append(self._pending(chunk.sequence, row))
        for chunk, row in zip(decode, rows[len(prefill):]):
            chunk.sequence.computed += 1
            tokens.append(self._pending(chunk.sequence, row))
        width = inputs.tokens.shape[1] if phase == "scored" else 1
        return _Rows(prefill_rows=len(prefill), decode_rows=len(decode), outputs=outputs, tokens=tokens,
                     call_seconds=call_seconds, width=width, scores=scores)

    @staticmethod
    def _scored(chunks: list[Chunk], rows: list[int]) -> list[_Scored]:
        """The prompt positions a scored prefill computes for each chunk that asks (`_scored_span`), each sequence's
        `scored` moved past them (a position is scored once, though a preempted prompt is computed again)."""
        scores = []
        for chunk, row in zip(chunks, rows):
            span = _scored_span(chunk)
            if span is not None:
                scores.append(_Scored(chunk.sequence, row, span.start - chunk.start, len(span)))
                chunk.sequence.scored = span.stop
        return scores

    def _pending(self, sequence: Sequence, row: int) -> _Token:
        """A PENDING token appended to `sequence` for step row `row`; the sequence finished at once (its pages and
        slot released) when this token reaches max_tokens or the context, whatever its value."""
        sequence.generated.append(PENDING)
        sequence.logprobs.append(0.0)
        sequence.pending += 1
        at_length = len(sequence.generated) >= sequence.params.max_tokens or sequence.length >= self.context
        if at_length:
            self.scheduler.finish(sequence)
        return _Token(sequence, len(sequence.generated) - 1, row, "length" if at_length else None)

    def _resolve(self, step: _Launched) -> list[TokenEvent]:
        """The tokens of a launched step read from the device (waiting for it) and written into their sequences;
        their events, in launch order. A sequence cancelled or stopped since yields none."""
        events = []
        for rows in step.rows:
            outputs = np.asarray(rows.outputs)
            if rows.scores:
                self._read_scores(rows.scores, PromptScores.unpacked(outputs, rows.width))
            sampled = Sampled.unpacked(outputs)
            tokens, logprobs = sampled.token.tolist(), sampled.logprob.tolist()
            for token in rows.tokens:
                top = token.sequence.params.top_logprobs
                event = self._arrived(token, tokens[token.row], logprobs[token.row],
                                      tuple(sampled.top_token[token.row, :top].tolist()) if top else (),
                                      tuple(sampled.top_logprob[token.row, :top].tolist()) if top else ())
                if event is not None:
                    events.append(event)
        now = time.perf_counter()
        seconds = now - max(step.started, self._last_resolved)
        self._last_resolved = now
        self.step_times.append(step.time(seconds))
        return events

    def _read_scores(self, scored: list[_Scored], scores: PromptScores) -> None:
        """Each sequence's prompt positions of a scored step appended to its `prompt_scores` (its own
        `prompt_logprobs` likeliest tokens of each); a sequence cancelled since takes none."""
        for entry in scored:
            sequence, kept = entry.sequence, entry.sequence.prompt_scores
            if self._sequences.get(sequence.request_id) is not sequence:
                continue
            at, top = (entry.row, slice(entry.first, entry.first + entry.count)), sequence.params.prompt_logprobs
            kept.logprobs.extend(scores.logprob[at].tolist())
            kept.ranks.extend(scores.rank[at].tolist())
            kept.top_tokens.extend(scores.top_token[at][:, :top].tolist())
            kept.top_logprobs.extend(scores.top_logprob[at][:, :top].tolist())

    def _arrived(self, pending: _Token, token: int, logprob: float, top_tokens: tuple[int, ...] = (),
                 top_logprobs: tuple[float, ...] = ()) -> TokenEvent | None:
        """A PENDING token's value: stored, and the sequence finished on a stop token; its event, None when the
        sequence was cancelled or finished by an earlier token."""
        sequence = pending.sequence
        if self._sequences.get(sequence.request_id) is not sequence:
            return None
        sequence.generated[pending.index], sequence.logprobs[pending.index] = token, logprob
        sequence.pending -= 1
        self._generated += 1
        reason = "stop" if token in sequence.params.stop_tokens or self._grammar_ended(sequence, token) \
            else pending.reason
        if reason is not None:
            self._sequences.pop(sequence.request_id)
            self.scheduler.finish(sequence)
        queued = sequence.scheduled_at - sequence.arrival if pending.index == 0 else None
        return TokenEvent(request_id=sequence.request_id, token=token, logprob=logprob, finish_reason=reason,
                          queued_s=queued, top_tokens=top_tokens, top_logprobs=top_logprobs,
                          prompt=sequence.prompt_scores if pending.index == 0 else None)

    @staticmethod
    def _grammar_ended(sequence: Sequence, token: int) -> bool:
        """Advances a guided sequence's matcher by its new token; True once its grammar takes no more (it ended,
        or took an EOS id). A token the grammar refuses (the mask was not applied: never expected) ends it too,
        with a warning."""
        guide = sequence.guide
        if guide is None:
            return False
        if not guide.advance(token):
            warnings.warn(f"request {sequence.request_id}: token {token} is outside its grammar ({guide.error}); "
                          "the request ends here", RuntimeWarning, stacklevel=2)
            return True
        return guide.finished

    def execute(self, phase: str, inputs: StepInputs | MixedInputs) -> Sampled:
        """The compiled step of `phase` over host `inputs`, the pools, slot tokens and slot state updated in place;
        its `Sampled` (tokens [B], log-probabilities [B], the likeliest tokens [B, K]) on the host, gathered from
        every process where the mesh spans several. Every process of such a mesh runs it with the same inputs
        (`multihost.follow`)."""
        outputs = self.dispatch(phase, inputs)
        return Sampled.unpacked(self._gathered(outputs) if jax.process_count() > 1 else np.asarray(outputs))

    def dispatch(self, phase: str, inputs: StepInputs | MixedInputs) -> jax.Array:
        """The compiled step launched (not waited for): its forward program, then its sampler with the passes the
        rows need (`SamplerFeatures.of`); the `Sampled.packed` outputs [B, F] on the devices, their copy to the host
        begun."""
        forward = self.program(phase, inputs)
        sampler = self._sampler(phase, inputs, forward, inputs.features())
        logits, rows, self.pages, scores = forward(self.params, self.rest, self.pages, self.recent,
                                                   self._placed(inputs))
        outputs, self._recent, self._slot_state = sampler(logits, rows, self.recent, self.slot_state, scores)
        if jax.process_count() == 1:
            outputs.copy_to_host_async()
        return outputs

    @staticmethod
    def _gathered(outputs: jax.Array) -> np.ndarray:
        return np.asarray(multihost_utils.process_allgather(outputs, tiled=True))

    def warm_up(self, progress=None, threads: int | None = None) -> int:
        """Compiles the forward program of every bucket (`Buckets.shapes`) and after each the sampler of every
        combination of passes (`SamplerFeatures.every`) now, so that no request waits for a compile: traced one
        after another (tracing reads the active layout), compiled by `threads` threads at once (XLA compiles outside
        Python's lock; default: the CPU cores, at most 8); `progress(done, total)` before the first and after
        each. Then allocates the page pools. Returns the forward programs compiled. On a mesh spanning processes
        every process calls it (each process compiles the programs it runs)."""
        shapes, samplers = self._start_programs()
        total = len(shapes) + len(samplers)
        lowered = {key: self._lowered(key) for key in shapes if key not in self._programs}
        samplers = {key: shape for key, shape in samplers.items() if key not in self._samplers}
        done = total - len(lowered) - len(samplers)
        if progress is not None:
            progress(done, total)  # the whole count first: a bar's total holds the samplers from the start
        workers = threads or min(8, os.cpu_count() or 1)

        def compile_all(programs: dict, into: dict) -> None:
            nonlocal done
            futures = {pool.submit(program.compile): key for key, program in programs.items()}
            for future in concurrent.futures.as_completed(futures):
                into[futures[future]] = future.result()
                done += 1
                if progress is not None:
                    progress(done, total)

        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="starscream-compile") as pool:
            compile_all(lowered, self._programs)  # the samplers are traced against the forward programs' outputs
            compile_all({key: self._lowered_sampler(bucket, self._programs[bucket], key[-1])
                         for key, bucket in samplers.items()}, self._samplers)
        self._compiled_at_start = len(self._programs) + len(self._samplers)
        if self.cache_size.reserve_bytes:
            capacity.check_reserve({**self._programs, **self._samplers}, self.cache_size.reserve_bytes)
        self.reset_slot(SlotReset.of(-1, self.model_config.vocab_size, [], []))
        for rows in self.mask_rows:  # (writes of no slot: each mask bucket compiled now)
            self.write_masks(np.full(rows, -1, np.int32), np.zeros((rows, self.slot_state.allowed.shape[1]), np.int32))
        jax.block_until_ready((self.pages, self.recent, self.slot_state))  # (a reset of no slot: compiled now)
        return len(shapes)

    def program(self, phase: str, inputs: StepInputs | MixedInputs):
        """The compiled forward program of `phase` that `inputs` run on: its bucket's (`buckets.Bucket`, rows of all
        shards), compiled on first use."""
        key = Bucket.of(phase, inputs)
        program = self._programs.get(key)
        if program is None:
            program = self._programs[key] = self._lowered(key).compile()
        return program

    def programs_at_start(self) -> int:
        """How many programs `warm_up` compiles: the forward program of every bucket and their samplers."""
        return sum(map(len, self._start_programs()))

    def _start_programs(self) -> tuple[list[Bucket], dict[tuple, Bucket]]:
        """(the forward programs' buckets (rows of all shards), {`_sampler_key`: the bucket it follows}) of every
        bucket (`Buckets.shapes`) and combination of passes (`SamplerFeatures.every`)."""
        shapes = [bucket.of_shards(self.shards) for bucket in self.buckets.shapes()]
        return shapes, {_sampler_key(bucket, features): bucket for bucket in shapes
                        for features in SamplerFeatures.every()}

    def _sampler(self, phase: str, inputs: StepInputs | MixedInputs, forward, features: SamplerFeatures):
        """The compiled sampler of `features` that follows `forward` (the compiled forward program of `phase` that
        `inputs` run on), compiled on first use."""
        bucket = Bucket.of(phase, inputs)
        key = _sampler_key(bucket, features)
        program = self._samplers.get(key)
        if program is None:
            program = self._samplers[key] = self._lowered_sampler(bucket, forward, features).compile()
        return program

    def _lowered(self, bucket: Bucket):
        """The forward program of `bucket` (rows of all shards) traced against the pools' and inputs' shapes
        (nothing allocated)."""
        return self._steps[LAYOUT_OF[bucket.phase]].lower(self.params, self.rest, self._abstract_pages(),
                                                          self._abstract_recent(), self._abstract_inputs(bucket))

    def _lowered_sampler(self, bucket: Bucket, forward, features: SamplerFeatures):
        """The sampler of `features` traced against the outputs of `forward`, the compiled forward program of
        `bucket` (nothing allocated)."""
        logits, rows, _, scores = forward.out_info
        return self._sample[LAYOUT_OF[bucket.phase]].lower(logits, rows, self._abstract_recent(),
                                                           self._abstract_slot_state(), scores, features=features)

    def keep_followers(self) -> None:
        """Tells the other processes, waiting for the next step, that the leader is idle but alive (else nothing)."""
        if self.channel is not None:
            self.channel.idle()

    def stop_followers(self) -> None:
        """Ends the other processes' `multihost.follow` loops (leader of a mesh spanning processes; else nothing)."""
        if self.channel is not None:
            self.channel.stop()

    def _mixed_inputs(self, prefill: list[Chunk], decode: list[Chunk]) -> tuple[MixedInputs, list[int]]:
        """A mixed step's host inputs (both groups' block tables of one width, of decode's buckets) and the row each
        chunk's output takes (`prefill`'s, then `decode`'s): shard s's rows of outputs are its decode rows, then its
        chunks (`model.paged.RowSplit`)."""
        pages = self._pages_bucket(prefill + decode, self.buckets.pages_of("mixed"))
        (chunks, chunk_rows), (rows, decode_rows) = (self._inputs(phase, group, pages) for phase, group in
                                                     (("prefill", prefill), ("decode", decode)))
        per_shard = [group.tokens.shape[0] // self.shards for group in (rows, chunks)]

        def output_row(row: int, group: int) -> int:
            shard, offset = divmod(row, per_shard[group])
            return shard * sum(per_shard) + (per_shard[0] if group else 0) + offset

        return (MixedInputs(decode=rows, prefill=chunks),
                [output_row(row, 1) for row in chunk_rows] + [output_row(row, 0) for row in decode_rows])

    @staticmethod
    def _pages_bucket(chunks: list[Chunk], buckets: tuple[int, ...]) -> int:
        return Buckets.round_up(max(len(c.sequence.pages) for c in chunks), buckets, "pages per row")

    def _inputs(self, phase: str, chunks: list[Chunk], mixed_pages: int | None = None) -> tuple[StepInputs, list[int]]:
        """The padded step inputs for `chunks` (host arrays) and the row each chunk runs in; a mixed step's groups
        with block tables `mixed_pages` wide, its chunks in `Buckets.mixed_chunks` rows of the largest positions
        bucket. Per row the host writes its tokens, positions and block table; the rows' other fields are gathered
        into lists and written a column at a time (a step of 256 decode rows would otherwise set each of some twenty
        fields row by row)."""
        by_shard = [[chunk for chunk in chunks if chunk.sequence.shard == shard] for shard in range(self.shards)]
        sized_as = "mixed" if mixed_pages and phase == "prefill" else phase
        rows = Buckets.round_up(max(len(group) for group in by_shard), self.buckets.rows_of(sized_as),
                                "rows per shard")
        positions = self.buckets.positions[-1:] if mixed_pages else self.buckets.positions
        width = 1 if phase == "decode" else Buckets.round_up(max(c.count for c in chunks), positions,
                                                             "prompt positions")
        pages = mixed_pages or self._pages_bucket(chunks, self.buckets.pages_of(phase))
        inputs = StepInputs.zeros(rows * self.shards, width, pages, phase == "scored")
        placed = [(shard * rows + offset, chunk) for shard, group in enumerate(by_shard)
                  for offset, chunk in enumerate(group)]
        settings, lasts, slots, masked_rows, masked = [], [], [], [], []
        for row, chunk in placed:
            sequence, last = chunk.sequence, chunk.last
            if phase == "decode":
                inputs.tokens[row, 0], inputs.positions[row, 0] = sequence.last_token, chunk.start
            else:
                inputs.tokens[row, :chunk.count] = sequence.token_slice(chunk.start, chunk.start + chunk.count)
                inputs.positions[row, :chunk.count] = np.arange(chunk.start, chunk.start + chunk.count)
            inputs.table[row, :len(sequence.pages)] = sequence.pages
            span = _scored_span(chunk) if phase == "scored" else None
            if span is not None:
                inputs.following[row, span.start - chunk.start:span.stop - chunk.start] = \
                    sequence.prompt[span.start + 1:span.stop + 1]
            params = sequence.params
            settings.append(_row_settings(sequence))
            lasts.append(chunk.count - 1)
            slots.append(sequence.slot if last else -1)
            taken = self._take_slot(sequence)
            masked_rows.append(last and (sequence.guide is not None or bool(params.allowed_token_ids)))
            if sequence.guide is not None and last or taken and params.allowed_token_ids:
                masked.append(sequence)
        at = [row for row, _ in placed]
        for name, column in zip(ROW_SETTINGS, zip(*settings)):
            getattr(inputs.sampling, name)[at] = column
        inputs.last[at], inputs.slot[at], inputs.sampling.masked[at] = lasts, slots, masked_rows
        self._write_allowed(masked)
        row_of = {id(chunk): row for row, chunk in placed}  # (placed by shard; the caller's order is the chunks')
        return inputs, [row_of[id(chunk)] for chunk in chunks]

    def _write_allowed(self, sequences: list[Sequence]) -> None:
        """Each sequence's allowed-token bits for its next token written into its slot, in order on the device
        before the step that reads them; one write per bucket of `mask_rows` slots. A guided sequence's are its
        grammar's (its matcher has taken every token it generated: it is not scheduled while one is PENDING),
        and with allowed_token_ids their intersection; allowed_token_ids alone give bits that never change, written
        when the sequence takes its slot."""
        vocab = self.model_config.vocab_size
        for start in range(0, len(sequences), self.mask_rows[-1]):
            group = sequences[start:start + self.mask_rows[-1]]
            rows = Buckets.round_up(len(group), self.mask_rows, "masked rows")
            slots = np.full(rows, -1, np.int32)
            slots[:len(group)] = [s.shard * self.config.rows_per_shard + s.slot for s in group]
            masks = self._masks.masks([s.guide for s in group], rows) if self._masks is not None else \
                np.full((rows, self.slot_state.allowed.shape[1]), -1, np.int32)
            for index, sequence in enumerate(group):
                if sequence.params.allowed_token_ids:
                    masks[index] &= allowed_bits(sequence.params.allowed_token_ids, vocab)
            if self.channel is not None:
                self.channel.send_masks(slots, masks)
            self.write_masks(slots, masks)

    def write_masks(self, slots: np.ndarray, masks: np.ndarray) -> None:
        """Writes grammar masks [K, W] int32 into slots [K] (-1: none) of the slot state (`sampling.write_masks`,
        in place), in order before the steps launched after it; every process of a mesh spanning several runs it
        (the leader announces it first, `multihost`)."""
        if self.mesh is not None and jax.process_count() > 1:
            everywhere = NamedSharding(self.mesh, PartitionSpec())
            slots, masks = (jax.make_array_from_callback(array.shape, everywhere, lambda at, a=array: a[at])
                            for array in (slots, masks))
        self._slot_state = self._write(self.slot_state, slots, masks)

    def _take_slot(self, sequence: Sequence) -> bool:
        """Whether `sequence` has just taken its slot; its slot state written first when it has and it reads it
        (`sampling.SlotReset`: its prompt's ids, its generated tokens' counts and newest tokens, its bias, stop ids
        and bad words), in order on the device before this step."""
        params, key = sequence.params, (sequence.shard, sequence.slot)
        if self._slot_holders.get(key) is sequence:
            return False
        self._slot_holders[key] = sequence
        if params.uses_slot:
            stops = params.stop_tokens if params.min_tokens else ()
            reset = SlotReset.of(sequence.shard * self.config.rows_per_shard + sequence.slot,
                                 self.model_config.vocab_size, sequence.prompt,
                                 [token for token in sequence.generated if token >= 0], params.logit_bias, stops,
                                 params.bad_words)
            if self.channel is not None:
                self.channel.send_reset(reset)
            self.reset_slot(reset)
        return True

    def _row_sharding(self) -> NamedSharding | None:
        """Step inputs' rows split as the attention batch (and the page pool) are; None without a mesh."""
        if self.mesh is None:
            return None
        _, axes = self.layouts["decode"].activations.lookup("attn_batch")
        return NamedSharding(self.mesh, PartitionSpec(axes or None))

    def _placed(self, inputs: StepInputs | MixedInputs) -> PackedInputs | MixedPacked:
        """The step inputs packed (`steps.PackedInputs`, one for each group of a mixed step) and sent to the
        devices in one transfer each, rows split as the attention batch (and the page pool) are; each process its
        own rows where the mesh spans several."""
        packed = inputs.packed()
        rows = self._row_sharding()
        if rows is None or jax.process_count() == 1:
            return jax.device_put(packed, rows)
        return jax.tree.map(lambda columns: jax.make_array_from_callback(columns.shape, rows, lambda at: columns[at]),
                            packed)

    def _abstract_inputs(self, bucket: Bucket) -> PackedInputs | MixedPacked:
        """Shape, type and placement of the packed step inputs of `bucket`, for compiling before any request."""
        if bucket.phase == "mixed":
            return MixedPacked.abstract(bucket, self._row_sharding())
        return PackedInputs.abstract(bucket.rows, bucket.width, bucket.pages, self._row_sharding(),
                                     bucket.phase == "scored")


ROW_SETTINGS = ("temperature", "top_p", "top_k", "seed", "min_p", "top_logprobs", "presence", "frequency",
                "repetition", "min_position", "biased", "banning")
"""The `steps.RowSampling` fields a row takes from its sequence alone, in `_row_settings`' order."""


def _row_settings(sequence: Sequence) -> tuple:
    """A sequence's row settings, ROW_SETTINGS in order: its sampling parameters, its seed, the position below which
    its stop ids are masked (its prompt's length plus min_tokens; 0: off), whether it has a logit bias and bad
    words."""
    params = sequence.params
    return (params.temperature, params.top_p, params.top_k, sequence.seed, params.min_p, params.top_logprobs,
            params.presence_penalty, params.frequency_penalty, params.repetition_penalty,
            len(sequence.prompt) + params.min_tokens if params.min_tokens else 0, bool(params.logit_bias),
            bool(params.bad_words))


def _sampler_key(bucket: Bucket, features: SamplerFeatures) -> tuple:
    """A compiled sampler's key: its phase's layout (a mixed step's own: its rows come from its own program), its
    rows (of all shards), a scored prefill's positions a row (whose scores it appends to its outputs; None in other
    steps) and its passes."""
    layout = "mixed" if bucket.phase == "mixed" else LAYOUT_OF[bucket.phase]
    return layout, bucket.rows + bucket.chunks, bucket.width if bucket.phase == "scored" else None, features


def _scored_span(chunk: Chunk) -> range | None:
    """The positions of `chunk` whose next prompt token's log-probability its sequence still needs (from its
    `scored` on, up to the prompt's last but one), or None."""
    sequence = chunk.sequence
    if not sequence.unscored:
        return None
    span = range(max(chunk.start, sequence.scored), min(chunk.start + chunk.count, len(sequence.prompt) - 1))
    return span if len(span) else None


def _paged_kernel(asked: str, mesh) -> str:
    """The paged decode attention the engine runs: `asked`, or the backend policy's where it is "" (cuDNN's paged
    kernel on NVIDIA GPUs, gathering elsewhere). cuDNN's kernel off an NVIDIA GPU is refused."""
    device = mesh.devices.flat[0] if mesh is not None else jax.devices()[0]
    policy = policy_of(device)
    if asked == "cudnn" and policy.paged_attention != "cudnn":
        raise StarscreamError(f"the cudnn paged-attention kernel runs on NVIDIA GPUs, not on {device.platform} "
                              f"({policy.name}); pass --kernel gather, or leave --kernel out for the backend's choice")
    return asked or policy.paged_attention


def _held_length(config: EngineConfig, length: int) -> int:
    """The most positions of a sequence, `length`, where one cache shard of the configured pages holds it (a
    sequence's pages stay in one shard, one page of each is its null page); else, for the model's own context,
    what a shard holds, and for a `max_model_len` asked for, a StarscreamError naming both fixes. A length below 2
    is refused too: it holds no request (a prompt token and a generated one), so the server would refuse them all."""
    held = length if config.pages_per_shard is None else min(length, (config.pages_per_shard - 1) * config.page_size)
    # (sized from memory, a shard holds at least one longest sequence: `_cache_size`'s floor)
    if held < length and config.max_model_len is not None:
        raise StarscreamError(f"max model length {length} needs {math.ceil(length / config.page_size)} pages of "
                              f"{config.page_size} positions a sequence, and a cache shard holds "
                              f"{config.pages_per_shard - 1}; give more pages a shard (--cache-pages) or a max model "
                              f"length of at most {held} (--max-model-len)")
    if held < 2:
        raise StarscreamError(f"a sequence of at most {held} position holds no request (a prompt token and a "
                              "generated one); give a max model length of 2 or more (--max-model-len), or more "
                              "positions a shard (--cache-pages, --page-size)")
    return held


def _held_rows(config: EngineConfig) -> EngineConfig:
    """`config` with no more sequences a shard than its configured pages can run: each running sequence holds a page
    of its own at least (a page it shares by prefix is full, and its last position is always its own), so rows
    beyond the pages less the null page could never run, yet every decode program and the slot state
    ([rows, vocab]) would be sized for them."""
    if config.pages_per_shard is None or config.rows_per_shard < config.pages_per_shard:
        return config
    return dataclasses.replace(config, rows_per_shard=config.pages_per_shard - 1)


def _mixed_buckets(buckets: Buckets, most: int) -> tuple[int, ...]:
    """Prompt chunks per shard of the mixed steps an engine compiles: none where `most` is 0, the buckets' own where
    they name them, else the prefill rows buckets below `most` and `most` itself."""
    if not most:
        return ()
    return buckets.mixed_chunks or tuple(sorted({rows for rows in buckets.rows_of("prefill") if rows < most} | {most}))


def _check_buckets(buckets: Buckets, config: EngineConfig) -> None:
    """The largest buckets must hold what the scheduler may plan: rows_per_shard decode rows, a whole chunk."""
    if buckets.rows[-1] < config.rows_per_shard or buckets.positions[-1] < config.chunk:
        raise StarscreamError(f"buckets of at most {buckets.rows[-1]} rows and {buckets.positions[-1]} positions "
                              f"cannot run {config.rows_per_shard} sequences per shard and chunks of {config.chunk}; "
                              "raise the largest buckets or lower rows_per_shard / chunk")
