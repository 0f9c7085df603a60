"""scripts/bench_decode.py: the bytes a decode step must read (weights once, the whole KV cache)."""

import jax
import pytest
from flax import nnx

from starscream_jax.model.catalog import load_model_config
from starscream_jax.model.decoder import Transformer



@pytest.fixture(scope="module")
def bench(script):
    return script("bench_decode")


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


def test_8_bit_weights_and_cache_are_counted_in_their_stored_bytes(bench):
    """Against the float32 model: each int8 weight reads 1 byte where it read 4, plus a float32 scale per output
    channel; an fp8 cache 1 byte per value plus a float32 scale per position and kv head."""
    c = load_model_config("tiny").replace(weight_format="int8", kv_format="float8_e4m3fn")
    float_read = bench.bytes_read_per_step(nnx.state(Transformer(c.replace(weight_format=""), rngs=nnx.Rngs(0)),
                                                     nnx.Param), c, batch=3, cache_length=10)
    read = bench.bytes_read_per_step(nnx.state(Transformer(c, rngs=nnx.Rngs(0)), nnx.Param), c, batch=3,
                                     cache_length=10)
    quantized = c.n_layers * (c.d_model * c.head_dim * (2 * c.n_heads + 2 * c.n_kv_heads) + 3 * c.d_model * c.d_ff)
    scales = c.n_layers * (c.head_dim * (c.n_heads + 2 * c.n_kv_heads) + 2 * c.d_model + 2 * c.d_ff)
    assert read["weights"] == float_read["weights"] - 3 * quantized + 4 * scales
    values = 2 * c.n_layers * 3 * 10 * c.n_kv_heads
    assert read["kv_cache"] == values * c.head_dim + 4 * values



def test_the_plain_jax_row_times_the_plain_decoder_on_the_models_weights(bench):
    """The plain JAX row beside the library's: the model's weights held as a plain params dict on one device, off
    the library's mesh, split per layer (matrices in the compute dtype, norm scales float32), and its step timed over
    the same bytes."""
    config = load_model_config("tiny", dtype="bfloat16")
    params = bench.plain_weights(Transformer(config, rngs=nnx.Rngs(0)))
    assert len(params["layers"]) == config.n_layers and params["layers"][0]["wq"].ndim == 3
    assert params["layers"][0]["wq"].dtype == jax.numpy.bfloat16 and params["final_norm"].dtype == jax.numpy.float32
    assert isinstance(params["embedding"].sharding, jax.sharding.SingleDeviceSharding)
    read = {"weights": 1000, "kv_cache": 24}
    row = bench.plain_row(params, config, batch=2, cache_length=32, warmup=1, steps=2, read=read)
    assert row["name"] == "plain JAX" and row["batch"] == 2 and row["bytes_per_step"] == read
    assert row["attention"] == "xla"  # cuDNN only on an NVIDIA GPU
    assert row["tokens_per_s"] == pytest.approx(2 / row["step_s"])
    assert row["bandwidth_bytes_per_s"] == pytest.approx(1024 / row["step_s"])


def test_no_plain_row_stands_beside_a_model_or_a_mesh_it_does_not_decode(bench):
    assert bench.plain_skipped(load_model_config("llama3-8b"), devices=1) is None
    assert "runs on one device, this run has 2" in bench.plain_skipped(load_model_config("llama3-8b"), devices=2)
    assert "not a plain Llama (qkv_bias = True)" in bench.plain_skipped(load_model_config("qwen2.5-72b"), devices=1)


def test_a_paged_row_runs_the_engine_over_the_models_cache_format(bench):
    """`run_paged` (--paged, --paged-cache int8): the engine's paged step over int8 pages (gathered on this CPU,
    read in place on CUDA), its row naming the format."""
    from starscream_jax.hardware.mesh import build_mesh
    from starscream_jax.model.decoder import create_sharded_model
    from starscream_jax.sharding.apply import use_layout

    config = load_model_config("tiny", kv_format="int8").replace(n_layers=2)
    mesh = build_mesh(gpus=1)
    with use_layout("starscream_decode", mesh):
        model = create_sharded_model(config, "starscream_decode", mesh)
    row = bench.run_paged(model, "starscream_decode", mesh, batch=2, cache_length=32, kernel="gather", warmup=0,
                          steps=1)
    assert row["kv_format"] == "int8" and row["kernel"] == "gather" and row["step_s"] > 0
