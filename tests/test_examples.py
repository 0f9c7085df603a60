"""examples/custom_model.py: a model written only against the public sharding API matches its unsharded run under
starscream_tp and flat_tp, and its training script learns."""
import importlib.util
from pathlib import Path

import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from starscream_jax.hardware.mesh import build_mesh
from starscream_jax.sharding.apply import create_sharded, use_layout

FP32_TOLERANCE = 2e-5
"""Largest absolute difference between sharded and unsharded float32 results (see tests/model/test_decoder.py)."""
EXAMPLE = Path(__file__).parents[1] / "examples" / "custom_model.py"
BATCH, FEATURES, HIDDEN, CLASSES = 8, 32, 64, 16


def load_example():
    spec = importlib.util.spec_from_file_location("custom_model", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


custom_model = load_example()


def logits_loss_and_grads(model, x_BD, labels_B):
    loss, grads = nnx.value_and_grad(custom_model.loss_fn)(model, x_BD, labels_B)
    return model(x_BD), loss, grads


def new_classifier():
    return custom_model.Classifier(FEATURES, HIDDEN, CLASSES, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("layout,stored", [
    ("starscream_tp", {"w_in": P("xcd", "gpu"), "w_out": P("gpu", "xcd"), "head": P("xcd", "gpu")}),
    ("flat_tp", {"w_in": P(None, ("gpu", "xcd")), "w_out": P(("gpu", "xcd"), None), "head": P(None, ("gpu", "xcd"))}),
])
def test_custom_model_matches_its_unsharded_run(layout, stored):
    x_BD, labels_B = custom_model.synthetic_batch(0, BATCH, FEATURES, CLASSES)
    expected = nnx.jit(logits_loss_and_grads)(new_classifier(), x_BD, labels_B)
    mesh = build_mesh("2x4")
    model = create_sharded(new_classifier, layout, mesh)
    assert {name: getattr(model, name).sharding.spec for name in stored} == stored
    with use_layout(layout, mesh):
        logits, loss, grads = nnx.jit(logits_loss_and_grads)(model, x_BD, labels_B)
    assert float(jnp.max(jnp.abs(logits - expected[0]))) <= FP32_TOLERANCE
    assert abs(float(loss - expected[1])) <= FP32_TOLERANCE
    for (path, grad), (_, expected_grad) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(expected[2])):
        assert float(jnp.max(jnp.abs(grad[...] - expected_grad[...]))) <= FP32_TOLERANCE, path


def test_example_script_trains():
    losses = custom_model.main(steps=10)
    assert losses[-1] < losses[0] / 4
