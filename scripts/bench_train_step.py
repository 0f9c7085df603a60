"""Whole training steps of several layouts on one mesh: the collectives each compiled step runs, and tokens/s.

For each layout the AdamW training step of `starscream train` (starscream_jax.training.steps.train_step) is compiled on
the mesh and read by the inspector (each collective's kind, replica groups as partition ids, scope, bytes per device and
runs per step), then run on tinyshakespeare batches: warm-up steps, then timed steps (`harness.timed_steps`), tokens/s =
tokens per step x timed steps / wall time (the last loss ready before the clock stops).

The mesh: `--grouping` lists the device ids of each physical GPU, so devices that are whole GPUs (NVIDIA) can stand in
for the partitions of one. Without it the mesh is what the machine shows (`build_mesh()`).

    python scripts/bench_train_step.py --grouping 0,1 2,3 --out steps.json       # 4 GPUs as 2 GPUs x 2 partitions
    python scripts/bench_train_step.py --grouping 0,1 --model llama3.2-1b --dtype bfloat16
    python scripts/bench_train_step.py --grouping 0,1 2,3 --simulate --quick     # CPU smoke run
"""
from __future__ import annotations

import argparse
import sys
import time

from starscream_jax.benchmarks import harness
from starscream_jax.cli.arguments import device_ids
from starscream_jax.hardware.mesh import build_mesh


def compiled_step(layout: str, mesh, model_config, train_config):
    """(compiled step, its arguments): the AdamW step of `train_config` for `model_config`, sharded by `layout`."""
    from starscream_jax.sharding.apply import Placement, batch_sharding, use_layout
    from starscream_jax.training import data
    from starscream_jax.training.loop import initial_state
    from starscream_jax.training.steps import train_step as make_train_step

    with use_layout(layout, mesh):
        graphdef, params, rest, optimizer, opt_state = initial_state(train_config, model_config, layout, mesh)
        train_step = make_train_step(graphdef, optimizer, under=Placement.of(layout, mesh))
        batches = data.TokenBatches(tokens=data.load_corpus(train_config.data), batch_size=train_config.batch_size,
                                    seq_len=train_config.seq_len + 1, seed=train_config.seed)
        sharding = batch_sharding(layout, mesh, train_config.batch_size)
        args = (params, opt_state, rest, batches.global_batch(0, sharding))
        return train_step.lower(*args).compile(), args, lambda step: batches.global_batch(step, sharding)


def collectives(report) -> list[dict]:
    """The inspector's collectives as plain records (op_name shortened to its last scopes)."""
    return [{"kind": c.kind, "scope": c.scope, "groups": c.groups, "buffer_bytes": c.buffer_bytes,
             "bytes_per_device": c.bytes_per_device, "count": c.count,
             "op_name": "/".join(c.op_name.split("/")[-3:])} for c in report.collectives]


def run_layout(layout: str, mesh, model_config, train_config, warmup: int, steps: int) -> dict:
    """Compile, inspect and time one layout's training step."""
    import jax

    from starscream_jax.analysis.report import inspect_compiled

    start = time.perf_counter()
    step_fn, (params, opt_state, rest, tokens), batch = compiled_step(layout, mesh, model_config, train_config)
    compile_s = time.perf_counter() - start
    report = inspect_compiled(step_fn, mesh, args=(params, opt_state, rest, tokens))
    step_index = iter(range(warmup + steps))

    def advance(state):
        params, opt_state, loss = step_fn(*state, rest, batch(next(step_index)))
        return (params, opt_state), loss

    timed = harness.timed_steps(advance, (params, opt_state), warmup=warmup, steps=steps)
    tokens_per_step = train_config.batch_size * train_config.seq_len
    return {"layout": layout, "compile_s": compile_s, "step_ms": 1e3 * timed.seconds_per_step,
            "tokens_per_s": tokens_per_step / timed.seconds_per_step,
            "losses": [float(value) for value in jax.device_get(timed.outputs)],
            "bytes_by_scope": report.bytes_by_scope(), "collectives": collectives(report),
            "memory": None if report.memory is None else vars(report.memory)}


def summary(result: dict) -> str:
    """A few lines per layout: tokens/s, then each collective kind and scope with its count per step."""
    lines = [f"{result['layout']}: {result['tokens_per_s']:,.0f} tokens/s ({result['step_ms']:.2f} ms/step, "
             f"compiled in {result['compile_s']:.1f} s), loss {result['losses'][0]:.3f} -> {result['losses'][-1]:.3f}"]
    kinds: dict[tuple, int] = {}
    for c in result["collectives"]:
        key = (c["kind"], c["scope"], str(c["groups"]))
        kinds[key] = kinds.get(key, 0) + c["count"]
    lines += [f"    {count:4d} x {kind} {scope} groups {groups}"
              for (kind, scope, groups), count in sorted(kinds.items())]
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grouping", type=device_ids, nargs="+", metavar="IDS",
                        help="device ids of each physical GPU, e.g. 0,1 2,3 (default: the machine's grouping)")
    parser.add_argument("--simulate", action="store_true", help="simulated CPU devices (with --grouping)")
    parser.add_argument("--layouts", nargs="+", default=["flat_tp", "starscream_tp"], help="layouts to compare")
    harness.add_model_arguments(parser, model="tiny")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="compute dtype")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per step (global)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    harness.add_run_arguments(parser, warmup=3, steps=20,
                              quick="2 timed steps of 4 x 32 tokens, the tiny model at 2 layers on 2 GPUs x 2 "
                                    "partitions (devices 0-3), the last layout only")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.batch_size, args.seq_len, args.warmup, args.steps = 2, 4, 32, 1, 2
        args.grouping = args.grouping or [[0, 1], [2, 3]]
        if "--layouts" not in (sys.argv[1:] if argv is None else argv):
            args.layouts = args.layouts[-1:]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    mesh = build_mesh(grouping=args.grouping, simulate=args.simulate)
    from starscream_jax.hardware.mesh import device_table
    from starscream_jax.training.config import TrainConfig

    model_config = harness.model_config(args, dtype=args.dtype)
    train_config = TrainConfig(model=args.model, dtype=args.dtype, batch_size=args.batch_size, seq_len=args.seq_len,
                               steps=args.warmup + args.steps)
    info = harness.run_info(__file__, argv)
    print(f"{model_config.name} ({args.dtype}) on mesh {dict(mesh.shape)}, devices {device_table(mesh)}; "
          f"{info.device_kind}, jax {info.jax}; {args.batch_size} x {args.seq_len} tokens per step",
          file=sys.stderr)
    meta = {"model": model_config.name, "dtype": args.dtype, "mesh": dict(mesh.shape),
            "devices": device_table(mesh), "device": info.device_kind, "batch_size": args.batch_size,
            "seq_len": args.seq_len, "warmup": args.warmup, "steps": args.steps, **info.as_dict()}
    result = {"meta": meta, "layouts": []}
    for layout in args.layouts:
        result["layouts"].append(run_layout(layout, mesh, model_config, train_config, args.warmup, args.steps))
        print(summary(result["layouts"][-1]))
        harness.write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
