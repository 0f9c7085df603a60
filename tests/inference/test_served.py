"""Generation on the serving engine: the static path's greedy tokens, rows that stop early padded with their stop
id, and the static path kept where fewer rows than cache shards would leave partitions idle."""
import numpy as np
import pytest
from flax import nnx

from starscream_jax.hardware.mesh import build_mesh
from starscream_jax.inference.generate import generate
from starscream_jax.inference.served import engine_config, generate_served, static_reason
from starscream_jax.model.catalog import load_model_config
from starscream_jax.model.decoder import Transformer
from starscream_jax.text import byte_level
from starscream_jax.training.steps import Sampling

PROMPT = np.stack([byte_level.encode("ROMEO:"), byte_level.encode("JULIET")])


@pytest.fixture(scope="module")
def model():
    return Transformer(load_model_config("tiny"), rngs=nnx.Rngs(7))


def test_the_engine_generates_the_static_paths_greedy_tokens_and_stops_rows_apart(model):
    """One engine run: each row's tokens equal the static path's up to and with its first stop id (row 0 meets
    it at its third token), then the stop id as padding."""
    static = generate(model, PROMPT, 8, Sampling()).tokens
    stop = int(static[0, 2])
    served = generate_served(model, PROMPT, 8, Sampling(), None, "starscream_tp", "starscream_decode", stop)
    kept = [list(row).index(stop) + 1 if stop in row else len(row) for row in static]
    for index, count in enumerate(kept):
        np.testing.assert_array_equal(served.tokens[index, :count], static[index, :count])
        assert set(served.tokens[index, count:]) <= {stop}
    assert kept[0] <= 3 and served.generated == sum(kept)
    assert served.programs == 2 and served.kernel == "gather"


def test_fewer_rows_than_cache_shards_and_layouts_placing_the_cache_apart_keep_the_static_path(model):
    """The static path where the engine would leave partitions idle (split-K decode) or could not keep one page
    pool for both phases (gpu_tp decode splits no batch over xcd, starscream_tp prefill does): its cache moves."""
    mesh = build_mesh("1x2x4")  # starscream_decode splits the attention batch over 4 partitions
    c = model.config

    def reason(batch, mesh, decode="starscream_decode"):
        return static_reason(batch, mesh, "starscream_tp", decode, c)

    assert reason(4, mesh) is None and reason(1, None) is None
    assert reason(3, mesh) == "split-K decode: fewer samples than cache shards"
    assert reason(4, mesh, "gpu_tp") == ("the layouts place the KV cache apart: the cache moves between prefill and "
                                         "decode")
    config = engine_config(6, 700, 100, mesh, "starscream_decode")
    assert (config.rows_per_shard, config.chunk, config.max_model_len) == (2, 512, 800)
    assert config.buckets.pages == (50,) and config.pages_per_shard == 2 * 50 + 1


def test_samples_of_one_prompt_draw_apart_with_any_64_bit_seed(model):
    """Rows of one prompt, sampled: each row its own engine seed (the seed's and the next ones), so the rows differ
    as the static path's do, and a seed beyond the engine's 31 bits (a command's --seed) is folded, not refused."""
    prompt = np.tile(byte_level.encode("ROMEO:"), (3, 1))
    drawn = Sampling(top_p=1.0, temperature=1.0, seed=2 ** 40 + 3)
    served = generate_served(model, prompt, 8, drawn, None, "starscream_tp", "starscream_decode")
    assert len({tuple(row) for row in served.tokens}) == 3
