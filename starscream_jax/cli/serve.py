"""`starscream serve`: an OpenAI-compatible HTTP server (`starscream_jax.serving.server`) over a model from a Hugging
Face directory or a training checkpoint, prefilled and decoded under the layouts given, with continuous batching over
a paged KV cache (`starscream_jax.serving.engine`) in an engine process of its own (`starscream_jax.serving.core`).

The command binds its port first (a taken port is one line, before any load), starts the engine process (which
loads the model, sizes the KV cache from the device memory left, compiles every program and prints what it chose),
then serves HTTP from this process until SIGTERM or Ctrl-C, which drain the running requests first. If the engine
fails, running streams end with an error, every request gets 503 and the command exits with status 1.
"""
from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import os
import socket
import sys
import time
from pathlib import Path

import msgspec
import uvicorn

from ..errors import StarscreamError
from ..model.paged import KERNELS
from ..serving.client import EngineClient
from ..serving.core import EngineProcess, ReadyEngine
from ..serving.requests import generation_defaults
from ..serving.server import Server
from ..serving.tools import PARSERS, default_parser
from ..text.tokenizer import check_template
from .arguments import (
    MODEL_SOURCE_EXCLUSIVE,
    RUN_MESH,
    add_distributed_arguments,
    add_mesh_arguments,
    add_model_source_arguments,
    count,
    count_or_zero,
    initialize_from_args,
    mesh_from_args,
    prepare_simulation,
)

DEFAULT_CHUNK = 512
"""Most prompt tokens of one sequence a step prefills by default (--chunk)."""

EXCLUSIVE = MODEL_SOURCE_EXCLUSIVE + (
    ("fake_engine", "quantize", "--fake-engine runs no model"),
    ("fake_engine", "kv_cache", "--fake-engine runs no model"),
)
"""(flag, flag, why only one is honoured), as dests: the model's source, as `generate` reads it."""
STARTED = time.perf_counter()
DEFAULT_COMPILATION_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "starscream" / "jax"
"""Where compiled programs are kept between runs (JAX's persistent compilation cache), unless --compilation-cache."""
API_KEY_ENV = "STARSCREAM_API_KEY"
"""The environment variable --api-key defaults to."""
LOG_LEVELS = ("debug", "info", "warning", "error")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `starscream serve` (mesh, model, layouts, capacity and batching, HTTP)."""
    add_mesh_arguments(parser, default_preset=RUN_MESH.preset, default_gpus=RUN_MESH.gpus, default_simulate=None)
    add_distributed_arguments(parser)
    group = parser.add_argument_group("model")
    add_model_source_arguments(group)
    group.add_argument("--served-model-name", type=model_name,
                       help="the model's name in the API (default: the model's own)")
    engine = parser.add_argument_group("capacity and batching (vLLM's names)")
    engine.add_argument("--gpu-memory-utilization", type=fraction, default=0.9,
                        help="fraction of each device's memory the server uses: the weights, the steps' working "
                             "memory, and KV-cache pages in all the rest (default 0.9)")
    engine.add_argument("--max-model-len", type=count, help="most positions (prompt and output) of a sequence "
                                                            "(default: the model's context)")
    engine.add_argument("--max-num-seqs", "--max-seqs", type=count, default=256, dest="max_num_seqs",
                        help="most sequences running at once, over every cache shard (default 256)")
    engine.add_argument("--max-num-batched-tokens", "--token-budget", type=count, dest="max_num_batched_tokens",
                        help="most prompt tokens one step prefills, the decoding rows running beside them in a "
                             "program of their own (default, as vLLM's server: 8192 on GPUs of 70 GiB or more, 2048 "
                             "on smaller ones and on the CPU)")
    engine.add_argument("--chunk", type=count, help="most prompt tokens of one sequence per step (chunked prefill; "
                                                    "default 512, or the token budget where that is smaller)")
    engine.add_argument("--page-size", type=count, default=16, help="positions per KV page (default 16)")
    engine.add_argument("--cache-pages", type=count, help="KV pages per cache shard (each partition holds one "
                                                          "shard), instead of sizing the cache from memory")
    engine.add_argument("--kernel", choices=KERNELS, default="",
                        help="paged decode attention (default: the backend's, cuDNN's paged kernel on NVIDIA GPUs, "
                             "gather elsewhere)")
    engine.add_argument("--no-overlap", dest="overlap", action="store_false",
                        help="read each step's tokens before launching the next (by default the next step is "
                             "scheduled and launched while the device runs the current one)")
    engine.add_argument("--mixed-chunks", type=count_or_zero, default=1, metavar="N",
                        help="most prompt chunks per cache shard of a step whose chunks and decode rows run as one "
                             "program, reading each weight once (default 1: a step of more runs as two programs; "
                             "each size compiles one program per decode bucket at start; 0: always two programs)")
    engine.add_argument("--enable-prompt-logprobs", action="store_true",
                        help="serve prompt log-probabilities (prompt_logprobs, and completions echo with logprobs, "
                             "as lm-eval's loglikelihood tasks ask): compiles a scored prefill of each prefill "
                             "bucket at start")
    engine.add_argument("--compilation-cache", default=str(DEFAULT_COMPILATION_CACHE), metavar="DIR",
                        help="keep compiled programs here so that a restart compiles nothing ('' turns it off; "
                             f"default {DEFAULT_COMPILATION_CACHE})")
    engine.add_argument("--fake-engine", type=positive_float, metavar="STEP_MS",
                        help="measure the server itself: no model, an engine that gives every running request a "
                             "token each STEP_MS milliseconds (token ids from its prompt)")
    http = parser.add_argument_group("http")
    http.add_argument("--host", default="127.0.0.1")
    http.add_argument("--port", type=port_number, default=8000)
    http.add_argument("--max-pending", type=count, default=1024,
                      help="requests in flight before new ones get 429 (default 1024)")
    http.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                      help=f"every /v1/ route then asks for 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}, "
                           "else none)")
    http.add_argument("--allowed-origins", type=json_list, default=[], metavar="JSON",
                      help='browser origins CORS lets in, a JSON list such as \'["*"]\' (default none)')
    http.add_argument("--allowed-methods", type=json_list, default=["*"], metavar="JSON",
                      help="HTTP methods CORS allows (default all)")
    http.add_argument("--allowed-headers", type=json_list, default=["*"], metavar="JSON",
                      help="request headers CORS allows (default all)")
    http.add_argument("--timeout-keep-alive", type=positive_seconds, default=5.0, metavar="SECONDS",
                      help="how long an idle kept-alive connection stays open before the server closes it "
                           "(uvicorn's timeout_keep_alive; default 5, as vLLM's): longer for clients that keep "
                           "their connections between bursts of requests")
    http.add_argument("--log-level", choices=LOG_LEVELS, default="info",
                      help="the server's and uvicorn's log level; at info a line per request and the engine's load "
                           "every 10 s while busy (default info)")
    http.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                      help="sampling defaults (temperature, top_p, top_k) for requests that leave them out: 'auto' "
                           "reads generation_config.json of --model-dir, a directory reads its own, 'vllm' keeps "
                           "the API's defaults (default auto)")
    http.add_argument("--tool-call-parser", choices=("auto", "none", *PARSERS), default="auto",
                      help="how tool calls are read out of an answer under tool_choice 'auto' (vLLM's names): "
                           "'auto' picks the parser of --model-dir's family (llama: llama3_json, qwen2 / qwen3: "
                           "hermes, mistral / mixtral: mistral), 'none' refuses tool_choice auto (default auto)")
    http.add_argument("--chat-template", metavar="FILE|TEMPLATE",
                      help="the Jinja chat template rendering chats instead of the tokenizer's, as vLLM's flag: a "
                           "file, or the template itself in one line (escapes such as \\n read as characters); a "
                           "request's chat_template replaces it")
    http.add_argument("--trust-request-chat-template", action="store_true",
                      help="render a request's own chat_template (refused otherwise, as vLLM refuses it: a template "
                           "can loop or grow its output until a worker thread or the memory is spent)")


def json_list(text: str) -> list[str]:
    """A JSON list of strings, as vLLM's --allowed-origins takes it; a bare word is a list of that one."""
    try:
        value = json.loads(text)
    except ValueError:
        value = [text] if text and not text.lstrip().startswith(("[", "{", '"')) else None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise argparse.ArgumentTypeError(f"{text}: give a JSON list of strings, such as '[\"*\"]'")
    return value


def sampling_defaults(args: argparse.Namespace) -> tuple[dict, Path | None]:
    """(the sampling defaults --generation-config asks for, the file they came from): 'auto' reads --model-dir's
    generation_config.json, a directory its own (`requests.generation_defaults`); ({}, None) with 'vllm', or where
    'auto' finds no such file."""
    if args.generation_config == "vllm":
        return {}, None
    directory = args.model_dir if args.generation_config == "auto" else args.generation_config
    if directory is None:
        return {}, None
    path = Path(directory) / "generation_config.json"
    if not path.is_file():
        if args.generation_config != "auto":
            raise StarscreamError(f"--generation-config {directory}: {path} not found; give a directory holding one, "
                                  "'auto' or 'vllm'")
        return {}, None
    return generation_defaults(path), path


def chat_template(args: argparse.Namespace) -> str | None:
    """--chat-template as vLLM reads it: the text of the file it names, or where no such file exists and it looks
    like a template (it holds a brace or a newline) the template itself, its backslash escapes read (a one-line
    form's \\n is a newline); checked by Jinja (`text.tokenizer.check_template`). None when not given;
    StarscreamError naming the flag otherwise."""
    given = args.chat_template
    if given is None:
        return None
    path = Path(given)
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise StarscreamError(f"--chat-template {given}: cannot read it as UTF-8 text ({err})") from None
    elif any(mark in given for mark in "{}\n"):
        text = given.encode("latin-1", "backslashreplace").decode("unicode_escape")
    else:
        raise StarscreamError(f"--chat-template {given}: no such file, and it holds no brace or newline, so it is not "
                              "a template either; give a template file or the template itself")
    return check_template(text, f"--chat-template {given[:60]}")


def tool_call_parser(args: argparse.Namespace) -> str | None:
    """The --tool-call-parser to serve with: as given, or with 'auto' the one of --model-dir's family (its
    config.json's model_type; `serving.tools.default_parser`), None for none."""
    if args.tool_call_parser != "auto":
        return None if args.tool_call_parser == "none" else args.tool_call_parser
    path = Path(args.model_dir) / "config.json" if getattr(args, "model_dir", None) else None
    try:
        model_type = json.loads(path.read_text()).get("model_type") if path is not None and path.is_file() else None
    except (OSError, ValueError, AttributeError):
        model_type = None
    return default_parser(model_type)


def configure_logging(level: str) -> None:
    """The server's own log lines (the load every 10 s) to stderr at `level`, beside uvicorn's."""
    logger = logging.getLogger("starscream")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(message)s", "%m-%d %H:%M:%S"))
        logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False


def model_name(text: str) -> str:
    """A --served-model-name: some text, since requests name the model by it and /v1/models lists it (an empty
    one would stand for no name at all)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: give the name requests use for the model, or leave the flag out "
                                         "for the model's own")
    return text


def port_number(text: str) -> int:
    """A TCP port, 0 (any free one) to 65535."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"--port {text}: give a port number from 0 to 65535")
    return port


def fraction(text: str) -> float:
    """A fraction in (0, 1], as --gpu-memory-utilization takes it."""
    return _float_flag(text, lambda value: 0.0 < value <= 1.0, "give a fraction above 0 and at most 1, such as 0.9")


def positive_float(text: str) -> float:
    """A positive, finite number (--fake-engine's milliseconds)."""
    return _float_flag(text, lambda value: 0.0 < value < math.inf, "give a positive number of milliseconds")


def positive_seconds(text: str) -> float:
    """A positive, finite number of seconds (--timeout-keep-alive)."""
    return _float_flag(text, lambda value: 0.0 < value < math.inf, "give a positive number of seconds, such as 5")


def _float_flag(text: str, accepted, fix: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not accepted(value):
        raise argparse.ArgumentTypeError(f"{text}: {fix}")
    return value


def engine_config(args: argparse.Namespace, shards: int, mesh=None):
    """The engine configuration the flags ask for, over `shards` cache shards (--max-num-seqs is split among
    them), the step's tokens by the memory of `mesh`'s GPUs where --max-num-batched-tokens is not given."""
    from ..hardware.axes import XCD
    from ..serving.capacity import default_token_budget, local_devices_of
    from ..serving.engine import EngineConfig

    token_budget = args.max_num_batched_tokens or default_token_budget(
        local_devices_of(mesh), args.gpu_memory_utilization, mesh.shape.get(XCD, 1) if mesh is not None else 1)
    return EngineConfig(page_size=args.page_size, pages_per_shard=args.cache_pages,
                        rows_per_shard=math.ceil(args.max_num_seqs / shards),
                        token_budget=token_budget, chunk=args.chunk or min(DEFAULT_CHUNK, token_budget),
                        kernel=args.kernel,
                        max_model_len=args.max_model_len, memory_utilization=args.gpu_memory_utilization,
                        overlap=args.overlap, prompt_logprobs=args.enable_prompt_logprobs,
                        mixed_chunks=args.mixed_chunks)


def bind(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound now (before the model loads) so that a taken port is found at once."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as err:
        raise StarscreamError(f"cannot listen on {host}:{port} ({err.strerror or err}); pick another --port or "
                              "stop the process that holds it") from None
    sock.set_inheritable(False)
    return sock


def run(args: argparse.Namespace) -> int:
    """Bind, start the engine process, serve until SIGTERM or Ctrl-C (then drain). Returns 0, or 1 after an engine
    failure. Over a mesh spanning processes (--coordinator ...), process 0 serves and schedules and the others run
    its steps (`serving.multihost`): their command only waits for the engine process."""
    follower = args.process_id not in (None, 0)
    defaults, defaults_path = ({}, None) if follower else sampling_defaults(args)
    template = None if follower else chat_template(args)
    sock = None if follower else bind(args.host, args.port)
    build = functools.partial(build_fake_engine if args.fake_engine else build_engine, args)
    engine = EngineProcess(build, None if args.fake_engine else args.gpu_memory_utilization)
    ready = engine.start()
    if ready is None:
        if sock is not None:
            sock.close()
        return 0 if engine.stop(timeout=None) == 0 else 1
    info, tokenizer = ready
    failed = []

    def engine_failed():
        failed.append(True)
        http.should_exit = True

    client = EngineClient(engine.addresses, engine.alive)
    name = info.model_name
    server = Server(client, tokenizer, name, info, args.max_pending, on_engine_failure=engine_failed,
                    api_key=args.api_key, allowed_origins=args.allowed_origins, allowed_methods=args.allowed_methods,
                    allowed_headers=args.allowed_headers, sampling_defaults=defaults,
                    tool_parser=tool_call_parser(args), chat_template=template,
                    trust_request_chat_template=args.trust_request_chat_template)
    configure_logging(args.log_level)
    http = uvicorn.Server(uvicorn.Config(server.app(), log_level=args.log_level, access_log=True,
                                        timeout_keep_alive=args.timeout_keep_alive))
    host, port = sock.getsockname()[:2]
    if defaults:
        print(f"starscream serve: sampling defaults from {defaults_path} for requests that leave them out: "
              f"{', '.join(f'{key} {value}' for key, value in defaults.items())} (--generation-config vllm: the "
              "API's)", flush=True)
    print(f"starscream serve: {name} ready in {time.perf_counter() - STARTED:.0f} s; http://{host}:{port}/v1",
          flush=True)
    http.run(sockets=[sock])
    status = engine.stop(timeout=60)
    return 1 if failed or status not in (0, None) else 0


def build_engine(args: argparse.Namespace) -> ReadyEngine:
    """In the engine process: join the processes of the mesh, load the model, size the cache, compile every
    program (printing what was chosen and where the start's seconds went), and give the engine with its tokenizer."""
    phases = _Phases()
    import jax

    from ..inference.loading import load_for_inference
    from ..serving.engine import Engine
    from ..serving.multihost import StepBroadcast
    from ..serving.steps import cache_shards
    from .generate import load_request

    if args.compilation_cache:
        jax.config.update("jax_compilation_cache_dir", str(Path(args.compilation_cache).expanduser()))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # every program a restart needs
    prepare_simulation(args)
    initialize_from_args(args)
    topology, mesh = mesh_from_args(args)
    chip = topology.preset.chip
    phases.end("imports and mesh")
    model, source, tokenizer = load_for_inference(load_request(args, chip), mesh, chip)
    phases.end("model")
    channel = StepBroadcast() if jax.process_count() > 1 else None  # a mesh spanning processes: 0 schedules
    shards = cache_shards(args.decode_layout, mesh)
    engine = Engine(model, engine_config(args, shards, mesh), mesh, args.prefill_layout, args.decode_layout, channel)
    leader = channel is None or channel.leader
    try:
        engine.use_tokenizer(tokenizer)  # structured output (`serving.guided`)
    except StarscreamError as err:
        if leader:
            print(f"starscream serve: no structured output: {err}", flush=True)
    phases.end("engine")
    name = args.served_model_name or model.config.name
    if leader:
        print(start_line(engine, name, source, mesh, args), flush=True)
    seconds = warm_up(engine, show=leader)
    phases.end("programs")
    if leader:
        print(f"starscream serve: {engine.buckets.programs()} programs and {engine.samplers} samplers compiled in "
              f"{seconds:.1f} s "
              f"(compilation cache: {args.compilation_cache or 'off'}); the engine's start: {phases}", flush=True)
    return ReadyEngine(engine=engine, tokenizer=tokenizer, info=msgspec.structs.replace(engine.info(), model_name=name),
                       follows=not leader)


class _Phases:
    """Seconds of each phase of the engine's start, in order, so that a slow start says where it went."""

    def __init__(self):
        self._last = time.perf_counter()
        self._seconds: list[tuple[str, float]] = []

    def end(self, name: str) -> None:
        now = time.perf_counter()
        self._seconds.append((name, now - self._last))
        self._last = now

    def __str__(self) -> str:
        return ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self._seconds)


def start_line(engine, name: str, source, mesh, args) -> str:
    """What the server chose and why: model, mesh, layouts, the cache, the limits and the compiled shapes."""
    size, buckets = engine.cache_size, engine.buckets
    return (f"starscream serve: {name} from {source} on mesh {dict(mesh.shape)}, prefill {args.prefill_layout}, "
            f"decode {args.decode_layout}\n"
            f"  KV cache: {engine.shards} shard(s) x {size.pages_per_shard} pages x {engine.config.page_size} "
            f"positions in {engine.kv_format or engine.model_config.dtype}, {engine.pool_bytes / 2 ** 30:.2f} GiB "
            f"({size.why})\n"
            f"  limits: {engine.config.rows_per_shard * engine.shards} sequences, context {engine.context}, "
            f"{engine.config.token_budget} tokens per step, prompt chunks of {engine.config.chunk}\n"
            f"  programs: decode rows per shard {list(buckets.rows)}, prefill rows {list(buckets.rows_of('prefill'))}"
            f" x {list(buckets.positions)} positions, pages per row {_pages_line(buckets)}"
            f"{_mixed_line(buckets)}: "
            f"{buckets.programs()} programs and {engine.programs_at_start() - buckets.programs()} samplers in all; "
            f"paged decode attention: {engine.kernel}")


def _mixed_line(buckets) -> str:
    """The mixed steps' shapes, or nothing where the engine runs none."""
    if not buckets.mixed_chunks:
        return ""
    return f", mixed steps of each decode bucket with {list(buckets.mixed_chunks)} prompt chunks per shard"


def _pages_line(buckets) -> str:
    """The page buckets, decode's apart where they differ (a kernel reading the pages in place needs one)."""
    decode, prefill = list(buckets.pages_of("decode")), list(buckets.pages)
    return str(prefill) if decode == prefill else f"{decode} in decode, {prefill} in prefill"


def warm_up(engine, show: bool) -> float:
    """Compiles every program with a progress bar (on the leader); the seconds it took."""
    from tqdm import tqdm

    started = time.perf_counter()
    with tqdm(total=engine.programs_at_start(), desc="compiling", unit="program", disable=not show,
              file=sys.stderr) as bar:
        def progress(done: int, total: int) -> None:
            bar.update(done - bar.n)

        engine.warm_up(progress)
    return time.perf_counter() - started


def build_fake_engine(args: argparse.Namespace) -> ReadyEngine:
    """In the engine process: the front-end benchmark's engine (no model, no device), with the tokenizer of
    --model-dir (or the byte-level one)."""
    from ..serving.fake import FakeEngine
    from ..text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.model_dir)
    engine = FakeEngine(vocab_size=tokenizer.vocab_size, context=args.max_model_len or 8192,
                        max_num_seqs=args.max_num_seqs, step_s=args.fake_engine / 1000)
    print(f"starscream serve: fake engine, a token per running request every {args.fake_engine} ms, at most "
          f"{args.max_num_seqs} sequences", flush=True)
    name = args.served_model_name or "fake"
    return ReadyEngine(engine=engine, tokenizer=tokenizer, info=msgspec.structs.replace(engine.info(), model_name=name))
