"""The decoder's projections: a layer's weight as its matmul uses it (`used`, `weight_at_use`: cast and gathered,
fp8 in fp8 training, 8-bit values with their scales), one matmul placed by its output's names (`matmul`, `project`)
and the projections that share an input (`projections`). Where the backend policy asks, one-row projections run on
rows padded with zeros (`_padded_rows`), and decode's projections by 8-bit weights on the weight-only kernel, those
sharing an input in one launch (`weight_only`, `weight_only_group`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from ..hardware.backend import policy_of
from ..sharding.apply import Placement
from .config import ModelConfig
from .quantize import Fp8Weight, Scaled, fp8_einsum, fp8_einsums, fp8_weight, fp8_weights, tensor_scale
from .weight_only import applies as weight_only_applies
from .weight_only_group import grouped_weight_only_matmul


def used(scope: str, c: ModelConfig, placement: Placement, stored: jax.Array, scale: jax.Array | None,
         names: tuple[str, ...], tensor: str) -> jax.Array | Scaled | Fp8Weight:
    """One layer's weight `stored` (named `tensor`, with logical `names`) as its projection uses it under
    `placement` (`weight_at_use`), under the projection's named scope; an 8-bit weight (its float32 `scale` given;
    None for a float weight) gathered in 8 bits, with its scale as stored (`Scaled`)."""
    with jax.named_scope(scope):
        if scale is None:
            return weight_at_use(c, placement, stored, names, tensor)
        return Scaled(placement.weight(stored, names, None, tensor), scale)


def used_together(scope: str, c: ModelConfig, placement: Placement,
                  stored: list[tuple[jax.Array, jax.Array | None, tuple[str, ...], str]]
                  ) -> list[jax.Array | Scaled | Fp8Weight]:
    """The weights (value, scale or None, logical names, tensor name) of projections that share one input, as `used`
    gives each; in fp8 training with one scale for the group (`quantize.fp8_weights`), as the weights joined into
    one GEMM would have."""
    if c.matmul_format:
        with jax.named_scope(scope):
            return fp8_weights(placement, [(value, names, tensor) for value, _, names, tensor in stored],
                               c.matmul_format, c.dtype)
    return [used(scope, c, placement, value, scale, names, tensor) for value, scale, names, tensor in stored]


def weight_at_use(c: ModelConfig, placement: Placement, value: jax.Array, names: tuple[str, ...],
                  tensor: str) -> jax.Array | Fp8Weight:
    """A float weight as its projection uses it (`Placement.weight`: cast to the compute dtype, gathered); in fp8
    training (`c.matmul_format`) its e4m3 values, quantized where it is stored and gathered in 8 bits
    (`quantize.fp8_weight`)."""
    if c.matmul_format:
        return fp8_weight(placement, value, names, c.matmul_format, c.dtype, tensor)
    return placement.weight(value, names, jnp.dtype(c.dtype), tensor)


def values(w: jax.Array | Scaled | Fp8Weight) -> jax.Array:
    """The array a matmul reads of a used weight (an 8-bit weight's values)."""
    return w.values if isinstance(w, (Scaled, Fp8Weight)) else w


def matmul(placement: Placement, subscripts: str, x: jax.Array, w: jax.Array | Scaled | Fp8Weight,
           out: tuple[str, ...], tensor: str, x_scale: jax.Array | None = None) -> jax.Array:
    """`placement.einsum(subscripts, x, w)` placed by `out`; for an 8-bit weight (x @ values) * scale, the values
    converted to x's dtype as the matmul reads them and the scale (over the output's trailing axes, or one number)
    placed as the output is; in fp8 training fp8 GEMMs forward and backward (`quantize.fp8_einsum`; `x_scale`: x's
    e4m3 scale where it was taken before x was typed as a shared input, `fp8_scale`)."""
    if isinstance(w, Fp8Weight):
        return fp8_einsum(placement, subscripts, x, w, out, tensor, x_scale)
    if not isinstance(w, Scaled):
        return placement.einsum(subscripts, x, w, out, tensor)
    y = placement.einsum(subscripts, x, w.values.astype(x.dtype), out, tensor)
    scale = w.scale if w.scale.ndim == 0 else placement.constrain(w.scale, out[len(out) - w.scale.ndim:],
                                                                    f"{tensor} scale")
    return y * scale.astype(y.dtype)


def project(scope: str, subscripts: str, x: jax.Array, w: jax.Array | Scaled | Fp8Weight, out: tuple[str, ...],
            c: ModelConfig, placement: Placement, x_scale: jax.Array | None = None) -> jax.Array:
    """One projection `einsum(subscripts, x, w)` of x [B, S, ...] placed by `out` ([B, S, ...]) under `placement`,
    under the named scope `scope` (`matmul`); on rows padded with zeros where the backend policy pads it
    (`_padded_rows`)."""
    with jax.named_scope(scope):
        implementation = _weight_only_implementation(subscripts, x, w, c, placement)
        if implementation:
            return _weight_only(placement, x, [(subscripts, w, out)], scope, implementation)[0]
        rows = _padded_rows(placement, x, values(w))
        if rows:
            return _padded_matmul(placement, subscripts, x, w, out, scope, rows)
        return matmul(placement, subscripts, x, w, out, scope, x_scale)


def _weight_only_implementation(subscripts: str, x: jax.Array, w, c: ModelConfig, placement: Placement) -> str:
    """The `weight_only` implementation a projection runs on, or "" for `matmul`'s: an 8-bit weight (`Scaled`)
    times a few token rows (decode: B x S up to weight_only.MAX_ROWS), x's trailing axes contracted with w's
    leading ones (`_weight_only_axes`), every operand whole on each device (a weight split over the mesh runs
    `matmul`, whose placement rules hold its collectives), and `c.eight_bit_matmul` (or the backend policy's
    choice) not "xla"."""
    if not isinstance(w, Scaled) or _weight_only_axes(subscripts) is None:
        return ""
    implementation = c.eight_bit_matmul or policy_of(placement.device).eight_bit_matmul
    contracted = int(np.prod(w.values.shape[:x.ndim - 2]))
    if not weight_only_applies(x.shape[0] * x.shape[1], contracted, w.values.size // contracted, implementation):
        return ""
    whole = all(_local_shape(t) == t.shape for t in (x, w.values, w.scale))
    return implementation if whole else ""


def _weight_only_axes(subscripts: str) -> tuple[str, str] | None:
    """(x's contracted letters, w's output letters) of an einsum x [B, S, contracted...] @ w [contracted...,
    out...] -> [B, S, out...] (every decode projection: "bsd,dhe->bshe", "bshe,hed->bsd", ...); None for another
    form."""
    inputs, result = subscripts.replace(" ", "").split("->")
    x_letters, w_letters = inputs.split(",")
    contracted = x_letters[2:]
    if not w_letters.startswith(contracted) or result != x_letters[:2] + w_letters[len(contracted):]:
        return None
    return contracted, w_letters[len(contracted):]


def projections(scope: str, x: jax.Array, projections: list[tuple[str, jax.Array | Scaled | Fp8Weight,
                                                                   tuple[str, ...]]],
                c: ModelConfig, placement: Placement, x_scale: jax.Array | None = None) -> list[jax.Array]:
    """The projections (subscripts, weight, out) of one input x [B, S, ...] under `placement` and the named scope
    `scope`: in fp8 training as one group (`quantize.fp8_einsums`: x and the outputs' gradients each with one
    scale for all of them, as the weights have, `used_together`); where
    every weight is 8-bit and runs on the same weight-only implementation (`_weight_only_implementation`: decode's
    few rows, operands whole on each device) and grouping is asked for (`c.eight_bit_matmul` named, or the backend
    policy's `eight_bit_groups`), all of them in one launch (`_weight_only`: q, k, v or gate, up, each weight read
    in place); otherwise each by `project`."""
    with jax.named_scope(scope):
        if all(isinstance(w, Fp8Weight) for _, w, _ in projections):
            return fp8_einsums(placement, x, projections, scope, x_scale)
        chosen = {_weight_only_implementation(subscripts, x, w, c, placement) for subscripts, w, _ in projections}
        grouped = bool(c.eight_bit_matmul) or policy_of(placement.device).eight_bit_groups
        if grouped and len(projections) > 1 and len(chosen) == 1 and "" not in chosen:
            return _weight_only(placement, x, projections, scope, chosen.pop())
    return [project(scope, subscripts, x, w, out, c, placement, x_scale) for subscripts, w, out in projections]


def _weight_only(placement: Placement, x: jax.Array, projections: list[tuple[str, Scaled, tuple[str, ...]]],
                 scope: str, implementation: str) -> list[jax.Array]:
    """`matmul(subscripts, x, w)` of x [B, S, ...] by each 8-bit weight of `projections` ((subscripts, weight,
    out) sharing x) in one launch of the grouped weight-only kernel (`weight_only_group`): x as [B S, K], each
    weight's values as [K, N] (a reshape of a row-major array, no copy) with its scale per output channel [N] (or
    one number), applied in the kernel's epilogue; each result [B, S, out...] in x's dtype, placed by its `out`.
    Under a layout the operands, whole on each device, enter the kernel as replicated arrays of a shard map (each
    device computes the whole products, as the XLA path would; a shared input's `reduced` type, gradient
    bookkeeping that decode does not use, is dropped there)."""
    B, S = x.shape[:2]
    K = int(np.prod(x.shape[2:]))
    shapes = [w.values.shape[len(_weight_only_axes(subscripts)[0]):] for subscripts, w, _ in projections]

    def local(x, *arrays):
        pairs = [(values.reshape(K, -1), scale if scale.ndim == 0 else scale.reshape(-1))
                 for values, scale in zip(arrays[::2], arrays[1::2])]
        outs = grouped_weight_only_matmul(x.reshape(B * S, K), pairs, implementation, ptx=ptx)
        return tuple(y.reshape(B, S, *shape) for y, shape in zip(outs, shapes))

    ptx = policy_of(placement.device).inline_ptx
    arrays = [t for _, w, _ in projections for t in (w.values, w.scale)]
    if not placement.placed:
        return list(local(x, *arrays))
    whole = PartitionSpec()
    outs = jax.shard_map(local, mesh=placement.mesh, in_specs=(whole,) * (1 + len(arrays)),
                         out_specs=(whole,) * len(projections))(*(placement.placed_as(t, whole) for t in (x, *arrays)))
    return [placement.constrain(y, out, f"{scope} output") for y, (_, _, out) in zip(outs, projections)]


def fp8_scale(c: ModelConfig, placement: Placement, x: jax.Array) -> jax.Array | None:
    """In fp8 training, the e4m3 scale of a projections' input x (`quantize.tensor_scale`), taken before x is
    typed as the shared input of several matmuls (`shared_input`), once for all of them; None otherwise."""
    return tensor_scale(placement, x, c.matmul_format) if c.matmul_format else None


def _padded_rows(placement: Placement, x: jax.Array, w: jax.Array) -> int:
    """The rows the projection of x [B, 1, ...] by w is padded to (`BackendPolicy.pads`: XLA:GPU would run one row
    per device as a multiply and a reduction), or 0 where it runs as it is."""
    if x.shape[1] != 1:
        return 0
    x_local, w_local = _local_shape(x), _local_shape(w)
    policy = policy_of(placement.device)
    pads = x_local[0] == 1 and policy.pads(int(np.prod(x_local)), int(np.prod(w_local)))
    return policy.padded_rows if pads else 0


def _local_shape(x: jax.Array) -> tuple[int, ...]:
    """The shape of the part of x each device holds, read from its type (x's shape outside a mesh)."""
    return jax.typeof(x).sharding.shard_shape(x.shape)


def _padded_matmul(placement: Placement, subscripts: str, x: jax.Array, w: jax.Array | Scaled, out: tuple[str, ...],
                   scope: str, rows: int) -> jax.Array:
    """`einsum(subscripts, x, w)` for x [B, 1, ...], computed on x with zero rows appended ([B, rows, ...]) and the
    first row kept, so that XLA runs a GEMM (`matmul`); the optimization barrier keeps XLA from folding the zero
    rows away. The extra rows cost nothing measurable where the weights' bytes bound the step."""
    padded = jax.lax.optimization_barrier(jnp.pad(x, [(0, 0), (0, rows - 1)] + [(0, 0)] * (x.ndim - 2)))
    return matmul(placement, subscripts, padded, w, out, scope)[:, :1]
