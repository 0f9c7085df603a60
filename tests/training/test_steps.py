"""The train step with gradient accumulation: n micro-batches give the big batch's gradients and update, sharded
(starscream_tp on a simulated 2 GPU x 4 partition mesh) and unsharded; remat policies change memory, not results; the
load-balancing loss a mixture of experts reports is the term its training loss adds."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from starscream_jax.analysis.report import inspect_compiled
from starscream_jax.errors import StarscreamError
from starscream_jax.hardware.backend import CUDA, PORTABLE
from starscream_jax.hardware.mesh import build_mesh
from starscream_jax.model.catalog import load_model_config
from starscream_jax.model.decoder import Transformer, abstract_model, create_sharded_model, next_token_loss
from starscream_jax.model.dense_cache import init_cache, split_cache
from starscream_jax.sharding.apply import Placement, batch_sharding, use_layout
from starscream_jax.sharding.layouts import fit_batch
from starscream_jax.training.config import TrainConfig
from starscream_jax.training.steps import (
    Sampling,
    accumulated_gradients,
    choose_token,
    decode_options,
    decode_step,
    eval_step,
    load_balance_step,
    make_optimizer,
    prefill_step,
    train_step,
)

CONFIG = load_model_config("tiny").replace(n_layers=2)


def _state(config=CONFIG):
    return nnx.split(Transformer(config, rngs=nnx.Rngs(0)), nnx.Param, ...)


def _tokens(batch=8, seq=16):
    return jax.random.randint(jax.random.key(1), (batch, seq + 1), 0, CONFIG.vocab_size, dtype=jnp.int32)


def _assert_close(actual, expected, rtol=2e-5, atol=2e-6):
    for got, want in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=rtol, atol=atol)


GRADIENT = jax.jit(accumulated_gradients, static_argnums=(3, 4))


@pytest.mark.slow  # the same under a layout runs by default
def test_accumulated_gradients_equal_the_big_batch_gradients_unsharded():
    graphdef, params, rest = _state()
    tokens = _tokens()
    _assert_close(GRADIENT(params, rest, tokens, graphdef, 4), GRADIENT(params, rest, tokens, graphdef, 1))


def test_accumulated_step_updates_like_the_big_batch_step_under_a_layout():
    """Sharded under starscream_tp (tokens over xcd, heads over gpu), 2 micro-batches of 4 sequences: the same new
    parameters, optimizer state and loss as one step over the 8, and the parameters stay placed as they were."""
    mesh = build_mesh("2x4")
    with use_layout("starscream_tp", mesh):
        graphdef, params, rest = nnx.split(create_sharded_model(CONFIG, "starscream_tp", mesh, 0), nnx.Param, ...)
        optimizer = make_optimizer(TrainConfig(), params)
        tokens = jax.device_put(_tokens(), batch_sharding("starscream_tp", mesh, 8))
        results = {}
        for micro_batches in (1, 2):
            copies = jax.tree.map(jnp.copy, (params, jax.jit(optimizer.init)(params)))
            results[micro_batches] = train_step(graphdef, optimizer, micro_batches, under=Placement.of("starscream_tp", mesh))(*copies, rest, tokens)
    _assert_close(results[2], results[1])
    for new, old in zip(jax.tree.leaves(results[2][0]), jax.tree.leaves(params)):
        assert new.sharding == old.sharding


def test_a_step_runs_the_program_of_its_own_layout_whichever_layout_is_active():
    """An eval step bound to starscream_tp and one bound to no layout, each called under gpu_tp, then under
    starscream_tp: each compiles its own layout's program (the logits' vocabulary split over gpu, or nothing split)
    and both give the unsharded loss."""
    mesh = build_mesh("2x4")
    graphdef, params, rest = _state()
    tokens = _tokens()
    bound = {name: eval_step(graphdef, under=None if name is None else Placement.of(name, mesh))
             for name in ("starscream_tp", None)}
    expected = float(bound[None](params, rest, tokens))
    for active in ("gpu_tp", "starscream_tp"):
        with use_layout(active, mesh):
            for name, step in bound.items():
                text = step.lower(params, rest, tokens).as_text()
                assert ("all_reduce" in text) == (name is not None), (name, active)
                assert float(step(params, rest, tokens)) == pytest.approx(expected, rel=1e-5)


def test_a_grad_accum_that_does_not_split_the_batch_is_refused():
    with pytest.raises(StarscreamError, match="--grad-accum 3 does not split --batch-size 16"):
        TrainConfig(grad_accum=3).model_config()


def test_remat_policies_give_the_same_gradients():
    graphdef, params, rest = _state()
    tokens = _tokens()
    kept = GRADIENT(params, rest, tokens, graphdef, 1)
    for policy in ("dots", "full"):
        recomputing, _, _ = _state(CONFIG.replace(remat=policy))
        _assert_close(GRADIENT(params, rest, tokens, recomputing, 1), kept)


@pytest.mark.parametrize("batch", [1, 3])
def test_prefill_of_prompts_split_inside_and_across_gpus_takes_the_last_logits_hierarchically(batch):
    """starscream_fsdp fitted to a batch of 1 or 3 on 2 GPUs x 4 partitions (+seq) splits each prompt over
    (gpu, xcd): the first new token equals the unsharded prefill's, and no collective spans both levels (the sum
    that keeps the last real position's logits was one flat all-reduce over all 8 devices)."""
    mesh = build_mesh("2x4")
    fitted = fit_batch("starscream_fsdp", mesh, batch, None)
    graphdef, params, rest = nnx.split(create_sharded_model(CONFIG, fitted, mesh, 0), nnx.Param, ...)
    prompt_BP = _tokens(batch=batch, seq=12)[:, :12]
    step = prefill_step(graphdef, CONFIG, Sampling(), 16, under=Placement.of(fitted, mesh))
    scopes = {c.scope for c in inspect_compiled(step.lower(params, rest, prompt_BP).compile(), mesh).collectives}
    assert "flat" not in scopes and "inter_gpu" in scopes
    token_B, _ = step(params, rest, prompt_BP)
    expected_B, _ = prefill_step(graphdef, CONFIG, Sampling(), 16, under=None)(jax.device_get(params), rest, prompt_BP)
    np.testing.assert_array_equal(token_B, expected_B)


def _layer_loops(step, *args) -> int:
    """How many `while` loops the compiled step runs (the layer loop, forward and backward, is its only one)."""
    return len(re.findall(r"\bwhile\(", step.lower(*args).compile().as_text()))


def test_no_phase_runs_a_layer_loop_unless_asked_and_both_forms_compute_the_same():
    """scan_unroll 0 (the default): decode, prefill and the train step run without a layer loop; scan_unroll 1 rolls
    each (the train step: one forward loop, one backward). Decode gives the same next token and the train step the
    same loss and parameters either way."""
    graphdef, params, rest = _state()
    rolled_graphdef, _, _ = _state(CONFIG.replace(scan_unroll=1))
    prompt_BP = _tokens(batch=2, seq=4)[:, :4]
    token_B, cache = prefill_step(graphdef, CONFIG, Sampling(), 8, under=None)(params, rest, prompt_BP)
    decode, rolled_decode = decode_step(graphdef, Sampling(), under=None), decode_step(rolled_graphdef, Sampling(), under=None)
    assert _layer_loops(decode, params, rest, cache, token_B, 4) == 0
    assert _layer_loops(rolled_decode, params, rest, cache, token_B, 4) == 1
    assert _layer_loops(prefill_step(graphdef, CONFIG, Sampling(), 8, under=None), params, rest, prompt_BP) == 0
    assert _layer_loops(prefill_step(rolled_graphdef, CONFIG, Sampling(), 8, under=None), params, rest, prompt_BP) == 1
    optimizer = make_optimizer(TrainConfig(), params)
    train, rolled_train = train_step(graphdef, optimizer, under=None), train_step(rolled_graphdef, optimizer, under=None)
    assert _layer_loops(train, params, optimizer.init(params), rest, _tokens()) == 0
    assert _layer_loops(rolled_train, params, optimizer.init(params), rest, _tokens()) == 2
    unrolled_next, _ = decode(params, rest, jax.tree.map(jnp.copy, cache), token_B, 4)
    rolled_next, _ = rolled_decode(params, rest, jax.tree.map(jnp.copy, cache), token_B, 4)
    np.testing.assert_array_equal(unrolled_next, rolled_next)
    stepped, _, loss = train(*jax.tree.map(jnp.copy, (params, optimizer.init(params))), rest, _tokens())
    rolled_stepped, _, rolled_loss = rolled_train(*jax.tree.map(jnp.copy, (params, optimizer.init(params))), rest,
                                                  _tokens())
    np.testing.assert_allclose(loss, rolled_loss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(stepped), jax.tree.leaves(rolled_stepped)):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_decode_with_a_cache_held_per_layer_equals_decode_with_the_stacked_cache():
    """Generation holds the cache per layer (`split_cache`) when decode runs no layer loop: same logits, same cache
    written, and no loop in the program."""
    graphdef, params, rest = _state()
    cache = jax.jit(lambda: init_cache(CONFIG, 2, 8))()
    cache = jax.tree.map(lambda zeros: jax.random.normal(jax.random.key(2), zeros.shape), cache)  # random history
    token_B1 = _tokens(batch=2, seq=1)[:, :1]

    @jax.jit
    def forward(params, cache):
        return nnx.merge(graphdef, params, rest)(token_B1, cache=cache, cache_index=5)

    stacked_logits, stacked_cache, _ = forward(params, cache)
    apart_logits, apart_cache, _ = forward(params, split_cache(cache))
    np.testing.assert_allclose(apart_logits, stacked_logits, rtol=1e-6, atol=1e-6)
    for name in ("k", "v"):
        np.testing.assert_array_equal(np.stack(getattr(apart_cache, name)), getattr(stacked_cache, name))
    assert _layer_loops(decode_step(graphdef, Sampling(), under=None), params, rest, split_cache(cache), token_B1[:, 0], 5) == 0


def test_an_unknown_remat_policy_is_refused():
    with pytest.raises(StarscreamError, match="remat policy 'some'"):
        CONFIG.replace(remat="some")


def test_the_reported_load_balancing_loss_is_what_the_training_loss_adds():
    tokens = np.random.default_rng(0).integers(0, 256, (4, 9), dtype=np.int32)
    weighted = load_model_config("tiny-moe", n_layers=1, load_balance_weight=0.5)
    graphdef, params, rest = nnx.split(Transformer(weighted, rngs=nnx.Rngs(0)), nnx.Param, ...)
    plain_graphdef = nnx.graphdef(Transformer(weighted.replace(load_balance_weight=0.0), rngs=nnx.Rngs(0)))

    @jax.jit
    def reported_and_added(params, rest, tokens):
        losses = [next_token_loss(nnx.merge(g, params, rest), tokens) for g in (graphdef, plain_graphdef)]
        return load_balance_step(graphdef, under=None)(params, rest, tokens), losses[0] - losses[1]

    balance, added = map(float, reported_and_added(params, rest, tokens))
    assert 0.5 < balance < weighted.n_experts  # 1 when the experts share the tokens evenly
    assert added == pytest.approx(0.5 * balance, rel=1e-4)


def test_weight_decay_skips_exactly_the_norm_scales_and_biases():
    """One AdamW step with zero gradients moves a parameter only by its weight decay: every matrix (experts and
    router included) shrinks, and the 1-D parameters (norm scales, q/k norms, q/k/v biases) stay as they were. All
    parameters start at one, so a bias that decayed would move."""
    config = CONFIG.replace(qkv_bias=True, qk_norm=True, n_experts=2, experts_per_token=1)
    _, abstract, _ = nnx.split(abstract_model(config), nnx.Param, ...)
    params = jax.tree.map(lambda leaf: np.ones(leaf.shape, leaf.dtype), abstract)
    optimizer = make_optimizer(TrainConfig(warmup_steps=0, weight_decay=0.5), params)
    update = jax.jit(lambda params: optimizer.update(jax.tree.map(jnp.zeros_like, params), optimizer.init(params),
                                                     params)[0])
    updates = update(params)
    moved = {path[-1]: bool(jnp.any(update.get_value() != 0)) for path, update in nnx.to_flat_state(updates)}
    assert {name for name, changed in moved.items() if not changed} == {
        "attn_norm", "mlp_norm", "final_norm", "q_norm", "k_norm", "bq", "bk", "bv"}
    assert {name for name, changed in moved.items() if changed} == {
        "embedding", "lm_head", "wq", "wk", "wv", "wo", "router", "w_gate", "w_up", "w_down"}


def test_a_nucleus_of_a_top_p_that_flushes_to_zero_holds_the_most_likely_token():
    """1e-38 is below float32's normal range: compiled, it flushes to 0, and a nucleus of the tokens whose mass before
    them is below it would hold none (every draw token 0)."""
    logits_BV = jax.random.normal(jax.random.key(0), (8, 32)) * 3
    chosen = jax.jit(lambda logits: choose_token(logits, 3, Sampling(top_p=1e-38, temperature=0.7, seed=1)))
    np.testing.assert_array_equal(chosen(logits_BV), jnp.argmax(logits_BV, axis=-1))


def test_decode_compiles_with_xlas_converting_gemms_only_for_8_bit_weights():
    """8-bit weights turn on XLA's Triton GEMM fusions (they convert the 8-bit operand in the GEMM's kernel); an 8-bit
    cache alone keeps the backend's cuBLAS calls for its bfloat16 weights; a backend that sets no option gets none."""
    assert decode_options(CUDA, eight_bit_weights=False)["xla_gpu_enable_triton_gemm"] is False
    assert decode_options(CUDA, eight_bit_weights=True)["xla_gpu_enable_triton_gemm"] is True
    assert decode_options(CUDA, True)["xla_gpu_dot_merger_threshold_mb"] == 0
    assert decode_options(PORTABLE, True) == {}
