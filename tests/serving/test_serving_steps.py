"""The serving step's per-row sampler (`serving.steps.sample_rows`, its passes chosen as the engine chooses them,
`SamplerFeatures.of`) and what it applies before drawing
(`serving.sampling`: penalties, logit bias, min_tokens, min_p, top log-probabilities, the per-slot state) on tiny
logits, compiled on the CPU: no model. Each setting is checked against a numpy reference of vLLM's definition.
(Named apart from tests/training/test_steps.py: pytest imports test modules by their file name.)"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from starscream_jax.errors import StarscreamError
from starscream_jax.hardware.mesh import build_mesh
from starscream_jax.serving.sampling import (
    MAX_LOGIT_BIAS,
    MAX_TOP_LOGPROBS,
    SlotReset,
    SlotState,
    apply_bias,
    apply_grammar,
    apply_penalties,
    record,
    reset_slot,
    top_logprobs,
    write_masks,
)
from starscream_jax.serving.steps import (
    PackedInputs,
    PromptScores,
    RowSampling,
    Sampled,
    SamplerFeatures,
    StepInputs,
    sample_rows,
)
from starscream_jax.sharding.apply import use_layout

B, V = 8, 32
SLOTS = 8


def rows_with(**settings) -> RowSampling:
    """Neutral settings for B rows, with `settings` ([B] values) in place."""
    neutral = RowSampling.neutral(B)
    return RowSampling(**{name: jnp.asarray(settings.get(name, getattr(neutral, name)),
                                            getattr(neutral, name).dtype) for name in neutral.__dataclass_fields__})


def sample(logits, rows, position, state, slot):
    """`sample_rows` jitted with the passes the host picks for these rows (`SamplerFeatures.of`), as the engine runs
    it."""
    features = SamplerFeatures.of(jax.tree.map(np.asarray, rows), np.asarray(slot), np.asarray(position))
    return jax.jit(sample_rows, static_argnums=5)(logits, rows, position, state, slot, features)


def filled_state(rng, prompt=None, generated=None, bias=(), stops=()) -> SlotState:
    """A state whose slot s holds prompt[s] and generated[s] (lists of ids), the same bias and stops in each."""
    state = SlotState.empty(SLOTS, V)
    for slot in range(SLOTS):
        reset = SlotReset.of(slot, V, prompt[slot] if prompt else [], generated[slot] if generated else [],
                             bias, stops)
        state = jax.jit(reset_slot)(state, reset)
    return state


def test_penalties_follow_vllms_definitions():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(B, V)).astype(np.float32) * 3
    prompt = [list(rng.integers(0, V, 5)) for _ in range(SLOTS)]
    generated = [list(rng.integers(0, V, 7)) for _ in range(SLOTS)]
    state = filled_state(rng, prompt, generated)
    slot = np.array([3, 0, 5, -1, 1, 2, 7, 6], np.int32)  # row 3 is padding: left alone
    presence, frequency = rng.uniform(-2, 2, B), rng.uniform(-2, 2, B)
    repetition = rng.uniform(0.5, 2, B)
    rows = rows_with(presence=presence, frequency=frequency, repetition=repetition)
    got = jax.jit(apply_penalties)(jnp.asarray(logits), state, jnp.asarray(slot), rows)

    want = logits.copy()
    for row, s in enumerate(slot):
        if s < 0:
            continue
        counts = np.bincount(generated[s], minlength=V)
        seen = (counts > 0) | np.isin(np.arange(V), prompt[s])
        penalty = np.where(seen, repetition[row], 1.0)
        want[row] = np.where(want[row] > 0, want[row] / penalty, want[row] * penalty)
        want[row] -= frequency[row] * counts + presence[row] * (counts > 0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not np.allclose(got[0], logits[0])  # the check can fail


def test_no_penalty_leaves_the_logits_and_the_counts_alone():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(B, V)), jnp.float32)
    state = filled_state(rng, generated=[[1, 1, 2]] * SLOTS)
    slot = jnp.arange(B, dtype=jnp.int32)
    np.testing.assert_array_equal(jax.jit(apply_penalties)(logits, state, slot, rows_with()), logits)
    unchanged = jax.jit(record)(state, slot, jnp.full((B,), 4, jnp.int32), rows_with())
    np.testing.assert_array_equal(unchanged.counts, state.counts)


def test_record_counts_each_sampled_token_in_its_slot():
    state = SlotState.empty(SLOTS, V)
    slot = jnp.asarray([2, -1, 0, 2, 5, 1, 3, 4][:B], jnp.int32)
    token = jnp.asarray([7, 9, 1, 7, 0, 31, 3, 3], jnp.int32)
    rows = rows_with(presence=np.full(B, 0.5))
    for _ in range(3):
        state = jax.jit(record)(state, slot, token, rows)
    want = np.zeros((SLOTS, V), np.int32)
    for s, t in zip(np.asarray(slot), np.asarray(token)):
        if s >= 0:
            want[s, t] += 3
    np.testing.assert_array_equal(state.counts, want)


def test_reset_writes_one_slot_and_counts_what_a_preempted_sequence_generated():
    state = jax.jit(reset_slot)(SlotState.empty(SLOTS, V), SlotReset.of(3, V, [1, 2, 2], [5, 5, 6], [(9, 1.5)], [0]))
    assert state.counts[3, 5] == 2 and state.counts[3, 6] == 1 and int(state.counts.sum()) == 3
    assert np.flatnonzero(state.prompt[3]).tolist() == [1, 2] and int(state.prompt.sum()) == 2
    assert state.bias_ids[3, 0] == 9 and state.bias[3, 0] == 1.5 and (state.bias_ids[3, 1:] == -1).all()
    assert state.stops[3, 0] == 0 and (state.stops[:3] == -1).all()


def test_logit_bias_forces_a_token_and_min_tokens_masks_the_stop_ids():
    rng = np.random.default_rng(2)
    logits = jnp.asarray(rng.normal(size=(B, V)), jnp.float32)
    greedy = np.asarray(jnp.argmax(logits, -1))
    forced = (greedy + 1) % V
    state = SlotState.empty(SLOTS, V)
    for s in range(SLOTS):
        bias = [(int(forced[s]), 100.0), (int(greedy[s]), -3.0)]
        state = jax.jit(reset_slot)(state, SlotReset.of(s, V, [1], [], bias, [int(greedy[s])]))
    slot, position = jnp.arange(B, dtype=jnp.int32), jnp.full((B,), 10, jnp.int32)
    biased = jax.jit(apply_bias)(logits, state, slot, rows_with(biased=np.ones(B)), position)
    want = np.asarray(logits).copy()
    want[np.arange(B), forced] += 100.0
    want[np.arange(B), greedy] -= 3.0
    np.testing.assert_allclose(biased, want, rtol=1e-6)
    sampled, _ = sample(logits, rows_with(biased=np.ones(B)), position, state, slot)
    np.testing.assert_array_equal(sampled.token, forced)
    # min_tokens: the stop id (here the greedy token) is masked while the new position is below min_position
    rows = rows_with(min_position=np.full(B, 11))
    masked, _ = sample(logits, rows, position, state, slot)
    second = np.argsort(np.asarray(logits), axis=-1)[:, -2]
    np.testing.assert_array_equal(masked.token, second)
    reached, _ = sample(logits, rows, position + 1, state, slot)
    np.testing.assert_array_equal(reached.token, greedy)
    # the log-probabilities returned are the model's, before bias and masks
    np.testing.assert_allclose(masked.logprob, jax.nn.log_softmax(logits)[np.arange(B), second], rtol=1e-6)


def test_min_p_keeps_only_tokens_near_the_likeliest():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.12, 0.08] + [1e-9] * (V - 4)] * B, jnp.float32))
    state, slot = SlotState.empty(SLOTS, V), jnp.arange(B, dtype=jnp.int32)
    drawn = set()
    for position in range(40):
        rows = rows_with(temperature=np.ones(B), min_p=np.full(B, 0.5), seed=np.arange(B))
        sampled, _ = sample(logits, rows, jnp.full((B,), position, jnp.int32), state, slot)
        drawn |= set(np.asarray(sampled.token).tolist())
    assert drawn == {0, 1}  # 0.12 and 0.08 are below half of 0.5


def test_top_logprobs_are_log_softmaxs_best():
    logits = jax.random.normal(jax.random.key(3), (B, V)) * 2
    state, slot = SlotState.empty(SLOTS, V), jnp.arange(B, dtype=jnp.int32)
    counts = np.array([0, 1, 5, 20, 0, 0, 2, 3])
    sampled, _ = sample(logits, rows_with(top_logprobs=counts), jnp.zeros((B,), jnp.int32), state, slot)
    want = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    order = np.argsort(-want, axis=-1)[:, :MAX_TOP_LOGPROBS]
    np.testing.assert_array_equal(sampled.top_token, order)
    np.testing.assert_allclose(sampled.top_logprob, np.take_along_axis(want, order, -1), rtol=1e-6)
    none, _ = sample(logits, rows_with(), jnp.zeros((B,), jnp.int32), state, slot)
    assert not np.asarray(none.top_logprob).any()  # skipped where no row asks


@pytest.mark.parametrize("vocab, per_round", [(1000, 16), (1000, 7), (24, 16)])
def test_top_logprobs_in_rounds_equal_one_top_k_ties_and_minus_infinity_included(vocab, per_round):
    values = np.round(np.asarray(jax.random.normal(jax.random.key(4), (4, vocab))), 1)  # many ties
    values[1, ::3] = -np.inf
    values[2, :] = 0.0  # every id tied: the lowest ids first
    values[3, :] = -np.inf
    values[3, [5, 9]] = [-1.0, -2.0]  # two ids possible: then every impossible id, the lowest first
    ids, best = top_logprobs(jnp.asarray(values), per_round=per_round)
    want_ids, want = top_logprobs(jnp.asarray(values), per_round=None)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(best, want)
    np.testing.assert_array_equal(want_ids[2], np.arange(MAX_TOP_LOGPROBS))
    np.testing.assert_array_equal(want_ids[3, :4], [5, 9, 0, 1])
    assert len(set(np.asarray(ids[3]).tolist())) == MAX_TOP_LOGPROBS


@pytest.mark.parametrize("setting, passes", [
    ({}, SamplerFeatures()), ({"temperature": 0.8}, SamplerFeatures(drawn=True)),
    ({"top_logprobs": 3}, SamplerFeatures(extras=True)), ({"presence": 0.5}, SamplerFeatures(extras=True)),
    ({"frequency": -0.5}, SamplerFeatures(extras=True)), ({"repetition": 1.2}, SamplerFeatures(extras=True)),
    ({"biased": 1}, SamplerFeatures(extras=True)), ({"masked": 1}, SamplerFeatures(extras=True)),
    ({"banning": 1}, SamplerFeatures(extras=True)),
    ({"min_position": 11}, SamplerFeatures(extras=True)), ({"min_position": 10}, SamplerFeatures()),
])
def test_the_host_picks_the_passes_one_row_needs(setting, passes):
    """One row of eight asks for a setting (the new token at position 10); the settings read from a slot ask for
    nothing where the row has none."""
    neutral = RowSampling.neutral(B)
    rows = RowSampling(**{name: getattr(neutral, name).copy() for name in neutral.__dataclass_fields__})
    for name, value in setting.items():
        getattr(rows, name)[3] = value
    position = np.full(B, 10, np.int32)
    assert SamplerFeatures.of(rows, np.arange(B, dtype=np.int32), position) == passes
    if passes.extras and "top_logprobs" not in setting:
        assert SamplerFeatures.of(rows, np.where(np.arange(B) == 3, -1, 0).astype(np.int32), position) == \
            SamplerFeatures()


def test_a_pass_that_runs_for_one_row_leaves_the_others_as_the_plain_sampler_does():
    """Penalties, bias, top log-probabilities and drawing in one step, each asked for by one row: every other row's
    token and log-probability equal the plain (greedy, no pass) sampler's."""
    rng = np.random.default_rng(6)
    logits = jnp.asarray(rng.normal(size=(B, V)), jnp.float32)
    state = filled_state(rng, [[1, 2]] * SLOTS, [[3, 3]] * SLOTS, [(4, 5.0)])
    slot, position = jnp.arange(B, dtype=jnp.int32), jnp.full((B,), 7, jnp.int32)
    rows = rows_with(presence=np.eye(B)[0], biased=np.eye(B)[1], top_logprobs=np.eye(B)[2] * 4,
                     temperature=np.eye(B)[3], seed=np.arange(B))
    mixed, _ = sample(logits, rows, position, state, slot)
    plain, _ = sample(logits, rows_with(), position, state, slot)
    assert SamplerFeatures.of(jax.tree.map(np.asarray, rows), np.asarray(slot), np.asarray(position)) == \
        SamplerFeatures(drawn=True, extras=True)
    np.testing.assert_array_equal(mixed.token[4:], plain.token[4:])
    np.testing.assert_array_equal(mixed.logprob[4:], plain.logprob[4:])
    assert mixed.token[1] == 4  # the biased row took its bias


def test_a_slot_refuses_more_bias_entries_than_it_holds():
    with pytest.raises(StarscreamError, match=f"logit_bias holds {MAX_LOGIT_BIAS + 1} entries"):
        SlotReset.of(0, V, [1], [], [(1, 1.0)] * (MAX_LOGIT_BIAS + 1))


@pytest.mark.parametrize("top_p", [1e-38, 0.0])
def test_a_nucleus_too_small_for_any_token_keeps_the_most_likely(top_p):
    """1e-38 flushes to 0 once compiled; a nucleus of the tokens whose mass before them is below it held none, and
    every row drew token 0 (a special token in most vocabularies)."""
    logits_BV = jax.random.normal(jax.random.key(0), (B, V)) * 3
    rows = rows_with(temperature=np.full(B, 0.7), top_p=np.full(B, top_p), seed=np.arange(B))
    sampled, _ = sample(logits_BV, rows, jnp.arange(B, dtype=jnp.int32), SlotState.empty(SLOTS, V),
                                      jnp.arange(B, dtype=jnp.int32))
    np.testing.assert_array_equal(sampled.token, jnp.argmax(logits_BV, axis=-1))
    np.testing.assert_allclose(sampled.logprob, jnp.max(jax.nn.log_softmax(logits_BV, axis=-1), axis=-1), rtol=1e-6)


def test_on_a_mesh_each_shard_reads_and_counts_its_own_slots():
    """Under the decode layout on the 1x2x4 mesh (4 cache shards of 2 slots; a row's slot local to its shard)
    the penalties, bias and counts equal the unsharded ones of the same global slots."""
    mesh = build_mesh("1x2x4")
    rng = np.random.default_rng(4)
    logits = jnp.asarray(rng.normal(size=(B, V)), jnp.float32)
    generated = [list(rng.integers(0, V, 6)) for _ in range(SLOTS)]
    state = filled_state(rng, [[1, 2]] * SLOTS, generated, [(5, 2.0)], [int(np.argmax(logits[0]))])
    local_slot = jnp.asarray([1, 0, 0, 1, 1, -1, 0, 1], jnp.int32)  # rows 2s, 2s+1 are shard s's
    global_slot = jnp.where(local_slot >= 0, local_slot + 2 * (jnp.arange(B) // 2), -1)
    rows = rows_with(presence=np.full(B, 0.7), frequency=np.full(B, 0.3), repetition=np.full(B, 1.3),
                     biased=np.ones(B), min_position=np.full(B, 5))
    position = jnp.full((B,), 3, jnp.int32)

    features = SamplerFeatures.of(jax.tree.map(np.asarray, rows), np.asarray(global_slot), np.asarray(position))

    def step(logits, state, slot):
        sampled, state = sample_rows(logits, rows, position, state, slot, features)
        return apply_penalties(apply_bias(logits, state, slot, rows, position), state, slot, rows), sampled, state

    want_logits, want, want_state = jax.jit(step)(logits, state, global_slot)
    with use_layout("starscream_decode", mesh):
        placed = jax.device_put(state, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "xcd"))))
        got_logits, got, got_state = jax.jit(step)(logits, placed, local_slot)
    np.testing.assert_allclose(got_logits, want_logits, rtol=1e-6)
    np.testing.assert_array_equal(got.token, want.token)
    np.testing.assert_array_equal(got_state.counts, want_state.counts)


def _bits(allowed_KV: np.ndarray) -> np.ndarray:
    """llguidance's layout of allowed-token masks [K, V] bool: [K, ceil(V / 32)] int32, bit v % 32 of word v // 32."""
    words = np.zeros((allowed_KV.shape[0], (allowed_KV.shape[1] + 31) // 32), np.uint32)
    for token in range(allowed_KV.shape[1]):
        words[:, token // 32] |= allowed_KV[:, token].astype(np.uint32) << np.uint32(token % 32)
    return words.view(np.int32)


@pytest.mark.parametrize("sharded", [False, True])
def test_grammar_masks_written_per_slot_mask_only_the_guided_rows(sharded):
    """Masks written into some slots (global indices; -1 writes nothing) set the forbidden tokens of each guided
    row to -inf and leave unguided rows and rows without a slot alone, whichever shard holds the slot (70 ids:
    three words, the last one partly used, the sign bit set)."""
    vocab, rng = 70, np.random.default_rng(5)
    allowed = rng.random((SLOTS, vocab)) < 0.3
    allowed[:, 31] = True  # a word's sign bit
    logits = jnp.asarray(rng.normal(size=(B, vocab)), jnp.float32)
    written = np.asarray([6, 1, 3, -1, 0, 2, 5, 7], np.int32)  # slot 4 keeps its default (every token)
    local_slot = np.asarray([1, 0, 0, 1, 0, -1, 0, 1], np.int32)  # rows 2s, 2s+1 are shard s's (as on the mesh)
    global_slot = np.where(local_slot >= 0, local_slot + 2 * (np.arange(B) // 2), -1)
    guided = np.asarray([1, 1, 0, 1, 1, 1, 0, 1], np.int32)
    masks = _bits(np.where((written >= 0)[:, None], allowed[np.maximum(written, 0)], False))  # -1: none
    allowed[4] = True
    want = np.where(allowed[np.maximum(global_slot, 0)] | ~((global_slot >= 0) & (guided > 0))[:, None],
                    np.asarray(logits), -np.inf)
    rows = rows_with(masked=guided)

    def step(state, slots, masks, slot):
        return apply_grammar(logits, write_masks(state, slots, masks), slot, rows)

    if not sharded:
        got = jax.jit(step)(SlotState.empty(SLOTS, vocab), written, masks, jnp.asarray(global_slot))
    else:
        mesh = build_mesh("1x2x4")
        with use_layout("starscream_decode", mesh):
            placed = jax.device_put(SlotState.empty(SLOTS, vocab),
                                    jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "xcd"))))
            got = jax.jit(step)(placed, written, masks, jnp.asarray(local_slot))
    np.testing.assert_array_equal(np.asarray(got), want)


def test_a_steps_inputs_and_outputs_cross_as_one_array_each_and_come_back_whole():
    """Every field of the step's inputs (ints and floats) and of its outputs survives packing into one int32 array
    and unpacking (the inputs' inside a compiled function, as the step unpacks them)."""
    rng = np.random.default_rng(0)
    inputs = StepInputs.zeros(4, 3, 5)
    for leaf in jax.tree.leaves(inputs):
        floats = leaf.dtype == np.float32
        leaf[...] = rng.standard_normal(leaf.shape) * 100 if floats else rng.integers(-5, 99, leaf.shape)
    packed = PackedInputs.pack(inputs)
    assert packed.columns.dtype == np.int32 and packed.columns.shape[0] == 4
    assert PackedInputs.abstract(4, 3, 5).columns.shape == packed.columns.shape
    back = jax.jit(lambda p: p.unpacked())(packed)
    for want, got in zip(jax.tree.leaves(inputs), jax.tree.leaves(back)):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got), want)
    sampled = Sampled(jnp.arange(4, dtype=jnp.int32), -jnp.arange(4, dtype=jnp.float32) / 3,
                      jnp.ones((4, MAX_TOP_LOGPROBS), jnp.int32), jnp.full((4, MAX_TOP_LOGPROBS), -0.5))
    host = Sampled.unpacked(np.asarray(jax.jit(Sampled.packed)(sampled)))
    for want, got in zip(jax.tree.leaves(sampled), jax.tree.leaves(host)):
        np.testing.assert_array_equal(got, np.asarray(want))


def test_a_scored_prefill_packs_its_following_tokens_and_returns_its_scores_after_the_sampled_columns():
    """A scored step's inputs carry `following` [B, S] (a plain step's pack none of it: their columns are as
    before), and its prompt scores [B, S] come back from the columns after `Sampled`'s."""
    inputs = StepInputs.zeros(4, 3, 5, scored=True)
    inputs.following[...] = np.arange(12).reshape(4, 3)
    packed = PackedInputs.pack(inputs)
    assert packed.scored and packed.columns.shape[1] == PackedInputs.abstract(4, 3, 5).columns.shape[1] + 3
    assert PackedInputs.abstract(4, 3, 5, scored=True).columns.shape == packed.columns.shape
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda p: p.unpacked().following)(packed)), inputs.following)
    rng = np.random.default_rng(1)
    scores = PromptScores(logprob=jnp.asarray(-rng.random((4, 3)), jnp.float32),
                          rank=jnp.arange(12, dtype=jnp.int32).reshape(4, 3),
                          top_token=jnp.asarray(rng.integers(0, 99, (4, 3, MAX_TOP_LOGPROBS)), jnp.int32),
                          top_logprob=jnp.asarray(-rng.random((4, 3, MAX_TOP_LOGPROBS)), jnp.float32))
    sampled = Sampled(jnp.arange(4, dtype=jnp.int32), -jnp.ones(4), jnp.ones((4, MAX_TOP_LOGPROBS), jnp.int32),
                      jnp.full((4, MAX_TOP_LOGPROBS), -0.5))
    outputs = np.asarray(jnp.concatenate([sampled.packed(), scores.packed()], axis=1))
    np.testing.assert_array_equal(Sampled.unpacked(outputs).token, np.arange(4))
    for want, got in zip(jax.tree.leaves(scores), jax.tree.leaves(PromptScores.unpacked(outputs, 3))):
        np.testing.assert_array_equal(got, np.asarray(want))


def test_the_paged_decode_step_compiles_with_the_decode_steps_options(monkeypatch):
    """The engine's decode programs take `training.steps.decode_options` as the decode step does (XLA's Triton
    GEMMs where the weights are 8-bit, on a backend that sets the option); its prefill and mixed programs take
    XLA's defaults."""
    from starscream_jax.serving import steps

    asked = []
    monkeypatch.setattr(steps, "decode_options", lambda policy, eight_bit: asked.append(eight_bit) or {})
    steps.forward_step(None, "gather", decode=True, under=None, eight_bit_weights=True)
    steps.forward_step(None, "gather", decode=True, under=None)
    steps.forward_step(None, "gather", decode=False, under=None, eight_bit_weights=True)
    assert asked == [True, False]
