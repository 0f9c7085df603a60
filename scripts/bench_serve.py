"""Serving under load, in the manner of `vllm bench serve`: N requests sent all at once or at a Poisson rate to the
engine (`starscream_jax.serving`), in process and through its HTTP server, with the workload's roofline beside.

Per run: request throughput (requests/s), output and total tokens/s over the run's span (first arrival to last
token), and TTFT (arrival to first token), TPOT (a request's mean time per token after its first), ITL (time between
consecutive tokens of a stream) and E2EL (arrival to last token): mean, p50, p99, in milliseconds. Also the decode
steps' mean time at the batch they ran (for TPOT against the step), the prefix-cache hit pages and the programs
compiled. Every workload runs twice, first on prompts of another seed (no prefix of theirs is cached for the second);
the second run is the one reported, and it must compile nothing new (the server's steady state).

Workloads: A, 256 requests of 512 prompt tokens and 128 output tokens at once; B, the same at a Poisson rate
(`--rate`); C, 64 requests whose prompts share a 1,024-token system prompt (then 64 tokens of their own, 64 out),
run with prefix caching and without. `--workload custom` takes --requests, --prompt, --output, --rate,
--random-lengths (each length drawn uniformly from [n/2, 3n/2]).

Roofline (printed beside): prefill FLOPs at the device's measured matmul efficiency (meshes/measured/<chip>.json,
its best large-GEMM figure) plus decode steps reading every weight and the batch's KV cache at the read rate measured
in this run (a sum over a 4 GiB array, scripts/bench_decode.py's measure), all requests decoding together.

Peers of workload A (GPU only): `--peers` adds the library's static `generate` on its first `--static-batch` prompts
(one batch, compile excluded: the throughput of static batching at that batch); `--transformers-only` runs, in a
process JAX has not touched (so torch has the GPU's memory), Hugging Face transformers' continuous batching
(`generate_batch`, sdpa_paged attention) on a randomly initialised model of the same shape instead of the engine.

    python scripts/bench_serve.py --workload A --http --peers --out benchmarks/results/serve_a.json
    python scripts/bench_serve.py --workload A --transformers-only --out benchmarks/results/serve_a_transformers.json
    python scripts/bench_serve.py --workload A --kernels --kernel pallas      # the two decode kernels, then the engine
    python scripts/bench_serve.py --quick                       # CPU smoke run: tiny model, small workloads
"""

import argparse
import asyncio
import dataclasses
import importlib.util
import json
import math
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

from starscream_jax.benchmarks import harness

MILLISECONDS = 1000.0


@dataclasses.dataclass(frozen=True)
class Workload:
    """requests, prompt and output tokens each (drawn from [n/2, 3n/2] with random_lengths), arrival rate (requests
    per second; inf: all at once), a shared prefix of that many tokens at the start of every prompt."""

    name: str
    requests: int
    prompt: int
    output: int
    rate: float = math.inf
    random_lengths: bool = False
    shared_prefix: int = 0


WORKLOADS = {"A": Workload("A", 256, 512, 128), "B": Workload("B", 256, 512, 128, rate=8.0),
             "C": Workload("C", 64, 1088, 64, shared_prefix=1024)}
QUICK = {"A": Workload("A", 8, 12, 6), "B": Workload("B", 8, 12, 6, rate=50.0),
         "C": Workload("C", 6, 20, 4, shared_prefix=16)}


@dataclasses.dataclass
class Trace:
    """One request: when it arrived and when each of its tokens did (perf_counter seconds)."""

    arrival: float
    tokens: list[float] = dataclasses.field(default_factory=list)


def prompts_of(workload: Workload, vocab: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """(prompt token ids, output lengths) of every request."""
    rng = np.random.default_rng(seed)

    def length(n):
        return int(rng.integers(max(1, n // 2), n + n // 2 + 1)) if workload.random_lengths else n

    prefix = rng.integers(0, vocab, workload.shared_prefix).tolist()
    prompts = [prefix + rng.integers(0, vocab, max(1, length(workload.prompt) - len(prefix))).tolist()
               for _ in range(workload.requests)]
    return prompts, [length(workload.output) for _ in range(workload.requests)]


def arrivals(workload: Workload, seed: int = 1) -> list[float]:
    """Seconds after the start at which each request is sent: all 0, or Poisson gaps at `rate`."""
    if math.isinf(workload.rate):
        return [0.0] * workload.requests
    gaps = np.random.default_rng(seed).exponential(1.0 / workload.rate, workload.requests)
    return np.concatenate([[0.0], np.cumsum(gaps[1:])]).tolist()


def summary(values: list[float]) -> dict:
    """mean, p50, p99 in milliseconds (None when empty)."""
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    ordered = np.asarray(values) * MILLISECONDS
    return {"mean": float(ordered.mean()), "p50": float(np.percentile(ordered, 50)),
            "p99": float(np.percentile(ordered, 99))}


def metrics(traces: list[Trace], prompts: list[list[int]]) -> dict:
    """The run's figures (see the module docstring) from its traces."""
    done = [trace for trace in traces if trace.tokens]
    span = max(trace.tokens[-1] for trace in done) - min(trace.arrival for trace in traces)
    output = sum(len(trace.tokens) for trace in done)
    gaps = [b - a for trace in done for a, b in zip(trace.tokens, trace.tokens[1:])]
    return {"completed": len(done), "seconds": span, "request_throughput": len(done) / span,
            "output_tokens_per_s": output / span,
            "total_tokens_per_s": (output + sum(len(p) for p in prompts)) / span,
            "ttft_ms": summary([trace.tokens[0] - trace.arrival for trace in done]),
            "tpot_ms": summary([(trace.tokens[-1] - trace.tokens[0]) / (len(trace.tokens) - 1) for trace in done
                                if len(trace.tokens) > 1]),
            "itl_ms": summary(gaps), "e2el_ms": summary([trace.tokens[-1] - trace.arrival for trace in done])}


def run_in_process(engine, workload: Workload, prompts, outputs) -> list[Trace]:
    """The workload through an `EngineThread`; each token timed when the engine hands it over."""
    from starscream_jax.serving.engine import EngineThread
    from starscream_jax.serving.scheduler import SamplingParams

    thread = EngineThread(engine)
    finished = threading.Semaphore(0)
    traces = []

    def listener(trace):
        def record(event):
            if isinstance(event, BaseException):
                finished.release()
                return
            trace.tokens.append(time.perf_counter())
            if event.finish_reason is not None:
                finished.release()
        return record

    start = time.perf_counter()
    for index, (prompt, output, at) in enumerate(zip(prompts, outputs, arrivals(workload))):
        time.sleep(max(0.0, start + at - time.perf_counter()))
        traces.append(Trace(time.perf_counter()))
        thread.submit(f"{workload.name}-{index}", prompt, SamplingParams(max_tokens=output), listener(traces[-1]))
    for _ in traces:
        finished.acquire()
    thread.stop()
    if thread.error is not None:
        raise thread.error
    return traces


def run_http(engine, workload: Workload, prompts, outputs) -> list[Trace]:
    """The workload through the HTTP server (uvicorn on a localhost port), streamed: each token timed as its
    server-sent event arrives."""
    import httpx
    import uvicorn

    from starscream_jax.serving.engine import EngineThread
    from starscream_jax.serving.server import Server
    server = Server(EngineThread(engine), IdTokenizer(), "bench", max_pending=workload.requests)
    http = uvicorn.Server(uvicorn.Config(server.app(), host="127.0.0.1", port=0, log_level="warning"))
    runner = threading.Thread(target=http.run, daemon=True)
    runner.start()
    while not http.started:
        time.sleep(0.01)
    port = http.servers[0].sockets[0].getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1/completions"

    async def one(client, trace, prompt, output, delay):
        await asyncio.sleep(delay)
        trace.arrival = time.perf_counter()
        body = {"model": "bench", "prompt": prompt, "max_tokens": output, "temperature": 0, "stream": True,
                "ignore_eos": True}
        async with client.stream("POST", url, json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    trace.tokens.append(time.perf_counter())

    async def everyone():
        limits = httpx.Limits(max_connections=workload.requests + 8)
        async with httpx.AsyncClient(timeout=None, limits=limits) as client:
            traces = [Trace(0.0) for _ in prompts]
            await asyncio.gather(*(one(client, trace, prompt, output, at) for trace, prompt, output, at in
                                   zip(traces, prompts, outputs, arrivals(workload))))
            return traces

    try:
        return asyncio.run(everyone())
    finally:
        http.should_exit = True
        runner.join(60)


def decode_step_ms(engine, since: int) -> dict:
    """Mean decode-step milliseconds per batch size (rows running) over the steps after index `since`."""
    rows: dict[int, list[float]] = {}
    for phase, batch, seconds in list(engine.step_seconds)[since:]:
        if phase == "decode":
            rows.setdefault(batch, []).append(seconds)
    return {str(batch): statistics.fmean(times) * MILLISECONDS for batch, times in sorted(rows.items())}


def roofline(config, workload: Workload, prompts, outputs, efficiency: float, peak: float, read_rate: float) -> dict:
    """Seconds and output tokens/s of the workload at the roofline (see the module docstring)."""
    itemsize = 2
    D, L, H, K, E, F, V = (config.d_model, config.n_layers, config.n_heads, config.n_kv_heads, config.head_dim,
                           config.d_ff, config.vocab_size)
    layer_weights = D * (H + 2 * K) * E + H * E * D + 3 * D * F
    weights = L * layer_weights + D * V * (1 if config.tie_embeddings else 2)
    prompt_tokens = sum(len(p) - workload.shared_prefix for p in prompts) + workload.shared_prefix
    attention = sum(2 * L * H * E * len(p) * len(p) for p in prompts)  # causal: q.k and p.v, half each
    prefill = (2 * (L * layer_weights + D * V) * prompt_tokens + attention) / (peak * efficiency)
    kv_per_position = 2 * L * K * E * itemsize
    decode = 0.0
    for step in range(max(outputs)):
        active = [len(p) + step for p, out in zip(prompts, outputs) if out > step]
        decode += (weights * itemsize + kv_per_position * sum(active)) / read_rate
    return {"seconds": prefill + decode, "prefill_seconds": prefill, "decode_seconds": decode,
            "output_tokens_per_s": sum(outputs) / (prefill + decode), "matmul_efficiency": efficiency,
            "read_bytes_per_s": read_rate}


def static_generate_peer(model, prompts, outputs, batch: int) -> dict:
    """The library's `generate` on the first `batch` prompts as one batch (compile excluded): output tokens/s."""
    from starscream_jax.training.generate import generate

    rows = np.asarray(prompts[:batch])
    result = generate(model, rows, max(outputs))
    seconds = rows.size / result.prefill_tokens_per_s + rows.shape[0] * (max(outputs) - 1) / result.decode_tokens_per_s
    return {"batch": rows.shape[0], "seconds": seconds, "output_tokens_per_s": rows.shape[0] * max(outputs) / seconds}


def transformers_peer(config, prompts, outputs) -> dict:
    """Hugging Face transformers' continuous batching (`generate_batch`) on a random model of the same shape."""
    try:
        import torch
        import transformers
        from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    except ImportError as err:
        return {"skipped": f"transformers peer skipped: {err}"}
    if not torch.cuda.is_available():
        return {"skipped": "transformers peer skipped: torch sees no CUDA GPU"}
    hf_config = LlamaConfig(vocab_size=config.vocab_size, hidden_size=config.d_model,
                            intermediate_size=config.d_ff, num_hidden_layers=config.n_layers,
                            num_attention_heads=config.n_heads, num_key_value_heads=config.n_kv_heads,
                            head_dim=config.head_dim, max_position_embeddings=config.max_seq_len,
                            tie_word_embeddings=config.tie_embeddings, eos_token_id=None, pad_token_id=0)
    try:
        torch.set_default_dtype(torch.bfloat16)
        with torch.device("cuda"):
            model = LlamaForCausalLM(hf_config)
        model.config._attn_implementation = "sdpa_paged"
        generation = GenerationConfig(max_new_tokens=max(outputs), do_sample=False, eos_token_id=None,
                                      pad_token_id=0)
        model.generate_batch(inputs=prompts[:4], generation_config=generation, progress_bar=False)  # warm-up
        torch.cuda.synchronize()
        started = time.perf_counter()
        results = model.generate_batch(inputs=prompts, generation_config=generation, progress_bar=False)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - started
    except Exception as err:  # an API this transformers version lacks: say so in the results
        return {"skipped": f"transformers {transformers.__version__} generate_batch failed: {err!r}"}
    produced = sum(len(output.generated_tokens) for output in results.values())
    return {"transformers": transformers.__version__, "seconds": seconds, "output_tokens": produced,
            "output_tokens_per_s": produced / seconds}


def time_kernels(config, batch: int, positions: int, page_size: int, warmup: int = 3, calls: int = 20) -> dict:
    """One layer's paged decode attention (`model.paged.paged_attention`) under each kernel, alone: `batch` rows
    of `positions` cached positions each, their pages scattered at random over a pool of exactly that many pages:
    milliseconds per call, the bytes of K/V it must read over that time, and its largest difference from the
    gather kernel's output."""
    import jax
    import jax.numpy as jnp

    from starscream_jax.model.paged import KERNELS, PagedLayer, paged_attention

    dtype, K, H, E = jnp.dtype(config.dtype), config.n_kv_heads, config.n_heads, config.head_dim
    per_row = -(-positions // page_size)
    keys = jax.random.split(jax.random.key(0), 5)
    pool = (K, batch * per_row + 1, page_size, E)
    pages_k, pages_v = (jax.random.normal(key, pool, dtype) for key in keys[:2])
    table = (jax.random.permutation(keys[2], batch * per_row) + 1).reshape(batch, per_row).astype(jnp.int32)
    q = jax.random.normal(keys[3], (batch, 1, H, E), dtype)
    k, v = (jax.random.normal(keys[4], (batch, 1, K, E), dtype) for _ in range(2))
    position = jnp.full((batch, 1), positions - 1, jnp.int32)
    rows, outputs = {}, {}
    for kernel in KERNELS:
        step = jax.jit(lambda q, k, v, p, t, a, b, kernel=kernel: paged_attention(q, k, v, p, PagedLayer(a, b, t,
                                                                                                       kernel))[0])
        args = (q, k, v, position, table, pages_k, pages_v)
        outputs[kernel] = np.asarray(step(*args).astype(jnp.float32))
        seconds = harness.seconds_per_call(step, args, warmup=warmup, calls=calls)
        read = 2 * batch * positions * K * E * dtype.itemsize
        rows[kernel] = {"ms": seconds * MILLISECONDS, "kv_bytes_per_s": read / seconds,
                        "max_abs_diff_vs_gather": float(np.max(np.abs(outputs[kernel] - outputs["gather"])))}
    return {"batch": batch, "positions": positions, "page_size": page_size, "kernels": rows}


def measured_read_rate() -> float:
    """Bytes per second of a sum over a 4 GiB bfloat16 array (scripts/bench_decode.py's `measured_bandwidth`)."""
    spec = importlib.util.spec_from_file_location("bench_decode", Path(__file__).with_name("bench_decode.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.measured_bandwidth(4.0)["read"]


def matmul_efficiency(chip: str) -> tuple[float, float]:
    """(best measured matmul efficiency of meshes/measured/<chip>.json, its peak FLOP/s)."""
    data = json.loads((harness.REPO_ROOT / "meshes" / "measured" / f"{chip}.json").read_text())
    return max(entry["efficiency"] for entry in data["matmul"]), data["peak_flops"]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_model_arguments(parser, model="llama3-8b")
    parser.add_argument("--workload", nargs="+", default=["A", "B", "C"], choices=["A", "B", "C", "custom"])
    parser.add_argument("--requests", type=int, default=64, help="custom workload: requests")
    parser.add_argument("--prompt", type=int, default=512, help="custom workload: prompt tokens")
    parser.add_argument("--output", type=int, default=128, help="custom workload: output tokens")
    parser.add_argument("--rate", type=float, default=math.inf, help="requests per second (B, custom; inf: at once)")
    parser.add_argument("--random-lengths", action="store_true", help="custom workload: lengths drawn")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--max-seqs", type=int, default=256, help="sequences running at once")
    parser.add_argument("--token-budget", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--kernel", default="gather", choices=["gather", "pallas"])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--http", action="store_true", help="also through the HTTP server")
    parser.add_argument("--peers", action="store_true", help="workload A's static generate peer (GPU)")
    parser.add_argument("--kernels", action="store_true",
                        help="first time one layer's paged decode attention under each kernel (--max-seqs rows, the "
                             "first workload's prompt + output positions)")
    parser.add_argument("--transformers-only", action="store_true",
                        help="run transformers' continuous batching on the workloads instead of the engine (GPU)")
    parser.add_argument("--static-batch", type=int, default=64, help="batch of the static generate peer")
    parser.add_argument("--chip", default="h200", help="measured figures of the roofline (meshes/measured)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here (rewritten after every run)")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny model, small workloads, CPU")
    return parser.parse_args(argv)


def engine_config(args, workloads: list[Workload]):
    """An engine configuration sized for the workloads: pages for every request of the largest at once, and few
    buckets (each compile of a full-depth model takes long): decode rows of a quarter and all of --max-seqs, pages of
    half and all of the widest request, prefill steps of every chunk the budget holds; one of each with --quick, so
    that the smoke run compiles two programs."""
    from starscream_jax.serving.engine import EngineConfig
    from starscream_jax.serving.steps import Buckets

    def pages_per_row(w: Workload) -> int:
        scale = 1.5 if w.random_lengths else 1.0
        return math.ceil(int((w.prompt + w.output) * scale) / args.page_size)

    widest = max(pages_per_row(w) for w in workloads)
    rows = min(args.max_seqs, max(w.requests for w in workloads))
    prefill_rows = max(1, min(rows, args.token_budget // args.chunk + 1))
    if args.quick:
        buckets = Buckets(rows=(rows,), positions=(args.chunk,), pages=(widest,), prefill_rows=(prefill_rows,))
    else:
        buckets = Buckets(rows=tuple(sorted({max(1, rows // 4), rows})), positions=(args.chunk,),
                          pages=tuple(sorted({max(1, widest // 2), widest})), prefill_rows=(prefill_rows,))
    pages = max(min(w.requests, rows) * pages_per_row(w) for w in workloads) + 1
    return EngineConfig(page_size=args.page_size, pages_per_shard=pages, rows_per_shard=rows,
                        token_budget=args.token_budget, chunk=args.chunk, kernel=args.kernel, buckets=buckets)


class IdTokenizer:
    """What the HTTP server needs of a tokenizer when prompts come as token ids: no EOS, text of the ids."""

    eos_id = None

    def decode(self, token_ids) -> str:
        return "".join(f" {int(token)}" for token in token_ids)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.quick:
        args.model, args.layers, args.dtype, args.chunk, args.token_budget = "tiny", 2, "float32", 16, 48
        args.page_size, args.max_seqs, args.http, args.kernels = 4, 8, True, True
    import jax
    from flax import nnx

    from starscream_jax.model.decoder import Transformer
    from starscream_jax.serving.engine import Engine

    config = harness.model_config(args, dtype=args.dtype)
    workloads = [QUICK[name] if args.quick else WORKLOADS[name] for name in args.workload if name != "custom"]
    if "custom" in args.workload:
        workloads.append(Workload("custom", args.requests, args.prompt, args.output, args.rate, args.random_lengths))
    if not args.quick and "B" in args.workload:
        workloads = [dataclasses.replace(w, rate=args.rate) if w.name == "B" and not math.isinf(args.rate) else w
                     for w in workloads]
    config = config.replace(max_seq_len=max(config.max_seq_len, max(w.prompt * 2 + w.output * 2 for w in workloads)))
    if args.transformers_only:
        return transformers_only(args, argv, config, workloads)
    model = Transformer(config, rngs=nnx.Rngs(0))
    settings = engine_config(args, workloads)
    engines = {}
    gpu = jax.devices()[0].platform == "gpu"
    efficiency, peak = matmul_efficiency(args.chip)
    read_rate = measured_read_rate() if gpu else 1e11
    info = harness.run_info(__file__, argv)
    result = {"meta": info.as_dict(), "model": config.name, "layers": config.n_layers, "dtype": config.dtype,
              "engine": {"page_size": args.page_size, "max_seqs": args.max_seqs, "token_budget": args.token_budget,
                         "chunk": args.chunk, "kernel": args.kernel}, "runs": []}
    if args.kernels:
        first = workloads[0]
        result["kernels"] = time_kernels(config, min(args.max_seqs, first.requests), first.prompt + first.output,
                                         args.page_size, calls=2 if args.quick else 20)
        print(f"paged attention, one layer: {json.dumps(result['kernels'])}", flush=True)
        harness.write_json(args.out, result)
    for workload in workloads:
        prompts, outputs = prompts_of(workload, config.vocab_size)
        warm = prompts_of(workload, config.vocab_size, seed=1)
        line = roofline(config, workload, prompts, outputs, efficiency, peak, read_rate)
        variants = [("prefix", True), ("no_prefix", False)] if workload.shared_prefix else [("", True)]
        for label, prefix_caching in variants:
            if not engines:
                engines["engine"] = Engine(model, settings)
            engine = engines["engine"]
            engine.use_prefix_caching(prefix_caching)
            modes = [("in_process", run_in_process)] + ([("http", run_http)] if args.http else [])
            for mode, runner in modes:
                runner(engine, workload, *warm)  # compiles what the workload reaches, on prompts of their own
                programs, since, hits = engine.stats().programs, len(engine.step_seconds), \
                    engine.stats().prefix_hit_pages
                figures = metrics(runner(engine, workload, prompts, outputs), prompts)
                stats = engine.stats()
                row = {"workload": dataclasses.asdict(workload), "mode": mode, "prefix_caching": prefix_caching,
                       **figures, "decode_step_ms_by_batch": decode_step_ms(engine, since),
                       "prefix_hit_pages": stats.prefix_hit_pages - hits, "programs": stats.programs,
                       "new_programs_in_timed_run": stats.programs - programs, "roofline": line,
                       "vs_roofline": figures["output_tokens_per_s"] / line["output_tokens_per_s"]}
                result["runs"].append(row)
                print(row_line(workload, mode, label, row), flush=True)
                harness.write_json(args.out, result)
        if args.peers and gpu and workload.name == "A":
            engines.clear()  # the peer's cache takes the pages' place
            result["peers"] = {"static_generate": static_generate_peer(model, prompts, outputs, args.static_batch)}
            print(f"peers: {json.dumps(result['peers'])}", flush=True)
            harness.write_json(args.out, result)
    return 0


def transformers_only(args, argv, config, workloads: list[Workload]) -> int:
    """transformers' continuous batching on each workload's prompts (all at once), nothing of JAX allocated."""
    result = {"meta": {"command": harness.command_line(__file__, argv)}, "model": config.name, "runs": []}
    for workload in workloads:
        prompts, outputs = prompts_of(workload, config.vocab_size)
        result["runs"].append({"workload": dataclasses.asdict(workload),
                               "transformers": transformers_peer(config, prompts, outputs)})
        print(f"{workload.name} transformers: {json.dumps(result['runs'][-1]['transformers'])}", flush=True)
        harness.write_json(args.out, result)
    return 0


def row_line(workload: Workload, mode: str, label: str, row: dict) -> str:
    return (f"{workload.name}{'/' + label if label else ''} {mode}: {row['completed']} requests in "
            f"{row['seconds']:.2f} s, {row['output_tokens_per_s']:,.0f} out tok/s "
            f"({row['vs_roofline']:.2f} of roofline {row['roofline']['output_tokens_per_s']:,.0f}), TTFT p50 "
            f"{row['ttft_ms']['p50']:.1f} ms, TPOT p50 {row['tpot_ms']['p50'] or 0:.2f} ms, ITL p99 "
            f"{row['itl_ms']['p99'] or 0:.2f} ms, prefix hits {row['prefix_hit_pages']}, programs {row['programs']} "
            f"(+{row['new_programs_in_timed_run']} in the timed run)")


if __name__ == "__main__":
    sys.exit(main())
