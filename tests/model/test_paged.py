"""The paged KV cache's per-device op: new keys and values land in their rows' pages (padding nowhere),
and paged attention (the gather path everywhere, cuDNN's paged kernel on a GPU) equals dense attention over each
row's positions; a mixed step's stream of decode rows and prompt chunks equals the two groups attended apart."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from starscream_jax.model.ops import AttentionOptions, explicit_attention, visible_keys
from starscream_jax.errors import StarscreamError
from starscream_jax.model.paged import PagedLayer, RowSplit, _reads_in_place, paged_attention
from starscream_jax.model.quantize import quantize_cache_entry

K, H, E, PAGE, POOL = 2, 4, 8, 4, 10


def _inputs(seed=0, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(seed), 5)
    pages_k, pages_v = (jax.random.normal(key, (POOL, PAGE, K, E), dtype) for key in keys[:2])
    table = jnp.array([[3, 7, 1, 0], [5, 2, 0, 0]], jnp.int32)  # row 0: 3 pages, row 1: 2 pages
    q = jax.random.normal(keys[2], (2, 1, H, E), dtype)
    k, v = (jax.random.normal(key, (2, 1, K, E), dtype) for key in keys[3:5])
    return q, k, v, table, pages_k, pages_v


def _dense(q, pages, table, row, length):
    """[1, length, K, E]: a row's first `length` positions of the pool, in order."""
    return pages[table[row]].reshape(-1, K, E)[None, :length]


def _written_slots(before, after) -> list[tuple[int, int]]:
    """(page, slot) of every position whose keys changed."""
    return sorted(map(tuple, np.argwhere(np.any(np.asarray(after != before), axis=(2, 3)))))


@pytest.mark.parametrize("kernel, dtype, tolerance", [
    ("gather", jnp.float32, 2e-5),
    pytest.param("cudnn", jnp.bfloat16, 2e-2, marks=pytest.mark.gpu)])  # cuDNN's kernel takes 16-bit pages
def test_decode_writes_its_position_and_attends_to_the_row_prefix(kernel, dtype, tolerance):
    q, k, v, table, pages_k, pages_v = _inputs(dtype=dtype)
    positions = jnp.array([[9], [5]], jnp.int32)  # row 0 at its third page, slot 1; row 1 at its second, slot 1
    cache = PagedLayer(k=pages_k, v=pages_v, table=table, kernel=kernel)
    out, layer = jax.jit(paged_attention)(q, k, v, positions, cache)
    np.testing.assert_allclose(layer.k[1, 1], k[0, 0])
    np.testing.assert_allclose(layer.v[2, 1], v[1, 0])
    assert _written_slots(pages_k, layer.k) == [(1, 1), (2, 1)]  # nothing else written
    for row, position in enumerate((9, 5)):
        keys = _dense(q, layer.k, table, row, position + 1)
        values = _dense(q, layer.v, table, row, position + 1)
        expected = jax.nn.dot_product_attention(q[row:row + 1], keys, values)
        np.testing.assert_allclose(np.asarray(out[row:row + 1], np.float32), np.asarray(expected, np.float32),
                                   rtol=tolerance, atol=tolerance)


def test_cudnns_kernel_reads_in_place_only_what_it_computes():
    """cuDNN's paged kernel takes decode steps over 16-bit pages whose every query head has its kv head local; a
    prefill chunk, an 8-bit cache, Gemma 2's options or query heads split finer than kv heads gather instead."""
    q, _, _, _, pages_k, pages_v = _inputs(dtype=jnp.bfloat16)
    pools, group = (pages_k, pages_v), H // K
    assert _reads_in_place("cudnn", q, pools, group, None)
    assert not _reads_in_place("gather", q, pools, group, None)
    assert not _reads_in_place("cudnn", jnp.concatenate([q, q], axis=1), pools, group, None)
    assert not _reads_in_place("cudnn", q, pools + pools, group, None)  # scales beside the pages: 8-bit
    assert not _reads_in_place("cudnn", q, pools, group, AttentionOptions(scale=0.3))
    assert not _reads_in_place("cudnn", q, tuple(pool.astype(jnp.float32) for pool in pools), group, None)
    assert not _reads_in_place("cudnn", q[:, :, :H // 2], pools, group, None)  # half the queries: a kv head apart


@pytest.mark.parametrize("kernel", ["gather", "cudnn"])
def test_gemma_2s_scaled_capped_windowed_attention_reads_the_pages_as_the_dense_form(kernel):
    """Attention options (a score scale, soft-capping, a window of 3 positions) in decode and in a prefill chunk:
    each row's output is the explicit form's over its dense prefix, whichever kernel the cache names (cuDNN's paged
    kernel computes none of them, so the gathered pages are attended)."""
    options = AttentionOptions(scale=0.3, softcap=2.0, sliding=True)
    q, k, v, table, pages_k, pages_v = _inputs(3)
    for positions in (jnp.array([[9], [5]], jnp.int32), jnp.array([[4, 5, 6], [0, 1, 2]], jnp.int32)):
        width = positions.shape[1]
        q_, k_, v_ = (jnp.concatenate([x * (1.0 + i) for i in range(width)], axis=1) for x in (q, k, v))
        attend = jax.jit(lambda *a: paged_attention(*a, options=options, window=jnp.int32(3)))
        out, layer = attend(q_, k_, v_, positions, PagedLayer(k=pages_k, v=pages_v, table=table, kernel=kernel))
        for row in range(2):
            last = int(positions[row, -1]) + 1
            keys, values = _dense(q, layer.k, table, row, last), _dense(q, layer.v, table, row, last)
            visible = visible_keys(positions[row:row + 1], jnp.arange(last)[None], 3)
            expected = explicit_attention(q_[row:row + 1], keys, values, visible, options)
            np.testing.assert_allclose(out[row:row + 1], expected, rtol=2e-5, atol=2e-5)
        whole = jax.jit(lambda *a: paged_attention(*a, options=options))(
            q_, k_, v_, positions, PagedLayer(k=pages_k, v=pages_v, table=table, kernel=kernel))[0]
        assert np.abs(np.asarray(out) - np.asarray(whole)).max() > 1e-3  # the window bites


def test_padding_writes_nothing_and_prefill_is_causal():
    q, k, v, table, pages_k, pages_v = _inputs(1)
    q, k, v = (jnp.concatenate([x, x * 0.5, x * 2.0], axis=1) for x in (q, k, v))  # 3 positions per row
    positions = jnp.array([[4, 5, -1], [0, 1, 2]], jnp.int32)
    out, layer = jax.jit(paged_attention)(q, k, v, positions, PagedLayer(k=pages_k, v=pages_v, table=table))
    changed = set(_written_slots(pages_k, layer.k))
    assert changed == {(7, 0), (7, 1), (5, 0), (5, 1), (5, 2)}  # the padding dropped, the null page untouched
    keys, values = _dense(q, layer.k, table, 1, 3), _dense(q, layer.v, table, 1, 3)
    expected = jax.nn.dot_product_attention(q[1:], keys, values, is_causal=True)
    np.testing.assert_allclose(out[1:], expected, rtol=2e-5, atol=2e-5)


@pytest.mark.gpu
def test_a_prefill_chunk_attends_through_cudnn_on_a_gpu():
    """A chunk of 16-bit queries over gathered pages runs cuDNN's fused attention with its mask as a bias, not
    XLA's form (which wrote [B, K, G, S, T] float32 scores a layer: 0.48 s of an 8B model's serving run), and equals
    causal attention over each row's positions (the second row's chunk starts at position 16, after a page of
    earlier keys)."""
    rows, width, heads, kv_heads, dim, page, pool = 2, 16, 8, 2, 64, 16, 6
    keys = jax.random.split(jax.random.key(5), 5)
    pages_k, pages_v = (jax.random.normal(key, (pool, page, kv_heads, dim), jnp.bfloat16) for key in keys[:2])
    q = jax.random.normal(keys[2], (rows, width, heads, dim), jnp.bfloat16)
    k, v = (jax.random.normal(key, (rows, width, kv_heads, dim), jnp.bfloat16) for key in keys[3:5])
    table = jnp.array([[3, 1, 0], [5, 2, 4]], jnp.int32)
    positions = jnp.stack([jnp.arange(width), jnp.arange(width) + page]).astype(jnp.int32)
    cache = PagedLayer(k=pages_k, v=pages_v, table=table, kernel="cudnn")
    attend = jax.jit(paged_attention)
    assert "__cudnn$fmha" in attend.lower(q, k, v, positions, cache).compile().as_text()
    out, layer = attend(q, k, v, positions, cache)
    for row in range(rows):
        first, last = int(positions[row, 0]), int(positions[row, -1]) + 1
        dense_k, dense_v = (pages[table[row]].reshape(-1, kv_heads, dim)[None, :last] for pages in (layer.k, layer.v))
        visible = jnp.arange(last)[None, None, None, :] <= positions[row][None, None, :, None]
        expected = jax.nn.dot_product_attention(q[row:row + 1], dense_k, dense_v, mask=visible)
        assert first == row * page
        np.testing.assert_allclose(np.asarray(out[row:row + 1], np.float32), np.asarray(expected, np.float32),
                                   rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("kernel, fmt", [("gather", "int8"), ("cudnn", "float8_e4m3fn")])  # 8-bit pages gather
def test_an_8_bit_cache_stores_quantized_pages_and_attends_to_them_dequantized(kernel, fmt):
    q, k, v, table, pages_k, pages_v = _inputs(2)
    (values_k, scales_k), (values_v, scales_v) = (quantize_cache_entry(pages, fmt) for pages in (pages_k, pages_v))
    positions = jnp.array([[9], [5]], jnp.int32)
    cache = PagedLayer(k=values_k, v=values_v, table=table, kernel=kernel, k_scale=scales_k, v_scale=scales_v)
    out, layer = jax.jit(paged_attention)(q, k, v, positions, cache)
    assert layer.k.dtype == jnp.dtype(fmt) and layer.k_scale.shape == (POOL, PAGE, K)
    keys_f, values_f = (pages.astype(jnp.float32) * scales[..., None]
                        for pages, scales in ((layer.k, layer.k_scale), (layer.v, layer.v_scale)))
    step = 0.005 if fmt == "int8" else 0.07  # half a step of the format at the head's largest value, relative
    np.testing.assert_allclose(keys_f[1, 1], k[0, 0], atol=step * float(jnp.max(jnp.abs(k[0, 0]))))
    assert set(_written_slots(values_k, layer.k)) <= {(1, 1), (2, 1)}  # nothing else written
    for row, position in enumerate((9, 5)):
        keys, values = _dense(q, keys_f, table, row, position + 1), _dense(q, values_f, table, row, position + 1)
        expected = jax.nn.dot_product_attention(q[row:row + 1], keys, values)
        np.testing.assert_allclose(out[row:row + 1], expected, rtol=1e-4, atol=1e-4)


def test_the_gather_path_copies_an_8_bit_cache_in_8_bits():
    """Decode over int8 pages by the gather kernel: the pages' gathers yield int8 rows [B, M, page, K, E] (the
    scales applied to scores and probabilities, `ops.attention_over_8_bit_cache`), never dequantized float rows
    (the test above checks the output against the dequantized pages)."""
    q, k, v, table, pages_k, pages_v = _inputs(3)
    (values_k, scales_k), (values_v, scales_v) = (quantize_cache_entry(pages, "int8") for pages in (pages_k, pages_v))
    cache = PagedLayer(k=values_k, v=values_v, table=table, kernel="gather", k_scale=scales_k,
                       v_scale=scales_v)
    positions = jnp.array([[9], [5]], jnp.int32)
    text = str(jax.make_jaxpr(paged_attention)(q, k, v, positions, cache))
    assert f"i8[2,4,{PAGE},{K},{E}]" in text and f"f32[2,4,{PAGE},{K},{E}]" not in text


def test_the_gather_path_decodes_8_bit_pages_on_the_decode_kernel_where_chosen(monkeypatch):
    """Where `eight_bit_decode`'s kernel is chosen (CUDA; here interpreted), the gathered 8-bit rows are attended
    by it inside the paged op's shard map, as the XLA form attends them."""
    from starscream_jax.model import ops

    q, k, v, table, pages_k, pages_v = _inputs(4)
    (values_k, scales_k), (values_v, scales_v) = (quantize_cache_entry(pages, "int8") for pages in (pages_k, pages_v))
    cache = PagedLayer(k=values_k, v=values_v, table=table, kernel="gather", k_scale=scales_k,
                       v_scale=scales_v)
    positions = jnp.array([[9], [5]], jnp.int32)
    expected, _ = jax.jit(lambda *args: paged_attention(*args))(q, k, v, positions, cache)  # fresh: no cached trace
    monkeypatch.setattr(ops, "_eight_bit_decode_implementation", lambda *shape, device=None: "interpret")
    assert "pallas_call" in str(jax.make_jaxpr(lambda *args: paged_attention(*args))(q, k, v, positions, cache))
    got, _ = jax.jit(lambda *args: paged_attention(*args))(q, k, v, positions, cache)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-2, atol=1e-2)


def _eight_bit_pool(fmt: str, seed: int, pages: int, page: int, kv_heads: int, head_dim: int):
    """(values, scales) of a pool of random 8-bit key (or value) pages [pages, page, K, E] whose ranges vary."""
    spread = jnp.linspace(0.5, 3.0, pages)[:, None, None, None]
    return quantize_cache_entry(jax.random.normal(jax.random.key(seed), (pages, page, kv_heads, head_dim)) * spread,
                                fmt)


@pytest.mark.parametrize("fmt, table_pages", [("int8", 4), ("float8_e4m3fn", 6), ("float8_e4m3fn", 32)])
def test_decode_reads_8_bit_pages_in_place_where_the_kernel_is_chosen(monkeypatch, fmt, table_pages):
    """Where `eight_bit_decode.paged_decode_attention` is chosen (CUDA; here interpreted), decode reads each row's
    8-bit pages where they lie (no gathered rows in the program) and attends as the gather path does: rows of one
    position, a page and a half, and the whole table (6 pages: a loop step's four pages padded past the table; 32
    pages: the positions split into stretches)."""
    from starscream_jax.model import paged

    page, kv_heads, head_dim, pool = 16, 2, 32, 3 * table_pages + 4
    (values_k, scales_k), (values_v, scales_v) = (_eight_bit_pool(fmt, seed, pool, page, kv_heads, head_dim)
                                                  for seed in (5, 6))
    table = jax.random.permutation(jax.random.key(7), pool)[:3 * table_pages].reshape(3, table_pages)
    table = table.astype(jnp.int32)
    q = jax.random.normal(jax.random.key(8), (3, 1, 4 * kv_heads, head_dim)).astype(jnp.bfloat16)
    k, v = (jax.random.normal(jax.random.key(seed), (3, 1, kv_heads, head_dim)).astype(jnp.bfloat16)
            for seed in (9, 10))
    positions = jnp.array([[0], [page + page // 2], [table_pages * page - 1]], jnp.int32)
    cache = paged.PagedLayer(k=values_k, v=values_v, table=table, kernel="cudnn", k_scale=scales_k,
                             v_scale=scales_v)
    expected, gathered_layer = jax.jit(lambda *args: paged_attention(*args))(q, k, v, positions, cache)
    monkeypatch.setattr(paged, "_eight_bit_in_place", lambda *args: "interpret")
    text = str(jax.make_jaxpr(lambda *args: paged_attention(*args))(q, k, v, positions, cache))
    assert "pallas_call" in text and f"[3,{table_pages},{page},{kv_heads},{head_dim}]" not in text
    got, layer = jax.jit(lambda *args: paged_attention(*args))(q, k, v, positions, cache)
    np.testing.assert_array_equal(np.asarray(layer.k), np.asarray(gathered_layer.k))  # the same pages written
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(expected, np.float32), rtol=2e-2, atol=2e-2)


def test_the_8_bit_in_place_kernel_is_chosen_only_where_it_applies():
    """Only decode over 8-bit pages under the in-place paged kernel ("gather" always gathers), without attention
    options, each local query head's kv head on the device, pages of at least 16 positions, and the backend's policy
    asking for the kernel (CUDA, not this CPU)."""
    from starscream_jax.hardware.backend import CUDA
    from starscream_jax.model import paged

    pools = [jnp.zeros((4, 16, 2, 32), jnp.int8)] * 2 + [jnp.zeros((4, 16, 2), jnp.float32)] * 2
    q = jnp.zeros((1, 1, 8, 32), jnp.bfloat16)
    device = jax.devices()[0]
    assert paged._eight_bit_in_place("cudnn", q, pools, 4, None, device) == ""  # the CPU's policy gathers
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(paged, "policy_of", lambda _: CUDA)
        assert paged._eight_bit_in_place("cudnn", q, pools, 4, None, device) == "pallas"
        assert paged._eight_bit_in_place("gather", q, pools, 4, None, device) == ""
        assert paged._eight_bit_in_place("cudnn", q, pools[:2], 4, None, device) == ""  # 16-bit pages: no scales
        assert paged._eight_bit_in_place("cudnn", jnp.zeros((1, 2, 8, 32)), pools, 4, None, device) == ""  # a chunk
        assert paged._eight_bit_in_place("cudnn", q, pools, 4, AttentionOptions(scale=0.1), device) == ""
        split = jnp.zeros((1, 1, 4, 32))  # query heads split finer than kv heads
        assert paged._eight_bit_in_place("cudnn", split, pools, 4, None, device) == ""
        small = [jnp.zeros((4, 8, 2, 32), jnp.int8)] * 2 + [jnp.zeros((4, 8, 2), jnp.float32)] * 2
        assert paged._eight_bit_in_place("cudnn", q, small, 4, None, device) == ""  # pages of 8 positions


def _mixed_case(seed: int, dtype):
    """Two shards' streams of one decode row (positions 9 and 5) and one chunk of 3 positions (4-6 and 0-2) each,
    and the two groups apart: (split, stream q / k / v / positions, tables [4, 4] in the stream's row order,
    decode rows' (q, k, v, positions, table), chunks' likewise)."""
    split = RowSplit(decode=1, prefill=1, width=3)
    keys = jax.random.split(jax.random.key(seed), 3)
    q, k, v = (jax.random.normal(key, (2, split.tokens, heads, E), dtype) for key, heads in zip(keys, (H, K, K)))
    positions = jnp.array([[9, 4, 5, 6], [5, 0, 1, 2]], jnp.int32)
    decode_table, chunk_table = jnp.array([[3, 7, 1, 0], [5, 2, 0, 0]]), jnp.array([[4, 6, 0, 0], [8, 9, 0, 0]])
    table = jnp.stack([decode_table[0], chunk_table[0], decode_table[1], chunk_table[1]]).astype(jnp.int32)
    decode = (*(split.groups(x)[0] for x in (q, k, v, positions)), decode_table.astype(jnp.int32))
    chunks = (*(split.groups(x)[1] for x in (q, k, v, positions)), chunk_table.astype(jnp.int32))
    return split, (q, k, v, positions), table, decode, chunks


@pytest.mark.parametrize("kernel, dtype, fmt, tolerance", [
    ("gather", jnp.float32, None, 2e-5), ("gather", jnp.float32, "int8", 1e-4),
    pytest.param("cudnn", jnp.bfloat16, None, 2e-2, marks=pytest.mark.gpu)])
def test_a_mixed_stream_equals_its_decode_rows_and_chunks_attended_apart(kernel, dtype, fmt, tolerance):
    """Each shard's stream (its decode row's token, then its chunk's 3) written and attended in one call gives the
    outputs and pools of the decode rows' step followed by the chunks' step, in 16-bit and in int8 pages."""
    split, stream, table, decode, chunks = _mixed_case(6, dtype)
    _, _, _, _, pages_k, pages_v = _inputs(6, dtype)
    pools = dict(k=pages_k, v=pages_v)
    if fmt:
        (pools["k"], pools["k_scale"]), (pools["v"], pools["v_scale"]) = (quantize_cache_entry(pages, fmt)
                                                                          for pages in (pages_k, pages_v))
    out, mixed = jax.jit(paged_attention)(*stream, PagedLayer(table=table, kernel=kernel, split=split, **pools))
    apart = PagedLayer(table=decode[4], kernel=kernel, **pools)
    decode_out, apart = jax.jit(paged_attention)(*decode[:4], apart)
    chunk_out, apart = jax.jit(paged_attention)(*chunks[:4], PagedLayer(
        k=apart.k, v=apart.v, table=chunks[4], kernel=kernel, k_scale=apart.k_scale, v_scale=apart.v_scale))
    np.testing.assert_array_equal(np.asarray(mixed.k, np.float32), np.asarray(apart.k, np.float32))
    np.testing.assert_array_equal(np.asarray(mixed.v, np.float32), np.asarray(apart.v, np.float32))
    if fmt:
        np.testing.assert_array_equal(mixed.k_scale, apart.k_scale)
    assert len(_written_slots(pools["k"], mixed.k)) == 2 + 6  # one position a decode row, three a chunk
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(split.stream(decode_out, chunk_out), np.float32),
                               rtol=tolerance, atol=tolerance)


def test_a_row_split_takes_streams_and_rows_apart_and_back():
    """`RowSplit`'s groups / stream and rows / joined are inverses over two shards; each row's last token sits at
    its decode row's index or at its chunk's start plus the chunk's last index; a group of none is refused."""
    split = RowSplit(decode=2, prefill=2, width=3)
    stream = jnp.arange(2 * split.tokens).reshape(2, split.tokens)
    decode, chunks = split.groups(stream)
    assert decode.shape == (4, 1) and chunks.shape == (4, 3)
    assert chunks[2].tolist() == [10, 11, 12]  # the second shard's first chunk, after its two decode rows
    np.testing.assert_array_equal(split.stream(decode, chunks), stream)
    rows = jnp.arange(8)
    np.testing.assert_array_equal(split.joined(*split.rows(rows)), rows)
    assert split.rows(rows)[0].tolist() == [0, 1, 4, 5]
    assert split.last_tokens(jnp.array([2, 0, 1, 2])).tolist() == [[0, 1, 4, 5], [0, 1, 3, 7]]
    with pytest.raises(StarscreamError, match="each needs at least 1"):
        RowSplit(decode=0, prefill=1, width=3)
