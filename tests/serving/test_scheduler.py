"""The scheduler over thousands of random admit / step / finish / cancel events, with pages running out: every
invariant holds after every event and the pools end empty. No arrays, no compiles."""
import random

import pytest

from starscream_jax.errors import StarscreamError
from starscream_jax.serving.pages import page_hashes
from starscream_jax.serving.scheduler import (SEEDS, SamplingParams, Scheduler, SchedulerConfig, Sequence, check_fits,
                                             engine_seed, sample_seeds)

CONFIG = SchedulerConfig(shards=2, pages_per_shard=9, page_size=4, rows_per_shard=3, token_budget=12, chunk=5,
                         prefill_rows=2)


def _sequence(name, prompt, max_tokens=8):
    return Sequence(request_id=name, prompt=prompt, params=SamplingParams(max_tokens=max_tokens), seed=0, arrival=0.0)


def _check_invariants(scheduler):
    held = {}
    for sequence in scheduler.running:
        assert 0 <= sequence.shard < CONFIG.shards
        assert len(sequence.pages) >= CONFIG.pages_for(sequence.computed)
        for page in sequence.pages:
            assert page != 0
            held.setdefault((sequence.shard, page), 0)
            held[(sequence.shard, page)] += 1
    for sequence in scheduler.waiting:
        assert sequence.pages == [] and sequence.shard == -1
    for index, shard in enumerate(scheduler.shards):
        assert shard.used == len({page for (where, page) in held if where == index})
        assert sum(1 for s in scheduler.running if s.shard == index) <= CONFIG.rows_per_shard


def _run_plan(scheduler, plan, rng):
    """What the engine does with a plan: chunks computed, a token appended where a chunk ends or a row decodes."""
    assert sum(chunk.count for chunk in plan.prefill) <= CONFIG.token_budget
    for shard in range(CONFIG.shards):
        assert sum(1 for chunk in plan.prefill if chunk.sequence.shard == shard) <= CONFIG.prefill_rows
    for chunk in plan.prefill:
        assert 1 <= chunk.count <= CONFIG.chunk
        assert CONFIG.pages_for(chunk.start + chunk.count) <= len(chunk.sequence.pages)
        scheduler.computed(chunk)
        if chunk.last:
            chunk.sequence.generated.append(rng.randrange(3))
    for sequence in plan.decode:
        assert CONFIG.pages_for(len(sequence.tokens)) <= len(sequence.pages)
        sequence.computed += 1
        sequence.generated.append(rng.randrange(3))
    for sequence in list(scheduler.running):
        if len(sequence.generated) >= sequence.params.max_tokens:
            scheduler.finish(sequence)


def test_random_events_leave_the_pools_empty():
    rng = random.Random(0)
    scheduler = Scheduler(CONFIG)
    known, preempted, shared = [], 0, 0
    system = [7, 7, 7, 7, 8, 8, 8, 8]  # two full pages many prompts share
    for event in range(4000):
        roll = rng.random()
        if roll < 0.3:
            prompt = (system if rng.random() < 0.5 else []) + [rng.randrange(3) for _ in range(rng.randrange(1, 14))]
            sequence = _sequence(f"r{event}", prompt, rng.randrange(1, 12))
            scheduler.add(sequence)
            known.append(sequence)
        elif roll < 0.4 and known:
            scheduler.finish(known.pop(rng.randrange(len(known))))  # cancel, wherever it is
        else:
            plan = scheduler.schedule()
            preempted += len(plan.preempted)
            _run_plan(scheduler, plan, rng)
        _check_invariants(scheduler)
    while scheduler.running or scheduler.waiting:
        _run_plan(scheduler, scheduler.schedule(), rng)
        _check_invariants(scheduler)
    assert scheduler.pages_used == 0
    assert all(shard.free == CONFIG.pages_per_shard - 1 for shard in scheduler.shards)
    assert preempted > 0  # pages ran out and the newest were recomputed, not failed
    shared = sum(shard.stats.hit_pages for shard in scheduler.shards)
    assert shared > 0


def test_preempted_sequence_is_recomputed_with_its_generated_tokens():
    scheduler = Scheduler(SchedulerConfig(shards=1, pages_per_shard=5, page_size=2, rows_per_shard=2,
                                          token_budget=8, chunk=8))
    old, new = _sequence("old", [1, 2, 3, 4, 5], 2), _sequence("new", [6, 7], 4)
    scheduler.add(old)
    scheduler.add(new)
    plan = scheduler.schedule()
    assert [chunk.sequence for chunk in plan.prefill] == [old, new]
    for chunk in plan.prefill:
        scheduler.computed(chunk)
        chunk.sequence.generated.append(0)
    # old's next position (5) is in its third page; new's (2) needs a second page, and the pool's 4 pages are
    # held: new, the newest, is preempted
    plan = scheduler.schedule()
    assert plan.preempted == (new,) and plan.decode == (old,)
    assert scheduler.waiting[0] is new and new.tokens == [6, 7, 0] and new.pages == []


def test_decoding_rows_leave_the_prompt_chunks_whole():
    """Decode rows run in a program of their own: the budget still takes two whole chunks beside two decoding rows
    (the prefill program pads a chunk to its full width, so splitting one would only add a step)."""
    scheduler = Scheduler(SchedulerConfig(shards=1, pages_per_shard=40, page_size=4, rows_per_shard=4,
                                          token_budget=8, chunk=4))
    first = [_sequence(name, [1, 2, 3, 4]) for name in ("a", "b")]
    for sequence in first:
        scheduler.add(sequence)
    for chunk in scheduler.schedule().prefill:
        scheduler.computed(chunk)
        chunk.sequence.generated.append(0)
    for name in ("c", "d"):
        scheduler.add(_sequence(name, [5, 6, 7, 8]))
    plan = scheduler.schedule()
    assert plan.decode == tuple(first)
    assert [(chunk.sequence.request_id, chunk.count) for chunk in plan.prefill] == [("c", 4), ("d", 4)]


def test_requests_that_cannot_fit_are_refused():
    scheduler = Scheduler(CONFIG)
    with pytest.raises(StarscreamError, match="needs 9 pages"):
        scheduler.add(_sequence("big", [1] * 30, 6))
    with pytest.raises(StarscreamError, match="exceed the model's context"):
        check_fits(30, 10, 32)
    with pytest.raises(StarscreamError, match="empty"):
        check_fits(0, 10, 32)
    with pytest.raises(StarscreamError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_a_sequence_hashes_each_prompt_page_once_and_alike():
    """Hashes asked for as the sequence grows equal the hashes of its whole prefix at once."""
    sequence = Sequence(request_id="s", prompt=list(range(10, 23)), params=SamplingParams(), seed=0, arrival=0.0)
    assert sequence.prefix_hashes(5, 4) == page_hashes(list(range(10, 14)), 4)
    sequence.generated += [7, 8, 9]
    assert sequence.prefix_hashes(16, 4) == page_hashes(sequence.tokens[:16], 4)
    assert sequence.prefix_hashes(3, 4) == []


def test_cache_salt_keeps_prefix_pages_to_requests_with_the_same_salt():
    """A prompt computed under one salt is found again under that salt only: not unsalted, not under another."""
    scheduler = Scheduler(SchedulerConfig(shards=1, pages_per_shard=20, page_size=2, rows_per_shard=4,
                                          token_budget=32, chunk=32))

    def admitted_hits(name, salt):
        sequence = Sequence(request_id=name, prompt=[1, 2, 3, 4, 5], params=SamplingParams(cache_salt=salt),
                            seed=0, arrival=0.0)
        scheduler.add(sequence)
        for chunk in scheduler.schedule().prefill:
            scheduler.computed(chunk)
        return sequence.pages, scheduler.shards[0].stats.hit_pages

    first, _ = admitted_hits("a", "tenant-a")
    assert admitted_hits("b", None)[1] == 0 and admitted_hits("c", "tenant-b")[1] == 0
    same, hits = admitted_hits("d", "tenant-a")
    assert hits == 2 and same[:2] == first[:2]
    with pytest.raises(StarscreamError, match="cache_salt"):
        SamplingParams(cache_salt="")


def test_seeds_of_any_64_bit_integer_fold_into_the_engines_range_and_samples_take_the_next_ones():
    """A seed in [0, 2**31) is the engine's as it is, any other 64-bit one folds into that range (distinct seeds
    apart); the samples of one prompt draw with the seed and those after it, wrapping at 2**31."""
    seeds = [engine_seed(seed) for seed in (0, 7, 2 ** 31 - 1, 2 ** 31, 2 ** 63 - 1, -1, -2 ** 63, 2 ** 40 + 7)]
    assert seeds[:3] == [0, 7, 2 ** 31 - 1] and all(0 <= seed < SEEDS for seed in seeds)
    assert len(set(seeds)) == len(seeds) and engine_seed(None) is None
    assert sample_seeds(5, 3) == [5, 6, 7] and sample_seeds(SEEDS - 1, 2) == [SEEDS - 1, 0]
    assert sample_seeds(None, 2) == [None, None]
