"""scripts/bench_decode.py: the bytes a decode step must read (weights once, the whole KV cache)."""
import importlib.util
from pathlib import Path

import jax
import pytest
from flax import nnx

from starscream_jax.model.config import load_model_config
from starscream_jax.model.decoder import Transformer

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_decode.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_decode", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("tied", [False, True])
def test_bytes_per_step_count_each_weight_once_and_the_whole_cache(bench, tied):
    config = load_model_config("tiny", tie_embeddings=tied)
    params = nnx.state(Transformer(config, rngs=nnx.Rngs(0)), nnx.Param)
    total = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
    table = config.vocab_size * config.d_model * 4  # float32 [V, D]
    read = bench.bytes_read_per_step(params, config, batch=3, cache_length=10)
    # an untied embedding table is read only for the 3 looked-up rows; tied, it is the head and read whole
    assert read["weights"] == (total if tied else total - table + 3 * config.d_model * 4)
    assert read["kv_cache"] == 2 * config.n_layers * 3 * 10 * config.n_kv_heads * config.head_dim * 2
