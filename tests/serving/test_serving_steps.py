"""The serving step's per-row sampler (`serving.steps.sample_rows`) on tiny logits, compiled on the CPU: no model.
(Named apart from tests/training/test_steps.py: pytest imports test modules by their file name.)"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from starscream_jax.serving.steps import RowSampling, sample_rows

B, V = 8, 32


@pytest.mark.parametrize("top_p", [1e-38, 0.0])
def test_a_nucleus_too_small_for_any_token_keeps_the_most_likely(top_p):
    """1e-38 flushes to 0 once compiled; a nucleus of the tokens whose mass before them is below it held none, and
    every row drew token 0 (a special token in most vocabularies)."""
    logits_BV = jax.random.normal(jax.random.key(0), (B, V)) * 3
    rows = RowSampling(temperature=jnp.full((B,), 0.7), top_p=jnp.full((B,), top_p, jnp.float32),
                       top_k=jnp.zeros((B,), jnp.int32), seed=jnp.arange(B, dtype=jnp.int32))
    token_B, logprob_B = jax.jit(sample_rows)(logits_BV, rows, jnp.arange(B, dtype=jnp.int32))
    np.testing.assert_array_equal(token_B, jnp.argmax(logits_BV, axis=-1))
    np.testing.assert_allclose(logprob_B, jnp.max(jax.nn.log_softmax(logits_BV, axis=-1), axis=-1), rtol=1e-6)
