"""The decoder's layer weights as its forward passes read them: one typed value per layer (`LayerWeights`, its
attention's `AttentionWeights` and its MLP's `DenseMlpWeights` or `RoutedMlpWeights`), whose fields are the
`decoder.LayerStack` parameters of the same names. A step reads them stacked [L, ...] and cast once
(`layer_weights`), split into each layer's (`unstacked`); an 8-bit weight may be held as one array per layer for the
programs that run the layers one after another (`split_layer_weights`); the model built 8-bit quantizes its weights
in place (`quantize_in_place`); each layer's attention window travels with its weights (`layer_windows`).
`weight_formats` converts a built model's weights. Inference holds the projections that share an input stacked into
one weight each (`inference_split`, `stack_projections`).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from jax.tree_util import register_dataclass

from ..errors import StarscreamError
from ..sharding.apply import logical_names, param, path_name, placed_explicitly
from .config import ModelConfig
from .quantize import QUANTIZED_INPUTS, SCALE_SUFFIX, held_as_read, quantize, scale_names


FULL_WINDOW = 1 << 30
"""The window of a layer that attends to every earlier position, in a model with sliding-window layers."""
COMPUTE = {"compute_dtype": True}
"""Field metadata of a weight used in the compute dtype: the projections' matrices and biases, cast once per step
(`layer_weights`). Norm scales and a router are used in float32; 8-bit values and their scales as stored."""


@register_dataclass
@dataclass(frozen=True, kw_only=True)
class AttentionWeights:
    """One layer's attention weights; the optional ones are None in a model without them. Shape letters as in
    `names`; the logical names of each dimension in brackets' order:

      wq                  [D, H, E]  embed, heads, head_dim       query projection
      wk, wv              [D, K, E]  embed, kv_heads, head_dim    key and value projections
      wo                  [H, E, D]  heads, head_dim, embed       output projection
      bq                  [H, E]     heads, head_dim              query bias (`qkv_bias`: Qwen2)
      bk, bv              [K, E]     kv_heads, head_dim           key and value biases (`qkv_bias`)
      q_norm, k_norm      [E]        norm                         per-head RMSNorm scales (`qk_norm`: Qwen3)
      wq_scale            [H, E]     heads, head_dim              8-bit weights' float32 scales (`weight_format`),
      wk_scale, wv_scale  [K, E]     kv_heads, head_dim           per output channel; [] per tensor
      wo_scale            [D]        embed                        (`weight_scales`: "tensor")
      wqkv          [D, K, G + 2, E] embed, kv_heads, -, head_dim q, k and v stacked by kv head (G = H / K query
      wqkv_scale    [K, G + 2, E]    kv_heads, -, head_dim        heads, then the key, then the value) where
                                                                  inference holds them so (`stack_projections`);
                                                                  wq, wk, wv and their scales are then None

    Where an 8-bit scale is present its weight holds the 8-bit values."""

    wq: jax.Array | None = field(default=None, metadata=COMPUTE)
    wk: jax.Array | None = field(default=None, metadata=COMPUTE)
    wv: jax.Array | None = field(default=None, metadata=COMPUTE)
    wqkv: jax.Array | None = field(default=None, metadata=COMPUTE)
    wo: jax.Array = field(metadata=COMPUTE)
    bq: jax.Array | None = field(default=None, metadata=COMPUTE)
    bk: jax.Array | None = field(default=None, metadata=COMPUTE)
    bv: jax.Array | None = field(default=None, metadata=COMPUTE)
    q_norm: jax.Array | None = None
    k_norm: jax.Array | None = None
    wq_scale: jax.Array | None = None
    wk_scale: jax.Array | None = None
    wv_scale: jax.Array | None = None
    wqkv_scale: jax.Array | None = None
    wo_scale: jax.Array | None = None


@register_dataclass
@dataclass(frozen=True, kw_only=True)
class DenseMlpWeights:
    """One layer's SwiGLU (or GeGLU) MLP weights; the 8-bit scales are None for float weights:

      w_gate, w_up              [D, F]  embed, mlp   gate and up projections
      w_down                    [F, D]  mlp, embed   down projection
      w_gate_scale, w_up_scale  [F]     mlp          8-bit weights' float32 scales per output channel;
      w_down_scale              [D]     embed        [] per tensor
      w_gate_up              [D, 2, F]  embed, -, mlp  gate and up stacked where inference holds them so
      w_gate_up_scale        [2, F]     -, mlp         (`stack_projections`); w_gate, w_up and their scales are
                                                       then None"""

    w_gate: jax.Array | None = field(default=None, metadata=COMPUTE)
    w_up: jax.Array | None = field(default=None, metadata=COMPUTE)
    w_gate_up: jax.Array | None = field(default=None, metadata=COMPUTE)
    w_down: jax.Array = field(metadata=COMPUTE)
    w_gate_scale: jax.Array | None = None
    w_up_scale: jax.Array | None = None
    w_gate_up_scale: jax.Array | None = None
    w_down_scale: jax.Array | None = None


@register_dataclass
@dataclass(frozen=True, kw_only=True)
class RoutedMlpWeights:
    """One layer's routed mixture of experts (`moe.routed_mlp`); the 8-bit scales are None for float weights:

      router                    [D, X]     embed, experts               router logits' projection (float32 at use)
      w_gate, w_up              [X, D, F]  experts, embed, expert_mlp   each expert's gate and up projections
      w_down                    [X, F, D]  experts, expert_mlp, embed   each expert's down projection
      w_gate_scale, w_up_scale  [X, F]     experts, expert_mlp          8-bit weights' float32 scales per output
      w_down_scale              [X, D]     experts, embed               channel; [X] (experts) per tensor"""

    router: jax.Array
    w_gate: jax.Array = field(metadata=COMPUTE)
    w_up: jax.Array = field(metadata=COMPUTE)
    w_down: jax.Array = field(metadata=COMPUTE)
    w_gate_scale: jax.Array | None = None
    w_up_scale: jax.Array | None = None
    w_down_scale: jax.Array | None = None


@register_dataclass
@dataclass(frozen=True, kw_only=True)
class LayerWeights:
    """One pre-norm block's weights (`decoder._block`): its norms' scales, its attention's and its MLP's weights,
    and its attention window. Shapes are one layer's (`unstacked`); the value a step reads (`layer_weights`) has
    each weight stacked [L, ...] on a leading `layers` axis, an 8-bit weight held per layer (`split_layer_weights`)
    as a tuple of L arrays.

      attn_norm, mlp_norm            [D]  norm   RMSNorm scales before the attention and the MLP
      attn_post_norm, mlp_post_norm  [D]  norm   RMSNorm scales of their outputs (`post_norms`: Gemma 2), or None
      window                         []   int32  the attention window (`layer_windows`) in a model with
                                                 sliding-window layers, or None"""

    attn_norm: jax.Array
    attention: AttentionWeights
    attn_post_norm: jax.Array | None = None
    mlp_norm: jax.Array
    mlp: DenseMlpWeights | RoutedMlpWeights
    mlp_post_norm: jax.Array | None = None
    window: jax.Array | None = None


def layer_windows(c: ModelConfig) -> np.ndarray:
    """Each layer's attention window [L] int32: `c.sliding_window` for the layers of `c.sliding_layers`,
    FULL_WINDOW for the others."""
    return np.array([c.sliding_window if layer in c.sliding_layers else FULL_WINDOW for layer in range(c.n_layers)],
                    np.int32)


STACKED_QKV_NAMES = ("embed", "kv_heads", None, "head_dim")
"""Logical names of q, k and v stacked by kv head, [D, K, G + 2, E] (`stacked_qkv`)."""
STACKED_GATE_UP_NAMES = ("embed", None, "mlp")
"""Logical names of gate and up stacked, [D, 2, F] (`stacked_gate_up`)."""


def by_kv_head(q_xHE: jax.Array, kv_heads: int) -> jax.Array:
    """A query weight or scale [..., H, E] as [..., K, G, E], each kv head's G query heads together, the mesh axes
    that split its heads kept on K. JAX's own reshape rule moves them to G where K is 1 (a size-1 axis, or one kv
    head), and the stack with k / v [..., K, E] would then mix placements; callers stack only where k splits K over
    the same axes as q splits H, so they divide K."""
    *lead, heads, head_dim = q_xHE.shape
    shape = (*lead, kv_heads, heads // kv_heads, head_dim)
    if not placed_explicitly(q_xHE):
        return q_xHE.reshape(shape)
    sharding = jax.typeof(q_xHE).sharding
    *lead_spec, h, e = sharding.spec
    return jnp.reshape(q_xHE, shape, out_sharding=NamedSharding(sharding.mesh, PartitionSpec(*lead_spec, h, None, e)))


def stacked_qkv(q_xHE: jax.Array, k_xKE: jax.Array, v_xKE: jax.Array) -> jax.Array:
    """q [..., H, E], k and v [..., K, E] (weights [.., D, ., E] or their scales [.., ., E]) stacked by kv head:
    [..., K, G + 2, E], each kv head's G query heads, then its key, then its value."""
    kv_heads = k_xKE.shape[-2]
    return jnp.concatenate([by_kv_head(q_xHE, kv_heads), k_xKE[..., None, :], v_xKE[..., None, :]], axis=-2)


def stacked_gate_up(gate_xF: jax.Array, up_xF: jax.Array) -> jax.Array:
    """Gate and up [..., F] (weights [.., D, F] or their scales) stacked as [..., 2, F]."""
    return jnp.stack([gate_xF, up_xF], axis=-2)


def inference_split(model: nnx.Module, mesh=None, dtype=None):
    """(graphdef, parameters, rest) of `model` as inference holds it on `mesh` (None: one device): float weights
    cast to `dtype` (None: as stored; `quantize.held_as_read`), then the projections sharing an input stacked
    (`stack_projections`). The model itself is unchanged."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    if dtype is not None:
        params = held_as_read(params, dtype)
    return nnx.split(stack_projections(nnx.merge(graphdef, params, rest), mesh), nnx.Param, ...)


def stack_projections(model: nnx.Module, mesh=None) -> nnx.Module:
    """A copy of `model` (its other arrays shared; `model` unchanged) whose layers hold q, k and v as one weight
    `wqkv` [L, D, K, G + 2, E] (`stacked_qkv`) and gate and up as `w_gate_up` [L, D, 2, F] (`stacked_gate_up`),
    8-bit weights' scales stacked alike (a per-tensor scale spread over its channels: the same product), where the
    model runs on one device (`mesh` None or of one device) with `fuse_projections` on. A model stacked already is
    copied as it is. The parts stay allocated while `model` holds them: a caller that holds the only reference
    (a server's loaded model) replaces it by the copy before sizing anything by free memory.

    Why: decode then multiplies each group in one GEMM (or one weight-only launch) with N = (H + 2K) E and 2F,
    which on an H200 ran Llama 3 8B's projections 13% faster than apart at 64 rows (benchmarks/NOTES.md run 71),
    and prefill stops stacking them every step (a copy of 470 MB per layer of Llama 3 8B's gate and up). Over
    several devices the weights stay as stored: a layout then splits each projection into smaller local GEMMs
    and places each output by its own rule (prefill still stacks them per step, `decoder._fuses`), and the
    inspector's judgements are made per projection (under 2-D weight-stationary decode a stacked gate / up would
    be one partial-sum output twice the size of each apart). A routed mixture of experts keeps gate and up apart
    (its own grouped matmuls)."""
    c = model.config
    graphdef, state = nnx.split(model)
    copy = nnx.merge(graphdef, state)
    if not c.fuse_projections or (mesh is not None and mesh.size > 1):
        return copy
    _stack_into(copy.layers, "wqkv", ("wq", "wk", "wv"), stacked_qkv, ("layers", *STACKED_QKV_NAMES))
    if not c.n_experts:
        _stack_into(copy.layers, "w_gate_up", ("w_gate", "w_up"), stacked_gate_up, ("layers", *STACKED_GATE_UP_NAMES))
    return copy


def _stack_into(layers: nnx.Module, name: str, parts: tuple[str, ...], stack, names: tuple) -> None:
    """Replaces the stacked layer weights `parts` of `layers` by one parameter `name` = stack(*parts) with logical
    `names`, and their 8-bit scales (present where the weights are 8-bit) by `name`_scale, each a per-tensor scale
    [L] spread over its weight's channels first; nothing where `layers` holds `name` already, or holds a part as
    one array per layer (`split_layer_weights`: a model already in the form its step reads)."""
    if hasattr(layers, name):
        return
    values = [getattr(layers, part).get_value() for part in parts]
    if any(_held_per_layer(value) for value in values):
        return
    setattr(layers, name, param(_computed(stack, *values), names))
    if hasattr(layers, parts[0] + SCALE_SUFFIX):
        scales = [_per_channel(getattr(layers, part + SCALE_SUFFIX).get_value(), value)
                  for part, value in zip(parts, values)]
        setattr(layers, name + SCALE_SUFFIX, param(_computed(stack, *scales), ("layers", *names[2:])))
        for part in parts:
            delattr(layers, part + SCALE_SUFFIX)
    for part in parts:
        delattr(layers, part)


def _per_channel(scale: jax.Array, values: jax.Array) -> jax.ShapeDtypeStruct | jax.Array:
    """A stacked weight's scale [L, channels...] as it is, or its per-tensor scale [L] spread over the channels of
    its values [L, D, channels...]."""
    channels = (values.shape[0], *values.shape[2:])
    if scale.shape == channels:
        return scale
    return _computed(lambda s: jnp.broadcast_to(s.reshape(-1, *[1] * (len(channels) - 1)), channels), scale)


def _computed(fn, *values):
    """fn(*values) for arrays (jitted), or its abstract result for abstract values (`abstract_model`'s)."""
    if any(isinstance(value, jax.ShapeDtypeStruct) for value in values):
        return jax.eval_shape(fn, *values)
    return jax.jit(fn)(*values)


def quantize_in_place(c: ModelConfig, layers: nnx.Module) -> None:
    """Replaces each weight of QUANTIZED_INPUTS by its 8-bit values, with its scale beside it as `<name>_scale`
    (`quantize.quantize`)."""
    for key in QUANTIZED_INPUTS:
        names = logical_names(getattr(layers, key))
        values, scale = quantize(getattr(layers, key)[...], key, names, c.weight_format, c.weight_scales)
        setattr(layers, key, param(values, names))
        setattr(layers, key + SCALE_SUFFIX, param(scale, scale_names(key, names, c.weight_scales)))


def layer_weights(c: ModelConfig, layers: nnx.Module) -> LayerWeights:
    """Every layer's weights stacked [L, ...] (`LayerWeights`), those marked COMPUTE cast to the compute dtype here,
    once per step before the layer loop, as stored (not gathered): each layer then slices and gathers its weights
    in that dtype, where casting inside the loop would copy each layer's float32 slice out of the stack first. A
    weight's gradient is the same either way (each layer's slice is used once). 8-bit weights and their scales stay
    as stored, and a weight held per layer (`split_layer_weights`: a tuple of L arrays) as held. With sliding-window
    layers each layer's window [L] rides along (`layer_windows`)."""
    mlp = _read(c, layers, RoutedMlpWeights if c.n_experts else DenseMlpWeights)
    window = jnp.asarray(layer_windows(c)) if c.sliding_window else None
    return _read(c, layers, LayerWeights, attention=_read(c, layers, AttentionWeights), mlp=mlp, window=window)


def _read(c: ModelConfig, layers: nnx.Module, kind: type, **given):
    """A `kind` of `layers`' stacked weights: each field not `given` the parameter of its name, absent (None) where
    the model has none; those marked COMPUTE in the compute dtype (`layer_weights`)."""
    def read(weight):
        stored = getattr(layers, weight.name).get_value()
        cast = weight.metadata.get("compute_dtype") and not _held_per_layer(stored) and stored.dtype.itemsize > 1
        return stored.astype(jnp.dtype(c.dtype)) if cast else stored

    return kind(**given, **{weight.name: read(weight) for weight in fields(kind)
                            if weight.name not in given and hasattr(layers, weight.name)})


def unstacked(stacked: LayerWeights, n_layers: int) -> list[LayerWeights]:
    """Each layer's weights from the stacked ones ([L, ...] each), split apart in one op per weight (whose gradient
    is one concatenation of the layers' gradients, where indexing each layer would pad every layer's gradient to
    the stack's shape and add the L of them); a weight held per layer (a tuple of L arrays, `split_layer_weights`)
    as held."""
    weights, tree = jax.tree.flatten(stacked, is_leaf=_held_per_layer)
    parts = [weight if _held_per_layer(weight) else [part.reshape(part.shape[1:])
                                                      for part in jnp.split(weight, n_layers)] for weight in weights]
    return [tree.unflatten([layers[index] for layers in parts]) for index in range(n_layers)]


def any_held_per_layer(stacked: LayerWeights) -> bool:
    """Whether any of the stacked weights is held per layer (`split_layer_weights`)."""
    return any(_held_per_layer(weight) for weight in jax.tree.leaves(stacked, is_leaf=_held_per_layer))


def _held_per_layer(node) -> bool:
    """Whether a node of stacked weights is a weight held per layer: a tuple of L arrays (a NamedTuple is not one)."""
    return type(node) is tuple


def split_layer_weights(params):
    """`params` (an nnx.State of a Transformer's parameters) with each 8-bit layer weight [L, ...] held as L arrays
    [...] (a tuple), each placed as its layer's part of the stack was, for the programs that run the layers one
    after another (decode without a layer loop, `decode_holds_cache_per_layer`, and the paged step).

    Why: a GEMM fusion that converts an 8-bit weight as it reads it (XLA's Triton GEMM) reads whole arrays, so XLA
    copies each layer's slice out of a stack first, every step: for Llama 3 8B at batch 1 on an H200 those copies
    took 6.2 ms of a 10.4 ms step (benchmarks/NOTES.md run 19), where a bfloat16 slice is read in place by cuBLAS
    (float weights stay stacked). Copies once, one weight at a time, so the extra memory held while splitting is
    one stacked weight's. The sliced `layers` axis must be unsplit (no layout splits it)."""
    def split(path, variable):
        value = variable.get_value()
        if not _held_in_eight_bits(path, value):
            return variable
        sharding = value.sharding
        if isinstance(sharding, NamedSharding) and sharding.spec and sharding.spec[0] is not None:
            raise StarscreamError(f"{path_name(path)} splits its layers over {sharding.spec[0]}; weights held per "
                                  "layer need the layers axis unsplit (use a layout that keeps it whole)")
        layer_sharding = (NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[1:]))
                          if isinstance(sharding, NamedSharding) else sharding)
        if isinstance(value, jax.ShapeDtypeStruct):  # abstract arguments (`analysis.compile`)
            return variable.replace(tuple(jax.ShapeDtypeStruct(value.shape[1:], value.dtype, sharding=layer_sharding)
                                          for _ in range(value.shape[0])))
        layers = jax.jit(lambda stack: tuple(stack[index] for index in range(stack.shape[0])),
                         out_shardings=layer_sharding)(value)
        return variable.replace(layers)

    return jax.tree.map_with_path(split, params, is_leaf=lambda node: isinstance(node, nnx.Variable))


def _held_in_eight_bits(path, value) -> bool:
    """Whether a parameter is a stacked 8-bit layer weight (`split_layer_weights`)."""
    return (not isinstance(value, tuple) and path_name(path).split("/")[0] == "layers" and value.ndim > 1
            and jnp.dtype(value.dtype).itemsize == 1)
