"""Abstract arguments -> the compiled step: the programs `starscream inspect` and `plan` judge, compiled ahead of time.

For one model, phase and mesh, a layout's step is lowered from abstract inputs (`jax.ShapeDtypeStruct`s carrying the
layout's shardings; no array is ever allocated, so a 70B model costs nothing) and compiled. The step is the one
`training.steps` defines, built exactly as training and generation build it, so the judged program is the program
that runs:
  train    `steps.train_step` with `steps.make_optimizer(settings.training)` (clipping, AdamW, the weight-decay mask)
           and its `grad_accum` micro-batches on tokens [B, S + 1]; parameters and optimizer state float32, placed
           by the layout's params rules, as `starscream train` keeps them.
  prefill  `steps.prefill_step` over a prompt [B, S] into a fresh KV cache of T positions (`Settings.cache_length`,
           default S); parameters held in the model's dtype, as `starscream generate` holds them for inference.
  decode   `steps.decode_step`: one new token per sequence [B] against a KV cache of T positions (default S), the
           token's position an input of the step; the cache held as generation holds it: one array per layer when
           decode runs no layer loop (`ModelConfig.scan_unroll` 0, the default:
           `decoder.decode_holds_cache_per_layer`), else stacked.

Depth: the model is compiled with L layers (`Settings.config.n_layers`, at least 2) in place of its N, with the
model's own `scan_unroll`. By default no phase runs a layer loop: the layers run one after another
(`Transformer._run_layers_apart`; a prefill into a stacked cache through a fully unrolled scan), their ops under the
layer scope (`LAYER_SCOPE`), L copies of one layer's, so per-layer figures are their sum over L. With `scan_unroll`
1 (or any number of layers per trip below L) the layers run as one loop (`jax.lax.scan`) whose body is the same for
every layer (`layer_loop_ops` finds it), and per-layer figures are what the body does in one trip. Which of the two
the program holds is told by the settings (`runs_layer_loop`), not guessed from the program: a loop of L trips
inside a layer (an MoE block looping over its 2 local experts, compiled at L = 2) would otherwise pass for it.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from ..checks import writable_directory
from ..hardware.backend import policy_of
from ..errors import ShardingRuleError, StarscreamError
from ..inference.generate import generation_cache_length
from ..model.config import ModelConfig
from ..model.catalog import load_model_config
from ..model.decoder import LAYER_SCOPE, abstract_model, decode_holds_cache_per_layer, rolls_layers
from ..model.dense_cache import DenseCache, cache_entries, cache_shardings
from ..model.layer_weights import inference_split, split_layer_weights
from ..model.paged import PAGES, SCALES, pool_shape
from ..model.quantize import held_dtype
from ..serving.steps import SLOTS, PackedInputs, cache_shards, forward_step
from ..sharding.apply import (
    Placement,
    abstract_placed,
    activation_spec,
    batch_sharding,
    path_name,
    token_sharding,
    use_layout,
)
from ..sharding.layouts import Layout, fit_batch, get_layout
from ..training.config import TrainConfig
from ..training.steps import Sampling, decode_step, make_optimizer, prefill_step, train_step
from .hlo import instructions_in_loops, scope_shares

PHASES = ("train", "prefill", "decode")
SERVE = "serve"
"""What `inspect --phase serve` compiles: the decode phase as the server runs it (`Settings.paged`)."""
SERVE_PAGE_SIZE = 16
"""Positions per KV page of the compiled serving step (the server's default, `serving.engine.EngineConfig`)."""
DEFAULT_SHAPES = {"train": (8, 2048), "prefill": (8, 4096), "decode": (64, 8192)}
"""(batch, seq) per phase: the token counts of the first H200 kernel-shape measurement."""
REFERENCE = "gpu_tp"
"""The layout whose kernel shapes principle 1 compares against."""
COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}
"""The programs are never run: skipping LLVM's optimisation of the CPU code halves compile time and leaves the
compiled HLO and its memory analysis unchanged."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
    """What to compile: `config` has the compiled depth (`layers`), `full_layers` is the model's own depth;
    `training` sets the train step's optimizer and `sampling` the prefill and decode steps' choice of token;
    `cache_length` is the KV cache's length in prefill and decode (None: `seq`); `cache_per_layer` whether decode
    holds the cache as one array per layer (None: as generation holds it for the full-depth model); `paged` compiles
    decode as the server runs it: `serving.steps.forward_step` (the model part of the engine's step; its sampler
    is a program of its own), one token per sequence against `seq` positions of a
    paged KV cache (`PagedArgs`), held per layer."""

    config: ModelConfig
    full_layers: int
    phase: str
    batch: int
    seq: int
    layouts: tuple[str, ...]
    dump_hlo: Path | None = None
    training: TrainConfig = TrainConfig()
    sampling: Sampling = Sampling()
    cache_length: int | None = None
    cache_per_layer: bool | None = None
    paged: bool = False

    @property
    def layers(self) -> int:
        return self.config.n_layers

    @property
    def holds_cache_per_layer(self) -> bool:
        """Whether the compiled decode step takes its KV cache as one array per layer (never in train, prefill)."""
        if self.phase != "decode":
            return False
        if self.cache_per_layer is not None:
            return self.cache_per_layer
        return decode_holds_cache_per_layer(self.config.replace(n_layers=self.full_layers))

    @property
    def cache(self) -> int:
        """The KV cache's length in prefill and decode."""
        return self.cache_length or self.seq


class TrainArgs(NamedTuple):
    params: Any
    opt_state: Any
    rest: Any
    tokens: Any


class PrefillArgs(NamedTuple):
    params: Any
    rest: Any
    prompt: Any


class DecodeArgs(NamedTuple):
    params: Any
    rest: Any
    cache: Any
    token: Any
    position: Any


class PagedArgs(NamedTuple):
    params: Any
    rest: Any
    pages: Any
    recent: Any
    inputs: Any


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompiledStep:
    """One layout's compiled step: the layout's name as asked for and the layout as fitted to the batch
    (`fitted_layout`), the abstract arguments it was lowered from and its abstract result, its layer-loop
    instructions (`layer_loop_ops`) and the lowered program's text (with locations: the activations' names)."""

    name: str
    layout: Layout
    args: NamedTuple
    outputs: Any
    compiled: Any
    loop_ops: dict[str, float]
    lowered_text: str


def make_settings(model: str, phase: str, batch: int | None, seq: int | None, layouts: str, layers: int,
                  dump_hlo: Path | None = None) -> Settings:
    """Checked Settings: `model` a name in models/, a TOML path or a Hugging Face model directory (its config.json),
    `batch` / `seq` None for the phase's defaults, `layouts` comma-separated names, `layers` the compiled depth (at
    least 2). The default sequence length is capped at the model's max_seq_len."""
    if phase not in (*PHASES, SERVE):
        raise StarscreamError(f"phase {phase!r}: expected one of {', '.join((*PHASES, SERVE))}")
    if layers < 2:
        raise StarscreamError(f"--layers {layers}: per-layer figures are read from the compiled layer loop, "
                              "which XLA removes at one layer; pass --layers 2 or more")
    full = load_model_config(model)
    if layers > full.n_layers:
        raise StarscreamError(f"--layers {layers} exceeds model {full.name}'s {full.n_layers} layers; pass --layers "
                              f"{full.n_layers} or fewer")
    if dump_hlo is not None:
        writable_directory(dump_hlo, "--dump-hlo")
    paged, phase = phase == SERVE, "decode" if phase == SERVE else phase
    default_batch, default_seq = DEFAULT_SHAPES[phase]
    batch = default_batch if batch is None else batch
    seq = min(default_seq, full.max_seq_len) if seq is None else seq
    if batch < 1 or seq < 2:
        raise StarscreamError(f"--batch {batch} --seq {seq}: need at least 1 sequence of at least 2 tokens")
    if seq > full.max_seq_len:
        raise StarscreamError(f"--seq {seq} exceeds model {full.name}'s max_seq_len {full.max_seq_len}; pass "
                              f"--seq {full.max_seq_len} or less")
    names = tuple(name.strip() for name in layouts.split(",") if name.strip())
    if not names:
        raise StarscreamError(f"--layout {layouts!r} names no layout; give names separated by commas")
    for name in names:
        get_layout(name)
    return Settings(config=full.replace(n_layers=layers), full_layers=full.n_layers, phase=phase, batch=batch, seq=seq,
                    layouts=tuple(dict.fromkeys(names)), dump_hlo=dump_hlo, cache_per_layer=True if paged else None,
                    paged=paged)


def step_program(settings: Settings, layout: Layout, mesh, config: ModelConfig | None = None):
    """(the phase's jitted step from `training.steps`, its abstract arguments) for a model of `config` (default:
    `settings.config`). Call inside `use_layout(layout, mesh)`."""
    config = config or settings.config
    if settings.paged:
        graphdef, args = abstract_paged_args(config, layout, mesh, settings.batch, settings.cache)
        kernel = policy_of(mesh.devices.flat[0]).paged_attention  # the engine's choice on this backend
        return forward_step(graphdef, kernel, under=Placement(layout, mesh),
                            eight_bit_weights=bool(config.weight_format)), args
    if settings.cache < settings.seq:
        raise StarscreamError(f"a KV cache of {settings.cache} positions cannot hold {settings.seq} tokens; give "
                              f"cache_length {settings.seq} or more")
    cache = cache_length(settings, layout, mesh)
    graphdef, args = abstract_args(config, layout, mesh, settings.phase, settings.batch, settings.seq,
                                   settings.training, cache, settings.holds_cache_per_layer)
    under = Placement(layout, mesh)
    if settings.phase == "train":
        step = train_step(graphdef, make_optimizer(settings.training, args.params), settings.training.grad_accum,
                          under=under)
    elif settings.phase == "prefill":
        step = prefill_step(graphdef, config, settings.sampling, cache, under=under)
    else:
        step = decode_step(graphdef, settings.sampling, under=under,
                           eight_bit_weights=bool(settings.config.weight_format))
    return step, args


def cache_length(settings: Settings, layout: Layout, mesh) -> int:
    """The KV cache's length under the fitted `layout`: `settings.cache` rounded up to a multiple of the parts the
    layout splits the cache's positions and the prompt into, as generation rounds it
    (`generate.generation_cache_length`)."""
    return generation_cache_length(settings.cache, layout, layout, mesh)


def compile_step(settings: Settings, layout_name: str, mesh) -> CompiledStep:
    """Lower the phase's step under the layout, fitted to the batch as training and generation fit it
    (`fitted_layout`), from abstract inputs and compile it (nothing is allocated)."""
    layout = fitted_layout(settings, layout_name, mesh)
    with use_layout(layout, mesh):
        step, args = step_program(settings, layout, mesh)
        traced = step.trace(*args)
        lowered = traced.lower()
        compiled = lowered.compile(compiler_options=COMPILER_OPTIONS)
    return CompiledStep(name=layout_name, layout=layout, args=args, outputs=traced.out_info, compiled=compiled,
                        loop_ops=layer_loop_ops(compiled.as_text(), settings.layers, runs_layer_loop(settings)),
                        lowered_text=lowered.as_text(debug_info=True))


def fitted_layout(settings: Settings, layout_name: str, mesh) -> Layout:
    """The layout `layout_name` as it places the phase's batch on `mesh` (`layouts.fit_batch`: a sequence split in
    train and prefill, split-K in decode, where the batch is smaller than the layout's batch split)."""
    if settings.paged:  # the server's paged step places its batch by the page pools (`serving.steps`)
        layout = get_layout(layout_name)
        if layout.splits_sequence:  # as the server refuses it (`serving.steps.check_same_cache_placement`)
            raise ShardingRuleError(f"layout {layout_name} splits the sequence and cannot decode from a paged KV "
                                    "cache; serve with a decode layout such as starscream_decode")
        return layout
    positions = {"train": settings.seq, "prefill": None, "decode": 1}[settings.phase]
    return fit_batch(layout_name, mesh, settings.batch, positions)


def runs_layer_loop(settings: Settings) -> bool:
    """Whether the compiled step runs its layers as a rolled loop (`decoder.rolls_layers`: decode with its cache held
    per layer never does)."""
    return rolls_layers(settings.config, settings.holds_cache_per_layer)


def abstract_args(config: ModelConfig, layout: Layout, mesh, phase: str, batch: int, seq: int,
                  training: TrainConfig = TrainConfig(), cache_length: int | None = None,
                  per_layer_cache: bool = False) -> tuple[Any, tuple]:
    """(graphdef, the step's arguments as ShapeDtypeStructs with the layout's shardings) for a model of `config`.

    Call inside `use_layout(layout, mesh)`. train: TrainArgs with tokens [B, S + 1]; prefill: PrefillArgs with the
    prompt [B, S]; decode: DecodeArgs with the KV cache (`abstract_cache`: T = `cache_length`, default S; one
    array per layer with `per_layer_cache`), the token [B] and its position (a scalar). Token batches are placed
    like the layout's `batch`, the cache by the activation rules; the optimizer state is `make_optimizer(training)`'s.
    """
    if phase == "train":
        graphdef, params, rest = nnx.split(abstract_model(config), nnx.Param, ...)
        params = abstract_placed(params, layout, mesh)
        opt_state = jax.eval_shape(make_optimizer(training, params).init, params)
        tokens = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32, sharding=batch_sharding(layout, mesh, batch))
        return graphdef, TrainArgs(params, abstract_placed(opt_state, layout, mesh), rest, tokens)
    graphdef, params, rest = inference_split(abstract_model(config), mesh)
    params = held_as_inference(abstract_placed(params, layout, mesh), jnp.dtype(config.dtype))
    if phase == "prefill":
        prompt = jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=batch_sharding(layout, mesh, batch))
        return graphdef, PrefillArgs(params, rest, prompt)
    cache = abstract_cache(config, layout, mesh, batch, cache_length or seq, per_layer_cache)
    if per_layer_cache:  # the layers run one after another, 8-bit weights held as generation holds them
        params = split_layer_weights(params)
    token = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=token_sharding(layout, mesh, batch))
    position = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec()))
    return graphdef, DecodeArgs(params, rest, cache, token, position)


def held_as_inference(params: nnx.State, dtype) -> nnx.State:
    """Abstract parameters in the dtypes inference holds them in (`quantize.held_dtype`): float weights in the
    compute `dtype`, 8-bit weights and their scales as stored."""

    def held(path, variable):
        value = variable.get_value()
        stored = held_dtype(path_name(path), value.dtype, dtype)
        return variable.replace(jax.ShapeDtypeStruct(value.shape, stored, sharding=value.sharding))

    return jax.tree.map_with_path(held, params, is_leaf=lambda node: isinstance(node, nnx.Variable))


def abstract_paged_args(config: ModelConfig, layout: Layout, mesh, batch: int, length: int) -> tuple[Any, PagedArgs]:
    """(graphdef, PagedArgs) of a serving decode step: `batch` sequences of `length` positions each in pages of
    SERVE_PAGE_SIZE (in the 8-bit `kv_format` with their scales where the config asks), every sequence's pages in its
    own cache shard (as `serving.scheduler` places them), plus one null page per shard; one token per sequence at its
    last position; 8-bit weights held per layer, as the engine holds them. Call inside `use_layout(layout, mesh)`."""
    graphdef, params, rest = inference_split(abstract_model(config), mesh)
    params = split_layer_weights(held_as_inference(abstract_placed(params, layout, mesh), jnp.dtype(config.dtype)))
    shards = cache_shards(layout, mesh)
    if batch % shards:
        raise StarscreamError(f"a batch of {batch} sequences cannot fill the {shards} cache shards of layout "
                              f"{layout.name}; pass --batch a multiple of {shards}")
    pages_per_row = -(-length // SERVE_PAGE_SIZE)
    pool = pool_shape(shards * (batch // shards * pages_per_row + 1), SERVE_PAGE_SIZE, config.n_kv_heads,
                      config.head_dim)
    sharding = NamedSharding(mesh, activation_spec(PAGES, pool, "kv pages"))
    pages = {name: tuple(jax.ShapeDtypeStruct(pool, jnp.dtype(config.kv_format or config.dtype), sharding=sharding)
                         for _ in range(config.n_layers)) for name in ("k", "v")}
    if config.kv_format:  # an 8-bit cache's scales, one per position and kv head
        scales = NamedSharding(mesh, activation_spec(SCALES, pool[:3], "kv page scales"))
        pages.update({name: tuple(jax.ShapeDtypeStruct(pool[:3], jnp.float32, sharding=scales)
                                  for _ in range(config.n_layers)) for name in ("k_scale", "v_scale")})
    _, axes = layout.activations.lookup("attn_batch")
    inputs = PackedInputs.abstract(batch, 1, pages_per_row, NamedSharding(mesh, PartitionSpec(axes or None)))
    recent = jax.ShapeDtypeStruct((batch,), jnp.int32,
                                  sharding=NamedSharding(mesh, activation_spec(SLOTS, (batch,), "slot tokens")))
    return graphdef, PagedArgs(params, rest, pages, recent, inputs)


def abstract_cache(config: ModelConfig, layout: Layout, mesh, batch: int, length: int,
                   per_layer: bool = False) -> DenseCache:
    """The KV cache (`dense_cache.cache_entries`: k and v [L, B, T, K, E], T = `length`, in the compute dtype or
    the 8-bit `kv_format` with its scales) as ShapeDtypeStructs placed by `layout` (`dense_cache.cache_shardings`, as
    `dense_cache.init_cache` places it); with `per_layer`, L arrays of each entry's layer ([B, T, K, E]), placed as
    `dense_cache.split_cache` places them (generation's decode cache)."""
    def placed(entry, sharding):
        if per_layer:
            return tuple(jax.ShapeDtypeStruct(entry.shape[1:], entry.dtype, sharding=sharding)
                         for _ in range(config.n_layers))
        return jax.ShapeDtypeStruct(entry.shape, entry.dtype, sharding=sharding)

    return jax.tree.map(placed, cache_entries(config, batch, length),
                        cache_shardings(config, batch, length, layout, mesh, per_layer))


def layer_loop_ops(hlo_text: str, layers: int, rolled: bool) -> dict[str, float]:
    """{name: share of its work that is the layers'} of the instructions of the layers. `rolled` (the program runs
    a layer loop, `runs_layer_loop`): those inside it (the forward scan, and the backward one when training), under
    a `while` whose known trip count is `layers` (share 1). Otherwise those whose op names lie in the layer scope
    `LAYER_SCOPE` (each of the L copies of the layer runs once), a collective that XLA combined from ops of the
    layers and ops outside them with the share of its bytes the layers' ops hold (`hlo.scope_shares`); per-layer
    figures are then as exact as the rolled program's."""
    found = (dict.fromkeys(instructions_in_loops(hlo_text, layers), 1.0) if rolled
             else scope_shares(hlo_text, LAYER_SCOPE))
    if not found:
        where = f"no loop of {layers} trips" if rolled else f"no op in the layer scope {LAYER_SCOPE!r}"
        raise StarscreamError(f"the compiled program has {where}, so per-layer figures cannot be told apart; the "
                              "model must run its layers with jax.lax.scan (scan_unroll below its depth) or each "
                              "under that scope")
    return found
