"""The grouped matmul alone on one accelerator: `jax.lax.ragged_dot`, the Pallas kernel (`grouped_matmul`, a few
block sizes) and a dense GEMM of the same total shape, forward and backward, timed side by side in one run; and the
kernel's error against a float32 reference.

Shapes: one projection of an MoE layer, T x k rows over G experts (Mixtral 8x7B: 8192 x 2 rows, 4096 -> 14336, 8
experts; Qwen3-30B-A3B: 2048 x 8 rows, 2048 -> 768, 128 experts), the rows split between experts as a router on
random data splits them. Every row's TFLOP/s counts the routed FLOPs (2 x rows x K x F forward, twice that
backward), so the ratios compare directly. Method: each program compiled first, then the candidates alternate over
rounds of timed calls; the median round is reported.

    python scripts/bench_grouped_matmul.py --out gmm.json      # on a GPU
    python scripts/bench_grouped_matmul.py --quick             # tiny shapes, the kernels in interpret mode (CPU)
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from starscream_jax.benchmarks import harness
from starscream_jax.hardware.mesh import build_mesh
from starscream_jax.model import moe
from starscream_jax.model.catalog import load_model_config
from starscream_jax.model.grouped_matmul import DEFAULT_BLOCKS, grouped_matmul
from starscream_jax.model.layer_weights import RoutedMlpWeights
from starscream_jax.model.moe import tile_rows
from starscream_jax.model.names import RESIDUAL
from starscream_jax.sharding.apply import activation_spec, use_layout
from starscream_jax.sharding.layouts import get_layout
from starscream_jax.sharding.rules import resolve

SHAPES = {"mixtral-8x7b": (16384, 4096, 14336, 8), "qwen3-30b-a3b": (16384, 2048, 768, 128)}
"""name: (rows T x k, K, F, experts)."""
VARIANTS = {"default": DEFAULT_BLOCKS,
            "cols128": dataclasses.replace(DEFAULT_BLOCKS, cols=128),
            "cols256": dataclasses.replace(DEFAULT_BLOCKS, cols=256),
            "warps4": dataclasses.replace(DEFAULT_BLOCKS, warps=4),
            "warps8": dataclasses.replace(DEFAULT_BLOCKS, warps=8),
            "depth128_weight64": dataclasses.replace(DEFAULT_BLOCKS, depth=128, weight_block=64)}
"""Block sizes tried beside the default (a variant whose kernels do not fit the chip's shared memory is recorded as
such and left out of the timings)."""


def group_sizes(rows: int, experts: int, seed=0) -> np.ndarray:
    """Rows per expert as top-k of a random router splits them: uneven around rows / experts."""
    shares = np.random.default_rng(seed).dirichlet(np.full(experts, 50.0))
    sizes = np.floor(shares * rows).astype(np.int64)
    sizes[0] += rows - sizes.sum()
    return sizes


def tiled(sizes: np.ndarray, tile: int) -> tuple[np.ndarray, int]:
    """(padded sizes: whole tiles, rows R of the tiled layout: the live tiles plus as many spare as experts)."""
    padded = -(-sizes // tile) * tile
    return padded, (-(-sizes.sum() // tile) + len(sizes)) * tile


def fwd_bwd(matmul):
    """x, w, cotangent -> (out, dx, dw) jitted."""
    def run(x, w, cotangent):
        out, pullback = jax.vjp(matmul, x, w)
        return (out, *pullback(cotangent))
    return jax.jit(run)


def timed(programs: dict, args: dict, rounds: int, calls: int) -> tuple[dict, dict]:
    """Compile every program, then alternate them over rounds of `calls` timed calls: (median round mean (s) of each
    program that compiled, the error of each that did not)."""
    compiled, failed = {}, {}
    for name, program in programs.items():
        try:
            compiled[name] = program.lower(*args[name]).compile()
        except jax.errors.JaxRuntimeError as error:  # e.g. blocks over the shared memory of the chip
            failed[name] = str(error).splitlines()[0]
            continue
        start = time.perf_counter()
        jax.block_until_ready(compiled[name](*args[name]))
        print(f"  {name}: compiled, first call {time.perf_counter() - start:.3f} s", flush=True)
    seconds = harness.alternating_rounds({name: (program, args[name]) for name, program in compiled.items()},
                                         rounds=rounds, warmup=1, calls=calls)
    return {name: rounds.median for name, rounds in seconds.items()}, failed


def relative_error(got, expected) -> float:
    got, expected = np.asarray(got, np.float64), np.asarray(expected, np.float64)
    return float(np.linalg.norm(got - expected) / np.linalg.norm(expected))


def shape_benchmark(name: str, rows: int, depth: int, cols: int, experts: int, tile: int, implementation: str,
                    variants: dict, rounds: int, calls: int) -> dict:
    sizes = group_sizes(rows, experts)
    padded, tiled_rows = tiled(sizes, tile)
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (rows, depth), jnp.bfloat16)
    w = (jax.random.normal(keys[1], (experts, depth, cols), jnp.float32) * depth ** -0.5).astype(jnp.bfloat16)
    dy = jax.random.normal(keys[2], (rows, cols), jnp.bfloat16)
    starts = np.concatenate([[0], np.cumsum(padded)[:-1]])
    destination = np.concatenate([start + np.arange(size) for start, size in zip(starts, sizes)])
    x_tiled = jnp.zeros((tiled_rows, depth), x.dtype).at[destination].set(x)
    dy_tiled = jnp.zeros((tiled_rows, cols), dy.dtype).at[destination].set(dy)
    padded_j, sizes_j = jnp.asarray(padded, jnp.int32), jnp.asarray(sizes, jnp.int32)
    programs = {"gemm": fwd_bwd(lambda x, w: x @ w[0]),
                "ragged_dot": fwd_bwd(lambda x, w: jax.lax.ragged_dot(x, w, sizes_j))}
    args = {"gemm": (x, w, dy), "ragged_dot": (x, w, dy)}
    for variant, blocks in variants.items():
        programs[f"pallas_{variant}"] = fwd_bwd(
            lambda x, w, blocks=blocks: grouped_matmul(x, w, padded_j, tile, implementation, blocks))
        args[f"pallas_{variant}"] = (x_tiled, w, dy_tiled)
    seconds, failed = timed(programs, args, rounds, calls)
    flops = 3 * 2 * rows * depth * cols
    result = {"rows": rows, "K": depth, "F": cols, "experts": experts, "tile": tile, "group_sizes": sizes.tolist(),
              "padded_rows": int(padded.sum()), "flops_fwd_bwd": flops,
              "seconds": seconds, "tflops": {k: flops / s / 1e12 for k, s in seconds.items()},
              "over_gemm": {k: seconds["gemm"] / s for k, s in seconds.items()}, "failed": failed}
    result["error"] = kernel_error(x_tiled, w, dy_tiled, padded, padded_j, tile, implementation)
    print(f"{name}: rows {rows}, {depth} -> {cols}, {experts} experts, tile {tile}; forward + backward")
    for key, value in seconds.items():
        print(f"  {key:24s} {value * 1e3:8.3f} ms  {result['tflops'][key]:7.1f} TFLOP/s  "
              f"{result['over_gemm'][key]:.3f} of the GEMM")
    for key, error in failed.items():
        print(f"  {key:24s} did not compile: {error}")
    print(f"  kernel error vs float32 (out, dx, dw): {result['error']}")
    return result


def kernel_error(x_tiled, w, dy_tiled, padded, padded_j, tile, implementation) -> list[float]:
    """||kernel - float32 reference|| / ||reference|| of out, dx and dw (`grouped_reference`, on the same device)."""
    got = fwd_bwd(lambda x, w: grouped_matmul(x, w, padded_j, tile, implementation))(x_tiled, w, dy_tiled)
    tile_groups = jnp.asarray(np.repeat(np.arange(len(padded)), padded // tile), jnp.int32)
    expected = grouped_reference(x_tiled, w, dy_tiled, tile_groups, tile)
    return [relative_error(a, e) for a, e in zip(got, expected)]


@functools.partial(jax.jit, static_argnums=4)
def grouped_reference(x_tiled, w, dy_tiled, tile_groups, tile: int):
    """(out, dx, dw) of the grouped matmul in float32 at the highest precision, one tile of `tile` rows at a time
    (a loop over the live tiles, each through its group's weights, `tile_groups` [N]; the spare tiles after them give
    zeros), so that no [N, K, F] copy of the weights is made."""
    xf, wf, dyf = (a.astype(jnp.float32) for a in (x_tiled, w, dy_tiled))
    live = tile_groups.shape[0] * tile
    matmul = functools.partial(jnp.matmul, precision=jax.lax.Precision.HIGHEST)

    def one_tile(dw_GKF, inputs):
        x_TK, dy_TF, group = inputs
        w_KF = wf[group]
        dw_GKF = dw_GKF.at[group].add(matmul(x_TK.T, dy_TF))
        return dw_GKF, (matmul(x_TK, w_KF), matmul(dy_TF, w_KF.T))

    tiles = (xf[:live].reshape(-1, tile, xf.shape[1]), dyf[:live].reshape(-1, tile, dyf.shape[1]), tile_groups)
    dw, (out, dx) = jax.lax.scan(one_tile, jnp.zeros_like(wf), tiles)
    spare = xf.shape[0] - live
    out = jnp.concatenate([out.reshape(live, -1), jnp.zeros((spare, wf.shape[2]))])
    dx = jnp.concatenate([dx.reshape(live, -1), jnp.zeros((spare, wf.shape[1]))])
    return out, dx, dw


def layout_check(implementation: str, devices: int | None = None) -> dict:
    """The routed block (tiny-moe shapes, bfloat16) under starscream_ep on a mesh of the first `devices` local
    devices (default every one), through the kernel inside the layout's shard map, against the dense reference
    unsharded: relative error of the output and of every gradient."""
    c = load_model_config("tiny-moe", dtype="bfloat16")
    devices = devices or len(jax.devices())
    mesh = build_mesh(f"{devices}x1", devices=jax.devices()[:devices])
    keys = jax.random.split(jax.random.key(2), 5)
    shapes = {"router": (c.d_model, c.n_experts), "w_gate": (c.n_experts, c.d_model, c.d_ff),
              "w_up": (c.n_experts, c.d_model, c.d_ff), "w_down": (c.n_experts, c.d_ff, c.d_model)}
    w = RoutedMlpWeights(**{name: jax.random.normal(key, shape, jnp.float32) * shape[-2] ** -0.5
                            for (name, shape), key in zip(shapes.items(), keys)})
    h = jax.random.normal(keys[4], (2 * devices, 64, c.d_model), jnp.float32)

    def loss_and_grads(block, h, w):
        def loss(h, w):
            out = block(h, w).astype(jnp.float32)
            return jnp.sum(out * out), out
        return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(h, w)[0][1], jax.grad(
            lambda h, w: loss(h, w)[0], argnums=(0, 1))(h, w)

    def dense(h, w):
        h_TD = h.reshape(-1, c.d_model).astype(jnp.bfloat16)
        gates, experts, _ = moe.route(h_TD, w.router, c.experts_per_token, c.normalize_gates)
        weights = [weight.astype(jnp.bfloat16) for weight in (w.w_gate, w.w_up, w.w_down)]
        return moe.dense_experts(h_TD, gates, experts, *weights).reshape(h.shape)

    expected = jax.jit(lambda h, w: loss_and_grads(dense, h, w))(h, w)
    rules = get_layout("starscream_ep").params

    def put(value, names):
        return jax.device_put(value, NamedSharding(mesh, resolve(names, value.shape, rules, mesh)))
    placed = RoutedMlpWeights(router=put(w.router, ("embed", "experts")), w_gate=put(w.w_gate, moe.GATE_UP_NAMES),
                              w_up=put(w.w_up, moe.GATE_UP_NAMES), w_down=put(w.w_down, moe.DOWN_NAMES))
    with use_layout("starscream_ep", mesh):
        tokens = jax.device_put(h, NamedSharding(mesh, activation_spec(RESIDUAL, h.shape)))
        program = jax.jit(lambda h, w: loss_and_grads(lambda h, w: moe.routed_mlp(c, h, w)[0], h, w))
        got = program(tokens, placed)
        text = program.lower(tokens, placed).compile().as_text()
    errors = [relative_error(a, e) for a, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected))]
    result = {"devices": devices, "relative_errors": errors,
              "triton_kernels_in_program": text.count("__gpu$xla.gpu.triton")}
    print(f"starscream_ep on {devices} device(s), routed through the {implementation} kernel vs dense: {result}")
    return result


QUICK_CHECK_DEVICES = 4
"""Devices of the layout check in a --quick run: one per expert of tiny-moe."""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds the candidates alternate over (default 5)")
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES),
                        help="projection shapes to time (default all)")
    harness.add_run_arguments(parser, warmup=None, steps=10, steps_flag="--calls", steps_help="timed calls per round",
                              quick=f"tiny shapes, kernels in interpret mode, the layout check on "
                                    f"{QUICK_CHECK_DEVICES} devices (CPU)")
    args = parser.parse_args(argv)
    info = harness.run_info(__file__, argv)
    result = {**info.as_dict(), "device": info.device_kind, "shapes": {}}
    shapes = {"tiny": (256, 64, 128, 4)} if args.quick else {name: SHAPES[name] for name in args.shapes}
    implementation = "interpret" if args.quick else "pallas"
    variants = {"default": DEFAULT_BLOCKS} if args.quick else VARIANTS
    rounds, calls = (1, 1) if args.quick else (args.rounds, args.calls)
    for name, (rows, depth, cols, experts) in shapes.items():
        tile = tile_rows(rows, experts)
        result["shapes"][name] = shape_benchmark(name, rows, depth, cols, experts, tile, implementation, variants,
                                                 rounds, calls)
        harness.write_json(args.out, result)
    result["layout_check"] = layout_check(moe.default_implementation(), QUICK_CHECK_DEVICES if args.quick else None)
    harness.write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
