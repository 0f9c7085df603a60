"""Applying a layout: the placement (a layout on a mesh) and its helpers, weights at use, and sharded parameter
creation.

Parameters carry their logical names as the `logical_axes` metadata of an `nnx.Param`; activations pass through
`constrain(x, names)`; matmuls go through `einsum(..., out=names)` so a contraction over a sharded dimension says
where its result lives (all-reduce, or reduce-scatter when `out` shards another dimension over the reduced axis).
Each helper is a method of `Placement`; the module-level functions of the same names apply the placement code is
traced under (`current()`: the one `use_layout`, or a `Jitted` bound to a placement, makes active; `UNPLACED`
outside, where every helper is the identity, so the same model runs unsharded). The library's own steps are handed
their placement instead (`jit(..., ambient=False)`): they enter JAX's mesh alone, and code inside them that asks
for an active layout is refused, so nothing they trace depends on the layout active where they are called.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec, reshard

from ..checks import of_type
from ..errors import ShardingRuleError
from ..hardware.axes import INSIDE_GPU, axes_of, spec_axes
from .collectives import hierarchical_psum, hierarchical_sum
from .layouts import LAYOUTS, Layout, flax_table, get_layout
from .rules import LogicalNames, resolve

LOGICAL_AXES = "logical_axes"
FLAX_METADATA = "out_sharding"
"""Where Flax NNX keeps a variable's logical names (`nnx.with_partitioning`, a layer's `kernel_metadata`)."""


@dataclass(frozen=True)
class Placement:
    """A layout on a mesh: where every array of a traced program goes, and the helpers that place them while the
    program is traced (each an identity for `UNPLACED`, the placement of code run with no layout). Hashable, as
    part of jit's cache key. Model code reaches the placement it is traced under through the module-level helpers
    below (`constrain`, `weight`, `einsum`, ...), which ask `current()`."""

    layout: Layout | None
    mesh: jax.sharding.Mesh | None

    @property
    def placed(self) -> bool:
        """Whether this places anything (False for `UNPLACED`)."""
        return self.layout is not None

    @property
    def auto(self) -> bool:
        """Whether the mesh's axes are Auto: arrays carry no placement in their types and XLA's sharding
        propagation places everything between the constraints (the helpers then constrain, never reshard)."""
        return self.placed and is_auto(self.mesh)

    @property
    def device(self):
        """The device a program traced under this placement compiles for: its mesh's first, else JAX's default."""
        return self.mesh.devices.flat[0] if self.placed else jax.devices()[0]

    @classmethod
    def of(cls, layout: Layout | str, mesh) -> Placement:
        """The placement of `layout` (a Layout or a layout's name) on `mesh`."""
        return cls(get_layout(layout), mesh)

    def activation_spec(self, names: LogicalNames, shape, tensor: str = "activation") -> PartitionSpec | None:
        """The PartitionSpec this layout gives an activation of logical `names` and `shape` on this mesh (None
        unplaced). A batch the layout's batch axes do not divide is refused with how to call `fit_batch`, which
        gives the layout that places it (the commands call it themselves; a layout given here is taken as given)."""
        if not self.placed:
            return None
        try:
            return resolve(names, tuple(shape), self.layout.activations, self.mesh, tensor,
                           f"activation rules of {self.layout.name}")
        except ShardingRuleError as err:
            fix = self._fit_batch_fix(names, shape)
            if not fix:
                raise
            raise ShardingRuleError(f"{err}; {fix}") from err

    def sharding(self, names: LogicalNames, shape, tensor: str = "activation") -> NamedSharding:
        """The NamedSharding of `activation_spec`: where an array placed from the host (a cache, a step's inputs)
        lives, asked of this placement rather than of the active one."""
        return NamedSharding(self.mesh, self.activation_spec(names, shape, tensor))

    def _fit_batch_fix(self, names: LogicalNames, shape) -> str:
        """How to place a batch dimension of `shape` that the layout's batch axes do not divide (`fit_batch`), or
        "" where every batch dimension divides."""
        for name, size in zip(names, shape):
            axes = self.layout.activations.lookup(name)[1] if name in ("batch", "attn_batch") else ()
            if not set(axes) <= set(self.mesh.shape):
                return ""  # a mesh without the layout's axes: the resolver's error says so
            if axes and size % math.prod(self.mesh.shape[axis] for axis in axes):
                layout = repr(self.layout.name) if self.layout.name in LAYOUTS else "layout"
                return (f"or fit the layout to a batch of {size}, as the starscream commands do: "
                        f"use_layout(fit_batch({layout}, mesh, batch={size}, positions=P), mesh), P the tokens per "
                        "sequence (1 in decode; None in a prefill, whose prompt is padded to the parts); fit_batch "
                        "is starscream_jax.fit_batch (docs/any_batch.md)")
        return ""

    def constrain(self, x: jax.Array, names: LogicalNames, tensor: str = "activation") -> jax.Array:
        """Reshards activation `x` to this layout's placement of its logical `names` (identity unplaced)."""
        spec = self.activation_spec(names, x.shape, tensor)
        return x if spec is None else self.placed_as(x, spec)

    def placed_as(self, x: jax.Array, spec: PartitionSpec) -> jax.Array:
        """`x` placed by `spec` on this mesh: resharded on Explicit axes, a sharding constraint on Auto axes."""
        if self.auto:
            return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))
        return reshard(x, spec)

    def weight_spec(self, names: LogicalNames, shape, tensor: str = "weight") -> PartitionSpec:
        """The PartitionSpec the layout's `weights` rules give a weight of `shape` as a matmul uses it."""
        return resolve(names, tuple(shape), self.layout.weights, self.mesh, tensor,
                       f"weight rules of {self.layout.name}")

    def weight(self, value: jax.Array, names: LogicalNames, dtype=None, tensor: str = "weight",
               summed_over: frozenset[str] | None = None) -> jax.Array:
        """A weight as a matmul uses it: cast to `dtype` first (fewer bytes to move), then resharded from its stored
        placement to the layout's `weights` rules (an all-gather inside the GPU under starscream_tp).

        Its gradient is a sum over the mesh axes that split the tokens (the layout's `batch` and `seq` axes). When
        those split the tokens both inside GPUs (xcd) and across them (data), the sum runs in two stages: a
        reduce-scatter inside each GPU into the stored placement, then an all-reduce of that shard (1/xcd of the
        bytes) across GPUs, where XLA would run one all-reduce over both levels at once. Otherwise XLA's one
        reduction stays on one level. `summed_over` replaces the token axes where the gradient also sums over other
        axes (a per-head scale applied to heads split over GPUs).
        """
        if dtype is not None:
            value = value.astype(dtype)
        move = self._move(value, names, tensor, summed_over)
        if move.mesh is None and not move.summed_over:
            return value if move.use is None else reshard(value, move.use)
        return _at_use(value, move)

    def placed_at_use(self, value: jax.Array, names: LogicalNames, tensor: str = "parameter") -> jax.Array:
        """`value` resharded to where the layout's `weights` rules place it, its gradient summed as XLA sums it (a
        parameter an elementwise op reads, which a weight typed for `weight`'s two-stage reduction cannot enter)."""
        use = self._move(value, names, tensor, None).use
        return value if use is None else reshard(value, use)

    def read_at_use(self, value: jax.Array, names: LogicalNames, tensor: str = "weight") -> jax.Array:
        """`weight(value, names)` for a parameter read by code that never calls `weight` (Flax's own layers,
        through `at_use.ParamAtUse`). On Auto axes, where the gradient's sum over the token axes the weight at use
        does not split stays on one level (inside GPUs, or across them), it is first placed as the weight is used,
        then as stored: a lookup's gradient (the scatter-add of `nnx.Embed`'s gather, tokens over `xcd`, the
        table's vocabulary over `gpu`) is then summed inside each GPU, where XLA, asked for the stored placement
        straight away, moved rows between partitions of different GPUs (a flat collective-permute). Where that sum
        spans both levels (starscream_fsdp's tokens over `gpu` and `xcd`) the sum whole would be one flat
        all-reduce, so the gradient goes straight to its stored placement, as `weight` sends it."""
        move = self._move(value, names, tensor, None)
        if move.mesh is None:
            return self.weight(value, names, tensor=tensor)
        summed = self._token_axes() - spec_axes(move.use)
        return _at_use(value, dataclasses.replace(move, via_use=not _inside_and_across_gpus(summed, move.mesh)))

    def encoded_weight(self, value: jax.Array, names: LogicalNames, dtype, tensor: str,
                       encode: Callable[[jax.Array], tuple[jax.Array, jax.Array]]
                       ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """A weight as a matmul that reads its encoded form uses it (fp8 training's `quantize.fp8_einsum`):
        `encode`d where it is stored (value in `dtype` -> its values and a replicated scale), then (the encoded
        values at use, moved in that form and typed as `weight` types its result; the scale; the weight at use in
        `dtype` as `weight` returns it, the anchor through which the matmul's weight gradient returns to the stored
        weight, summed as `weight` sums it). Neither the values nor the scale carry a gradient, and the anchor's
        value is never read, so XLA computes no float copy of the weight at use."""
        value = value.astype(dtype)
        move = self._move(value, names, tensor, None)
        values, scale = encode(jax.lax.stop_gradient(value))
        return move.typed(move.placed(values)), scale, _at_use(value, move)

    def _move(self, value: jax.Array, names: LogicalNames, tensor: str, summed_over: frozenset[str] | None) -> _Move:
        """The way of a stored weight `value` to its use under this layout (see `weight`)."""
        if not self.placed:
            return _Move()
        spec = self.weight_spec(names, value.shape, tensor)
        if self.auto:
            stored = resolve(names, value.shape, self.layout.params, self.mesh, tensor,
                             f"param rules of {self.layout.name}")
            return _Move(use=spec, stored=stored, mesh=self.mesh)
        summed_over = (self._token_axes() if summed_over is None else summed_over) - spec_axes(spec)
        if not _inside_and_across_gpus(summed_over, self.mesh):
            summed_over = frozenset()
        return _Move(use=spec, stored=jax.typeof(value).sharding.spec, summed_over=summed_over)

    def _token_axes(self) -> frozenset[str]:
        """The mesh axes that split the tokens (batch or sequence) under this layout."""
        return frozenset(axis for name in ("batch", "seq") for axis in self.layout.activations.lookup(name)[1])

    def amax(self, x: jax.Array) -> jax.Array:
        """max |x| over the whole logical array x, a float32 scalar on every device. Under an Explicit layout each
        device takes its shard's maximum and the maxima are reduced over every mesh axis that splits x, one axis at
        a time, inside the GPU first (`hierarchical_psum`), so no reduction spans both levels (XLA drops those over
        an axis of one device, which the shard's type still varies over); on Auto axes XLA places the reduction."""
        def local(shard):
            return jnp.max(jnp.abs(shard)).astype(jnp.float32)

        if not self.placed or self.auto:
            return local(x)
        spec = jax.typeof(x).sharding.spec
        axes = tuple(spec_axes(spec))
        if not axes:
            return local(x)
        return jax.shard_map(lambda shard: hierarchical_psum(local(shard), axes, jax.lax.pmax), in_specs=(spec,),
                             out_specs=PartitionSpec())(x)

    def shared_input(self, x: jax.Array, used_by: list[jax.Array]) -> jax.Array:
        """`x` as the common input of several matmuls with the weights `used_by` (as `weight` returned them),
        marked so that its gradient is summed over the mesh once, not once per matmul.

        When every weight splits an output dimension (heads, mlp) over mesh axes that `x` is replicated on, each
        matmul's input gradient is a partial sum over those axes. Typed `reduced` there, `x` receives them
        unreduced; autodiff adds them locally and one all-reduce (or reduce-scatter) sums the total, where XLA would
        reduce each matmul's gradient on its own (q, k and v: three times the bytes). Identity unplaced, where the
        weights do not all split the same axes (kv heads fewer than the partitions the query heads are split over),
        and on Auto axes (XLA's propagation chooses the reductions there)."""
        if not self.placed or self.auto:
            return x
        spec = jax.typeof(x).sharding.spec
        split = {spec_axes(jax.typeof(w).sharding.spec) - spec_axes(spec) for w in used_by}
        if len(split) != 1 or not (axes := split.pop()):
            return x
        return _summed_once(x, spec, axes)

    def scale(self, x: jax.Array, value: jax.Array, names: LogicalNames, tensor: str = "scale") -> jax.Array:
        """x [..., *value.shape] times the weight `value` (a norm scale [D], or [N, E]), the weight used as `weight`
        places it, its gradient summed over the mesh axes that split x's leading dimensions. A weight typed
        `reduced` is taken only by dot_general, so it multiplies through an einsum, which XLA compiles back into an
        elementwise multiply. Leading dimensions of size 1 of `value` (a [1, S, D] table) broadcast."""
        value, names = _trailing(x, value, names, tensor)
        if not self.placed:
            return x * value
        if self.auto:
            return x * self.weight(value, names, tensor=tensor)
        leading = jax.typeof(x).sharding.spec[:x.ndim - value.ndim]
        used = self.weight(value, names, tensor=tensor,
                           summed_over=frozenset(a for entry in leading for a in axes_of(entry)))
        if not jax.typeof(used).sharding.spec.reduced:
            return x * used
        letters = "abcdefgh"[:value.ndim]
        return jnp.einsum(f"...{letters},{letters}->...{letters}", x, used, precision=jax.lax.Precision.HIGHEST)

    def shift(self, x: jax.Array, value: jax.Array, names: LogicalNames, tensor: str = "shift") -> jax.Array:
        """x [..., *value.shape] plus the parameter `value` (a bias, a learned position table, a class token's
        offset), placed as `scale` places a weight it multiplies by: x + 1 * value through `scale`, so its gradient
        is summed over x's token axes as a matmul weight's is. A parameter read raw (stored split where x is whole)
        or through `weight` (typed for the two-stage reduction) cannot enter an elementwise op on an Explicit
        mesh."""
        value, names = _trailing(x, value, names, tensor)
        if not self.placed:
            return x + value
        return x + self.scale(jnp.ones_like(x), value, names, tensor)

    def token_mean(self, x: jax.Array, names: LogicalNames, tensor: str = "token mean") -> jax.Array:
        """The mean of `x` [B, ...], a value per token placed by the logical `names` (batch first).

        When the tokens (the batch, the sequence or both) are split both inside GPUs and across them, each device
        sums its own tokens and the sums are added over the partitions of each GPU first, then across GPUs
        (`hierarchical_psum` of one scalar); `jnp.mean` would reduce in groups that span both levels.
        """
        spec = self.activation_spec(names, x.shape, tensor)
        if spec is None or self.auto or not _inside_and_across_gpus(spec_axes(spec), self.mesh):
            return jnp.mean(x)
        return hierarchical_sum(self.placed_as(x, spec), spec, self.mesh, tuple(range(x.ndim))) / x.size

    def einsum(self, subscripts: str, lhs: jax.Array, rhs: jax.Array, out: LogicalNames, tensor: str = "einsum",
               preferred_element_type=None) -> jax.Array:
        """`jnp.einsum` (explicit "...->..." form) whose result is placed by the layout's rule for the logical
        names `out`: a contraction over a sharded dimension all-reduces, or reduce-scatters when `out` shards
        another dimension over the reduced axis. `preferred_element_type`: the result's dtype (that of 8-bit
        operands' GEMMs).

        A reduce-scatter whose result is copied over some mesh axis (kv heads fewer than the GPUs: the k and v
        projections' results are whole on every GPU) is written as the product summed in place, then scattered
        (`_scattered_axes`): left to choose, XLA splits such a product's rows over the idle axis and sends each
        block to its owner by collective-permutes between partitions of different GPUs at different partition
        indices (flat)."""
        if not isinstance(subscripts, str) or subscripts.count("->") != 1:
            raise ShardingRuleError(f"einsum {subscripts!r}: give the explicit form, inputs -> result (such as "
                                    "'bd,df->bf'): the result's logical names place it")
        inputs, result = subscripts.replace(" ", "").split("->")
        sizes = {}
        for letters, operand in zip(inputs.split(","), (lhs, rhs)):
            sizes.update(zip(letters, operand.shape))
        shape = tuple(sizes[letter] for letter in result)
        spec = self.activation_spec(out, shape, tensor)
        if spec is not None and self.auto:
            return self.placed_as(jnp.einsum(subscripts, lhs, rhs, preferred_element_type=preferred_element_type),
                                  spec)
        scattered = self._scattered_axes(inputs, result, (lhs, rhs), spec)
        if not scattered:
            return jnp.einsum(subscripts, lhs, rhs, out_sharding=spec, preferred_element_type=preferred_element_type)
        kept = [tuple(axis for axis in axes_of(entry) if axis not in scattered) for entry in spec.partitions]
        summed = PartitionSpec(*(axes or None for axes in kept), unreduced=scattered)
        return reshard(jnp.einsum(subscripts, lhs, rhs, out_sharding=summed,
                                  preferred_element_type=preferred_element_type), spec)

    def _scattered_axes(self, inputs: str, result: str, operands, spec: PartitionSpec | None) -> frozenset[str]:
        """The mesh axes an einsum (`inputs` -> `result` letters) reduce-scatters over: those that split a
        contracted dimension of both operands and a dimension of the result `spec`; empty unless the result is also
        whole over some other mesh axis of more than one device (the case `einsum` writes out), or an operand is
        typed reduced."""
        if spec is None:
            return frozenset()
        contracted = set(inputs.replace(",", "")) - set(result)
        split = []
        for letters, operand in zip(inputs.split(","), operands):
            operand_spec = jax.typeof(operand).sharding.spec
            if operand_spec.reduced or operand_spec.unreduced:
                return frozenset()
            entries = (*operand_spec.partitions, *(None,) * (len(letters) - len(operand_spec.partitions)))
            split.append({axis for letter, entry in zip(letters, entries) if letter in contracted
                          for axis in axes_of(entry)})
        copied = [axis for axis in self.mesh.axis_names if self.mesh.shape[axis] > 1 and axis not in spec_axes(spec)]
        return frozenset(split[0] & split[1] & spec_axes(spec)) if copied else frozenset()

    def transposed_einsum(self, subscripts: str, lhs: jax.Array, rhs: jax.Array, like: jax.Array,
                          scale: jax.Array, dtype) -> jax.Array:
        """`jnp.einsum(subscripts, lhs, rhs)` in `dtype`, times the replicated scalar `scale`: the gradient of an
        operand of another matmul (a hand-written transpose: fp8 training's `quantize.fp8_einsum`), placed as
        `like` (an array typed as that operand) and unreduced over the axes `like` is typed reduced over, as
        autodiff's own transpose leaves that gradient (a split contraction otherwise sums here). Placed by XLA on
        Auto axes and unplaced."""
        if not self.placed or self.auto:
            return jnp.einsum(subscripts, lhs, rhs, preferred_element_type=dtype) * scale.astype(dtype)
        spec = jax.typeof(like).sharding.spec
        product = jnp.einsum(subscripts, lhs, rhs, preferred_element_type=dtype,
                             out_sharding=spec.update(reduced=frozenset(), unreduced=spec.reduced))
        if spec.reduced:  # an unreduced product scales by a scalar typed reduced over the same axes
            scale = reshard(scale, PartitionSpec(reduced=spec.reduced))
        return product * scale.astype(dtype)


UNPLACED = Placement(None, None)
"""The placement of code traced with no layout: every helper is the identity."""

_ACTIVE = jax.make_user_context(None)
"""The active Placement (None outside `use_layout`; `_HANDED` inside a step handed its placement): a JAX user
context, so its value is part of the cache key of every jitted function, and a function traced under one layout is
traced again under another."""


class _Handed:
    """The value of `_ACTIVE` while a step bound with `jit(..., ambient=False)` traces: its code is handed its
    placement, so asking for an active one (`current()`, `active()`) is refused."""

    def __repr__(self) -> str:
        return "handed"


_HANDED = _Handed()


def is_auto(mesh: jax.sharding.Mesh) -> bool:
    """True for a mesh whose axes are all Auto, False for all Explicit; a mix is an error."""
    types = set(mesh.axis_types)
    if types == {AxisType.Auto}:
        return True
    if types == {AxisType.Explicit}:
        return False
    raise ShardingRuleError(f"mesh axes {mesh.axis_names} are of types {[t.name for t in mesh.axis_types]}; a layout "
                            "needs them all Explicit (build_mesh) or all Auto (auto_axes(mesh))")


@contextlib.contextmanager
def use_layout(layout: Layout | str, mesh):
    """Makes `layout` on `mesh` the active layout (and `mesh` JAX's mesh) for code traced inside the block.

    On a mesh with Auto axes (`auto_axes(mesh)`, for models written for Flax's GSPMD guide) the layout is also
    installed as Flax's logical-axis rules (`nnx.logical_axis_rules`, which Linen's `nn.with_logical_constraint` and
    `nn.logical_axis_rules` share): the layout's weights-at-use and activation tables in one (`flax_table(layout,
    "use")`, every name of the layout's tables, yours too after `in_vocabulary`), so each logical constraint of the
    model places its activation as the layout does; parameters are placed at rest by `create_sharded`.

    The active layout is part of jit's cache key: a function jitted once (`jax.jit`, `nnx.jit`) and called under
    two layouts is traced, lowered and compiled once for each. To bind a function to one layout whatever is active
    where it is called, jit it with `jit(fn, under=Placement.of(layout, mesh))`."""
    of_type(mesh, Mesh, "mesh", "a jax.sharding.Mesh, as starscream_jax.build_mesh gives", ShardingRuleError)
    current = Placement.of(layout, mesh)
    with contextlib.ExitStack() as stack:
        stack.enter_context(_ACTIVE(current))
        stack.enter_context(jax.set_mesh(mesh))
        if current.auto:
            stack.enter_context(nnx.logical_axis_rules(flax_table(current.layout, "use")))
        try:
            yield
        except Exception as err:
            if (type(err).__name__ != ELEMENTWISE_TYPE_ERROR or current.auto
                    or not any(sign in str(err) for sign in ELEMENTWISE_SIGNS)):
                raise
            raise ShardingRuleError(f"{str(err).strip().splitlines()[0]}; {ELEMENTWISE_FIX}") from err


ELEMENTWISE_TYPE_ERROR = "ShardingTypeError"
"""The class name of the error JAX raises where the operands of one op are placed incompatibly (private in JAX)."""
ELEMENTWISE_SIGNS = ("produces an illegally sharded result", "another input is reduced on")
"""What JAX says where an elementwise op meets operands placed apart (a parameter stored split where the activation
is whole) or an operand typed `reduced` (a parameter read through `weight`); other sharding errors pass as JAX's."""
ELEMENTWISE_FIX = (
    "where an operand is a parameter read in an elementwise op (x + self.pos[...], x * self.gain[...]), read it "
    "through starscream_jax.shift(x, value, names) for a sum or starscream_jax.scale(x, value, names) for a product, "
    "which place it as x is placed and sum its gradient over x's tokens (in a model of Flax's layers, "
    "weights_at_use(model) in the loss places each such parameter so); a parameter read raw keeps its stored "
    "placement and one read through weight() is typed for a matmul (einsum) only (docs/your_model.md)")


@contextlib.contextmanager
def placed(under: Placement | None, ambient: bool = True):
    """`use_layout(under.layout, under.mesh)`, or for None no layout at all (code traced inside runs unsharded).
    With `ambient=False`, for code handed its placement: JAX's mesh alone, and no active layout to ask for."""
    if not ambient:
        with _ACTIVE(_HANDED), (jax.set_mesh(under.mesh) if under is not None else contextlib.nullcontext()):
            yield
    elif under is None:
        with _ACTIVE(None):
            yield
    else:
        with use_layout(under.layout, under.mesh):
            yield


class Jitted:
    """`jax.jit(fn, **options)` bound to the placement `under`: calling, tracing and lowering it always trace `fn`
    under that placement (None: no layout), whichever layout is active at the call.

    `ambient=True` (for your own functions) makes `under` the active layout while `fn` traces, as `use_layout`
    does, so the module-level helpers and Flax's logical rules inside place by it. `ambient=False` (the library's
    steps, which hand `under` to every function that places) sets JAX's mesh alone: code inside that asks for an
    active layout is refused (`current()`), so no read of ambient state can slip into a step, and the layout active
    where the step is called is not part of its cache key."""

    def __init__(self, fn, under: Placement | None, ambient: bool = True, **options):
        if not isinstance(ambient, bool):
            raise ShardingRuleError(f"ambient={ambient!r}: pass True (the placement active while fn traces) or False "
                                    "(fn is handed its placement)")
        self.under = under
        self.ambient = ambient
        self._jitted = jax.jit(fn, **options)
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        with placed(self.under, self.ambient):
            return self._jitted(*args, **kwargs)

    def trace(self, *args, **kwargs):
        with placed(self.under, self.ambient):
            return self._jitted.trace(*args, **kwargs)

    def lower(self, *args, **kwargs):
        with placed(self.under, self.ambient):
            return self._jitted.lower(*args, **kwargs)


def jit(fn=None, *, under: Placement | None, ambient: bool = True, **options):
    """`fn` jitted (`jax.jit` options) and bound to the placement `under` (`Jitted`, which says what `ambient`
    does); as a decorator, `@jit(under=Placement.of("starscream_tp", mesh))`."""
    if under is not None and not isinstance(under, Placement):
        raise ShardingRuleError(f"jit(under={under!r}): expected a Placement; pass under=Placement.of(layout, mesh), "
                                "or None for a step that runs unplaced")
    if fn is None:
        return functools.partial(jit, under=under, ambient=ambient, **options)
    return Jitted(fn, under, ambient, **options)


def active() -> Placement | None:
    """The active layout and mesh, or None outside `use_layout`. Refused inside a step handed its placement."""
    value = _ACTIVE.value
    if value is _HANDED:
        raise ShardingRuleError("code traced inside a step that is handed its placement asked for the active layout; "
                                "pass it the step's placement (placement=..., or device=placement.device)")
    return value


def current() -> Placement:
    """The placement code traced now is placed by: the active one, or `UNPLACED` outside `use_layout` (refused
    inside a step handed its placement, as `active()` is)."""
    return active() or UNPLACED


def placed_by(placement: Placement | None) -> Placement:
    """The placement a model function runs under: the one it was handed (the library's steps hand theirs), or
    `current()` for None (your own call under `use_layout`). Anything else is refused in one line."""
    if placement is None:
        return current()
    if not isinstance(placement, Placement):
        raise ShardingRuleError(f"placement {placement!r} is not a Placement; pass Placement.of(layout, mesh), or "
                                "leave it out inside use_layout(layout, mesh)")
    return placement


def placed_explicitly(x: jax.Array) -> bool:
    """Whether `x`'s type carries its placement: traced on a mesh whose axes are Explicit (False outside a mesh and
    on Auto axes, where XLA's propagation places it). Read from the array, not from the active layout."""
    mesh = jax.typeof(x).sharding.mesh
    return not mesh.empty and AxisType.Explicit in mesh.axis_types


def compute_device():
    """The device a traced computation compiles for (`Placement.device` of `current()`)."""
    return current().device


def activation_spec(names: LogicalNames, shape, tensor: str = "activation") -> PartitionSpec | None:
    """The PartitionSpec the active layout gives an activation (`Placement.activation_spec`), or None outside
    `use_layout`: the form traced model code reads."""
    return current().activation_spec(names, shape, tensor)


def constrain(x: jax.Array, names: LogicalNames, tensor: str = "activation") -> jax.Array:
    """`Placement.constrain` under `current()`: identity outside `use_layout`."""
    return current().constrain(x, names, tensor)


def placed_as(x: jax.Array, spec: PartitionSpec) -> jax.Array:
    """`Placement.placed_as` under the active layout."""
    return current().placed_as(x, spec)


def weight_spec(names: LogicalNames, shape, tensor: str = "weight") -> PartitionSpec:
    """`Placement.weight_spec` under the active layout."""
    return current().weight_spec(names, shape, tensor)


def weight(value: jax.Array, names: LogicalNames, dtype=None, tensor: str = "weight",
           summed_over: frozenset[str] | None = None) -> jax.Array:
    """`Placement.weight` under `current()`: a weight as a matmul uses it (only cast outside `use_layout`)."""
    return current().weight(value, names, dtype, tensor, summed_over)


def read_at_use(value: jax.Array, names: LogicalNames, tensor: str = "weight") -> jax.Array:
    """`Placement.read_at_use` under `current()`."""
    return current().read_at_use(value, names, tensor)


def encoded_weight(value: jax.Array, names: LogicalNames, dtype, tensor: str,
                   encode: Callable[[jax.Array], tuple[jax.Array, jax.Array]]
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`Placement.encoded_weight` under `current()`."""
    return current().encoded_weight(value, names, dtype, tensor, encode)


def amax(x: jax.Array) -> jax.Array:
    """`Placement.amax` under `current()`: max |x| over the whole logical array, reduced one level at a time."""
    return current().amax(x)


def shared_input(x: jax.Array, used_by: list[jax.Array]) -> jax.Array:
    """`Placement.shared_input` under `current()`."""
    return current().shared_input(x, used_by)


def scale(x: jax.Array, value: jax.Array, names: LogicalNames, tensor: str = "scale") -> jax.Array:
    """`Placement.scale` under `current()`: x times a parameter read elementwise (x * value outside `use_layout`)."""
    return current().scale(x, value, names, tensor)


def shift(x: jax.Array, value: jax.Array, names: LogicalNames, tensor: str = "shift") -> jax.Array:
    """`Placement.shift` under `current()`: x plus a parameter read elementwise (x + value outside `use_layout`)."""
    return current().shift(x, value, names, tensor)


def _trailing(x: jax.Array, value: jax.Array, names: LogicalNames, tensor: str) -> tuple[jax.Array, LogicalNames]:
    """`value` and its `names` without leading dimensions of size 1, broadcast to x's trailing dimensions (as `x +
    value` broadcasts it; refused where it does not broadcast)."""
    names = tuple(names) if not isinstance(names, str) else names
    if isinstance(names, str) or len(names) != jnp.ndim(value):
        raise ShardingRuleError(f"{tensor} {tuple(jnp.shape(value))} given logical names {names!r}; give a tuple of "
                                f"{jnp.ndim(value)} names, one a dimension")
    lead = 0
    while lead < jnp.ndim(value) and value.shape[lead] == 1 and jnp.ndim(value) - lead > 1:
        lead += 1
    value, names = value.reshape(value.shape[lead:]), names[lead:]
    trailing = tuple(x.shape[x.ndim - value.ndim:])
    if value.ndim > x.ndim or any(size not in (1, used) for size, used in zip(value.shape, trailing)):
        raise ShardingRuleError(f"{tensor} {tuple(value.shape)} does not broadcast to the trailing dimensions of x "
                                f"{tuple(x.shape)}; slice or reshape it to x's last {value.ndim} dimensions first")
    return (value if tuple(value.shape) == trailing else jnp.broadcast_to(value, trailing)), names


def token_mean(x: jax.Array, names: LogicalNames, tensor: str = "token mean") -> jax.Array:
    """`Placement.token_mean` under `current()`."""
    return current().token_mean(x, names, tensor)


def einsum(subscripts: str, lhs: jax.Array, rhs: jax.Array, out: LogicalNames, tensor: str = "einsum",
           preferred_element_type=None) -> jax.Array:
    """`Placement.einsum` under `current()`: the result placed by the layout's rule for `out`."""
    return current().einsum(subscripts, lhs, rhs, out, tensor, preferred_element_type)


def transposed_einsum(subscripts: str, lhs: jax.Array, rhs: jax.Array, like: jax.Array, scale: jax.Array,
                      dtype) -> jax.Array:
    """`Placement.transposed_einsum` under `current()`."""
    return current().transposed_einsum(subscripts, lhs, rhs, like, scale, dtype)


@dataclass(frozen=True, kw_only=True)
class _Move:
    """A weight's way from its stored placement to its placement at use, and its gradient's way back. `use` None:
    no layout (identity). `mesh` given: Auto axes (sharding constraints; the gradient is constrained to the stored
    placement, so XLA sums it straight into the stored shards, a reduce-scatter inside the GPU, rather than whole).
    `summed_over` non-empty: the used weight is typed `reduced` there, so its gradient arrives unreduced (each device
    holding its tokens' share) and `backward` sums it in two stages (see `weight`)."""

    use: PartitionSpec | None = None
    stored: PartitionSpec | None = None
    summed_over: frozenset[str] = frozenset()
    mesh: Mesh | None = None
    via_use: bool = False
    """Auto axes: the gradient is constrained to the placement at use before the stored one (`read_at_use`)."""

    def placed(self, x: jax.Array) -> jax.Array:
        if self.use is None:
            return x
        if self.mesh is not None:
            return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, self.use))
        return reshard(x, self.use)

    def typed(self, x: jax.Array) -> jax.Array:
        """x (placed at use) typed as reduced over `summed_over` (a change of type only)."""
        return reshard(x, self.use.update(reduced=self.summed_over)) if self.summed_over else x

    def backward(self, gradient: jax.Array) -> jax.Array:
        """The gradient at use -> placed like the stored weight: for `summed_over`, first summed over the token axes
        inside a GPU and those the stored spec splits (a reduce-scatter, or an all-reduce for a weight not split
        there), then the result over the others (an all-reduce across GPUs)."""
        if self.use is None:
            return gradient
        if self.mesh is not None:
            if self.via_use:
                gradient = jax.lax.with_sharding_constraint(gradient, NamedSharding(self.mesh, self.use))
            return jax.lax.with_sharding_constraint(gradient, NamedSharding(self.mesh, self.stored))
        if not self.summed_over:
            return reshard(gradient, self.stored)
        across_gpus = self.summed_over - spec_axes(self.stored) - {INSIDE_GPU}
        return reshard(reshard(gradient, self.stored.update(unreduced=across_gpus)), self.stored)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _at_use(value, move: _Move):
    """`value` moved to its use (`_Move`); the gradient `move.backward`."""
    return move.typed(move.placed(value))


def _at_use_forward(value, move):
    return _at_use(value, move), None


def _at_use_gradient(move, _, gradient):
    return (move.backward(gradient),)


_at_use.defvjp(_at_use_forward, _at_use_gradient)


def _inside_and_across_gpus(axes: frozenset[str], mesh) -> bool:
    """Whether the mesh `axes` split over the partitions of a GPU and over several GPUs (sizes above one)."""
    splitting = {axis for axis in axes if mesh.shape[axis] > 1}
    return INSIDE_GPU in splitting and len(splitting) > 1


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _summed_once(x, spec: PartitionSpec, axes: frozenset[str]):
    """`x` (placed by `spec`) typed as reduced over `axes`; its gradient is summed there once."""
    return reshard(x, spec.update(reduced=axes))


def _summed_once_forward(x, spec, axes):
    return _summed_once(x, spec, axes), None


def _summed_once_gradient(spec, axes, _, gradient):
    return (reshard(gradient, spec),)


_summed_once.defvjp(_summed_once_forward, _summed_once_gradient)


def param(value: jax.Array, names: LogicalNames) -> nnx.Param:
    """An nnx.Param carrying its logical axis names."""
    if isinstance(names, str) or len(names) != value.ndim:
        raise ShardingRuleError(f"parameter of shape {value.shape} given logical names {names!r}; give a tuple of "
                                f"{value.ndim} names, one a dimension (None for one never split)")
    return nnx.Param(value, **{LOGICAL_AXES: tuple(names)})


def path_name(path) -> str:
    return "/".join(str(getattr(p, "key", p)) for p in path)


def logical_names(variable) -> LogicalNames | None:
    """A variable's logical names: this library's `logical_axes` metadata, else Flax's `out_sharding`; None for an
    unnamed variable (or a plain array)."""
    if not hasattr(variable, "get_metadata"):
        return None
    names = variable.get_metadata(LOGICAL_AXES, None)
    if names is None:
        names = variable.get_metadata(FLAX_METADATA, None)
    return None if names is None else tuple(names)


def param_specs(state: nnx.State, layout: Layout | str, mesh) -> nnx.State:
    """PartitionSpec of every variable in `state` under the layout's `params` rules (optimizer state included).

    Logical names are read from `logical_axes` (`param`) or Flax's `out_sharding` metadata (`logical_names`).
    Variables without logical names are scalars (step counters); anything else unnamed is an error, because an
    unnamed tensor would be silently replicated.
    """
    layout = get_layout(layout)

    def spec_of(path, variable):
        names = logical_names(variable)
        shape = getattr(variable, "shape", None) or jnp.shape(variable.get_value() if hasattr(variable, "get_value")
                                                              else variable)
        if names is None:
            if len(shape) == 0:
                return PartitionSpec()
            raise ShardingRuleError(f"{path_name(path)} {tuple(shape)} has no logical axis names; {_naming(variable)}")
        return resolve(names, tuple(shape), layout.params, mesh, path_name(path), f"param rules of {layout.name}")

    return jax.tree.map_with_path(spec_of, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _naming(variable) -> str:
    """How to give `variable` logical names: a parameter at its creation; another variable (a layer's statistics,
    such as `nnx.BatchNorm`'s mean and var, which the layer takes no metadata for) once created."""
    if isinstance(variable, nnx.Variable) and not isinstance(variable, nnx.Param):
        return (f"name this {type(variable).__name__} once its layer is created, in the model's constructor: "
                "variable.set_metadata(out_sharding=names)")
    return "create it with starscream_jax.param(value, names) or nnx.with_partitioning(init, names)"


def param_shardings(state: nnx.State, layout: Layout | str, mesh) -> nnx.State:
    """NamedSharding of every variable in `state` (see `param_specs`)."""
    specs = param_specs(state, layout, mesh)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def abstract_placed(state: nnx.State, layout: Layout | str, mesh, dtype=None) -> nnx.State:
    """`state` (parameters or optimizer state, arrays or abstract values) with each array a ShapeDtypeStruct
    carrying the layout's params sharding (`param_shardings`), cast to `dtype` when given; Variables keep their
    metadata. What a step compiled before any array exists takes."""

    def abstract(sharding, node):
        if isinstance(node, nnx.Variable):
            return node.replace(abstract(sharding, node.get_value()))
        return jax.ShapeDtypeStruct(node.shape, dtype or node.dtype, sharding=sharding)

    return jax.tree.map(abstract, param_shardings(state, layout, mesh), state,
                        is_leaf=lambda node: isinstance(node, NamedSharding))


def batch_sharding(layout: Layout | str, mesh, batch_size: int | None = None) -> NamedSharding:
    """Where a token batch [B, S] goes under the layout: B over the layout's `batch` axes, S whole. With
    `batch_size` the divisibility is checked, so a batch the mesh cannot split is a clear error, which says how to
    call `fit_batch` for the layout that places it."""
    layout = get_layout(layout)
    spec = PartitionSpec(layout.activations.lookup("batch")[1] or None, None)
    if batch_size is not None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ShardingRuleError(f"batch_size {batch_size!r}: expected the number of sequences, a whole number of "
                                    "at least 1 (or None to place any batch)")
        try:
            spec = resolve(("batch", None), (batch_size, 1), layout.activations, mesh, "token batch",
                           f"activation rules of {layout.name}")
        except ShardingRuleError as err:
            name = repr(layout.name) if layout.name in LAYOUTS else "layout"
            raise ShardingRuleError(
                f"{err}; or fit the layout to a batch of {batch_size}, as the starscream commands do: layout = "
                f"fit_batch({name}, mesh, batch={batch_size}, positions=P) (P the tokens per sequence; in your "
                "names: in_vocabulary(layout, vocabulary)), then batch_sharding(layout, mesh) and use_layout(layout, "
                "mesh); fit_batch is starscream_jax.fit_batch (docs/any_batch.md)") from err
    return NamedSharding(mesh, spec)


def token_sharding(layout: Layout | str, mesh, batch_size: int) -> NamedSharding:
    """Where the layout keeps one token per row, [B] int32: like the rows of a token batch."""
    return NamedSharding(mesh, PartitionSpec(batch_sharding(layout, mesh, batch_size).spec[0]))
