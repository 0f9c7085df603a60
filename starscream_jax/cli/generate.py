"""`starscream generate`: text from a training checkpoint, prefilled under one layout and decoded under another
(`starscream_jax.training.generate`). Tokens are bytes (`starscream_jax.training.data`)."""
from __future__ import annotations

import argparse

import numpy as np

from ..hardware.distributed import is_main_process
from ..training import data
from ..training.checkpoint import restore_model
from ..training.generate import DEFAULT_DECODE_LAYOUT, DEFAULT_PREFILL_LAYOUT, batch_multiple, generate
from ..training.steps import Sampling
from .arguments import (
    add_distributed_arguments,
    add_mesh_arguments,
    count,
    initialize_from_args,
    mesh_from_args,
    step_number,
)
from .train import DEFAULT_GPUS, DEFAULT_PRESET


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `starscream generate` (mesh, multi-process, checkpoint, layouts, sampling)."""
    add_mesh_arguments(parser, default_preset=DEFAULT_PRESET, default_gpus=DEFAULT_GPUS, default_simulate=None)
    add_distributed_arguments(parser)
    group = parser.add_argument_group("generation")
    group.add_argument("--checkpoint", default="runs/train/checkpoints",
                       help="checkpoint directory of a training run (RUN_DIR/checkpoints)")
    group.add_argument("--step", type=step_number, help="checkpoint step (default: the latest)")
    group.add_argument("--prompt", default="ROMEO:\n", help="text to continue")
    group.add_argument("--max-new-tokens", type=count, default=200, help="tokens (bytes) to generate per sample")
    group.add_argument("--samples", type=count,
                       help="continuations of the prompt, decoded as one batch (default: the smallest batch the "
                            "layouts can split)")
    group.add_argument("--greedy", action="store_true", help="argmax decoding instead of top-p sampling")
    group.add_argument("--top-p", type=float, default=0.9, help="nucleus probability mass")
    group.add_argument("--temperature", type=float, default=0.8, help="softmax temperature for sampling")
    group.add_argument("--seed", type=int, default=0, help="sampling seed")
    group.add_argument("--prefill-layout", default=DEFAULT_PREFILL_LAYOUT, help="layout for the prompt")
    group.add_argument("--decode-layout", default=DEFAULT_DECODE_LAYOUT, help="layout for each new token")
    group.add_argument("--dtype", choices=("float32", "bfloat16"), help="compute dtype (default: the training one)")


def run(args: argparse.Namespace) -> int:
    """`starscream generate`: restore the checkpoint, generate, print each sample and the tokens/s. Returns 0."""
    sampling = Sampling(top_p=None if args.greedy else args.top_p, temperature=args.temperature, seed=args.seed)
    prompt_tokens = data.encode(args.prompt)
    initialize_from_args(args)
    echo = print if is_main_process() else (lambda *_: None)
    _, mesh = mesh_from_args(args)
    model, description = restore_model(args.checkpoint, args.prefill_layout, mesh, args.step, args.dtype)
    samples = args.samples or batch_multiple((args.prefill_layout, args.decode_layout), mesh)
    prompt = np.tile(prompt_tokens, (samples, 1))
    result = generate(model, prompt, args.max_new_tokens, sampling, mesh, args.prefill_layout, args.decode_layout)
    echo(f"{model.config.name} from step {description['step']} on mesh {dict(mesh.shape)}; prefill "
         f"{args.prefill_layout}, decode {args.decode_layout}")
    shown_rows = result.tokens[:1] if args.greedy else result.tokens  # greedy rows are all the same
    for index, row in enumerate(shown_rows):
        echo(f"--- sample {index}")
        echo(data.decode(np.concatenate([prompt_tokens, row])))
    echo(f"prefill {result.prefill_tokens_per_s:,.0f} tokens/s, decode {result.decode_tokens_per_s:,.0f} tokens/s "
         f"({samples} x {args.max_new_tokens} new tokens)")
    return 0
