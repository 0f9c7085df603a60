"""The model under every layout equals the unsharded model: logits, loss, gradients, one AdamW step, greedy decoding.

Each (config, mesh, layout) case compiles one program once (a train step, then a prefill and a decode loop) and keeps
only the errors against the unsharded run, which every test of that case reads.
"""
import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from starscream_jax.errors import ShardingRuleError, StarscreamError
from starscream_jax.hardware.backend import CUDA, PORTABLE
from starscream_jax.hardware.mesh import build_mesh
from starscream_jax.model.catalog import load_model_config
from starscream_jax.model.decoder import Transformer, create_sharded_model, next_token_loss
from starscream_jax.model.dense_cache import init_cache
from starscream_jax.sharding.apply import activation_spec, batch_sharding, param_shardings, use_layout
from starscream_jax.sharding.layouts import EXPERT_LAYOUTS, LAYOUTS, fit_batch

FP32_TOLERANCE = 2e-5
"""Largest absolute difference allowed between a sharded and the unsharded float32 result (logits, loss, gradients,
parameters after one AdamW step). Sharding changes only the order of additions (a psum of partial sums instead of one
sum); over the <= 384-term contractions of these models that moves results by a few ulps of values of order 1, and
about 6e-6 is seen. The AdamW step below has lr = eps, so it moves a parameter by at most the gradient's error."""

MESHES = {"1x1x1": (1, 1, 1), "1x2x4": (1, 2, 4), "2x2x2": (2, 2, 2), "1x4x2": (1, 4, 2)}
"""(data, gpu, xcd) shapes: no sharding at all, 2 GPUs of 4 partitions, a data axis, 4 GPUs of 2 partitions."""
BATCH, SEQ, PROMPT, NEW_TOKENS = 8, 16, 8, 8
ADAMW = optax.adamw(learning_rate=1e-3, eps=1e-3)

PADDING = dataclasses.replace(PORTABLE, padded_rows=CUDA.padded_rows, small_dot_elements=CUDA.small_dot_elements)
"""The portable policy with CUDA's padding of one-row projections, and no cuDNN attention (which CPUs lack)."""

BATCH_LAYOUTS = [name for name, layout in LAYOUTS.items() if not layout.splits_sequence]
"""The layouts that keep each sequence whole (and so decode with a KV cache); the context-parallel ones are tested
below on sequences their axes divide."""
CASES = [("tiny", mesh, layout) for mesh in MESHES for layout in BATCH_LAYOUTS if layout not in EXPERT_LAYOUTS]
CASES += [("tiny-moe", "1x2x4", layout) for layout in BATCH_LAYOUTS if layout != "flat_ep"]
"""flat_ep's attention is flat_tp's and its MoE block is checked in test_moe."""
CASES += [("tiny-tied", "1x2x4", layout) for layout in BATCH_LAYOUTS if layout not in EXPERT_LAYOUTS]
FEW_KV = "tiny-kv2"
"""The tiny model with 2 kv heads (4 query heads each): on 4 GPUs each kv head is copied over 2 of them."""
SLOW_MESHES = ("1x4x2",)
"""Meshes whose cases run only with `-m slow`: 4 GPUs of 2 partitions repeats 1x2x4's placements with a wider gpu
axis, which the placement tests of tests/sharding check at 8 x 8."""
KEPT_BY_DEFAULT = {"1x1x1": (), "1x2x4": ("gpu_tp", "starscream_tp", "starscream_decode", "starscream_fsdp"),
                   "tiny-tied": ("starscream_decode",),
                   "tiny-moe": ("starscream_tp", "starscream_decode", "starscream_ep"), "2x2x2": ("starscream_fsdp",)}
"""The cases of a mesh or model that the default run keeps; the rest run with `-m slow`. One device places nothing,
so every layout there computes the unsharded program (the one-device forms run by default in tests/model/
test_hf_checkpoint.py and tests/serving/test_engine.py); the flat baselines' logits are checked on every layout by
tests/model/test_hf_checkpoint.py and their decode by tests/inference/test_generate.py; the tied head changes one
part of the model, which one layout exercises (the decode layout, whose head places the embedding table as a
weight); the routed block is exercised by the library's own layouts; on 2 x 2 x 2 starscream_fsdp runs with a data
axis (the other layouts' reductions over it: tests/sharding/test_data_parallel, and decode with a data axis:
tests/model/test_hf_checkpoint.py's any-batch generation)."""


def _slow(model: str, mesh: str, layout: str) -> bool:
    kept = KEPT_BY_DEFAULT.get(model if model != "tiny" else mesh)
    return mesh in SLOW_MESHES or (kept is not None and layout not in kept)


CASES = [pytest.param(*case, marks=pytest.mark.slow) if _slow(*case) else case for case in CASES]
CASES += [pytest.param(FEW_KV, "1x4x2", "starscream_decode", marks=pytest.mark.slow)]
"""Decode with kv heads fewer than the GPUs: the k and v projections summed and scattered inside each GPU
(`sharding.apply.einsum`) give the unsharded model's tokens."""
TIED = "tiny-tied"
"""The tiny model with its output head tied to the embedding table (as Llama 3.2 1B ties them)."""


def config_of(name: str):
    """The model configuration of a case: a file in models/, TIED or FEW_KV."""
    if name == TIED:
        return load_model_config("tiny").replace(name=TIED, tie_embeddings=True)
    if name == FEW_KV:
        return load_model_config("tiny").replace(name=FEW_KV, n_kv_heads=2)
    return load_model_config(name)


def mesh_of(name: str):
    data, gpu, xcd = MESHES[name]
    return build_mesh(f"{data * gpu}x{xcd}", data=data)


def train_step(graphdef, params, tokens_BS):
    """(logits [B, S, V], loss, grads, params after one AdamW step by nnx.Optimizer). `params` is left as it was."""
    loss, grads = jax.value_and_grad(lambda p: next_token_loss(nnx.merge(graphdef, p), tokens_BS))(params)
    model = nnx.merge(graphdef, params, copy=True)
    logits_BSV = model(tokens_BS).logits
    optimizer = nnx.Optimizer(model, ADAMW, wrt=nnx.Param)
    optimizer.update(model, grads)
    return logits_BSV, loss, grads, nnx.state(model, nnx.Param)


def prefill(graphdef, config, params, prompt_BP):
    """(first generated token [B], KV cache of PROMPT + NEW_TOKENS positions holding the prompt)."""
    cache = init_cache(config, prompt_BP.shape[0], PROMPT + NEW_TOKENS)
    out = nnx.merge(graphdef, params)(prompt_BP, cache=cache, cache_index=0)
    return greedy(out.logits), out.cache


def decode_loop(graphdef, params, token_B, cache):
    """The NEW_TOKENS greedy tokens [B, NEW_TOKENS] from `token_B` on, fed to the model one at a time."""
    model = nnx.merge(graphdef, params)

    def step(carry, _):
        token_B, cache, index = carry
        out = model(token_B[:, None], cache=cache, cache_index=index)
        return (greedy(out.logits), out.cache, index + 1), token_B

    _, tokens_NB = jax.lax.scan(step, (place_batch(token_B), cache, jnp.int32(PROMPT)), length=NEW_TOKENS)
    return tokens_NB.T


def whole_case(graphdef, config, params, tokens_BS):
    """The train step's outputs and the tokens greedy decoding generates after the first PROMPT tokens."""
    return train_step(graphdef, params, tokens_BS), decode_loop(graphdef, params, *prefill(graphdef, config, params,
                                                                                           tokens_BS[:, :PROMPT]))


def jit(function, *static):
    """`function` with its leading arguments `static` bound, jitted."""
    return jax.jit(functools.partial(function, *static))


def greedy(logits_BSV):
    """The most likely next token after the last position, [B], placed like the batch."""
    return place_batch(jnp.argmax(logits_BSV[:, -1], axis=-1).astype(jnp.int32))


def place_batch(token_B):
    """`token_B` placed like the active layout's batch (a prefill under another layout may have placed it
    otherwise; a scan carry keeps one placement)."""
    spec = activation_spec(("batch",), token_B.shape)
    return token_B if spec is None else jax.sharding.reshard(token_B, spec)


def sample_tokens(config) -> np.ndarray:
    return np.random.default_rng(1).integers(0, config.vocab_size, (BATCH, SEQ), dtype=np.int32)


@functools.cache
def reference(config_name: str):
    """The unsharded model's (config, graphdef, params, outputs), computed on one device with no layout active and
    kept as host (numpy) arrays, so comparing with them and placing them on a mesh compiles nothing."""
    config = config_of(config_name)
    graphdef, params = nnx.split(Transformer(config, rngs=nnx.Rngs(0)))
    (logits, loss, grads, stepped), generated = jit(whole_case, graphdef, config)(params, sample_tokens(config))
    outputs = {"logits": logits, "loss": loss, "grads": grads, "stepped": stepped, "generated": generated}
    return config, graphdef, jax.device_get(params), jax.device_get(outputs)


def max_error(actual, expected) -> float:
    return float(np.max(np.abs(np.asarray(actual) - np.asarray(expected))))


def errors_by_path(actual, expected) -> dict[str, float]:
    """Largest absolute difference per leaf, by the leaf's path."""
    paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(expected)[0]]
    return {path: max_error(a, e) for path, a, e in zip(paths, jax.tree.leaves(actual), jax.tree.leaves(expected))}


def on_mesh(params, layout: str, mesh, tokens_BS: np.ndarray):
    """(params, tokens) placed by the layout."""
    return (jax.device_put(params, param_shardings(params, layout, mesh)),
            jax.device_put(tokens_BS, batch_sharding(layout, mesh, BATCH)))


def generate(config_name: str, mesh, prefill_layout: str, decode_layout: str) -> np.ndarray:
    """Greedy tokens [B, NEW_TOKENS] after the prompt, as two programs: the prefill under `prefill_layout`, then the
    decode loop under `decode_layout`, each with the parameters placed by its own layout."""
    config, graphdef, params, _ = reference(config_name)
    placed, prompt = on_mesh(params, prefill_layout, mesh, sample_tokens(config)[:, :PROMPT])
    with use_layout(prefill_layout, mesh):
        token, cache = jit(prefill, graphdef, config)(placed, prompt)
    placed = jax.device_put(params, param_shardings(params, decode_layout, mesh))
    with use_layout(decode_layout, mesh):
        return np.asarray(jit(decode_loop, graphdef)(placed, token, cache))


@functools.cache
def sharded_run(config_name: str, mesh_name: str, layout: str):
    """Errors of the sharded train step against the reference, the placement of the stepped parameters, and the
    tokens greedy decoding generates, all under `layout`."""
    config, graphdef, params, expected = reference(config_name)
    mesh = mesh_of(mesh_name)
    placed, tokens = on_mesh(params, layout, mesh, sample_tokens(config))
    with use_layout(layout, mesh):
        (logits, loss, grads, stepped), generated = jit(whole_case, graphdef, config)(placed, tokens)
    return {
        "logits": max_error(logits, expected["logits"]),
        "loss": max_error(loss, expected["loss"]),
        "grads": errors_by_path(grads, expected["grads"]),
        "stepped": errors_by_path(stepped, expected["stepped"]),
        "param_shardings": [leaf.sharding.spec for leaf in jax.tree.leaves(stepped)],
        "expected_shardings": [s.spec for s in jax.tree.leaves(param_shardings(params, layout, mesh))],
        "generated": np.asarray(generated),
    }


def worst(errors: dict[str, float]) -> tuple[str, float]:
    return max(errors.items(), key=lambda item: item[1])


@pytest.mark.parametrize("config_name,mesh_name,layout", CASES)
def test_logits_loss_and_gradients_match_the_unsharded_model(config_name, mesh_name, layout):
    run = sharded_run(config_name, mesh_name, layout)
    assert run["logits"] <= FP32_TOLERANCE
    assert run["loss"] <= FP32_TOLERANCE
    assert worst(run["grads"])[1] <= FP32_TOLERANCE, worst(run["grads"])


@pytest.mark.parametrize("config_name,mesh_name,layout", CASES)
def test_one_adamw_step_gives_the_same_parameters_in_place(config_name, mesh_name, layout):
    run = sharded_run(config_name, mesh_name, layout)
    assert worst(run["stepped"])[1] <= FP32_TOLERANCE, worst(run["stepped"])
    assert run["param_shardings"] == run["expected_shardings"]


@pytest.mark.parametrize("config_name,mesh_name,layout", CASES)
def test_greedy_decoding_with_the_kv_cache_gives_the_same_tokens(config_name, mesh_name, layout):
    run = sharded_run(config_name, mesh_name, layout)
    np.testing.assert_array_equal(run["generated"], reference(config_name)[3]["generated"])


MIXED_CASES = [("tiny", mesh) for mesh in MESHES if mesh != "1x1x1"] + [("tiny-moe", "1x2x4")]


@pytest.mark.parametrize("config_name,mesh_name", MIXED_CASES)
def test_prefill_under_starscream_tp_then_decode_under_starscream_decode(config_name, mesh_name):
    generated = generate(config_name, mesh_of(mesh_name), "starscream_tp", "starscream_decode")
    np.testing.assert_array_equal(generated, reference(config_name)[3]["generated"])


@pytest.mark.parametrize("config_name", ["tiny", "tiny-moe", TIED])
def test_reference_outputs_are_informative(config_name):
    """The checks above can fail: the step moves every parameter by far more than the tolerance, and greedy
    decoding does not repeat one token."""
    config, _, params, outputs = reference(config_name)
    assert ("lm_head" in params) != config.tie_embeddings  # a tied model has no head of its own
    moved = errors_by_path(outputs["stepped"], params)
    assert min(moved.values()) > 10 * FP32_TOLERANCE, min(moved.items(), key=lambda item: item[1])
    assert len(np.unique(outputs["generated"])) > NEW_TOKENS


def test_cached_decoding_equals_the_uncached_forward_pass():
    """Unsharded: each token generated with the KV cache is the argmax of the uncached forward pass over the prompt
    and the tokens generated before it (one causal pass over the whole sequence gives every position's argmax)."""
    config, graphdef, params, outputs = reference("tiny")
    sequence_BS = np.concatenate([sample_tokens(config)[:, :PROMPT], outputs["generated"][:, :-1]], axis=1)
    logits_BSV = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t).logits)(params, sequence_BS)
    np.testing.assert_array_equal(np.argmax(logits_BSV[:, PROMPT - 1:], axis=-1), outputs["generated"])


CP_KEPT_BY_DEFAULT = {("starscream_cp", "1x2x4"), ("starscream_cp", "2x2x2"), ("flat_cp", "1x2x4")}
"""Context-parallel cases the default run keeps, the rest with `-m slow`: starscream_cp on one GPU split of 2 x 4
and with a data axis, flat_cp's flat gathers on the same 2 x 4 (on 4 x 2 both split the sequence the same way over
other sizes)."""


@pytest.mark.parametrize("layout,mesh_name", [
    pytest.param(layout, mesh, marks=() if (layout, mesh) in CP_KEPT_BY_DEFAULT else pytest.mark.slow)
    for layout in ("starscream_cp", "flat_cp") for mesh in MESHES if mesh != "1x1x1"])
def test_context_parallel_training_matches_and_only_starscream_cp_stays_hierarchical(layout, mesh_name):
    """The sequence split over the partitions (starscream_cp, with tensor parallelism across GPUs) or over every
    device (flat_cp, with fully sharded weights): the loss and gradients equal the unsharded model's; starscream_cp's
    collectives stay inside a GPU or across GPUs, flat_cp gathers its weights over both at once."""
    from starscream_jax.analysis.principles import check_principles
    from starscream_jax.analysis.report import inspect_compiled

    config, graphdef, params, _ = reference("tiny")
    tokens = np.random.default_rng(2).integers(0, config.vocab_size, (4, 33), dtype=np.int32)  # 32 positions

    def loss_and_grads(params, tokens_BS):
        return jax.value_and_grad(lambda p: next_token_loss(nnx.merge(graphdef, p), tokens_BS))(params)

    expected_loss, expected_grads = jit(loss_and_grads)(params, tokens)
    mesh = mesh_of(mesh_name)
    placed = jax.device_put(params, param_shardings(params, layout, mesh))
    with use_layout(layout, mesh):
        compiled = jit(loss_and_grads).lower(placed, jax.device_put(tokens, batch_sharding(layout, mesh, 4))).compile()
        loss, grads = compiled(placed, jax.device_put(tokens, batch_sharding(layout, mesh, 4)))
    assert max_error(loss, expected_loss) <= FP32_TOLERANCE
    assert worst(errors_by_path(grads, expected_grads))[1] <= FP32_TOLERANCE
    verdict = check_principles(inspect_compiled(compiled, mesh), None).hierarchical_collectives
    assert verdict.ok == (layout == "starscream_cp"), verdict.violations


def test_remat_recomputes_each_layers_matmuls_in_the_backward_pass():
    """With remat the gradient program runs every forward matmul of the layer loop a second time (a third of the
    loop's matmuls more), and gives the same gradients."""
    from starscream_jax.analysis.hlo import parse_hlo

    tokens = jnp.arange(2 * 9, dtype=jnp.int32).reshape(2, 9) % 256

    def gradient_program(remat: bool):
        config = load_model_config("tiny", remat=remat)
        graphdef, params = nnx.split(Transformer(config, rngs=nnx.Rngs(0)), nnx.Param)
        grad = jax.jit(jax.grad(lambda p: next_token_loss(nnx.merge(graphdef, p), tokens)))
        return grad.lower(params).compile(), params

    (kept, params), (recomputed, _) = gradient_program(False), gradient_program(True)
    dots = [sum(dot.count for dot in parse_hlo(program.as_text()).dots) for program in (kept, recomputed)]
    assert dots[1] > dots[0]
    for got, want in zip(jax.tree.leaves(recomputed(params)), jax.tree.leaves(kept(params))):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_create_sharded_model_equals_the_unsharded_initialisation():
    mesh = mesh_of("1x2x4")
    _, _, params, _ = reference("tiny")
    created = nnx.state(create_sharded_model(load_model_config("tiny"), "starscream_tp", mesh, seed=0), nnx.Param)
    expected = param_shardings(params, "starscream_tp", mesh)
    for value, sharding in zip(jax.tree.leaves(created), jax.tree.leaves(expected)):
        assert value.sharding == sharding
    assert worst(errors_by_path(created, params))[1] == 0.0


def test_batch_sharding_checks_divisibility():
    mesh = mesh_of("2x2x2")
    assert batch_sharding("starscream_tp", mesh, 8).spec == jax.sharding.PartitionSpec(("data", "xcd"), None)
    assert batch_sharding("flat_fsdp", mesh).spec == jax.sharding.PartitionSpec(("data", "gpu", "xcd"), None)
    with pytest.raises(ShardingRuleError, match=r"token batch \(6, 1\) .* 'batch' of size 6 is not "
                                                 r"divisible .* in the activation rules of flat_fsdp"):
        batch_sharding("flat_fsdp", mesh, 6)


@pytest.mark.parametrize("index, new_tokens", [(7, 2), (8, 1), (0, 9), (-1, 1)])
def test_a_write_past_the_end_of_the_kv_cache_is_an_error(index, new_tokens):
    """A cache of 8 positions holds positions 0-7: writing past it (or before it) is refused, not clamped onto the
    last slots, when the model is called directly as well as under jit with the index known."""
    config, graphdef, params, _ = reference("tiny")
    model = nnx.merge(graphdef, params)
    cache = init_cache(config, 2, 8)
    tokens_BS = np.zeros((2, new_tokens), np.int32)
    with pytest.raises(StarscreamError, match="into a KV cache of 8 positions"):
        model(tokens_BS, cache=cache, cache_index=index)
    with pytest.raises(StarscreamError, match="into a KV cache of 8 positions"):
        jax.jit(lambda t, c: model(t, cache=c, cache_index=index))(tokens_BS, cache)


def test_a_write_that_ends_at_the_last_slot_of_the_kv_cache_is_allowed():
    config, graphdef, params, _ = reference("tiny")
    model = nnx.merge(graphdef, params)
    logits = model(np.zeros((2, 2), np.int32), cache=init_cache(config, 2, 8), cache_index=6).logits
    assert logits.shape == (2, 2, config.vocab_size)


def test_a_prompt_prefilled_in_chunks_split_over_the_partitions_equals_the_unsharded_model():
    """One sequence on 2 GPUs x 4 partitions (starscream_tp+seq): its 16 tokens in two chunks of 8, each split over
    the partitions, the second at a traced index attending split-K to the cache the first wrote. The logits of both
    are the unsharded model's over the whole sequence."""
    config, graphdef, params, expected = reference("tiny")
    mesh = mesh_of("1x2x4")
    layout = fit_batch("starscream_tp", mesh, 1, None)
    assert layout.name == "starscream_tp+seq"

    def chunks(params, tokens_BS, at):
        model = nnx.merge(graphdef, params)
        first = model(tokens_BS[:, :PROMPT], cache=init_cache(config, 1, SEQ), cache_index=0)
        second = model(tokens_BS[:, PROMPT:], cache=first.cache, cache_index=at)
        return jnp.concatenate([first.logits, second.logits], axis=1)

    with use_layout(layout, mesh):
        placed = jax.device_put(params, param_shardings(params, layout, mesh))
        tokens_BS = jax.device_put(sample_tokens(config)[:1], batch_sharding(layout, mesh, 1))
        logits = jax.jit(chunks)(placed, tokens_BS, jnp.int32(PROMPT))
    assert max_error(logits, expected["logits"][:1]) <= FP32_TOLERANCE


@pytest.mark.parametrize("index, new_tokens, fits", [(6, 2, True), (7, 2, False), (8, 1, False), (-1, 1, False)])
def test_a_traced_index_that_would_write_past_the_kv_cache_poisons_the_logits(index, new_tokens, fits):
    """Decode inside jit with the index a tracer: the write cannot be refused while tracing, and XLA would clamp it
    onto the last slots; every logit of such a step is NaN instead, so the caller sees it. A write that fits is
    untouched."""
    config, graphdef, params, _ = reference("tiny")
    model = nnx.merge(graphdef, params)
    step = jax.jit(lambda tokens, cache, at: model(tokens, cache=cache, cache_index=at))
    logits = step(np.zeros((2, new_tokens), np.int32), init_cache(config, 2, 8), jnp.int32(index)).logits
    assert bool(jnp.all(jnp.isfinite(logits))) if fits else bool(jnp.all(jnp.isnan(logits)))


@pytest.mark.parametrize("mesh_name, layout, batch", [("1x1x1", None, 1), ("1x2x4", "starscream_fsdp", 8)])
def test_one_row_decode_projections_run_on_padded_rows_and_compute_the_same(mesh_name, layout, batch, monkeypatch):
    """A decode step whose devices each hold one sequence (batch 1; batch 8 split over 8 devices) runs its small
    projections on rows padded with zeros (projections._padded_matmul, which an optimization barrier keeps in the
    program) and computes the logits it computes without them."""
    from starscream_jax.model import projections

    config, graphdef, params, _ = reference("tiny")
    tokens_BS = sample_tokens(config)[:batch, :1]
    mesh = mesh_of(mesh_name)

    def decode(padding: bool):
        monkeypatch.setattr(projections, "policy_of", lambda device: PADDING if padding else PORTABLE)
        with contextlib.ExitStack() as stack:
            if layout:
                stack.enter_context(use_layout(layout, mesh))
            step = jit(lambda p, t: nnx.merge(graphdef, p)(t, cache=init_cache(config, batch, 4), cache_index=2).logits)
            return step.lower(params, tokens_BS).as_text().count("optimization_barrier"), step(params, tokens_BS)

    (barriers, padded), (none, plain) = decode(True), decode(False)
    # q, k, v, o, gate, up, down: every tiny weight is small (the layer's body is lowered once per layer or once)
    assert none == 0 and barriers > 0 and barriers % 7 == 0
    np.testing.assert_allclose(np.asarray(padded), np.asarray(plain), atol=FP32_TOLERANCE)


PLACEMENT_CASES = [("tiny", "starscream_tp", "train"), ("tiny", "starscream_decode", "decode"),
                   ("tiny", "starscream_decode", "paged"), ("tiny-moe", "starscream_ep", "train"),
                   pytest.param("tiny", "starscream_fsdp", "train", marks=pytest.mark.slow)]
"""Training, decode over the dense cache, the paged step and the routed block by default; another training layout
(the same functions under other rules) with `-m slow`."""


@pytest.mark.parametrize("config_name, layout, phase", PLACEMENT_CASES)
def test_the_model_places_by_the_placement_it_is_handed_not_by_an_active_layout(config_name, layout, phase):
    """The library's steps hand the model its placement: traced with only JAX's mesh set (no layout active), the
    training loss and gradients, a decode step over a dense cache and a step over the paged cache lower to the same
    program as under `use_layout`, so no helper on their path reads the active layout. A helper that did would
    place nothing without it, and the programs would differ."""
    from starscream_jax.model.paged import PAGES, TABLE, PagedCache, init_pages, pool_shape
    from starscream_jax.sharding.apply import Placement

    config, graphdef, params, _ = reference(config_name)
    mesh = mesh_of("1x2x4")
    placement = Placement.of(layout, mesh)
    placed = jax.device_put(params, param_shardings(params, layout, mesh))
    tokens_BS = jax.device_put(sample_tokens(config), batch_sharding(layout, mesh, BATCH))

    def traced(params, tokens_BS):
        model = nnx.merge(graphdef, params)
        if phase == "train":
            return jax.value_and_grad(lambda p: next_token_loss(nnx.merge(graphdef, p), tokens_BS, placement))(params)
        if phase == "decode":
            cache = init_cache(config, BATCH, SEQ, placement)
            return model(tokens_BS[:, :1], cache=cache, cache_index=3, placement=placement).logits
        shards = 4  # the pools' pages and the rows over the 4 partitions of each GPU (xcd)
        shape = pool_shape(shards * (BATCH // shards * 4 + 1), 4, config.n_kv_heads, config.head_dim)
        pools = init_pages(config.n_layers, shape, jnp.float32, placement.sharding(PAGES, shape))
        local_BM = jnp.arange(4, dtype=jnp.int32)[None, :] + 1 + 4 * (jnp.arange(BATCH)[:, None] % 2)
        table = placement.constrain(local_BM, TABLE)  # each shard's two rows: its pages 1-4 and 5-8 (0 is null)
        cache = PagedCache(k=pools, v=pools, table=table)
        positions_BS = jnp.broadcast_to(jnp.arange(SEQ // 2), (BATCH, SEQ // 2))
        return model.paged(tokens_BS[:, :SEQ // 2], positions_BS, jnp.full((BATCH,), SEQ // 2 - 1), cache,
                           placement=placement)[0]

    program = jax.jit(traced)
    with jax.set_mesh(mesh):
        handed = program.lower(placed, tokens_BS).as_text()
    with use_layout(layout, mesh):
        active = program.lower(placed, tokens_BS).as_text()
    assert "sdy.sharding" in handed or "mhlo.sharding" in handed
    assert handed == active
