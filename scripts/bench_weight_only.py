"""Decode's projections with 8-bit weights, one at a time: the library's weight-only kernel (model/weight_only.py)
against XLA's path as decode ran it before (a GEMM of the weights converted to bfloat16, `projections.project` with
eight_bit_matmul "xla", compiled with the 8-bit decode options) and against the bfloat16 GEMM of the same shape
(`projections.project` of bfloat16 weights, decode's options: cuBLAS, one-row projections padded as decode pads them).

Shapes: each projection of the model's layer as x [M, K] @ W [K, N] (Llama 3 8B: q and o 4096 x 4096, k and v 4096 x
1024, gate and up 4096 x 14336, down 14336 x 4096) at M = 1 and 64 rows (decode's batches), int8 and fp8 e4m3 weights
with float32 scales per output channel. Each timed call multiplies x by `copies` distinct weights of the shape, together
at least --gigabytes of 8-bit weights (at most MAX_COPIES), so that no weight stays in the GPU's L2 between uses, as in
a decode step, which reads 32 layers' weights; rate = weight bytes read (values and scales; bfloat16: 2 per value) /
time. On Hopper and newer the Mosaic GPU kernel (model/weight_only_mosaic.py: TMA copies into a ring of shared-memory
stages, warpgroup MMA) is timed beside it ("mosaic", its weights transposed once beforehand, as loading would hold
them). The kernel runs with its default blocks (every shape first, with XLA's path and bf16) and then, while
--budget-s lasts, each of ALTERNATIVE_BLOCKS (its best is reported beside the default, a guide to the defaults),
every candidate checked against XLA's product. Candidates take turns in
rounds (`harness.alternating_rounds`). "layer" sums the seven projections of one layer per implementation.

"grouped_layer" times one layer's seven projections as one program per implementation, as decode runs them: the
grouped kernel (model/weight_only_group.py: q, k, v in one launch, gate and up in one, o and down alone: 4
launches), the single-projection kernel (7 launches), XLA's converting GEMMs and bfloat16 GEMMs; each call runs
LAYER_COPIES distinct layers' weights (no layer's weights stay in L2). --layer-only times only these;
--layer-alternatives adds the grouped kernel at each of LAYER_ALTERNATIVE_BLOCKS' tilings; --profile-dir (GPU) traces
the grouped kernel's and bfloat16's layer calls too and stores each one's kernels (`layer_traces`).

    python scripts/bench_weight_only.py --out weight_only.json             # on the GPU
    python scripts/bench_weight_only.py --layer-only --out layer.json      # the grouped launches per layer
    python scripts/bench_weight_only.py --quick                            # CPU smoke run, kernel interpreted
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

from starscream_jax.benchmarks import harness

ALTERNATIVE_BLOCKS = ({"reduce": "sum", "depth": 64}, {"cols": 64, "depth": 128},
                      {"cols": 256, "depth": 32, "warps": 8}, {"splits": 1})
"""Blocks tried beside the default (weight_only.Blocks fields); "sum" only where the rows are at most 4."""
ROWS = (1, 64)
MAX_COPIES = 16
"""At most this many distinct weights per call (k and v of Llama 3 8B: 16 x 4.2 MB, beyond the H200's 50 MB L2;
each copy is one more kernel call for the compiler)."""


def projections(config) -> list[tuple[str, int, int]]:
    """(names, K, N) of each distinct projection shape of one layer, names joined by "," (k,v and gate,up share)."""
    D, HE, KE, F = config.d_model, config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim, config.d_ff
    return [("q", D, HE), ("k,v", D, KE), ("o", HE, D), ("gate,up", D, F), ("down", F, D)]


def copies_for(weight_bytes: int, gigabytes: float) -> int:
    """Distinct weights per timed call: together at least `gigabytes`, 1 to MAX_COPIES."""
    return min(MAX_COPIES, max(1, math.ceil(gigabytes * 1e9 / weight_bytes)))


def candidates(rows: int, implementation: str, quick: bool) -> dict:
    """{name: weight_only.Blocks} of the kernel to time at `rows` rows: "kernel" (the defaults), and in a full
    run each of ALTERNATIVE_BLOCKS that applies."""
    from starscream_jax.model.weight_only import DEFAULT_BLOCKS, Blocks

    found = {"kernel": DEFAULT_BLOCKS}
    if quick:
        return found
    for fields in ALTERNATIVE_BLOCKS:
        if fields.get("reduce") == "sum" and rows > 4:
            continue
        found["kernel " + ",".join(f"{key}={value}" for key, value in fields.items())] = Blocks(**fields)
    return found


def programs(config, K: int, N: int, rows: int, format_name: str, copies: int, implementation: str, quick: bool):
    """{name: (jitted function, args, weight bytes per call)} of the candidates for one shape, and x."""
    import jax
    import jax.numpy as jnp

    from starscream_jax.hardware.backend import policy_of
    from starscream_jax.model import projections as model_projections
    from starscream_jax.model.quantize import Scaled, quantize
    from starscream_jax.model import weight_only_mosaic
    from starscream_jax.model.weight_only import weight_only_matmul
    from starscream_jax.sharding.apply import UNPLACED
    from starscream_jax.training.steps import decode_options as step_options

    keys = jax.random.split(jax.random.key(K * 7 + N + rows), copies + 1)
    x = jax.random.normal(keys[0], (rows, 1, K), jnp.float32).astype(jnp.bfloat16)
    make = jax.jit(lambda key: quantize(jax.random.normal(key, (K, N), jnp.float32), "w_gate", ("embed", "mlp"),
                                        format_name))
    scaled = [Scaled(*make(key)) for key in keys[1:]]
    dequantize = jax.jit(lambda w: (w.values.astype(jnp.float32) * w.scale).astype(jnp.bfloat16))
    floats = [dequantize(w) for w in scaled]
    policy = policy_of(jax.devices()[0])
    decode_options, eight_bit_options, ptx = step_options(policy, False), step_options(policy, True), policy.inline_ptx
    xla_config = config.replace(eight_bit_matmul="xla")
    out = ("batch", "seq", "mlp")

    def project(x, weights):
        return [model_projections.project("bench", "bsd,df->bsf", x, w, out, xla_config, UNPLACED)
                for w in weights]

    def kernel(blocks):
        def run(x, weights):
            return [weight_only_matmul(x[:, 0], w.values, w.scale, implementation, blocks, ptx)[:, None]
                    for w in weights]
        return jax.jit(run, compiler_options=decode_options or None)

    def mosaic_run(x, weights):
        return [weight_only_mosaic.mosaic_weight_only_matmul(x[:, 0], w.values, w.scale)[:, None] for w in weights]

    eight_bit_bytes = sum(w.values.nbytes + w.scale.nbytes for w in scaled)
    found = {name: (kernel(blocks), (x, scaled), eight_bit_bytes)
             for name, blocks in candidates(rows, implementation, quick).items()}
    if weight_only_mosaic.available() and weight_only_mosaic.applies(rows, K, N):
        held = [Scaled(weight_only_mosaic.transposed(w.values), w.scale) for w in scaled]  # as loading would hold them
        found["mosaic"] = (jax.jit(mosaic_run, compiler_options=decode_options or None), (x, held), eight_bit_bytes)
    found["xla"] = (jax.jit(project, compiler_options=eight_bit_options or None), (x, scaled), eight_bit_bytes)
    found["bf16"] = (jax.jit(project, compiler_options=decode_options or None), (x, floats),
                     sum(w.nbytes for w in floats))
    return found


LAYER_COPIES = 2
"""Distinct layers per timed call of a whole layer (Llama 3 8B's 8-bit layer is 218 MB, four times the L2)."""
LAYER_IMPLEMENTATIONS = ("grouped", "kernel", "mosaic", "xla", "bf16")
""""mosaic": the Mosaic GPU kernel on Hopper and newer only, one launch a group of LAYER_GROUPS as the grouped kernel
launches them, each group's weights held transposed and joined along N ([N_q + N_k + N_v, K]) once beforehand."""


def layer_weights(config, format_name: str, seed: int) -> dict:
    """{projection: quantize.Scaled [K, N]} of one layer (q, k, v, o, gate, up, down), random, per channel."""
    import jax
    import jax.numpy as jnp

    from starscream_jax.model.quantize import Scaled, quantize

    make = jax.jit(lambda key, K, N: quantize(jax.random.normal(key, (K, N), jnp.float32), "w_gate",
                                              ("embed", "mlp"), format_name), static_argnums=(1, 2))
    shapes = {name: (K, N) for names, K, N in projections(config) for name in names.split(",")}
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return {name: Scaled(*make(key, K, N)) for key, (name, (K, N)) in zip(keys, shapes.items())}


LAYER_GROUPS = (("q", "k", "v"), ("o",), ("gate", "up"), ("down",))
"""The projections that share an input, one launch each on the grouped kernel."""


LAYER_ALTERNATIVE_BLOCKS = ({"convert": "cast"}, {"convert": "half"}, {"convert": "half", "stages": 6},
                            {"convert": "half", "depth": 128, "warps": 8}, {"stages": 6}, {"depth": 128, "warps": 8})
"""Tilings of the grouped kernel tried beside its choice (`weight_only_group.blocks_for`) with --layer-alternatives:
each conversion (`weight_only.Blocks.convert`: the other one is the choice's alternative), 16 KB a loop step, deeper
pipelines. Over seven rounds on the H200 (h200_weight_only_layer_rounds7.json) float16 won for e4m3 weights at 1 and 16
rows, now their choice, and lost for int8; no tiling beat the choice by more than the rounds' spread."""


def layer_alternatives(args) -> tuple[dict, ...]:
    """The tilings --layer-alternatives adds: LAYER_ALTERNATIVE_BLOCKS, or in a --quick run (the kernel interpreted,
    slowly) the first two, each conversion once."""
    if not args.layer_alternatives:
        return ()
    return LAYER_ALTERNATIVE_BLOCKS[:2] if args.quick else LAYER_ALTERNATIVE_BLOCKS


def grouped_blocks(rows: int, format_name: str, fields: dict):
    """`weight_only_group.blocks_for(rows, format)` with `fields` replaced (a weight_only.Blocks)."""
    import dataclasses

    from starscream_jax.model.weight_only_group import blocks_for

    return dataclasses.replace(blocks_for(rows, format_name), **fields)


def layer_function(name: str, implementation: str, config, blocks=None):
    """f(x_by_input, layers) -> outputs of every projection of every layer, as `name` (LAYER_IMPLEMENTATIONS, or
    "grouped ..." with `blocks`) runs them. x_by_input: {group's first projection: x [M, K]}; layers:
    [{projection: Scaled or bf16 [K, N]}], or for "mosaic" [{group: Scaled [N_group, K]}] (`mosaic_layer`)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from starscream_jax.hardware.backend import policy_of
    from starscream_jax.model import projections as model_projections
    from starscream_jax.model.weight_only import weight_only_matmul
    from starscream_jax.model.weight_only_group import grouped_weight_only_matmul
    from starscream_jax.model.weight_only_mosaic import mosaic_weight_only_matmul
    from starscream_jax.sharding.apply import UNPLACED

    xla_config = config.replace(eight_bit_matmul="xla")
    ptx = policy_of(jax.devices()[0]).inline_ptx
    width = {name: N for names, _, N in projections(config) for name in names.split(",")}

    def run(xs, layers):
        outputs = []
        for weights in layers:
            for group in LAYER_GROUPS:
                x = xs[group[0]]
                if name.startswith("grouped"):
                    outputs += grouped_weight_only_matmul(x, [tuple(weights[p]) for p in group], implementation,
                                                          blocks, ptx)
                elif name == "kernel":
                    outputs += [weight_only_matmul(x, *weights[p], implementation, ptx=ptx) for p in group]
                elif name == "mosaic":
                    joined = mosaic_weight_only_matmul(x, *weights[group])
                    outputs += jnp.split(joined, np.cumsum([width[p] for p in group])[:-1].tolist(), axis=1)
                else:
                    outputs += [model_projections.project("bench", "bsd,df->bsf", x[:, None], weights[p],
                                                          ("batch", "seq", "mlp"), xla_config, UNPLACED)[:, 0]
                                for p in group]
        return outputs

    return run


def mosaic_layer(layer: dict) -> dict:
    """One layer's weights as the Mosaic kernel's layer row reads them: per group of LAYER_GROUPS (a tuple key) the
    members' 8-bit values transposed and joined along N, [N_group, K], with their scales [N_group]."""
    import jax.numpy as jnp

    from starscream_jax.model.quantize import Scaled
    from starscream_jax.model.weight_only_mosaic import transposed

    return {group: Scaled(jnp.concatenate([transposed(layer[p].values) for p in group]),
                          jnp.concatenate([jnp.broadcast_to(layer[p].scale, (layer[p].values.shape[1],))
                                           for p in group]))
            for group in LAYER_GROUPS}


def layer_programs(config, rows: int, format_name: str, implementation: str, alternatives=()) -> dict:
    """{name: (jitted function, args, weight bytes per layer)} of LAYER_IMPLEMENTATIONS at `rows` rows, and of
    the grouped kernel with each of `alternatives` (fields of weight_only.Blocks) in place of its own tiling."""
    import jax
    import jax.numpy as jnp

    from starscream_jax.hardware.backend import policy_of
    from starscream_jax.model import weight_only_mosaic
    from starscream_jax.training.steps import decode_options as step_options

    layers = [layer_weights(config, format_name, seed) for seed in range(LAYER_COPIES)]
    floats = [{p: (w.values.astype(jnp.float32) * w.scale).astype(jnp.bfloat16) for p, w in layer.items()}
              for layer in layers]
    xs = {group[0]: jax.random.normal(jax.random.key(rows), (rows, layers[0][group[0]].values.shape[0]),
                                      jnp.float32).astype(jnp.bfloat16) for group in LAYER_GROUPS}
    policy = policy_of(jax.devices()[0])
    decode_options, eight_bit_options = step_options(policy, False), step_options(policy, True)
    eight_bit_bytes = sum(w.values.nbytes + w.scale.nbytes for w in layers[0].values())
    found = {}
    held = {"bf16": floats, "mosaic": [mosaic_layer(layer) for layer in layers]}
    for name in LAYER_IMPLEMENTATIONS:
        if name == "mosaic" and not weight_only_mosaic.available():
            continue
        options = eight_bit_options if name == "xla" else decode_options
        function = jax.jit(layer_function(name, implementation, config), compiler_options=options or None)
        found[name] = ((function, (xs, held.get(name, layers))),
                       sum(w.nbytes for w in floats[0].values()) if name == "bf16" else eight_bit_bytes)
    for fields in alternatives:
        name = "grouped " + ",".join(f"{key}={value}" for key, value in fields.items())
        function = layer_function(name, implementation, config, grouped_blocks(rows, format_name, fields))
        found[name] = ((jax.jit(function, compiler_options=decode_options or None), (xs, layers)), eight_bit_bytes)
    return found


def measure_layer(config, rows: int, format_name: str, args, implementation: str) -> dict:
    """One layer's seven projections per implementation (`layer_programs`): seconds per layer, weight bytes per
    second, ratios of the grouped kernel to the others, the error of each against XLA's products, pallas launches."""
    import jax
    import numpy as np

    found = layer_programs(config, rows, format_name, implementation,
                           layer_alternatives(args))
    compiled, result = {}, {"format": format_name, "rows": rows, "layers_per_call": LAYER_COPIES}
    for name, ((function, call_args), _) in found.items():
        try:
            outputs = jax.block_until_ready(function(*call_args))
            compiled[name] = (function, call_args, outputs)
            # the jaxpr of the function itself: on the GPU (JAX 0.11) `function.trace` refused the jit's
            # compiler_options ("can only be passed to top-level jax.jit") and every row was marked failed
            result[f"{name}_launches"] = str(jax.make_jaxpr(function.__wrapped__)(*call_args)).count("pallas_call") \
                or None
        except Exception as error:  # noqa: BLE001 - reported, not fatal
            result[f"{name}_error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
    timed = harness.alternating_rounds({name: entry[:2] for name, entry in compiled.items()}, rounds=args.rounds,
                                       warmup=args.warmup, calls=args.calls)
    for name, rounds in timed.items():
        seconds = rounds.median / LAYER_COPIES
        result.update({f"{name}_s": seconds, f"{name}_bytes_per_s": found[name][1] / seconds})
        if "xla" in compiled and name != "bf16":
            got, expected = (np.concatenate([np.asarray(o, np.float32).ravel() for o in compiled[n][2]])
                             for n in (name, "xla"))
            result[f"{name}_error_vs_xla"] = float(np.linalg.norm(got - expected) / np.linalg.norm(expected))
    for other in ("kernel", "mosaic", "xla", "bf16"):
        if "grouped" in timed and other in timed:
            result[f"grouped_over_{other}"] = timed[other].median / timed["grouped"].median
    grouped = {name: rounds.median for name, rounds in timed.items() if name.startswith("grouped")}
    if grouped and "bf16" in timed:
        result["best_grouped"] = min(grouped, key=grouped.get)
        result["best_grouped_over_bf16"] = timed["bf16"].median / min(grouped.values())
    if args.profile_dir:
        result["layer_traces"] = layer_traces(compiled, args.profile_dir / f"{format_name}-{rows}", args.calls)
    return result


TRACED = ("grouped", "bf16")
"""The layer implementations --profile-dir traces: the grouped kernel as decode runs it, and bfloat16's GEMMs."""


def layer_traces(compiled: dict, directory: Path, calls: int) -> dict:
    """{implementation: its device time per call by category and its 8 longest kernels (`analysis.profile.
    time_breakdown`: seconds and launches per call; a call runs LAYER_COPIES layers)} of each of TRACED's compiled
    layer programs, `calls` calls traced under `directory`/<implementation>."""
    traces = {}
    for name in TRACED:
        if name not in compiled:
            continue
        function, call_args, _ = compiled[name]
        hlo_text = function.lower(*call_args).compile().as_text()

        def step(state, run=function, run_args=call_args):
            return state, run(*run_args)

        _, breakdown = harness.traced_breakdown(step, None, steps=calls, directory=directory / name, hlo_text=hlo_text)
        traces[name] = {"per_call_s": breakdown["per_step_s"], "top_kernels": breakdown["top_kernels"][:8]}
    return traces


def layer_line(result: dict) -> str:
    times = " ".join(f"{name} {1e6 * result[name + '_s']:.0f} us ({result[name + '_bytes_per_s'] / 1e12:.2f} TB/s)"
                     for name in LAYER_IMPLEMENTATIONS if name + "_s" in result)
    ratios = ", ".join(f"over {other} {result['grouped_over_' + other]:.2f}x"
                       for other in ("kernel", "mosaic", "xla", "bf16") if "grouped_over_" + other in result)
    errors = "; ".join(f"{key[:-len('_error')]}: {value}" for key, value in result.items() if key.endswith("_error"))
    best = (f"; best grouped tiling {result['best_grouped']} {result['best_grouped_over_bf16']:.2f}x bf16"
            if "best_grouped" in result else "")
    return (f"one layer, {result['format']} at {result['rows']} rows: {times}; grouped {ratios}{best}"
            + (f"; FAILED {errors}" if errors else ""))


ESSENTIAL = ("kernel", "mosaic", "xla", "bf16")
"""The candidates every shape is timed with first (the Mosaic GPU kernel, `model.weight_only_mosaic`, on Hopper and
newer only, its weights transposed once beforehand); the alternative blocks follow while time is left."""


def measure_shape(config, names: str, K: int, N: int, rows: int, format_name: str, args, implementation: str,
                  alternatives: bool = False) -> list[dict]:
    """One row per candidate of one shape: seconds per projection, GB/s of weight bytes, the error against XLA's
    product, ratios to XLA's path and to bfloat16 (time over time). ESSENTIAL's candidates, or with
    `alternatives` the kernel's alternative blocks beside XLA's path (whose row is not returned again)."""
    import jax
    import numpy as np

    copies = copies_for(K * N, args.gigabytes)
    found = programs(config, K, N, rows, format_name, copies, implementation, args.quick)
    found = {name: entry for name, entry in found.items()
             if (name.startswith("kernel ") or name == "xla" if alternatives else name in ESSENTIAL)}
    compiled, failed = {}, {}
    for name, (function, call_args, _) in found.items():
        try:
            outputs = function(*call_args)
            jax.block_until_ready(outputs)
            compiled[name] = (function, call_args, outputs[0])
        except Exception as error:  # noqa: BLE001 - a candidate that does not compile is reported, not fatal
            failed[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
    timed = harness.alternating_rounds({name: entry[:2] for name, entry in compiled.items()}, rounds=args.rounds,
                                       warmup=args.warmup, calls=args.calls)
    expected = np.asarray(compiled["xla"][2], np.float32) if "xla" in compiled else None
    rows_out = []
    for name in found:
        row = {"projection": names, "K": K, "N": N, "rows": rows, "format": format_name, "implementation": name,
               "copies": copies}
        if name in failed:
            rows_out.append({**row, "error": failed[name]})
            continue
        seconds = timed[name].median / copies
        weight_bytes = found[name][2] / copies
        row.update(seconds=seconds, weight_bytes=weight_bytes, bytes_per_s=weight_bytes / seconds,
                   rounds_s=[mean / copies for mean in timed[name].means])
        if expected is not None:
            got = np.asarray(compiled[name][2], np.float32)
            row["relative_error_vs_xla"] = float(np.linalg.norm(got - expected) / max(np.linalg.norm(expected), 1e-30))
        rows_out.append(row)
    for row in rows_out:
        for other in ("xla", "bf16"):
            if "seconds" in row and other in timed:
                row[f"speedup_over_{other}"] = timed[other].median / copies / row["seconds"]
    return [row for row in rows_out if not (alternatives and row["implementation"] == "xla")]


def with_bf16_ratio(row: dict, rows: list[dict]) -> dict:
    """An alternative's row with its ratio to the bfloat16 GEMM of the same shape timed in the first pass."""
    for other in rows:
        if other["implementation"] == "bf16" and "seconds" in other and "seconds" in row and all(
                other[key] == row[key] for key in ("projection", "rows", "format")):
            return {**row, "speedup_over_bf16": other["seconds"] / row["seconds"]}
    return row


def layer_totals(rows: list[dict]) -> list[dict]:
    """Per (format, rows): one layer's seven projections summed for the default kernel, the best kernel
    candidate of each shape, XLA's path and bfloat16, with the ratios."""
    totals = []
    for key in sorted({(row["format"], row["rows"]) for row in rows}):
        mine = [row for row in rows if (row["format"], row["rows"]) == key and "seconds" in row]
        sums = {"kernel": 0.0, "best kernel": 0.0, "xla": 0.0, "bf16": 0.0}
        complete = True
        for names in dict.fromkeys(row["projection"] for row in mine):
            count = len(names.split(","))
            shape_rows = {row["implementation"]: row["seconds"] for row in mine if row["projection"] == names}
            kernels = [s for name, s in shape_rows.items() if name.startswith("kernel")]
            if not all(name in shape_rows for name in ("kernel", "xla", "bf16")):
                complete = False
                continue
            sums["kernel"] += count * shape_rows["kernel"]
            sums["best kernel"] += count * min(kernels)
            sums["xla"] += count * shape_rows["xla"]
            sums["bf16"] += count * shape_rows["bf16"]
        total = {"format": key[0], "rows": key[1], "complete": complete, **{f"{k}_s": v for k, v in sums.items()}}
        if sums["kernel"] > 0:
            total.update(kernel_over_xla=sums["xla"] / sums["kernel"], kernel_over_bf16=sums["bf16"] / sums["kernel"],
                         best_over_bf16=sums["bf16"] / sums["best kernel"], xla_over_bf16=sums["bf16"] / sums["xla"])
        totals.append(total)
    return totals


def row_line(row: dict) -> str:
    head = f"{row['format']:<14} {row['rows']:>3} {row['projection']:<8} {row['K']:>6}x{row['N']:<6} " \
           f"{row['implementation']:<34}"
    if "error" in row:
        return head + " FAILED " + row["error"]
    ratios = " ".join(f"{row[key]:>6.2f}x" if key in row else f"{'':>7}"
                      for key in ("speedup_over_xla", "speedup_over_bf16"))
    error = row.get("relative_error_vs_xla")
    return (head + f" {1e6 * row['seconds']:>9.1f} {row['bytes_per_s'] / 1e9:>8.0f} {ratios} "
            f"{'' if error is None else f'{error:.1e}'}")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_model_arguments(parser, model="llama3-8b")
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS), help="token rows (decode's batch)")
    parser.add_argument("--formats", nargs="+", default=["int8", "float8_e4m3fn"],
                        choices=("int8", "float8_e4m3fn", "float8_e4m3fnuz"), help="8-bit weight formats")
    parser.add_argument("--gigabytes", type=float, default=0.15,
                        help="8-bit weight bytes per timed call (distinct copies of the shape, at most MAX_COPIES; "
                             "default 0.15 GB, three times the H200's L2)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (the median is reported)")
    parser.add_argument("--calls", type=int, default=5, help="calls per round")
    parser.add_argument("--budget-s", type=float, default=120.0,
                        help="seconds from the start after which no more shapes are timed with the alternative kernel "
                             "blocks, which follow the default kernel, XLA's path and bf16 of every shape (default "
                             "120)")
    parser.add_argument("--warmup", type=int, default=1, help="calls before each round's clock starts (default 1)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here (rewritten after every shape)")
    parser.add_argument("--layer-only", action="store_true",
                        help="time only one layer's projections per implementation (grouped launches, the "
                             "single-projection kernel, XLA, bf16), not each shape")
    parser.add_argument("--layer-alternatives", action="store_true",
                        help="also time one layer on the grouped kernel with each of LAYER_ALTERNATIVE_BLOCKS")
    parser.add_argument("--profile-dir", type=Path,
                        help="GPU: trace each layer's grouped kernel and bfloat16 GEMMs here and store their kernels")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: tiny model, 1 and 3 rows, int8, the kernel interpreted, one round")
    args = parser.parse_args(argv)
    if args.profile_dir and (args.quick or not args.layer_only):
        parser.error("--profile-dir traces the layer's kernels on a GPU: give it with --layer-only, without --quick "
                     "(which interprets the kernel on the CPU)")
    if args.quick:
        args.model, args.rows, args.formats, args.gigabytes, args.rounds, args.calls = \
            "tiny", [1, 3], ["int8"], 0.0, 1, 1
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax

    from starscream_jax.model.weight_only import default_implementation

    implementation = "interpret" if args.quick else default_implementation()
    config = harness.model_config(args, dtype="bfloat16")
    info = harness.run_info(__file__, argv)
    result = {"meta": {"model": config.name, "implementation": implementation, "gigabytes": args.gigabytes,
                       "rounds": args.rounds, "calls": args.calls, **info.as_dict()}, "rows": [], "layer": []}
    print(f"{config.name} projections on {info.device_kind}, jax {info.jax}, kernel {implementation}", flush=True)
    result["grouped_layer"] = []
    layer_rows = args.rows if not args.quick else args.rows[:1] if args.layer_only else []  # interpreting is slow
    for rows in layer_rows:
        for format_name in args.formats:
            result["grouped_layer"].append(measure_layer(config, rows, format_name, args, implementation))
            print(layer_line(result["grouped_layer"][-1]), flush=True)
            harness.write_json(args.out, result)
    if args.layer_only:
        return 0
    print(f"{'format':<14} {'M':>3} {'proj':<8} {'K x N':<13} {'implementation':<34} {'us':>9} {'GB/s':>8} "
          f"{'vs xla':>7} {'vs bf16':>7} error vs xla", flush=True)
    deadline = time.perf_counter() + args.budget_s
    cases = [(format_name, rows, shape) for rows in args.rows for format_name in args.formats
             for shape in projections(config)]  # every format at the first rows (batch 1) first
    for format_name, rows, (names, K, N) in cases:
        for row in measure_shape(config, names, K, N, rows, format_name, args, implementation):
            row["elapsed_s"] = time.perf_counter() - (deadline - args.budget_s)
            result["rows"].append(row)
            print(row_line(row), flush=True)
        harness.write_json(args.out, result)
    summarize(result, args.out)
    for format_name, rows, (names, K, N) in ([] if args.quick else cases):
        if time.perf_counter() > deadline:
            print(f"--budget-s {args.budget_s:.0f} spent: the remaining alternative blocks are not tried", flush=True)
            break
        for row in measure_shape(config, names, K, N, rows, format_name, args, implementation, alternatives=True):
            result["rows"].append(with_bf16_ratio(row, result["rows"]))
            print(row_line(result["rows"][-1]), flush=True)
        harness.write_json(args.out, result)
    if not args.quick:
        summarize(result, args.out)
    jax.clear_caches()
    return 0


def summarize(result: dict, out: Path | None) -> None:
    """Stores and prints the sums per layer of the rows so far (`layer_totals`)."""
    result["layer"] = layer_totals(result["rows"])
    harness.write_json(out, result)
    for total in result["layer"]:
        if "kernel_over_bf16" in total:
            print(f"one layer, {total['format']} at {total['rows']} rows: kernel {1e6 * total['kernel_s']:.0f} us, "
                  f"XLA {1e6 * total['xla_s']:.0f} us, bf16 {1e6 * total['bf16_s']:.0f} us; kernel over XLA "
                  f"{total['kernel_over_xla']:.2f}x, over bf16 {total['kernel_over_bf16']:.2f}x (best blocks "
                  f"{total['best_over_bf16']:.2f}x), XLA's over bf16 {total['xla_over_bf16']:.2f}x", flush=True)


if __name__ == "__main__":
    sys.exit(main())
