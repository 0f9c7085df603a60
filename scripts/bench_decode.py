"""Decode speed against the memory-bandwidth limit: the library's decode step (training.steps.decode_step) timed at
several batch sizes against a full KV cache, with the fraction of HBM bandwidth it uses, for each precision variant
(VARIANTS: bfloat16, 8-bit weights, 8-bit KV cache) side by side with its speed-up over bfloat16.

One decode step reads every weight once (as stored: bfloat16, or 8-bit values and their float32 scales; the
embedding table only for the B rows it looks up, unless it is tied to the head) and the whole KV cache (keys and
values of every layer, [L, B, T, K, E] each, bfloat16 or 8-bit with a float32 scale per position and kv head):
bytes per step = those bytes, a floor on what the step must move. Bandwidth used = bytes per step / step
time; its fraction of the device's bandwidth is reported against the datasheet figure (H200: 4.8 TB/s), against a
device-to-device copy measured in the same run (bytes read + written / time) and against a sum over the same array
(bytes read / time). tokens/s = batch / step time.

The cache is filled with random values (never zeros) and the step decodes at its last position, so attention covers
every cached position. Each step is compiled first, warmed up, then timed over `--steps` back-to-back steps
(`harness.timed_steps`: the cache donated from each step to the next, the clock stopped once the last token is on
hand).

Beside each bfloat16 row on one device, the plain JAX decoder (`benchmarks.plain_llama.plain_decode_step`: the
model's weights as a params dict cast and split per layer once, the layers a Python loop, a dense cache of one array
pair per layer written in place, cuDNN's attention where JAX takes it) on the same weights and cache length: its rows
are "plain_rows" and each bf16 row's tokens/s over its batch's plain row is "vs_plain".

Where torch and a CUDA GPU are present (`--no-torch` leaves it out, `--quick` skips it), the gpt-fast-style peer of
scripts/torch_peers.py decodes at the same batches against the same cache length, its bytes counted alike; its rows
are stored as "peer_rows" and each library row's tokens/s over the peer's at its batch is "vs_torch".

`--paged KERNEL ...` also times the serving engine's paged decode step (`serving.engine.Engine.dispatch`) at each
batch, every row at the same cache length in pages of its own (`model.paged.KERNELS`: cuDNN's paged kernel reading
the pages in place, or gathering them), launched back to back as a server launches it; its rows ("paged_rows") carry
their step time over the dense bf16 step's at the same batch ("vs_dense").

    CUDA_VISIBLE_DEVICES=0 python scripts/bench_decode.py --model llama3-8b --batches 1 64 --cache 4096 --out d.json
    CUDA_VISIBLE_DEVICES=0 python scripts/bench_decode.py --variants bf16 w-int8 w-fp8 kv-int8 kv-fp8 --out d8.json
    CUDA_VISIBLE_DEVICES=0 python scripts/bench_decode.py --no-torch --paged cudnn gather --out paged.json
    python scripts/bench_decode.py --quick                          # CPU smoke run (tiny model)
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from starscream_jax.benchmarks import harness

H200_HBM_BYTES_PER_S = 4.8e12
VARIANTS = {"bf16": ("", ""), "w-int8": ("int8", ""), "w-fp8": ("fp8", ""), "kv-int8": ("", "int8"),
            "kv-fp8": ("", "fp8"), "w-int8-kv-int8": ("int8", "int8"), "w-fp8-kv-fp8": ("fp8", "fp8")}
"""Variant -> (weights, KV cache): "" bfloat16, int8, or fp8 (--fp8-format). Each also runs as "<variant>-apart":
its q/k/v and gate/up projections held apart, as stored (`ModelConfig.fuse_projections` off), where inference
otherwise holds each group stacked as one weight (`layer_weights.stack_projections`)."""
APART = "-apart"


READ_ROW = 8192
"""Elements per row of the row-wise read pass (`measured_bandwidth`)."""
GEMM_WEIGHT = (4096, 14336)
"""Shape of each weight of the GEMM read pass: Llama 3 8B's gate projection, the largest of its decode's reads."""
GEMM_ROWS = 8
"""Token rows of the GEMM read pass: the rows XLA pads a decode GEMM to on the tensor cores."""
ATTENTION_POSITIONS, ATTENTION_HEADS, ATTENTION_KV_HEADS, ATTENTION_HEAD_DIM = 4096, 32, 8, 128
"""The attention read pass: one query per row over a cache of 4,096 positions, as many rows as fill the array,
Llama 3 8B's heads (decode attention at 64 rows x 4,096 reads 4.0 TB/s on an H200, benchmarks/NOTES.md run 39,
where 64 rows over the 16,384 positions of a 4 GiB array read 2.1: run 53)."""
QUEUED_CALLS = 8
"""Calls of a bandwidth pass queued back to back per timing, as a decode loop queues its steps: a call timed alone
also counts its launch and the host's wait (on an H200 the passes over 4 GiB read 2.1-2.2 TB/s timed one call at a
time and 3.9-4.0 queued eight at a time, in one process: benchmarks/NOTES.md, run 57)."""
WARM_SECONDS = 0.5
"""How long each bandwidth pass runs before it is timed: the first GPU work of the process finds the clocks at idle
(an H200 reads 345 MHz before work, 1980 MHz under it), which a few milliseconds of timed calls would measure."""


def measured_bandwidth(gigabytes: float, repeats: int = 10, warm_seconds: float = WARM_SECONDS) -> dict:
    """Bytes per second of passes over `gigabytes` of random bfloat16 values, median of `repeats` after
    `warm_seconds` of untimed passes: "copy", an elementwise pass (bytes read + written); "read_sum", one sum of
    the whole array, "read_rows", a sum of each row of READ_ROW elements (every row reduced by its own block),
    "read_gemv", one row times the array held as a [elements / READ_ROW, READ_ROW] weight, and "read_gemm",
    GEMM_ROWS rows times each of as many separate GEMM_WEIGHT weights as fill `gigabytes`, compiled with the
    backend's decode options (`BackendPolicy.decode_compiler_options`): how a decode step reads its weights, one
    GEMM per projection, each weight its own buffer; "read_attention", decode attention (`ops.fused_attention`:
    cuDNN's on NVIDIA GPUs), one query per row over the array held as rows of keys and values, as a decode step
    reads its cache. "read" is the fastest: the ceiling benchmarks divide by (a single sum's last reduction stages
    leave most of the chip idle, and a GEMV of one huge weight splits its reduction poorly: on an H200 both read
    near 2.2 TB/s, where cuDNN's decode attention reads 4.0)."""
    import jax
    import jax.numpy as jnp

    from starscream_jax.hardware.backend import policy_of

    elements = int(gigabytes * 2**30) // 2 // READ_ROW * READ_ROW
    x = jax.random.normal(jax.random.key(0), (elements,), jnp.bfloat16)
    row = jnp.ones((1, elements // READ_ROW), jnp.bfloat16)
    rates = {}
    passes = [("copy", jax.jit(lambda x: x + 1), 2 * x.nbytes),
              ("read_sum", jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32)), x.nbytes),
              ("read_rows", jax.jit(lambda x: jnp.sum(x.reshape(-1, READ_ROW), axis=1, dtype=jnp.float32)), x.nbytes),
              ("read_gemv", jax.jit(lambda x: row @ x.reshape(-1, READ_ROW)), x.nbytes)]
    for name, step, moved in passes:
        rates[name] = _median_rate(step, (x,), moved, repeats, warm_seconds)
    attend, arguments, moved = attention_read_pass(x)
    del x
    rates["read_attention"] = _median_rate(attend, arguments, moved, repeats, warm_seconds)
    del arguments
    K, N = GEMM_WEIGHT[0], max(1, min(GEMM_WEIGHT[1], elements // GEMM_WEIGHT[0]))  # a small run: one narrower
    weights = [jax.random.normal(jax.random.key(n), (K, N), jnp.bfloat16) for n in range(max(1, elements // (K * N)))]
    rows = jnp.ones((GEMM_ROWS, K), jnp.bfloat16)
    options = dict(policy_of(jax.devices()[0]).decode_compiler_options) or None
    gemms = jax.jit(lambda rows, weights: [rows @ w for w in weights], compiler_options=options)
    rates["read_gemm"] = _median_rate(gemms, (rows, weights), sum(w.nbytes for w in weights), repeats,
                                      warm_seconds)
    rates["read"] = max(rates[name] for name in ("read_sum", "read_rows", "read_gemv", "read_gemm", "read_attention"))
    return rates


def attention_read_pass(x) -> tuple:
    """(the jitted pass, its arguments, the bytes it reads) of "read_attention": the values of `x` (a flat bfloat16
    array) as the keys and values [R, ATTENTION_POSITIONS, ATTENTION_KV_HEADS, ATTENTION_HEAD_DIM] each (R as many
    rows as fit, fewer positions where not one row fits; copied into arrays of their own before the clock, so the
    kernel reads them in place), every position visible to its row's one query."""
    import jax
    import jax.numpy as jnp

    from starscream_jax.model.ops import fused_attention

    per_position = ATTENTION_KV_HEADS * ATTENTION_HEAD_DIM
    positions = min(ATTENTION_POSITIONS, x.size // (2 * per_position))  # fewer in a small array (--quick)
    rows = x.size // (2 * per_position * positions)
    shape = (rows, positions, ATTENTION_KV_HEADS, ATTENTION_HEAD_DIM)
    count = per_position * positions * rows
    keys, values = x[:count].reshape(shape), x[count:2 * count].reshape(shape)
    q = jnp.ones((rows, 1, ATTENTION_HEADS, ATTENTION_HEAD_DIM), jnp.bfloat16)
    lengths = jnp.full((rows,), positions, jnp.int32)
    attend = jax.jit(lambda q, keys, values: fused_attention(q, keys, values, key_value_seq_lengths=lengths))
    return attend, (q, keys, values), 2 * count * 2


def _median_rate(step, args: tuple, moved: int, repeats: int, warm_seconds: float) -> float:
    """`moved` bytes over the median seconds of one call of `step(*args)` (QUEUED_CALLS queued per timing), after
    `warm_seconds` of untimed calls."""
    warm_until = time.perf_counter() + warm_seconds
    while time.perf_counter() < warm_until:
        harness.block(step(*args))
    times = [harness.seconds_per_call(step, args, warmup=1, calls=QUEUED_CALLS) for _ in range(repeats)]
    return moved / sorted(times)[len(times) // 2]


def check_decode_attention(batch: int = 4, length: int = 4096, heads: int = 32, kv_heads: int = 8,
                           head_dim: int = 128) -> float:
    """Relative error (||out - ref|| / ||ref||) of the model's decode attention (`ops._cached_attention`, one query
    per row against a bfloat16 cache, each row at its own position) against float32 attention with an explicit mask,
    on random inputs: the check that the kernels the step runs compute the same function."""
    import jax
    import jax.numpy as jnp

    from starscream_jax.model.ops import _cached_attention

    keys = jax.random.split(jax.random.key(4), 4)
    q = jax.random.normal(keys[0], (batch, 1, heads, head_dim), jnp.bfloat16)
    k, v = (jax.random.normal(key, (batch, length, kv_heads, head_dim), jnp.bfloat16) for key in keys[1:3])
    positions = jax.random.randint(keys[3], (batch, 1), 0, length, jnp.int32)
    out = jax.jit(_cached_attention)(q, k, v, positions).astype(jnp.float32)
    mask = jnp.arange(length)[None, None, None, :] <= positions[:, None, :, None]
    ref = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla"))(
        *(x.astype(jnp.float32) for x in (q, k, v)))
    return float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))


def bytes_read_per_step(params, config, batch: int, cache_length: int) -> dict:
    """{"weights", "kv_cache"}: bytes one decode step must read (see the module docstring)."""
    import jax

    from starscream_jax.model.dense_cache import cache_entries
    from starscream_jax.sharding.apply import LOGICAL_AXES

    weights = 0
    for variable in jax.tree.leaves(params, is_leaf=lambda node: hasattr(node, "get_metadata")):
        value = variable.get_value()
        names = variable.get_metadata(LOGICAL_AXES)
        if names == ("vocab", "embed") and not config.tie_embeddings:
            weights += batch * value.shape[1] * value.dtype.itemsize  # only the looked-up rows
        else:  # a weight held per layer (layer_weights.split_layer_weights) is a tuple of arrays
            weights += sum(part.nbytes for part in jax.tree.leaves(value))
    cache = sum(entry.size * entry.dtype.itemsize
                for entry in cache_entries(config.replace(dtype="bfloat16"), batch, cache_length).entries().values())
    return {"weights": weights, "kv_cache": cache}


def run_batch(graphdef, params, rest, config, layout: str, mesh, batch: int, cache_length: int, warmup: int,
              steps: int, profile_dir: Path | None = None) -> dict:
    """Compile and time the decode step at one batch size; bytes, bandwidth and tokens/s (with `profile_dir`, the
    device time of 5 more steps by category, `analysis.profile.time_breakdown`)."""
    import jax
    import jax.numpy as jnp

    from starscream_jax.model.decoder import decode_holds_cache_per_layer
    from starscream_jax.model.dense_cache import DenseCache, cache_entries, cache_shardings, split_cache
    from starscream_jax.model.layer_weights import split_layer_weights
    from starscream_jax.sharding.apply import Placement, token_sharding, use_layout
    from starscream_jax.training.steps import Sampling, decode_step

    shardings = cache_shardings(config, batch, cache_length, layout, mesh).entries()

    def fill(key, entry):  # random values; an 8-bit cache's scales 1/64
        if entry.ndim == 4:
            return jnp.full(entry.shape, 1 / 64, entry.dtype)
        return jax.random.normal(key, entry.shape, jnp.float32).astype(entry.dtype)

    entries = cache_entries(config, batch, cache_length).entries()
    cache = DenseCache(**{name: jax.jit(fill, static_argnums=1, out_shardings=shardings[name])(
        jax.random.key(index), entry) for index, (name, entry) in enumerate(entries.items())})
    if decode_holds_cache_per_layer(config):  # held per layer, as generation holds it
        with use_layout(layout, mesh):
            cache = jax.jit(split_cache)(cache)
        params = split_layer_weights(params)
    token_B = jax.device_put(jax.random.randint(jax.random.key(3), (batch,), 0, config.vocab_size, jnp.int32),
                             token_sharding(layout, mesh, batch))
    position = jnp.asarray(cache_length - 1, jnp.int32)
    with use_layout(layout, mesh):
        start = time.perf_counter()
        compiled = decode_step(graphdef, Sampling(), under=Placement.of(layout, mesh),
                               eight_bit_weights=bool(config.weight_format)).lower(
            params, rest, cache, token_B, position).compile()
        compile_s = time.perf_counter() - start

    def advance(state):
        token_B, cache = compiled(params, rest, state[1], state[0], position)
        return (token_B, cache), token_B

    state = (token_B, cache)
    warm_until = time.perf_counter() + WARM_SECONDS  # the compile left the GPU idle: its clocks are down again
    while time.perf_counter() < warm_until:
        state = advance(state)[0]
        harness.block(state)
    timed = harness.timed_steps(advance, state, warmup=warmup, steps=steps)
    step_s = timed.seconds_per_step
    breakdown = None
    if profile_dir is not None:
        text = compiled.as_text()
        breakdown = harness.traced_breakdown(advance, timed.state, steps=5, directory=profile_dir / f"batch{batch}",
                                             hlo_text=text)[1]
        (profile_dir / f"batch{batch}.hlo.txt").write_text(text)
    read = bytes_read_per_step(params, config, batch, cache_length)
    total = read["weights"] + read["kv_cache"]
    memory = compiled.memory_analysis()
    text = compiled.as_text()
    return {"batch": batch, "fused_attention_calls": text.count('custom_call_target="__cudnn$fmha'),
            "cache_length": cache_length, "compile_s": compile_s, "step_s": step_s,
            "tokens_per_s": batch / step_s, "bytes_per_step": read, "bandwidth_bytes_per_s": total / step_s,
            "temp_bytes": None if memory is None else int(memory.temp_size_in_bytes), "time_breakdown": breakdown}


def with_fractions(row: dict, devices: int, peak: float, copy: float, read: float) -> dict:
    """`row` with its bandwidth as a fraction of the datasheet's, of the measured copy's and of the measured read's
    (each over `devices`)."""
    bandwidth = row["bandwidth_bytes_per_s"]
    row.update(fraction_of_peak=bandwidth / (devices * peak), fraction_of_copy=bandwidth / (devices * copy),
               fraction_of_read=bandwidth / (devices * read))
    return row


def plain_skipped(config, devices: int) -> str | None:
    """Why no plain JAX row runs beside the library's (it decodes a plain Llama on one device), or None."""
    from starscream_jax.benchmarks.plain_llama import plain_differences

    if devices != 1:
        return f"plain JAX rows skipped: the plain decoder runs on one device, this run has {devices}"
    differences = plain_differences(config)
    if differences:
        return f"plain JAX rows skipped: {config.name} is not a plain Llama ({', '.join(differences)})"
    return None


def plain_weights(model) -> dict:
    """The model's parameters as the plain JAX decoder holds them (`plain_llama.plain_decode_weights`: on one
    device, no mesh, split per layer), matrices in the compute dtype, norm scales in float32: what a JAX user
    prepares once before decoding."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from starscream_jax.benchmarks.plain_llama import plain_decode_weights

    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])  # off the library's mesh and its typed axes
    stacked = jax.device_put(nnx.to_pure_dict(nnx.state(model, nnx.Param)), device)
    return plain_decode_weights(stacked, jnp.dtype(model.config.dtype))


def plain_row(params: dict, config, batch: int, cache_length: int, warmup: int, steps: int, read: dict) -> dict:
    """The plain JAX decode step (`plain_llama.plain_decode_step`) at `batch` rows at the last of `cache_length`
    positions, timed as the library's rows are; `read`: the bytes a step must read (the library bf16 row's, the
    same weights and cache). Attention through cuDNN on an NVIDIA GPU, as a JAX user who wants the fused kernel asks
    for it, else (elsewhere, or a shape cuDNN refuses while tracing) JAX's own form; the row names which ran."""
    import jax
    import jax.numpy as jnp

    from starscream_jax.benchmarks.plain_llama import plain_cache, plain_decode_step

    cache = plain_cache(config, batch, cache_length)
    token_B = jax.random.randint(jax.random.key(3), (batch,), 0, config.vocab_size, jnp.int32)
    position = jnp.asarray(cache_length - 1, jnp.int32)
    start = time.perf_counter()
    implementation = "cudnn" if jax.devices()[0].platform in ("gpu", "cuda") else None
    try:
        compiled = plain_decode_step(config, implementation).lower(params, cache, token_B, position).compile()
    except NotImplementedError:
        implementation = None
        compiled = plain_decode_step(config, implementation).lower(params, cache, token_B, position).compile()
    compile_s = time.perf_counter() - start

    def advance(state):
        token_B, cache = compiled(params, state[1], state[0], position)
        return (token_B, cache), token_B

    step_s = harness.timed_steps(advance, (token_B, cache), warmup=warmup, steps=steps).seconds_per_step
    return {"name": "plain JAX", "attention": implementation or "xla", "batch": batch, "cache_length": cache_length,
            "compile_s": compile_s,
            "step_s": step_s, "tokens_per_s": batch / step_s, "bytes_per_step": read,
            "bandwidth_bytes_per_s": sum(read.values()) / step_s}


PAGE_SIZE = 16
"""Positions per page of the paged rows (the server's default)."""


def run_paged(model, layout: str, mesh, batch: int, cache_length: int, kernel: str, warmup: int, steps: int,
              profile_dir: Path | None = None) -> dict:
    """The engine's paged decode step at `batch` rows, each at its last of `cache_length` positions over pages of
    its own (what the pages hold does not change what attention reads), launched back to back; compile and step
    seconds and the host's seconds per launch (a launch that returns only when the step ends means the device waits
    on the host); with `profile_dir`, the device time of 5 more steps by category and their sum, which falls short
    of the step's wall time by the time the device sits idle. The engine holds its own per-layer copy of the
    weights."""
    from starscream_jax.serving.engine import Engine, EngineConfig
    from starscream_jax.serving.buckets import Buckets
    from starscream_jax.serving.steps import StepInputs, cache_shards

    shards = cache_shards(layout, mesh)
    rows, pages = batch // shards, -(-cache_length // PAGE_SIZE)
    if batch % shards:
        raise SystemExit(f"bench_decode: batch {batch} does not split over the {shards} cache shards of {layout}; "
                         f"give --batches multiples of {shards}")
    config = EngineConfig(page_size=PAGE_SIZE, pages_per_shard=rows * pages + 1, rows_per_shard=rows,
                          token_budget=max(rows, PAGE_SIZE), chunk=PAGE_SIZE, kernel=kernel, overlap=False,
                          buckets=Buckets(rows=(rows,), positions=(PAGE_SIZE,), pages=(pages,), prefill_rows=(1,)),
                          prefix_caching=False)
    engine = Engine(model, config, mesh, decode_layout=layout)
    inputs = StepInputs.zeros(batch, 1, pages)
    inputs.table[:] = 1 + (np.arange(batch)[:, None] % rows) * pages + np.arange(pages)  # shard-local pages
    inputs.positions[:] = cache_length - 1
    inputs.tokens[:] = 1
    start = time.perf_counter()
    engine.dispatch("decode", inputs).block_until_ready()
    compile_s = time.perf_counter() - start
    warm_until = time.perf_counter() + WARM_SECONDS
    while time.perf_counter() < warm_until:
        engine.dispatch("decode", inputs).block_until_ready()
    for _ in range(warmup):
        engine.dispatch("decode", inputs)
    start, host_s = time.perf_counter(), 0.0
    for _ in range(steps):
        launched = time.perf_counter()
        outputs = engine.dispatch("decode", inputs)
        host_s += time.perf_counter() - launched
    outputs.block_until_ready()
    step_s = (time.perf_counter() - start) / steps
    breakdown = None
    if profile_dir is not None:
        text = engine.program("decode", inputs).as_text()
        directory = profile_dir / f"paged_{engine.kernel}_batch{batch}"
        breakdown = harness.traced_breakdown(lambda state: (state, engine.dispatch("decode", inputs)), None,
                                             steps=5, directory=directory, hlo_text=text)[1]
        breakdown["device_s"] = sum(breakdown["per_step_s"].values())
        (directory / "step.hlo.txt").write_text(text)
    return {"kernel": engine.kernel, "kv_format": model.config.kv_format or model.config.dtype, "batch": batch,
            "cache_length": cache_length, "compile_s": compile_s,
            "step_s": step_s, "dispatch_s": host_s / steps, "tokens_per_s": batch / step_s, "time_breakdown": breakdown}


def paged_rows(model, args, mesh, dense_by_batch: dict) -> list[dict]:
    """`run_paged` per kernel of --paged and batch, each with its step time over the dense bf16 step's."""
    rows = []
    for kernel in args.paged:
        for batch in args.batches:
            row = run_paged(model, args.layout, mesh, batch, args.cache, kernel, args.warmup, args.steps,
                            args.profile_dir)
            if batch in dense_by_batch:
                row["vs_dense"] = row["step_s"] / dense_by_batch[batch]
            print(f"paged decode ({row['kernel']:<6} {row['kv_format']}) {batch:>5} {args.cache:>6} "
                  f"{1e3 * row['step_s']:>8.2f} "
                  f"{row['tokens_per_s']:>10,.0f}   {row.get('vs_dense', float('nan')):.3f}x the dense step's time",
                  flush=True)
            if row["time_breakdown"] is not None:
                print(f"  device busy {1e3 * row['time_breakdown']['device_s']:.2f} ms of the step's "
                      f"{1e3 * row['step_s']:.2f} (the host's launch {1e3 * row['dispatch_s']:.2f}): " + ", ".join(
                          f"{name} {1e3 * seconds:.2f}" for name, seconds in row["time_breakdown"]["per_step_s"].items()
                          if seconds), flush=True)
            rows.append(row)
    return rows


def peer_rows(peers, config, args) -> list[dict]:
    """The PyTorch peer's rows (`torch_peers.decode_benchmark`, gpt-fast's manner) at the library's batches and
    cache, each with its fraction of the datasheet bandwidth. Run before the library's rows: JAX's allocator keeps
    the GPU memory it has grown to, so the peer's weights and caches must come and go first."""
    rows = peers.decode_benchmark(config, args.batches, args.cache, warmup=args.warmup, steps=args.steps,
                                  device=args.torch_device)
    for row in rows:
        row["fraction_of_peak"] = row["bandwidth_bytes_per_s"] / args.peak_bandwidth
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_model_arguments(parser, model="llama3-8b")
    parser.add_argument("--layout", default="starscream_decode", help="layout the decode step runs under")
    parser.add_argument("--gpus", type=int, default=1, help="devices to use")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64], help="sequences decoded per step")
    parser.add_argument("--cache", type=int, default=4096, help="KV cache length (positions)")
    parser.add_argument("--peak-bandwidth", type=float, default=H200_HBM_BYTES_PER_S,
                        help="device bandwidth in bytes/s (default: the H200 datasheet's 4.8e12)")
    parser.add_argument("--copy-gigabytes", type=float, default=4.0, help="size of the measured copy")
    parser.add_argument("--unroll", type=int, default=0,
                        help="layers per iteration of the layer loop (ModelConfig.scan_unroll; default 0: the "
                             "library's, every layer in decode)")
    parser.add_argument("--profile-dir", type=Path,
                        help="trace 5 more steps of each variant's batches here (DIR/VARIANT/batchB, its compiled "
                             "program beside it) and record their device time by category")
    parser.add_argument("--variants", nargs="+", default=["bf16"],
                        choices=[*VARIANTS, *(variant + APART for variant in VARIANTS)],
                        help="precisions to time side by side (weights-cache; bf16 first for the speed-ups)")
    parser.add_argument("--fp8-format", default="float8_e4m3fn", choices=("float8_e4m3fn", "float8_e4m3fnuz"),
                        help="the chip's fp8 e4m3 format (OCP on H200 and MI355X, FNUZ on MI300X)")
    parser.add_argument("--eight-bit-matmul", default="", choices=("", "pallas", "interpret", "xla"),
                        help="how 8-bit weights' projections run (ModelConfig.eight_bit_matmul; default '': the "
                             "backend's choice, the weight-only kernel on CUDA)")
    parser.add_argument("--paged", nargs="*", default=[], choices=["", "gather", "cudnn"],
                        help="also time the serving engine's paged decode step with these kernels ('': the "
                             "backend's) beside the dense bf16 step")
    parser.add_argument("--paged-cache", default="", choices=["", "int8", "fp8"],
                        help="the paged rows' KV cache format ('': the model's dtype; fp8: --fp8-format), its "
                             "pages read as the engine reads them (8-bit decode: in place on CUDA)"),
    parser.add_argument("--torch", action=argparse.BooleanOptionalAction, default=True,
                        help="also time the PyTorch peer (scripts/torch_peers.py) where torch and a CUDA GPU are "
                             "present (default: on; --quick skips it)")
    parser.add_argument("--torch-device", default="cuda", choices=("cuda", "cpu"),
                        help="where the PyTorch peer runs (cpu: a check of the peer on a machine without a GPU)")
    harness.add_run_arguments(parser, warmup=5, steps=50,
                              quick="tiny model at 2 layers, cache 64, batch 1, 1 + 2 steps, no PyTorch peer")
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.layers, args.cache, args.batches, args.warmup, args.steps, args.copy_gigabytes = \
            "tiny", 2, 64, [1], 1, 2, 0.01
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    # Before JAX starts: torch, if its peer runs, must find GPU memory that JAX has not reserved.
    peers, skipped = harness.torch_peers(args.torch_device) if args.torch and not args.quick else (
        None, "PyTorch peer skipped: " + ("--quick" if args.quick else "--no-torch"))
    import jax.numpy as jnp

    from starscream_jax.hardware.mesh import build_mesh
    from starscream_jax.model.decoder import create_sharded_model
    from starscream_jax.model.layer_weights import inference_split
    from starscream_jax.sharding.apply import use_layout

    mesh = build_mesh(gpus=args.gpus)
    config = harness.model_config(args, dtype="bfloat16", scan_unroll=args.unroll)
    measured = measured_bandwidth(args.copy_gigabytes, warm_seconds=0 if args.quick else WARM_SECONDS)
    copy = measured["copy"]
    devices = mesh.devices.size
    info = harness.run_info(__file__, argv)
    meta = {"model": config.name, "layout": args.layout, "scan_unroll": args.unroll, "mesh": dict(mesh.shape),
            "eight_bit_matmul": args.eight_bit_matmul,
            "devices": devices, "peak_bandwidth_bytes_per_s": args.peak_bandwidth,
            "copy_bandwidth_bytes_per_s": copy, "read_bandwidth_bytes_per_s": measured["read"],
            "read_sum_bytes_per_s": measured["read_sum"], "read_rows_bytes_per_s": measured["read_rows"],
            "read_gemv_bytes_per_s": measured["read_gemv"], "read_gemm_bytes_per_s": measured["read_gemm"],
            "read_attention_bytes_per_s": measured["read_attention"],
            "decode_attention_relative_error": check_decode_attention(*QUICK_ATTENTION_CHECK if args.quick else ()),
            "warmup": args.warmup, "steps": args.steps, **info.as_dict()}
    print(f"{config.name} decode under {args.layout} on {devices} x {info.device_kind}, jax {info.jax}; "
          f"measured copy {copy / 1e12:.2f} TB/s, read {measured['read'] / 1e12:.2f} TB/s, datasheet "
          f"{args.peak_bandwidth / 1e12:.2f} TB/s; decode attention vs float32 reference: relative error "
          f"{meta['decode_attention_relative_error']:.1e}", flush=True)
    header = (f"{'':<26} {'batch':>5} {'cache':>6} {'ms/step':>8} {'tokens/s':>10} {'GB/step':>8} {'TB/s':>6} "
              f"{'of peak':>7} {'of copy':>7} {'of read':>7} {'vs torch':>8} cuDNN attention calls")
    print(header, flush=True)
    result = {"meta": meta, "rows": []}
    if peers is not None and "bf16" not in args.variants:
        peers, skipped = None, "PyTorch peer skipped: no bf16 variant to compare it with"
    if peers is not None:
        result["peer_rows"] = peer_rows(peers, config, args)
        for row in result["peer_rows"]:
            print(row_line(row["name"], row), flush=True)
        harness.write_json(args.out, result)  # kept should a later row not finish
    peer_by_batch = {row["batch"]: row for row in result.get("peer_rows", [])}
    rows, bf16_tokens_per_s = result["rows"], {}
    plain_reason = plain_skipped(config, devices)
    if plain_reason is not None:
        result["plain_skipped"] = plain_reason
        print(plain_reason, flush=True)
    for variant, batch in ((variant, batch) for variant in args.variants for batch in args.batches):
        if batch == args.batches[0]:  # the variant's model, served as stored: bfloat16, or 8-bit with scales
            weights, cache = (args.fp8_format if kind == "fp8" else kind
                              for kind in VARIANTS[variant.removesuffix(APART)])
            variant_config = config.replace(weight_format=weights, kv_format=cache,
                                            eight_bit_matmul=args.eight_bit_matmul,
                                            fuse_projections=not variant.endswith(APART))
            params = rest = None  # the previous variant's weights leave the device first
            with use_layout(args.layout, mesh):
                model = create_sharded_model(variant_config, args.layout, mesh)
            plain_params = plain_weights(model) if variant == "bf16" and plain_reason is None else None
            graphdef, params, rest = inference_split(model, mesh, jnp.bfloat16)  # as the engine holds them
            model = None
        row = run_batch(graphdef, params, rest, variant_config, args.layout, mesh, batch, args.cache, args.warmup,
                        args.steps, args.profile_dir / variant if args.profile_dir else None)
        row["variant"] = variant
        if variant == "bf16":
            bf16_tokens_per_s[batch] = row["tokens_per_s"]
            if batch in peer_by_batch:
                row["vs_torch"] = row["tokens_per_s"] / peer_by_batch[batch]["tokens_per_s"]
        row["speedup_over_bf16"] = row["tokens_per_s"] / bf16_tokens_per_s[batch] if batch in bf16_tokens_per_s \
            else None
        rows.append(with_fractions(row, devices, args.peak_bandwidth, copy, measured["read"]))
        print(row_line(f"{args.layout} {variant}", row), flush=True)
        if plain_params is not None:
            plain = with_fractions(plain_row(plain_params, variant_config, batch, args.cache, args.warmup, args.steps,
                                             row["bytes_per_step"]), devices, args.peak_bandwidth, copy,
                                   measured["read"])
            row["vs_plain"] = row["tokens_per_s"] / plain["tokens_per_s"]
            result.setdefault("plain_rows", []).append(plain)
            print(row_line(plain["name"], plain), flush=True)
        harness.write_json(args.out, result)
    if args.paged:
        params = rest = None  # the last variant's weights leave the device first
        paged_cache = args.fp8_format if args.paged_cache == "fp8" else args.paged_cache
        with use_layout(args.layout, mesh):
            model = create_sharded_model(config.replace(kv_format=paged_cache), args.layout, mesh)
        dense = {row["batch"]: row["step_s"] for row in rows if row["variant"] == "bf16"}
        result["paged_rows"] = paged_rows(model, args, mesh, dense)
        harness.write_json(args.out, result)
    speedups = [f"{row['variant']} batch {row['batch']} {row['speedup_over_bf16']:.2f}x" for row in rows
                if row["speedup_over_bf16"] is not None and row["variant"] != "bf16"]
    if speedups:
        print("tokens/s over bf16: " + ", ".join(speedups), flush=True)
    over_plain = [f"batch {row['batch']} {row['vs_plain']:.3f}x" for row in rows if "vs_plain" in row]
    if over_plain:
        print("library vs plain JAX, tokens/s: " + ", ".join(over_plain), flush=True)
    if peers is None:
        print(skipped, flush=True)
        return 0
    print("library vs torch, tokens/s: " + ", ".join(f"batch {row['batch']} {row['vs_torch']:.3f}x"
                                                    for row in rows if "vs_torch" in row), flush=True)
    return 0


QUICK_ATTENTION_CHECK = (2, 64, 4, 2, 16)
"""check_decode_attention's (batch, length, heads, kv_heads, head_dim) in a --quick run."""


def row_line(name: str, row: dict) -> str:
    """One table line: a library row (its bandwidth fractions, ratio to the peer, cuDNN calls) or a peer's."""
    gigabytes = sum(row["bytes_per_step"].values()) / 1e9

    def percent(key: str) -> str:
        return f"{row[key]:>7.1%}" if key in row else f"{'':>7}"

    ratio = f"{row['vs_torch']:>8.3f}" if "vs_torch" in row else f"{'':>8}"
    return (f"{name:<26} {row['batch']:>5} {row['cache_length']:>6} {1e3 * row['step_s']:>8.2f} "
            f"{row['tokens_per_s']:>10,.0f} {gigabytes:>8.2f} {row['bandwidth_bytes_per_s'] / 1e12:>6.2f} "
            f"{percent('fraction_of_peak')} {percent('fraction_of_copy')} {percent('fraction_of_read')} {ratio} "
            f"{row.get('fused_attention_calls', '')}")


if __name__ == "__main__":
    sys.exit(main())
