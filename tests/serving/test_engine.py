"""The engine: greedy tokens equal `generate()`'s on (1,1,1), (1,2,4) and (2,2,2) meshes under the decode layouts,
with pages running out (preemption and recompute); requests one by one give the tokens of all at once; a seeded
request samples the same tokens whatever else runs; full prompt pages are shared by prefix; 8-bit pages; two
processes serving over one mesh; a step's prompt chunks and decode rows in one mixed program or in two. Each engine
compiles its programs once (conftest.engine_for) and every test reuses them."""
import dataclasses
import json
import sys
from collections import Counter
from pathlib import Path

import jax
import numpy as np
import pytest

from safetensors.numpy import load_file

from starscream_jax.analysis.hlo import parse_hlo
from starscream_jax.errors import StarscreamError
from starscream_jax.hardware.mesh import build_mesh
from starscream_jax.inference.generate import generate
from starscream_jax.model.hf_checkpoint import load_hf_model
from starscream_jax.serving.engine import Engine, EngineConfig, _held_length, _held_rows, _mixed_buckets
from starscream_jax.serving.scheduler import SamplingParams
from starscream_jax.serving.buckets import Buckets
from starscream_jax.serving.steps import MixedInputs, SamplerFeatures, StepInputs, cache_shards

ROWS, NEW_TOKENS = 8, 6
WORKER = Path(__file__).with_name("multihost_serve_worker.py")
PENALIZED = dict(repetition_penalty=1.8, presence_penalty=1.0, logit_bias=((7, -11.0),), min_tokens=2)
"""multihost_serve_worker.PENALIZED: settings that read each sequence's slot state."""
CASES = ("1x1x1", "1x2x4", "2x2x2", "1x2x4-flat", "1x2x4-apart")  # conftest.CASES: the meshes and layouts


@pytest.fixture(scope="module")
def prompts():
    return np.random.default_rng(0).integers(2, 384, (ROWS, 6))


@pytest.fixture(scope="module")
def reference(prompts, unsharded_llama):
    return generate(unsharded_llama, prompts, NEW_TOKENS).tokens.tolist()


SWEPT_ONLY = ("1x2x4-flat", "2x2x2")
"""Engines whose greedy tokens are checked with -m slow: a flat layout's (generate checks flat layouts) and the data
axis's (1 x 2 x 4 already serves from several cache shards)."""


@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.slow) if case in SWEPT_ONLY else case
                                  for case in CASES])
def test_greedy_tokens_equal_generate(engine_for, prompts, reference, case):
    engine = engine_for(case)
    assert engine.generate([list(p) for p in prompts], SamplingParams(max_tokens=NEW_TOKENS)) == reference
    stats = engine.stats()
    mixed = bool(engine.buckets.mixed_chunks)
    assert stats.programs == 2 + mixed and stats.pages_used == 0 and stats.running == stats.waiting == 0
    if case == "1x1x1":
        assert stats.preemptions > 0  # 8 x 3 pages asked of 12: the newest were recomputed


@pytest.mark.parametrize("family", ["gemma2", "mixtral"])
def test_gemma_2_and_routed_experts_serve_the_reference_tokens(family, run_staggered):
    """Gemma 2 (scaled and soft-capped scores, a window of 6 on alternate layers: paged attention in XLA's explicit
    form, the window passed 20 tokens before the end) and Mixtral (routed experts, each expert's weights read once
    per GPU under starscream_decode) served on 2 GPUs x 4 partitions: 4 rows of the fixture's prompt give the greedy
    tokens Hugging Face transformers generated (tests/fixtures/hf/<family>/reference.safetensors), at once and
    arriving while others decode (mixed steps)."""
    fixture = Path(__file__).parents[1] / "fixtures" / "hf" / family
    expected, mesh = load_file(fixture / "reference.safetensors"), build_mesh("1x2x4")
    shards = cache_shards("starscream_decode", mesh)
    config = EngineConfig(page_size=4, pages_per_shard=40, rows_per_shard=ROWS // shards, token_budget=64, chunk=8,
                          buckets=Buckets(rows=(ROWS // shards,), positions=(8,), pages=(16,)))
    engine = Engine(load_hf_model(fixture, "starscream_tp", mesh), config, mesh, "starscream_tp", "starscream_decode")
    generated = expected["generated_ids"].tolist()
    prompts = [expected["prompt_ids"].tolist()] * 4
    assert engine.generate(prompts, SamplingParams(max_tokens=len(generated))) == [generated] * 4
    assert len(expected["prompt_ids"]) + len(generated) > 6 + 8  # past the window, over two prompt chunks
    engine.use_prefix_caching(False)  # the later prompts' chunks computed, beside the earlier ones' decode rows
    assert run_staggered(engine, prompts, len(generated)) == [generated] * 4
    assert any(step.prefill_rows and step.decode_rows and step.programs == 1 for step in engine.step_times)


@pytest.mark.parametrize("case", ["1x2x4", "1x2x4-apart", "1x1x1", pytest.param("2x2x2", marks=pytest.mark.slow)])
def test_chunks_arriving_while_rows_decode_run_in_one_program_with_the_reference_tokens(engine_for, unsharded_llama,
                                                                                        run_staggered, case):
    """Requests that arrive while others decode: their prompt chunks (one of 3 positions, some of two chunks
    across steps, one shard holding more chunks than another) and the decode rows run in one mixed program a step
    (two with `EngineConfig.mixed_chunks` 0, and on one device where a step holds more chunks than the default mixed
    step's one), and every request's greedy tokens equal the unsharded model's."""
    _serve_arriving_prompts(engine_for(case), unsharded_llama, run_staggered, case)


@pytest.mark.gpu
def test_chunks_arriving_while_rows_decode_serve_the_reference_tokens_on_a_gpu(engine_for, unsharded_llama,
                                                                               run_staggered):
    """The same on one GPU (XLA:GPU's mixed program: the streams' reshapes, matmuls over both groups' tokens, both
    groups' attention), float32 matmuls at full precision as the unsharded reference computes them."""
    with jax.default_matmul_precision("highest"):
        _serve_arriving_prompts(engine_for("1x1x1"), unsharded_llama, run_staggered, "1x1x1")


def _serve_arriving_prompts(engine, unsharded_llama, run_staggered, case: str) -> None:
    """Eight prompts arriving two at a time on `engine` (`conftest.staggered`), the last sharing the first three
    pages of the third: the unsharded model's greedy tokens, and one program for each step of chunks and decode
    rows that the engine's mixed buckets hold, two for the others."""
    rng = np.random.default_rng(5)
    prompts = [list(rng.integers(2, 384, length)) for length in (6, 4, 13, 3, 16, 9, 20)]
    prompts.append(prompts[2][:12] + [5, 6, 7, 8, 9])  # prompt 2's first 3 pages cached: a chunk from position 12
    expected = [generate(unsharded_llama, np.asarray([prompt]), 4).tokens[0].tolist() for prompt in prompts]
    engine.step_times.clear()
    hits = engine.stats().prefix_hit_pages
    assert run_staggered(engine, prompts, 4) == expected
    if case != "1x1x1":  # (one device's 12 pages reuse a finished prompt's pages before the copy arrives)
        assert engine.stats().prefix_hit_pages >= hits + 3
    both = [step.programs for step in engine.step_times if step.prefill_rows and step.decode_rows]
    mixed = bool(engine.buckets.mixed_chunks)
    programs = {1, 2} if case == "1x1x1" else {1 if mixed else 2}  # 1x1x1: a mixed step of one chunk
    assert len(both) >= 2 and set(both) == programs
    if case == "1x1x1":
        assert all((step.programs == 1) == (step.prefill_rows == 1) for step in engine.step_times
                   if step.prefill_rows and step.decode_rows)
    assert engine.stats().pages_used == 0 and engine.stats().programs_after_start == 0
    if not mixed:
        with pytest.raises(StarscreamError, match="compiled no mixed steps"):
            engine.use_mixed_steps(True)


def test_steps_launched_ahead_give_the_tokens_of_steps_run_one_at_a_time(engine_for, prompts, reference):
    """With overlap a step's tokens are read after the next step launched (so the first step returns none); the
    tokens are those of an engine that reads each step's before the next, with preemption, a stop token that a
    sequence only learns of one step late, and seeded sampling."""
    ahead, sync = engine_for("1x1x1"), engine_for("1x1x1-sync")
    ahead.submit("first", [3, 4, 5], SamplingParams(max_tokens=2))
    sync.submit("first", [3, 4, 5], SamplingParams(max_tokens=2))
    assert ahead.step() == [] and [event.request_id for event in sync.step()] == ["first"]
    while ahead.busy or sync.busy:
        ahead.step(), sync.step()
    stop = reference[0][2]
    greedy = SamplingParams(max_tokens=NEW_TOKENS, stop_tokens=(stop,))
    expected = [row[:row.index(stop) + 1] if stop in row else row for row in reference]
    sampled = SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, top_k=50, seed=3)
    for engine in (ahead, sync):
        assert engine.generate([list(p) for p in prompts], greedy) == expected
        stats = engine.stats()
        assert stats.pages_used == 0 and stats.preemptions > 0 and not engine.busy
    assert ahead.generate([list(p) for p in prompts], sampled) == sync.generate([list(p) for p in prompts], sampled)
    assert sum(step.host_seconds for step in ahead.step_times) > 0


@pytest.mark.parametrize("case", ["1x2x4", pytest.param("2x2x2", marks=pytest.mark.slow)])
def test_a_mixed_step_moves_nothing_between_devices_to_join_or_split_its_stream(engine_for, case):
    """The compiled mixed program holds the prefill program's collectives, kind for kind (its streams are joined and
    split on each device from its own rows), and reads each weight once: its matmuls are the prefill program's, each
    over the whole stream of the device's shard (its decode rows' tokens and its chunks')."""
    engine = engine_for(case)
    programs = {bucket.phase: parse_hlo(program.as_text()) for bucket, program in engine._programs.items()}

    def collectives(program):
        return Counter((c.kind, c.count) for c in program.collectives)

    def weight_matmuls(program):  # (einsum, rows of tokens a device) of every matmul outside attention
        return [(dot.op_name.split("/")[-2], dot.m) for dot in program.dots if "/attention/" not in dot.op_name]

    assert collectives(programs["mixed"]) == collectives(programs["prefill"])
    stream = engine.buckets.rows[0] + engine.buckets.mixed_chunks[0] * engine.buckets.positions[-1]
    mixed, prefill = weight_matmuls(programs["mixed"]), weight_matmuls(programs["prefill"])
    assert [name for name, _ in mixed] == [name for name, _ in prefill]  # one matmul a weight, as in prefill
    assert {rows for name, rows in mixed if name != "bsd,vd->bsv"} == {stream}  # a shard's stream on each device


def test_no_program_of_a_step_holds_a_conditional(engine_for):
    """A GPU reads a conditional's predicate on the host, so a step holding one makes the host wait inside every
    launch for the device to reach it (benchmarks/NOTES.md run 46): the forward programs and every sampler the
    engine compiled at start (each combination of passes) are straight-line code."""
    engine = engine_for("1x2x4")
    texts = [engine.program(phase, inputs).as_text() for phase, inputs in (
        ("decode", StepInputs.zeros(ROWS, 1, 16)), ("prefill", StepInputs.zeros(ROWS, 8, 16)),
        ("mixed", MixedInputs(StepInputs.zeros(ROWS, 1, 16), StepInputs.zeros(ROWS, 8, 16))))]
    texts += [program.as_text() for program in engine._samplers.values()]
    assert engine.samplers == 3 * len(SamplerFeatures.every())  # decode's, prefill's and mixed rows, each combination
    assert engine.programs_at_start() == engine.buckets.programs() + engine.samplers  # the start's progress bar total
    assert not [text for text in texts if " conditional(" in text]


def test_one_by_one_equals_all_at_once(engine_for):
    engine = engine_for("1x2x4")
    rng = np.random.default_rng(1)
    prompts = [list(rng.integers(2, 384, length)) for length in (10, 3, 7, 9, 1)]  # 10 and 9: two chunks each
    together = engine.generate(prompts, SamplingParams(max_tokens=5))
    alone = [engine.generate([prompt], SamplingParams(max_tokens=5))[0] for prompt in prompts]
    assert together == alone
    assert engine.stats().programs == 3  # no shape outside the buckets compiled


def test_seeded_request_samples_alike_whatever_runs_beside_it(engine_for):
    engine = engine_for("1x2x4")
    params = SamplingParams(max_tokens=6, temperature=1.5, top_p=0.95, top_k=100, seed=5, logprobs=True)
    prompt = [5, 6, 7, 8]
    alone = engine.generate([prompt], params)[0]
    crowded = engine.generate([[11, 12], prompt, [9, 9, 9]], params)[1]
    assert alone == crowded
    others = {tuple(engine.generate([prompt], dataclasses.replace(params, seed=seed))[0]) for seed in (6, 7, 8)}
    assert others - {tuple(alone)}  # another seed, other tokens


def test_prefix_pages_are_shared_and_give_the_same_tokens(engine_for):
    engine = engine_for("1x2x4")
    prefix = list(range(40, 48))  # two full pages
    first, second = prefix + [1, 2], prefix + [3]
    cold = engine.generate([second], SamplingParams(max_tokens=4))[0]
    engine.generate([first], SamplingParams(max_tokens=4))
    hits = engine.stats().prefix_hit_pages
    assert engine.generate([second], SamplingParams(max_tokens=4))[0] == cold
    assert engine.stats().prefix_hit_pages == hits + 2


def test_cancel_frees_pages_and_bad_requests_are_refused(engine_for):
    engine = engine_for("1x2x4")
    engine.submit("a", [1, 2, 3], SamplingParams(max_tokens=8))
    engine.step()
    assert engine.stats().pages_used > 0
    with pytest.raises(StarscreamError, match="already running"):
        engine.submit("a", [1], SamplingParams())
    assert engine.cancel("a") and not engine.cancel("a")
    assert engine.stats().pages_used == 0 and not engine.busy
    with pytest.raises(StarscreamError, match="context"):
        engine.submit("b", [2] * 60, SamplingParams(max_tokens=8))


def test_an_8_bit_cache_decodes_close_to_the_full_precision_pages(engine_for, prompts, reference):
    """int8 pages (per position and kv head scales) on the 1x2x4 mesh, read by the pallas kernel: on this
    checkpoint every greedy token equals the full-precision engine's (as do all 8 x 32 of a longer run; e4m3 fp8
    pages keep 3 in 4); the pools take a quarter of the bytes, plus the scales."""
    full = engine_for("1x2x4")
    engine = engine_for("1x2x4-int8")
    tokens = engine.generate([list(p) for p in prompts], SamplingParams(max_tokens=NEW_TOKENS))
    assert tokens == reference
    assert {name: pool[0].dtype.name for name, pool in engine.pages.items()} == {
        "k": "int8", "v": "int8", "k_scale": "float32", "v_scale": "float32"}
    values = sum(pool.nbytes for name in ("k", "v") for pool in full.pages[name])
    head_dim = full.pages["k"][0].shape[-1]
    itemsize = full.pages["k"][0].dtype.itemsize
    assert engine.pool_bytes == values // itemsize + values // itemsize // head_dim * 4
    assert engine.stats().pages_used == 0



@pytest.mark.multiprocess
def test_two_processes_serve_the_tokens_of_one(engine_for, prompts, cpu_child_env, free_port, local_processes,
                                               run_staggered):
    """Two CPU processes of 4 devices each join the 1x2x4 mesh (its gpu axis across them, `multihost_serve_worker`):
    process 0 schedules and broadcasts every step (and each slot's penalty state), process 1 runs each; their
    greedy tokens, plain, under penalties and with prompts arriving while others decode (mixed steps), equal the
    single-process engine's on the same mesh."""
    coordinator = f"127.0.0.1:{free_port()}"
    outputs = local_processes([[sys.executable, str(WORKER), coordinator, str(process), json.dumps(prompts.tolist()),
                                str(NEW_TOKENS)] for process in range(2)], cpu_child_env(4), timeout=240)
    lines = [line.split(" ", 1) for stdout, _ in outputs for line in stdout.splitlines()
             if line.startswith(("tokens ", "penalized ", "staggered ", "followed "))]  # and gloo's messages
    reported = {kind: json.loads(value) for kind, value in lines}
    assert reported["followed"] >= NEW_TOKENS  # a prefill, then a decode step per further token at least
    single = engine_for("1x2x4").generate([list(p) for p in prompts], SamplingParams(max_tokens=NEW_TOKENS))
    assert reported["tokens"] == single
    penalized = engine_for("1x2x4").generate([list(p) for p in prompts],
                                             SamplingParams(max_tokens=NEW_TOKENS, **PENALIZED))
    assert reported["penalized"] == penalized and penalized != single
    assert reported["staggered"] == run_staggered(engine_for("1x2x4"), [list(p) for p in prompts], NEW_TOKENS)


def test_the_engine_api_checks_what_the_server_checks(engine_for):
    """Out-of-vocabulary ids, a top_k beyond int32, a stop token given as text and a zero page size are one-line
    refusals; a batch with one bad prompt runs none of its prompts and leaves the engine idle."""
    engine = engine_for("1x2x4")
    vocab = engine.model_config.vocab_size
    with pytest.raises(StarscreamError, match=f"token id {vocab} is outside the model's vocabulary"):
        engine.submit("oov", [1, vocab], SamplingParams())
    with pytest.raises(StarscreamError, match="top_k"):
        SamplingParams(top_k=1099511627776)
    with pytest.raises(StarscreamError, match="stop_tokens"):
        SamplingParams(stop_tokens="nxyz")
    with pytest.raises(StarscreamError, match="page_size"):
        EngineConfig(page_size=0)
    with pytest.raises(StarscreamError, match="overlap is 'no'; give True or False"):
        EngineConfig(overlap="no")
    with pytest.raises(StarscreamError, match="outside the model's vocabulary"):
        engine.generate([[1, 2], [vocab + 5]], SamplingParams(max_tokens=2))
    assert not engine.busy and engine.generate([[1, 2]], SamplingParams(max_tokens=2))[0]


def test_ids_past_the_tokens_of_a_padded_vocabulary_are_refused(engine_for, monkeypatch):
    """With a vocabulary padded for the layouts (`model.vocabulary`), the ids of its padding rows are no tokens: a
    prompt, a logit bias naming one, and the vocabulary the server checks stop at the tokens."""
    engine = engine_for("1x2x4")
    tokens = engine.model_config.vocab_size - 2
    monkeypatch.setattr(engine, "model_config", engine.model_config.replace(vocab_padding=2))
    with pytest.raises(StarscreamError, match=f"token id {tokens} is outside the model's vocabulary of {tokens}"):
        engine.submit("padding", [1, tokens], SamplingParams())
    with pytest.raises(StarscreamError, match=f"logit_bias token id {tokens + 1} is outside the model's vocabulary "
                                              f"of {tokens}"):
        engine.submit("bias", [1, 2], SamplingParams(logit_bias=((tokens + 1, 5.0),)))
    assert engine.info().vocab_size == tokens and not engine.busy


def _reference_prompt_logprobs(model, prompt: list[int]) -> np.ndarray:
    """log_softmax of the unsharded model's full-sequence logits [S, V] at each position."""
    logits = np.asarray(model(np.asarray([prompt], np.int32)).logits[0], np.float64)
    return logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - \
        logits.max(-1, keepdims=True)


@pytest.mark.parametrize("mesh", ["1x2x4", "1x1x1"])
def test_prompt_logprobs_equal_the_unsharded_models_across_chunks(engine_for, unsharded_llama, mesh):
    """A scored prefill on the 1x2x4 mesh and on one device, one prompt per prefill step: a prompt of 19 tokens runs
    as three chunks of 8 (a chunk's last position scores the next chunk's first token); each prompt token's log-probability, rank and the likeliest tokens at its
    position equal log_softmax of the unsharded model's full-sequence logits; a prefix that another request cached
    is computed again for a request that asks, and one that does not ask gets none and shares the prefix."""
    engine = engine_for(f"{mesh}-logprobs")
    prompt = [int(t) for t in np.random.default_rng(2).integers(2, 384, 19)]
    reference = _reference_prompt_logprobs(unsharded_llama, prompt)
    engine.generate([prompt], SamplingParams(max_tokens=2))  # its full pages now cached
    hits = engine.stats().prefix_hit_pages
    engine.submit("scored", prompt, SamplingParams(max_tokens=2, prompt_logprobs=5))
    engine.submit("plain", prompt[:12] + [7], SamplingParams(max_tokens=2))
    events = {}
    while engine.busy:
        for event in engine.step():
            events.setdefault(event.request_id, []).append(event)
    scores = events["scored"][0].prompt
    assert events["plain"][0].prompt is None and engine.stats().prefix_hit_pages == hits + 3
    want = reference[np.arange(len(prompt) - 1), prompt[1:]]
    np.testing.assert_allclose(scores.logprobs, want, atol=2e-4)
    ranks = [1 + int(np.sum(row > row[token] + 1e-4)) for row, token in zip(reference, prompt[1:])]
    assert all(abs(rank - want_rank) <= 1 for rank, want_rank in zip(scores.ranks, ranks))
    assert [tops[0] for tops in scores.top_tokens] == [int(row.argmax()) for row in reference[:-1]]
    np.testing.assert_allclose(scores.top_logprobs, np.sort(reference[:-1], -1)[:, ::-1][:, :5], atol=2e-4)
    assert engine.stats().programs == 4 and engine.buckets.programs() == 4 and engine.stats().pages_used == 0


def test_mixed_chunks_choose_the_mixed_buckets():
    """--mixed-chunks N: a mixed step of the prefill rows buckets below N and of N itself; 0 none; buckets that name
    their own keep them; a negative count is a one-line refusal."""
    buckets = Buckets.for_limits(rows=64, chunk=512, pages=512, prefill_rows=16)
    assert [_mixed_buckets(buckets, most) for most in (0, 1, 4, 16)] == [(), (1,), (1, 4), (1, 16)]
    assert _mixed_buckets(dataclasses.replace(buckets, mixed_chunks=(2,)), 1) == (2,)
    with pytest.raises(StarscreamError, match="mixed_chunks is -1; give a whole number of at least 0"):
        EngineConfig(mixed_chunks=-1)


def test_a_chunk_above_the_budget_and_a_length_no_shard_holds_are_refused_at_start():
    """A chunk no step could prefill whole is refused; with pages given a shard, a max model length asked for that
    a shard cannot hold is refused naming both fixes, and the model's own context shrinks to what a shard holds (12
    pages of 8, one the null page: 88 positions)."""
    with pytest.raises(StarscreamError, match="chunk 10 exceeds token_budget 8: no step could prefill a whole chunk"):
        EngineConfig(chunk=10, token_budget=8)
    pages = EngineConfig(pages_per_shard=12, page_size=8, chunk=8)
    assert _held_length(pages, 256) == 88 and _held_length(pages, 64) == 64
    assert _held_length(EngineConfig(), 4096) == 4096  # sized from memory: a shard holds one longest sequence
    with pytest.raises(StarscreamError, match=r"max model length 128 needs 16 pages of 8 positions a sequence, and a "
                                              r"cache shard holds 11; give more pages a shard \(--cache-pages\) or a "
                                              r"max model length of at most 88"):
        _held_length(dataclasses.replace(pages, max_model_len=128), 128)


def test_start_refusals_name_the_flag_that_fixes_them(unsharded_llama):
    """A max model length beyond the model's, a cache shard of one page, and a length that holds no request (a
    prompt token and a generated one: every request would be refused) are one line each naming the flag."""
    with pytest.raises(StarscreamError, match=r"context of 256 positions; give at most 256 \(--max-model-len\)"):
        Engine(unsharded_llama, EngineConfig(max_model_len=1000))
    with pytest.raises(StarscreamError, match=r"pages_per_shard is 1; .* give 2 or more \(--cache-pages\)"):
        EngineConfig(pages_per_shard=1)
    for config in (EngineConfig(max_model_len=1), EngineConfig(pages_per_shard=2, page_size=1, chunk=8)):
        with pytest.raises(StarscreamError, match=r"at most 1 position holds no request .* \(--max-model-len\)"):
            _held_length(config, config.max_model_len or 256)


def test_sequences_a_shard_are_at_most_what_its_given_pages_run():
    """Each running sequence holds a page of its own, so --max-num-seqs above a shard's pages (less the null page)
    shrinks to them, rather than compiling decode programs and a slot state of rows that could never run."""
    assert _held_rows(EngineConfig(pages_per_shard=10, rows_per_shard=25_000)).rows_per_shard == 9
    assert _held_rows(EngineConfig(pages_per_shard=10, rows_per_shard=9)).rows_per_shard == 9
    assert _held_rows(EngineConfig(rows_per_shard=25_000)).rows_per_shard == 25_000  # sized from memory to hold them
