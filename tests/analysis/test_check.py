"""`check`: a user's own jitted step (Flax NNX layers, MaxText's names) judged as the built-in model is judged."""
import importlib.util
import re
import sys
from pathlib import Path

import optax
import pytest
from flax import nnx

import starscream_jax as ss

EXAMPLE = Path(__file__).parents[2] / "examples" / "flax_nnx_model.py"


def load_example():
    spec = importlib.util.spec_from_file_location("flax_nnx_model", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["flax_nnx_model"] = module
    spec.loader.exec_module(module)
    return module


example = load_example()


def checked(layout_name: str, mesh, reference="gpu_tp"):
    layout = ss.in_vocabulary(layout_name, ss.MAXTEXT)
    model = ss.create_sharded(lambda: example.Transformer(rngs=nnx.Rngs(0)), layout, mesh)
    with ss.use_layout(layout, mesh):
        optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
        return ss.check(nnx.jit(example.train_step), model, optimizer, example.batches(0, batch=8, seq=9),
                        mesh=mesh, vocabulary=ss.MAXTEXT, reference=reference)


def test_a_flax_model_under_the_flat_layout_fails_as_the_built_in_model_does():
    """The same model passes under starscream_tp (tests/test_examples.py runs the example's own check); under flat_tp
    its collectives span GPUs and partitions at once, as the built-in model's do (tests/analysis/test_principles.py)."""
    result = checked("flat_tp", ss.build_mesh("2x4"), reference=None)
    assert not result.ok and not result.principles.hierarchical_collectives.ok
    assert result.report.bytes_by_scope()["flat"] > 0
    names = {entry.name for entry in (*result.report.inputs, *result.report.outputs)}
    assert {"0/blocks/0/q/kernel", "1/opt_state/0/mu/blocks/0/q/kernel", "output/0/blocks/0/q/kernel"} <= names
    table = result.table()
    assert "step under flat_tp on mesh data 1 x gpu 2 x xcd 4" in table
    assert "3 hierarchical collectives" in table and "hierarchical_collectives: " in table
    placed = {placement.path: placement.rules for placement in result.placements}
    assert placed["0/blocks/0/q/kernel"] == ("embed -> whole", "heads -> (gpu, xcd)", "kv -> whole")
    assert result.unnamed() == ()
    assert re.search(r"^without logical names \(left replicated\) +none$", table, re.MULTILINE)


def test_a_step_that_is_not_jitted_is_refused():
    mesh = ss.build_mesh("2x4")
    with pytest.raises(ss.StarscreamError, match="wrap it with jax.jit or nnx.jit"):
        ss.check(example.train_step, mesh=mesh, layout="starscream_tp")


def test_a_step_without_a_layout_is_refused():
    with pytest.raises(ss.StarscreamError, match="call it inside use_layout"):
        ss.check(nnx.jit(example.train_step), mesh=ss.build_mesh("2x4"))


def test_with_a_data_axis_only_the_norm_scales_gradient_is_summed_flat():
    """Flax's RMSNorm multiplies by its scale elementwise, so `weights_at_use` leaves the scales' gradients to XLA,
    which sums them over data and xcd at once; every other collective stays inside a GPU or across GPUs."""
    result = checked("starscream_tp", ss.build_mesh("4x2", data=2), reference=None)
    flat = [c for c in result.report.collectives if c.scope == "flat"]
    norm_bytes = 5 * 32 * 4  # 2 blocks x 2 norms + the final norm, d_model 32, float32
    scalar_bytes = 4  # the loss, a mean over every token
    assert flat and all(c.kind == "all-reduce" for c in flat)
    assert sum(c.buffer_bytes for c in flat) <= norm_bytes + scalar_bytes
    assert result.principles.shape_preservation.unjudged and result.principles.no_redundancy.ok
