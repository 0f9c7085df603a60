"""A model loaded for inference: from a training run's checkpoint or a Hugging Face model directory, placed by the
prefill layout on a mesh, its weights and KV cache in the formats asked for on a chip, with its tokenizer. What
`starscream generate` and `starscream serve` load; the commands only turn their flags into a `LoadRequest`.

The KV cache's format travels on the model's configuration (`ModelConfig.kv_format`), the one place every path that
holds a cache reads it: static decode (`dense_cache.init_cache`), the serving engine's page pools and the serve step
`inspect` compiles."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from flax import nnx

from ..errors import ShardingRuleError
from ..hardware.presets import Chip
from ..model.config import ModelConfig
from ..model.heads import pad_query_heads_to, refuse_unsplit_heads
from ..model.hf_checkpoint import load_hf_model
from ..model.hf_config import model_config_from_hf
from ..model.layer_weights import stack_projections
from ..model.quantize import OCP_TO_FNUZ
from ..model.vocabulary import pad_vocabulary, padded_vocabulary
from ..model.weight_formats import quantize_model, to_fnuz
from ..sharding.layouts import PHASE_DEFAULTS
from ..text.tokenizer import ByteTokenizer, HFTokenizer, model_dir_tokenizer, tokenizer_for_model
from ..training.checkpoint import CheckpointStore, restore_model
from ..training.config import TrainConfig

PADDING_LOAD_LAYOUT = "starscream_fsdp"
"""The layout a model whose query heads or vocabulary are padded is loaded under: it splits neither (weights inside
each GPU by embed), so it places the model's own on any mesh; generation then places the padded model by its
layouts."""


@dataclass(frozen=True, kw_only=True)
class LoadRequest:
    """What to load. model_dir: a Hugging Face model directory, else checkpoint: a training run's checkpoints
    directory, at step (None: the latest); dtype: the compute dtype (None: the model's; a checkpoint's: its
    training one); weight_format: "" or the 8-bit format the weights are quantized into (a pre-quantized
    checkpoint's own format is checked against the chip's), at weight_scales granularity; kv_format: "" or the
    8-bit format of the KV cache; pad_heads: query heads to pad the model to (None: its own); prefill_layout and
    decode_layout: the layouts generation runs under (the model is placed by the prefill one)."""

    model_dir: str | Path | None = None
    checkpoint: str | Path | None = None
    step: int | None = None
    dtype: str | None = None
    weight_format: str = ""
    weight_scales: str = "channel"
    kv_format: str = ""
    pad_heads: int | None = None
    prefill_layout: str = PHASE_DEFAULTS["prefill"]
    decode_layout: str = PHASE_DEFAULTS["decode"]


class LoadedModel(NamedTuple):
    """model: placed by the request's prefill layout; source: where it came from (the model directory, or the
    checkpoint's step); tokenizer: its tokenizer."""

    model: nnx.Module
    source: str
    tokenizer: ByteTokenizer | HFTokenizer


def load_for_inference(request: LoadRequest, mesh, chip: Chip) -> LoadedModel:
    """The model `request` names, placed by its prefill layout on `mesh`, in the 8-bit formats it asks for on
    `chip`, its projections as inference holds them (`layer_weights.stack_projections`: the loaded parts freed
    before an engine sizes its cache by free memory). With pad_heads, or a vocabulary the layouts' parts do not
    divide (padded to the rows they do, `model.vocabulary`), the model is loaded under PADDING_LOAD_LAYOUT (which
    splits neither), padded, then quantized into the prefill layout's placement. Query heads the prefill or decode
    layout cannot split over the mesh are refused before anything runs, with the --pad-heads N that splits them."""
    layouts = (request.prefill_layout, request.decode_layout)
    config = saved_config(request)
    vocabulary = padded_vocabulary(config.vocab_tokens, layouts, mesh)
    try:
        loaded = _load(request, mesh, chip, vocabulary if vocabulary != config.vocab_size else None)
    except ShardingRuleError:
        refuse_unsplit_heads(config, layouts, mesh)  # the heads were what the layout could not place
        raise
    refuse_unsplit_heads(loaded.model.config, layouts, mesh)
    return loaded._replace(model=stack_projections(loaded.model, mesh))


def saved_config(request: LoadRequest) -> ModelConfig:
    """The configuration of the model `request` names, read without its weights."""
    if request.model_dir:
        return model_config_from_hf(request.model_dir)
    with CheckpointStore(request.checkpoint, must_exist=True) as store:
        return ModelConfig(**store.restore_meta(request.step)["model_config"])


def _load(request: LoadRequest, mesh, chip: Chip, vocabulary: int | None) -> LoadedModel:
    """`load_for_inference` without the check of the query heads; the vocabulary padded to `vocabulary` rows (None:
    as it is)."""
    weights = request.weight_format
    pad = bool(request.pad_heads or vocabulary)
    layout = PADDING_LOAD_LAYOUT if pad else request.prefill_layout
    if request.model_dir:
        model = load_hf_model(request.model_dir, layout, mesh, dtype=request.dtype, quantize="" if pad else weights,
                              scales=request.weight_scales)
        source, tokenizer = str(request.model_dir), model_dir_tokenizer(request.model_dir, model.config)
    else:
        model, description = restore_model(request.checkpoint, layout, mesh, request.step, request.dtype)
        run_config = TrainConfig.from_dict(description["train_config"])
        # a run fine-tuned from a model directory trained on its tokenizer: bytes only if the model was made for them
        tokenizer = tokenizer_for_model(run_config.tokenizer_dir(), model.config, trained_weights=bool(run_config.init))
        source = f"step {description['step']}"
    if request.pad_heads:
        model = pad_query_heads_to(model, request.pad_heads)
    if vocabulary:
        model = pad_vocabulary(model, vocabulary)
    if weights and (pad or not request.model_dir):
        model = quantize_model(model, weights, request.weight_scales, request.prefill_layout, mesh)
    if OCP_TO_FNUZ.get(model.config.weight_format) in chip.formats and model.config.weight_format not in chip.formats:
        model = to_fnuz(model)  # an OCP fp8 checkpoint on a chip of FNUZ fp8 (MI300X): exact
    if model.config.weight_format:
        chip.check_format(model.config.weight_format)
    if request.kv_format:
        model.config = model.config.replace(kv_format=request.kv_format)
    return LoadedModel(model, source, tokenizer)
