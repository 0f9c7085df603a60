"""Serving under load, measured as `vllm bench serve` measures it: `starscream serve` started as its own process on a
model directory, the load sent from another process (this one), and beside it in the same run the same engine driven
in process, Hugging Face transformers' continuous batching, and the workload's roofline.

Per run: request throughput (requests/s), output and total tokens/s over the run's span (first arrival to last
token), and TTFT (arrival to first token), TPOT (a request's mean time per token after its first), ITL (time between
consecutive chunks of a stream) and E2EL (arrival to last token): mean, p50, p99, in milliseconds. Every workload
runs twice, first on prompts of another seed (no prefix of theirs is cached for the second); the second run is the
one reported, and it must compile nothing new.

The steps, each a process of its own so that each has the GPU's memory to itself:
  1. the model directory: --model-dir, or one of random weights in --model's shape (`benchmarks.random_model`);
  2. the engine in process (`--engine-only`, a child): the engine `starscream serve` would build from the same
     flags (`cli.serve.build_engine`: capacity from memory, every program compiled), driven step by step by a loop
     that submits each request at its arrival; the roofline's read rate is measured there; with
     `--static-generate BATCH`, then the library's static `generate` over the same prompts, BATCH rows at a time,
     on the engine's weights (what continuous batching is measured against);
  3. `--http`: `starscream serve` on the directory (its start-up time to /health recorded, the compilation cache
     warm from step 2), the load streamed over HTTP from here, then /metrics' TTFT beside the client's;
  4. `--transformers`: transformers' continuous batching (`generate_batch`) on the same shape, in a child.
`--fake-engine STEP_MS` instead measures the server alone on the CPU: `starscream serve --fake-engine` (no model)
under --streams concurrent streams, its tokens/s and the API process' CPU seconds per token and per step.

Workloads: A, 256 requests of 512 prompt tokens and 128 output tokens at once; B, the same at a Poisson rate
(`--rate`); C, 64 requests whose prompts share a 1,024-token system prompt (then 64 tokens of their own, 64 out),
run with prefix caching and without. `--workload custom` takes --requests, --prompt, --output, --rate,
--random-lengths (each length drawn uniformly from [n/2, 3n/2]).

`--sampling-settings` runs each workload in process a second time with every request greedy under a presence,
frequency and repetition penalty, a logit bias and 5 top log-probabilities (`SETTINGS`): the decode step's time
with and without the work the step does for them (`serving.sampling`).

Roofline (printed beside): prefill FLOPs at the device's measured matmul efficiency (meshes/measured/<chip>.json,
its best large-GEMM figure) plus decode steps, all requests decoding together, each the slower of reading every
multiplied weight (the embedding only by the rows it gathers) and their FLOPs at that efficiency (at a few hundred
rows the GEMMs turn compute-bound: Llama 3 8B's 256 rows on an H200 need 4.9 ms of FLOPs against 4.0 ms of reads),
plus the batch's KV cache read; reads at the rate measured in this run (a sum over a 4 GiB array,
scripts/bench_decode.py's measure).

    python scripts/bench_serve.py --workload A --http --transformers --out benchmarks/results/serve_a.json
    python scripts/bench_serve.py --fake-engine 20 --out benchmarks/results/serve_front_end.json   # CPU
    python scripts/bench_serve.py --quick                       # CPU smoke run: tiny model, small workloads
"""

import argparse
import asyncio
import dataclasses
import datetime
import importlib.util
import json
import math
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from starscream_jax.benchmarks import harness
from starscream_jax.cli.arguments import count_or_zero

MILLISECONDS = 1000.0


@dataclasses.dataclass(frozen=True, kw_only=True)
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


WORKLOADS = {"A": Workload(name="A", requests=256, prompt=512, output=128),
             "B": Workload(name="B", requests=256, prompt=512, output=128, rate=8.0),
             "C": Workload(name="C", requests=64, prompt=1088, output=64, shared_prefix=1024)}
QUICK = {"A": Workload(name="A", requests=8, prompt=12, output=6),
         "B": Workload(name="B", requests=8, prompt=12, output=6, rate=50.0),
         "C": Workload(name="C", requests=6, prompt=20, output=4, shared_prefix=16)}


@dataclasses.dataclass
class Trace:
    """One request: when it arrived and when each of its tokens (or streamed chunks) did (perf_counter seconds),
    and its tokens in all where a chunk may hold several (the server's usage count; None: one per entry)."""

    arrival: float
    tokens: list[float] = dataclasses.field(default_factory=list)
    count: int | None = None

    @property
    def generated(self) -> int:
        return len(self.tokens) if self.count is None else self.count


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
    output = sum(trace.generated for trace in done)
    gaps = [b - a for trace in done for a, b in zip(trace.tokens, trace.tokens[1:])]
    return {"completed": len(done), "seconds": span, "request_throughput": len(done) / span,
            "output_tokens_per_s": output / span,
            "total_tokens_per_s": (output + sum(len(p) for p in prompts)) / span,
            "ttft_ms": summary([trace.tokens[0] - trace.arrival for trace in done]),
            "tpot_ms": summary([(trace.tokens[-1] - trace.tokens[0]) / (trace.generated - 1) for trace in done
                                if trace.generated > 1]),
            "itl_ms": summary(gaps), "e2el_ms": summary([trace.tokens[-1] - trace.arrival for trace in done])}


def decode_step_ms(engine, since: int) -> dict:
    """Mean decode-step milliseconds per batch size (rows running) over the steps after index `since`."""
    rows: dict[int, list[float]] = {}
    for step in list(engine.step_times)[since:]:
        if step.prefill_rows == 0:
            rows.setdefault(step.decode_rows, []).append(step.seconds)
    return {str(batch): statistics.fmean(times) * MILLISECONDS for batch, times in sorted(rows.items())}


def steps_by_kind(engine, since: int) -> dict:
    """The steps after index `since` by kind: prefill only, decode only, and both (prompt chunks beside decode rows),
    each with its count and mean milliseconds; where both ran, the programs a step launched (1: a mixed step)."""
    kinds: dict[str, list] = {"prefill": [], "decode": [], "both": []}
    for step in list(engine.step_times)[since:]:
        kind = "both" if step.prefill_rows and step.decode_rows else "prefill" if step.prefill_rows else "decode"
        kinds[kind].append(step)
    out = {kind: {"steps": len(steps), "mean_ms": statistics.fmean(s.seconds for s in steps) * MILLISECONDS}
           for kind, steps in kinds.items() if steps}
    if kinds["both"]:
        out["both"]["programs"] = statistics.fmean(step.programs for step in kinds["both"])
    return out


def host_ms(engine, since: int) -> dict:
    """Milliseconds per step over the steps after index `since`: the host's own work (scheduling, building the
    inputs) and the program calls' return (placing the inputs, enqueueing; a call the runtime makes wait for the
    device counts here), each as a mean and as a share of the steps' seconds (with the engine's overlap, host work
    under a share of 1 runs while the device computes)."""
    steps = list(engine.step_times)[since:]
    if not steps:
        return {}
    total = max(sum(step.seconds for step in steps), 1e-9)
    host, calls = [step.host_seconds for step in steps], [step.call_seconds for step in steps]
    return {"mean": statistics.fmean(host) * MILLISECONDS, "share_of_step": sum(host) / total,
            "calls_mean": statistics.fmean(calls) * MILLISECONDS, "calls_share_of_step": sum(calls) / total}


def roofline(config, workload: Workload, prompts, outputs, efficiency: float, peak: float, read_rate: float) -> dict:
    """Seconds and output tokens/s of the workload at the roofline (see the module docstring)."""
    itemsize = 2
    D, L, H, K, E, F, V = (config.d_model, config.n_layers, config.n_heads, config.n_kv_heads, config.head_dim,
                           config.d_ff, config.vocab_size)
    layer_weights = D * (H + 2 * K) * E + H * E * D + 3 * D * F
    multiplied = L * layer_weights + D * V  # a decode step gathers only its tokens' embedding rows
    prompt_tokens = sum(len(p) - workload.shared_prefix for p in prompts) + workload.shared_prefix
    attention = sum(2 * L * H * E * len(p) * len(p) for p in prompts)  # causal: q.k and p.v, half each
    matmul_rate = peak * efficiency
    prefill = (2 * multiplied * prompt_tokens + attention) / matmul_rate
    kv_per_position = 2 * L * K * E * itemsize
    decode = 0.0
    for step in range(max(outputs)):
        active = [len(p) + step for p, out in zip(prompts, outputs) if out > step]
        weight_seconds = max(multiplied * itemsize / read_rate, 2 * multiplied * len(active) / matmul_rate)
        decode += weight_seconds + kv_per_position * sum(active) / read_rate
    return {"seconds": prefill + decode, "prefill_seconds": prefill, "decode_seconds": decode,
            "output_tokens_per_s": sum(outputs) / (prefill + decode), "matmul_efficiency": efficiency,
            "read_bytes_per_s": read_rate}


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
        model.config._attn_implementation = "paged|sdpa"
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


def measured_read_rate() -> float:
    """Bytes per second of the fastest read of 4 GiB of bfloat16 values (scripts/bench_decode.py's
    `measured_bandwidth`: a sum, row sums, a GEMV, GEMMs of a few rows over separate weights as decode reads them,
    or decode attention over the array as a KV cache)."""
    spec = importlib.util.spec_from_file_location("bench_decode", Path(__file__).with_name("bench_decode.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.measured_bandwidth(4.0)["read"]


def matmul_efficiency(chip: str) -> tuple[float, float]:
    """(best measured matmul efficiency of meshes/measured/<chip>.json, its peak FLOP/s)."""
    data = json.loads((harness.REPO_ROOT / "meshes" / "measured" / f"{chip}.json").read_text())
    return max(entry["efficiency"] for entry in data["matmul"]), data["peak_flops"]


SETTINGS = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1, logit_bias=((0, -1.0),),
                top_logprobs=5, logprobs=True)
"""--sampling-settings: what every request of the second in-process run asks for besides max_tokens."""


def run_engine(engine, workload: Workload, prompts, outputs, settings: dict | None = None) -> list[Trace]:
    """The workload driven straight through the engine: each request submitted at its arrival (with `settings`,
    SamplingParams fields, where given), steps run back to back, each token timed when its step returns."""
    from starscream_jax.serving.scheduler import SamplingParams

    traces, due = [Trace(0.0) for _ in prompts], arrivals(workload)
    by_id, sent, start = {}, 0, time.perf_counter()
    while sent < len(prompts) or engine.busy:
        now = time.perf_counter()
        while sent < len(prompts) and start + due[sent] <= now:
            traces[sent].arrival = now
            by_id[f"{workload.name}-{sent}"] = traces[sent]
            engine.submit(f"{workload.name}-{sent}", prompts[sent],
                          SamplingParams(max_tokens=outputs[sent], **(settings or {})))
            sent += 1
        if not engine.busy:
            time.sleep(max(0.0, min(0.001, start + due[sent] - time.perf_counter())))
            continue
        events = engine.step()
        stamp = time.perf_counter()
        for event in events:
            by_id[event.request_id].tokens.append(stamp)
    return traces


KEEP_ALIVE_S = 60.0
"""The HTTP run's server keeps an idle connection this long (`--timeout-keep-alive`; uvicorn's default 5 s closes
the connections of the warm-up round's first finished requests before the timed round reuses them)."""


def http_rounds(url: str, workload: Workload, rounds, model: str, before_last=lambda: None):
    """Each round of (prompts, outputs) streamed to `url` in turn, request i of every round sent by user i: a client
    of its own whose one connection stays open from round to round, as a long-lived user's does (the timed last
    round sets up no connection). One client per user, not one pool for all: httpx's pool, holding hundreds of idle
    connections, kept requests waiting for one for seconds (256 streams of a fake engine: the second round's
    requests started sending after 26 s, the first's after 0.2). `before_last()` runs just before the last round.
    Gives (every round's traces, what `before_last` gave)."""
    import httpx

    async def run():
        one_connection = httpx.Limits(max_connections=1, keepalive_expiry=KEEP_ALIVE_S / 2)
        users = [httpx.AsyncClient(timeout=None, limits=one_connection) for _ in range(workload.requests)]
        try:
            traces = [await http_load(users, url, workload, prompts, outputs, model)
                      for prompts, outputs in rounds[:-1]]
            noted = before_last()
            return [*traces, await http_load(users, url, workload, *rounds[-1], model)], noted
        finally:
            await asyncio.gather(*(user.aclose() for user in users))

    return asyncio.run(run())


async def http_load(users, url: str, workload: Workload, prompts, outputs, model: str) -> list[Trace]:
    """The workload streamed over HTTP to `url`, request i by `users[i]` (an httpx client) at its arrival: each
    server-sent chunk timed (a chunk holds every token of the steps its client had not read yet), the tokens counted
    by the usage chunk."""
    async def one(client, trace, prompt, output, delay):
        await asyncio.sleep(delay)
        trace.arrival = time.perf_counter()
        body = {"model": model, "prompt": prompt, "max_tokens": output, "temperature": 0, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"the server answered {response.status_code}: {await response.aread()}")
            async for line in response.aiter_lines():
                if line.startswith('data: {"id"') and '"usage"' in line and '"choices":[]' in line:
                    trace.count = json.loads(line[6:])["usage"]["completion_tokens"]
                elif line.startswith("data: {"):
                    trace.tokens.append(time.perf_counter())

    traces = [Trace(0.0) for _ in prompts]
    await asyncio.gather(*(one(*sent) for sent in zip(users, traces, prompts, outputs, arrivals(workload))))
    return traces


class ServeProcess:
    """`starscream serve` in a process of its own on a free port, until `stop()` (SIGTERM, then its exit)."""

    def __init__(self, serve_args: list[str], log: Path):
        self.port = free_port()
        self.log = log
        command = [sys.executable, "-m", "starscream_jax.cli.main", "serve", *serve_args, "--port", str(self.port)]
        self.started = time.perf_counter()
        self.process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=child_env())
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_healthy(self, timeout: float) -> float:
        """Seconds from the start to the first 200 of /health."""
        import httpx

        deadline = self.started + timeout
        while time.perf_counter() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"starscream serve exited with {self.process.returncode}:\n{self.log.read_text()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.perf_counter() - self.started
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"starscream serve was not healthy within {timeout} s:\n{self.log.read_text()}")

    def cpu_seconds(self) -> float:
        """User and system CPU seconds of the API process so far (Linux /proc)."""
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def metrics(self) -> str:
        import httpx
        return httpx.get(self.url + "/metrics", timeout=10).text

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(120)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def child_env() -> dict:
    """This environment for a child process, the repository importable."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(harness.REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_model_arguments(parser, model="llama3-8b")
    parser.add_argument("--model-dir", type=Path, help="serve this Hugging Face directory (default: random weights "
                                                       "of --model's shape, written to --work-dir)")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/starscream-bench-serve"))
    parser.add_argument("--workload", nargs="+", default=["A"], choices=["A", "B", "C", "custom"])
    parser.add_argument("--requests", type=int, default=64, help="custom workload: requests")
    parser.add_argument("--prompt", type=int, default=512, help="custom workload: prompt tokens")
    parser.add_argument("--output", type=int, default=128, help="custom workload: output tokens")
    parser.add_argument("--rate", type=float, default=math.inf, help="requests per second (B, custom; inf: at once)")
    parser.add_argument("--random-lengths", action="store_true", help="custom workload: lengths drawn")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="sequences running at once")
    parser.add_argument("--max-num-batched-tokens", type=int, help="most tokens per step (default: the server's)")
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--kernel", default="", choices=["", "gather", "cudnn"],
                        help="paged decode attention (default: the backend's, cuDNN's paged kernel on NVIDIA GPUs)")
    parser.add_argument("--no-overlap", action="store_true", help="the engine reads each step before the next")
    parser.add_argument("--mixed-chunks", type=count_or_zero, default=1,
                        help="most prompt chunks per shard of a mixed step (serve's --mixed-chunks; 0: none)")
    parser.add_argument("--compare-two-programs", action="store_true",
                        help="also run each workload in process with mixed steps off (a step's prompt chunks and "
                             "decode rows as two programs), on the same engine")
    parser.add_argument("--sampling-settings", action="store_true",
                        help="also run each workload in process with penalties, a logit bias and top logprobs")
    parser.add_argument("--http", action="store_true", help="also through `starscream serve` in its own process")
    parser.add_argument("--transformers", action="store_true", help="also transformers' continuous batching (GPU)")
    parser.add_argument("--static-generate", type=int, default=0, metavar="BATCH",
                        help="also the library's static `generate` over each workload's prompts, BATCH rows at a "
                             "time, in the engine's process on its weights (equal prompt and output lengths)")
    parser.add_argument("--chip", default="h200", help="measured figures of the roofline (meshes/measured)")
    parser.add_argument("--fake-engine", type=float, metavar="STEP_MS", help="measure the server alone (CPU)")
    parser.add_argument("--streams", type=int, default=256, help="--fake-engine: concurrent streams")
    parser.add_argument("--profile-dir", type=Path, help="trace each timed in-process run here (GPU) and record "
                                                          "its device time by category and the device's idle share")
    parser.add_argument("--out", type=Path, help="write the results as JSON here (rewritten after every run)")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny model, small workloads, CPU")
    parser.add_argument("--engine-only", type=Path, help=argparse.SUPPRESS)  # the child of step 2: its JSON path
    parser.add_argument("--transformers-only", type=Path, help=argparse.SUPPRESS)  # the child of step 4
    args = parser.parse_args(argv)
    if args.static_generate < 0:
        parser.error(f"--static-generate {args.static_generate}: give the rows of each static batch (at least 1), "
                     "or leave it out")
    return args


def workloads_of(args) -> list[Workload]:
    chosen = [QUICK[name] if args.quick else WORKLOADS[name] for name in args.workload if name != "custom"]
    if "custom" in args.workload:
        chosen.append(Workload(name="custom", requests=args.requests, prompt=args.prompt, output=args.output,
                               rate=args.rate, random_lengths=args.random_lengths))
    return [dataclasses.replace(w, rate=args.rate) if w.name == "B" and not math.isinf(args.rate) else w
            for w in chosen]


def serve_args(args, model_dir: Path, workloads: list[Workload]) -> list[str]:
    """The `starscream serve` flags of this run, which the in-process engine is built from too."""
    longest = max(int((w.prompt + w.output) * (1.5 if w.random_lengths else 1.0)) for w in workloads)
    flags = ["--model-dir", str(model_dir), "--max-num-seqs", str(args.max_num_seqs), "--max-model-len",
             str(max(longest, 16)), "--chunk", str(args.chunk), "--compilation-cache", str(args.work_dir / "compiled")]
    if args.max_num_batched_tokens:
        flags += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.kernel:
        flags += ["--kernel", args.kernel]
    if args.no_overlap:
        flags.append("--no-overlap")
    flags += ["--mixed-chunks", str(args.mixed_chunks)]
    if args.quick:
        flags += ["--simulate", "--topology", "1x1", "--page-size", "4", "--dtype", "float32"]
    else:
        flags += ["--gpus", "1"]
    return flags


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.quick:
        args.model, args.layers, args.chunk, args.max_num_batched_tokens = "tiny", 2, 16, 48
        args.max_num_seqs, args.http, args.sampling_settings, args.compare_two_programs = 4, True, True, True
        args.mixed_chunks = 3  # every prefill step's chunks (48 tokens in chunks of 16): every step of both mixes
        args.static_generate = args.static_generate or 4
        args.fake_engine = args.fake_engine or 20.0
        args.streams = min(args.streams, 16)
    if args.engine_only:
        return engine_only(args, argv)
    if args.transformers_only:
        return transformers_only(args, argv)
    result = {"meta": {"command": harness.command_line(__file__, argv),
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "host": f"{platform.machine()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}"}}
    if args.fake_engine:
        result["front_end"] = front_end(args)
        print(f"front end: {json.dumps(result['front_end'])}", flush=True)
        harness.write_json(args.out, result)
        if not args.quick:
            return 0
    workloads = workloads_of(args)
    config = harness.model_config(args)
    model_dir = args.model_dir or write_model(config, args.work_dir / f"model-{config.name}-{config.n_layers}")
    flags = serve_args(args, model_dir, workloads)
    engine_json = args.work_dir / "engine.json"
    child = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--engine-only",
             str(engine_json)]
    run_child(child, "the engine in process")
    engine = json.loads(engine_json.read_text())
    result["meta"] = {**engine.pop("meta"), **result["meta"]}  # the child's JAX and device, this run's command
    result.update(engine)
    harness.write_json(args.out, result)
    if args.http:
        result["http"] = http_runs(args, flags, workloads, config)
        harness.write_json(args.out, result)
    if args.transformers:
        peer_json = args.work_dir / "transformers.json"
        run_child([sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--transformers-only",
                   str(peer_json)], "transformers' run")
        result["transformers"] = json.loads(peer_json.read_text())["runs"]
    result["ratios"] = ratios(result)
    print(f"ratios: {json.dumps(result['ratios'])}", flush=True)
    harness.write_json(args.out, result)
    return 0


def write_model(config, out: Path) -> Path:
    from starscream_jax.benchmarks.random_model import write_random_model

    started = time.perf_counter()
    write_random_model(config, out, dtype="float32" if config.dtype == "float32" else "bfloat16")
    print(f"model directory {out} ready in {time.perf_counter() - started:.1f} s", flush=True)
    return out


def run_child(command: list[str], what: str) -> None:
    """Runs a step's child process; where it fails, exits naming the step (its own message is printed above)."""
    status = subprocess.run(command, env=child_env()).returncode
    if status:
        raise SystemExit(f"bench_serve.py: {what} failed (exit status {status}; its output is above)")


def engine_only(args, argv) -> int:
    """Step 2 (a child process): the engine `starscream serve` builds from the same flags, driven in process."""
    import jax

    from starscream_jax.cli import main as cli
    from starscream_jax.cli.serve import build_engine

    workloads = workloads_of(args)
    config = harness.model_config(args)
    model_dir = args.model_dir or args.work_dir / f"model-{config.name}-{config.n_layers}"
    parser = cli.build_parser()
    serve = parser.parse_args(["serve", *serve_args(args, model_dir, workloads)])
    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{serve.gpu_memory_utilization:.3f}"  # as the server's engine
    gpu = jax.devices()[0].platform == "gpu"
    if args.profile_dir and not gpu:
        raise SystemExit("bench_serve.py: --profile-dir reads a GPU's kernels from the trace and this run has no GPU; "
                         "drop the flag")
    read_rate = measured_read_rate() if gpu else 1e11  # before the engine's pools take the free memory
    efficiency, peak = matmul_efficiency(args.chip)
    started = time.perf_counter()
    engine = build_engine(serve).engine
    start_s = time.perf_counter() - started
    info = harness.run_info(__file__, argv)
    result = {"meta": info.as_dict(), "model": config.name, "layers": config.n_layers, "dtype": engine.model_config.dtype,
              "engine": {"serve_args": serve_args(args, model_dir, workloads), "start_s": start_s,
                         "pages_per_shard": engine.cache_size.pages_per_shard, "cache_why": engine.cache_size.why,
                         "programs": engine.buckets.programs()}, "runs": []}
    for workload in workloads:
        prompts, outputs = prompts_of(workload, config.vocab_size)
        warm = prompts_of(workload, config.vocab_size, seed=1)
        line = roofline(engine.model_config, workload, prompts, outputs, efficiency, peak, read_rate)
        variants = [("prefix", True, None, True), ("no_prefix", False, None, True)] if workload.shared_prefix else \
            [("", True, None, True)]
        if args.sampling_settings:
            variants.append(("settings", True, SETTINGS, True))
        if args.compare_two_programs:
            variants.append(("two_programs", True, None, False))
        for label, prefix_caching, settings, mixed in variants:
            engine.use_prefix_caching(prefix_caching)
            engine.use_mixed_steps(mixed and bool(engine.buckets.mixed_chunks))
            run_engine(engine, workload, *warm, settings)
            before, since = engine.stats(), len(engine.step_times)
            traced = args.profile_dir / f"{workload.name}{label}" if args.profile_dir else None
            if traced:
                jax.profiler.start_trace(str(traced), create_perfetto_trace=True)
            figures = metrics(run_engine(engine, workload, prompts, outputs, settings), prompts)
            stats = engine.stats()
            row = {"workload": dataclasses.asdict(workload), "mode": "in_process", "prefix_caching": prefix_caching,
                   "sampling_settings": settings is not None,
                   "mixed_steps": mixed and bool(engine.buckets.mixed_chunks),
                   "steps": steps_by_kind(engine, since),
                   **figures, "decode_step_ms_by_batch": decode_step_ms(engine, since),
                   "host_ms_per_step": host_ms(engine, since),
                   "prefix_hit_pages": stats.prefix_hit_pages - before.prefix_hit_pages,
                   "programs": stats.programs, "new_programs_in_timed_run": stats.programs - before.programs,
                   "roofline": line, "vs_roofline": figures["output_tokens_per_s"] / line["output_tokens_per_s"]}
            if traced:
                row["device_time"] = device_time(traced, figures["seconds"])
            result["runs"].append(row)
            print(row_line(workload, "in_process", label, row), flush=True)
        if args.static_generate:
            static = static_generate(engine, prompts, outputs, args.static_generate)
            result.setdefault("static_generate", []).append({"workload": dataclasses.asdict(workload), **static})
            print(f"{workload.name} static generate: {json.dumps(static)}", flush=True)
    harness.write_json(args.engine_only, result)
    return 0


STATIC_PASSES = 2
"""Passes of the static `generate` over a workload's prompts; the faster one is its figure."""


def static_generate(engine, prompts, outputs, batch: int, passes: int = STATIC_PASSES) -> dict:
    """The library's static `generate` (prefill, then decode of the whole batch to the end) over `prompts`, `batch`
    rows at a time, on the engine's own weights and mesh, greedy as the engine's runs: its output tokens/s over the
    seconds its programs ran (`Generation`'s phase rates; `generate` compiles its programs at each call, and the
    engine's were compiled at start), the faster of `passes` passes over all the prompts (one pass's figure moved
    14% between two runs of one machine, benchmarks/NOTES.md runs 78 and 80; the faster pass is the baseline's best
    showing), each pass's figure beside it. Needs prompts of one length, outputs of one length, and 16-bit weights
    (the engine holds 8-bit ones per layer, `split_layer_weights`)."""
    from flax import nnx

    from starscream_jax.inference.generate import generate

    if len({len(p) for p in prompts}) > 1 or len(set(outputs)) > 1:
        return {"skipped": "the prompts or outputs differ in length; a static batch takes one of each"}
    if engine.model_config.weight_format:
        return {"skipped": f"{engine.model_config.weight_format} weights are held per layer by the engine"}
    model = nnx.merge(engine.graphdef, engine.params, engine.rest)
    rates = []
    for _ in range(passes):
        produced, seconds = 0, 0.0
        for start in range(0, len(prompts), batch):
            chunk = np.asarray(prompts[start:start + batch])
            run = generate(model, chunk, outputs[0], mesh=engine.mesh)
            rows, decoded = chunk.shape[0], run.tokens.shape[1] - 1
            seconds += rows * chunk.shape[1] / run.prefill_tokens_per_s
            seconds += rows * decoded / run.decode_tokens_per_s if decoded else 0.0
            produced += run.tokens.size
        rates.append((produced / seconds, seconds))
    best, seconds = max(rates)
    return {"batch": batch, "seconds": seconds, "output_tokens_per_s": best,
            "passes_output_tokens_per_s": [rate for rate, _ in rates]}


def device_time(directory: Path, seconds: float) -> dict:
    """Where a traced run's device time went (the trace under `directory`, stopped here): seconds by category
    (`analysis.profile.time_breakdown`, kernels named by their own names: the run's programs are many), their sum,
    the share of the run's `seconds` the device sat idle, the host's events that took longest by their own time
    (the engine's Python functions and the runtime's launches), and what each host thread was doing while the device
    sat idle (both read from the same trace by `time_breakdown`)."""
    import jax

    from starscream_jax.analysis.profile import time_breakdown

    jax.profiler.stop_trace()
    breakdown = time_breakdown(directory, steps=1)
    busy = sum(breakdown["per_step_s"].values())
    return {"by_category_s": breakdown["per_step_s"], "busy_s": busy, "idle_share": max(0.0, 1.0 - busy / seconds),
            "top_kernels": breakdown["top_kernels"][:12],
            "top_host_events": breakdown["top_host_events"], "idle_causes": breakdown["idle_causes"],
            "trace": breakdown["trace"]}


def http_runs(args, flags: list[str], workloads: list[Workload], config) -> dict:
    """Step 3: `starscream serve` in its own process, each workload streamed to it from this one."""
    server = ServeProcess([*flags, "--timeout-keep-alive", str(KEEP_ALIVE_S)], args.work_dir / "serve.log")
    runs = []
    try:
        start_s = server.wait_healthy(timeout=900)
        print(f"starscream serve healthy after {start_s:.1f} s", flush=True)
        name = json.loads(__import__("httpx").get(server.url + "/v1/models").text)["data"][0]["id"]
        for workload in workloads:
            if workload.shared_prefix:
                continue  # prefix caching cannot be switched over HTTP: C runs in process only
            prompts, outputs = prompts_of(workload, config.vocab_size)
            warm_up = prompts_of(workload, config.vocab_size, seed=1)
            (first, traces), before = http_rounds(server.url, workload, [warm_up, (prompts, outputs)], name,
                                                  lambda: histogram_sum_count(server.metrics(),
                                                                              "vllm:time_to_first_token_seconds"))
            figures = metrics(traces, prompts)
            after_text = server.metrics()
            after = histogram_sum_count(after_text, "vllm:time_to_first_token_seconds")
            served_ttft = (after[0] - before[0]) / max(after[1] - before[1], 1) * MILLISECONDS
            row = {"workload": dataclasses.asdict(workload), "mode": "http", **figures,
                   "warm_up_round": {key: value for key, value in metrics(first, warm_up[0]).items()
                                     if key in ("output_tokens_per_s", "ttft_ms", "tpot_ms")},
                   "metrics_ttft_mean_ms": served_ttft,
                   "programs_compiled_while_serving": metric_value(after_text, 'when="serving"')}
            runs.append(row)
            print(f"{workload.name} http: {row['output_tokens_per_s']:,.0f} out tok/s, TTFT p50 "
                  f"{row['ttft_ms']['p50']:.1f} ms (client mean {row['ttft_ms']['mean']:.1f}, /metrics mean "
                  f"{served_ttft:.1f}), TPOT p50 {row['tpot_ms']['p50'] or 0:.2f} ms, programs compiled while "
                  f"serving {row['programs_compiled_while_serving']}", flush=True)
    finally:
        status = server.stop()
    return {"start_to_health_s": start_s, "exit_status": status, "runs": runs}


def histogram_sum_count(text: str, name: str) -> tuple[float, float]:
    """(sum, count) of a Prometheus histogram in /metrics text."""
    values = {"sum": 0.0, "count": 0.0}
    for line in text.splitlines():
        for part in values:
            if line.startswith(f"{name}_{part}"):
                values[part] = float(line.rsplit(" ", 1)[1])
    return values["sum"], values["count"]


def metric_value(text: str, fragment: str) -> float | None:
    return next((float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if fragment in line
                 and not line.startswith("#")), None)


def front_end(args) -> dict:
    """The server alone: `starscream serve --fake-engine` under --streams concurrent streams of 128 tokens each."""
    log = args.work_dir / "serve_fake.log"
    args.work_dir.mkdir(parents=True, exist_ok=True)
    output = 32 if args.quick else 128
    server = ServeProcess(["--fake-engine", str(args.fake_engine), "--max-num-seqs", str(args.streams),
                           "--compilation-cache", ""], log)
    try:
        server.wait_healthy(timeout=120)
        workload = Workload(name="front-end", requests=args.streams, prompt=16, output=output)
        prompts = [[1 + (i + j) % 200 for j in range(16)] for i in range(args.streams)]
        rounds = [(prompts, [4] * args.streams), (prompts, [output] * args.streams)]
        (_, traces), cpu = http_rounds(server.url, workload, rounds, "fake", server.cpu_seconds)
        figures = metrics(traces, prompts)
        cpu = server.cpu_seconds() - cpu
    finally:
        server.stop()
    tokens = args.streams * output
    steps = output  # every stream gets a token per fake step
    return {"step_ms": args.fake_engine, "streams": args.streams, "output_tokens_per_s": figures["output_tokens_per_s"],
            "ideal_tokens_per_s": args.streams / (args.fake_engine / 1000), "api_cpu_s": cpu,
            "api_cpu_us_per_token": cpu / tokens * 1e6, "api_cpu_ms_per_step": cpu / steps * 1e3,
            "itl_ms": figures["itl_ms"], "ttft_ms": figures["ttft_ms"]}


def ratios(result: dict) -> dict:
    """Output tokens/s of the server over the engine in process, and over transformers, per workload; of the
    engine in process over the static `generate` (--static-generate); of the engine with --sampling-settings over
    without; of the engine with mixed steps over two programs a step (--compare-two-programs)."""
    engine = {row["workload"]["name"]: row["output_tokens_per_s"] for row in result.get("runs", ())
              if row["prefix_caching"] and not row.get("sampling_settings") and row.get("mixed_steps", True)}
    out = {f"{row['workload']['name']}_with_sampling_settings_over_without":
           row["output_tokens_per_s"] / engine[row["workload"]["name"]]
           for row in result.get("runs", ()) if row.get("sampling_settings")}
    out.update({f"{row['workload']['name']}_mixed_steps_over_two_programs":
                engine[row["workload"]["name"]] / row["output_tokens_per_s"]
                for row in result.get("runs", ()) if row.get("mixed_steps") is False})
    for row in result.get("http", {}).get("runs", ()):
        name = row["workload"]["name"]
        out[f"{name}_http_over_in_process"] = row["output_tokens_per_s"] / engine[name]
    for row in result.get("static_generate", ()):
        name = row["workload"]["name"]
        if "output_tokens_per_s" in row:
            out[f"{name}_in_process_over_static_generate"] = engine[name] / row["output_tokens_per_s"]
    for row in result.get("transformers", ()):
        peer = row["transformers"].get("output_tokens_per_s")
        name = row["workload"]["name"]
        if peer:
            out[f"{name}_in_process_over_transformers"] = engine[name] / peer
            http = next((r for r in result.get("http", {}).get("runs", ()) if r["workload"]["name"] == name), None)
            if http is not None:
                out[f"{name}_http_over_transformers"] = http["output_tokens_per_s"] / peer
    return out


def transformers_only(args, argv) -> int:
    """Step 4 (a child process, nothing of JAX allocated): transformers' continuous batching on each workload's
    prompts, all at once."""
    config = harness.model_config(args)
    result = {"runs": []}
    for workload in workloads_of(args):
        prompts, outputs = prompts_of(workload, config.vocab_size)
        result["runs"].append({"workload": dataclasses.asdict(workload),
                               "transformers": transformers_peer(config, prompts, outputs)})
        print(f"{workload.name} transformers: {json.dumps(result['runs'][-1]['transformers'])}", flush=True)
    harness.write_json(args.transformers_only, result)
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
