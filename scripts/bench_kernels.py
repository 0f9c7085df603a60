"""Per-device kernels of a flat and a hierarchical layout, timed side by side on one accelerator.

Each row is one kernel of a transformer block as one logical device runs it under two layouts on the same topology
(default: Llama 3 70B, flat_tp vs starscream_tp on 8 GPUs x 8 partitions). Nothing is hard-coded: the per-device
shapes come from the model configuration (models/<name>.toml, through the model's own parameters and their logical
axis names) and the layouts' rules on the topology's mesh:
  matmuls    M = tokens / the mesh axes the `batch` activation rule names; K and N = each weight's dimensions at use
             (the layout's `weights` rules), K over its contracted logical names. q/k/v and gate/up are fused along N
             (one kernel reading the same input), as the model runs them in training and prefill (decoder._qkv,
             decoder._gate_up; decode runs them apart).
  attention  q [B, S, H, E] and k/v [B, T, K, E] per device from the `attn_batch`, `heads` and `kv_heads` activation
             rules; where kv heads are copied (fewer kv heads than devices) each device uses the kv heads its query
             heads share. Prefill is causal self-attention (XLA's implementation, as the model calls
             `jax.nn.dot_product_attention`; `--prefill-implementation cudnn` for cuDNN's fused kernel); decode is
             one new token against a full cache of L positions, with a mask, as the model's cached attention runs it.
  split-K    decode of fewer sequences than partitions (`--split-k`, default batch 1 at caches of 8192-32768): the
             unsplit attention gpu_tp runs on every partition (the whole cache, the model's cached attention:
             cuDNN's fused kernel on NVIDIA GPUs) against one partition's split-K part under starscream_decode
             fitted to the batch (1/X of the cache's positions, `model.split_k.partial_attention` and the merge's
             local combine). The merge's one collective inside the GPU is not in the kernel (one device).
Method: bfloat16 inputs drawn at random, each kernel jitted, warmed up, then timed as the mean of N calls; the flat and
hierarchical kernels alternate over several rounds and each reports the median of its round means. "speedup" is hier
TFLOP/s over flat TFLOP/s (kernel efficiency); "time flat/hier" compares the two kernels' times, which differ from
the speedup where the flat layout does redundant work (copied kv heads).

    python scripts/bench_kernels.py                      # on a GPU: Llama 3 70B shapes, table on stdout
    python scripts/bench_kernels.py --out kernels.json   # and every figure as JSON
    python scripts/bench_kernels.py --quick              # under a minute on a CPU: tiny model on 2 x 4, smoke test
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import asdict, dataclass

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh

from starscream_jax.benchmarks import harness
from starscream_jax.hardware.axes import AXES, axes_of
from starscream_jax.hardware.topology import parse_override
from starscream_jax.model.decoder import abstract_model
from starscream_jax.model.names import ATTN_Q
from starscream_jax.model.split_k import combine_partials, partial_attention
from starscream_jax.sharding.layouts import Layout, fit_batch, get_layout, positions_multiple
from starscream_jax.sharding.rules import resolve

# kernel name: (weights fused along N, logical names the kernel contracts over)
MATMULS = {
    "qkv_fused": (("wq", "wk", "wv"), ("embed",)),
    "o_proj": (("wo",), ("heads", "head_dim")),
    "gate_up_fused": (("w_gate", "w_up"), ("embed",)),
    "down": (("w_down",), ("mlp",)),
    "lm_head": (("lm_head",), ("embed",)),
}
ATTENTION = ("attn_prefill", "attn_decode", "attn_split_k")
DTYPE = jnp.bfloat16


@dataclass(frozen=True, kw_only=True)
class Kernel:
    """One kernel under both layouts: its per-device shapes (M, K, N for matmuls; q and k/v for attention)."""

    kernel: str
    case: str
    flat_shape: list
    hier_shape: list


@dataclass(frozen=True, kw_only=True)
class Measured:
    """One kernel's times (microseconds), rates (TFLOP/s) and ratios."""

    kernel: str
    case: str
    flat_shape: list
    hier_shape: list
    flat_us: float
    hier_us: float
    flat_tflops: float
    hier_tflops: float
    speedup: float
    time_ratio: float


def layout_mesh(topology: str) -> AbstractMesh:
    """The (data, gpu, xcd) mesh of a topology string ("8x8", "mi300x-cpx-nps1:8"), without devices."""
    parsed = parse_override(topology)
    return AbstractMesh((1, parsed.num_gpus, parsed.partitions_per_gpu), AXES)


def local_shape(names, shape, rules, mesh) -> list[int]:
    """Per-device shape of a tensor whose dimensions carry logical `names`, placed by `rules` on `mesh`."""
    spec = tuple(resolve(tuple(names), tuple(shape), rules, mesh))
    entries = spec + (None,) * (len(shape) - len(spec))
    return [size // math.prod(mesh.shape[axis] for axis in axes_of(entry)) for size, entry in zip(shape, entries)]


def local_tokens(tokens: int, layout: Layout, mesh, name: str = "batch") -> int:
    """Tokens one device holds when `tokens` are placed by the activation rule for `name`."""
    return local_shape((name,), (tokens,), layout.activations, mesh)[0]


def matmul_shape(model, weights, contracted, layout: Layout, mesh, tokens: int) -> list[int]:
    """[M, K, N] of one device: tokens by its weights at use, fused along N."""
    ks, n = set(), 0
    for name in weights:
        variable = getattr(model.layers if hasattr(model.layers, name) else model, name)
        names = variable.get_metadata("logical_axes")
        dims = dict(zip(names, local_shape(names, variable.shape, layout.weights, mesh)))
        dims.pop("layers", None)
        ks.add(math.prod(dims[c] for c in contracted))
        n += math.prod(size for axis, size in dims.items() if axis not in contracted)
    if len(ks) != 1:
        raise ValueError(f"weights {weights} contract over different sizes {sorted(ks)}; they cannot be fused")
    return [local_tokens(tokens, layout, mesh), ks.pop(), n]


def attention_shapes(config, layout: Layout, mesh, batch: int, query_len: int, key_len: int) -> list[list[int]]:
    """[q [B, S, H, E], k/v [B, T, K, E]] of one device: K = the kv heads its query heads use."""
    q = local_shape(ATTN_Q, (batch, query_len, config.n_heads, config.head_dim), layout.activations, mesh)
    group = config.n_heads // config.n_kv_heads
    return [q, [q[0], key_len, max(1, q[2] // group), config.head_dim]]


def kernels(config, flat: Layout, hier: Layout, mesh, tokens, prefill, decode) -> list[Kernel]:
    """Every kernel to time, shapes derived from the model and both layouts."""
    model = abstract_model(config)
    head = "embedding" if config.tie_embeddings else "lm_head"      # tied: logits = x @ embedding^T
    matmuls = {**MATMULS, "lm_head": ((head,), ("embed",))}
    found = [Kernel(kernel=name, case=f"{count} tokens", flat_shape=matmul_shape(model, *spec, flat, mesh, count),
                    hier_shape=matmul_shape(model, *spec, hier, mesh, count))
             for count in tokens for name, spec in matmuls.items()]
    found += [Kernel(kernel="attn_prefill", case=f"B{b} S{s}", flat_shape=attention_shapes(config, flat, mesh, b, s, s),
                     hier_shape=attention_shapes(config, hier, mesh, b, s, s)) for b, s in prefill]
    found += [Kernel(kernel="attn_decode", case=f"B{b} L{length}",
                     flat_shape=attention_shapes(config, flat, mesh, b, 1, length),
                     hier_shape=attention_shapes(config, hier, mesh, b, 1, length)) for b, length in decode]
    return found


def split_k_kernels(config, mesh, cases) -> list[Kernel]:
    """The split-K rows (see the module docstring): gpu_tp's unsplit decode attention as `flat_shape`, one
    partition's part of starscream_decode fitted to the batch as `hier_shape`."""
    found = []
    for batch, length in cases:
        split = fit_batch("starscream_decode", mesh, batch, 1)
        parts = positions_multiple(split, mesh, "cache_seq")
        found.append(Kernel(kernel="attn_split_k", case=f"B{batch} L{length}",
                            flat_shape=attention_shapes(config, get_layout("gpu_tp"), mesh, batch, 1, length),
                            hier_shape=attention_shapes(config, split, mesh, batch, 1, -(-length // parts))))
    return found


def flops(kernel: str, shape: list) -> float:
    """FLOPs of one call: 2MKN for a matmul; 4 B H S T E for attention, halved for causal prefill."""
    if kernel in ATTENTION:
        (b, s, h, e), (_, t, _, _) = shape
        return 4 * b * h * s * t * e / (2 if kernel == "attn_prefill" else 1)
    m, k, n = shape
    return 2 * m * k * n


def program(kernel: str, shape: list, key, prefill_implementation: str = "xla", split: bool = False):
    """(jitted function, its random bfloat16 arguments) for one kernel at one per-device shape; `split`: a split-K
    row's part rather than its unsplit attention."""
    keys = jax.random.split(key, 3)
    if kernel not in ATTENTION:
        m, k, n = shape
        return jax.jit(jnp.dot), (jax.random.normal(keys[0], (m, k), DTYPE), jax.random.normal(keys[1], (k, n), DTYPE))
    q_shape, kv_shape = shape
    args = (jax.random.normal(keys[0], q_shape, DTYPE), jax.random.normal(keys[1], kv_shape, DTYPE),
            jax.random.normal(keys[2], kv_shape, DTYPE))
    if kernel == "attn_prefill":
        return jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation=prefill_implementation)), args
    if kernel == "attn_split_k":
        return jax.jit(split_k_part if split else unsplit_decode), args
    every_position = jnp.ones((1, 1, 1, kv_shape[1]), bool)
    return jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=every_position)), args


def unsplit_decode(q_BSHE, k_BTKE, v_BTKE):
    """Decode attention as the model runs it over a whole cache: the visible positions given as lengths, cuDNN's
    fused kernel on NVIDIA GPUs, XLA's elsewhere."""
    lengths_B = jnp.full((q_BSHE.shape[0],), k_BTKE.shape[1], jnp.int32)
    cuda = jax.devices()[0].platform == "gpu" and "cuda" in jax.devices()[0].client.platform_version.lower()
    return jax.nn.dot_product_attention(q_BSHE, k_BTKE, v_BTKE, key_value_seq_lengths=lengths_B,
                                        implementation="cudnn" if cuda else None)


def split_k_part(q_BSHE, k_BTKE, v_BTKE):
    """One partition's split-K part over its slots, then the merge's combine (of the one part this device holds)."""
    visible_BST = jnp.ones((q_BSHE.shape[0], q_BSHE.shape[1], k_BTKE.shape[1]), bool)
    part = partial_attention(q_BSHE, k_BTKE, v_BTKE, visible_BST)
    return combine_partials(jax.tree.map(lambda field: field[None], part)).out.astype(q_BSHE.dtype)


def measure(kernel: Kernel, warmup: int, calls: int, rounds: int, prefill_implementation: str = "xla") -> Measured:
    """Time the flat and hierarchical kernels alternately for `rounds` rounds; median of each one's round means
    (`harness.alternating_rounds`)."""
    seconds = harness.alternating_rounds(
        {"flat": program(kernel.kernel, kernel.flat_shape, jax.random.key(0), prefill_implementation),
         "hier": program(kernel.kernel, kernel.hier_shape, jax.random.key(1), prefill_implementation, split=True)},
        rounds=rounds, warmup=warmup, calls=calls)
    flat_s, hier_s = seconds["flat"].median, seconds["hier"].median
    flat_rate = flops(kernel.kernel, kernel.flat_shape) / flat_s / 1e12
    hier_rate = flops(kernel.kernel, kernel.hier_shape) / hier_s / 1e12
    return Measured(**asdict(kernel), flat_us=flat_s * 1e6, hier_us=hier_s * 1e6, flat_tflops=flat_rate,
                    hier_tflops=hier_rate, speedup=hier_rate / flat_rate, time_ratio=flat_s / hier_s)


def shape_text(shape: list) -> str:
    if isinstance(shape[0], list):
        return " / ".join("x".join(map(str, part)) for part in shape)
    return "x".join(map(str, shape))


def table(rows: list[Measured], flat: str, hier: str) -> str:
    """A markdown table of the measurements."""
    lines = [f"| kernel | case | {flat} shape | {hier} shape | {flat} TFLOP/s | {hier} TFLOP/s | speedup | "
             f"time {flat}/{hier} |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r.kernel} | {r.case} | {shape_text(r.flat_shape)} | {shape_text(r.hier_shape)} | "
              f"{r.flat_tflops:.4g} | {r.hier_tflops:.4g} | {r.speedup:.2f} | {r.time_ratio:.2f} |" for r in rows]
    return "\n".join(lines)


def pairs(text: str) -> tuple[int, int]:
    """"8x4096" -> (8, 4096)."""
    first, _, second = text.partition("x")
    if not (first.isdigit() and second.isdigit()):
        raise argparse.ArgumentTypeError(f"{text!r}: expected BATCHxLENGTH, e.g. 8x4096")
    return int(first), int(second)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_model_arguments(parser, model="llama3-70b")
    parser.add_argument("--topology", default="mi300x-cpx-nps1:8",
                        help="mesh the layouts are placed on: PRESET:GPUS or GPUSxPARTITIONS")
    parser.add_argument("--flat", default="flat_tp", help="the flat layout")
    parser.add_argument("--hier", default="starscream_tp", help="the hierarchical layout")
    parser.add_argument("--tokens", type=int, nargs="*", default=[4096, 16384], help="tokens per step (global)")
    parser.add_argument("--prefill", type=pairs, nargs="*", default=[(8, 4096), (64, 2048)],
                        help="prefill cases, BATCHxSEQ")
    parser.add_argument("--decode", type=pairs, nargs="*", default=[(64, 8192), (256, 4096)],
                        help="decode cases, BATCHxCACHE_LENGTH")
    parser.add_argument("--split-k", type=pairs, nargs="*", default=[(1, 8192), (1, 16384), (1, 32768)],
                        help="split-K decode cases, BATCHxCACHE_LENGTH (rows: gpu_tp unsplit vs one partition's "
                             "part under starscream_decode)")
    parser.add_argument("--prefill-implementation", choices=("xla", "cudnn"), default="xla",
                        help="jax.nn.dot_product_attention implementation for prefill (the model uses xla)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating flat / hier rounds")
    harness.add_run_arguments(parser, warmup=5, steps=20, steps_flag="--calls", steps_help="timed calls per round",
                              quick="tiny model on 2x4, small shapes, few calls (seconds on a CPU)")
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.topology, args.tokens = "tiny", "2x4", [64]
        args.prefill, args.decode, args.warmup, args.calls, args.rounds = [(8, 32)], [(8, 64)], 1, 2, 1
        args.split_k = [(1, 64)]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    config = harness.model_config(args)
    flat, hier = get_layout(args.flat), get_layout(args.hier)
    mesh = layout_mesh(args.topology)
    info = harness.run_info(__file__, argv)
    print(f"{config.name} under {flat.name} vs {hier.name} on mesh {dict(mesh.shape)}; one {info.device_kind} "
          f"({info.platform}), jax {info.jax}, bf16, mean of {args.calls} calls after {args.warmup} "
          f"warm-up, median of {args.rounds} rounds", file=sys.stderr)
    meta = {"model": config.name, "topology": args.topology, "mesh": dict(mesh.shape), "flat": flat.name,
            "hier": hier.name, "device": info.device_kind, "dtype": "bfloat16",
            "prefill_implementation": args.prefill_implementation, "warmup": args.warmup, "calls": args.calls,
            "rounds": args.rounds, **info.as_dict()}
    result = {"meta": meta, "kernels": []}
    rows = result["kernels"]
    found = kernels(config, flat, hier, mesh, args.tokens, args.prefill, args.decode)
    for kernel in found + split_k_kernels(config, mesh, args.split_k):
        rows.append(measure(kernel, args.warmup, args.calls, args.rounds, args.prefill_implementation))
        print(f"  {kernel.kernel} {kernel.case}: speedup {rows[-1].speedup:.2f}", file=sys.stderr)
        harness.write_json(args.out, result)
    print(table(rows[:len(found)], flat.name, hier.name))
    print(table(rows[len(found):], "gpu_tp (unsplit)", "split-K part"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
