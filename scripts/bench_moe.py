"""The routed mixture-of-experts block against the dense one it replaced, timed side by side on one accelerator.

Two measurements, each a ratio taken within one run:
  layer  one MoE layer of Mixtral 8x7B's shape (D 4096, F 14336, 8 experts, 2 per token) on T tokens, forward and
         backward (gradients of the tokens and every weight), bfloat16: the routed block (`moe.routed_mlp`), the dense
         block (every expert on every token, weighted by its gate: `moe.dense_experts`), and a dense SwiGLU GEMM of
         the routed block's total shape (T x k rows through one expert's weights: the same FLOPs in one matmul). Each
         row's TFLOP/s counts the routed FLOPs (6 x T x k x 3 x D x F, forward and backward), so they compare
         directly; the target is routed >= half the GEMM's.
  step   a whole training step (`training.steps.train_step`: AdamW, clipping) of the many-expert model (Qwen3-30B-A3B's
         shape cut to a few layers) with the routed block and with the dense block; the FLOP-proportional speed-up is
         `flops_per_token` of the dense model (every expert counted) over the routed one's, and the measured speed-up
         should reach it within 30%. The loss and gradients alone (the step less the optimizer's update, whose
         memory traffic over the float32 parameters and moments routing does not change) are timed beside it.
Method: each program jitted and compiled first, then the candidates alternate over rounds of N timed calls each; the
median of the round means is reported.

    python scripts/bench_moe.py --out moe.json        # on a GPU
    python scripts/bench_moe.py --quick               # a tiny smoke test on CPU
"""
from __future__ import annotations

import argparse
import functools
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from starscream_jax.benchmarks import harness
from starscream_jax.cli.arguments import count
from starscream_jax.model import decoder, moe
from starscream_jax.model.catalog import load_model_config
from starscream_jax.model.layer_weights import RoutedMlpWeights
from starscream_jax.training.config import TrainConfig
from starscream_jax.training.steps import accumulated_gradients, make_optimizer, train_step


def dense_block(c, h_BSD, w):
    """The dense block on the same routing, with the routed block's signature (`moe.routed_mlp`)."""
    dtype = jnp.dtype(c.dtype)
    h_TD = h_BSD.reshape(-1, h_BSD.shape[-1])
    gates, experts, _ = moe.route(h_TD, w.router, c.experts_per_token, c.normalize_gates)
    weights = [weight.astype(dtype) for weight in (w.w_gate, w.w_up, w.w_down)]
    return moe.dense_experts(h_TD, gates, experts, *weights).reshape(h_BSD.shape), jnp.zeros((), jnp.float32)


def gemm_block(c, h_BSD, w):
    """A dense SwiGLU MLP on T x k rows (each token repeated k times) through expert 0's weights: the routed
    block's FLOPs as one matmul per projection."""
    dtype = jnp.dtype(c.dtype)
    rows_AD = jnp.repeat(h_BSD.reshape(-1, h_BSD.shape[-1]), c.experts_per_token, axis=0)
    gate, up, down = (weight[0].astype(dtype) for weight in (w.w_gate, w.w_up, w.w_down))
    return (jax.nn.silu(rows_AD @ gate) * (rows_AD @ up)) @ down, jnp.zeros((), jnp.float32)


def layer_program(block, c):
    """(h, weights) -> gradients of sum(block(h)^2) with respect to h and every weight, jitted."""
    def loss(h, w):
        out = block(c, h, w)[0].astype(jnp.float32)
        return jnp.mean(out * out)
    return jax.jit(jax.grad(loss, argnums=(0, 1)))


def kernels(compiled) -> dict[str, int]:
    """How many instructions of the compiled program are ragged dots, gemm / fused custom-calls and plain dots, by
    kind (what the accelerator actually runs the grouped matmuls as)."""
    counts: dict[str, int] = {}
    for line in compiled.as_text().splitlines():
        target = re.search(r'custom_call_target="([^"]+)"', line)
        kind = target.group(1) if target else next((op for op in (" ragged-dot(", " dot(") if op in line), None)
        if kind:
            counts[kind.strip(" (")] = counts.get(kind.strip(" ("), 0) + 1
    return counts


def timed(programs: dict, args: dict, rounds: int, calls: int, profile_dir: Path | None = None) -> dict[str, dict]:
    """Compile each program (a jitted function, or an already compiled one), then alternate them over `rounds` of
    `calls` timed calls (`harness.alternating_rounds`); median round mean (s), and the kernels each ran. With
    `profile_dir`, each program's device time by category over 3 more traced calls (`harness.traced_breakdown`;
    the program's compiled text beside the trace, program.hlo.txt)."""
    compile_s, ran = {}, {}
    for name, program in list(programs.items()):
        start = time.perf_counter()
        if hasattr(program, "lower"):
            programs[name] = program = program.lower(*args[name]).compile()
        jax.block_until_ready(program(*args[name]))
        compile_s[name] = time.perf_counter() - start
        ran[name] = kernels(program)
    seconds = harness.alternating_rounds({name: (program, args[name]) for name, program in programs.items()},
                                         rounds=rounds, warmup=1, calls=calls)
    results = {name: {"seconds": seconds[name].median, "rounds": list(seconds[name].means),
                      "compile_and_first_call_s": compile_s[name], "kernels": ran[name]} for name in programs}
    if profile_dir is not None:
        for name, program in programs.items():
            directory = profile_dir / name
            directory.mkdir(parents=True, exist_ok=True)
            (directory / "program.hlo.txt").write_text(program.as_text())
            results[name]["time_breakdown"] = harness.traced_breakdown(
                lambda state, program=program, name=name: (state, program(*args[name])), None, steps=3,
                directory=directory, hlo_text=program.as_text())[1]
    return results


def layer_benchmark(tokens: int, quick: bool, rounds: int, calls: int, profile_dir: Path | None = None) -> dict:
    c = load_model_config("tiny-moe" if quick else "mixtral-8x7b", dtype="bfloat16")
    D, F, X, k = c.d_model, c.d_ff, c.n_experts, c.experts_per_token
    key = jax.random.key(0)
    keys = jax.random.split(key, 5)
    w = RoutedMlpWeights(router=jax.random.normal(keys[0], (D, X), jnp.float32) * D ** -0.5,
                         w_gate=jax.random.normal(keys[1], (X, D, F), jnp.bfloat16) * D ** -0.5,
                         w_up=jax.random.normal(keys[2], (X, D, F), jnp.bfloat16) * D ** -0.5,
                         w_down=jax.random.normal(keys[3], (X, F, D), jnp.bfloat16) * F ** -0.5)
    h = jax.random.normal(keys[4], (1, tokens, D), jnp.bfloat16)
    programs = {"routed": layer_program(moe.routed_mlp, c), "dense": layer_program(dense_block, c),
                "gemm": layer_program(gemm_block, c)}
    results = timed(programs, dict.fromkeys(programs, (h, w)), rounds, calls, profile_dir)
    routed_flops = 3 * 2 * tokens * k * 3 * D * F
    for row in results.values():
        row["tflops_of_routed_flops"] = routed_flops / row["seconds"] / 1e12
    _, experts, _ = moe.route(h[0], w.router, k, True)
    counts = np.bincount(np.asarray(experts).reshape(-1), minlength=X)
    return {"model": c.name, "tokens": tokens, "d_model": D, "d_ff": F, "experts": X, "experts_per_token": k,
            "routed_flops": routed_flops, "assignments_per_expert": counts.tolist(), "rows": results,
            "routed_over_gemm_tflops": results["routed"]["tflops_of_routed_flops"]
            / results["gemm"]["tflops_of_routed_flops"],
            "dense_over_routed_time": results["dense"]["seconds"] / results["routed"]["seconds"]}


def step_benchmark(layers: int, batch: int, seq: int, quick: bool, rounds: int, calls: int,
                   profile_dir: Path | None = None, grad_accum: int = 1) -> dict:
    c = load_model_config("tiny-moe" if quick else "qwen3-30b-a3b", n_layers=layers, load_balance_weight=0.0,
                          dtype="bfloat16")
    tokens = jax.random.randint(jax.random.key(1), (batch, seq + 1), 0, c.vocab_size, jnp.int32)
    programs, args = {}, {}
    graphdef, params, rest = nnx.split(decoder.Transformer(c, rngs=nnx.Rngs(0)), nnx.Param, ...)
    optimizer = make_optimizer(TrainConfig(), params)
    opt_state = jax.jit(optimizer.init)(params)
    for name, block in (("routed", moe.routed_mlp), ("dense", dense_block)):
        decoder.routed_mlp = block  # the decoder's MoE block, for this program's trace
        args[name] = (params, opt_state, rest, tokens)
        # The whole step (new parameters and optimizer state, and the loss), without donation so that each timed
        # call can take the same arguments; compiled here, while the decoder holds this block.
        step = train_step(graphdef, optimizer, grad_accum, under=None)
        whole_step = jax.jit(functools.partial(lambda s, *a: s(*a), step))
        programs[name] = whole_step.lower(*args[name]).compile()
        # The loss and its gradients alone (the step without the optimizer's update).
        args[f"{name}_gradients"] = (params, rest, tokens)
        gradients = jax.jit(functools.partial(accumulated_gradients, graphdef=graphdef, micro_batches=grad_accum))
        programs[f"{name}_gradients"] = gradients.lower(*args[f"{name}_gradients"]).compile()
    decoder.routed_mlp = moe.routed_mlp
    results = timed(programs, args, rounds, calls, profile_dir)
    routed_flops = c.flops_per_token(seq)
    dense_flops = c.replace(experts_per_token=c.n_experts).flops_per_token(seq)
    expected = dense_flops / routed_flops
    measured = results["dense"]["seconds"] / results["routed"]["seconds"]
    gradients = results["dense_gradients"]["seconds"] / results["routed_gradients"]["seconds"]
    for name, row in results.items():
        flops = routed_flops if name.startswith("routed") else dense_flops
        row["tokens_per_s"] = batch * seq / row["seconds"]
        row["tflops"] = flops * batch * seq / row["seconds"] / 1e12
    return {"model": c.name, "layers": layers, "batch": batch, "seq": seq, "grad_accum": grad_accum, "rows": results,
            "flop_proportional_speedup": expected, "measured_speedup": measured,
            "measured_over_flop_proportional": measured / expected,
            "gradients_speedup": gradients, "gradients_over_flop_proportional": gradients / expected}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8192, help="tokens through the MoE layer (default 8192)")
    parser.add_argument("--layers", type=int, default=4, help="layers of the many-expert model's step (default 4)")
    parser.add_argument("--batch", type=int, default=1, help="sequences in the step (default 1)")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--grad-accum", type=count, default=1,
                        help="micro-batches the step's sequences are split into, one optimizer update per step")
    parser.add_argument("--rounds", type=int, default=3, help="rounds the candidates alternate over (default 3)")
    parser.add_argument("--parts", nargs="+", choices=("layer", "step"), default=["layer", "step"],
                        help="which measurements to run (default both)")
    parser.add_argument("--profile-dir", type=Path,
                        help="trace 3 more calls of each program here and record its device time by category")
    harness.add_run_arguments(parser, warmup=None, steps=5, steps_flag="--calls", steps_help="timed calls per round",
                              quick="tiny shapes, the layer only unless --parts says more (a CPU smoke test)")
    args = parser.parse_args(argv)
    if args.batch % args.grad_accum:
        parser.error(f"--grad-accum {args.grad_accum} does not divide --batch {args.batch}: pass a divisor")
    if args.quick:
        args.tokens, args.layers, args.batch, args.seq, args.rounds, args.calls = 64, 1, 2, 16, 1, 1
        if "--parts" not in (sys.argv[1:] if argv is None else argv):
            args.parts = ["layer"]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    info = harness.run_info(__file__, argv)
    result = {**info.as_dict(), "device": info.device_kind}
    if "layer" in args.parts:
        report_layer(result, args)
    if "step" in args.parts:
        report_step(result, args)
    return 0


def report_layer(result: dict, args) -> None:
    """The MoE layer's measurement into `result` (printed, and written to --out)."""
    result["layer"] = layer_benchmark(args.tokens, args.quick, args.rounds, args.calls,
                                      args.profile_dir and args.profile_dir / "layer")
    layer = result["layer"]
    print(f"MoE layer {layer['model']} x {layer['tokens']} tokens, forward + backward, TFLOP/s of routed FLOPs:")
    for name, row in layer["rows"].items():
        print(f"  {name:7s} {row['seconds'] * 1e3:9.2f} ms  {row['tflops_of_routed_flops']:8.1f} TFLOP/s")
    print(f"  routed / GEMM TFLOP/s {layer['routed_over_gemm_tflops']:.3f} (target >= 0.5); "
          f"dense / routed time {layer['dense_over_routed_time']:.2f}")
    harness.write_json(args.out, result)


def report_step(result: dict, args) -> None:
    """The whole training step's measurement into `result` (printed, and written to --out)."""
    result["step"] = step_benchmark(args.layers, args.batch, args.seq, args.quick, args.rounds, args.calls,
                                    args.profile_dir and args.profile_dir / "step", args.grad_accum)
    step = result["step"]
    print(f"training step {step['model']}, {step['layers']} layers, {step['batch']} x {step['seq']} tokens"
          f" in {step['grad_accum']} micro-batch(es):")
    for name, row in step["rows"].items():
        print(f"  {name:17s} {row['seconds'] * 1e3:9.2f} ms  {row['tokens_per_s']:10,.0f} tokens/s  "
              f"{row['tflops']:8.1f} TFLOP/s")
    print(f"  speed-up {step['measured_speedup']:.2f} of a FLOP-proportional {step['flop_proportional_speedup']:.2f} "
          f"({step['measured_over_flop_proportional']:.2f}; target >= 0.7)")
    print(f"  loss and gradients alone (no optimizer update): speed-up {step['gradients_speedup']:.2f} "
          f"({step['gradients_over_flop_proportional']:.2f} of the FLOP-proportional)")
    harness.write_json(args.out, result)


if __name__ == "__main__":
    sys.exit(main())
