"""A vocabulary padded with zero rows, so that a checkpoint's token count the layouts' parts do not divide (32,001:
a token added to Llama 2's 32,000) splits over them, the tokens' logits unchanged.

The embedding table [V, D] gains zero rows and an untied head [D, V] zero columns up to the smallest multiple of the
parts (`padded_vocabulary`); `ModelConfig.vocab_padding` counts them. No token id reaches a padded row, and the
decoder sets the padded ids' logits to the float minimum (`decoder.Transformer._logits`), so no softmax, sample,
log-probability or loss counts them; a token id a request names is checked against the tokens alone
(`ModelConfig.vocab_tokens`). The cost is at most parts - 1 rows of the table and columns of the logits.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
from flax import nnx

from ..errors import StarscreamError
from ..sharding.layouts import Layout, get_layout
from .config import ModelConfig
from .decoder import Transformer


def vocabulary_parts(layout: Layout | str, mesh) -> int:
    """How many parts `layout` splits the vocabulary (embedding rows, logits) into on `mesh`: the mesh size of the
    axes its `vocab` rules name, the largest of its tables."""
    layout = get_layout(layout)
    tables = (layout.params, layout.weights, layout.activations)
    return math.lcm(*(math.prod(mesh.shape[axis] for axis in rules.lookup("vocab")[1]) for rules in tables))


def padded_vocabulary(tokens: int, layouts, mesh) -> int:
    """The rows a vocabulary of `tokens` ids takes under `layouts` on `mesh`: the smallest multiple of every
    layout's parts (`vocabulary_parts`) that holds them."""
    parts = math.lcm(*(vocabulary_parts(layout, mesh) for layout in layouts))
    return -(-tokens // parts) * parts


def padded_config(config: ModelConfig, layouts, mesh) -> ModelConfig:
    """`config` with its vocabulary padded to the rows `layouts` split on `mesh` (`padded_vocabulary`), as
    inference loads it: the model `inspect` compiles for prefill, decode and serve."""
    rows = padded_vocabulary(config.vocab_tokens, layouts, mesh)
    return config.replace(vocab_size=rows, vocab_padding=rows - config.vocab_tokens)


def pad_vocabulary(model: Transformer, rows: int) -> Transformer:
    """A copy of `model` whose embedding table (and untied head) holds `rows` ids, the new ones zeros counted by
    `vocab_padding`; the model itself where it has that many. Arrays in any placement; the result's are computed
    from them (place it with a layout afterwards)."""
    config = model.config
    if rows < config.vocab_tokens:
        raise StarscreamError(f"a vocabulary of {config.vocab_tokens} tokens cannot be padded to {rows} rows")
    if rows == config.vocab_size:
        return model
    extra = rows - config.vocab_size
    graphdef, state = nnx.split(nnx.clone(model))  # the state's variables are the module's own: leave it whole
    state["embedding"].set_value(jnp.pad(state["embedding"].get_value(), ((0, extra), (0, 0))))
    if not config.tie_embeddings:
        state["lm_head"].set_value(jnp.pad(state["lm_head"].get_value(), ((0, 0), (0, extra))))
    padded = nnx.merge(graphdef, state)
    padded.config = config.replace(vocab_size=rows, vocab_padding=rows - config.vocab_tokens)
    return padded
