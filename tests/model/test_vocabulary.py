"""A vocabulary padded with zero rows (`model.vocabulary`): the rows a layout's parts divide, the tokens' logits and
loss unchanged, the padded ids' logits the float minimum."""
import re

import jax
import numpy as np
import pytest
from flax import nnx

from starscream_jax.errors import CheckpointError, PresetError, ShardingRuleError, StarscreamError
from starscream_jax.hardware.mesh import build_mesh
from starscream_jax.model.catalog import load_model_config
from starscream_jax.model.decoder import Transformer, next_token_loss
from starscream_jax.model.hf_checkpoint import export_hf_model
from starscream_jax.model.vocabulary import pad_vocabulary, padded_vocabulary, vocabulary_parts
from starscream_jax.sharding.apply import batch_sharding, use_layout
from starscream_jax.sharding.at_use import param_shardings

ODD = load_model_config("tiny").replace(n_layers=1, dtype="float32", vocab_size=390)
"""390 tokens: 2 GPUs split them, 4 or 8 parts do not."""


def test_the_rows_are_the_smallest_multiple_of_every_layouts_parts():
    """32,001 tokens (a token added to Llama 2's) on 2 GPUs x 4 partitions: starscream_tp splits the vocabulary
    over the GPUs (2), starscream_decode over every partition (8): 32,008 rows; a vocabulary they divide keeps
    its own."""
    mesh = build_mesh("2x4")
    assert (vocabulary_parts("starscream_tp", mesh), vocabulary_parts("starscream_decode", mesh)) == (2, 8)
    assert padded_vocabulary(32001, ["starscream_tp", "starscream_decode"], mesh) == 32008
    assert padded_vocabulary(32000, ["starscream_tp", "starscream_decode"], mesh) == 32000
    assert padded_vocabulary(32001, ["starscream_fsdp"], mesh) == 32001


@pytest.mark.parametrize("tied, layout, mesh", [(False, "flat_tp", "2x4"), (True, "starscream_tp", "4x2")])
def test_a_padded_vocabulary_places_where_the_tokens_did_not_split_and_keeps_their_logits(tied, layout, mesh):
    model = Transformer(ODD.replace(tie_embeddings=tied), rngs=nnx.Rngs(0))
    tokens = np.random.default_rng(0).integers(0, 390, (8, 17), dtype=np.int32)
    logits, loss = jax.jit(lambda m, t: (m(t[:, :-1]).logits, next_token_loss(m, t)))(model, tokens)
    mesh = build_mesh(mesh)
    with pytest.raises(ShardingRuleError, match="dimension 'vocab' of size 390 is not divisible"):
        param_shardings(nnx.state(model), layout, mesh)
    padded = pad_vocabulary(model, padded_vocabulary(390, [layout], mesh))
    assert (padded.config.vocab_size, padded.config.vocab_padding, padded.config.vocab_tokens) == (392, 2, 390)
    assert model.config.vocab_size == 390 and model.embedding.shape == (390, 128)
    graphdef, params = nnx.split(padded)
    with use_layout(layout, mesh):
        placed = jax.device_put(params, param_shardings(params, layout, mesh))
        tokens_placed = jax.device_put(tokens, batch_sharding(layout, mesh, 8))
        padded_logits, padded_loss = jax.jit(lambda p, t: (nnx.merge(graphdef, p)(t[:, :-1]).logits,
                                                            next_token_loss(nnx.merge(graphdef, p), t)))(
            placed, tokens_placed)
    padded_logits = np.asarray(padded_logits)
    np.testing.assert_allclose(padded_logits[..., :390], logits, atol=2e-5)
    assert np.all(padded_logits[..., 390:] == np.finfo(np.float32).min)
    np.testing.assert_allclose(padded_loss, loss, rtol=1e-6)


def test_padding_counts_rows_past_the_tokens_only_and_is_not_exported(tmp_path):
    with pytest.raises(PresetError, match=re.escape("vocab_padding 390 leaves no token of its vocab_size 390")):
        ODD.replace(vocab_padding=390)
    model = Transformer(ODD, rngs=nnx.Rngs(0))
    with pytest.raises(StarscreamError, match="cannot be padded to 389 rows"):
        pad_vocabulary(model, 389)
    with pytest.raises(CheckpointError, match=r"holds 2 padding rows past its 390 tokens \(placed for inference\)"):
        export_hf_model(pad_vocabulary(model, 392), tmp_path / "out")
