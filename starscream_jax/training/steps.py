"""The one definition of each step: train, eval, prefill and decode.

`starscream train`, `generate`, `inspect`, `plan` and the benchmarks all jit these functions, so the program a command
judges or times is the program that training and generation run. Each step takes the model's parameters (`params`,
an nnx.State of nnx.Param) and the rest of its state (`rest`) apart, as `nnx.split(model, nnx.Param, ...)` gives
them. Each factory takes the placement the step runs under (`under`: a `Placement`, a layout on a mesh, or None for
no layout), binds the jitted step to it (`sharding.apply.jit`) and hands it to every function the step calls that
places an array: the step is traced on `under`'s mesh with no active layout (`ambient=False`), so one step can never
run a trace made for another layout, and none reads a layout from where it is called.

  train    (params, opt_state, rest, tokens [B, S + 1]) -> (params, opt_state, loss): value_and_grad of
           `next_token_loss`, then `make_optimizer`'s update (global-norm clipping, AdamW with the weight-decay mask).
           params and opt_state are donated and come back placed as they went in. With gradient accumulation over
           n micro-batches (rows i, i + n, i + 2n, ... form micro-batch i, so each device keeps its own rows), the
           mean of the n micro-batches' gradients (float32, placed like the parameters) is the big batch's.
  eval     (params, rest, tokens [B, S + 1]) -> loss; `load_balance_step` likewise -> a mixture of experts'
           load-balancing loss.
  prefill  (params, rest, prompt [B, P]) -> (first new token [B], cache): the prompt through the model into a fresh
           KV cache (`dense_cache.DenseCache`: [L, B, T, K, E], T = cache_length), and the token chosen from its last
           logits; padded to a multiple of the sequence split where the layout splits the sequence (`_padded_prompt`).
  decode   (params, rest, cache, token [B], position) -> (next token [B], cache): one token per sequence at
           `position` of the cache (donated; stacked, or held per layer as generation holds it when decode runs no
           layer loop, `dense_cache.split_cache`), compiled with the backend policy's decode options
           (`hardware.backend.BackendPolicy.decode_compiler_options`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import PartitionSpec, reshard

from ..checks import finite_number
from ..errors import StarscreamError
from ..hardware.axes import INSIDE_GPU, axes_of, dim_axes
from ..hardware.backend import BackendPolicy, policy_of
from ..model.config import ModelConfig
from ..model.decoder import next_token_loss
from ..model.dense_cache import init_cache
from ..sharding.apply import LOGICAL_AXES, UNPLACED, Jitted, Placement, jit, placed_by
from ..sharding.collectives import hierarchical_sum
from ..sharding.layouts import positions_multiple
from .config import TrainConfig


def decays(logical_axes: tuple[str, ...]) -> bool:
    """Whether weight decay applies to a parameter with these logical axes: to matrices, not to the 1-D parameters
    (norm scales [.., norm] and q/k/v biases [.., heads, head_dim], one vector of heads * head_dim each). A
    parameter is 1-D when, leaving out the stacked `layers` axis and counting `head_dim` with its heads, one axis is
    left."""
    return len([name for name in logical_axes if name not in ("layers", "head_dim")]) > 1


def make_optimizer(config: TrainConfig, params) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW on a warm-up + cosine schedule; the 1-D parameters (norm scales and biases,
    see `decays`) get no weight decay. `params`: the nnx.State the optimizer will update (for the mask)."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=config.learning_rate, warmup_steps=config.warmup_steps,
        decay_steps=max(config.steps, config.warmup_steps + 1),
        end_value=config.learning_rate * config.final_learning_rate_fraction,
    )
    decay_mask = jax.tree.map(lambda variable: decays(variable.get_metadata(LOGICAL_AXES)), params,
                              is_leaf=lambda node: isinstance(node, nnx.Variable))
    return optax.chain(
        optax.clip_by_global_norm(config.clip_norm),
        optax.adamw(schedule, weight_decay=config.weight_decay, mask=decay_mask),
    )


def train_step(graphdef, optimizer: optax.GradientTransformation, grad_accum: int = 1, *,
               under: Placement | None) -> Jitted:
    """The jitted training step (see the module docstring) under `under`, accumulating gradients over `grad_accum`
    micro-batches; params and opt_state are donated."""

    @jit(under=under, ambient=False, donate_argnums=(0, 1))
    def step(params, opt_state, rest, tokens_BS):
        loss, grads = accumulated_gradients(params, rest, tokens_BS, graphdef, grad_accum, under or UNPLACED)
        with jax.named_scope("optimizer"):
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

    return step


def accumulated_gradients(params, rest, tokens_BS, graphdef, micro_batches: int = 1,
                          placement: Placement | None = None):
    """(mean loss, mean gradients) over `micro_batches` equal micro-batches of tokens [B, S + 1], one at a time
    (one micro-batch: plain value_and_grad), the model traced under `placement` (None: `current()`). Gradients are
    float32 and placed like `params`.

    Micro-batch i holds rows i, i + n, ... (n = micro_batches): the rows [B] split as [B / n, n] keep each device's
    rows on it, and the scan runs over the second dimension."""
    if micro_batches == 1:
        return jax.value_and_grad(_loss)(params, rest, tokens_BS, graphdef, placement)
    rows, width = tokens_BS.shape
    if rows % micro_batches:
        raise StarscreamError(f"{micro_batches} micro-batches cannot split a batch of {rows} sequences; pass a "
                              "divisor of the batch size")
    spec = jax.typeof(tokens_BS).sharding.spec
    batch_axes = spec[0] if len(spec) else None
    tokens_MNS = jnp.reshape(tokens_BS, (rows // micro_batches, micro_batches, width),
                             out_sharding=PartitionSpec(batch_axes, None, None) if batch_axes else None)
    tokens_NMS = jnp.swapaxes(tokens_MNS, 0, 1)

    def accumulate(total, micro_tokens_MS):
        loss, grads = jax.value_and_grad(_loss)(params, rest, micro_tokens_MS, graphdef, placement)
        return jax.tree.map(jnp.add, total, (loss, grads)), None

    zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
    (loss, grads), _ = jax.lax.scan(accumulate, zeros, tokens_NMS)
    return jax.tree.map(lambda total: total / micro_batches, (loss, grads))


def eval_step(graphdef, *, under: Placement | None) -> Jitted:
    """The jitted evaluation step under `under`: (params, rest, tokens [B, S + 1]) -> mean next-token loss (nats)."""
    return jit(functools.partial(_loss, graphdef=graphdef, placement=under or UNPLACED), under=under, ambient=False)


def load_balance_step(graphdef, *, under: Placement | None) -> Jitted:
    """The jitted load-balancing loss of a mixture of experts: (params, rest, tokens [B, S + 1]) -> the mean over
    layers of the router's load-balancing loss on tokens[:, :-1] (`moe.balance_loss`: 1 when even), the term the
    training loss adds times `load_balance_weight`; 0 for a dense model. Under `under`."""

    @jit(under=under, ambient=False)
    def step(params, rest, tokens_BS):
        return nnx.merge(graphdef, params, rest)(tokens_BS[:, :-1], placement=under or UNPLACED).balance_loss

    return step


def _loss(params, rest, tokens_BS, graphdef, placement: Placement | None = None):
    return next_token_loss(nnx.merge(graphdef, params, rest), tokens_BS, placement)


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
        finite_number(self.temperature, "--temperature", positive=True)


def prefill_step(graphdef, config: ModelConfig, sampling: Sampling, cache_length: int, *,
                 under: Placement | None) -> Jitted:
    """The jitted prefill step (see the module docstring) under `under`, filling a KV cache of `cache_length`
    positions."""

    placement = under or UNPLACED

    @jit(under=under, ambient=False)
    def step(params, rest, prompt_BP):
        model = nnx.merge(graphdef, params, rest)
        cache = init_cache(config, prompt_BP.shape[0], cache_length, placement)
        out = model(_padded_prompt(prompt_BP, under), cache=cache, cache_index=0, placement=placement)
        last_BV = _last_real(out.logits, prompt_BP.shape[1], placement)
        return choose_token(last_BV, prompt_BP.shape[1], sampling, placement), out.cache

    return step


def _padded_prompt(prompt_BP: jax.Array, under: Placement | None) -> jax.Array:
    """The prompt [B, P] with zeros appended up to a multiple of the parts the placement `under` splits the
    sequence into (`layouts.positions_multiple`; P itself where none). The padding follows every real position, so
    causal attention keeps it from them; its keys land in cache slots that decode overwrites before reading them."""
    parts = 1 if under is None else positions_multiple(under.layout, under.mesh)
    return jnp.pad(prompt_BP, ((0, 0), (0, -prompt_BP.shape[1] % parts)))


def _last_real(logits_BPV: jax.Array, length: int, placement: Placement) -> jax.Array:
    """The logits [B, V] of position `length - 1`, as a sum that keeps only that position: where the layout splits
    the positions, a reduction of [B, V] values over their axes, where slicing would gather every position's (read
    from the logits' type: outside a layout, or on Auto axes, no axis splits them there). Each device sums its own
    positions and the sums are added over the partitions of each GPU first, then across GPUs (`hierarchical_sum`):
    `jnp.sum` over positions split over (gpu, xcd) (`starscream_fsdp+seq`) was one flat all-reduce."""
    spec = jax.typeof(logits_BPV).sharding.spec
    if not dim_axes(spec, 1):
        return logits_BPV[:, length - 1]
    last_P = jnp.arange(logits_BPV.shape[1]) == length - 1
    return hierarchical_sum(jnp.where(last_P[None, :, None], logits_BPV, 0.0), spec, placement.mesh, (1,))


EIGHT_BIT_DECODE_OPTIONS = {"xla_gpu_enable_triton_gemm": True}
"""XLA options of the decode step with 8-bit weights, over the backend's (where it sets them): XLA's Triton GEMM
fusions, which convert the 8-bit operand inside the GEMM's own kernel where a projection runs on XLA's path (a
weight split over the mesh, `eight_bit_matmul` "xla"), where a cuBLAS call would read a bfloat16 copy that a
separate kernel wrote."""


def decode_options(policy: BackendPolicy, eight_bit_weights: bool) -> dict:
    """The decode step's XLA options: the backend policy's, with EIGHT_BIT_DECODE_OPTIONS over those it sets where
    the weights are 8-bit. An 8-bit cache alone keeps the policy's: its bfloat16 weights stay cuBLAS calls, where
    XLA's Triton GEMMs copied each layer's o weight out of the layer stack first (an H200 trace of Llama 3 8B with
    an int8 cache: 32 copies, 0.5 ms of a 5-6 ms step, benchmarks/NOTES.md run 84)."""
    options = dict(policy.decode_compiler_options)
    if eight_bit_weights:
        options.update({name: value for name, value in EIGHT_BIT_DECODE_OPTIONS.items() if name in options})
    return options


def decode_step(graphdef, sampling: Sampling, *, under: Placement | None, eight_bit_weights: bool = False) -> Jitted:
    """The jitted decode step (see the module docstring) under `under`; the cache is donated; compiled with
    `decode_options` (`eight_bit_weights`: the model's weights in 8 bits)."""
    placement = under or UNPLACED
    options = decode_options(policy_of(placement.device), eight_bit_weights)

    @jit(under=under, ambient=False, donate_argnums=(2,), compiler_options=options)
    def step(params, rest, cache, token_B, position):
        out = nnx.merge(graphdef, params, rest)(token_B[:, None], cache=cache, cache_index=position,
                                                placement=placement)
        return choose_token(out.logits[:, 0], position + 1, sampling, placement), out.cache

    return step


def choose_token(logits_BV: jax.Array, position, sampling: Sampling, placement: Placement | None = None) -> jax.Array:
    """The next token of each row [B] int32 from the last position's logits [B, V] (float32, placed by the
    ("batch", "vocab") rules of `placement`; None: `current()`), drawn for sequence position `position`."""
    with jax.named_scope("sample"):
        logits_BV = whole_vocabulary(logits_BV, placement)
        if sampling.top_p is None:
            return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
        scaled_BV = logits_BV / sampling.temperature
        probabilities_BV = jax.nn.softmax(scaled_BV, axis=-1)
        descending_BV = jnp.sort(probabilities_BV, axis=-1)[:, ::-1]
        mass_before_BV = jnp.cumsum(descending_BV, axis=-1) - descending_BV
        first_BV = jnp.arange(descending_BV.shape[-1])[None, :] == 0  # kept always: a top_p of 1e-38 flushes to 0
        smallest_kept_B1 = jnp.min(jnp.where((mass_before_BV < sampling.top_p) | first_BV, descending_BV, 1.0),
                                   axis=-1, keepdims=True)
        nucleus_BV = jnp.where(probabilities_BV >= smallest_kept_B1, scaled_BV, -jnp.inf)
        key = jax.random.fold_in(jax.random.key(sampling.seed), position)
        return jax.random.categorical(key, nucleus_BV, axis=-1).astype(jnp.int32)


def whole_vocabulary(logits_BV: jax.Array, placement: Placement | None = None) -> jax.Array:
    """The logits [B, V] with the vocabulary whole on every device (rows stay where `placement`, None: `current()`,
    puts them), gathered inside each GPU first and then across GPUs, so neither gather spans both levels. Identity
    unplaced."""
    spec = placed_by(placement).activation_spec(("batch", "vocab"), logits_BV.shape, "next-token logits")
    if spec is None:
        return logits_BV
    vocab_axes = axes_of(spec[1])
    across_gpus = tuple(axis for axis in vocab_axes if axis != INSIDE_GPU)
    if INSIDE_GPU in vocab_axes and across_gpus:
        logits_BV = reshard(logits_BV, PartitionSpec(spec[0], across_gpus))
    return reshard(logits_BV, PartitionSpec(spec[0], None))
