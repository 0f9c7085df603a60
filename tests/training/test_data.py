"""Corpus split, unigram entropy and deterministic sharded batches."""
import math

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from starscream_jax.errors import StarscreamError
from starscream_jax.text import byte_level
from starscream_jax.training import data


def test_corpus_loads_as_bytes_and_holds_out_the_last_tenth():
    tokens = data.load_corpus()
    assert tokens.dtype == np.uint8 and len(tokens) == 1_115_394
    assert byte_level.decode(tokens[:9]) == "First Cit"
    train, validation = data.split_corpus(tokens)
    assert len(train) == int(len(tokens) * 0.9)
    assert np.array_equal(np.concatenate([train, validation]), tokens)


def test_missing_corpus_names_the_path(tmp_path):
    with pytest.raises(StarscreamError, match="nowhere.txt"):
        data.load_corpus(tmp_path / "nowhere.txt")


def test_a_data_file_that_cannot_be_read_is_named_with_the_reason(tmp_path):
    """/proc/self/mem is a regular file whose first read fails (EIO), even for root, whom permissions do not stop."""
    readable = tmp_path / "notes.txt"
    readable.write_text("text")
    data.require_readable([str(readable), str(tmp_path / "missing.txt")])  # a missing one is the reader's to name
    with pytest.raises(StarscreamError, match=r"^training data /proc/self/mem cannot be read \(Input/output error\); "
                                              "make it readable"):
        data.require_readable([str(readable), "/proc/self/mem"])


def test_unigram_entropy_of_known_distributions():
    assert data.unigram_entropy_nats(np.array([7] * 10, dtype=np.uint8)) == 0.0
    uniform = np.arange(256, dtype=np.uint8).repeat(3)
    assert math.isclose(data.unigram_entropy_nats(uniform), math.log(256))
    assert math.isclose(data.nats_to_bits(math.log(256)), 8.0)


def test_batches_are_a_pure_function_of_seed_and_step():
    tokens = np.arange(1000, dtype=np.uint16) % 256
    batches = data.TokenBatches(tokens=tokens.astype(np.uint8), batch_size=4, seq_len=16, seed=3)
    twin = data.TokenBatches(tokens=tokens.astype(np.uint8), batch_size=4, seq_len=16, seed=3)
    assert np.array_equal(batches.block(5), twin.block(5))
    assert not np.array_equal(batches.block(5), batches.block(6))
    other_seed = data.TokenBatches(tokens=tokens.astype(np.uint8), batch_size=4, seq_len=16, seed=4)
    assert not np.array_equal(batches.block(5), other_seed.block(5))


def test_rows_are_contiguous_windows_of_the_corpus():
    tokens = (np.arange(5000) % 251).astype(np.uint8)
    batches = data.TokenBatches(tokens=tokens, batch_size=8, seq_len=32, seed=0)
    block = batches.block(2)
    assert block.shape == (8, 32) and block.dtype == np.int32
    for row, start in zip(block, batches.start_offsets(2)):
        assert np.array_equal(row, tokens[start:start + 32])


def test_block_slices_match_the_full_batch():
    tokens = (np.arange(3000) % 256).astype(np.uint8)
    batches = data.TokenBatches(tokens=tokens, batch_size=8, seq_len=16, seed=1)
    full = batches.block(9)
    assert np.array_equal(batches.block(9, (slice(2, 6), slice(4, 12))), full[2:6, 4:12])


def test_global_batch_is_placed_with_the_requested_sharding():
    mesh = jax.make_mesh((2, 4), ("gpu", "xcd"), devices=jax.devices()[:8])
    sharding = NamedSharding(mesh, P("xcd", "gpu"))
    tokens = data.load_corpus()[:20_000]
    batches = data.TokenBatches(tokens=tokens, batch_size=8, seq_len=32, seed=0)
    batch = batches.global_batch(4, sharding)
    assert batch.shape == (8, 32) and batch.sharding == sharding
    assert batch.addressable_shards[0].data.shape == (2, 16)
    assert np.array_equal(np.asarray(batch), batches.block(4))


def test_window_longer_than_the_corpus_is_refused():
    with pytest.raises(StarscreamError, match="--seq-len"):
        data.TokenBatches(tokens=np.zeros(10, dtype=np.uint8), batch_size=2, seq_len=10, seed=0)
