"""The routed (dropless) mixture-of-experts block: a router, tokens grouped by expert through grouped matmuls (tiles
of rows by expert, each tile through its own expert's weights: `grouped_matmul`), and the results combined with the
gates. Shape letters as in `names`; A = T x k assignments, N tiles of M rows.

Each token goes to the k experts with the largest router probabilities (a softmax over all X experts' logits); its
gates are those k probabilities, divided by their sum when `normalize_gates` (Mixtral, Qwen3-MoE: equal to a softmax
over the k chosen logits) or as they are (Switch-style routers). No token is dropped: every assignment is computed,
in tiles whose FLOPs are the routed count plus padding (`expert_outputs`), k / X of running every expert on every
token.

Under a layout the block runs per device (`jax.shard_map` over the layout's mesh), because a grouped matmul works on
the tokens and experts a device holds:
  tokens    the residual stream as the layout places it (RESIDUAL), gathered over the axes that split its embed dim;
  weights   the expert weights as stored (`params` rules), their embed dimension gathered inside the shard map to its
            placement at use (the `weights` rules: inside the GPU under starscream_tp and starscream_ep, the gradient
            reduce-scattered there), their experts and hidden (expert_mlp) dimensions left split; the router's
            embed dimension likewise, its experts dimension gathered whole (it is small);
  compute   each device routes its own tokens and runs those that chose its experts through its share of them;
  combine   the partial outputs summed over the mesh axes that split the experts and their hidden dimension: an
            all-reduce across GPUs between same-index partitions under starscream_ep, over every partition under
            flat_ep, over the GPUs (as the dense MLP's) under the tensor-parallel layouts.
Where the weights stay split over embed at use (`contract`: starscream_decode's 2-D weight-stationary placement,
embed over xcd, as the residual stream), the tokens stay split too and every contraction over embed is partial:
the router's logits [T, X] and the experts' gate and up pre-activations, in assignment order [T k, F / gpu], are
summed inside the GPU before their nonlinearities, and the down projection gives each partition its share of the
embed dimension directly. Each partition then reads 1 / xcd of its GPU's router and expert weights, so each weight
byte is read once per GPU, as the dense MLP of that layout reads its weights (decode, where a gather would have every
partition read the GPU's whole share). A contraction split over axes that also split the tokens would sum different
tokens' products; it is refused.
A layout whose tokens and experts share a mesh axis would leave assignments to other devices' experts uncomputed;
it is refused. The optional load-balancing loss (Switch Transformer form) is X * sum_x f_x * P_x, with f_x the share
of the T x k assignments that expert x got and P_x its mean router probability: 1 when the load is even.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from ..errors import ShardingRuleError
from ..hardware.axes import dim_axes, spec_axes
from ..sharding.apply import Placement, placed_by
from ..sharding.collectives import hierarchical_all_gather, hierarchical_psum
from .config import ModelConfig
from .grouped_matmul import default_implementation, grouped_matmul
from .names import RESIDUAL
from .layer_weights import RoutedMlpWeights
from .quantize import Scaled, dequantize

GATE_UP_NAMES = ("experts", "embed", "expert_mlp")
"""The logical names of one layer's expert gate and up weights [X, D, F]."""
DOWN_NAMES = ("experts", "expert_mlp", "embed")
"""The logical names of one layer's expert down weight [X, F, D]."""
EMBED_DIMS = (1, 1, 2)
"""Which dimension of each expert weight, in `_experts`' order (w_gate, w_up [X, D, F], w_down [X, F, D]), is
embed."""


def route(h_TD: jax.Array, router_DX: jax.Array, k: int, normalize_gates: bool, total=None):
    """(gates [T, k] float32, experts [T, k] int32, router probabilities [T, X] float32) of tokens h [T, D].

    `total` (per device: a sum over the mesh axes that split D, e.g. `hierarchical_psum` over xcd) completes logits
    that h and the router, both split over D, give as partial sums; None where D is whole."""
    with jax.named_scope("router"):
        logits_TX = jnp.einsum("td,dx->tx", h_TD.astype(jnp.float32), router_DX.astype(jnp.float32))
    if total is not None:
        logits_TX = total(logits_TX)
    probabilities_TX = jax.nn.softmax(logits_TX, axis=-1)
    gates_TK, experts_TK = jax.lax.top_k(probabilities_TX, k)
    if normalize_gates:
        gates_TK = gates_TK / jnp.sum(gates_TK, axis=-1, keepdims=True)
    return gates_TK, experts_TK, probabilities_TX


def expert_outputs(h_TD, gates_TK, experts_TK, w_gate_XDF, w_up_XDF, w_down_XFD, first_expert=0,
                   implementation: str | None = None, total=None, device=None) -> jax.Array:
    """[T, D]: the sum over each token's assignments to experts first_expert .. first_expert + X_local - 1 (the
    experts whose weights [X_local, ...] are given) of gate x SwiGLU expert(token); other assignments add nothing.

    With `total` (per device: a sum over the mesh axes that split D), h [T, D_local] and the weights hold one part
    of D: the gate and up pre-activations are partial sums, completed by `total` in assignment order ([T k, F],
    `_total_by_assignment`) before the SwiGLU, and the result is that part of D, [T, D_local].

    The assignments are sorted by expert into rows R = N tiles x M (`tile_rows`), each local expert's rows padded to
    whole tiles, and run through the grouped matmul (`grouped_matmul`, its `implementation`: by default the Pallas
    kernel on a GPU, batched matmuls of the tiles elsewhere). N = ceil(T k / M) + X_local tiles hold every
    assignment whichever experts they chose, so none is dropped; the FLOPs are those of the local experts' rows
    plus at most X_local x M padding rows (the Pallas kernel skips the tiles past them; the batched matmuls run all
    N tiles: the T x k rows on a device that holds some of the experts). `device`: the one the program compiles
    for (`grouped_matmul`'s)."""
    tokens, k = experts_TK.shape
    local_experts, d_model, _ = w_gate_XDF.shape
    rows = tokens * k
    tile = tile_rows(rows, local_experts)
    tiles = -(-rows // tile) + local_experts
    expert_A = experts_TK.reshape(-1) - first_expert
    group_A = jnp.where((expert_A >= 0) & (expert_A < local_experts), expert_A, local_experts)
    order_A = jnp.argsort(group_A, stable=True)
    sorted_group_A = group_A[order_A]
    sizes_X = jnp.bincount(group_A, length=local_experts + 1)[:local_experts]
    padded_X = (-(-sizes_X // tile) * tile).astype(jnp.int32)
    expert_of_row_A = jnp.minimum(sorted_group_A, local_experts - 1)
    row_in_group_A = jnp.arange(rows) - (jnp.cumsum(sizes_X) - sizes_X)[expert_of_row_A]
    destination_A = jnp.where(sorted_group_A < local_experts,
                              (jnp.cumsum(padded_X) - padded_X)[expert_of_row_A] + row_in_group_A, tiles * tile)
    # each row's assignment (A where it pads a tile) and each assignment's row (R where another device runs it)
    source_R = jnp.full((tiles * tile,), rows, jnp.int32).at[destination_A].set(order_A.astype(jnp.int32),
                                                                                  mode="drop")
    row_A = jnp.zeros((rows,), jnp.int32).at[order_A].set(destination_A.astype(jnp.int32))
    x_RD = permute_rows(jnp.repeat(h_TD, k, axis=0), source_R, row_A)
    implementation = implementation or default_implementation()

    def per_expert(name, rows_RK, weights_XKF):
        with jax.named_scope(name):
            return grouped_matmul(rows_RK, weights_XKF, padded_X, tile, implementation, device=device)

    gate_RF, up_RF = per_expert("gate", x_RD, w_gate_XDF), per_expert("up", x_RD, w_up_XDF)
    if total is not None:
        gate_RF, up_RF = _total_by_assignment(total, (gate_RF, up_RF), source_R, row_A)
    hidden_RF = jax.nn.silu(gate_RF) * up_RF
    out_RD = per_expert("down", hidden_RF, w_down_XFD)
    out_TKD = permute_rows(out_RD, row_A, source_R).reshape(tokens, k, d_model)
    return combined(out_TKD, gates_TK)


def combined(out_TKD: jax.Array, gates_TK: jax.Array) -> jax.Array:
    """[T, D]: each token's k expert outputs [T, k, D] weighted by its gates [T, k] and summed, in float32, in out's
    dtype. Elementwise (k is a few): a batched matmul of k-long contractions would be T tiny products, which XLA
    leaves unnamed in the backward pass, so the compiled program could not tell whose they are."""
    weighted = out_TKD.astype(jnp.float32) * gates_TK.astype(jnp.float32)[:, :, None]
    return jnp.sum(weighted, axis=1).astype(out_TKD.dtype)


def _total_by_assignment(total, partial_RF: tuple[jax.Array, ...], source_R, row_A) -> tuple[jax.Array, ...]:
    """Each partial sum [R, F] of the grouped rows completed by `total`, which runs on the T k assignments' rows
    alone ([A, F]: the R rows hold up to X_local tiles of padding besides) and the result put back in its rows."""
    by_assignment = tuple(permute_rows(x_RF, row_A, source_R) for x_RF in partial_RF)
    return tuple(permute_rows(x_AF, source_R, row_A) for x_AF in total(by_assignment))


@jax.custom_vjp
def permute_rows(x_ND: jax.Array, index_M: jax.Array, inverse_N: jax.Array) -> jax.Array:
    """[M, D]: row m is x's row index[m], zeros where index[m] is out of range. `index` takes each row of x at most
    once, and `inverse` [N] says where each row of x went (out of range where nowhere), so the gradient is a gather
    by `inverse` too, where JAX would transpose the gather into a scatter-add (a serialised pass over the MoE
    block's [T k, D] rows; measured in benchmarks/NOTES.md)."""
    return jnp.take(x_ND, index_M, axis=0, mode="fill", fill_value=0)


def _permute_rows_forward(x_ND, index_M, inverse_N):
    return permute_rows(x_ND, index_M, inverse_N), (index_M, inverse_N)


def _permute_rows_backward(indices, cotangent_MD):
    index_M, inverse_N = indices
    return jnp.take(cotangent_MD, inverse_N, axis=0, mode="fill", fill_value=0), None, None


permute_rows.defvjp(_permute_rows_forward, _permute_rows_backward)


def tile_rows(rows: int, experts: int) -> int:
    """Rows M per tile of the grouped matmul: the largest power of two up to 128 (a kernel's row block) whose
    padding (at most `experts` x M rows) stays within a quarter of the `rows` assigned (16 at least: the matrix
    units' smallest)."""
    return max(16, min(128, 1 << max(0, (rows // (4 * experts)).bit_length() - 1)))


def dense_experts(h_TD, gates_TK, experts_TK, w_gate_XDF, w_up_XDF, w_down_XFD) -> jax.Array:
    """[T, D]: the same sum as `expert_outputs`, computed densely (every expert on every token, weighted by its
    gate, 0 where not chosen): X / k times the routed FLOPs. The reference the routed block is tested and measured
    against."""
    gates_TX = jnp.sum(jax.nn.one_hot(experts_TK, w_gate_XDF.shape[0], dtype=jnp.float32) * gates_TK[..., None], 1)
    with jax.named_scope("gate"):
        gate_TXF = jnp.einsum("td,xdf->txf", h_TD, w_gate_XDF)
    with jax.named_scope("up"):
        up_TXF = jnp.einsum("td,xdf->txf", h_TD, w_up_XDF)
    hidden_TXF = jax.nn.silu(gate_TXF) * up_TXF * gates_TX.astype(h_TD.dtype)[..., None]
    with jax.named_scope("down"):
        return jnp.einsum("txf,xfd->td", hidden_TXF, w_down_XFD)


def load_balance(experts_TK: jax.Array, probabilities_TX: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(assignments per expert [X], summed router probability per expert [X]) of these tokens, float32."""
    counts_X = jnp.zeros(probabilities_TX.shape[-1:], jnp.float32).at[experts_TK.reshape(-1)].add(1.0)
    return counts_X, jnp.sum(probabilities_TX, axis=0)


def balance_loss(counts_X: jax.Array, probability_sums_X: jax.Array, k: int) -> jax.Array:
    """The load-balancing loss X * sum_x f_x P_x from the assignment counts and summed router probabilities of
    tokens routed to `k` experts each."""
    assignments = jnp.sum(counts_X)
    return counts_X.shape[0] * jnp.sum(counts_X / assignments * probability_sums_X / (assignments / k))


@dataclasses.dataclass(frozen=True, kw_only=True)
class _ExpertAxes:
    """Mesh axes the per-device block works with: those that split the tokens' embed dim, the router's dims and
    each expert weight's embed dim (in `_experts`' order; gathered on entry), the embed dim kept split at use
    (`contract`: the contractions over it are partial, summed over these axes), the tokens (batch and seq: the
    load-balancing statistics are summed over them), the experts (which experts a device holds) and the experts
    with their hidden dim (the partial outputs are summed over them)."""

    token_embed: tuple[str, ...] = ()
    router: tuple[tuple[str, ...], ...] = ()
    weight_embed: tuple[tuple[str, ...], ...] = ((), (), ())
    contract: tuple[str, ...] = ()
    tokens: tuple[str, ...] = ()
    experts: tuple[str, ...] = ()
    combine: tuple[str, ...] = ()


def routed_mlp(c: ModelConfig, h_BSD: jax.Array, w: RoutedMlpWeights,
               placement: Placement | None = None) -> tuple[jax.Array, jax.Array]:
    """(the block's output [B, S, D] placed by RESIDUAL, the load-balancing loss of these tokens: a float32 scalar).

    `w`: one layer's router [D, X] and expert weights w_gate / w_up [X, D, F], w_down [X, F, D] as stored (8-bit
    ones with their scales, dequantized to the compute dtype here: the grouped matmul reads one dtype).
    `placement`: where it runs (None: `current()`)."""
    w, placement = _in_compute_dtype(c, w), placed_by(placement)
    if not placement.placed:
        return _per_device(c, _ExpertAxes(), placement.device, h_BSD, w)
    h_BSD = placement.constrain(h_BSD, RESIDUAL, "moe input")
    token_spec = placement.activation_spec(RESIDUAL, h_BSD.shape, "moe input")
    specs = jax.tree.map(lambda value: jax.typeof(value).sharding.spec, w)
    mesh_axes = _expert_axes(placement, w.w_gate.shape, specs, token_spec)
    mapped = jax.shard_map(functools.partial(_per_device, c, mesh_axes, placement.device), mesh=placement.mesh,
                           in_specs=(token_spec, specs), out_specs=(token_spec, PartitionSpec()))
    out_BSD, balance = mapped(h_BSD, w)
    return placement.constrain(out_BSD, RESIDUAL, "moe output"), balance


def _in_compute_dtype(c: ModelConfig, w: RoutedMlpWeights) -> RoutedMlpWeights:
    """`w` with its expert weights in the compute dtype (8-bit ones times their scales, which it then drops)."""
    return RoutedMlpWeights(router=w.router,
                            w_gate=_expert_weight(c, w.w_gate, w.w_gate_scale, "w_gate", GATE_UP_NAMES),
                            w_up=_expert_weight(c, w.w_up, w.w_up_scale, "w_up", GATE_UP_NAMES),
                            w_down=_expert_weight(c, w.w_down, w.w_down_scale, "w_down", DOWN_NAMES))


def _expert_weight(c: ModelConfig, stored: jax.Array, scale: jax.Array | None, key: str,
                   names: tuple[str, ...]) -> jax.Array:
    """One expert weight (`key`, with logical `names`) in the compute dtype: an 8-bit one (its `scale` given)
    times its scales."""
    dtype = jnp.dtype(c.dtype)
    if scale is None:
        return stored.astype(dtype)
    return dequantize(Scaled(stored, scale), key, names, c.weight_scales, dtype)


def _experts(w: RoutedMlpWeights) -> tuple:
    """The expert weights of `w` (or of its specs) in EMBED_DIMS' order: w_gate, w_up, w_down."""
    return w.w_gate, w.w_up, w.w_down


def _expert_axes(placement: Placement, w_gate_shape, specs: RoutedMlpWeights,
                 token_spec: PartitionSpec) -> _ExpertAxes:
    """The mesh axes the per-device block works with (`_ExpertAxes`), of weights stored as `specs` (each field its
    PartitionSpec) and tokens placed by `token_spec`."""
    contract = _contract_axes(placement, w_gate_shape, specs, token_spec)
    return _ExpertAxes(
        token_embed=() if contract else dim_axes(token_spec, 2),
        router=(() if contract else dim_axes(specs.router, 0), dim_axes(specs.router, 1)),
        weight_embed=tuple(() if contract else dim_axes(spec, dim) for spec, dim in zip(_experts(specs), EMBED_DIMS)),
        contract=contract,
        tokens=(*dim_axes(token_spec, 0), *dim_axes(token_spec, 1)),
        experts=dim_axes(specs.w_gate, 0),
        combine=_combine_axes(specs.w_gate, token_spec),
    )


def _combine_axes(expert_spec: PartitionSpec, token_spec: PartitionSpec) -> tuple[str, ...]:
    """The mesh axes that split the experts or their hidden dimension (w_gate [X, D, F]), over which the partial
    outputs are summed; refused where the tokens are split over one of them too."""
    axes = (*dim_axes(expert_spec, 0), *dim_axes(expert_spec, 2))
    shared = sorted(set(axes) & spec_axes(token_spec))
    if shared:
        raise ShardingRuleError(
            f"the layout splits both the tokens ({token_spec}) and the experts or their hidden dimension "
            f"({expert_spec}) over mesh axes {shared}, so tokens would never meet the experts on other devices; "
            f"map 'experts' and 'expert_mlp' to axes the 'batch' and 'seq' rules do not use")
    return axes


def _contract_axes(placement: Placement, w_gate_shape, specs: RoutedMlpWeights,
                   token_spec: PartitionSpec) -> tuple[str, ...]:
    """The mesh axes that split the experts' embed dimension at use (the active layout's `weights` rules for w_gate
    [X, D, F]): () where it is gathered whole (train and prefill layouts). Where it stays split (starscream_decode),
    the tokens' embed dimension and the stored router and expert weights must be split over the same axes and the
    tokens over none of them, so that each partial contraction sums one token's products; else refused."""
    contract = dim_axes(placement.weight_spec(GATE_UP_NAMES, w_gate_shape, "w_gate"), EMBED_DIMS[0])
    if not contract:
        return ()
    split = {"tokens": dim_axes(token_spec, 2), "router": dim_axes(specs.router, 0),
             **{name: dim_axes(spec, dim) for name, spec, dim in zip(("w_gate", "w_up", "w_down"), _experts(specs),
                                                                      EMBED_DIMS)}}
    differ = {name: axes for name, axes in split.items() if axes != contract}
    if differ:
        raise ShardingRuleError(
            f"the layout keeps the experts' embed dimension split over {contract} at use, but splits the embed "
            f"dimension of {differ} otherwise; map 'embed' to the same axes in the params, weights and activations "
            f"rules, or gather it at use (weights rule 'embed': None)")
    shared = sorted(set(contract) & {*dim_axes(token_spec, 0), *dim_axes(token_spec, 1)})
    if shared:
        raise ShardingRuleError(
            f"the layout splits both the tokens ({token_spec}) and the experts' embed dimension at use over mesh "
            f"axes {shared}, so a partial contraction would sum different tokens' products; gather the weights' "
            f"embed dimension at use (weights rule 'embed': None) or keep the tokens whole on those axes")
    return contract


def _per_device(c: ModelConfig, mesh_axes: _ExpertAxes, device, h_BSD, w: RoutedMlpWeights):
    """The block on the tokens and experts one device holds (the whole block outside a layout): gather the
    dimensions `mesh_axes` names, route, run the local experts (contractions over an embed dim kept split completed
    by a sum over `mesh_axes.contract`), sum the partial outputs over the combine axes and the load-balancing
    statistics over the token axes. `device`: the one the program compiles for."""
    h_BSD = hierarchical_all_gather(h_BSD, mesh_axes.token_embed, 2)
    router_DX = w.router
    for dim, axes in enumerate(mesh_axes.router):
        router_DX = _gather_weight(router_DX, axes, dim, mesh_axes.tokens)
    w_gate_XDF, w_up_XDF, w_down_XFD = (_gather_weight(weight, axes, dim, mesh_axes.tokens) for weight, axes, dim in
                                        zip(_experts(w), mesh_axes.weight_embed, EMBED_DIMS))
    batch, seq, d_model = h_BSD.shape
    h_TD = h_BSD.reshape(batch * seq, d_model)
    total = functools.partial(hierarchical_psum, axes=mesh_axes.contract) if mesh_axes.contract else None
    gates_TK, experts_TK, probabilities_TX = route(h_TD, router_DX, c.experts_per_token, c.normalize_gates, total)
    if mesh_axes.combine:  # typed as differing over the experts' axes before the experts use it: its gradient sums
        h_TD = jax.lax.pcast(h_TD, mesh_axes.combine, to="varying")  # there (the gather by expert would not say so)
    first_expert = jax.lax.axis_index(mesh_axes.experts) * w_gate_XDF.shape[0] if mesh_axes.experts else 0
    out_TD = expert_outputs(h_TD, gates_TK, experts_TK, w_gate_XDF, w_up_XDF, w_down_XFD, first_expert, total=total,
                            device=device)
    if mesh_axes.combine:
        out_TD = jax.lax.psum(out_TD, mesh_axes.combine)
    if mesh_axes.token_embed:  # the device's share of the embed dim, as the tokens came in
        share = d_model // jax.lax.axis_size(mesh_axes.token_embed)
        out_TD = jax.lax.dynamic_slice_in_dim(out_TD, jax.lax.axis_index(mesh_axes.token_embed) * share, share, 1)
    return out_TD.reshape(batch, seq, -1), _balance(c, mesh_axes, experts_TK, probabilities_TX)


def _gather_weight(x: jax.Array, axes: tuple[str, ...], dimension: int, token_axes: tuple[str, ...]) -> jax.Array:
    """A weight's `dimension`, split over the mesh `axes`, gathered whole (as `hierarchical_all_gather`, innermost
    axis first). Over an axis the tokens are not split on (a decode batch too small for it: split-K) every device
    of the axis then computes the same outputs, so the gather is typed invariant there; else the block's output,
    placed without that axis, would be refused by shard_map as possibly varying over it."""
    for axis in reversed(axes):
        x = jax.lax.all_gather(x, axis, axis=dimension, tiled=True,
                               to="varying" if axis in token_axes else "invarying")
    return x


def _balance(c: ModelConfig, mesh_axes: _ExpertAxes, experts_TK, probabilities_TX) -> jax.Array:
    """The load-balancing loss of every device's tokens (0 when its weight is 0: nothing is computed). The
    statistics are summed over the token axes; the loss, the same on every device but computed from a router
    gathered over other axes too, is averaged over those (a scalar) so that it is one value everywhere."""
    if not c.load_balance_weight:
        return jnp.zeros((), jnp.float32)
    statistics = hierarchical_psum(load_balance(experts_TK, probabilities_TX), mesh_axes.tokens)
    balance = balance_loss(*statistics, c.experts_per_token)
    gathered = tuple(axis for axes in mesh_axes.router for axis in axes if axis not in mesh_axes.tokens)
    return hierarchical_psum(balance, gathered, reduction=jax.lax.pmean)
