"""scripts/torch_peers.py's decode peer (where torch is installed): the fused decoder with its static cache gives the
plain Llama's logits position by position, and the benchmark's rows carry what bench_decode stores."""

import pytest

torch = pytest.importorskip("torch")

from starscream_jax.model.catalog import load_model_config  # noqa: E402



@pytest.fixture(scope="module")
def peers(script):
    return script("torch_peers")


@pytest.mark.parametrize("tied", [False, True])
def test_the_fused_decoder_gives_the_plain_llamas_logits_position_by_position(peers, tied):
    """The training peer's weights fused (q | k | v, gate | up) into the decoder, whose random cache is written one
    position at a time: each position's logits equal the plain model's causal forward pass over the prefix, so the
    in-place writes, the mask and the grouping of query heads by kv head are right."""
    config = load_model_config("tiny").replace(n_layers=2, dtype="float32", tie_embeddings=tied)
    torch.manual_seed(0)
    llama = peers.Llama(config).eval()
    decoder = peers.Decoder(config, batch=2, cache_length=8).eval()
    peers.fuse_from(decoder, llama)
    tokens = torch.randint(config.vocab_size, (2, 6))
    with torch.no_grad():
        expected = llama(tokens)
        for position in range(6):
            got = decoder.logits(tokens[:, position:position + 1], torch.tensor([position]))
            torch.testing.assert_close(got, expected[:, position], atol=1e-5, rtol=1e-5)
        assert peers.decode_step(decoder, tokens[:, :1], torch.tensor([0])).shape == (2, 1)


def test_a_position_past_the_written_ones_is_not_read(peers):
    """Attention sees the cached positions up to the decoded one only: changing the cache beyond it changes
    nothing."""
    config = load_model_config("tiny").replace(n_layers=1, dtype="float32")
    torch.manual_seed(1)
    decoder = peers.Decoder(config, batch=1, cache_length=8).eval()
    token, position = torch.tensor([[3]]), torch.tensor([4])
    with torch.no_grad():
        before = decoder.logits(token, position)
        decoder.layers[0].k_cache[:, :, 5:] += 100.0
        torch.testing.assert_close(decoder.logits(token, position), before)


def test_the_decode_benchmark_rows_carry_what_bench_decode_stores(peers):
    """Eager on the CPU (no compile, no CUDA graph, no profile): a row per batch, the bytes of every weight once and
    the whole cache, and no recompile at a new position."""
    config = load_model_config("tiny").replace(n_layers=2)
    rows = peers.decode_benchmark(config, [1, 3], 16, warmup=4, steps=2, device="cpu", compile_mode=None)
    assert [row["batch"] for row in rows] == [1, 3]
    for row in rows:
        assert row["name"] == peers.DECODE_NAME and row["step_s"] > 0 and row["recompiles_at_new_position"] == 0
        assert row["bytes_per_step"]["kv_cache"] == 2 * 2 * row["batch"] * 16 * config.n_kv_heads * config.head_dim * 2
        assert row["tokens_per_s"] == pytest.approx(row["batch"] / row["step_s"])
    assert "graphs not captured" in peers.graph_line(rows[0])


def test_the_profile_line_says_what_it_saw_or_why_not(peers):
    row = {"name": peers.DECODE_NAME, "batch": 1}
    assert "per step 1.0 CUDA graph launches, 0.0 kernel launches" in peers.launches_line(
        {**row, "graph_launches_per_step": 1.0, "kernel_launches_per_step": 0.0})
    assert "the profile failed (RuntimeError: no CUPTI)" in peers.launches_line(
        {**row, "profile_error": "RuntimeError: no CUPTI"})
