"""What the serving step does to a row's logits before it draws, as vLLM defines each setting, and the per-slot
device state the settings need. Everything runs inside the compiled step; nothing crosses to the host per token.

Order, as vLLM's sampler applies them: the allowed-token bits (a grammar's, `allowed_token_ids`, or both
intersected: `apply_grammar`), then `bad_words` (`apply_bad_words`), then `logit_bias` added and the stop tokens
masked while fewer than `min_tokens` are generated (`apply_bias`), then the repetition, frequency and presence
penalties (`apply_penalties`), then temperature, `min_p`, top-k and top-p (`keep_min_p` inside the step's draw). The
log-probabilities returned (the chosen token's and the `top_logprobs` best, `top_logprobs`) are the model's own,
before any of these.

`SlotState` holds, for every slot of every cache shard (a running sequence holds one slot of its shard, its index local
to the shard, `Sequence.slot`), the counts of its generated tokens per vocabulary id [slots, V] int32, which ids its
prompt holds [slots, V] bool, its logit bias as (id, value) pairs [slots, MAX_LOGIT_BIAS] and its stop ids [slots,
MAX_STOP_IDS] (-1: none), its bad words' token sequences [slots, MAX_BAD_WORDS * MAX_BAD_WORD_TOKENS] and the last
MAX_BAD_WORD_TOKENS - 1 tokens it generated [slots, MAX_BAD_WORD_TOKENS - 1] (-1: none), and the allowed-token bits of a
masked row's next token [slots, W] int32 (a grammar's, `serving.guided`, and `allowed_token_ids`: W = ceil(V / 32)
words, bit v % 32 of word v // 32 for token v). Its slots are split as the attention batch is (`SLOT_TABLE`), as the
step's rows are: shard s's rows read and write only shard s's slots, on the device that holds both (`run_sharded`), so
no slot is stored twice and none moves. The host writes a slot's row once, when a sequence that uses these settings
takes it (`reset_slot`, with `SlotReset.of`); the step counts each penalized row's sampled token itself (`record`, a
scatter of B ones) and appends it to a banning row's tail of generated tokens, so a bad word of several tokens is
matched against every token, the newest included, with nothing read by the host. A guided row's bits change with every
token it takes, so the host writes them before each step that samples it, after reading its previous token
(`write_masks`, one scatter of the masked rows' masks); the bits of `allowed_token_ids` alone do not change, so they are
written once, when the sequence takes its slot. The step then sets every token a masked row's bits forbid to -inf before
anything else (`apply_grammar`), as vLLM applies its grammar bitmask. Each pass runs only in a step some of whose rows
use it: the host decides which (`steps.SamplerFeatures`), never the device, so the compiled sampler holds no
conditional (a GPU reads a conditional's predicate on the host, which would stall the queue of launched steps).
Every function that places takes the placement it runs under (`placement`; None: `current()`, for a call of your own
under `use_layout`): the serving steps hand theirs.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import register_dataclass

from ..errors import StarscreamError
from ..model.ops import run_sharded
from ..sharding.apply import Placement, placed_explicitly
from .guided import mask_words
from .scheduler import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS, MAX_LOGIT_BIAS, MAX_STOP_IDS, MAX_TOP_LOGPROBS

SLOT_ROWS = ("attn_batch",)
"""A step's rows [B] and the slot of each, split as the attention batch is."""
SLOT_TABLE = ("attn_batch", None)
"""Each `SlotState` array: slots split as the attention batch is (a shard's slots on its device), the rest whole."""


TAIL = MAX_BAD_WORD_TOKENS - 1
"""Generated tokens a slot keeps (`SlotState.tail`): the longest bad word's tokens before its last."""
RESET_FIELDS = ("counts", "prompt", "bias_ids", "bias", "stops", "bad_words", "tail")
"""The fields of `SlotState` a `SlotReset` writes (`reset_slot`), as its own fields of those names."""


@register_dataclass
@dataclass(frozen=True, kw_only=True)
class SlotState:
    """Per slot of every cache shard (see the module docstring): counts [slots, V] int32 of generated tokens,
    prompt [slots, V] bool, bias_ids [slots, MAX_LOGIT_BIAS] int32 and bias [slots, MAX_LOGIT_BIAS] float32 (the
    logit bias, id -1: none), stops [slots, MAX_STOP_IDS] int32 (-1: none), bad_words [slots, MAX_BAD_WORDS *
    MAX_BAD_WORD_TOKENS] int32 (each word's token ids right-aligned in its MAX_BAD_WORD_TOKENS columns, -1 before
    them; all -1: no word), tail [slots, TAIL] int32 (the newest generated tokens, oldest first, -1 where fewer were
    generated), allowed [slots, ceil(V / 32)] int32 (a masked row's allowed-token bits). `slots` is shards * slots
    per shard."""

    counts: jax.Array
    prompt: jax.Array
    bias_ids: jax.Array
    bias: jax.Array
    stops: jax.Array
    bad_words: jax.Array
    tail: jax.Array
    allowed: jax.Array

    @staticmethod
    def shapes(slots: int, vocab: int) -> SlotState:
        """Each array's (shape, dtype), as a SlotState of `jax.ShapeDtypeStruct`s without placement."""
        def spec(width, dtype):
            return jax.ShapeDtypeStruct((slots, width), dtype)

        return SlotState(counts=spec(vocab, jnp.int32), prompt=spec(vocab, jnp.bool_),
                         bias_ids=spec(MAX_LOGIT_BIAS, jnp.int32), bias=spec(MAX_LOGIT_BIAS, jnp.float32),
                         stops=spec(MAX_STOP_IDS, jnp.int32),
                         bad_words=spec(MAX_BAD_WORDS * MAX_BAD_WORD_TOKENS, jnp.int32), tail=spec(TAIL, jnp.int32),
                         allowed=spec(mask_words(vocab), jnp.int32))

    @staticmethod
    def abstract(slots: int, vocab: int, sharding=None) -> SlotState:
        """The state's shapes and types on `sharding` (a NamedSharding by SLOT_TABLE; None: the default device)."""
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
                            SlotState.shapes(slots, vocab))

    @staticmethod
    def empty(slots: int, vocab: int, sharding=None) -> SlotState:
        """Every slot cleared (no counts, no prompt, no bias, stop ids or bad words, every token allowed), on
        `sharding`."""
        shapes = SlotState.shapes(slots, vocab)
        fills = {"counts": 0, "prompt": False, "bias_ids": -1, "bias": 0.0, "stops": -1, "bad_words": -1, "tail": -1,
                 "allowed": -1}
        return SlotState(**{name: jnp.full(getattr(shapes, name).shape, fill, getattr(shapes, name).dtype,
                                           device=sharding) for name, fill in fills.items()})


@register_dataclass
@dataclass(frozen=True, kw_only=True)
class SlotReset:
    """One slot's new row, written by `reset_slot`: `slot` (a scalar, shard * slots per shard + the sequence's
    slot), counts [V] of its generated tokens so far (more than none after a preemption), prompt [V] (1: the id is
    in the prompt; int32, as `multihost` broadcasts it),
    bias_ids / bias [MAX_LOGIT_BIAS], stops [MAX_STOP_IDS] (-1: none), bad_words [MAX_BAD_WORDS *
    MAX_BAD_WORD_TOKENS] and tail [TAIL] (as `SlotState`'s). Host arrays, built by `of`."""

    slot: np.ndarray
    counts: np.ndarray
    prompt: np.ndarray
    bias_ids: np.ndarray
    bias: np.ndarray
    stops: np.ndarray
    bad_words: np.ndarray
    tail: np.ndarray

    @classmethod
    def of(cls, slot: int, vocab: int, prompt: list[int], generated: list[int], logit_bias=(), stops=(),
           bad_words=()) -> SlotReset:
        """The row of a sequence of `prompt` and `generated` tokens, with `logit_bias` ((id, value) pairs), `stops`
        (stop token ids masked while min_tokens are not reached) and `bad_words` (token-id sequences);
        StarscreamError beyond what a slot holds."""
        if len(logit_bias) > MAX_LOGIT_BIAS:
            raise StarscreamError(f"logit_bias holds {len(logit_bias)} entries; give at most {MAX_LOGIT_BIAS}")
        if len(stops) > MAX_STOP_IDS:
            raise StarscreamError(f"{len(stops)} stop token ids with min_tokens; give at most {MAX_STOP_IDS}")
        if len(bad_words) > MAX_BAD_WORDS or any(not 1 <= len(word) <= MAX_BAD_WORD_TOKENS for word in bad_words):
            raise StarscreamError(f"bad_words: at most {MAX_BAD_WORDS} token sequences of 1 to "
                                  f"{MAX_BAD_WORD_TOKENS} tokens each")
        words = np.full((MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS), -1, np.int32)
        for index, word in enumerate(bad_words):
            words[index, MAX_BAD_WORD_TOKENS - len(word):] = word
        tail = np.full(TAIL, -1, np.int32)
        newest = generated[len(generated) - TAIL:]
        tail[TAIL - len(newest):] = newest
        bias_ids, bias = np.full(MAX_LOGIT_BIAS, -1, np.int32), np.zeros(MAX_LOGIT_BIAS, np.float32)
        for index, (token, value) in enumerate(logit_bias):
            bias_ids[index], bias[index] = token, value
        stop_ids = np.full(MAX_STOP_IDS, -1, np.int32)
        stop_ids[:len(stops)] = stops
        present = np.zeros(vocab, np.int32)
        present[np.asarray(prompt, np.int64)] = 1
        counts = np.bincount(np.asarray(generated, np.int64), minlength=vocab).astype(np.int32)
        return cls(slot=np.asarray(slot, np.int32), counts=counts, prompt=present, bias_ids=bias_ids, bias=bias,
                   stops=stop_ids, bad_words=words.reshape(-1), tail=tail)


def reset_slot(state: SlotState, reset: SlotReset, placement: Placement | None = None) -> SlotState:
    """`state` with slot `reset.slot`'s row replaced by `reset`'s (jit it with `state` donated: an update in
    place); each shard writes only if the slot is its own."""
    count = len(RESET_FIELDS)

    def local(*arrays, specs):
        (slot, *rows), local_slots = arrays[count:], arrays[0].shape[0]
        at = _local_index(slot, local_slots, specs)
        return tuple(array.at[at].set(row.astype(array.dtype), mode="drop")
                     for array, row in zip(arrays[:count], rows))

    written = [getattr(state, name) for name in RESET_FIELDS]  # the allowed bits are `write_masks`'
    fields = (reset.slot, *(getattr(reset, name) for name in RESET_FIELDS))
    out = run_sharded(local, [*written, *fields], [SLOT_TABLE] * count + [None] * (count + 1),
                      [(SLOT_TABLE, array.shape) for array in written], "slot state", placement=placement)
    return dataclasses.replace(state, **dict(zip(RESET_FIELDS, out)))


def _local_index(slot, local_slots: int, specs):
    """Global slot index (scalar or [K]) -> its index among this shard's `local_slots` slots, or `local_slots`
    (out of range: a scatter with mode="drop" writes nothing) where another shard owns it or it is -1."""
    axes = specs[0][0] if len(specs[0]) else None
    first = jax.lax.axis_index(axes) * local_slots if axes else 0
    return jnp.where((slot >= first) & (slot < first + local_slots), slot - first, local_slots)


def write_masks(state: SlotState, slot_K: jax.Array, masks_KW: jax.Array,
                placement: Placement | None = None) -> SlotState:
    """`state` with the allowed-token bits of slots `slot_K` [K] int32 (global indices, -1: none) replaced by
    `masks_KW` [K, W] int32 (jit it with `state` donated: an update in place). The K rows cross to every device
    whole (a few KB) and each shard keeps the slots that are its own, so the bits land beside the rows that read
    them. K is bucketed by the engine, so a handful of these small programs serve every step."""
    def local(allowed_RW, slot_K, masks_KW, specs):
        return allowed_RW.at[_local_index(slot_K, allowed_RW.shape[0], specs)].set(masks_KW, mode="drop")

    allowed = run_sharded(local, [state.allowed, slot_K, masks_KW], [SLOT_TABLE, None, None],
                          [(SLOT_TABLE, state.allowed.shape)], "grammar masks", placement=placement)
    return dataclasses.replace(state, allowed=allowed)


def apply_grammar(logits_BV: jax.Array, state: SlotState, slot_B: jax.Array, rows,
                  placement: Placement | None = None) -> jax.Array:
    """The logits [B, V] with every token the bits of a masked row (`rows.masked` [B] > 0, with a slot: its
    grammar's allowed tokens, its allowed_token_ids, or both intersected) do not allow set to -inf, from its slot's
    bits (`SlotState.allowed`); other rows are left as they are. Placed as `logits_BV` is."""
    def local(logits_bV, allowed_RW, slot_b, masked_b, specs):
        vocab = logits_bV.shape[-1]
        ids_V = jnp.arange(vocab)
        words_bV = allowed_RW[jnp.maximum(slot_b, 0)][:, ids_V // 32]
        allowed_bV = ((words_bV >> (ids_V % 32)[None, :]) & 1) > 0
        keep_bV = allowed_bV | ~((slot_b >= 0) & (masked_b > 0))[:, None]
        return jnp.where(keep_bV, logits_bV, -jnp.inf)

    out = run_sharded(local, [logits_BV, state.allowed, slot_B, rows.masked],
                      [SLOT_TABLE, SLOT_TABLE, SLOT_ROWS, SLOT_ROWS], [(SLOT_TABLE, logits_BV.shape)], "grammar",
                      placement=placement)
    return placed_like(out, logits_BV)


def apply_bad_words(logits_BV: jax.Array, state: SlotState, slot_B: jax.Array, rows,
                    placement: Placement | None = None) -> jax.Array:
    """The logits [B, V] with, for each banning row (`rows.banning` [B] > 0, with a slot), the last token of each of
    its bad words set to -inf where the tokens it generated last equal the word's other tokens (a one-token word:
    always), as vLLM bans them; the tail compared is the slot's (`SlotState.tail`), which the step itself extends,
    so the newest token counts though the host has not read it. A word longer than the tokens generated so far plus
    one is not matched (its earlier tokens would lie in the prompt). Placed as `logits_BV` is."""
    def local(logits_bV, words_RX, tail_RT, slot_b, banning_b, specs):
        vocab, at_b = logits_bV.shape[-1], jnp.maximum(slot_b, 0)
        words_bNL = words_RX[at_b].reshape(-1, MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS)
        before_bNT, last_bN = words_bNL[..., :-1], words_bNL[..., -1]
        follows_bN = jnp.all((before_bNT < 0) | (before_bNT == tail_RT[at_b][:, None, :]), axis=-1)
        used_b1 = ((slot_b >= 0) & (banning_b > 0))[:, None]
        banned_bN = jnp.where(used_b1 & follows_bN & (last_bN >= 0), last_bN, vocab)
        hit_bV = jax.vmap(lambda ids: jnp.zeros(vocab, bool).at[ids].set(True, mode="drop"))(banned_bN)
        return jnp.where(hit_bV, -jnp.inf, logits_bV)

    args = [logits_BV, state.bad_words, state.tail, slot_B, rows.banning]
    out = run_sharded(local, args, [SLOT_TABLE] * 3 + [SLOT_ROWS] * 2, [(SLOT_TABLE, logits_BV.shape)], "bad words",
                      placement=placement)
    return placed_like(out, logits_BV)


def masking(rows, slot_B: jax.Array) -> jax.Array:
    """[B] bool: the rows with a slot and allowed-token bits (a grammar, allowed_token_ids)."""
    return (slot_B >= 0) & (rows.masked > 0)


def banning(rows, slot_B: jax.Array) -> jax.Array:
    """[B] bool: the rows with a slot and bad words."""
    return (slot_B >= 0) & (rows.banning > 0)


def penalized(rows, slot_B: jax.Array) -> jax.Array:
    """[B] bool: the rows with a slot and a presence, frequency or repetition penalty."""
    return (slot_B >= 0) & ((rows.presence != 0) | (rows.frequency != 0) | (rows.repetition != 1))


def biased(rows, slot_B: jax.Array, position_B: jax.Array) -> jax.Array:
    """[B] bool: the rows with a slot and a logit bias, or whose stop ids are masked at `position_B` (min_tokens)."""
    return (slot_B >= 0) & ((rows.biased > 0) | (position_B < rows.min_position))


def apply_penalties(logits_BV: jax.Array, state: SlotState, slot_B: jax.Array, rows,
                    placement: Placement | None = None) -> jax.Array:
    """The logits [B, V] (vocabulary whole) after each row's repetition penalty (ids of its prompt or its generated
    tokens: positive logits divided by it, negative ones multiplied), frequency penalty (minus it times each id's
    count among the generated tokens) and presence penalty (minus it for each id generated at least once), as vLLM
    applies them; `rows` holds presence, frequency and repetition [B]. Rows of slot -1 are left as they are. The
    result is placed as `logits_BV` is."""
    def local(logits_bV, counts_RV, prompt_RV, slot_b, presence_b, frequency_b, repetition_b, specs):
        used_b = slot_b >= 0
        at_b = jnp.maximum(slot_b, 0)
        counts_bV = jnp.where(used_b[:, None], counts_RV[at_b], 0)
        seen_bV = used_b[:, None] & (prompt_RV[at_b] | (counts_bV > 0))
        repetition_bV = jnp.where(seen_bV, repetition_b[:, None], 1.0)
        logits_bV = jnp.where(logits_bV > 0, logits_bV / repetition_bV, logits_bV * repetition_bV)
        return logits_bV - frequency_b[:, None] * counts_bV - presence_b[:, None] * (counts_bV > 0)

    args = [logits_BV, state.counts, state.prompt, slot_B, rows.presence, rows.frequency, rows.repetition]
    out = run_sharded(local, args, [SLOT_TABLE] * 3 + [SLOT_ROWS] * 4, [(SLOT_TABLE, logits_BV.shape)], "penalties",
                      placement=placement)
    return placed_like(out, logits_BV)


def apply_bias(logits_BV: jax.Array, state: SlotState, slot_B: jax.Array, rows, position_B: jax.Array,
               placement: Placement | None = None) -> jax.Array:
    """The logits [B, V] with each row's logit bias added (`rows.biased` [B] > 0: its slot's) and its slot's stop
    ids masked (-inf) while the new token's position `position_B` [B] is below `rows.min_position` [B] (the prompt's
    length plus min_tokens). Rows of slot -1 are left as they are. The result is placed as `logits_BV` is."""
    def local(logits_bV, ids_RK, bias_RK, stops_RS, slot_b, biased_b, stopping_b, specs):
        vocab = logits_bV.shape[-1]
        at_b, used_b = jnp.maximum(slot_b, 0), slot_b >= 0
        ids_bK = jnp.where((used_b & biased_b)[:, None] & (ids_RK[at_b] >= 0), ids_RK[at_b], vocab)
        added_bV = jax.vmap(lambda ids, values: jnp.zeros(vocab).at[ids].add(values, mode="drop"))(
            ids_bK, bias_RK[at_b])
        stops_bS = jnp.where((used_b & stopping_b)[:, None] & (stops_RS[at_b] >= 0), stops_RS[at_b], vocab)
        masked_bV = jax.vmap(lambda ids: jnp.zeros(vocab, bool).at[ids].set(True, mode="drop"))(stops_bS)
        return jnp.where(masked_bV, -jnp.inf, logits_bV + added_bV)

    args = [logits_BV, state.bias_ids, state.bias, state.stops, slot_B, rows.biased > 0,
            position_B < rows.min_position]
    out = run_sharded(local, args, [SLOT_TABLE] * 4 + [SLOT_ROWS] * 3, [(SLOT_TABLE, logits_BV.shape)], "logit bias",
                      placement=placement)
    return placed_like(out, logits_BV)


def record(state: SlotState, slot_B: jax.Array, token_B: jax.Array, rows,
           placement: Placement | None = None) -> SlotState:
    """`state` with each penalized row's sampled token [B] counted in its slot and each banning row's appended to
    its slot's tail (dropping the oldest), in place (scatters of B rows, none written where no row has a penalty or
    bad words: only those rows read them, and a sequence's slot is written afresh when it takes it); `rows` holds
    presence, frequency, repetition and banning [B]."""
    def local(counts_RV, tail_RT, slot_b, counted_b, banned_b, token_b, specs):
        counted_at_b = jnp.where(counted_b, slot_b, counts_RV.shape[0])
        banned_at_b = jnp.where(banned_b, slot_b, tail_RT.shape[0])
        tail_bT = jnp.concatenate([tail_RT[jnp.maximum(slot_b, 0)][:, 1:], token_b[:, None]], axis=1)
        return (counts_RV.at[counted_at_b, token_b].add(1, mode="drop"),
                tail_RT.at[banned_at_b].set(tail_bT, mode="drop"))

    counts, tail = run_sharded(local, [state.counts, state.tail, slot_B, penalized(rows, slot_B),
                                       banning(rows, slot_B), token_B],
                               [SLOT_TABLE, SLOT_TABLE] + [SLOT_ROWS] * 4,
                               [(SLOT_TABLE, state.counts.shape), (SLOT_TABLE, state.tail.shape)], "token counts",
                               placement=placement)
    return dataclasses.replace(state, counts=counts, tail=tail)


def keep_min_p(scaled_BV: jax.Array, min_p_B: jax.Array) -> jax.Array:
    """The temperature-scaled logits [B, V] with every token less likely than min_p [B] times the row's likeliest
    set to -inf (min_p 0 keeps all)."""
    floor_B1 = jnp.max(scaled_BV, axis=-1, keepdims=True) + jnp.log(jnp.maximum(min_p_B, 1e-30))[:, None]
    return jnp.where((min_p_B[:, None] > 0) & (scaled_BV < floor_B1), -jnp.inf, scaled_BV)


TOP_K_ROUND = 16
"""The most ids one `lax.top_k` of `top_logprobs` takes: on a GPU, XLA's top-k up to 16 runs its own kernel (0.59 ms
over 256 rows x 128,256 ids on an H200), where 20 costs a sort (2.4 ms)."""


def top_logprobs(logprob_BV: jax.Array, per_round: int | None = TOP_K_ROUND) -> tuple[jax.Array, jax.Array]:
    """The MAX_TOP_LOGPROBS likeliest ids [B, K] int32 and their log-probabilities [B, K] float32 of each row,
    best first, from the log-probabilities [B, V] (a vocabulary smaller than K, as test models have, padded with
    id 0 at -inf).

    In rounds of at most `per_round` ids (None: one `lax.top_k`): each round takes the best of what earlier rounds
    left, those set to -inf first. Exact, ties in `lax.top_k`'s order (the lower id first): ids at -inf are lifted
    to the lowest finite value beforehand, so a taken id ranks below every id not yet taken, and restored after."""
    count = min(MAX_TOP_LOGPROBS, logprob_BV.shape[-1])
    per_round = per_round or count
    floor = jnp.finfo(logprob_BV.dtype).min
    left_BV = jnp.maximum(logprob_BV, floor)
    values, ids = [], []
    for taken in range(0, count, per_round):
        value_BR, id_BR = jax.lax.top_k(left_BV, min(per_round, count - taken))
        values.append(value_BR)
        ids.append(id_BR)
        if taken + per_round < count:
            left_BV = _without_taken(left_BV, value_BR, id_BR)
    values_BK, ids_BK = jnp.concatenate(values, axis=-1), jnp.concatenate(ids, axis=-1)
    values_BK = jnp.where(values_BK <= floor, -jnp.inf, values_BK)
    short = MAX_TOP_LOGPROBS - count
    values_BK = jnp.pad(values_BK, ((0, 0), (0, short)), constant_values=-jnp.inf)
    return jnp.pad(ids_BK.astype(jnp.int32), ((0, 0), (0, short))), values_BK


def _without_taken(left_BV: jax.Array, value_BR: jax.Array, id_BR: jax.Array) -> jax.Array:
    """`left_BV` with the ids a `lax.top_k` round took [B, R] set to -inf, by comparison rather than a scatter (so
    any placement of the rows holds): every id above the round's last value, and of the ids equal to it those up to
    the highest such id taken (top-k takes ties lowest id first)."""
    last_B1 = value_BR[:, -1:]
    highest_B1 = jnp.max(jnp.where(value_BR == last_B1, id_BR, -1), axis=-1, keepdims=True)
    ids_1V = jnp.arange(left_BV.shape[-1])[None, :]
    taken_BV = (left_BV > last_B1) | ((left_BV == last_B1) & (ids_1V <= highest_B1))
    return jnp.where(taken_BV, -jnp.inf, left_BV)


def placed_like(x: jax.Array, like: jax.Array) -> jax.Array:
    """`x` placed as `like` is, read from `like`'s type: resharded where its mesh's axes are Explicit, the identity
    outside a mesh or on Auto axes (where XLA's propagation places it)."""
    return jax.sharding.reshard(x, jax.typeof(like).sharding.spec) if placed_explicitly(like) else x
