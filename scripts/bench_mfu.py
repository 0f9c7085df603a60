"""Training throughput and model FLOPs utilisation: the library's step under each layout beside a plain JAX Llama.

Both sides train the same model (default: models/llama3.2-1b.toml) on the same batch (default 8 x 2048 tokens) with
bfloat16 compute, float32 parameters and AdamW state, global-norm clipping and jit with donated state:

  plain JAX   `benchmarks.plain_llama`: pure functions over a params dict, `lax.scan` over the stacked layers,
              `jax.nn.dot_product_attention` with implementation="cudnn" on NVIDIA GPUs, plain data parallelism
              (batch split over the devices, parameters replicated). It starts from the library's initial
              parameters, so both sides must report the same loss at step 0.
  plain JAX TP / FSDP (`--plain tp fsdp`): the same functions with ordinary sharding annotations
              (`plain_param_specs`, `with_sharding_constraint`): Megatron tensor parallelism, or every weight stored
              split and gathered before use.
  library     `starscream_jax.training.loop.initial_state` / `training.steps.train_step` under each layout, on the
              mesh of the devices present (one H200: 1x1x1, where every layout places everything alike; two: 1x2x1).
  PyTorch     (where torch and a CUDA GPU are present; `--no-torch` leaves it out, `--quick` skips it): the
              torchtitan-style peer of scripts/torch_peers.py on one GPU, from a copy of the same initial
              parameters, on the same tokens, run before the JAX rows (JAX's GPU memory is not preallocated
              then); every row's ratio to it is "vs_torch".

Each step is compiled first, then run `--warmup` times, then `--steps` times on the clock (`harness.timed_steps`:
the clock stops once the last loss and the state are on hand). tokens/s = batch x seq_len x steps / seconds. MFU =
tokens/s x FLOPs per token / (devices x peak), with FLOPs per token from `ModelConfig.flops_per_token(seq_len)`: 6 x
the matmul parameters (embedding-as-head counted once) + 12 x layers x seq_len x heads x head_dim for attention
(PaLM's accounting: causal masking is not discounted). The peak is the H200 datasheet's dense bf16 figure, 989
TFLOP/s, unless --peak-tflops. Every row's step-0 loss must agree with plain JAX's (or the first row's) within
STEP0_LOSS_TOLERANCE, or the run exits 1; the check is printed and stored as "step0_check". `--compile-only`
compiles each row and runs nothing: the compile time of a deep model with and without the layer loop (`--unroll 1`
adds the rolled loop's rows). `--fp8` adds a row per layout with fp8 matmuls (`ModelConfig.matmul_format`: OCP e4m3
by default, as on H200 and MI355X; `--fp8 float8_e4m3fnuz` on MI300X) beside its bfloat16 row; its MFU is still
against the bf16 peak (the chips' dense fp8 peak is twice it), and its step-0 loss, computed from 8-bit operands,
is held to FP8_STEP0_LOSS_TOLERANCE. `--fp8-logits` adds a third row per layout with the vocabulary projection in
fp8 too (`ModelConfig.fp8_logits`).

    python scripts/bench_mfu.py --out mfu.json                        # every GPU present
    CUDA_VISIBLE_DEVICES=0 python scripts/bench_mfu.py --out mfu1.json
    python scripts/bench_mfu.py --gpus 2 --plain dp tp --layouts starscream_tp starscream_fsdp
    python scripts/bench_mfu.py --model llama3-8b --batch-size 1 --plain --layouts starscream_tp --unroll 1 \\
        --compile-only                                                # compile s, no loop and rolled loop
    python scripts/bench_mfu.py --plain --layouts gpu_tp --fp8        # bf16 and fp8 steps side by side
    python scripts/bench_mfu.py --quick                               # CPU smoke run (tiny model)
"""
from __future__ import annotations

import argparse
import functools
import re
import sys
import time
from collections import Counter
from pathlib import Path

from starscream_jax.benchmarks import harness
from starscream_jax.benchmarks.plain_llama import PLAIN_AXIS, plain_loss, plain_param_specs

H200_BF16_PEAK_TFLOPS = 989.0
FLOP_COUNTING = ("6 x matmul parameters (tied embedding counted once, as the head) + 12 x layers x seq_len x heads x "
                 "head_dim (attention, causal half not discounted): ModelConfig.flops_per_token(seq_len)")


def plain_optimizer(train_config, params: dict):
    """The library's optimizer on a params dict: global-norm clipping, AdamW (warm-up + cosine), no weight decay on
    norm scales."""
    import jax
    import optax

    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=train_config.learning_rate, warmup_steps=train_config.warmup_steps,
        decay_steps=max(train_config.steps, train_config.warmup_steps + 1),
        end_value=train_config.learning_rate * train_config.final_learning_rate_fraction)
    decay_mask = jax.tree_util.tree_map_with_path(lambda path, _: "norm" not in jax.tree_util.keystr(path), params)
    return optax.chain(optax.clip_by_global_norm(train_config.clip_norm),
                       optax.adamw(schedule, weight_decay=train_config.weight_decay, mask=decay_mask))


def plain_train_step(config, optimizer, attention_impl: str | None, parallelism: str = "dp"):
    """step(params, opt_state, tokens [B, S+1]) -> (params, opt_state, loss), jitted, params and state donated."""
    import jax
    import optax

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, tokens_BS1):
        loss, grads = jax.value_and_grad(plain_loss)(params, tokens_BS1, config, attention_impl, parallelism)
        with jax.named_scope("optimizer"):
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

    return step


def on_cuda(device) -> bool:
    """True for an NVIDIA GPU (where cuDNN attention exists)."""
    return device.platform == "gpu" and "cuda" in device.client.platform_version.lower()


# ---- measuring -----------------------------------------------------------------------------------------------------

def compiled_summary(text: str, compiled) -> dict:
    """What the compiled step calls out to (custom-call targets: cuDNN attention, cuBLAS GEMMs, ...), its
    collectives and its temporary memory."""
    memory = compiled.memory_analysis()
    return {"custom_calls": dict(Counter(re.findall(r'custom_call_target="([^"]+)"', text))),
            "collectives": dict(Counter(re.findall(r"\b(all-reduce|all-gather|reduce-scatter|all-to-all|"
                                                   r"collective-permute)(?:-start)?\(", text))),
            "temp_bytes": None if memory is None else int(memory.temp_size_in_bytes)}


def timed_run(step, state: tuple, constants: tuple, tokens, warmup: int, steps: int, profile_dir: Path | None = None,
              profiled_steps: int = 3, compile_only: bool = False) -> dict:
    """Compile `step(*state, *constants, tokens) -> (*state, loss)` (state donated), run warm-up then timed steps
    (`harness.timed_steps`).

    Returns compile_s, step_s (seconds per timed step), the loss of every step (the first is step 0's: the loss of
    the initial parameters) and the compiled program's summary; with `compile_only`, compile_s and the summary
    alone. With `profile_dir`, `profiled_steps` more steps run under the JAX profiler and "time_breakdown" holds
    their device time by category (`harness.traced_breakdown`)."""
    import jax

    start = time.perf_counter()
    compiled = step.lower(*state, *constants, tokens).compile()
    compile_s = time.perf_counter() - start
    text = compiled.as_text()
    result = {"compile_s": compile_s, **compiled_summary(text, compiled), "hlo": text}
    if compile_only:
        return result

    def advance(state):
        *state, loss = compiled(*state, *constants, tokens)
        return tuple(state), loss

    timed = harness.timed_steps(advance, tuple(state), warmup=warmup, steps=steps)
    result.update(step_s=timed.seconds_per_step, losses=[float(x) for x in jax.device_get(timed.outputs)])
    if profile_dir is not None:
        from starscream_jax.errors import StarscreamError

        try:
            result["time_breakdown"] = harness.traced_breakdown(advance, timed.state, steps=profiled_steps,
                                                                directory=profile_dir, hlo_text=text)[1]
        except StarscreamError as error:  # the trace stays on disk; the timing must not be lost
            result["time_breakdown_error"] = str(error)
    return result


PLAIN_NAMES = {"dp": "plain JAX", "tp": "plain JAX TP", "fsdp": "plain JAX FSDP"}


def plain_row(parallelism: str, library_params, model_config, train_config, mesh, tokens, warmup: int, steps: int,
              profile_dir: Path | None = None, suffix: str = "", compile_only: bool = False) -> dict:
    """The plain implementation over the mesh's devices as one flat axis ("dp", "tp" or "fsdp": see `plain_loss`),
    from a copy of `library_params`. The batch is split over the devices except under "tp". Named
    PLAIN_NAMES[parallelism] + `suffix`."""
    import jax
    import numpy as np
    from flax import nnx
    from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

    devices = mesh.devices.reshape(-1)
    plain_mesh = Mesh(np.asarray(devices), (PLAIN_AXIS,), axis_types=(AxisType.Auto,))
    pure = nnx.to_pure_dict(library_params)
    shardings = jax.tree.map(lambda spec: NamedSharding(plain_mesh, spec), plain_param_specs(pure, parallelism))
    params = jax.tree.map(lambda x, sharding: jax.device_put(x, sharding).copy(), pure, shardings)
    del pure  # never the library's buffers: the step donates its arguments
    optimizer = plain_optimizer(train_config, params)
    opt_state = jax.jit(optimizer.init)(params)
    batch_spec = PartitionSpec(None if parallelism == "tp" else PLAIN_AXIS, None)
    tokens = jax.device_put(tokens, NamedSharding(plain_mesh, batch_spec))
    attention_impl = "cudnn" if on_cuda(devices[0]) else None
    step = plain_train_step(model_config, optimizer, attention_impl, parallelism)
    with jax.set_mesh(plain_mesh):
        result = timed_run(step, (params, opt_state), (), tokens, warmup, steps, profile_dir,
                           compile_only=compile_only)
    return {"name": PLAIN_NAMES[parallelism] + suffix, "mesh": f"{parallelism.upper()} x{len(devices)}", **result}


def layout_row(layout: str, model_config, train_config, mesh, tokens, warmup: int, steps: int,
               profile_dir: Path | None = None, name: str | None = None, compile_only: bool = False) -> dict:
    """The library's training step (training.loop.initial_state / training.steps.train_step) under `layout`."""
    import jax

    from starscream_jax.sharding.apply import Placement, batch_sharding, use_layout
    from starscream_jax.training.loop import initial_state
    from starscream_jax.training.steps import train_step as make_train_step

    with use_layout(layout, mesh):
        graphdef, params, rest, optimizer, opt_state = initial_state(train_config, model_config, layout, mesh)
        train_step = make_train_step(graphdef, optimizer, under=Placement.of(layout, mesh))
        tokens = jax.device_put(tokens, batch_sharding(layout, mesh, train_config.batch_size))
        result = timed_run(train_step, (params, opt_state), (rest,), tokens, warmup, steps, profile_dir,
                           compile_only=compile_only)
    return {"name": name or layout, "mesh": "x".join(str(size) for size in mesh.shape.values()), **result}


def initial_params(model_config, train_config, layout: str, mesh):
    """The library's initial parameters (nnx.State, float32) under `layout`: the plain side starts from these."""
    from starscream_jax.sharding.apply import use_layout
    from starscream_jax.training.loop import initial_state

    with use_layout(layout, mesh):
        return initial_state(train_config, model_config, layout, mesh)[1]


def host_initial_params(model_config, train_config) -> dict:
    """The library's initial parameters (`initial_params`, `nnx.to_pure_dict` form) as numpy arrays, computed on one
    CPU device: the values every row starts from (the same seed), without JAX's GPU allocator growing by the
    parameters and optimizer state before the PyTorch peer runs."""
    import jax
    import numpy as np
    from flax import nnx

    from starscream_jax.hardware.mesh import build_mesh

    cpu_mesh = build_mesh("1x1", devices=jax.devices("cpu")[:1])
    params = initial_params(model_config, train_config, "gpu_tp", cpu_mesh)
    return jax.tree.map(np.asarray, jax.device_get(nnx.to_pure_dict(params)))


def add_rates(row: dict, tokens_per_step: int, flops_per_token: float, devices: int, peak_flops: float,
              plain_rows: list[dict]) -> dict:
    """tokens/s, MFU against `devices` x `peak_flops`, and the ratio of tokens/s to each plain row's ("vs_plain":
    the first plain row's; "vs_plain_by_name": every one's), with the step-0 loss difference from the first."""
    tokens_per_s = tokens_per_step / row["step_s"]
    row["tokens_per_s"] = tokens_per_s
    row["mfu"] = tokens_per_s * flops_per_token / (devices * peak_flops)
    row["vs_plain_by_name"] = {plain["name"]: tokens_per_s / plain["tokens_per_s"] for plain in plain_rows}
    row["vs_plain"] = tokens_per_s / plain_rows[0]["tokens_per_s"] if plain_rows else None
    row["loss0_minus_plain"] = row["losses"][0] - plain_rows[0]["losses"][0] if plain_rows else None
    return row


def add_peer_ratio(row: dict, peer: dict | None) -> None:
    """"vs_torch": the row's tokens/s over the PyTorch peer's (where the run has one)."""
    if peer is not None and peer is not row:
        row["vs_torch"] = row["tokens_per_s"] / peer["tokens_per_s"]


def attention_calls(row: dict) -> str:
    """The fused attention a row's program calls: its cuDNN custom calls and their counts, "none (XLA)" without
    any, or what the row names itself (a PyTorch peer: "SDPA")."""
    if "attention" in row:
        return row["attention"]
    return ", ".join(f"{name} x{count}" for name, count in sorted(row["custom_calls"].items())
                     if "fmha" in name or "attention" in name.lower()) or "none (XLA)"


COLUMNS = (f"{'implementation':<26} {'mesh':<7} {'ms/step':>9} {'tokens/s':>10} {'MFU':>6} {'vs plain':>8} "
           f"{'vs torch':>8} {'loss@0':>8} {'compile s':>9}  attention calls")


def table_line(row: dict) -> str:
    """One row of the results table ("vs plain": against the first plain row; a compiled-only row shows its
    compile time alone)."""
    if "step_s" not in row:
        return (f"{row['name']:<26} {row['mesh']:<7} {'':>9} {'':>10} {'':>6} {'':>8} {'':>8} {'':>8} "
                f"{row['compile_s']:>9.1f}  {attention_calls(row)}")
    ratio = "" if row["vs_plain"] is None else f"{row['vs_plain']:.3f}"
    peer = f"{row['vs_torch']:.3f}" if "vs_torch" in row else ""
    return (f"{row['name']:<26} {row['mesh']:<7} {1e3 * row['step_s']:>9.1f} {row['tokens_per_s']:>10,.0f} "
            f"{100 * row['mfu']:>5.1f}% {ratio:>8} {peer:>8} {row['losses'][0]:>8.4f} {row['compile_s']:>9.1f}  "
            f"{attention_calls(row)}")


def torch_row(params: dict, model_config, train_config, tokens, warmup: int, steps: int, peers,
              device: str) -> dict:
    """The PyTorch peer (`torch_peers.train_benchmark`, torchtitan's manner) on one GPU, from the library's initial
    parameters (`host_initial_params`), on the same tokens."""
    import jax
    import numpy as np

    result = peers.train_benchmark(params, model_config, train_config, np.asarray(jax.device_get(tokens)),
                                   warmup=warmup, steps=steps, device=device)
    return {"name": peers.TRAIN_NAME, "mesh": f"1 {device}", "devices": 1, **result}


def step0_check(rows: list[dict]) -> dict:
    """Whether every row starts from the same loss at step 0 (the same initial weights and tokens) as the first
    plain JAX row, or the first row where there is none, within STEP0_LOSS_TOLERANCE nats: the reference, each
    row's difference from it and the rows that are apart."""
    reference = next((row for row in rows if row["name"] in PLAIN_NAMES.values()), rows[0])
    differences = {row["name"]: row["losses"][0] - reference["losses"][0] for row in rows if row is not reference}
    return {"reference": reference["name"], "reference_loss0": reference["losses"][0], "differences": differences,
            "tolerance": STEP0_LOSS_TOLERANCE, "fp8_tolerance": FP8_STEP0_LOSS_TOLERANCE,
            "apart": [name for name, difference in differences.items() if abs(difference) > step0_tolerance(name)]}


STEP0_LOSS_TOLERANCE = 1e-2
"""Nats: bfloat16 compute, the same sums in another order (PyTorch's kernels, XLA's fusions)."""
FP8_STEP0_LOSS_TOLERANCE = 5e-2
"""Nats, for the fp8 rows: every projection's operands rounded to 3 mantissa bits."""
FP8_SUFFIX = " fp8"


def step0_tolerance(name: str) -> float:
    """The step-0 loss tolerance of a row by its name (an fp8 row's, logits in fp8 or not, is
    FP8_STEP0_LOSS_TOLERANCE)."""
    return FP8_STEP0_LOSS_TOLERANCE if FP8_SUFFIX in name else STEP0_LOSS_TOLERANCE


def parse_args(argv=None) -> argparse.Namespace:
    from starscream_jax.cli.arguments import count, device_ids
    from starscream_jax.model.quantize import MATMUL_FORMATS
    from starscream_jax.sharding.layouts import LAYOUTS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_model_arguments(parser, model="llama3.2-1b")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"), help="compute dtype")
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS), metavar="LAYOUT",
                        help=f"library layouts to time (default: all: {', '.join(LAYOUTS)})")
    parser.add_argument("--plain", nargs="*", default=["dp"], choices=list(PLAIN_NAMES),
                        help="plain JAX baselines, first is the reference of 'vs plain' (default: dp; none: no "
                             "plain rows)")
    parser.add_argument("--torch", action=argparse.BooleanOptionalAction, default=True,
                        help="also time the PyTorch peer (scripts/torch_peers.py) where torch and a CUDA GPU are "
                             "present (default: on; --quick skips it)")
    parser.add_argument("--torch-device", default="cuda", choices=("cuda", "cpu"),
                        help="where the PyTorch peer runs (cpu: a check of the peer and its step-0 loss on a machine "
                             "without a GPU, tiny shapes only)")
    parser.add_argument("--unfused", action="store_true",
                        help="also time each layout with q/k/v and gate/up as separate GEMMs (fuse_projections off)")
    parser.add_argument("--fp8", nargs="?", const=MATMUL_FORMATS[0], choices=MATMUL_FORMATS, metavar="FORMAT",
                        help="also time each layout with fp8 matmuls in this e4m3 format (default "
                             f"{MATMUL_FORMATS[0]}; {MATMUL_FORMATS[1]} on MI300X)")
    parser.add_argument("--fp8-logits", action="store_true",
                        help="with --fp8, also time each layout with the vocabulary projection in fp8 too")
    parser.add_argument("--remat", action="store_true", help="recompute each layer in the backward pass (both sides)")
    parser.add_argument("--unroll", type=count, nargs="+", default=[], metavar="N",
                        help="also time every row with N layers per trip of the layer loop (ModelConfig.scan_unroll; "
                             "1: a rolled loop; the default rows run no loop), both sides")
    parser.add_argument("--compile-only", action="store_true",
                        help="compile every row and report its compile time, run nothing (the PyTorch peer, which "
                             "compiles on its first step, is left out)")
    parser.add_argument("--gpus", type=int, help="use the first N devices (default: every device present; --quick: 1)")
    parser.add_argument("--grouping", type=device_ids, nargs="+", metavar="IDS",
                        help="device ids of each physical GPU, e.g. 0,1 (two GPUs as the partitions of one)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per step (global)")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens the model reads per sequence")
    parser.add_argument("--peak-tflops", type=float, default=H200_BF16_PEAK_TFLOPS,
                        help="per-device peak for MFU (default: H200 dense bf16 datasheet figure)")
    parser.add_argument("--hlo-dir", type=Path, help="write each compiled step's HLO text here")
    parser.add_argument("--profile-dir", type=Path,
                        help="trace 3 more steps of each row here and record their device time by category")
    harness.add_run_arguments(parser, warmup=3, steps=10,
                              quick="tiny model at 2 layers, 4 x 32 tokens, 1 device, one layout, 1 + 2 steps, "
                                    "no PyTorch peer")
    args = parser.parse_args(argv)
    if args.fp8_logits and not args.fp8:
        parser.error("--fp8-logits adds rows with the vocabulary projection in fp8 as well; pass it with --fp8")
    if args.quick:
        args.model, args.layers, args.batch_size, args.seq_len, args.warmup, args.steps = "tiny", 2, 4, 32, 1, 2
        args.gpus = args.gpus or 1
        if "--layouts" not in (argv if argv is not None else sys.argv[1:]):
            args.layouts = args.layouts[:1]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    # Before JAX starts: torch, if its peer runs, must find GPU memory that JAX has not reserved.
    peers, skipped = harness.torch_peers(args.torch_device) if args.torch and not args.quick and not args.compile_only \
        else (None, "PyTorch peer skipped: " + ("--quick" if args.quick else "--compile-only" if args.compile_only
                                                else "--no-torch"))
    import jax

    from starscream_jax.hardware.mesh import build_mesh
    from starscream_jax.training.config import TrainConfig

    mesh = build_mesh(gpus=args.gpus, grouping=args.grouping)
    devices = mesh.devices.size
    model_config = harness.model_config(args, dtype=args.dtype, remat=args.remat)
    train_config = TrainConfig(model=args.model, dtype=args.dtype, batch_size=args.batch_size, seq_len=args.seq_len,
                               steps=args.warmup + args.steps + 1)
    tokens = jax.random.randint(jax.random.key(0), (args.batch_size, args.seq_len + 1), 0, model_config.vocab_size)
    flops_per_token = model_config.flops_per_token(args.seq_len)
    tokens_per_step = args.batch_size * args.seq_len
    peak = args.peak_tflops * 1e12
    info = harness.run_info(__file__, argv)
    header = (f"{model_config.name} ({args.dtype}), {args.batch_size} x {args.seq_len} tokens per step, "
              f"{devices} x {info.device_kind}, jax {info.jax}; "
              f"{flops_per_token / 1e9:.3f} GFLOP per token; MFU against {args.peak_tflops:g} TFLOP/s per device")
    meta = {"model": model_config.name, "dtype": args.dtype, "batch_size": args.batch_size, "seq_len": args.seq_len,
            "remat": args.remat, "fp8": args.fp8, "fp8_logits": args.fp8_logits, "unroll": args.unroll, "warmup": args.warmup, "steps": args.steps,
            "devices": devices,
            "mesh": dict(mesh.shape), "flops_per_token": flops_per_token, "flop_counting": FLOP_COUNTING,
            "peak_tflops_per_device": args.peak_tflops, "compile_only": args.compile_only, **info.as_dict()}
    result = {"meta": meta, "rows": []}
    rows = result["rows"]

    def record(row: dict) -> None:
        row["attention"] = attention_calls(row)
        if not args.compile_only:
            add_rates(row, tokens_per_step, flops_per_token, row.get("devices", devices), peak,
                      [r for r in rows if r["name"] in PLAIN_NAMES.values()])
            add_peer_ratio(row, next((r for r in rows if r["name"] == peers.TRAIN_NAME), None) if peers else None)
        hlo = row.pop("hlo", None)
        if args.hlo_dir and hlo:
            args.hlo_dir.mkdir(parents=True, exist_ok=True)
            (args.hlo_dir / f"{devices}gpu_{row['name'].replace(' ', '_')}.hlo.txt").write_text(hlo)
        rows.append(row)
        print(table_line(row), flush=True)
        harness.write_json(args.out, result)

    def profile_dir(name: str) -> Path | None:
        return None if args.profile_dir is None else args.profile_dir / name.replace(" ", "_")

    print(header + "\n" + COLUMNS, flush=True)
    if skipped:
        print(skipped, flush=True)
    loops = [(model_config, "")] + [(model_config.replace(scan_unroll=n), f" unroll {n}") for n in args.unroll]
    peer = None
    if peers is not None:  # first, before JAX's allocator grows on the GPU (it keeps what it grows to)
        peer = torch_row(host_initial_params(model_config, train_config), model_config, train_config, tokens,
                         args.warmup, args.steps, peers, args.torch_device)
    if args.plain:
        start_params = initial_params(model_config, train_config, (args.layouts or ["gpu_tp"])[0], mesh)
        for parallelism in args.plain:
            for config, suffix in loops:
                record(plain_row(parallelism, start_params, config, train_config, mesh, tokens, args.warmup,
                                 args.steps, profile_dir(PLAIN_NAMES[parallelism] + suffix), suffix,
                                 args.compile_only))
        del start_params
    if peer is not None:
        record(peer)
    variants = loops + ([(model_config.replace(fuse_projections=False), " unfused")] if args.unfused else [])
    variants += [(model_config.replace(matmul_format=args.fp8), FP8_SUFFIX)] if args.fp8 else []
    if args.fp8_logits:
        variants += [(model_config.replace(matmul_format=args.fp8, fp8_logits=True), FP8_SUFFIX + " logits")]
    failed = []
    for layout in args.layouts:
        for config, suffix in variants:
            try:
                record(layout_row(layout, config, train_config, mesh, tokens, args.warmup, args.steps,
                                  profile_dir(layout + suffix), layout + suffix, args.compile_only))
            except Exception as error:  # one layout that does not compile or run must not lose the others' figures
                failed.append(layout + suffix)
                print(f"{layout + suffix:<26} failed: {type(error).__name__}: {str(error).splitlines()[0][:300]}",
                      flush=True)
    if args.compile_only:
        return 1 if failed else 0
    if peer is not None:
        for row in rows:
            add_peer_ratio(row, peer)
        print("tokens/s against " + peer["name"] + ": " + ", ".join(
            f"{row['name']} {row['vs_torch']:.3f}x" for row in rows if "vs_torch" in row), flush=True)
    result["step0_check"] = step0_check(rows)
    harness.write_json(args.out, result)
    check = result["step0_check"]
    print(f"step-0 loss against {check['reference']}'s {check['reference_loss0']:.4f}: "
          + ", ".join(f"{name} {difference:+.2e}" for name, difference in check["differences"].items())
          + (" (every row within" if not check["apart"] else f" ({', '.join(check['apart'])} NOT within")
          + f" {STEP0_LOSS_TOLERANCE} nats" + (f", fp8 rows {FP8_STEP0_LOSS_TOLERANCE})" if args.fp8 else ")"),
          flush=True)
    return 1 if failed or check["apart"] else 0


if __name__ == "__main__":
    sys.exit(main())
