"""Continuous batching: which sequences prefill and which decode in each engine step, and where their pages live.

Pure Python, no arrays: the engine turns each `StepPlan` into the compiled steps' inputs. Every step
  1. gives each decoding sequence the page its next position needs; a shard with no free page preempts its newest
     sequence (pages freed, the sequence back at the head of the queue, recomputed from its tokens later) until one
     is free;
  2. hands the per-step token budget to chunks of the prompts still being prefilled (oldest first, at most `chunk`
     tokens each, at most `prefill_rows` chunks per shard); the decoding rows take none of it, whether they run in
     a program of their own or beside the chunks in a mixed step: each chunk is padded to `chunk` positions, so a
     budget less one token per decoding row would only split a chunk into a padded part and a further step (256
     decoding rows over a budget of 8,192 in chunks of 512 made workload A's 256 prompts take 17 prefill steps where
     16 hold them);
  3. admits waiting requests in arrival order while a shard has a row and the pages of the whole prompt (full pages
     of a known prefix are shared, not allocated), each to the shard holding most of its prefix, else the
     least busy one.
A sequence has its K/V for `computed` positions in the cache; it decodes when only its last token is missing
(computed = len(tokens) - 1), and prefills while more are.

A running sequence holds a slot of its shard (0 .. rows_per_shard - 1): the row of the engine's per-shard device
buffers where each step leaves the sequence's newest token (`steps.sample_step`), so the next step can read a token
the host has not seen yet. A token still on its way to the host is `PENDING` in `Sequence.generated`; a sequence
holding one is not admitted again (its prompt pages would be recomputed from tokens the host does not have). A
guided sequence (structured output: its next token's mask follows from its last token, `serving.guided`) whose
last token is PENDING sits the step out (`Sequence.held`): it decodes in the step after its token is read.
"""
from __future__ import annotations

import hashlib
import itertools
import math
from collections import deque
from dataclasses import dataclass, field

from ..errors import StarscreamError
from .guided import Grammar
from .pages import ShardPages, page_hashes, salt_key


PENDING = -1
"""A generated token sampled by a step whose outputs the host has not read yet (`Engine.step`)."""

MAX_TOP_K = 2 ** 31 - 1
"""The largest top_k a row holds (int32); any larger keeps every token, as top_k 0 does."""
MAX_LOGIT_BIAS = 300
"""The most logit_bias entries of one request (OpenAI's limit; a slot of `sampling.SlotState` holds this many)."""
MAX_TOP_LOGPROBS = 20
"""The most top log-probabilities per generated position (vLLM's default `max_logprobs`)."""
MAX_STOP_IDS = 32
"""The most stop token ids (EOS ids included) of a request with min_tokens: the step masks them itself."""
MAX_BAD_WORDS = 128
"""The most token sequences of one request's bad_words (a word gives one or two: with and without a leading space;
a slot of `sampling.SlotState` holds this many)."""
MAX_BAD_WORD_TOKENS = 8
"""The most tokens of one bad word's sequence (the step compares the word's earlier tokens with the slot's last
MAX_BAD_WORD_TOKENS - 1 generated ones)."""


SEEDS = 2 ** 31
"""The engine's seeds are in [0, SEEDS)."""


def engine_seed(seed: int | None) -> int | None:
    """A 64-bit seed (an API request's, a command's --seed) as the engine takes it: one in [0, SEEDS) as it is, any
    other hashed into that range (one seed draws alike every time; two distinct seeds rarely share a draw)."""
    if seed is None or 0 <= seed < SEEDS:
        return seed
    digest = hashlib.blake2b(seed.to_bytes(8, "little", signed=True), digest_size=4).digest()
    return int.from_bytes(digest, "little") % SEEDS


def sample_seeds(seed: int | None, count: int) -> list[int | None]:
    """The engine seeds of `count` samples of one prompt: `seed` (an engine seed) and the seeds after it, modulo
    SEEDS, so that the samples differ and each is drawn again by the same request; all None without a seed."""
    return [None if seed is None else (seed + index) % SEEDS for index in range(count)]


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """What one request asks of the engine. temperature 0 is greedy; top_p 1 and top_k 0 keep every token; a seed
    makes the draw of each position a function of (seed, position) alone, whatever else runs in the batch; a token
    of `stop_tokens` (the tokenizer's EOS ids) ends the sequence, none is drawn before `min_tokens`; `logprobs`
    returns the log-probability of each chosen token, and `top_logprobs` that many of the likeliest tokens with
    theirs. As vLLM defines them: `min_p` drops tokens less likely than it times the likeliest; the presence and
    frequency penalties subtract from the logit of each id generated so far (once, or once per time); the
    repetition penalty divides positive logits and multiplies negative ones of ids in the prompt or generated;
    `logit_bias` ((id, value) pairs) adds to logits; `allowed_token_ids` (empty: all) are the only ids drawn;
    `bad_words` (token-id sequences) ban each sequence's last id where the tokens generated last are the rest of it
    (always, for one id); `grammar` (structured output, `serving.guided`) allows only
    the tokens that keep the text within it, and the request ends ("stop") when the grammar does; `prompt_logprobs`
    N (None: off) returns each prompt token's log-probability and rank after the first, with the N likeliest
    tokens at its position (`PromptLogprobs`, on the first token's event); `cache_salt` (a non-empty text, None:
    none) keeps the request's prompt pages apart from those of requests with another salt or none (`pages`), so
    only requests with the same salt share cached pages. Stop strings are
    text, so the API process applies them to the detokenized text (`serving.detokenize`) and cancels the request;
    the engine stops on token ids and lengths alone."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_tokens: tuple[int, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    min_tokens: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] = ()
    bad_words: tuple[tuple[int, ...], ...] = ()
    grammar: Grammar | None = None
    prompt_logprobs: int | None = None
    cache_salt: str | None = None

    def __post_init__(self):
        problems = [(not _is_int(self.max_tokens) or self.max_tokens < 1,
                     f"max_tokens {self.max_tokens!r} must be a whole number of at least 1"),
                    (not 0.0 <= self.temperature <= 100.0, f"temperature {self.temperature} is outside [0, 100]"),
                    (not 0.0 < self.top_p <= 1.0, f"top_p {self.top_p} is outside (0, 1]"),
                    (not _is_int(self.top_k) or not 0 <= self.top_k <= MAX_TOP_K,
                     f"top_k {self.top_k!r} must be 0 (off) or a whole number up to {MAX_TOP_K}"),
                    (self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < SEEDS),
                     f"seed {self.seed!r} is outside [0, 2**31)"),
                    (isinstance(self.stop_tokens, (str, bytes)) or
                     not all(_is_int(token) and 0 <= token < 2 ** 31 for token in self.stop_tokens),
                     f"stop_tokens {self.stop_tokens!r} must be a tuple of token ids")] + self._problems_beyond_top_k()
        for failed, message in problems:
            if failed:
                raise StarscreamError(message)

    def _problems_beyond_top_k(self) -> list[tuple[bool, str]]:
        """(failed, message) of the settings the step applies from the row's slot, and of top_logprobs."""
        return [(not _is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS,
                 f"top_logprobs {self.top_logprobs!r} is outside [0, {MAX_TOP_LOGPROBS}]"),
                (self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                       or not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS),
                 f"prompt_logprobs {self.prompt_logprobs!r} is outside [0, {MAX_TOP_LOGPROBS}]"),
                (not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens,
                 f"min_tokens {self.min_tokens!r} must be a whole number from 0 to max_tokens ({self.max_tokens})"),
                (self.min_tokens > 0 and len(self.stop_tokens) > MAX_STOP_IDS,
                 f"min_tokens with {len(self.stop_tokens)} stop token ids (EOS ids included); give at most "
                 f"{MAX_STOP_IDS} stop_token_ids with min_tokens"),
                (not _number_in(self.min_p, 0.0, 1.0), f"min_p {self.min_p!r} is outside [0, 1]"),
                (not _number_in(self.presence_penalty, -2.0, 2.0),
                 f"presence_penalty {self.presence_penalty!r} is outside [-2, 2]"),
                (not _number_in(self.frequency_penalty, -2.0, 2.0),
                 f"frequency_penalty {self.frequency_penalty!r} is outside [-2, 2]"),
                (not _number_in(self.repetition_penalty, 1e-6, 1e6),
                 f"repetition_penalty {self.repetition_penalty!r} must be above 0 (1: off)"),
                (len(self.logit_bias) > MAX_LOGIT_BIAS,
                 f"logit_bias holds {len(self.logit_bias)} entries; give at most {MAX_LOGIT_BIAS}"),
                (self.grammar is not None and not isinstance(self.grammar, Grammar),
                 f"grammar is a {type(self.grammar).__name__}; pass a serving.guided.Grammar"),
                (not all(isinstance(pair, (tuple, list)) and len(pair) == 2 and _is_int(pair[0])
                         and 0 <= pair[0] < 2 ** 31 and _number_in(pair[1], -100.0, 100.0)
                         for pair in self.logit_bias),
                 "logit_bias must map token ids to values in [-100, 100]"),
                (not _ids(self.allowed_token_ids), "allowed_token_ids must be a tuple of token ids"),
                (isinstance(self.bad_words, (str, bytes)) or len(self.bad_words) > MAX_BAD_WORDS or
                 not all(_ids(word) and 1 <= len(word) <= MAX_BAD_WORD_TOKENS for word in self.bad_words),
                 f"bad_words must be at most {MAX_BAD_WORDS} tuples of 1 to {MAX_BAD_WORD_TOKENS} token ids"),
                (self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt),
                 f"cache_salt {self.cache_salt!r} must be a non-empty text (or None)")]

    @property
    def uses_slot(self) -> bool:
        """Whether the step reads this request's slot state written when it takes its slot (`sampling.SlotReset`):
        a penalty, a logit bias, min_tokens or bad words."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens or self.bad_words)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _ids(values) -> bool:
    """A tuple or list of token ids (whole numbers in [0, 2**31))."""
    return isinstance(values, (tuple, list)) and all(_is_int(value) and 0 <= value < 2 ** 31 for value in values)


def _number_in(value, low: float, high: float) -> bool:
    """A real number (not a bool, not NaN) within [low, high]."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value <= high


@dataclass(frozen=True, kw_only=True)
class PromptLogprobs:
    """A prompt's log-probabilities, one entry per prompt token after the first (the first has no context): the
    token's log-probability under the model given the tokens before it, its rank in the vocabulary (1: the
    likeliest), and the request's `prompt_logprobs` likeliest ids at its position with their log-probabilities,
    best first."""

    logprobs: list[float]
    ranks: list[int]
    top_tokens: list[list[int]]
    top_logprobs: list[list[float]]


@dataclass(frozen=True, kw_only=True)
class TokenEvent:
    """A new token of request `request_id` ([its log-probability]); `finish_reason` "stop" (a stop token) or
    "length" (max_tokens or the context) on its last; on its first, the seconds the request waited before its
    first step (`queued_s`) and, where the request asks, its prompt's log-probabilities (`prompt`); the request's
    `top_logprobs` likeliest ids and their log-probabilities, best first."""

    request_id: str
    token: int
    logprob: float
    finish_reason: str | None
    queued_s: float | None = None
    top_tokens: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()
    prompt: PromptLogprobs | None = None


@dataclass(eq=False, kw_only=True)
class Sequence:
    """One request inside the engine: its tokens so far (prompt, then generated), its shard and pages."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    seed: int
    arrival: float
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    shard: int = -1
    pages: list[int] = field(default_factory=list)
    computed: int = 0
    admitted: int = -1  # admission order while running (newest is preempted first)
    preemptions: int = 0
    scheduled_at: float | None = None  # when its first step began (its queue time ends)
    slot: int = -1  # its row of the shard's device token buffer while running
    pending: int = 0  # generated tokens still PENDING (sampled on the device, not read yet)
    guide: object = None  # its grammar's matcher (`serving.guided.Guide`), held by the engine
    compiling: bool = False  # its grammar still compiling: not admitted yet
    scored: int = 0  # prompt positions whose next token's log-probability a launched step computes
    prompt_scores: PromptLogprobs | None = None  # those read so far (`SamplingParams.prompt_logprobs`)
    _hashes: list[bytes] = field(default_factory=list, repr=False)

    @property
    def unscored(self) -> bool:
        """Whether it asks for its prompt's log-probabilities and a position still needs a step to compute them
        (position p gives prompt token p + 1's, so positions 0 .. len(prompt) - 2 do)."""
        return self.params.prompt_logprobs is not None and self.scored < len(self.prompt) - 1

    def prefix_hashes(self, positions: int, page_size: int) -> list[bytes]:
        """`pages.page_hashes` of tokens[:positions], each page hashed once in the sequence's life (its tokens
        only grow, and each page's hash chains its predecessor's; the first page's chains the request's
        cache_salt)."""
        full = positions // page_size
        if len(self._hashes) < full:
            start = len(self._hashes) * page_size
            self._hashes += page_hashes(self.token_slice(start, full * page_size), page_size,
                                        self._hashes[-1] if self._hashes else salt_key(self.params.cache_salt))
        return self._hashes[:full]

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def length(self) -> int:
        """len(tokens), without building them."""
        return len(self.prompt) + len(self.generated)

    @property
    def last_token(self) -> int:
        """tokens[-1]: its newest generated token (PENDING while still on the device), else its prompt's last."""
        return self.generated[-1] if self.generated else self.prompt[-1]

    def token_slice(self, start: int, stop: int) -> list[int]:
        """tokens[start:stop], without building them all."""
        cut = len(self.prompt)
        return self.prompt[start:min(stop, cut)] + self.generated[max(start - cut, 0):max(stop - cut, 0)]

    @property
    def decoding(self) -> bool:
        return self.computed == self.length - 1

    @property
    def held(self) -> bool:
        """Guided with its last token PENDING: the mask of its next token is not known yet, so it sits out."""
        return self.guide is not None and self.pending > 0


@dataclass(frozen=True)
class Chunk:
    """Prefill of tokens[start : start + count] of `sequence`; `last` when it reaches the sequence's last token
    (its logits give the next token)."""

    sequence: Sequence
    start: int
    count: int

    @property
    def last(self) -> bool:
        return self.start + self.count == self.sequence.length


@dataclass(frozen=True)
class StepPlan:
    """One engine step: prompt chunks to prefill and sequences to decode (each placed on its shard)."""

    prefill: tuple[Chunk, ...]
    decode: tuple[Sequence, ...]
    preempted: tuple[Sequence, ...]


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """shards: cache shards (the partitions the attention batch is split over); pages_per_shard: each shard's pages
    (one is its null page); page_size: positions per page; rows_per_shard: most sequences a shard runs at once;
    token_budget: most prompt tokens a step prefills (decode rows, at most rows_per_shard per shard, take none of
    it); chunk: most prompt tokens of one sequence per step; prefill_rows: most prompt chunks a
    shard runs in one step (default rows_per_shard); prefix_caching: whether full prompt pages are shared by hash."""

    shards: int
    pages_per_shard: int
    page_size: int
    rows_per_shard: int
    token_budget: int
    chunk: int
    prefix_caching: bool = True
    prefill_rows: int | None = None

    def __post_init__(self):
        if self.prefill_rows is None:
            object.__setattr__(self, "prefill_rows", self.rows_per_shard)
        for name in ("shards", "pages_per_shard", "page_size", "rows_per_shard", "token_budget", "chunk",
                     "prefill_rows"):
            if getattr(self, name) < 1:
                raise StarscreamError(f"scheduler {name} is {getattr(self, name)}; it must be at least 1")

    def pages_for(self, positions: int) -> int:
        return math.ceil(positions / self.page_size)


class Scheduler:
    """Waiting and running sequences over the shards' page pools (see the module docstring)."""

    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.shards = [ShardPages(config.pages_per_shard) for _ in range(config.shards)]
        self._free_slots = [list(range(config.rows_per_shard - 1, -1, -1)) for _ in range(config.shards)]
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._admissions = itertools.count()

    def add(self, sequence: Sequence) -> None:
        """Queues a new request; StarscreamError when it could never fit one shard's pages."""
        needed = self.config.pages_for(len(sequence.prompt) + sequence.params.max_tokens)
        if needed > self.config.pages_per_shard - 1:
            raise StarscreamError(f"request {sequence.request_id} needs {needed} pages of {self.config.page_size} "
                                  f"positions and a cache shard holds {self.config.pages_per_shard - 1}; shorten "
                                  "the prompt or max_tokens, or give the cache more pages")
        self.waiting.append(sequence)

    def finish(self, sequence: Sequence) -> None:
        """Ends a running or waiting sequence (finished, cancelled, disconnected): its pages are released."""
        if sequence in self.running:
            self.running.remove(sequence)
            self._release(sequence)
        elif sequence in self.waiting:
            self.waiting.remove(sequence)

    @property
    def pages_used(self) -> int:
        return sum(shard.used for shard in self.shards)

    def schedule(self) -> StepPlan:
        """The next step's plan (see the module docstring); preempted sequences are back in `waiting`."""
        preempted = self._grow_decoding()
        decode = tuple(sequence for sequence in self.running if sequence.decoding and not sequence.held)
        budget = self.config.token_budget
        chunks, per_shard = [], [0] * self.config.shards
        for sequence in sorted((s for s in self.running if not s.decoding), key=lambda s: s.admitted):
            if budget <= 0:
                break
            if per_shard[sequence.shard] < self.config.prefill_rows:
                chunks.append(self._chunk(sequence, budget))
                per_shard[sequence.shard] += 1
                budget -= chunks[-1].count
        full = {shard for shard, count in enumerate(per_shard) if count >= self.config.prefill_rows}
        while self.waiting and budget > 0 and self._admit(self.waiting[0], full):
            sequence = self.waiting.popleft()
            chunks.append(self._chunk(sequence, budget))
            per_shard[sequence.shard] += 1
            if per_shard[sequence.shard] >= self.config.prefill_rows:
                full.add(sequence.shard)
            budget -= chunks[-1].count
        return StepPlan(tuple(chunks), decode, tuple(preempted))

    def computed(self, chunk: Chunk) -> None:
        """Records that `chunk` ran: its positions are cached, and its full prompt pages are registered by hash."""
        sequence = chunk.sequence
        sequence.computed = chunk.start + chunk.count
        if not self.config.prefix_caching:
            return
        shard = self.shards[sequence.shard]
        for index, digest in enumerate(sequence.prefix_hashes(sequence.computed, self.config.page_size)):
            shard.register(sequence.pages[index], digest)

    def _chunk(self, sequence: Sequence, budget: int) -> Chunk:
        remaining = sequence.length - sequence.computed
        return Chunk(sequence, sequence.computed, min(remaining, budget, self.config.chunk))

    def _grow_decoding(self) -> list[Sequence]:
        """Gives each decoding sequence the page of its next position, preempting the newest on a full shard."""
        preempted = []
        for sequence in sorted(self.running, key=lambda s: s.admitted):
            if sequence.shard < 0 or not sequence.decoding:  # preempted in this loop, or prefilling
                continue
            if self.config.pages_for(sequence.length) <= len(sequence.pages):
                continue
            shard = self.shards[sequence.shard]
            while shard.free == 0:
                victim = max((s for s in self.running if s.shard == sequence.shard), key=lambda s: s.admitted)
                self._preempt(victim)
                preempted.append(victim)
                if victim is sequence:
                    break
            if sequence.shard >= 0:
                sequence.pages += shard.allocate(1)
        return preempted

    def _preempt(self, sequence: Sequence) -> None:
        self.running.remove(sequence)
        self._release(sequence)
        sequence.preemptions += 1
        self.waiting.appendleft(sequence)

    def _release(self, sequence: Sequence) -> None:
        self.shards[sequence.shard].release(sequence.pages)
        self._free_slots[sequence.shard].append(sequence.slot)
        sequence.pages, sequence.computed, sequence.shard, sequence.admitted, sequence.slot = [], 0, -1, -1, -1

    def _admit(self, sequence: Sequence, full: set[int]) -> bool:
        """Places `sequence` on a shard (not in `full`: no prefill row left this step) with a free row and the pages
        of its tokens; False when none has them, while a token of it is PENDING, or while its grammar compiles."""
        if sequence.pending or sequence.compiling:
            return False
        length = sequence.length
        shared = self.config.prefix_caching and not sequence.unscored  # (its prompt's positions must be computed)
        hashes = sequence.prefix_hashes(length - 1, self.config.page_size) if shared else []
        # (the last token is always computed: its logits give the next)
        needed = self.config.pages_for(length)
        best = None
        for index, shard in enumerate(self.shards):
            rows = sum(1 for s in self.running if s.shard == index)
            hit = shard.cached_prefix(hashes)
            if index in full or rows >= self.config.rows_per_shard or not shard.can_hold(hashes, needed):
                continue
            key = (hit, -rows, shard.free)
            if best is None or key > best[0]:
                best = (key, index)
        if best is None:
            return False
        shard = self.shards[best[1]]
        sequence.shard = best[1]
        sequence.slot = self._free_slots[best[1]].pop()
        sequence.pages = shard.take_prefix(hashes)
        sequence.computed = len(sequence.pages) * self.config.page_size
        sequence.pages += shard.allocate(needed - len(sequence.pages))
        sequence.admitted = next(self._admissions)
        self.running.append(sequence)
        return True


def check_fits(prompt_tokens: int, max_tokens: int, context: int) -> None:
    """StarscreamError when a prompt and its max_tokens exceed the model's context."""
    if prompt_tokens < 1:
        raise StarscreamError("the prompt is empty; give at least one token")
    if prompt_tokens + max_tokens > context:
        raise StarscreamError(f"the prompt's {prompt_tokens} tokens plus max_tokens {max_tokens} exceed the model's "
                              f"context of {context} tokens; shorten the prompt or lower max_tokens")
