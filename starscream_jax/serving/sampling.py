"""What the serving step does to a row's logits before it draws, as vLLM defines each setting, and the per-slot
device state the settings need. Everything runs inside the compiled step; nothing crosses to the host per token.

Order, as vLLM's sampler applies them: `logit_bias` added and the stop tokens masked while fewer than
`min_tokens` are generated (`apply_bias`), then the repetition, frequency and presence penalties
(`apply_penalties`), then temperature, `min_p`, top-k and top-p (`keep_min_p` inside the step's draw). The
log-probabilities returned (the chosen token's and the `top_logprobs` best, `top_logprobs`) are the model's own,
before any of these.

`SlotState` holds, for every slot of every cache shard (a running sequence holds one slot of its shard, its index local
to the shard, `Sequence.slot`), the counts of its generated tokens per vocabulary id [slots, V] int32, which ids its
prompt holds [slots, V] bool, its logit bias as (id, value) pairs [slots, MAX_LOGIT_BIAS] and its stop ids [slots,
MAX_STOP_IDS] (-1: none), and the allowed-token bits of a guided row's next token [slots, W] int32 (structured output,
`serving.guided`: W = ceil(V / 32) words, bit v % 32 of word v // 32 for token v). Its slots are split as the attention
batch is (`SLOT_TABLE`), as the step's rows are: shard s's rows read and write only shard s's slots, on the device that
holds both (`run_sharded`), so no slot is stored twice and none moves. The host writes a slot's row once, when a
sequence that uses these settings takes it (`reset_slot`, with `SlotReset.of`); the step counts each penalized row's
sampled token itself (`record`, a scatter of B ones). A guided row's bits change with every token it takes, so the host
writes them before each step that samples it, after reading its previous token (`write_masks`, one scatter of the guided
rows' masks); the step then sets every token a guided row's grammar forbids to -inf before anything else
(`apply_grammar`), as vLLM applies its grammar bitmask. A step none of whose rows uses a setting skips its work
(`jax.lax.cond`).
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
from ..sharding.apply import active
from .guided import mask_words
from .scheduler import MAX_LOGIT_BIAS, MAX_STOP_IDS, MAX_TOP_LOGPROBS

SLOT_ROWS = ("attn_batch",)
"""A step's rows [B] and the slot of each, split as the attention batch is."""
SLOT_TABLE = ("attn_batch", None)
"""Each `SlotState` array: slots split as the attention batch is (a shard's slots on its device), the rest whole."""


RESET_FIELDS = ("counts", "prompt", "bias_ids", "bias", "stops")
"""The fields of `SlotState` a `SlotReset` writes (`reset_slot`), as its own fields of those names."""


@register_dataclass
@dataclass(frozen=True, kw_only=True)
class SlotState:
    """Per slot of every cache shard (see the module docstring): counts [slots, V] int32 of generated tokens,
    prompt [slots, V] bool, bias_ids [slots, MAX_LOGIT_BIAS] int32 and bias [slots, MAX_LOGIT_BIAS] float32 (the
    logit bias, id -1: none), stops [slots, MAX_STOP_IDS] int32 (-1: none), allowed [slots, ceil(V / 32)] int32
    (a guided row's allowed-token bits). `slots` is shards * slots per shard."""

    counts: jax.Array
    prompt: jax.Array
    bias_ids: jax.Array
    bias: jax.Array
    stops: jax.Array
    allowed: jax.Array

    @staticmethod
    def shapes(slots: int, vocab: int) -> SlotState:
        """Each array's (shape, dtype), as a SlotState of `jax.ShapeDtypeStruct`s without placement."""
        def spec(width, dtype):
            return jax.ShapeDtypeStruct((slots, width), dtype)

        return SlotState(counts=spec(vocab, jnp.int32), prompt=spec(vocab, jnp.bool_),
                         bias_ids=spec(MAX_LOGIT_BIAS, jnp.int32), bias=spec(MAX_LOGIT_BIAS, jnp.float32),
                         stops=spec(MAX_STOP_IDS, jnp.int32), allowed=spec(mask_words(vocab), jnp.int32))

    @staticmethod
    def abstract(slots: int, vocab: int, sharding=None) -> SlotState:
        """The state's shapes and types on `sharding` (a NamedSharding by SLOT_TABLE; None: the default device)."""
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
                            SlotState.shapes(slots, vocab))

    @staticmethod
    def empty(slots: int, vocab: int, sharding=None) -> SlotState:
        """Every slot cleared (no counts, no prompt, no bias or stop ids, every token allowed), on `sharding`."""
        shapes = SlotState.shapes(slots, vocab)
        fills = {"counts": 0, "prompt": False, "bias_ids": -1, "bias": 0.0, "stops": -1, "allowed": -1}
        return SlotState(**{name: jnp.full(getattr(shapes, name).shape, fill, getattr(shapes, name).dtype,
                                           device=sharding) for name, fill in fills.items()})


@register_dataclass
@dataclass(frozen=True, kw_only=True)
class SlotReset:
    """One slot's new row, written by `reset_slot`: `slot` (a scalar, shard * slots per shard + the sequence's
    slot), counts [V] of its generated tokens so far (more than none after a preemption), prompt [V] (1: the id is
    in the prompt; int32, as `multihost` broadcasts it),
    bias_ids / bias [MAX_LOGIT_BIAS], stops [MAX_STOP_IDS] (-1: none). Host arrays, built by `of`."""

    slot: np.ndarray
    counts: np.ndarray
    prompt: np.ndarray
    bias_ids: np.ndarray
    bias: np.ndarray
    stops: np.ndarray

    @classmethod
    def of(cls, slot: int, vocab: int, prompt: list[int], generated: list[int], logit_bias=(), stops=()) -> SlotReset:
        """The row of a sequence of `prompt` and `generated` tokens, with `logit_bias` ((id, value) pairs) and
        `stops` (stop token ids masked while min_tokens are not reached); StarscreamError beyond what a slot holds."""
        if len(logit_bias) > MAX_LOGIT_BIAS:
            raise StarscreamError(f"logit_bias holds {len(logit_bias)} entries; give at most {MAX_LOGIT_BIAS}")
        if len(stops) > MAX_STOP_IDS:
            raise StarscreamError(f"{len(stops)} stop token ids with min_tokens; give at most {MAX_STOP_IDS}")
        bias_ids, bias = np.full(MAX_LOGIT_BIAS, -1, np.int32), np.zeros(MAX_LOGIT_BIAS, np.float32)
        for index, (token, value) in enumerate(logit_bias):
            bias_ids[index], bias[index] = token, value
        stop_ids = np.full(MAX_STOP_IDS, -1, np.int32)
        stop_ids[:len(stops)] = stops
        present = np.zeros(vocab, np.int32)
        present[np.asarray(prompt, np.int64)] = 1
        counts = np.bincount(np.asarray(generated, np.int64), minlength=vocab).astype(np.int32)
        return cls(slot=np.asarray(slot, np.int32), counts=counts, prompt=present, bias_ids=bias_ids, bias=bias,
                   stops=stop_ids)


def reset_slot(state: SlotState, reset: SlotReset) -> SlotState:
    """`state` with slot `reset.slot`'s row replaced by `reset`'s (jit it with `state` donated: an update in
    place); each shard writes only if the slot is its own."""
    def local(*arrays, specs):
        (slot, *rows), local_slots = arrays[5:], arrays[0].shape[0]
        at = _local_index(slot, local_slots, specs)
        return tuple(array.at[at].set(row.astype(array.dtype), mode="drop") for array, row in zip(arrays[:5], rows))

    written = [getattr(state, name) for name in RESET_FIELDS]  # the allowed bits are `write_masks`'
    fields = (reset.slot, reset.counts, reset.prompt, reset.bias_ids, reset.bias, reset.stops)
    out = run_sharded(local, [*written, *fields], [SLOT_TABLE] * 5 + [None] * 6,
                      [(SLOT_TABLE, array.shape) for array in written], "slot state")
    return dataclasses.replace(state, **dict(zip(RESET_FIELDS, out)))


def _local_index(slot, local_slots: int, specs):
    """Global slot index (scalar or [K]) -> its index among this shard's `local_slots` slots, or `local_slots`
    (out of range: a scatter with mode="drop" writes nothing) where another shard owns it or it is -1."""
    axes = specs[0][0] if len(specs[0]) else None
    first = jax.lax.axis_index(axes) * local_slots if axes else 0
    return jnp.where((slot >= first) & (slot < first + local_slots), slot - first, local_slots)


def write_masks(state: SlotState, slot_K: jax.Array, masks_KW: jax.Array) -> SlotState:
    """`state` with the allowed-token bits of slots `slot_K` [K] int32 (global indices, -1: none) replaced by
    `masks_KW` [K, W] int32 (jit it with `state` donated: an update in place). The K rows cross to every device
    whole (a few KB) and each shard keeps the slots that are its own, so the bits land beside the rows that read
    them. K is bucketed by the engine, so a handful of these small programs serve every step."""
    def local(allowed_RW, slot_K, masks_KW, specs):
        return allowed_RW.at[_local_index(slot_K, allowed_RW.shape[0], specs)].set(masks_KW, mode="drop")

    allowed = run_sharded(local, [state.allowed, slot_K, masks_KW], [SLOT_TABLE, None, None],
                          [(SLOT_TABLE, state.allowed.shape)], "grammar masks")
    return dataclasses.replace(state, allowed=allowed)


def apply_grammar(logits_BV: jax.Array, state: SlotState, slot_B: jax.Array, rows) -> jax.Array:
    """The logits [B, V] with every token the grammar of a guided row (`rows.guided` [B] > 0, with a slot) does not
    allow set to -inf, from its slot's bits (`SlotState.allowed`); other rows are left as they are, and a step with
    no guided row skips the work. Placed as `logits_BV` is."""
    def mask(logits_BV):
        def local(logits_bV, allowed_RW, slot_b, guided_b, specs):
            vocab = logits_bV.shape[-1]
            ids_V = jnp.arange(vocab)
            words_bV = allowed_RW[jnp.maximum(slot_b, 0)][:, ids_V // 32]
            allowed_bV = ((words_bV >> (ids_V % 32)[None, :]) & 1) > 0
            keep_bV = allowed_bV | ~((slot_b >= 0) & (guided_b > 0))[:, None]
            return jnp.where(keep_bV, logits_bV, -jnp.inf)

        out = run_sharded(local, [logits_BV, state.allowed, slot_B, rows.guided],
                          [SLOT_TABLE, SLOT_TABLE, SLOT_ROWS, SLOT_ROWS], [(SLOT_TABLE, logits_BV.shape)], "grammar")
        return _like(out, logits_BV)

    return jax.lax.cond(jnp.any((rows.guided > 0) & (slot_B >= 0)), mask, lambda logits: logits, logits_BV)


def penalized(rows, slot_B: jax.Array) -> jax.Array:
    """[B] bool: the rows with a slot and a presence, frequency or repetition penalty."""
    return (slot_B >= 0) & ((rows.presence != 0) | (rows.frequency != 0) | (rows.repetition != 1))


def biased(rows, slot_B: jax.Array, position_B: jax.Array) -> jax.Array:
    """[B] bool: the rows with a slot and a logit bias, or whose stop ids are masked at `position_B` (min_tokens)."""
    return (slot_B >= 0) & ((rows.biased > 0) | (position_B < rows.min_position))


def apply_penalties(logits_BV: jax.Array, state: SlotState, slot_B: jax.Array, rows) -> jax.Array:
    """The logits [B, V] (vocabulary whole) after each row's repetition penalty (ids of its prompt or its generated
    tokens: positive logits divided by it, negative ones multiplied), frequency penalty (minus it times each id's
    count among the generated tokens) and presence penalty (minus it for each id generated at least once), as vLLM
    applies them; `rows` holds presence, frequency and repetition [B]. Rows of slot -1 are left as they are; a step
    where no row has a penalty skips the work. The result is placed as `logits_BV` is."""
    def penalize(logits_BV):
        def local(logits_bV, counts_RV, prompt_RV, slot_b, presence_b, frequency_b, repetition_b, specs):
            used_b = slot_b >= 0
            at_b = jnp.maximum(slot_b, 0)
            counts_bV = jnp.where(used_b[:, None], counts_RV[at_b], 0)
            seen_bV = used_b[:, None] & (prompt_RV[at_b] | (counts_bV > 0))
            repetition_bV = jnp.where(seen_bV, repetition_b[:, None], 1.0)
            logits_bV = jnp.where(logits_bV > 0, logits_bV / repetition_bV, logits_bV * repetition_bV)
            return logits_bV - frequency_b[:, None] * counts_bV - presence_b[:, None] * (counts_bV > 0)

        args = [logits_BV, state.counts, state.prompt, slot_B, rows.presence, rows.frequency, rows.repetition]
        out = run_sharded(local, args, [SLOT_TABLE] * 3 + [SLOT_ROWS] * 4, [(SLOT_TABLE, logits_BV.shape)],
                          "penalties")
        return _like(out, logits_BV)

    return jax.lax.cond(jnp.any(penalized(rows, slot_B)), penalize, lambda logits: logits, logits_BV)


def apply_bias(logits_BV: jax.Array, state: SlotState, slot_B: jax.Array, rows, position_B: jax.Array) -> jax.Array:
    """The logits [B, V] with each row's logit bias added (`rows.biased` [B] > 0: its slot's) and its slot's stop
    ids masked (-inf) while the new token's position `position_B` [B] is below `rows.min_position` [B] (the prompt's
    length plus min_tokens). Rows of slot -1 are left as they are; a step where no row has either skips the work.
    The result is placed as `logits_BV` is."""
    biased_B, stopping_B = rows.biased > 0, position_B < rows.min_position

    def bias(logits_BV):
        def local(logits_bV, ids_RK, bias_RK, stops_RS, slot_b, biased_b, stopping_b, specs):
            vocab = logits_bV.shape[-1]
            at_b, used_b = jnp.maximum(slot_b, 0), slot_b >= 0
            ids_bK = jnp.where((used_b & biased_b)[:, None] & (ids_RK[at_b] >= 0), ids_RK[at_b], vocab)
            added_bV = jax.vmap(lambda ids, values: jnp.zeros(vocab).at[ids].add(values, mode="drop"))(
                ids_bK, bias_RK[at_b])
            stops_bS = jnp.where((used_b & stopping_b)[:, None] & (stops_RS[at_b] >= 0), stops_RS[at_b], vocab)
            masked_bV = jax.vmap(lambda ids: jnp.zeros(vocab, bool).at[ids].set(True, mode="drop"))(stops_bS)
            return jnp.where(masked_bV, -jnp.inf, logits_bV + added_bV)

        args = [logits_BV, state.bias_ids, state.bias, state.stops, slot_B, biased_B, stopping_B]
        out = run_sharded(local, args, [SLOT_TABLE] * 4 + [SLOT_ROWS] * 3, [(SLOT_TABLE, logits_BV.shape)],
                          "logit bias")
        return _like(out, logits_BV)

    return jax.lax.cond(jnp.any(biased(rows, slot_B, position_B)), bias, lambda logits: logits, logits_BV)


def record(state: SlotState, slot_B: jax.Array, token_B: jax.Array, rows) -> SlotState:
    """`state` with each penalized row's sampled token [B] counted in its slot, in place (a scatter of B ones,
    none where no row has a penalty: only those rows read the counts, and a sequence's slot is written afresh
    when it takes it); `rows` holds presence, frequency and repetition [B]."""
    def local(counts_RV, slot_b, counted_b, token_b, specs):
        at_b = jnp.where(counted_b, slot_b, counts_RV.shape[0])
        return counts_RV.at[at_b, token_b].add(1, mode="drop")

    counts = run_sharded(local, [state.counts, slot_B, penalized(rows, slot_B), token_B],
                         [SLOT_TABLE, SLOT_ROWS, SLOT_ROWS, SLOT_ROWS], [(SLOT_TABLE, state.counts.shape)],
                         "token counts")
    return dataclasses.replace(state, counts=counts)


def keep_min_p(scaled_BV: jax.Array, min_p_B: jax.Array) -> jax.Array:
    """The temperature-scaled logits [B, V] with every token less likely than min_p [B] times the row's likeliest
    set to -inf (min_p 0 keeps all)."""
    floor_B1 = jnp.max(scaled_BV, axis=-1, keepdims=True) + jnp.log(jnp.maximum(min_p_B, 1e-30))[:, None]
    return jnp.where((min_p_B[:, None] > 0) & (scaled_BV < floor_B1), -jnp.inf, scaled_BV)


def top_logprobs(logprob_BV: jax.Array, count_B: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The MAX_TOP_LOGPROBS likeliest ids [B, K] int32 and their log-probabilities [B, K] float32 of each row,
    best first, from the log-probabilities [B, V]; zeros in a step where no row asks for any (`count_B` [B])."""
    def top(logprob_BV):
        values_BK, ids_BK = jax.lax.top_k(logprob_BV, min(MAX_TOP_LOGPROBS, logprob_BV.shape[-1]))
        short = MAX_TOP_LOGPROBS - values_BK.shape[-1]  # a vocabulary smaller than K (test models)
        values_BK = jnp.pad(values_BK, ((0, 0), (0, short)), constant_values=-jnp.inf)
        return jnp.pad(ids_BK.astype(jnp.int32), ((0, 0), (0, short))), values_BK

    def none(logprob_BV):  # zeros from the same ops over K columns (no [B, V] top-k): both branches' types match
        return tuple(jnp.zeros_like(result) for result in top(logprob_BV[:, :MAX_TOP_LOGPROBS]))

    return jax.lax.cond(jnp.any(count_B > 0), top, none, logprob_BV)


def _like(x: jax.Array, like: jax.Array) -> jax.Array:
    """`x` placed as `like` is under the active layout (identity outside one, or on Auto mesh axes, where XLA's
    propagation places it)."""
    current = active()
    if current is None or current.auto:
        return x
    return jax.sharding.reshard(x, jax.typeof(like).sharding.spec)
