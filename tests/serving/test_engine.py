"""The engine: greedy tokens equal `generate()`'s on (1,1,1), (1,2,4) and (2,2,2) meshes under the decode layouts,
with pages running out (preemption and recompute); requests one by one give the tokens of all at once; a seeded
request samples the same tokens whatever else runs; full prompt pages are shared by prefix. Each engine compiles
its two programs once (module-scoped) and every test reuses them."""
import numpy as np
import pytest
from flax import nnx

from starscream_jax.errors import StarscreamError
from starscream_jax.hardware.mesh import build_mesh
from starscream_jax.model.config import load_model_config
from starscream_jax.model.decoder import Transformer
from starscream_jax.serving.engine import Engine, EngineConfig, cache_shards
from starscream_jax.serving.scheduler import SamplingParams
from starscream_jax.serving.steps import Buckets
from starscream_jax.training.generate import generate

ROWS, NEW_TOKENS = 8, 6
CASES = {"1x1x1": ("starscream_tp", "starscream_decode"), "1x2x4": ("starscream_tp", "starscream_decode"),
         "2x2x2": ("starscream_tp", "starscream_decode"), "1x2x4-flat": ("flat_tp", "flat_tp")}


@pytest.fixture(scope="module")
def model():
    return Transformer(load_model_config("tiny", max_seq_len=32, n_layers=2), rngs=nnx.Rngs(7))


@pytest.fixture(scope="module")
def prompts():
    return np.random.default_rng(0).integers(0, 256, (ROWS, 6))


@pytest.fixture(scope="module")
def reference(model, prompts):
    return generate(model, prompts, NEW_TOKENS).tokens.tolist()


_ENGINES = {}


def engine_for(model, case: str) -> Engine:
    """One engine per case, each compiling one decode and one prefill program: 8 rows in all, chunks of 8
    positions, 4 pages of 4 per row; 12 pages per shard, too few for the 8 greedy requests at once on one shard."""
    if case not in _ENGINES:
        mesh, layouts = build_mesh(case.split("-")[0]), CASES[case]
        shards = cache_shards(layouts[1], mesh)
        config = EngineConfig(page_size=4, pages_per_shard=13, rows_per_shard=ROWS // shards, token_budget=64,
                              chunk=8, buckets=Buckets((ROWS // shards,), (8,), (4,)))
        _ENGINES[case] = Engine(model, config, mesh, *layouts)
    return _ENGINES[case]


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_equal_generate(model, prompts, reference, case):
    engine = engine_for(model, case)
    assert engine.generate([list(p) for p in prompts], SamplingParams(max_tokens=NEW_TOKENS)) == reference
    stats = engine.stats()
    assert stats.programs == 2 and stats.pages_used == 0 and stats.running == stats.waiting == 0
    if case == "1x1x1":
        assert stats.preemptions > 0  # 8 x 3 pages asked of 12: the newest were recomputed


def test_one_by_one_equals_all_at_once(model):
    engine = engine_for(model, "1x2x4")
    rng = np.random.default_rng(1)
    prompts = [list(rng.integers(0, 256, length)) for length in (10, 3, 7, 9, 1)]  # 10 and 9: two chunks each
    together = engine.generate(prompts, SamplingParams(max_tokens=5))
    alone = [engine.generate([prompt], SamplingParams(max_tokens=5))[0] for prompt in prompts]
    assert together == alone
    assert engine.stats().programs == 2  # no shape outside the buckets compiled


def test_seeded_request_samples_alike_whatever_runs_beside_it(model):
    engine = engine_for(model, "1x2x4")
    params = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, top_k=40, seed=5, logprobs=True)
    prompt = [5, 6, 7, 8]
    alone = engine.generate([prompt], params)[0]
    crowded = engine.generate([[1, 2], prompt, [9, 9, 9]], params)[1]
    assert alone == crowded
    other_seed = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, top_k=40,
                                                          seed=6))[0]
    assert other_seed != alone


def test_prefix_pages_are_shared_and_give_the_same_tokens(model):
    engine = engine_for(model, "1x2x4")
    prefix = list(range(40, 48))  # two full pages
    first, second = prefix + [1, 2], prefix + [3]
    cold = engine.generate([second], SamplingParams(max_tokens=4))[0]
    engine.generate([first], SamplingParams(max_tokens=4))
    hits = engine.stats().prefix_hit_pages
    assert engine.generate([second], SamplingParams(max_tokens=4))[0] == cold
    assert engine.stats().prefix_hit_pages == hits + 2


def test_cancel_frees_pages_and_bad_requests_are_refused(model):
    engine = engine_for(model, "1x2x4")
    engine.submit("a", [1, 2, 3], SamplingParams(max_tokens=8))
    engine.step()
    assert engine.stats().pages_used > 0
    with pytest.raises(StarscreamError, match="already running"):
        engine.submit("a", [1], SamplingParams())
    assert engine.cancel("a") and not engine.cancel("a")
    assert engine.stats().pages_used == 0 and not engine.busy
    with pytest.raises(StarscreamError, match="context"):
        engine.submit("b", [1] * 30, SamplingParams(max_tokens=8))
