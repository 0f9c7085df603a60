"""Query heads padded with zero weights: the logits of the unpadded model, and a head count the GPUs now divide."""
import dataclasses
import itertools
import re

import jax
import numpy as np
import pytest
from flax import nnx

from starscream_jax.analysis.compile import fitted_layout, make_settings, step_program
from starscream_jax.errors import ShardingRuleError
from starscream_jax.hardware.mesh import build_mesh
from starscream_jax.model.catalog import load_model_config
from starscream_jax.model.decoder import Transformer
from starscream_jax.model.heads import (
    heads_parts,
    pad_heads_fix,
    pad_query_heads,
    padded_heads,
    refuse_unsplit_heads,
)
from starscream_jax.sharding.apply import batch_sharding, param_shardings, use_layout

QWEN2_7B_HEADS = load_model_config("tiny").replace(n_heads=28, n_kv_heads=4, head_dim=8, qkv_bias=True)
"""Qwen2-7B's head counts (28 query heads sharing 4 kv heads, q/k/v biases) on the tiny model's other sizes."""


@pytest.mark.parametrize("heads, kv_heads, gpus, expected", [(28, 4, 8, 32), (28, 4, 4, 28), (6, 2, 4, 8),
                                                              (8, 8, 3, 24), (8, 4, 1, 8)])
def test_each_group_grows_to_the_smallest_size_the_gpus_divide(heads, kv_heads, gpus, expected):
    config = QWEN2_7B_HEADS.replace(n_heads=heads, n_kv_heads=kv_heads)
    assert padded_heads(config, gpus) == expected and expected % gpus == 0 and expected % kv_heads == 0


def test_padded_heads_keep_the_logits_and_place_on_gpus_the_heads_did_not_divide():
    model = Transformer(QWEN2_7B_HEADS, rngs=nnx.Rngs(0))
    state = nnx.state(model)  # nonzero biases, so that a padded head's zero weights are what keeps it silent
    state["layers"]["bq"].set_value(jax.random.normal(jax.random.key(1), state["layers"]["bq"].shape))
    nnx.update(model, state)
    tokens = np.random.default_rng(0).integers(0, QWEN2_7B_HEADS.vocab_size, (2, 12), dtype=np.int32)
    expected = jax.jit(lambda m, t: m(t).logits)(model, tokens)
    padded = pad_query_heads(model, 8)
    assert padded.config.n_heads == 32 and padded.layers.wq.shape[2] == 32 and model.layers.wq.shape[2] == 28
    np.testing.assert_allclose(jax.jit(lambda m, t: m(t).logits)(padded, tokens), expected, atol=2e-5)

    mesh = build_mesh("8x1")
    with pytest.raises(ShardingRuleError, match="dimension 'heads' of size 28 is not divisible"):
        param_shardings(nnx.state(model), "gpu_tp", mesh)
    graphdef, params = nnx.split(padded)
    with use_layout("gpu_tp", mesh):
        placed = jax.device_put(params, param_shardings(params, "gpu_tp", mesh))
        logits = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t).logits)(
            placed, jax.device_put(tokens, batch_sharding("gpu_tp", mesh, 2)))
    np.testing.assert_allclose(logits, expected, atol=2e-5)


def test_heads_a_layout_cannot_split_are_refused_naming_the_pad_that_splits_them():
    """14 query heads sharing 2 kv heads on 4 GPUs x 4 partitions: the layouts that split heads over the GPUs (4
    parts) or over every partition (16) cannot place them; each kv head's group padded from 7 to 8 (16 heads) can.
    A layout that splits no heads, or may copy those it cannot split, needs no padding; where the kv heads neither
    divide nor are divided by the parts no padding helps (`model.ops` refuses those), so none is named."""
    mesh = build_mesh("4x4")
    config = QWEN2_7B_HEADS.replace(n_heads=14, n_kv_heads=2)
    assert {name: heads_parts(name, mesh) for name in ("gpu_tp", "starscream_decode", "flat_tp", "starscream_fsdp",
                                                        "flat_ep")} == {"gpu_tp": 4, "starscream_decode": 4,
                                                                        "flat_tp": 16, "starscream_fsdp": 1,
                                                                        "flat_ep": 1}
    fix = pad_heads_fix(config, ["gpu_tp"], mesh)
    assert fix.startswith("pass --pad-heads 16: each kv head's 7 query heads padded with zero heads to 8")
    assert pad_heads_fix(config, ["starscream_fsdp", "flat_ep"], mesh) == ""
    assert pad_heads_fix(config.replace(n_heads=16), ["flat_tp"], mesh) == ""
    assert pad_heads_fix(QWEN2_7B_HEADS, ["gpu_tp"], build_mesh("8x1")).startswith("pass --pad-heads 32")
    assert pad_heads_fix(QWEN2_7B_HEADS.replace(n_heads=8), ["gpu_tp"], build_mesh("3x1")) == ""  # 4 kv heads
    with pytest.raises(ShardingRuleError, match=re.escape("(starscream_decode into 4); pass --pad-heads 16")):
        refuse_unsplit_heads(config, ["starscream_fsdp", "starscream_decode"], mesh)
    refuse_unsplit_heads(config.replace(n_heads=16), ["starscream_fsdp", "starscream_decode", "flat_tp"], mesh)


AWKWARD_HEADS = [(3, 1), (6, 2), (5, 5)]
"""(query heads, kv heads) that few meshes divide: one kv head, groups of 3, an odd count with as many kv heads."""
SWEPT_MESHES = ["2x1x4", "1x2x4", "1x3x2"]
"""(data, gpu, xcd): one GPU per data group, two GPUs, three."""


def traces(config, phase: str, batch: int, layout: str, mesh_name: str) -> bool:
    """Whether the phase's step traces (abstract evaluation, nothing compiled) under `layout` fitted to the batch;
    False where the resolver refuses the placement (a ShardingRuleError naming the problem)."""
    data, gpu, xcd = (int(size) for size in mesh_name.split("x"))
    mesh = build_mesh(f"{data * gpu}x{xcd}", data=data)
    settings = dataclasses.replace(make_settings("tiny", phase, batch, 16, layout, 2), config=config)
    try:
        fitted = fitted_layout(settings, layout, mesh)
        with use_layout(fitted, mesh):
            step, args = step_program(settings, fitted, mesh)
            step.trace(*args)
    except ShardingRuleError:
        return False
    return True


@pytest.mark.slow  # a sweep over meshes; the padded heads' logits and refusals run by default
def test_awkward_head_counts_trace_on_every_mesh_whose_weights_place():
    """Prefill (q, k and v fused into one GEMM) at a batch the layout splits (under starscream_tp and flat_tp) and at
    one it fits (starscream_tp+seq, `fit_batch`) on each mesh, and training where one kv head meets one GPU: where
    the resolver places the weights, the step traces. Three heads sharing one kv head on data 2 x gpu 1 once
    failed inside the fused stack (JAX moved the size-1 gpu axis from the kv heads to the query group). The
    vocabulary is 384, so that three GPUs divide it."""
    tiny = load_model_config("tiny").replace(n_layers=2, vocab_size=384)
    placed = {(heads, kv_heads, name, batch, layout)
              for (heads, kv_heads), name, (batch, layout) in itertools.product(
                  AWKWARD_HEADS, SWEPT_MESHES, ((8, "starscream_tp"), (8, "flat_tp"), (1, "starscream_tp")))
              if traces(tiny.replace(n_heads=heads, n_kv_heads=kv_heads), "prefill", batch, layout, name)}
    assert {(3, 1, "2x1x4", 8, "starscream_tp"), (3, 1, "1x3x2", 1, "starscream_tp"),
            (6, 2, "1x3x2", 8, "flat_tp")} <= placed
    assert (5, 5, "1x2x4", 8, "starscream_tp") not in placed and len(placed) >= 10
    assert traces(tiny.replace(n_heads=3, n_kv_heads=1), "train", 8, "starscream_tp", "2x1x4")
