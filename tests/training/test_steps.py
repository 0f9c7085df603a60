"""The steps' definitions: the load-balancing loss a mixture of experts reports is the term its training loss adds."""
import jax
import numpy as np
import pytest
from flax import nnx

from starscream_jax.model.config import load_model_config
from starscream_jax.model.decoder import Transformer, next_token_loss
from starscream_jax.training.steps import load_balance_step


def test_the_reported_load_balancing_loss_is_what_the_training_loss_adds():
    tokens = np.random.default_rng(0).integers(0, 256, (4, 9), dtype=np.int32)
    weighted = load_model_config("tiny-moe", n_layers=1, load_balance_weight=0.5)
    graphdef, params, rest = nnx.split(Transformer(weighted, rngs=nnx.Rngs(0)), nnx.Param, ...)
    plain_graphdef = nnx.graphdef(Transformer(weighted.replace(load_balance_weight=0.0), rngs=nnx.Rngs(0)))

    @jax.jit
    def reported_and_added(params, rest, tokens):
        losses = [next_token_loss(nnx.merge(g, params, rest), tokens) for g in (graphdef, plain_graphdef)]
        return load_balance_step(graphdef)(params, rest, tokens), losses[0] - losses[1]

    balance, added = map(float, reported_and_added(params, rest, tokens))
    assert 0.5 < balance < weighted.n_experts  # 1 when the experts share the tokens evenly
    assert added == pytest.approx(0.5 * balance, rel=1e-4)
