"""Measurements the cost model is checked against, on the GPUs present (written for one or two NVIDIA H200s):

  matmul       bf16 [M, K] x [K, N] on one GPU over a grid of shapes: seconds and TFLOP/s per shape, and the
               efficiency against the preset's peak (what `costmodel` reads from benchmarks/results/).
  collectives  all-reduce, all-gather and reduce-scatter over the GPUs present (two), per message size: seconds and
               bus bandwidth (NCCL's definition: all-reduce moves 2 (n - 1) / n of the buffer per device, the others
               (n - 1) / n); on one GPU, a device-to-device copy (the HBM bandwidth a collective inside a GPU sees).
  memory       `compiled.memory_analysis()` of the steps `starscream train` and `generate` run (training.steps), for
               Llama 3.2 1B and Llama 3 8B at full depth on one GPU, per remat policy (train) and cache length
               (decode): arguments, outputs, aliased and temporary bytes.
  steps        measured seconds per step of the training step (Llama 3.2 1B, 8 x 2048, bf16 compute, float32 state)
               on one GPU and on two (data parallel, FSDP, tensor parallel), and of the decode step on one.
  --cases heldout  other programs than those the memory terms were read from (other models, batches, remat
               policies, gradient accumulation, decode with the layer loop unrolled): memory compiled only, and
               step times of a few, to check the cost model on programs it was not set from.

Each part writes what it measured as soon as it has it, so a run cut short keeps the parts before. Figures go to
--out as one JSON object with the command, date, JAX version and devices.

    PYTHONUNBUFFERED=1 python scripts/measure_costmodel.py --out benchmarks/results/h200_costmodel.json
    PYTHONUNBUFFERED=1 python scripts/measure_costmodel.py --parts collectives,memory,steps --cases heldout \
        --out benchmarks/results/h200_costmodel_heldout.json   # one GPU: the copy rate, held-out programs
    python scripts/measure_costmodel.py --quick --out /tmp/smoke.json        # CPU smoke run (tiny shapes)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from starscream_jax.benchmarks import harness

MATMUL_M = (64, 256, 1024, 4096, 16384)
MATMUL_KN = (1024, 2048, 4096, 8192, 16384)
COLLECTIVE_BYTES = tuple(2 ** power for power in range(12, 31, 2))  # 4 KiB .. 1 GiB
MEMORY_CASES = {  # (model, phase, batch, seq (train, prefill) or cache length (decode), remat, grad_accum)
    "set": (("llama3.2-1b", "train", 8, 2048, "none", 1), ("llama3.2-1b", "train", 8, 2048, "full", 1),
            ("llama3.2-1b", "decode", 64, 8192, "none", 1), ("llama3-8b", "train", 2, 2048, "none", 1),
            ("llama3-8b", "train", 4, 2048, "full", 1), ("llama3-8b", "decode", 64, 8192, "none", 1),
            ("llama3.2-1b", "train", 8, 2048, "dots", 1)),
    "heldout": (("llama3-8b", "train", 1, 2048, "none", 1), ("llama3-8b", "train", 2, 2048, "dots", 1),
                ("llama3-8b", "train", 8, 2048, "full", 4), ("llama3.2-1b", "train", 16, 2048, "full", 1),
                ("llama3.2-1b", "train", 16, 2048, "none", 4), ("llama3.2-1b", "prefill", 8, 4096, "none", 1),
                ("llama3.2-1b", "decode", 32, 4096, "none", 1), ("llama3-8b", "decode", 8, 8192, "none", 1),
                ("qwen3-30b-a3b", "decode", 16, 4096, "none", 1)),
}
STEP_CASES = {  # (name, model, phase, layout, data, gpus, batch, seq, remat, grad_accum, scan_unroll)
    "set": (("1 GPU", "llama3.2-1b", "train", "starscream_tp", 1, 1, 8, 2048, "none", 1, 1),
            ("2 GPUs data parallel", "llama3.2-1b", "train", "starscream_tp", 2, 2, 8, 2048, "none", 1, 1),
            ("2 GPUs FSDP", "llama3.2-1b", "train", "starscream_fsdp", 1, 2, 8, 2048, "none", 1, 1),
            ("2 GPUs tensor parallel", "llama3.2-1b", "train", "starscream_tp", 1, 2, 8, 2048, "none", 1, 1),
            ("1 GPU decode", "llama3.2-1b", "decode", "starscream_decode", 1, 1, 64, 8192, "none", 1, 1)),
    "heldout": (("1 GPU remat full", "llama3.2-1b", "train", "starscream_tp", 1, 1, 8, 2048, "full", 1, 1),
                ("1 GPU 4 micro-batches", "llama3.2-1b", "train", "starscream_tp", 1, 1, 8, 2048, "none", 4, 1),
                ("1 GPU decode unrolled", "llama3.2-1b", "decode", "starscream_decode", 1, 1, 64, 8192, "none", 1,
                 16),
                ("1 GPU decode batch 1", "llama3.2-1b", "decode", "starscream_decode", 1, 1, 1, 4096, "none", 1, 1)),
}


def measure_matmuls(peak_flops: float, quick: bool):
    import jax
    import jax.numpy as jnp

    dims, kns = ((64, 256), (256, 512)) if quick else (MATMUL_M, MATMUL_KN)
    matmul = jax.jit(lambda a, b: a @ b)
    for m in dims:
        for k in kns:
            for n in kns:
                a = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
                b = jax.random.normal(jax.random.key(1), (k, n), jnp.bfloat16)
                flops = 2 * m * k * n
                calls = max(3, min(200, int(2e12 / flops)))
                seconds = harness.seconds_per_call(matmul, (a, b), warmup=1, calls=calls)
                yield {"m": m, "k": k, "n": n, "seconds": seconds, "tflops": flops / seconds / 1e12,
                       "efficiency": flops / seconds / peak_flops}


def measure_collectives(quick: bool):
    """Bus bandwidth per kind and size over every device present (a copy on one device)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = jax.devices()[:2] if quick else jax.devices()
    count = len(devices)
    mesh = Mesh(np.asarray(devices), ("d",))
    kinds = {
        "all_reduce": (lambda x: jax.lax.psum(x, "d"), 2 * (count - 1) / count),
        "all_gather": (lambda x: jax.lax.all_gather(x, "d", tiled=True), (count - 1) / count),
        "reduce_scatter": (lambda x: jax.lax.psum_scatter(x, "d", tiled=True), (count - 1) / count),
    }
    for size in COLLECTIVE_BYTES[:3] if quick else COLLECTIVE_BYTES:
        elements = size // 2
        if count == 1:
            x = jnp.ones((elements,), jnp.bfloat16)
            seconds = harness.seconds_per_call(jax.jit(lambda x: x * 1), (x,), warmup=1, calls=20)
            yield {"kind": "copy", "devices": 1, "bytes": size, "seconds": seconds, "bus_bandwidth": 2 * size / seconds}
            continue
        for kind, (collective, factor) in kinds.items():
            per_device = elements // count if kind == "all_gather" else elements
            x = jax.device_put(jnp.ones((per_device * count,), jnp.bfloat16), NamedSharding(mesh, PartitionSpec("d")))
            function = jax.jit(jax.shard_map(collective, mesh=mesh, in_specs=PartitionSpec("d"),
                                             out_specs=PartitionSpec("d"), check_vma=False))
            seconds = harness.seconds_per_call(function, (x,), warmup=1, calls=20)
            buffer = size  # the all-reduced buffer, the gathered result, the scattered input
            yield {"kind": kind, "devices": count, "bytes": buffer, "seconds": seconds,
                   "bus_bandwidth": buffer * factor / seconds}


def compile_case(model: str, phase: str, batch: int, seq: int, remat: str, layout: str, mesh, grad_accum: int = 1,
                 scan_unroll: int = 1):
    """(compiled step, its abstract arguments, Settings) of one phase at full depth on `mesh`, compiled for the
    devices present (the step of training.steps, as analysis.compile builds it), with `grad_accum` micro-batches
    (train) and `scan_unroll` layers per trip of the layer loop."""
    from starscream_jax.analysis.compile import make_settings, step_program
    from starscream_jax.model.catalog import load_model_config
    from starscream_jax.sharding.apply import use_layout
    from starscream_jax.sharding.layouts import get_layout

    layers = load_model_config(model).n_layers
    settings = make_settings(model, phase, batch, seq, layout, layers)
    settings = dataclasses.replace(settings, config=settings.config.replace(remat=remat, scan_unroll=scan_unroll),
                                   training=dataclasses.replace(settings.training, batch_size=batch,
                                                                grad_accum=grad_accum))
    with use_layout(get_layout(layout), mesh):
        step, args = step_program(settings, get_layout(layout), mesh)
        return step.lower(*args).compile(), args, settings


def measure_memory(quick: bool, cases: str):
    import jax

    from starscream_jax.hardware.mesh import build_topology_mesh

    _, mesh = build_topology_mesh("cpu" if quick else "h200", gpus=1, devices=jax.devices()[:1])
    quick_cases = (("tiny", "train", 8, 64, "none", 1), ("tiny", "train", 8, 64, "none", 2),
                   ("tiny", "decode", 8, 64, "none", 1))
    for model, phase, batch, seq, remat, grad_accum in quick_cases if quick else MEMORY_CASES[cases]:
        start = time.perf_counter()
        try:
            compiled, _, _ = compile_case(model, phase, batch, seq, remat, "starscream_tp", mesh, grad_accum)
        except Exception as err:  # one case that cannot compile must not lose the others
            yield {"model": model, "phase": phase, "batch": batch, "seq": seq, "remat": remat,
                   "grad_accum": grad_accum, "error": f"{type(err).__name__}: {str(err)[:300]}"}
            continue
        memory = compiled.memory_analysis()
        yield {"model": model, "phase": phase, "batch": batch, "seq": seq, "remat": remat, "grad_accum": grad_accum,
               "layout": "starscream_tp",
               "mesh": dict(mesh.shape), "compile_s": time.perf_counter() - start,
               "argument_bytes": memory.argument_size_in_bytes, "output_bytes": memory.output_size_in_bytes,
               "alias_bytes": memory.alias_size_in_bytes, "temp_bytes": memory.temp_size_in_bytes,
               "peak_bytes": memory.argument_size_in_bytes + memory.output_size_in_bytes
               - memory.alias_size_in_bytes + memory.temp_size_in_bytes}


def measure_steps(quick: bool, cases: str):
    """Seconds per step of each STEP_CASES row the devices present allow, on real arrays."""
    import jax
    from flax import nnx

    from starscream_jax.hardware.mesh import build_topology_mesh
    from starscream_jax.model.decoder import create_sharded_model
    from starscream_jax.sharding.apply import use_layout
    from starscream_jax.sharding.layouts import get_layout

    for name, model, phase, layout, data, gpus, batch, seq, remat, grad_accum, unroll in STEP_CASES[cases]:
        if gpus > len(jax.devices()):
            continue
        model = "tiny" if quick else model
        batch, seq, unroll = (8, 32, 1) if quick else (batch, seq, unroll)
        _, mesh = build_topology_mesh("cpu:1" if quick else "h200", gpus=gpus, data=data, devices=jax.devices()[:gpus])
        compiled, args, settings = compile_case(model, phase, batch, seq, remat, layout, mesh, grad_accum, unroll)
        with use_layout(get_layout(layout), mesh):
            _, params, rest = nnx.split(create_sharded_model(settings.config, layout, mesh, 0), nnx.Param, ...)
            concrete = _concrete(args, params, rest)
        steps = 3 if quick else (10 if phase == "train" else 50)
        seconds = harness.timed_steps(lambda state: (_advance(compiled, phase, state), None), concrete, warmup=2,
                                      steps=steps).seconds_per_step
        tokens = batch * (seq if phase == "train" else 1)
        yield {"name": name, "model": model, "phase": phase, "layout": layout, "mesh": dict(mesh.shape),
               "batch": batch, "seq": seq, "remat": remat, "grad_accum": grad_accum, "scan_unroll": unroll,
               "step_s": seconds, "tokens_per_s": tokens / seconds}


def _concrete(args, params, rest):
    """Real arrays for the abstract arguments: the model's parameters (cast like the abstract ones), zeros for the
    optimizer state and cache, ones for the tokens."""
    import jax
    import jax.numpy as jnp

    def fill(abstract):
        return jax.device_put(jnp.ones(abstract.shape, abstract.dtype) if abstract.dtype == jnp.int32
                              else jnp.zeros(abstract.shape, abstract.dtype), abstract.sharding)

    cast = jax.tree.map(lambda real, abstract: real.astype(abstract.dtype), params, args.params)
    filled = jax.tree.map(fill, args._replace(params=None, rest=None))
    return filled._replace(params=cast, rest=rest)


def _advance(compiled, phase: str, state):
    if phase == "train":
        params, opt_state, loss = compiled(state.params, state.opt_state, state.rest, state.tokens)
        return state._replace(params=params, opt_state=opt_state)
    token, cache = compiled(state.params, state.rest, state.cache, state.token, state.position)
    return state._replace(cache=cache, token=token)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    parser.add_argument("--parts", default="matmul,collectives,steps,memory", help="comma-separated parts to run")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 peak for the efficiency column")
    parser.add_argument("--cases", choices=("set", "heldout"), default="set",
                        help="the memory and step cases: those the cost model was set from, or held-out ones")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny shapes on CPU devices")
    args = parser.parse_args(argv)
    if args.quick:
        from starscream_jax.hardware.simulation import simulate_cpu_devices
        simulate_cpu_devices(2)
    import jax

    info = harness.run_info(__file__, argv)
    result = {**info.as_dict(), "devices": [str(device.device_kind) for device in jax.devices()],
              "peak_flops": args.peak_tflops * 1e12}
    measures = {"matmul": lambda: measure_matmuls(args.peak_tflops * 1e12, args.quick),
                "collectives": lambda: measure_collectives(args.quick),
                "steps": lambda: measure_steps(args.quick, args.cases),
                "memory": lambda: measure_memory(args.quick, args.cases)}
    for part in args.parts.split(","):
        start = time.perf_counter()
        result[part] = []
        try:
            for row in measures[part]():  # written row by row: a run cut short keeps what it measured
                result[part].append(row)
                print(json.dumps(row), flush=True)
                harness.write_json(args.out, result)
        except Exception as err:  # one failed part must not lose the others' figures
            result[part + "_error"] = f"{type(err).__name__}: {err}"
            print(f"{part} failed: {result[part + '_error']}", flush=True)
        print(f"{part}: {time.perf_counter() - start:.1f} s", flush=True)
        harness.write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
