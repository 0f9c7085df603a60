"""8-bit numbers: weights stored in int8 or fp8 with float32 scales, the KV cache likewise, and fp8 matmuls.

A quantized weight is a pair: `values` in the 8-bit format, of the weight's shape and logical names, and `scale`
(float32) over the weight's output channels (the weight's names without the contracted ones, QUANTIZED_INPUTS) or one
per stacked tensor ("tensor": the `layers` and `experts` names only). Both are parameters placed by the layout's
rules for their names, so a scale is split wherever its weight's output channels are and is never gathered with the
values. The product x @ (values * scale) is computed as (x @ values) * scale: the 8-bit values are converted in the
matmul's own fusion and the scale multiplies the output channels, which it commutes with.

fp8 training (`fp8_weight`, `fp8_einsum`) multiplies 8-bit operands: each projection's input and weight in the
chip's e4m3 format and the gradient arriving at its output in e5m2, with current scaling: a float32 scale from this
step's max |x| over the whole logical tensor (`sharding.apply.amax`: the shards' maxima reduced one mesh axis at a
time, inside the GPU first), one number per tensor, so that it commutes with the sums of a contraction split over
devices and every shard of a gathered weight uses the same one. Current scaling needs no state: delayed scaling's
amax history (Flax's `fp8_ops`, MaxText's `fp8` / `nanoo_fp8`) would live in the parameters and be "updated"
through its gradient, which the optimizer, the checkpoints and the layouts' rules would all have to know; a current
scale also follows a loss spike in the same step instead of overflowing the format for the length of the history.
Its cost is a read of each operand for its maximum and a scalar reduction per tensor. The dots take the 8-bit
arrays themselves, which XLA:GPU runs as fp8 GEMMs (cuBLASLt on NVIDIA, hipBLASLt on AMD); XLA:CPU converts them
first. Weights are quantized where they are stored and gathered in 8 bits (`sharding.apply.encoded_weight`).
Every gradient passes straight through the rounding (as if it were exact), and the weights' gradients are summed
in the compute dtype (never in 8 bits: RCCL would add FNUZ values as integers).

Symmetric scales: scale = max |w| over the contracted axes / the format's largest value; values = w / scale,
rounded to nearest (int8 clipped to +-127). fp8 e4m3 keeps 3 mantissa bits, int8 about 7 bits at the channel's
largest weight: int8 is the closer of the two for weights, fp8 the one whose matmuls the chips run natively.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from ..errors import PresetError
from ..hardware.backend import policy_of
from ..hardware.presets import FP8_PAIRS
from ..sharding.apply import Placement, path_name
from . import byte_transpose

WEIGHT_FORMATS = ("int8", "float8_e4m3fn", "float8_e4m3fnuz")
"""The 8-bit formats weights and the KV cache can be stored in (JAX dtype names; `hardware.presets.Chip.formats`
says which a chip computes in)."""
MATMUL_FORMATS = tuple(e4m3 for e4m3, _ in FP8_PAIRS)
"""The e4m3 formats of fp8 training (`ModelConfig.matmul_format`); each one's gradients use its e5m2 partner
(`gradient_format`)."""
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


def gradient_format(format_name: str) -> str:
    """The e5m2 format of the chip whose e4m3 format is `format_name` (presets.FP8_PAIRS): OCP's or FNUZ's."""
    return dict(FP8_PAIRS)[format_name]


def _current_scale(peak: jax.Array, format_name: str, dtype) -> jax.Array:
    """The float32 scale that maps this step's max |x| (`peak`) to the format's largest value, rounded to `dtype` so
    that dequantizing in `dtype` multiplies by the very scale quantizing divided by; 1 for an all-zero tensor."""
    peak = jax.lax.stop_gradient(peak)
    scale = jnp.where(peak > 0, peak / largest(format_name), 1.0)
    return scale.astype(dtype).astype(jnp.float32)


class Fp8Weight(NamedTuple):
    """A weight as an fp8 training matmul uses it (`sharding.apply.encoded_weight`)."""

    values: jax.Array
    """The weight at use in e4m3, gathered in 8 bits, placed (and typed) as `sharding.apply.weight` places it."""
    scale: jax.Array
    """Its float32 current scale, one per tensor (replicated)."""
    anchor: jax.Array
    """The weight at use in the compute dtype, never computed: the matmul's weight gradient returns through it to
    the stored float32 weight, summed over the token axes as `weight` sums it."""


def fp8_weight(placement: Placement, value: jax.Array, names: tuple[str, ...], format_name: str, dtype,
               tensor: str) -> Fp8Weight:
    """Stored weight `value` (logical `names`) as fp8 training's `fp8_einsum` reads it under `placement`: quantized
    to `format_name` where it is stored with its current per-tensor scale, gathered in 8 bits."""
    return fp8_weights(placement, [(value, names, tensor)], format_name, dtype)[0]


def fp8_weights(placement: Placement, stored: list[tuple[jax.Array, tuple[str, ...], str]], format_name: str,
                dtype) -> list[Fp8Weight]:
    """Stored weights (value, logical names, tensor name) that multiply one input (q, k and v; gate and up) as
    `fp8_einsums` reads them: one current scale for the group, max |w| over all of them, so that each weight's 8-bit
    values are those of its part of the weights joined into one (the fused q|k|v of `decoder._qkv`) whatever the
    layout keeps apart; each quantized where it is stored and gathered in 8 bits."""
    peak = functools.reduce(jnp.maximum, [placement.amax(jax.lax.stop_gradient(value.astype(dtype)))
                                          for value, _, _ in stored])
    scale = _current_scale(peak, format_name, dtype)
    return [Fp8Weight(*placement.encoded_weight(value, names, dtype, tensor,
                                                lambda at_rest: (_scaled_into(at_rest, scale, format_name), scale)))
            for value, names, tensor in stored]


def tensor_scale(placement: Placement, x: jax.Array, format_name: str) -> jax.Array:
    """The current scale of x in `format_name`: max |x| over the whole tensor (`Placement.amax`) over the format's
    largest value, float32, replicated, without a gradient (`_current_scale`)."""
    return _current_scale(placement.amax(jax.lax.stop_gradient(x)), format_name, x.dtype)


def _scaled_into(x: jax.Array, scale: jax.Array, format_name: str) -> jax.Array:
    """x / scale rounded into `format_name`."""
    return to_format(x.astype(jnp.float32) / scale, format_name)


def fp8_einsum(placement: Placement, subscripts: str, x: jax.Array, w: Fp8Weight, out: tuple[str, ...], tensor: str,
               x_scale: jax.Array | None = None) -> jax.Array:
    """`placement.einsum(subscripts, x, w)` (placed by `out`) as fp8 GEMMs: the forward reads x in e4m3 (its
    current per-tensor scale, `amax` over the whole tensor) and the weight's e4m3 values; the backward quantizes the
    arriving gradient to the matching e5m2 format (current per-tensor scale) and reads it with the same 8-bit
    operands, the input gradient against the weight's values and the weight gradient against x's. Each GEMM's
    output is in x's dtype, times the product of its operands' scales (one number, so it commutes with every sum
    over a split contraction). The 8-bit operands reach the dots themselves (XLA:GPU runs a dot of 8-bit operands
    as an fp8 GEMM, cuBLASLt / hipBLASLt, and the forward keeps x in 8 bits for the backward); a pattern of
    quantize, convert back and dot is not one: XLA folds the round trip through 8 bits away. Gradients pass
    straight through the rounding (as if exact) and are float in x's dtype. `x_scale`: x's scale
    (`tensor_scale`) where the caller took it, as it must for an x typed `reduced` (a shared input, whose
    maximum no mesh reduction can take)."""
    return fp8_einsums(placement, x, [(subscripts, w, out)], tensor, x_scale)[0]


def fp8_einsums(placement: Placement, x: jax.Array, products: list[tuple[str, Fp8Weight, tuple[str, ...]]],
                tensor: str, x_scale: jax.Array | None = None) -> list[jax.Array]:
    """`fp8_einsum` of each (subscripts, weight, out) of `products` by the one input x, as a group: x quantized
    once, and the gradients arriving at the outputs quantized with one e5m2 scale, max |g| over all of them, as the
    weights share theirs (`fp8_weights`). Each product then equals its columns of one fp8 GEMM of the weights
    joined, forward and backward, so a layout that keeps q, k and v apart (flat_tp copying kv heads) computes the
    numbers of the fused q|k|v GEMM the other layouts and the unsharded model run; x's gradient is the sum of the
    products' input gradients."""
    if x_scale is None:
        x_scale = tensor_scale(placement, x, products[0][1].values.dtype.name)
    subscripts, weights, outs = zip(*products)
    return list(_fp8_einsums(placement, subscripts, tuple(map(tuple, outs)), tensor, x, x_scale,
                             tuple(w.values for w in weights), tuple(w.scale for w in weights),
                             tuple(w.anchor for w in weights)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _fp8_einsums(placement, subscripts, outs, tensor, x, x_scale, values, scales, anchors):
    return _fp8_forward(placement, subscripts, outs, tensor, x, x_scale, values, scales, anchors)[0]


def _fp8_forward(placement, subscripts, outs, tensor, x, x_scale, values, scales, anchors):
    x_q = _scaled_into(x, x_scale, values[0].dtype.name)
    ys = []
    for product, out, w_values, scale in zip(subscripts, outs, values, scales):
        forward_subscripts, forward_values = _contraction_innermost(placement, product, w_values)
        y = placement.einsum(forward_subscripts, x_q, forward_values, out, tensor, preferred_element_type=x.dtype)
        ys.append(y * (x_scale * scale).astype(x.dtype))
    return tuple(ys), (x_q, x_scale, values, scales)


def _contraction_innermost(placement: Placement, subscripts: str, values: jax.Array) -> tuple[str, jax.Array]:
    """(subscripts, weight values) for the forward GEMM: where the backend's policy asks for it
    (`BackendPolicy.byte_transpose`), a weight whose contracted dimensions lead (as every stored weight [in..., out...]
    does) moved so that they come last, by the byte transpose kernel on each device's shard
    (`byte_transpose.transposed`; XLA's transpose where a shard's sides do not tile), so that XLA has no transpose
    left to emit before the GEMM; else as given. The backward reads the weight as stored (the input gradient
    contracts its output dimensions, innermost there)."""
    kind = _byte_transpose_kind(placement)
    inputs, result = subscripts.replace(" ", "").split("->")
    x_letters, w_letters = inputs.split(",")
    contracted = [letter for letter in w_letters if letter in x_letters and letter not in result]
    n = len(contracted)
    spec = jax.typeof(values).sharding.spec if placement.placed else None
    if (not kind or placement.auto or not 0 < n < len(w_letters) or set(w_letters[:n]) != set(contracted)
            or (spec is not None and (spec.reduced or spec.unreduced))):
        return subscripts, values
    moved = w_letters[n:] + w_letters[:n]
    permutation = tuple(range(n, len(w_letters))) + tuple(range(n))

    def local(shard):
        rows, cols = math.prod(shard.shape[:n]), math.prod(shard.shape[n:])
        if not byte_transpose.tile_for(rows, cols):
            return jnp.transpose(shard, permutation)
        flipped = byte_transpose.transposed(shard.reshape(rows, cols), interpret=kind == "interpret")
        return flipped.reshape(tuple(shard.shape[i] for i in permutation))

    if spec is None:
        moved_values = local(values)
    else:
        padded = tuple(spec) + (None,) * (len(w_letters) - len(spec))
        moved_values = jax.shard_map(local, mesh=placement.mesh, in_specs=(spec,),
                                     out_specs=jax.sharding.PartitionSpec(*(padded[i] for i in permutation)),
                                     check_vma=False)(values)
    return f"{x_letters},{moved}->{result}", moved_values


def _byte_transpose_kind(placement: Placement) -> str:
    """"pallas" where the policy of the placement's device moves fp8 weights by the byte transpose kernel, else ""
    (the tests make it "interpret")."""
    return "pallas" if policy_of(placement.device).byte_transpose else ""


def _fp8_backward(placement, subscripts, outs, tensor, residuals, gradients):
    x_q, x_scale, values, scales = residuals
    g_format = gradient_format(values[0].dtype.name)
    peak = functools.reduce(jnp.maximum, [placement.amax(jax.lax.stop_gradient(g)) for g in gradients])
    g_scale = _current_scale(peak, g_format, gradients[0].dtype)
    dx, dws = None, []
    for product, w_values, scale, gradient in zip(subscripts, values, scales, gradients):
        g_q = _scaled_into(gradient, g_scale, g_format)
        inputs, result = product.replace(" ", "").split("->")
        x_letters, w_letters = inputs.split(",")
        dx_part = placement.transposed_einsum(f"{result},{w_letters}->{x_letters}", g_q, w_values, x_q,
                                              g_scale * scale, gradient.dtype)
        dx = dx_part if dx is None else dx + dx_part
        dws.append(placement.transposed_einsum(f"{x_letters},{result}->{w_letters}", x_q, g_q, w_values,
                                               x_scale * g_scale, gradient.dtype))
    return dx, None, (None,) * len(values), (None,) * len(values), tuple(dws)


_fp8_einsums.defvjp(_fp8_forward, _fp8_backward)
