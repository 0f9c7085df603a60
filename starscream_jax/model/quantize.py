"""8-bit numbers: weights stored in int8 or fp8 with float32 scales, the KV cache likewise, and fp8 matmuls.

A quantized weight is a pair: `values` in the 8-bit format, of the weight's shape and logical names, and `scale`
(float32) over the weight's output channels (the weight's names without the contracted ones, QUANTIZED_INPUTS) or one
per stacked tensor ("tensor": the `layers` and `experts` names only). Both are parameters placed by the layout's
rules for their names, so a scale is split wherever its weight's output channels are and is never gathered with the
values. The product x @ (values * scale) is computed as (x @ values) * scale: the 8-bit values are converted in the
matmul's own fusion and the scale multiplies the output channels, which it commutes with.

Symmetric scales: scale = max |w| over the contracted axes / the format's largest value; values = w / scale,
rounded to nearest (int8 clipped to +-127). fp8 e4m3 keeps 3 mantissa bits, int8 about 7 bits at the channel's
largest weight: int8 is the closer of the two for weights, fp8 the one whose matmuls the chips run natively.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from ..errors import PresetError
from ..sharding.apply import path_name

WEIGHT_FORMATS = ("int8", "float8_e4m3fn", "float8_e4m3fnuz")
"""The 8-bit formats weights and the KV cache can be stored in (JAX dtype names; `hardware.presets.Chip.formats`
says which a chip computes in)."""
SCALE_GRANULARITIES = ("channel", "tensor")
QUANTIZED_INPUTS = {"wq": ("embed",), "wk": ("embed",), "wv": ("embed",), "wo": ("heads", "head_dim"),
                    "w_gate": ("embed",), "w_up": ("embed",), "w_down": ("mlp", "expert_mlp")}
"""The layers' weights stored in 8 bits, each with the logical names of its contracted (input) axes. The embedding
table (a few rows read per step), the output head (kept in float by the hub's FP8 checkpoints too: the logits are the
most sensitive product), norm scales, biases and a mixture's router stay in their float dtype."""
STACKED = ("layers", "experts")
"""Logical names of the stacked axes: a per-tensor scale has one value per layer (and expert)."""
SCALE_SUFFIX = "_scale"


class Scaled(NamedTuple):
    """A quantized weight as a matmul uses it: 8-bit `values` placed by the weight rules, float32 `scale` over the
    output channels (or a scalar)."""

    values: jax.Array
    scale: jax.Array


def check_format(format_name: str, allowed: tuple[str, ...] = WEIGHT_FORMATS, what: str = "weight format") -> None:
    if format_name not in allowed:
        raise PresetError(f"{what} {format_name!r}; use one of {', '.join(allowed)}")


def largest(format_name: str) -> float:
    """The largest value of an 8-bit format that a scale maps a tensor's largest magnitude to."""
    dtype = jnp.dtype(format_name)
    return 127.0 if dtype == jnp.int8 else float(jnp.finfo(dtype).max)


def scale_names(key: str, names: tuple[str, ...], granularity: str) -> tuple[str, ...]:
    """The logical names of the scale of weight `key` (of QUANTIZED_INPUTS) with logical `names`: the weight's
    without its contracted ones (per channel), or only its stacked ones (per tensor)."""
    if granularity == "tensor":
        return tuple(name for name in names if name in STACKED)
    return tuple(name for name in names if name not in QUANTIZED_INPUTS[key])


def _broadcast_shape(key: str, names: tuple[str, ...], shape: tuple[int, ...], granularity: str) -> tuple[int, ...]:
    """The scale's shape with the reduced axes kept as 1 (to broadcast against the weight)."""
    kept = scale_names(key, names, granularity)
    return tuple(size if name in kept else 1 for name, size in zip(names, shape))


def quantize(value: jax.Array, key: str, names: tuple[str, ...], format_name: str,
             granularity: str = "channel") -> tuple[jax.Array, jax.Array]:
    """(values in `format_name`, float32 scale) of weight `key` (`value`, with logical `names`; see the module
    docstring). An all-zero channel gets scale 1."""
    kept = scale_names(key, names, granularity)
    axes = tuple(axis for axis, name in enumerate(names) if name not in kept)
    value32 = value.astype(jnp.float32)
    amax = jnp.max(jnp.abs(value32), axis=axes, keepdims=True)
    scale = jnp.where(amax > 0, amax / largest(format_name), 1.0)
    return to_format(value32 / scale, format_name), jnp.squeeze(scale, axes)


def to_format(value32: jax.Array, format_name: str) -> jax.Array:
    """float32 values already within the format's range, rounded to nearest into `format_name`."""
    if jnp.dtype(format_name) == jnp.int8:
        return jnp.clip(jnp.round(value32), -127, 127).astype(jnp.int8)
    return jnp.clip(value32, -largest(format_name), largest(format_name)).astype(format_name)


def dequantize(weight: Scaled, key: str, names: tuple[str, ...], granularity: str, dtype) -> jax.Array:
    """values * scale of weight `key` in `dtype`, the scale broadcast over the contracted axes (`names`: the
    values' logical names)."""
    shape = _broadcast_shape(key, names, weight.values.shape, granularity)
    return (weight.values.astype(jnp.float32) * weight.scale.reshape(shape)).astype(dtype)


def is_scale(path: str) -> bool:
    return path.endswith(SCALE_SUFFIX)


def held_dtype(path: str, stored, dtype):
    """The dtype inference holds a parameter in (`path`: its name, `stored`: its dtype): the compute `dtype` for
    float weights; 8-bit values and their float32 scales keep theirs."""
    if is_scale(path) or jnp.dtype(stored).itemsize == 1:
        return jnp.dtype(stored)
    return jnp.dtype(dtype)


def held_as_read(params, dtype):
    """`params` (an nnx.State) as inference holds them: float weights in the compute `dtype`, 8-bit weights and their
    scales as stored (`held_dtype`)."""
    def held(path, variable):
        return variable.replace(variable.get_value().astype(held_dtype(path_name(path), variable.dtype, dtype)))

    return jax.tree.map_with_path(held, params, is_leaf=lambda node: isinstance(node, nnx.Variable))


def quantize_cache_entry(x_BSKE: jax.Array, format_name: str) -> tuple[jax.Array, jax.Array]:
    """New keys or values [B, S, K, E] for an 8-bit KV cache: (values [B, S, K, E] in `format_name`, float32 scale
    [B, S, K]), one scale per position and kv head over head_dim, so that each token's head keeps its own range."""
    x32 = x_BSKE.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=-1)
    scale = jnp.where(amax > 0, amax / largest(format_name), 1.0)
    return to_format(x32 / scale[..., None], format_name), scale


OCP_TO_FNUZ = {"float8_e4m3fn": "float8_e4m3fnuz"}
"""The FNUZ format that holds every value of an OCP fp8 format once halved: e4m3fnuz's exponent bias is one more than
e4m3fn's, so x / 2 of every e4m3fn value x is an e4m3fnuz value (e4m3fn's largest, 448, becomes 224 < 240)."""


def ocp_to_fnuz(weight: Scaled) -> Scaled:
    """An e4m3fn weight as e4m3fnuz values with twice the scale, exactly (for chips without OCP fp8: MI300X)."""
    halved = weight.values.astype(jnp.float32) * 0.5
    return Scaled(halved.astype(OCP_TO_FNUZ[weight.values.dtype.name]), weight.scale * 2)
