"""scripts/bench_mfu.py: the plain JAX Llama computes the library model's loss (its --quick run: test_benchmarks.py, under -m slow)."""
import importlib.util
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from starscream_jax.model.catalog import load_model_config
from starscream_jax.model.decoder import Transformer, next_token_loss

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_mfu.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_mfu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("model", ["tiny", "llama3.2-1b"])
def test_plain_loss_equals_the_library_model_on_its_parameters(bench, model):
    # llama3.2-1b's structure (tied embeddings) at a tiny size; tiny has a separate lm_head
    config = load_model_config(model, dtype="float32")
    config = config.replace(vocab_size=256, d_model=64, n_layers=2, d_ff=128, n_heads=4, n_kv_heads=2, head_dim=16)
    library_model = Transformer(config, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, config.vocab_size)
    params = nnx.to_pure_dict(nnx.state(library_model, nnx.Param))
    expected = float(jax.jit(next_token_loss)(library_model, tokens))
    plain = jax.jit(bench.plain_loss, static_argnums=(2, 3))(params, tokens, config, None)
    assert float(plain) == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("parallelism", ["tp", "fsdp"])
def test_plain_baselines_with_sharding_annotations_compute_the_unsharded_loss(bench, parallelism):
    """The plain tensor-parallel and FSDP steps place their parameters and activations by ordinary annotations; on
    two devices their loss is the unsharded one."""
    from jax.sharding import AxisType, Mesh, NamedSharding

    config = load_model_config("tiny", dtype="float32").replace(n_layers=2)
    params = nnx.to_pure_dict(nnx.state(Transformer(config, rngs=nnx.Rngs(0)), nnx.Param))
    tokens = jax.random.randint(jax.random.key(1), (4, 17), 0, config.vocab_size)
    expected = jax.jit(bench.plain_loss, static_argnums=(2, 3))(params, tokens, config, None)
    mesh = Mesh(np.asarray(jax.devices()[:2]), (bench.PLAIN_AXIS,), axis_types=(AxisType.Auto,))
    specs = bench.plain_param_specs(params, parallelism)
    placed = jax.tree.map(lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec)), params, specs)
    assert bench.PLAIN_AXIS in placed["layers"]["wq"].sharding.spec
    with jax.set_mesh(mesh):
        loss = jax.jit(bench.plain_loss, static_argnums=(2, 3, 4))(placed, tokens, config, None, parallelism)
    assert float(loss) == pytest.approx(float(expected), rel=1e-5)


def test_rates_count_model_flops_against_every_device(bench):
    plain = [{"name": "plain JAX", "tokens_per_s": 4000.0, "losses": [2.5]},
             {"name": "plain JAX TP", "tokens_per_s": 2500.0, "losses": [2.5]}]
    row = bench.add_rates({"step_s": 0.5, "losses": [3.0]}, tokens_per_step=1000, flops_per_token=2e9, devices=2,
                          peak_flops=1e12, plain_rows=plain)
    assert row["tokens_per_s"] == 2000.0
    assert row["mfu"] == pytest.approx(2000.0 * 2e9 / 2e12)
    assert row["vs_plain"] == 0.5 and row["loss0_minus_plain"] == 0.5
    assert row["vs_plain_by_name"] == {"plain JAX": 0.5, "plain JAX TP": 0.8}
