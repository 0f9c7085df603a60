"""The decoder's layer weights as its forward passes read them: each stacked weight [L, ...] by name, cast once per
step (`layer_weights`), split into each layer's (`unstacked`), an 8-bit weight held as one array per layer for the
programs that run the layers one after another (`split_layer_weights`), quantized in place where the model is built
8-bit (`quantize_in_place`), and each layer's attention window (`layer_windows`). The weights themselves are defined
by `decoder.LayerStack`; `weight_formats` converts a built model's.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from ..errors import StarscreamError
from ..sharding.apply import logical_names, param, path_name
from .config import ModelConfig
from .quantize import QUANTIZED_INPUTS, SCALE_SUFFIX, quantize, scale_names


FULL_WINDOW = 1 << 30
"""The window of a layer that attends to every earlier position, in a model with sliding-window layers."""


def layer_windows(c: ModelConfig) -> np.ndarray:
    """Each layer's attention window [L] int32: `c.sliding_window` for the layers of `c.sliding_layers`,
    FULL_WINDOW for the others."""
    return np.array([c.sliding_window if layer in c.sliding_layers else FULL_WINDOW for layer in range(c.n_layers)],
                    np.int32)


def quantize_in_place(c: ModelConfig, layers: nnx.Module) -> None:
    """Replaces each weight of QUANTIZED_INPUTS by its 8-bit values, with its scale beside it as `<name>_scale`
    (`quantize.quantize`)."""
    for key in QUANTIZED_INPUTS:
        names = logical_names(getattr(layers, key))
        values, scale = quantize(getattr(layers, key)[...], key, names, c.weight_format, c.weight_scales)
        setattr(layers, key, param(values, names))
        setattr(layers, key + SCALE_SUFFIX, param(scale, scale_names(key, names, c.weight_scales)))


def unstacked(stacked: dict, n_layers: int) -> list[dict]:
    """Each layer's weights {name: [...]} from the stacked ones {name: [L, ...]}, split apart in one op per weight
    (whose gradient is one concatenation of the layers' gradients, where indexing each layer would pad every
    layer's gradient to the stack's shape and add the L of them); a weight held per layer (a tuple of L arrays,
    `split_layer_weights`) as held."""
    parts = {name: value if isinstance(value, tuple) else [part.reshape(part.shape[1:])
                                                            for part in jnp.split(value, n_layers)]
             for name, value in stacked.items()}
    return [{name: layers[index] for name, layers in parts.items()} for index in range(n_layers)]


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


def _layer_weight_names(c: ModelConfig) -> list[str]:
    names = ["attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down"]
    names += ["attn_post_norm", "mlp_post_norm"] if c.post_norms else []
    names += ["bq", "bk", "bv"] if c.qkv_bias else []
    names += ["q_norm", "k_norm"] if c.qk_norm else []
    names += ["router"] if c.n_experts else []
    return names + ([name + SCALE_SUFFIX for name in names if name in QUANTIZED_INPUTS] if c.weight_format else [])


CAST_ONCE = frozenset({"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "bq", "bk", "bv"})
"""The stacked layer weights used in the compute dtype: the projections' matrices and biases (norm scales and a
mixture of experts' router are used in float32)."""


def layer_weights(c: ModelConfig, layers: nnx.Module) -> dict:
    """Every stacked layer weight [L, ...] by name, those of CAST_ONCE cast to the compute dtype here, once per step
    before the layer loop, as stored (not gathered): each layer then slices and gathers its weights in that dtype,
    where casting inside the loop would copy each layer's float32 slice out of the stack first. A weight's
    gradient is the same either way (each layer's slice is used once). 8-bit weights and their scales stay as
    stored, and a weight held per layer (`split_layer_weights`: a tuple of L arrays) as held."""
    dtype = jnp.dtype(c.dtype)
    stored = {name: getattr(layers, name).get_value() for name in _layer_weight_names(c)}
    weights = {name: value.astype(dtype) if name in CAST_ONCE and not isinstance(value, tuple)
               and value.dtype.itemsize > 1 else value for name, value in stored.items()}
    if c.sliding_window:  # each layer's attention window travels with its weights (`layer_windows`)
        weights["window"] = jnp.asarray(layer_windows(c))
    return weights
