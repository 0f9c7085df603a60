"""`starscream generate`: text from a training checkpoint or a Hugging Face model directory (loaded by
`inference.loading`), prefilled under one layout and decoded under another, on the serving engine
(`inference.served`; fewer samples than the decode layout's cache shards: the static path's split-K decode,
`inference.generate`), with
the model's tokenizer (bytes for the demo's runs), stopping at any of its EOS ids (`eos_ids`: tokenizer_config.json's,
generation_config.json's and config.json's)."""
from __future__ import annotations

import argparse

import numpy as np

from ..errors import StarscreamError
from ..hardware.distributed import is_main_process
from ..hardware.presets import Chip
from ..inference.generate import generate, stop_ids_of
from ..inference.loading import LoadRequest, load_for_inference
from ..inference.served import generate_served, static_reason
from ..model.config import ModelConfig
from ..training.steps import Sampling
from .arguments import (
    MODEL_SOURCE_EXCLUSIVE,
    RUN_MESH,
    add_distributed_arguments,
    add_mesh_arguments,
    add_model_source_arguments,
    checkpoint_dir,
    count,
    eight_bit_format,
    initialize_from_args,
    mesh_from_args,
    seed,
)

EXCLUSIVE = MODEL_SOURCE_EXCLUSIVE + (
    ("greedy", "top_p", "greedy decoding takes the most likely token; nothing is sampled"),
    ("greedy", "temperature", "greedy decoding takes the most likely token; nothing is sampled"),
    ("greedy", "seed", "greedy decoding draws no random numbers"),
)
"""(flag, flag, why only one is honoured), as dests."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `starscream generate` (mesh, multi-process, checkpoint, layouts, sampling)."""
    add_mesh_arguments(parser, default_preset=RUN_MESH.preset, default_gpus=RUN_MESH.gpus, default_simulate=None)
    add_distributed_arguments(parser)
    add_model_source_arguments(parser.add_argument_group("model"))
    group = parser.add_argument_group("generation")
    group.add_argument("--prompt", default="ROMEO:\n", help="text to continue")
    group.add_argument("--max-new-tokens", type=count, default=200,
                       help="most tokens to generate per sample (fewer when every sample reaches EOS)")
    group.add_argument("--samples", type=count, default=1,
                       help="continuations of the prompt, decoded as one batch; any number places (fewer than the "
                            "partitions: the prompt split over them, split-K decode)")
    group.add_argument("--greedy", action="store_true", help="argmax decoding instead of top-p sampling")
    group.add_argument("--top-p", type=float, default=0.9, help="nucleus probability mass")
    group.add_argument("--temperature", type=float, default=0.8, help="softmax temperature for sampling")
    group.add_argument("--seed", type=seed, default=0, help="sampling seed (a 64-bit signed integer)")


def run(args: argparse.Namespace) -> int:
    """`starscream generate`: load the model, generate, print each sample and the tokens/s. Returns 0."""
    sampling = Sampling(top_p=None if args.greedy else args.top_p, temperature=args.temperature, seed=args.seed)
    initialize_from_args(args)
    echo = print if is_main_process() else (lambda *_: None)
    topology, mesh = mesh_from_args(args)
    chip = topology.preset.chip
    model, source, tokenizer = load_for_inference(load_request(args, chip), mesh, chip)
    samples = args.samples
    prompt_tokens = checked_prompt(args.prompt, args.max_new_tokens, tokenizer, model.config)
    prompt = np.tile(prompt_tokens, (samples, 1))
    layouts = (args.prefill_layout, args.decode_layout)
    static = static_reason(samples, mesh, *layouts, model.config)
    if static is None:
        served = generate_served(model, prompt, args.max_new_tokens, sampling, mesh, *layouts,
                                 stop_token=tokenizer.eos_ids)
        tokens, footer = served.tokens, (
            f"served by the engine: {served.generated} new tokens in {served.seconds:.2f} s, "
            f"{served.tokens_per_s:,.0f} tokens/s ({served.programs} programs compiled before; paged decode attention "
            f"{served.kernel})")
    else:
        result = generate(model, prompt, args.max_new_tokens, sampling, mesh, *layouts, stop_token=tokenizer.eos_ids)
        tokens, footer = result.tokens, (
            f"prefill {result.prefill_tokens_per_s:,.0f} tokens/s, decode {result.decode_tokens_per_s:,.0f} tokens/s "
            f"({samples} x {result.tokens.shape[1]} new tokens; the static path: {static})")
    echo(f"{model.config.name} from {source} on mesh {dict(mesh.shape)}; prefill {args.prefill_layout}, decode "
         f"{args.decode_layout}")
    shown_rows = tokens[:1] if args.greedy else tokens  # greedy rows are all the same
    for index, row in enumerate(shown_rows):
        echo(f"--- sample {index}")
        echo(tokenizer.decode(np.concatenate([prompt_tokens, until_stop(row, tokenizer.eos_ids)])))
    echo(footer)
    return 0


def load_request(args: argparse.Namespace, chip: Chip) -> LoadRequest:
    """What --model-dir or --checkpoint (at --step), --dtype, --quantize, --quantize-scales, --kv-cache, --pad-heads
    and the layouts ask to load on `chip` (`inference.loading`)."""
    return LoadRequest(model_dir=args.model_dir, checkpoint=None if args.model_dir else checkpoint_dir(args.checkpoint),
                       step=args.step, dtype=args.dtype, weight_format=eight_bit_format(args.quantize, chip),
                       weight_scales=args.quantize_scales, kv_format=eight_bit_format(args.kv_cache, chip),
                       pad_heads=args.pad_heads or None, prefill_layout=args.prefill_layout, decode_layout=args.decode_layout)


def checked_prompt(prompt: str, max_new_tokens: int, tokenizer, config: ModelConfig) -> np.ndarray:
    """--prompt's tokens, refused here by the flags that fix them rather than inside the engine or the static path:
    a prompt of no tokens (empty, under a tokenizer that adds no BOS) leaves prefill nothing to read, and prompt and
    --max-new-tokens together must fit the model's max_seq_len (the KV cache's positions)."""
    tokens = tokenizer.encode(prompt)
    if not len(tokens):
        raise StarscreamError(f"--prompt {prompt!r} encodes to no tokens with this model's tokenizer; pass some text "
                              "to continue")
    room = config.max_seq_len - len(tokens)
    if max_new_tokens > room:
        fix = f"pass --max-new-tokens {room} or less" if room > 0 else "shorten --prompt"
        raise StarscreamError(f"--prompt of {len(tokens)} tokens + --max-new-tokens {max_new_tokens} exceed model "
                              f"{config.name}'s max_seq_len {config.max_seq_len}; {fix}")
    return tokens


def until_stop(row: np.ndarray, stop_tokens) -> np.ndarray:
    """`row` up to (not including) its first token of `stop_tokens` (ids, or one id, or None)."""
    stops = np.flatnonzero(np.isin(row, stop_ids_of(stop_tokens)))
    return row[:stops[0]] if len(stops) else row
