"""Generation: a model's continuation of prompts, prefilled under one layout and decoded under another.

Prefill (the prompt, compute-bound) runs under the prefill layout (default `starscream_tp`); every following token
is decoded under the decode layout (default `starscream_decode`, 2-D weight-stationary), with the KV cache placed as
that layout says (kv heads over `gpu`, batch over `xcd`). Parameters and the cache move between the two placements
once, after prefill. Sampling is greedy or top-p (nucleus); the random draw of position t is a pure function of
(seed, t), so a sharded run and an unsharded one pick the same tokens. The steps are `steps.prefill_step` and
`steps.decode_step`, the programs `starscream inspect` judges.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from ..errors import StarscreamError
from ..model.decoder import decode_holds_cache_per_layer
from ..model.dense_cache import cache_shardings, split_cache
from ..model.layer_weights import inference_split, split_layer_weights
from ..sharding.apply import Placement, batch_sharding, param_shardings, token_sharding
from ..sharding.layouts import PHASE_DEFAULTS, Layout, fit_batch, positions_multiple
from ..training.steps import Sampling, decode_step, prefill_step

STOP_CHECK_EVERY = 16


@dataclass(kw_only=True)
class Generation:
    """Generated token ids [batch, new_tokens] (numpy int32), the measured throughput of each phase and the two
    compiled programs that ran (`steps.prefill_step`, `steps.decode_step`)."""

    tokens: object
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    prefill_program: object
    decode_program: object


def place_params(params, layout, mesh):
    """`params` (an nnx.State of parameters) moved to `layout`'s params placement on `mesh` (no copy when there)."""
    return jax.device_put(params, param_shardings(params, layout, mesh))


def generate(model, prompt_BP, max_new_tokens: int, sampling: Sampling = Sampling(), mesh=None,
             prefill_layout=PHASE_DEFAULTS["prefill"], decode_layout=PHASE_DEFAULTS["decode"],
             stop_token: int | tuple[int, ...] | None = None) -> Generation:
    """Continue each row of `prompt_BP` (int tokens, numpy or jax) by `max_new_tokens` tokens.

    Parameters are held in the model's compute dtype, as inference reads them, q/k/v and gate/up each stacked into one
    weight on one device (`layer_weights.inference_split`). With `mesh`, prefill runs under
    `prefill_layout` and decoding under `decode_layout`, parameters and KV cache placed by each in turn; without,
    everything runs unsharded on one device. Any B >= 1 places (`fit_generation`): where B is smaller than the
    layouts' batch split, prefill splits each prompt over the partitions and decode attends split-K to a cache split
    by position the same way, so the cache stays where prefill wrote it. Returns the new tokens [B, N] and each
    phase's tokens/s. With `stop_token` (EOS: one id, or several, as `tokenizer.eos_ids` gives them), decoding stops
    once every row has produced one of them (checked every STOP_CHECK_EVERY tokens, so N may exceed the first EOS).
    """
    stop_ids = stop_ids_of(stop_token)
    config = model.config
    batch, prompt_length = np.shape(prompt_BP)
    end = cache_length = prompt_length + max_new_tokens
    if prompt_length < 1 or max_new_tokens < 1:
        raise StarscreamError(f"prompt of {prompt_length} tokens and {max_new_tokens} new tokens; both must be at "
                              "least 1")
    if end > config.max_seq_len:
        raise StarscreamError(f"prompt {prompt_length} + {max_new_tokens} new tokens exceed model {config.name}'s "
                              f"max_seq_len {config.max_seq_len}; generate fewer tokens or shorten the prompt")
    if mesh is not None:
        prefill_layout, decode_layout = fit_generation(prefill_layout, decode_layout, mesh, batch)
        cache_length = generation_cache_length(end, prefill_layout, decode_layout, mesh)
    graphdef, params, rest = inference_split(model, mesh, config.dtype)
    prompt = jnp.asarray(prompt_BP, jnp.int32)

    def placement(layout) -> Placement | None:
        return Placement.of(layout, mesh) if mesh is not None else None

    # the compiled steps are bound to their phase's placement; the host's own operations on placed arrays (the
    # cache's split, the stop test, the tokens' stack) need only JAX's mesh, no layout
    on_mesh = jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()
    with on_mesh:
        if mesh is not None:
            params = place_params(params, prefill_layout, mesh)
            prompt = jax.device_put(prompt, batch_sharding(prefill_layout, mesh, batch))
        compiled_prefill = prefill_step(graphdef, config, sampling, cache_length,
                                        under=placement(prefill_layout)).lower(params, rest, prompt).compile()
        started = time.perf_counter()
        token_B, cache = compiled_prefill(params, rest, prompt)
        token_B.block_until_ready()
        prefill_seconds = time.perf_counter() - started

        if mesh is not None:  # decode: the weights, the cache and the tokens moved to the decode layout's placement
            params = place_params(params, decode_layout, mesh)
            cache = jax.device_put(cache, cache_shardings(config, batch, cache_length, decode_layout, mesh))
            token_B = jax.device_put(token_B, token_sharding(decode_layout, mesh, batch))
        if decode_holds_cache_per_layer(config):  # decode runs no layer loop
            cache = jax.jit(split_cache)(cache)
            params = split_layer_weights(params)
        new_tokens = [token_B]
        compiled_decode = decode_step(graphdef, sampling, under=placement(decode_layout),
                                      eight_bit_weights=bool(config.weight_format)).lower(
            params, rest, cache, token_B, jnp.int32(prompt_length)).compile()
        started = time.perf_counter()
        stopped_B = is_stop(token_B, stop_ids) if stop_ids else None
        for position in range(prompt_length, end - 1):
            token_B, cache = compiled_decode(params, rest, cache, token_B, jnp.int32(position))
            new_tokens.append(token_B)
            if stop_ids:
                stopped_B = stopped_B | is_stop(token_B, stop_ids)
                if len(new_tokens) % STOP_CHECK_EVERY == 0 and bool(jnp.all(stopped_B)):
                    break
        tokens_BN = jnp.stack(new_tokens, axis=1)
        if mesh is not None:  # replicated, so that every process can read all rows
            tokens_BN = jax.device_put(tokens_BN, NamedSharding(mesh, PartitionSpec()))
        tokens = np.asarray(jax.device_get(tokens_BN))
        decode_seconds = time.perf_counter() - started

    decoded_count = batch * (len(new_tokens) - 1)
    return Generation(tokens=tokens, prefill_tokens_per_s=batch * prompt_length / prefill_seconds,
                      decode_tokens_per_s=decoded_count / decode_seconds if decoded_count else math.nan,
                      prefill_program=compiled_prefill, decode_program=compiled_decode)


def stop_ids_of(stop_token) -> tuple[int, ...]:
    """`generate`'s stop_token as a tuple of ids: None -> (), an id -> (id,), ids as they are (each a whole number
    of at least 0)."""
    ids = () if stop_token is None else (stop_token,) if np.ndim(stop_token) == 0 else tuple(stop_token)
    for token in ids:
        if isinstance(token, bool) or not isinstance(token, (int, np.integer)) or token < 0:
            raise StarscreamError(f"stop token {token!r}: expected a token id (a whole number of at least 0)")
    return tuple(int(token) for token in ids)


def is_stop(token_B: jax.Array, stop_ids: tuple[int, ...]) -> jax.Array:
    """Whether each row's token [B] is one of `stop_ids` (a non-empty tuple) [B] bool."""
    return jnp.any(token_B[:, None] == jnp.asarray(stop_ids, token_B.dtype)[None, :], axis=-1)


def fit_generation(prefill_layout, decode_layout, mesh, batch: int) -> tuple[Layout, Layout]:
    """The prefill and decode layouts that place `batch` sequences on `mesh` (`layouts.fit_batch`: a sequence split
    for prefill and split-K decode where the batch is smaller than the split). Both must split the cache's positions
    over the same axes: the slots of a cache split by position are in an order of its own (names.CACHE)."""
    prefill, decode = fit_batch(prefill_layout, mesh, batch, None), fit_batch(decode_layout, mesh, batch, 1)
    written, read = (layout.activations.lookup("cache_seq")[1] for layout in (prefill, decode))
    if written != read:
        raise StarscreamError(
            f"a batch of {batch}: prefill under {prefill.name} splits the KV cache's positions over "
            f"{written or 'no axis'}, decode under {decode.name} over {read or 'no axis'}; prefill with "
            f"{PHASE_DEFAULTS['prefill']} and decode with {PHASE_DEFAULTS['decode']}, or another pair that agree")
    return prefill, decode


def generation_cache_length(end: int, prefill_layout, decode_layout, mesh) -> int:
    """The KV cache's length for `end` positions: `end` rounded up to a multiple of the parts the layouts split
    the cache's positions and the prompt into (`layouts.positions_multiple`); the slots past `end` are never read."""
    multiple = math.lcm(positions_multiple(prefill_layout, mesh), positions_multiple(prefill_layout, mesh, "cache_seq"),
                        positions_multiple(decode_layout, mesh, "cache_seq"))
    return -(-end // multiple) * multiple
