"""The serving step, compiled per bucket as two programs launched back to back, and the per-row sampling it ends with.

  forward     (params, rest, pages {"k", "v"[, "k_scale", "v_scale"]}, recent [shards * slots], StepInputs) ->
              (logits [B, V] at each row's last token, `SamplerRows`, pages, a scored prefill's scores): the tokens
              [B, S] of every row through the model over the paged KV cache (`Transformer.paged`, pages donated,
              written in place). A token the host does not know yet (-1, sampled by the step before and not read
              back) is read from the row's slot of `recent`, so the engine builds and launches the next step while
              this one runs. Decode runs it with S = 1 under the decode layout, prefill chunks with S > 1 under the
              prefill layout; both layouts place the pages alike, so neither copies the cache. A step that has both
              runs them as one mixed program (`MixedInputs`) under the prefill layout: every matmul over both
              groups' tokens at once, so the weights are read once a step, not twice (`model.paged.RowSplit`).
  sampler     (logits, `SamplerRows`, recent, slot state (`sampling.SlotState`), scores; `SamplerFeatures`, static)
              -> (outputs [B, F]: `Sampled` packed, tokens [B], log-probabilities [B] and the likeliest tokens
              [B, K], a scored prefill's `PromptScores` after them; recent, slot state): each row's next token drawn
              from its logits, left in its sequence's slot of `recent` (donated) and counted in the slot state
              (donated) where a row has a penalty. The host picks the passes each step needs (`SamplerFeatures.of`)
              and runs the sampler compiled with those alone, so neither program holds a conditional (whose
              predicate a GPU reads on the host, stalling the launch of the next step); a few small samplers per
              bucket of rows serve every combination.

A scored prefill is a program variant of its own, compiled at start only where the engine serves prompt
log-probabilities (`EngineConfig.prompt_logprobs`, `buckets.Buckets.scored`): it projects every position onto the
vocabulary ([B, S, V] logits, where the plain prefill projects one position a row), so its working memory must be known
before the page pools take the device memory left (`capacity.check_reserve` reads the compiled programs), and no request
waits behind a compile; a server that is not asked for it compiles and holds the programs it always did.

The pages' placement is the decode layout's, split into `cache_shards` shards (one page pool each); the prefill
layout must place them alike (`check_same_cache_placement`).

Shapes are bucketed (`buckets.Buckets`): rows per shard, positions per row (prefill) and pages per row round up to the
next bucket, so a server compiles each program (`buckets.Bucket`: phase, rows, positions, pages, and a mixed step's
chunk rows) once, at start, and holds `Buckets.programs()` of them. Sampling is per row: a masked row's allowed tokens
(grammar, allowed_token_ids), its bad words, then logit bias, the min_tokens mask and the penalties
(`serving.sampling`), then temperature 0 is greedy, else min_p, top-k, then top-p (nucleus) at the row's temperature,
the draw keyed by (row's seed, the new token's position) alone.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.tree_util import register_dataclass

from ..errors import StarscreamError
from ..hardware.backend import policy_of
from ..model.ops import run_sharded
from ..model.paged import PAGES, PagedCache, RowSplit, pool_shape
from ..sharding.apply import UNPLACED, Jitted, Placement, jit, placed_by
from ..sharding.layouts import PHASE_DEFAULTS, get_layout
from ..training.steps import decode_options, whole_vocabulary
from .sampling import (
    MAX_TOP_LOGPROBS,
    SlotState,
    apply_bad_words,
    apply_bias,
    apply_grammar,
    apply_penalties,
    banning,
    biased,
    keep_min_p,
    masking,
    penalized,
    placed_like,
    record,
    top_logprobs,
)

if TYPE_CHECKING:
    from .buckets import Bucket


PHASES = ("prefill", "decode", "scored", "mixed")
"""The steps an engine runs: a prefill of prompt chunks, a decode, a scored prefill (a prefill that also returns
its prompt's log-probabilities, `PromptScores`), and a mixed step (a step's decode rows and prompt chunks in one
program, `MixedInputs`)."""
LAYOUT_OF = {"prefill": "prefill", "decode": "decode", "scored": "prefill", "mixed": "prefill"}
"""Each phase's layout: a scored prefill runs as a prefill does, and so does a mixed step, whose matmuls run over
its chunks' tokens and its decode rows' at once (the chunks' tokens are most of them)."""


@register_dataclass
@dataclass(frozen=True, kw_only=True)
class RowSampling:
    """Each row's sampling settings [B]: temperature (0: greedy), top_p, top_k (0: off), seed; min_p (0: off);
    presence, frequency (0: off) and repetition (1: off) penalties; min_position (its stop ids are masked while
    the new token's position is below it: the prompt's length plus min_tokens; 0: off); biased (1: its slot's
    logit bias applies); top_logprobs (how many of the likeliest tokens it returns, at most
    `sampling.MAX_TOP_LOGPROBS`); masked (1: the allowed-token bits in its slot mask its logits: its grammar's,
    written before each step that samples it, its allowed_token_ids', or both intersected); banning (1: its slot's
    bad words apply). Those from min_p on read the row's slot (`sampling.SlotState`)."""

    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array
    seed: jax.Array
    min_p: jax.Array
    presence: jax.Array
    frequency: jax.Array
    repetition: jax.Array
    min_position: jax.Array
    biased: jax.Array
    top_logprobs: jax.Array
    masked: jax.Array
    banning: jax.Array

    @classmethod
    def neutral(cls, rows: int) -> RowSampling:
        """Host settings [rows] that ask for nothing: greedy, no filter, no penalty, no bias, no top tokens, no
        mask, no bad words."""
        f32, i32 = np.zeros((rows,), np.float32), np.zeros((rows,), np.int32)
        ones = np.ones((rows,), np.float32)
        return cls(temperature=f32.copy(), top_p=ones.copy(), top_k=i32.copy(), seed=i32.copy(), min_p=f32.copy(),
                   presence=f32.copy(), frequency=f32.copy(), repetition=ones.copy(), min_position=i32.copy(),
                   biased=i32.copy(), top_logprobs=i32.copy(), masked=i32.copy(), banning=i32.copy())


@register_dataclass
@dataclass(frozen=True)
class Sampled:
    """What a step returns per row: the token [B] int32, its log-probability under the model [B] float32, and the
    `sampling.MAX_TOP_LOGPROBS` likeliest tokens [B, K] int32 with their log-probabilities [B, K] float32 (zeros in
    a step where no row asks for them)."""

    token: jax.Array
    logprob: jax.Array
    top_token: jax.Array
    top_logprob: jax.Array

    def packed(self) -> jax.Array:
        """One int32 array [B, SAMPLED_COLUMNS] of every field (floats by their bits), so the host reads a step's
        outputs in one transfer."""
        return jnp.concatenate([_bits(self.token[:, None]), _bits(self.logprob[:, None]), _bits(self.top_token),
                                _bits(self.top_logprob)], axis=1)

    @staticmethod
    def unpacked(rows_BF: np.ndarray) -> Sampled:
        """The host's `Sampled` of a step's outputs [B, F] (numpy; its first SAMPLED_COLUMNS columns, `packed`)."""
        top = MAX_TOP_LOGPROBS
        return Sampled(rows_BF[:, 0], rows_BF[:, 1].view(np.float32), rows_BF[:, 2:2 + top],
                       rows_BF[:, 2 + top:SAMPLED_COLUMNS].view(np.float32))


SAMPLED_COLUMNS = 2 + 2 * MAX_TOP_LOGPROBS
"""Columns of `Sampled.packed`: token, log-probability, the likeliest tokens and theirs."""


def _bits(array_BX: jax.Array) -> jax.Array:
    """An int32 or float32 array as int32 (floats by their bits), for one packed output array."""
    return jax.lax.bitcast_convert_type(array_BX, jnp.int32) if array_BX.dtype != jnp.int32 else array_BX


@register_dataclass
@dataclass(frozen=True, kw_only=True)
class PromptScores:
    """A scored prefill's prompt log-probabilities per row and position [B, S]: the log-probability of the prompt
    token that follows the position (`StepInputs.following`; 0 where none does) and its rank in the vocabulary (1:
    the likeliest, as vLLM ranks), and the MAX_TOP_LOGPROBS likeliest tokens [B, S, K] with theirs. A few numbers
    a position: what the host reads of the [B, S, V] logits, which never leave the devices."""

    logprob: jax.Array
    rank: jax.Array
    top_token: jax.Array
    top_logprob: jax.Array

    def packed(self) -> jax.Array:
        """One int32 array [B, S * SAMPLED_COLUMNS] (per position: log-probability, rank, the likeliest tokens and
        theirs), placed after a step's `Sampled.packed` columns."""
        rows, width = self.rank.shape
        per_position = jnp.concatenate([_bits(self.logprob[..., None]), _bits(self.rank[..., None]),
                                        _bits(self.top_token), _bits(self.top_logprob)], axis=2)
        return per_position.reshape(rows, width * SAMPLED_COLUMNS)

    @staticmethod
    def unpacked(rows_BF: np.ndarray, width: int) -> PromptScores:
        """The host's scores of a scored step's outputs [B, F] (numpy) over `width` positions a row."""
        per_position = rows_BF[:, SAMPLED_COLUMNS:].reshape(rows_BF.shape[0], width, SAMPLED_COLUMNS)
        top = MAX_TOP_LOGPROBS
        return PromptScores(logprob=per_position[..., 0].view(np.float32), rank=per_position[..., 1],
                            top_token=per_position[..., 2:2 + top],
                            top_logprob=per_position[..., 2 + top:].view(np.float32))


SLOTS = ("attn_batch",)
"""The device token buffer [shards * slots_per_shard] and each row's slot [B]: split as the attention batch is, a
row's slot an index local to its shard (as its block table's pages are), so reading and writing it stay on one
device."""


@register_dataclass
@dataclass(frozen=True, kw_only=True)
class StepInputs:
    """One step's rows: tokens and positions [B, S] (position -1: padding; token -1: the row's sequence's newest
    token, still on the device in its slot), block tables [B, M], the index of each row's last token [B], the
    slot [B] its sampled token goes to (-1: none, for padding rows and prompt chunks that do not end their prompt)
    and its sampling; in a scored prefill only, `following` [B, S]: the prompt token after each position whose
    log-probability the row asks for (-1: none; the next chunk's first token at a chunk's last position), None in
    every other step (no column of it is packed). Rows are grouped by cache shard (shard s holds rows s * B /
    shards onwards)."""

    tokens: jax.Array
    positions: jax.Array
    table: jax.Array
    last: jax.Array
    slot: jax.Array
    sampling: RowSampling
    following: jax.Array | None = None

    @classmethod
    def zeros(cls, rows: int, width: int, pages: int, scored: bool = False) -> StepInputs:
        """Host inputs of one bucket with every row padding: no token, position -1, the null page, no slot,
        greedy, and where `scored` no position scored (every field's shape and dtype, for the engine, its compiles
        and the followers of `multihost`)."""
        row_i32 = np.zeros((rows,), np.int32)
        following = np.full((rows, width), -1, np.int32) if scored else None
        return cls(tokens=np.zeros((rows, width), np.int32), positions=np.full((rows, width), -1, np.int32),
                   table=np.zeros((rows, pages), np.int32), last=row_i32.copy(), slot=np.full((rows,), -1, np.int32),
                   sampling=RowSampling.neutral(rows), following=following)

    def features(self) -> SamplerFeatures:
        """The sampler passes these host rows need (`SamplerFeatures.of`)."""
        return SamplerFeatures.of(self.sampling, self.slot, self.positions[:, 0] + self.last + 1)

    def packed(self) -> PackedInputs:
        """These rows as one int32 array for one transfer (`PackedInputs.pack`)."""
        return PackedInputs.pack(self)


@register_dataclass
@dataclass(frozen=True)
class MixedInputs:
    """A mixed step's host inputs: its decode rows' `StepInputs` [Bd, 1] and its prompt chunks' [Bp, S], both with
    block tables of the same width and each grouped by cache shard as a step of its kind groups them. The step's
    outputs hold each shard's decode rows, then its chunks (`RowSplit`)."""

    decode: StepInputs
    prefill: StepInputs

    def features(self) -> SamplerFeatures:
        """The passes either group's rows need: one sampler draws them all."""
        return self.decode.features() | self.prefill.features()

    def packed(self) -> MixedPacked:
        """Each group packed for one transfer of its own."""
        return MixedPacked(self.decode.packed(), self.prefill.packed())


@register_dataclass
@dataclass(frozen=True)
class PackedInputs:
    """A step's `StepInputs` as one int32 array [B, F] (every field's columns side by side, floats by their bits),
    so a step costs the host one transfer however many fields the rows carry; `width` and `pages` (static) say
    how wide the tokens and the block tables are, `scored` (static) whether `following` is packed (a scored
    prefill, a program of its own). Rows are placed as the StepInputs' are."""

    columns: jax.Array
    width: int = field(metadata={"static": True})
    pages: int = field(metadata={"static": True})
    scored: bool = field(default=False, metadata={"static": True})

    @classmethod
    def pack(cls, inputs: StepInputs) -> PackedInputs:
        """The host inputs (numpy, every field [B] or [B, X] of a 4-byte type) packed."""
        rows, width = inputs.tokens.shape
        columns = [np.ascontiguousarray(leaf).reshape(rows, -1).view(np.int32) for leaf in jax.tree.leaves(inputs)]
        return cls(np.concatenate(columns, axis=1), width, inputs.table.shape[1], inputs.following is not None)

    @classmethod
    def abstract(cls, rows: int, width: int, pages: int, sharding=None, scored: bool = False) -> PackedInputs:
        """The packed inputs' shape and type for one bucket, on `sharding` (rows split; None: one device)."""
        columns = sum(leaf.size // rows for leaf in jax.tree.leaves(StepInputs.zeros(rows, width, pages, scored)))
        return cls(jax.ShapeDtypeStruct((rows, columns), jnp.int32, sharding=sharding), width, pages, scored)

    def unpacked(self) -> StepInputs:
        """The StepInputs again (inside the step: slices of the one array, floats bitcast back)."""
        rows = self.columns.shape[0]
        leaves, tree = jax.tree.flatten(StepInputs.zeros(rows, self.width, self.pages, self.scored))
        fields, start = [], 0
        for leaf in leaves:
            count = leaf.size // rows
            column = self.columns[:, start:start + count].reshape(leaf.shape)
            fields.append(column if leaf.dtype == np.int32 else jax.lax.bitcast_convert_type(column, leaf.dtype))
            start += count
        return jax.tree.unflatten(tree, fields)

    def model_rows(self, recent: jax.Array, placement: Placement) -> ModelRows:
        """What the model and the sampler read of these rows (inside the step), each -1 token read from its slot
        of `recent` (`with_slot_tokens`)."""
        inputs = self.unpacked()
        positions_B = inputs.positions[:, 0] + inputs.last  # a row's positions run on from its first
        return ModelRows(tokens=with_slot_tokens(inputs.tokens, recent, inputs.slot, placement),
                         positions=inputs.positions, last=inputs.last, table=inputs.table, split=None,
                         sampler=SamplerRows(sampling=inputs.sampling, position=positions_B + 1, slot=inputs.slot),
                         following=inputs.following)


@register_dataclass
@dataclass(frozen=True)
class MixedPacked:
    """A mixed step's `MixedInputs` on the devices: each group's `PackedInputs`, rows placed as a step of its kind
    places them."""

    decode: PackedInputs
    prefill: PackedInputs
    scored = False  # a scored prefill runs alone

    @classmethod
    def abstract(cls, bucket: Bucket, sharding=None) -> MixedPacked:
        """The packed inputs' shapes and types for a mixed `bucket`, on `sharding` (rows split; None: one device)."""
        return cls(PackedInputs.abstract(bucket.rows, 1, bucket.pages, sharding),
                   PackedInputs.abstract(bucket.chunks, bucket.width, bucket.pages, sharding))

    def model_rows(self, recent: jax.Array, placement: Placement) -> ModelRows:
        """The two groups as the model reads a mixed step (`model.paged.RowSplit`): each cache shard's stream of
        tokens and positions [shards, n] (its decode rows' tokens, then its chunks'), the index in its stream of
        each of its rows' last token [shards, R], and the block tables and sampler rows [shards * R, ...] of its
        decode rows, then its chunks. Joined on each device from its own rows: nothing moves between devices."""
        decode, prefill = (group.model_rows(recent, placement) for group in (self.decode, self.prefill))
        shards = cache_shards(placement.layout, placement.mesh) if placement.placed else 1
        split = RowSplit(decode.tokens.shape[0] // shards, prefill.tokens.shape[0] // shards, prefill.tokens.shape[1])
        row_leaves, tree = jax.tree.flatten((decode.table, decode.sampler))
        prefill_leaves = jax.tree.leaves((prefill.table, prefill.sampler))

        def local(decode_tokens, decode_positions, prefill_tokens, prefill_positions, prefill_last, *rows, specs):
            half = len(rows) // 2
            joined = [split.joined(first, second) for first, second in zip(rows[:half], rows[half:])]
            return (split.stream(decode_tokens, prefill_tokens), split.stream(decode_positions, prefill_positions),
                    split.last_tokens(prefill_last), *joined)

        stream = (shards, split.tokens)
        row_names = [_row_names(leaf) for leaf in row_leaves]
        outs = [(STREAM, stream), (STREAM, stream), (STREAM, (shards, split.decode + split.prefill))] + [
            (names, (leaf.shape[0] + second.shape[0], *leaf.shape[1:]))
            for names, leaf, second in zip(row_names, row_leaves, prefill_leaves)]
        tokens, positions, last, *rows = run_sharded(
            local, [decode.tokens, decode.positions, prefill.tokens, prefill.positions, prefill.last, *row_leaves,
                    *prefill_leaves], [STREAM] * 4 + [SLOTS] + row_names * 2, outs, "mixed step rows",
            placement=placement)
        table, sampler = jax.tree.unflatten(tree, rows)
        return ModelRows(tokens=tokens, positions=positions, last=last, table=table, split=split, sampler=sampler,
                         following=None)


STREAM = (SLOTS[0], None)
"""Rows of tokens [B, S] as the step's inputs place them: split as the attention batch is (a mixed step's streams
[shards, n] one a shard)."""


def _row_names(leaf: jax.Array) -> tuple:
    """The logical names of a per-row array [B, ...]: rows split as the attention batch is."""
    return SLOTS + (None,) * (leaf.ndim - 1)


@dataclass(frozen=True)
class ModelRows:
    """A step's rows as its forward program reads them: tokens and positions [B, S] (a mixed step's streams
    [shards, n]), each row's last token's index [B] (a mixed step's [shards, R]), block tables [R, M], the mixed
    step's `model.paged.RowSplit` (None in a step of one kind), what the sampler reads of each row, and a scored
    prefill's `following` [B, S] (else None)."""

    tokens: jax.Array
    positions: jax.Array
    last: jax.Array
    table: jax.Array
    split: RowSplit | None
    sampler: SamplerRows
    following: jax.Array | None


@dataclass(frozen=True, kw_only=True)
class SamplerFeatures:
    """Which optional passes a step's sampler runs (`sample_rows`), decided by the host from the rows' settings and
    compiled in (a static argument), so the compiled sampler holds no conditional: a GPU reads a conditional's
    predicate on the host, which makes the host wait for the step to reach it before it can launch the next one
    (measured: benchmarks/NOTES.md run 46). drawn: some row draws at a temperature above 0 (the sort of each row's
    logits); extras: some row has a mask (grammar, allowed_token_ids), bad words, a logit bias or min_tokens mask
    in force, or a penalty (the passes of `serving.sampling`, and the counts and tails the step keeps for them), or
    asks for its likeliest tokens. Two flags, so that a server compiles four samplers per bucket of rows at start:
    the plain and drawn ones most requests run, and each with every other pass. A pass that runs leaves the rows
    that do not use it as they are, so each is exact for every row whatever else the step holds."""

    drawn: bool = False
    extras: bool = False

    @classmethod
    def of(cls, rows: RowSampling, slot_B: np.ndarray, position_B: np.ndarray) -> SamplerFeatures:
        """The passes the host rows need: `rows` and `slot_B` [B] as a step's `StepInputs` hold them (numpy),
        `position_B` [B] each row's new token's position."""
        asked_B = (masking(rows, slot_B) | banning(rows, slot_B) | biased(rows, slot_B, position_B)
                   | penalized(rows, slot_B) | (rows.top_logprobs > 0))
        return cls(drawn=bool((rows.temperature > 0).any()), extras=bool(asked_B.any()))

    def __or__(self, other: SamplerFeatures) -> SamplerFeatures:
        """The passes either needs (a mixed step's two groups of rows)."""
        return SamplerFeatures(drawn=self.drawn or other.drawn, extras=self.extras or other.extras)

    @staticmethod
    def every() -> tuple[SamplerFeatures, ...]:
        """Every combination of the passes (what a server compiles at start for each bucket of rows)."""
        return tuple(SamplerFeatures(drawn=drawn, extras=extras) for drawn in (False, True) for extras in (False, True))


@register_dataclass
@dataclass(frozen=True, kw_only=True)
class SamplerRows:
    """What the sampler reads of a step's rows, as the forward program leaves it on the devices: each row's settings
    (`RowSampling` [B] fields), the position of the token it samples [B] and its slot [B] (-1: none)."""

    sampling: RowSampling
    position: jax.Array
    slot: jax.Array


def forward_step(graphdef, kernel: str, decode: bool = True, *, under: Placement | None,
                 eight_bit_weights: bool = False) -> Jitted:
    """The jitted model part of the paged step (see the module docstring) under `under` (`sharding.apply.jit`),
    its decode attention `kernel` (`model.paged.KERNELS`: the engine's, resolved from the backend policy); the pages
    are donated. (params, rest, pages, recent, packed `PackedInputs`, or a mixed step's `MixedPacked`) -> (logits
    [B, V] at each row's last token (a mixed step's rows: each shard's decode rows, then its chunks),
    `SamplerRows`, pages, and in a scored prefill the rows' `PromptScores.packed` [B, S * SAMPLED_COLUMNS], else
    None). Decode steps compile with the decode step's options (`training.steps.decode_options`: the backend
    policy's, and XLA's Triton GEMMs where `eight_bit_weights`), so that both decode paths build their matmuls alike."""
    placement = under or UNPLACED
    options = decode_options(policy_of(placement.device), eight_bit_weights) if decode else None

    @jit(under=under, ambient=False, donate_argnums=(2,), compiler_options=options)
    def step(params, rest, pages, recent, packed: PackedInputs | MixedPacked):
        rows = packed.model_rows(recent, placement)
        model = nnx.merge(graphdef, params, rest)
        cache = PagedCache(k=pages["k"], v=pages["v"], table=rows.table, kernel=kernel, k_scale=pages.get("k_scale"),
                           v_scale=pages.get("v_scale"), split=rows.split)
        logits_BV, cache, *every_BSV = model.paged(rows.tokens, rows.positions, rows.last, cache,
                                                   every_position=packed.scored, placement=placement)
        scores = score_prompt(every_BSV[0], rows.following, placement).packed() if packed.scored else None
        written = {"k": cache.k, "v": cache.v}
        if cache.k_scale is not None:
            written.update(k_scale=cache.k_scale, v_scale=cache.v_scale)
        return logits_BV, rows.sampler, written, scores

    return step


def sample_step(*, under: Placement | None) -> Jitted:
    """The jitted sampler of the paged step under `under`: (logits [B, V], `SamplerRows`, recent, slot state,
    scores [B, X] or None; `features`, static: `SamplerFeatures`) -> (outputs [B, F]: `Sampled.packed`, and a scored
    prefill's scores after its columns, one array for one transfer to the host; recent with each row's token at its
    slot; the slot state with the tokens counted), recent and the slot state donated. A program of its own beside
    the forward one, so that the host picks the passes each step runs (no conditional in either program), and a
    few small programs per bucket of rows serve every combination."""
    placement = under or UNPLACED

    @jit(under=under, ambient=False, donate_argnums=(2, 3), static_argnames=("features",))
    def sample(logits_BV, rows: SamplerRows, recent, slots: SlotState, scores, features: SamplerFeatures):
        sampled, slots = sample_rows(logits_BV, rows.sampling, rows.position, slots, rows.slot, features, placement)
        outputs = sampled.packed()
        if scores is not None:  # as the rows are placed (the forward program's output may name other axes of size 1)
            outputs = jnp.concatenate([outputs, placed_like(scores, outputs)], axis=1)
        return outputs, write_slots(recent, rows.slot, sampled.token, placement), slots

    return sample


def with_slot_tokens(tokens_BS: jax.Array, recent: jax.Array, slot_B: jax.Array,
                     placement: Placement | None = None) -> jax.Array:
    """The step's tokens [B, S] with each -1 replaced by recent[slot] of its row (0 where the slot is -1), each
    shard reading its own slots (SLOTS). Done inside one shard map, so the tokens keep their own placement whatever
    the rows' count (a select of two differently placed operands is refused under explicit mesh axes)."""
    def local(tokens_BS, recent_R, slot_B, specs):
        newest_B = jnp.where(slot_B >= 0, recent_R[jnp.maximum(slot_B, 0)], 0)
        return jnp.where(tokens_BS < 0, newest_B[:, None], tokens_BS)

    rows = (SLOTS[0], None)
    return run_sharded(local, [tokens_BS, recent, slot_B], [rows, SLOTS, SLOTS], [(rows, tokens_BS.shape)],
                       "slot tokens", placement=placement)


def write_slots(recent: jax.Array, slot_B: jax.Array, token_B: jax.Array,
                placement: Placement | None = None) -> jax.Array:
    """`recent` [shards * slots] with each row's token [B] written at its slot (rows of slot -1 write nothing)."""
    def local(recent_R, slot_B, token_B, specs):
        return recent_R.at[jnp.where(slot_B >= 0, slot_B, recent_R.shape[0])].set(token_B, mode="drop")

    return run_sharded(local, [recent, slot_B, token_B], [SLOTS, SLOTS, SLOTS], [(SLOTS, recent.shape)],
                       "slot tokens", placement=placement)


def sample_rows(logits_BV: jax.Array, rows: RowSampling, position_B: jax.Array, slots: SlotState,
                slot_B: jax.Array, features: SamplerFeatures,
                placement: Placement | None = None) -> tuple[Sampled, SlotState]:
    """Each row's next token, drawn for sequence position `position_B` [B] from the logits [B, V] (placed by the
    layout's ("batch", "vocab") rules) after its allowed-token bits, bad words, logit bias, min_tokens mask and
    penalties (`serving.sampling`, reading the row's slot `slot_B` [B] of `slots`, -1: none), with the model's
    log-probabilities of it and of the likeliest tokens (`Sampled`); `slots` with the tokens counted and the bad
    words' tails extended. Only the passes `features` names run (the host's choice, `SamplerFeatures.of`): a step
    of greedy, plain rows takes the argmax alone, the sort that drawing needs runs where some row draws."""
    placement = placed_by(placement)
    with jax.named_scope("sample"):
        logits_BV = whole_vocabulary(logits_BV, placement)
        rows, position_B, slot_B = jax.tree.map(lambda row_B: placement.constrain(row_B, ("batch",), "sampling"),
                                                (rows, position_B, slot_B))
        logprob_BV = jax.nn.log_softmax(logits_BV, axis=-1)  # the model's own, as vLLM returns them
        if features.extras:  # in vLLM's order: the grammar's mask before everything else
            logits_BV = apply_grammar(logits_BV, slots, slot_B, rows, placement)
            logits_BV = apply_bad_words(logits_BV, slots, slot_B, rows, placement)
            logits_BV = apply_bias(logits_BV, slots, slot_B, rows, position_B, placement)
            logits_BV = apply_penalties(logits_BV, slots, slot_B, rows, placement)
        token_B = _greedy(logits_BV)
        if features.drawn:
            token_B = _drawn(logits_BV, rows, position_B, token_B)
        if features.extras:
            top_token_BK, top_logprob_BK = top_logprobs(logprob_BV)
        else:  # zeros placed as the rows are
            top_logprob_BK = jnp.zeros_like(logprob_BV[:, :MAX_TOP_LOGPROBS])
            top_token_BK = top_logprob_BK.astype(jnp.int32)
        sampled = Sampled(token_B, _at_column(logprob_BV, token_B)[:, 0], top_token_BK, top_logprob_BK)
        return sampled, record(slots, slot_B, token_B, rows, placement) if features.extras else slots


def score_prompt(logits_BSV: jax.Array, following_BS: jax.Array, placement: Placement | None = None) -> PromptScores:
    """The prompt log-probabilities (`PromptScores`) of every position from its logits [B, S, V]: log_softmax over
    the whole vocabulary (the positions as rows [B * S, V], gathered as the sampler gathers a row,
    `whole_vocabulary`), the log-probability and rank of the token that follows it, `following_BS` [B, S] (-1:
    none, read as token 0), and the likeliest tokens (`sampling.top_logprobs`)."""
    with jax.named_scope("prompt_logprobs"):
        rows, width, vocab = logits_BSV.shape
        placement = placed_by(placement)
        logprob_NV = jax.nn.log_softmax(whole_vocabulary(logits_BSV.reshape(rows * width, vocab), placement), axis=-1)
        following_N = placement.constrain(following_BS.reshape(rows * width), ("batch",), "prompt tokens")
        logprob_N = _at_column(logprob_NV, jnp.maximum(following_N, 0))[:, 0]
        rank_N = 1 + jnp.sum(logprob_NV > logprob_N[:, None], axis=-1, dtype=jnp.int32)
        top_token_NK, top_logprob_NK = top_logprobs(logprob_NV)
        return PromptScores(logprob=logprob_N.reshape(rows, width), rank=rank_N.reshape(rows, width),
                            top_token=top_token_NK.reshape(rows, width, -1),
                            top_logprob=top_logprob_NK.reshape(rows, width, -1))


def _greedy(logits_BV):
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)


def _drawn(logits_BV, rows: RowSampling, position_B, greedy_B):
    """Each row's draw at its temperature from its top-k, then top-p, tokens (greedy where temperature is 0). The
    nucleus always holds the most likely token: a top_p that flushes to zero (1e-38, below float32's normal range)
    would otherwise keep none, and the draw from no token at all would be token 0."""
    vocab = logits_BV.shape[-1]
    scaled_BV = keep_min_p(logits_BV / jnp.maximum(rows.temperature, 1e-6)[:, None], rows.min_p)
    descending_BV = jnp.sort(scaled_BV, axis=-1)[:, ::-1]
    k_B = jnp.where(rows.top_k > 0, jnp.minimum(rows.top_k, vocab), vocab)
    kth_B1 = _at_column(descending_BV, k_B - 1)
    top_k_BV = jnp.where(descending_BV >= kth_B1, descending_BV, -jnp.inf)
    probabilities_BV = jax.nn.softmax(top_k_BV, axis=-1)
    mass_before_BV = jnp.cumsum(probabilities_BV, axis=-1) - probabilities_BV
    first_BV = jnp.arange(vocab)[None, :] == 0
    kept_BV = ((mass_before_BV < rows.top_p[:, None]) | first_BV) & (descending_BV >= kth_B1)
    smallest_B1 = jnp.min(jnp.where(kept_BV, descending_BV, jnp.inf), axis=-1, keepdims=True)
    nucleus_BV = jnp.where(scaled_BV >= smallest_B1, scaled_BV, -jnp.inf)
    keys = jax.vmap(lambda seed, position: jax.random.fold_in(jax.random.key(seed), position))(rows.seed, position_B)
    drawn_B = jax.vmap(lambda key, row: jax.random.categorical(key, row))(keys, nucleus_BV).astype(jnp.int32)
    return jnp.where(rows.temperature > 0, drawn_B, greedy_B)


def _at_column(values_BV: jax.Array, column_B: jax.Array) -> jax.Array:
    """values[b, column[b]] as [B, 1], by a select and a row maximum: elementwise over the rows however they are
    placed (a gather's output placement is ambiguous where the rows split over a mesh axis of size 1)."""
    hit_BV = jnp.arange(values_BV.shape[-1])[None, :] == column_B[:, None]
    return jnp.max(jnp.where(hit_BV, values_BV, -jnp.inf), axis=-1, keepdims=True)


def cache_shards(layout, mesh) -> int:
    """How many shards a layout splits the attention batch (and the page pool) into on `mesh` (1 without one)."""
    if mesh is None:
        return 1
    _, axes = get_layout(layout).activations.lookup("attn_batch")
    return math.prod(mesh.shape[axis] for axis in axes)


def check_same_cache_placement(layouts: dict, mesh, c, shards: int) -> None:
    """The prefill and decode layouts must place the page pools alike (else every step would copy the cache; the
    placement does not depend on the pool's size)."""
    every = math.lcm(shards, *(cache_shards(layout, mesh) for layout in layouts.values()))
    shape = pool_shape(2 * every, 16, c.n_kv_heads, c.head_dim)  # (pages that each layout's shards divide)
    specs = {}
    for phase, layout in layouts.items():
        if layout.splits_sequence:
            raise StarscreamError(f"layout {layout.name} splits the sequence and cannot serve from a KV cache; prefill "
                                  f"with {PHASE_DEFAULTS['prefill']} and decode with {PHASE_DEFAULTS['decode']}")
        specs[phase] = Placement(layout, mesh).activation_spec(PAGES, shape, "kv pages")
    if specs["prefill"] != specs["decode"] or cache_shards(layouts["prefill"], mesh) != shards:
        raise StarscreamError(f"prefill layout {layouts['prefill'].name} places the KV pages as {specs['prefill']} and "
                              f"decode layout {layouts['decode'].name} as {specs['decode']}; serve with layouts that "
                              "place the cache alike (e.g. starscream_tp and starscream_decode)")
