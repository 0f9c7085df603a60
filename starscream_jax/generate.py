"""`starscream generate`: text from a training checkpoint, prefilled under one layout and decoded under another.

Prefill (the prompt, compute-bound) runs under the prefill layout (default `starscream_tp`); every following token
is decoded under the decode layout (default `starscream_decode`, 2-D weight-stationary), with the KV cache placed as
that layout says (kv heads over `gpu`, batch over `xcd`). Parameters and the cache move between the two placements
once, after prefill. Sampling is greedy or top-p (nucleus); the random draw of position t is a pure function of
(seed, t), so a sharded run and an unsharded one pick the same tokens. Tokens are bytes (see starscream_jax.data).

This module imports jax only inside functions: the command line sets up simulated devices before jax starts.
"""
from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass

from starscream_jax.distributed import add_distributed_arguments, initialize_from_args
from starscream_jax.errors import StarscreamError
from starscream_jax.mesh import add_mesh_arguments
from starscream_jax.train import DEFAULT_GPUS, DEFAULT_PRESET

DEFAULT_PREFILL_LAYOUT = "starscream_tp"
DEFAULT_DECODE_LAYOUT = "starscream_decode"


@dataclass(frozen=True)
class Sampling:
    """Greedy when `top_p` is None; otherwise nucleus sampling at `temperature` from the smallest set of tokens whose
    probability reaches `top_p`, with the draw for position t keyed by (seed, t)."""

    top_p: float | None = None
    temperature: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise StarscreamError(f"top-p {self.top_p} is outside (0, 1]; pass a value such as 0.9, or --greedy")
        if self.temperature <= 0.0:
            raise StarscreamError(f"temperature {self.temperature} must be positive; use --greedy for argmax")


@dataclass
class Generation:
    """Generated token ids [batch, new_tokens] (numpy int32) and the measured throughput of each phase."""

    tokens: object
    prefill_tokens_per_s: float
    decode_tokens_per_s: float


def choose_token(logits_BxV, position, sampling: Sampling):
    """The next token of each row [B] int32 from the last position's logits [B, V] (float32)."""
    import jax
    import jax.numpy as jnp

    from starscream_jax.sharding import constrain

    logits_BxV = constrain(logits_BxV, ("batch", None), "next-token logits")
    if sampling.top_p is None:
        return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    scaled = logits_BxV / sampling.temperature
    probabilities = jax.nn.softmax(scaled, axis=-1)
    descending = jnp.sort(probabilities, axis=-1)[:, ::-1]
    mass_before = jnp.cumsum(descending, axis=-1) - descending
    smallest_kept = jnp.min(jnp.where(mass_before < sampling.top_p, descending, 1.0), axis=-1, keepdims=True)
    nucleus_logits = jnp.where(probabilities >= smallest_kept, scaled, -jnp.inf)
    key = jax.random.fold_in(jax.random.key(sampling.seed), position)
    return jax.random.categorical(key, nucleus_logits, axis=-1).astype(jnp.int32)


def place_params(params, layout, mesh):
    """`params` (an nnx.State of parameters) moved to `layout`'s params placement on `mesh` (no copy when there)."""
    import jax

    from starscream_jax.sharding import param_shardings

    return jax.device_put(params, param_shardings(params, layout, mesh))


def cache_shardings(config, batch: int, length: int, layout, mesh) -> dict:
    """{"k", "v"}: where `layout` keeps a KV cache of [L, batch, length, K, E] on `mesh`."""
    import jax
    from jax.sharding import NamedSharding

    from starscream_jax.model import init_cache
    from starscream_jax.sharding import use_layout

    with use_layout(layout, mesh):
        abstract_cache = jax.eval_shape(lambda: init_cache(config, batch, length))
    return {name: NamedSharding(mesh, array.sharding.spec) for name, array in abstract_cache.items()}


def token_sharding(layout, mesh, batch: int):
    """Where `layout` keeps one token per row, [batch] int32: like the rows of a token batch."""
    from jax.sharding import NamedSharding, PartitionSpec

    from starscream_jax.model import batch_sharding

    return NamedSharding(mesh, PartitionSpec(batch_sharding(layout, mesh, batch).spec[0]))


def make_phases(graphdef, config, sampling: Sampling, cache_length: int):
    """(prefill, decode), plain functions of (params, rest, ...) for jax.jit.

    prefill(params, rest, prompt_BxP) -> (first new token [B], cache); decode(params, rest, cache, token_B, position)
    -> (next token [B], cache), where `position` is the token's index in the sequence.
    """
    from flax import nnx

    from starscream_jax.model import init_cache

    def prefill(params, rest, prompt_BxP):
        model = nnx.merge(graphdef, params, rest)
        cache = init_cache(config, prompt_BxP.shape[0], cache_length)
        logits_BxPxV, cache = model(prompt_BxP, cache=cache, cache_index=0)
        return choose_token(logits_BxPxV[:, -1], prompt_BxP.shape[1], sampling), cache

    def decode(params, rest, cache, token_B, position):
        model = nnx.merge(graphdef, params, rest)
        logits_Bx1xV, cache = model(token_B[:, None], cache=cache, cache_index=position)
        return choose_token(logits_Bx1xV[:, 0], position + 1, sampling), cache

    return prefill, decode


def generate(model, prompt_BxP, max_new_tokens: int, sampling: Sampling = Sampling(), mesh=None,
             prefill_layout=DEFAULT_PREFILL_LAYOUT, decode_layout=DEFAULT_DECODE_LAYOUT) -> Generation:
    """Continue each row of `prompt_BxP` (int tokens, numpy or jax) by `max_new_tokens` tokens.

    With `mesh`, prefill runs under `prefill_layout` and decoding under `decode_layout`, parameters and KV cache
    placed by each in turn; without, everything runs unsharded on one device. B must be divisible by the mesh axes
    that the layouts split the batch over.
    """
    import contextlib

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    from starscream_jax.model import batch_sharding
    from starscream_jax.sharding import use_layout

    config = model.config
    batch, prompt_length = np.shape(prompt_BxP)
    cache_length = prompt_length + max_new_tokens
    if prompt_length < 1 or max_new_tokens < 1:
        raise StarscreamError(f"prompt of {prompt_length} tokens and {max_new_tokens} new tokens; both must be at "
                              "least 1")
    if cache_length > config.max_seq_len:
        raise StarscreamError(f"prompt {prompt_length} + {max_new_tokens} new tokens exceed model {config.name}'s "
                              f"max_seq_len {config.max_seq_len}; generate fewer tokens or shorten the prompt")
    if mesh is not None:
        _check_cache_layouts(prefill_layout, decode_layout)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    prefill, decode = make_phases(graphdef, config, sampling, cache_length)
    prompt = jnp.asarray(prompt_BxP, jnp.int32)

    def phase(layout):
        return use_layout(layout, mesh) if mesh is not None else contextlib.nullcontext()

    with phase(prefill_layout):
        if mesh is not None:
            params = place_params(params, prefill_layout, mesh)
            prompt = jax.device_put(prompt, batch_sharding(prefill_layout, mesh, batch))
        compiled_prefill = jax.jit(prefill).lower(params, rest, prompt).compile()
        started = time.perf_counter()
        token_B, cache = compiled_prefill(params, rest, prompt)
        token_B.block_until_ready()
        prefill_seconds = time.perf_counter() - started

    with phase(decode_layout):
        if mesh is not None:
            params = place_params(params, decode_layout, mesh)
            cache = jax.device_put(cache, cache_shardings(config, batch, cache_length, decode_layout, mesh))
            token_B = jax.device_put(token_B, token_sharding(decode_layout, mesh, batch))
        new_tokens = [token_B]
        compiled_decode = jax.jit(decode, donate_argnums=(2,)).lower(params, rest, cache, token_B,
                                                                     jnp.int32(prompt_length)).compile()
        started = time.perf_counter()
        for position in range(prompt_length, cache_length - 1):
            token_B, cache = compiled_decode(params, rest, cache, token_B, jnp.int32(position))
            new_tokens.append(token_B)
        tokens_BxN = jnp.stack(new_tokens, axis=1)
        if mesh is not None:  # replicated, so that every process can read all rows
            tokens_BxN = jax.device_put(tokens_BxN, NamedSharding(mesh, PartitionSpec()))
        tokens = np.asarray(jax.device_get(tokens_BxN))
        decode_seconds = time.perf_counter() - started

    decoded_count = batch * (max_new_tokens - 1)
    return Generation(tokens=tokens, prefill_tokens_per_s=batch * prompt_length / prefill_seconds,
                      decode_tokens_per_s=decoded_count / decode_seconds if decoded_count else math.nan)


def _check_cache_layouts(*layouts) -> None:
    """Generation keeps a KV cache, which a layout that splits the sequence (context parallelism) cannot hold."""
    from starscream_jax.layouts import get_layout

    for layout in map(get_layout, layouts):
        if layout.splits_sequence:
            raise StarscreamError(f"layout {layout.name} splits the sequence over the partitions (context parallelism) "
                                  f"and cannot hold the KV cache generation needs; prefill with "
                                  f"{DEFAULT_PREFILL_LAYOUT} and decode with {DEFAULT_DECODE_LAYOUT}")


def batch_multiple(layouts, mesh) -> int:
    """The smallest batch every layout can split: the lcm of the mesh sizes of their batch axes."""
    from starscream_jax.layouts import get_layout

    multiple = 1
    for layout in layouts:
        for name in ("batch", "attn_batch"):
            _, axes = get_layout(layout).activations.lookup(name)
            multiple = math.lcm(multiple, math.prod(mesh.shape[axis] for axis in axes))
    return multiple


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `starscream generate` (mesh, multi-process, checkpoint, layouts, sampling)."""
    add_mesh_arguments(parser, default_preset=DEFAULT_PRESET, default_gpus=DEFAULT_GPUS, default_simulate=None)
    add_distributed_arguments(parser)
    group = parser.add_argument_group("generation")
    group.add_argument("--checkpoint", default="runs/train/checkpoints",
                       help="checkpoint directory of a training run (RUN_DIR/checkpoints)")
    group.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    group.add_argument("--prompt", default="ROMEO:\n", help="text to continue")
    group.add_argument("--max-new-tokens", type=int, default=200, help="tokens (bytes) to generate per sample")
    group.add_argument("--samples", type=int,
                       help="continuations of the prompt, decoded as one batch (default: the smallest batch the "
                            "layouts can split)")
    group.add_argument("--greedy", action="store_true", help="argmax decoding instead of top-p sampling")
    group.add_argument("--top-p", type=float, default=0.9, help="nucleus probability mass")
    group.add_argument("--temperature", type=float, default=0.8, help="softmax temperature for sampling")
    group.add_argument("--seed", type=int, default=0, help="sampling seed")
    group.add_argument("--prefill-layout", default=DEFAULT_PREFILL_LAYOUT, help="layout for the prompt")
    group.add_argument("--decode-layout", default=DEFAULT_DECODE_LAYOUT, help="layout for each new token")
    group.add_argument("--dtype", choices=("float32", "bfloat16"), help="compute dtype (default: the training one)")


def run(args: argparse.Namespace) -> int:
    """`starscream generate`: restore the checkpoint, generate, print each sample and the tokens/s. Returns 0."""
    initialize_from_args(args)
    import numpy as np

    from starscream_jax import data
    from starscream_jax.checkpoint import restore_model
    from starscream_jax.distributed import is_main_process
    from starscream_jax.mesh import mesh_from_args

    echo = print if is_main_process() else (lambda *_: None)
    _, mesh = mesh_from_args(args)
    model, description = restore_model(args.checkpoint, args.prefill_layout, mesh, args.step, args.dtype)
    samples = args.samples or batch_multiple((args.prefill_layout, args.decode_layout), mesh)
    prompt = np.tile(data.encode(args.prompt), (samples, 1))
    sampling = Sampling(top_p=None if args.greedy else args.top_p, temperature=args.temperature, seed=args.seed)
    result = generate(model, prompt, args.max_new_tokens, sampling, mesh, args.prefill_layout, args.decode_layout)
    echo(f"{model.config.name} from step {description['step']} on mesh {dict(mesh.shape)}; prefill "
         f"{args.prefill_layout}, decode {args.decode_layout}")
    shown_rows = result.tokens[:1] if args.greedy else result.tokens  # greedy rows are all the same
    for index, row in enumerate(shown_rows):
        echo(f"--- sample {index}")
        echo(args.prompt + data.decode(row))
    echo(f"prefill {result.prefill_tokens_per_s:,.0f} tokens/s, decode {result.decode_tokens_per_s:,.0f} tokens/s "
         f"({samples} x {args.max_new_tokens} new tokens)")
    return 0
