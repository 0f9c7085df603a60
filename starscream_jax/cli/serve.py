"""`starscream serve`: an OpenAI-compatible HTTP server (`starscream_jax.serving.server`) over a model from a Hugging
Face directory or a training checkpoint, prefilled and decoded under the layouts given, with continuous batching over
a paged KV cache (`starscream_jax.serving.engine`)."""
from __future__ import annotations

import argparse

import jax
import uvicorn

from ..model.paged import KERNELS
from ..serving.engine import Engine, EngineConfig, EngineThread
from ..serving.multihost import StepBroadcast, follow
from ..serving.server import Server
from .arguments import (
    MODEL_SOURCE_EXCLUSIVE,
    RUN_MESH,
    add_distributed_arguments,
    add_mesh_arguments,
    add_model_source_arguments,
    count,
    initialize_from_args,
    mesh_from_args,
)
from .generate import load_for_generation

EXCLUSIVE = MODEL_SOURCE_EXCLUSIVE
"""(flag, flag, why only one is honoured), as dests: the model's source, as `generate` reads it."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `starscream serve` (mesh, model, layouts, cache and batching, HTTP)."""
    add_mesh_arguments(parser, default_preset=RUN_MESH.preset, default_gpus=RUN_MESH.gpus, default_simulate=None)
    add_distributed_arguments(parser)
    group = parser.add_argument_group("model")
    add_model_source_arguments(group)
    group.add_argument("--served-model-name", help="the model's name in the API (default: the model's own)")
    engine = parser.add_argument_group("engine")
    defaults = EngineConfig()
    engine.add_argument("--page-size", type=count, default=defaults.page_size, help="positions per KV page")
    engine.add_argument("--cache-pages", type=count, default=defaults.pages_per_shard,
                        help="KV pages per cache shard (each partition holds one shard)")
    engine.add_argument("--max-seqs", type=count, default=defaults.rows_per_shard,
                        help="most sequences a cache shard runs at once")
    engine.add_argument("--token-budget", type=count, default=defaults.token_budget, help="most tokens per step")
    engine.add_argument("--chunk", type=count, default=defaults.chunk, help="most prompt tokens of one sequence "
                                                                            "per step (chunked prefill)")
    engine.add_argument("--kernel", choices=KERNELS, default=defaults.kernel, help="paged decode attention")
    http = parser.add_argument_group("http")
    http.add_argument("--host", default="127.0.0.1")
    http.add_argument("--port", type=port_number, default=8000)
    http.add_argument("--max-pending", type=count, default=256,
                      help="requests in flight before new ones get 429")


def port_number(text: str) -> int:
    """A TCP port, 0 (any free one) to 65535."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"--port {text}: give a port number from 0 to 65535")
    return port


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(page_size=args.page_size, pages_per_shard=args.cache_pages, rows_per_shard=args.max_seqs,
                        token_budget=args.token_budget, chunk=args.chunk, kernel=args.kernel)


def run(args: argparse.Namespace) -> int:
    """Load the model, start the engine, serve until SIGTERM or Ctrl-C (then drain). Returns 0. Over a mesh spanning
    processes (--coordinator ...), process 0 serves and schedules and the others run its steps
    (`serving.multihost`)."""
    initialize_from_args(args)
    topology, mesh = mesh_from_args(args)
    model, source, tokenizer = load_for_generation(args, mesh, topology.preset.chip)
    channel = StepBroadcast() if jax.process_count() > 1 else None  # a mesh spanning processes: 0 schedules
    engine = Engine(model, engine_config(args), mesh, args.prefill_layout, args.decode_layout, tokenizer.decode,
                    channel)
    if channel is not None and not channel.leader:
        follow(engine)  # run process 0's steps until it stops
        return 0
    name = args.served_model_name or model.config.name
    server = Server(EngineThread(engine), tokenizer, name, args.max_pending)
    print(f"starscream serve: {name} from {source} on mesh {dict(mesh.shape)}, prefill {args.prefill_layout}, "
          f"decode {args.decode_layout}; {engine.shards} cache shard(s) of {args.cache_pages} pages x "
          f"{args.page_size} ({engine.pool_bytes / 2 ** 30:.2f} GiB of pages in "
          f"{engine.kv_format or model.config.dtype}); at most {engine.buckets.programs()} programs; "
          f"http://{args.host}:{args.port}/v1",
          flush=True)
    uvicorn.run(server.app(), host=args.host, port=args.port, log_level="warning")
    engine.stop_followers()
    return 0
