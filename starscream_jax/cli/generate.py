"""`starscream generate`: text from a training checkpoint or a Hugging Face model directory, prefilled under one
layout and decoded under another (`starscream_jax.training.generate`), with the model's tokenizer (bytes for the
demo's runs), stopping at any of its EOS ids (`eos_ids`: tokenizer_config.json's, generation_config.json's and
config.json's)."""
from __future__ import annotations

import argparse

import numpy as np

from ..errors import ShardingRuleError
from ..hardware.distributed import is_main_process
from ..hardware.presets import Chip
from ..model.config import ModelConfig
from ..model.decoder import quantize_model, to_fnuz
from ..model.heads import pad_query_heads_to, refuse_unsplit_heads
from ..model.hf_checkpoint import load_hf_model
from ..model.hf_config import model_config_from_hf
from ..model.quantize import OCP_TO_FNUZ
from ..training.checkpoint import CheckpointStore, restore_model
from ..training.config import TrainConfig
from ..training.generate import generate, stop_ids_of
from ..training.steps import Sampling
from ..training.tokenizer import model_dir_tokenizer, tokenizer_for_model
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
)

PADDING_LOAD_LAYOUT = "starscream_fsdp"
"""The layout a model whose query heads are padded is loaded under: it splits no heads (weights inside each GPU by
embed), so it places the model's own heads on any mesh; generation then places the padded model by its layouts."""


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
    group.add_argument("--seed", type=int, default=0, help="sampling seed")


def run(args: argparse.Namespace) -> int:
    """`starscream generate`: load the model, generate, print each sample and the tokens/s. Returns 0."""
    sampling = Sampling(top_p=None if args.greedy else args.top_p, temperature=args.temperature, seed=args.seed)
    initialize_from_args(args)
    echo = print if is_main_process() else (lambda *_: None)
    topology, mesh = mesh_from_args(args)
    model, source, tokenizer = load_for_generation(args, mesh, topology.preset.chip)
    samples = args.samples
    prompt_tokens = tokenizer.encode(args.prompt)
    prompt = np.tile(prompt_tokens, (samples, 1))
    result = generate(model, prompt, args.max_new_tokens, sampling, mesh, args.prefill_layout, args.decode_layout,
                      stop_token=tokenizer.eos_ids)
    echo(f"{model.config.name} from {source} on mesh {dict(mesh.shape)}; prefill {args.prefill_layout}, decode "
         f"{args.decode_layout}")
    shown_rows = result.tokens[:1] if args.greedy else result.tokens  # greedy rows are all the same
    for index, row in enumerate(shown_rows):
        echo(f"--- sample {index}")
        echo(tokenizer.decode(np.concatenate([prompt_tokens, until_stop(row, tokenizer.eos_ids)])))
    echo(f"prefill {result.prefill_tokens_per_s:,.0f} tokens/s, decode {result.decode_tokens_per_s:,.0f} tokens/s "
         f"({samples} x {result.tokens.shape[1]} new tokens)")
    return 0


def load_for_generation(args: argparse.Namespace, mesh, chip: Chip):
    """(model placed by the prefill layout, where it came from, its tokenizer) from --model-dir or --checkpoint, in
    the 8-bit formats --quantize and --kv-cache ask for on `chip` (a pre-quantized checkpoint's format checked
    against the chip's). With --pad-heads the model is loaded under PADDING_LOAD_LAYOUT (which splits no heads),
    padded, then quantized into the prefill layout's placement. Query heads the prefill or decode layout cannot
    split over the mesh are refused before anything runs, with the --pad-heads N that splits them."""
    layouts = (args.prefill_layout, args.decode_layout)
    try:
        loaded = _load(args, mesh, chip)
    except ShardingRuleError:
        refuse_unsplit_heads(_saved_config(args), layouts, mesh)  # the heads were what the layout could not place
        raise
    refuse_unsplit_heads(loaded[0].config, layouts, mesh)
    return loaded


def _saved_config(args: argparse.Namespace) -> ModelConfig:
    """The configuration of the model --model-dir or --checkpoint (at --step) holds, read without its weights."""
    if args.model_dir:
        return model_config_from_hf(args.model_dir)
    with CheckpointStore(checkpoint_dir(args.checkpoint), must_exist=True) as store:
        return ModelConfig(**store.restore_meta(args.step)["model_config"])


def _load(args: argparse.Namespace, mesh, chip: Chip):
    """`load_for_generation` without the check of the query heads."""
    weights, cache = eight_bit_format(args.quantize, chip), eight_bit_format(args.kv_cache, chip)
    pad = args.pad_heads
    layout = PADDING_LOAD_LAYOUT if pad else args.prefill_layout
    if args.model_dir:
        model = load_hf_model(args.model_dir, layout, mesh, dtype=args.dtype, quantize="" if pad else weights,
                              scales=args.quantize_scales)
        source, tokenizer = args.model_dir, model_dir_tokenizer(args.model_dir, model.config)
    else:
        model, description = restore_model(checkpoint_dir(args.checkpoint), layout, mesh, args.step, args.dtype)
        run_config = TrainConfig.from_dict(description["train_config"])
        # a run fine-tuned from a model directory trained on its tokenizer: bytes only if the model was made for them
        tokenizer = tokenizer_for_model(run_config.tokenizer_dir(), model.config, trained_weights=bool(run_config.init))
        source = f"step {description['step']}"
    if pad:
        model = pad_query_heads_to(model, pad)
    if weights and (pad or not args.model_dir):
        model = quantize_model(model, weights, args.quantize_scales, args.prefill_layout, mesh)
    if OCP_TO_FNUZ.get(model.config.weight_format) in chip.formats and model.config.weight_format not in chip.formats:
        model = to_fnuz(model)  # an OCP fp8 checkpoint on a chip of FNUZ fp8 (MI300X): exact
    if model.config.weight_format:
        chip.check_format(model.config.weight_format)
    if cache:
        model.config = model.config.replace(kv_format=cache)
    return model, source, tokenizer


def until_stop(row: np.ndarray, stop_tokens) -> np.ndarray:
    """`row` up to (not including) its first token of `stop_tokens` (ids, or one id, or None)."""
    stops = np.flatnonzero(np.isin(row, stop_ids_of(stop_tokens)))
    return row[:stops[0]] if len(stops) else row
