"""Per-device kernels: attention with and without the KV cache, vocab-parallel embedding lookup and cross entropy.
Each sharded run is compared with the same op run with no layout active (one device, plain jnp)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from starscream_jax.errors import ShardingRuleError
from starscream_jax.hardware.mesh import auto_axes, build_mesh
from starscream_jax.model.dense_cache import DenseLayer, write_cache
from starscream_jax.model.ops import attention, cross_entropy, embed_lookup
from starscream_jax.sharding.apply import use_layout, weight
from starscream_jax.sharding.layouts import fit_batch, get_layout

FP32_TOLERANCE = 2e-5
"""Largest absolute difference between a sharded and the unsharded float32 result (see tests/model/test_decoder.py)."""
B, S, H, K, E, V, D = 8, 8, 8, 2, 4, 64, 16


def qkv(heads: int = H, kv_heads: int = K, seq: int = S):
    keys = jax.random.split(jax.random.key(0), 3)
    return (jax.random.normal(keys[0], (B, seq, heads, E)), jax.random.normal(keys[1], (B, seq, kv_heads, E)),
            jax.random.normal(keys[2], (B, seq, kv_heads, E)))


def positions(seq: int = S, start: int = 0):
    return jnp.broadcast_to(jnp.arange(start, start + seq), (B, seq))


def empty_cache(length: int = S, kv_heads: int = K, batch: int = B):
    """Layer 0 of a one-layer model's stacked KV cache, [1, B, T, K, E] each."""
    zeros = jnp.zeros((1, batch, length, kv_heads, E))
    return DenseLayer(k=zeros, v=zeros, layer=0)


def through_cache(q, k, v, positions_BS, cache, index):
    """(attention of the new queries through the cache, the cache) after writing the new keys and values at
    `index`, as the model's layers do."""
    cache = write_cache(cache, index, k, v)
    return attention(q, k, v, positions_BS, cache.read(), index), cache


def grouped_attention_by_hand(q, k, v):
    """Causal softmax attention with query head h reading kv head h // (H / K), in plain jnp."""
    k, v = (jnp.repeat(x, q.shape[2] // k.shape[2], axis=2) for x in (k, v))
    scores = jnp.einsum("bshe,bthe->bhst", q, k) / jnp.sqrt(q.shape[-1])
    causal = jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
    return jnp.einsum("bhst,bthe->bshe", weights, v)


def test_unsharded_attention_is_grouped_query_causal_attention():
    q, k, v = qkv()
    out = attention(q, k, v, positions())
    np.testing.assert_allclose(out, grouped_attention_by_hand(q, k, v), atol=1e-5)


def test_prefill_in_two_chunks_through_the_cache_equals_one_pass():
    q, k, v = qkv()
    full = attention(q, k, v, positions())
    first, cache = through_cache(q[:, :5], k[:, :5], v[:, :5], positions(5), empty_cache(), 0)
    second, cache = through_cache(q[:, 5:], k[:, 5:], v[:, 5:], positions(3, start=5), cache, 5)
    np.testing.assert_allclose(jnp.concatenate([first, second], axis=1), full, atol=1e-5)
    np.testing.assert_array_equal(cache.k[0], k)
    np.testing.assert_array_equal(cache.v[0], v)


def test_decode_sees_the_cache_up_to_its_position_only():
    """One new position per sequence reads a prefix of the cache (key_value_seq_lengths): the slots after each row's
    position hold random keys and values that must not count."""
    q, k, v = qkv()
    position_B = jnp.arange(B) % (S - 1)  # rows at positions 0 .. S - 2, never the last slot
    out_B1HE = attention(q[:, :1], k[:, :1], v[:, :1], position_B[:, None], DenseLayer(k=k, v=v))
    for row, position in enumerate(np.asarray(position_B)):
        keys_THE, values_THE = (jnp.repeat(x[row, :position + 1], H // K, axis=1) for x in (k, v))
        weights_HT = jax.nn.softmax(jnp.einsum("he,the->ht", q[row, 0], keys_THE) / np.sqrt(E), axis=-1)
        np.testing.assert_allclose(out_B1HE[row, 0], jnp.einsum("ht,the->he", weights_HT, values_THE), atol=1e-5)


def sharded(layout, mesh, function, *args):
    with use_layout(layout, mesh):
        return jax.jit(function)(*args)


@pytest.mark.parametrize("layout,topology", [
    ("flat_tp", "2x4"),            # 8 query heads one per device; 2 kv heads kept over gpu and sliced per device
    ("gpu_tp", "4x2"),             # 2 query heads per GPU share half a kv head group
    ("starscream_tp", "2x4"),      # batch over xcd, heads over gpu
    ("starscream_decode", "4x2"),
    ("flat_fsdp", "2x4"),
])
def test_sharded_attention_with_and_without_cache_equals_unsharded(layout, topology):
    q, k, v = qkv()
    expected = attention(q, k, v, positions())
    mesh = build_mesh(topology)
    out = sharded(layout, mesh, lambda q, k, v: attention(q, k, v, positions()), q, k, v)
    np.testing.assert_allclose(out, expected, atol=FP32_TOLERANCE)

    def last_token_through_cache(q, k, v, cache):
        _, cache = through_cache(q[:, :-1], k[:, :-1], v[:, :-1], positions(S - 1), cache, 0)
        return through_cache(q[:, -1:], k[:, -1:], v[:, -1:], positions(1, start=S - 1), cache, S - 1)

    last, cache = sharded(layout, mesh, last_token_through_cache, q, k, v, empty_cache())
    np.testing.assert_allclose(last, expected[:, -1:], atol=FP32_TOLERANCE)
    np.testing.assert_array_equal(cache.k[0], k)


SEQUENCE_SPLIT = "starscream_cp"
"""Tensor parallelism over GPUs with the sequence, not the batch, over the partitions (context parallelism)."""


def test_attention_over_a_split_sequence_and_its_gradient_equal_unsharded():
    """Each partition holds a quarter of the positions: its queries must still see every earlier key."""
    q, k, v = qkv()
    weights = jax.random.normal(jax.random.key(1), (B, S, H, E))

    def loss(q, k, v):
        return jnp.sum(attention(q, k, v, positions()) * weights)

    expected = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)
    got = sharded(SEQUENCE_SPLIT, build_mesh("2x4"), jax.value_and_grad(loss, argnums=(0, 1, 2)), q, k, v)
    for actual, wanted in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        np.testing.assert_allclose(actual, wanted, atol=FP32_TOLERANCE)


def test_a_split_sequence_writes_its_cache_split_by_position_and_later_chunks_read_it():
    """A prompt split over the 4 partitions attends as unsharded and leaves the cache in strided order (partition i
    holds positions i and i + 4); a prompt in two chunks (chunked prefill), each split over the partitions, equals
    it too: the second chunk's queries attend split-K to the cache the first wrote, itself written in place."""
    q, k, v = qkv()
    mesh = build_mesh("2x4")
    out, cache = sharded(SEQUENCE_SPLIT, mesh, lambda q, k, v, cache: through_cache(q, k, v, positions(), cache, 0),
                         q, k, v, empty_cache())
    np.testing.assert_allclose(out, attention(q, k, v, positions()), atol=FP32_TOLERANCE)
    np.testing.assert_array_equal(cache.k[0], k[:, [0, 4, 1, 5, 2, 6, 3, 7]])

    def two_chunks(q, k, v, cache, at):
        first, cache = through_cache(q[:, :4], k[:, :4], v[:, :4], positions(4), cache, 0)
        second, cache = through_cache(q[:, 4:], k[:, 4:], v[:, 4:], positions(4, 4), cache, at)
        return jnp.concatenate([first, second], axis=1), cache

    chunked, cache = sharded(SEQUENCE_SPLIT, mesh, two_chunks, q, k, v, empty_cache(), jnp.int32(4))
    np.testing.assert_allclose(chunked, out, atol=FP32_TOLERANCE)
    np.testing.assert_array_equal(cache.k[0], k[:, [0, 4, 1, 5, 2, 6, 3, 7]])


def test_split_k_decode_over_a_cache_split_by_position_equals_unsharded():
    """Fewer sequences than partitions: the cache's positions over the 4 partitions of each GPU (strided), the last
    position's query attending split-K."""
    batch = 3
    q, k, v = (x[:batch] for x in qkv())
    layout = fit_batch("starscream_decode", build_mesh("2x4"), batch, 1)
    assert layout.name == "starscream_decode+split_k"

    def last_token(q, k, v, cache):
        _, cache = through_cache(q[:, :-1], k[:, :-1], v[:, :-1], positions(S - 1)[:batch], cache, 0)
        return through_cache(q[:, -1:], k[:, -1:], v[:, -1:], positions(1, start=S - 1)[:batch], cache, S - 1)

    cache = empty_cache(batch=batch)
    last, cache = sharded(layout, build_mesh("2x4"), last_token, q, k, v, cache)
    np.testing.assert_allclose(last, attention(q, k, v, positions()[:batch])[:, -1:], atol=FP32_TOLERANCE)
    np.testing.assert_array_equal(cache.k[0], k[:, [0, 4, 1, 5, 2, 6, 3, 7]])


def test_query_heads_that_split_a_kv_group_unevenly_are_refused():
    q, k, v = qkv(heads=6, kv_heads=2)
    with pytest.raises(ShardingRuleError, match="6 query heads over 3 devices gives 2 per device, which splits groups "
                                                "of 3 query heads per kv head unevenly"):
        sharded("gpu_tp", build_mesh("3x1"), lambda q, k, v: attention(q, k, v, positions()), q, k, v)


def test_kv_heads_on_axes_the_query_heads_do_not_lead_with_are_refused():
    layout = get_layout("gpu_tp").with_rules(activations={"kv_heads": "xcd"})
    q, k, v = qkv(kv_heads=4)
    with pytest.raises(ShardingRuleError, match=r"kv heads sharded over \('xcd',\) but query heads over \('gpu',\)"):
        sharded(layout, build_mesh("2x4"), lambda q, k, v: attention(q, k, v, positions()), q, k, v)


def table_and_tokens():
    table = jax.random.normal(jax.random.key(1), (V, D))
    return table, jax.random.randint(jax.random.key(2), (B, S), 0, V)


@pytest.mark.parametrize("layout", ["flat_tp", "starscream_decode", "flat_fsdp"])
def test_vocab_parallel_embedding_lookup_equals_take(layout):
    table, tokens = table_and_tokens()

    def lookup(table_VD, tokens_BS):
        return embed_lookup(weight(table_VD, ("vocab", "embed")), tokens_BS, out=("batch", "seq", "embed"))

    rows = sharded(layout, build_mesh("2x4"), lookup, table, tokens)
    np.testing.assert_array_equal(rows, jnp.take(table, tokens, axis=0))


def test_embedding_placed_unlike_the_residual_stream_is_refused():
    """starscream_decode keeps the residual stream's embed over xcd; weight rules that use the table with embed
    whole do not fit it."""
    table, tokens = table_and_tokens()
    layout = get_layout("starscream_decode").with_rules(weights={"embed": None})
    with pytest.raises(ShardingRuleError, match="embedding table at use shards embed over None but the residual "
                                                "stream over xcd"):
        sharded(layout, build_mesh("2x4"), lambda t, x: embed_lookup(t, x, out=("batch", "seq", "embed")),
                table, tokens)


def test_a_table_as_stored_is_taken_as_the_layout_uses_it():
    """A table passed as create_sharded stores it (embed over xcd) is gathered inside the GPU first, as `weight`
    gathers it: the rows equal take's, forward and gradient, on Explicit and on Auto axes, and the gradient is
    placed like the stored table."""
    table, tokens = table_and_tokens()
    mesh = build_mesh("2x4")

    def summed(table_VD, tokens_BS):
        return jnp.sum(jnp.sin(embed_lookup(table_VD, tokens_BS)))

    expected = jax.value_and_grad(lambda t: jnp.sum(jnp.sin(jnp.take(t, tokens, axis=0))))(table)
    for on in (mesh, auto_axes(mesh)):
        stored = jax.device_put(table, jax.sharding.NamedSharding(on, jax.sharding.PartitionSpec("gpu", "xcd")))
        value, grad = sharded("starscream_tp", on, jax.value_and_grad(summed), stored, tokens)
        np.testing.assert_allclose(value, expected[0], rtol=1e-6)
        np.testing.assert_allclose(grad, expected[1], atol=1e-6)
        assert grad.sharding.spec == jax.sharding.PartitionSpec("gpu", "xcd")


@pytest.mark.parametrize("layout,axes", [("flat_tp", "explicit"), ("starscream_tp", "explicit"),
                                         ("starscream_tp", "auto")], ids=["flat", "tp", "auto"])
def test_vocab_parallel_cross_entropy_and_its_gradient_equal_optax(layout, axes):
    mesh = build_mesh("2x4") if axes == "explicit" else auto_axes(build_mesh("2x4"))  # built at run time, not at
    # collection: on a GPU machine `pytest -m gpu` collects this file without simulated devices
    logits = 3 * jax.random.normal(jax.random.key(3), (B, S, V))
    targets = jax.random.randint(jax.random.key(4), (B, S), 0, V)

    def mean_loss(loss_fn):
        return jax.value_and_grad(lambda x: jnp.mean(loss_fn(x, targets)))

    expected_loss, expected_grad = mean_loss(optax.softmax_cross_entropy_with_integer_labels)(logits)
    loss, grad = sharded(layout, mesh, mean_loss(cross_entropy), logits)
    np.testing.assert_allclose(loss, expected_loss, atol=FP32_TOLERANCE)
    np.testing.assert_allclose(grad, expected_grad, atol=FP32_TOLERANCE)
    assert cross_entropy(logits, targets).shape == (B, S)


def test_cross_entropy_gradient_is_not_a_scatter_over_the_logits():
    """The target's logit is picked as a masked sum, so the compiled gradient holds no scatter (which would write a
    [B, S, V] float32 array and read it again), and it equals optax's."""
    logits = 3 * jax.random.normal(jax.random.key(3), (B, S, V))
    targets = jax.random.randint(jax.random.key(4), (B, S), 0, V)
    gradient = jax.jit(jax.grad(lambda x: jnp.mean(cross_entropy(x, targets))))
    assert " scatter(" not in gradient.lower(logits).compile().as_text()
    expected = jax.grad(lambda x: jnp.mean(optax.softmax_cross_entropy_with_integer_labels(x, targets)))(logits)
    np.testing.assert_allclose(gradient(logits), expected, atol=1e-7)


def test_split_k_decode_over_an_8_bit_cache_equals_the_unsharded_8_bit_cache():
    """Three sequences on 8 partitions: the 8-bit cache's values and scales are split by position together, and
    the last query attends split-K with each part's scales, as the unsharded 8-bit cache attends."""
    batch = 3
    q, k, v = (x[:batch] for x in qkv())
    layout = fit_batch("starscream_decode", build_mesh("2x4"), batch, 1)
    values = jnp.zeros((1, batch, S, K, E), jnp.int8)
    cache = DenseLayer(k=values, v=values, k_scale=jnp.ones((1, batch, S, K)), v_scale=jnp.ones((1, batch, S, K)),
                       layer=0)

    def last_token(q, k, v, cache):
        _, cache = through_cache(q[:, :-1], k[:, :-1], v[:, :-1], positions(S - 1)[:batch], cache, 0)
        return through_cache(q[:, -1:], k[:, -1:], v[:, -1:], positions(1, start=S - 1)[:batch], cache, S - 1)

    expected, whole = jax.jit(last_token)(q, k, v, cache)
    last, split = sharded(layout, build_mesh("2x4"), last_token, q, k, v, cache)
    np.testing.assert_allclose(last, expected, atol=FP32_TOLERANCE)
    order = [0, 4, 1, 5, 2, 6, 3, 7]
    for name, entry in split.entries().items():
        np.testing.assert_array_equal(np.asarray(entry[0], np.float32),
                                      np.asarray(whole.entries()[name][0][:, order], np.float32))


def _eight_bit_decode_operands(format_name: str, batch: int = 3, length: int = 24, kv_heads: int = 2,
                               group: int = 4, head_dim: int = 16):
    """A bfloat16 query per row [B, 1, H, E], a float cache [B, T, K, E] (ranges spread over positions), its 8-bit
    values and scales [B, T, K], and each row's position [B, 1] (rows at the start, middle and end)."""
    from starscream_jax.model.quantize import quantize_cache_entry

    keys = jax.random.split(jax.random.key(7), 3)
    q = jax.random.normal(keys[0], (batch, 1, kv_heads * group, head_dim)).astype(jnp.bfloat16)
    spread = jnp.linspace(0.5, 3.0, length)[None, :, None, None]
    k, v = (jax.random.normal(key, (batch, length, kv_heads, head_dim)) * spread for key in keys[1:])
    (k8, k_scale), (v8, v_scale) = (quantize_cache_entry(x, format_name) for x in (k, v))
    positions_B1 = (jnp.arange(batch)[:, None] * (length - 1)) // max(batch - 1, 1)
    return q, (k, v), (k8, v8, k_scale, v_scale), positions_B1


@pytest.mark.parametrize("format_name", ["int8", "float8_e4m3fn"])
def test_decode_over_an_8_bit_cache_reads_it_in_place_as_the_matmul_form_computes(format_name):
    """One query per row: the in-place form (`ops._decode_over_8_bit_cache`) gives the batched-matmul form's
    output (the prefill form, run here at S = 1) to bfloat16's rounding, and attention over the dequantized cache
    to the format's step."""
    from starscream_jax.model import ops

    q, (k, v), (k8, v8, k_scale, v_scale), positions_B1 = _eight_bit_decode_operands(format_name)
    got = jax.jit(ops._decode_over_8_bit_cache)(q, k8, v8, k_scale, v_scale, positions_B1)
    assert got.shape == q.shape and got.dtype == q.dtype
    B, _, H, E = q.shape
    scores = jnp.einsum("bkge,btke->bkgt", q[:, 0].reshape(B, 2, H // 2, E).astype(jnp.float32),
                        k8.astype(jnp.float32)) * jnp.swapaxes(k_scale, 1, 2)[:, :, None] * E ** -0.5
    seen = jnp.arange(k8.shape[1])[None, None, None] <= positions_B1[:, :, None, None]
    weights = jax.nn.softmax(jnp.where(seen, scores, -jnp.inf), axis=-1) * jnp.swapaxes(v_scale, 1, 2)[:, :, None]
    expected = jnp.einsum("bkgt,btke->bkge", weights, v8.astype(jnp.float32)).reshape(B, 1, H, E)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(expected), rtol=2e-2, atol=2e-2)
    floats = [(x.astype(jnp.float32) * scale[..., None]).astype(jnp.bfloat16) for x, scale in ((k8, k_scale),
                                                                                               (v8, v_scale))]
    dequantized = attention(q, floats[0][:, :1], floats[1][:, :1], positions_B1, DenseLayer(k=floats[0], v=floats[1]))
    error = float(jnp.sqrt(jnp.mean((got.astype(jnp.float32) - dequantized.astype(jnp.float32)) ** 2)))
    assert error <= 0.02 * float(jnp.sqrt(jnp.mean(dequantized.astype(jnp.float32) ** 2)))


def test_decode_over_an_8_bit_cache_has_no_matmul_and_no_float_copy_of_the_cache_where_the_policy_reads_it_in_place(
        monkeypatch):
    """The dense cache's path (`attention`) at one query per row under a policy of in-place reads
    (`BackendPolicy.eight_bit_attention` "reductions", the NVIDIA policy's form for shapes its kernel does not take):
    no dot_general and no transpose in the traced program (the batched dot's layout is what made XLA copy the
    converted cache per step); a chunk of several queries keeps the matmul form, and so does decode under the
    portable policy (XLA's dots)."""
    from starscream_jax.hardware.backend import PORTABLE
    from starscream_jax.model import ops

    q, _, (k8, v8, k_scale, v_scale), positions_B1 = _eight_bit_decode_operands("int8")
    cache = DenseLayer(k=k8, v=v8, k_scale=k_scale, v_scale=v_scale)
    new = k8[:, :1].astype(q.dtype)  # the new keys and values, already in the cache: only their shape is read
    def decode():  # a new function each time: a traced one is cached
        return str(jax.make_jaxpr(lambda q, c: attention(q, new, new, positions_B1, c))(q, cache))

    assert "dot_general" in decode()
    monkeypatch.setattr(ops, "policy_of", lambda device: dataclasses.replace(PORTABLE,
                                                                             eight_bit_attention="reductions"))
    jaxpr = decode()
    assert "dot_general" not in jaxpr and "transpose" not in jaxpr
    prefill = str(jax.make_jaxpr(lambda q, c: attention(q, jnp.concatenate([new, new], axis=1), jnp.concatenate(
        [new, new], axis=1), jnp.concatenate([positions_B1, positions_B1], axis=1), c))(
        jnp.concatenate([q, q], axis=1), cache))
    assert "dot_general" in prefill  # a chunk of several queries keeps the matmul form


@pytest.mark.parametrize("length", [16, 32, 64])
def test_compiled_decode_over_an_8_bit_cache_on_this_backend_is_the_float_attention(length):
    """One row at the cache's last position, 8 query heads over 4 kv heads of 16, compiled for this process's
    backend: the output within float32 rounding of a float64 reference over the same 8-bit values (XLA:CPU
    compiled the reductions' form of 32 or more positions with scores off by about 1,000)."""
    batch, kv_heads, group, head_dim = 1, 4, 2, 16
    q, _, (k8, v8, k_scale, v_scale), _ = _eight_bit_decode_operands(
        "int8", batch=batch, length=length, kv_heads=kv_heads, group=group, head_dim=head_dim)
    q, positions_B1 = q.astype(jnp.float32), jnp.full((batch, 1), length - 1)
    cache = DenseLayer(k=k8, v=v8, k_scale=k_scale, v_scale=v_scale)
    new = k8[:, :1].astype(q.dtype)
    got = jax.jit(lambda q, c: attention(q, new, new, positions_B1, c))(q, cache)
    q64 = np.asarray(q[:, 0], np.float64).reshape(batch, kv_heads, group, head_dim)
    keys = np.asarray(k8, np.float64) * np.asarray(k_scale, np.float64)[..., None]
    values = np.asarray(v8, np.float64) * np.asarray(v_scale, np.float64)[..., None]
    scores = np.einsum("bkge,btke->bkgt", q64, keys) / np.sqrt(head_dim)
    scores = np.where(np.arange(length) <= np.asarray(positions_B1)[:, :, None, None], scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    expected = np.einsum("bkgt,btke->bkge", weights / weights.sum(-1, keepdims=True), values)
    np.testing.assert_allclose(np.asarray(got).reshape(expected.shape), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("format_name", ["int8", "float8_e4m3fn"])
def test_compiled_decode_over_an_8_bit_cache_on_a_gpu_matches_the_matmul_form(format_name):
    """Llama 3 8B's attention shape at batch 8 (8 kv heads of 4 queries, head_dim 128, 4096 positions) compiled:
    the in-place form within bfloat16's rounding of the batched-matmul form."""
    from starscream_jax.model import ops

    q, _, (k8, v8, k_scale, v_scale), positions_B1 = _eight_bit_decode_operands(format_name, batch=8, length=4096,
                                                                                 kv_heads=8, head_dim=128)
    got = jax.jit(ops._decode_over_8_bit_cache)(q, k8, v8, k_scale, v_scale, positions_B1)
    q2, positions_B2 = jnp.concatenate([q, q], axis=1), jnp.concatenate([positions_B1, positions_B1], axis=1)
    expected = jax.jit(ops.attention_over_8_bit_cache)(q2, k8, v8, k_scale, v_scale, positions_B2)[:, :1]
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(expected, np.float32), rtol=2e-2, atol=2e-2)
