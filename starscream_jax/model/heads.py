"""Query heads padded with zero weights, so that a head count the GPUs do not divide (Qwen2-7B: 28 heads, 4 kv heads,
on 8 GPUs) splits over them, the logits unchanged.

Each kv head's group of G query heads grows to G' (the smallest G' >= G with K G' a multiple of the GPUs): the new
heads' query projection (and bias) and their rows of the output projection are zeros. A zero query scores every key
alike, so the padded head attends to the mean of the values, which its zero rows of `wo` multiply by zero: the
residual stream, and so the logits, are those of the unpadded model. The cost is (G' - G) / G more attention and
q / o projection work per GPU, against tensor parallelism over fewer GPUs, which the planner weighs.

The vocabulary is padded the same way, with zero rows, wherever the layouts' parts do not divide it
(`model.vocabulary`).
"""
from __future__ import annotations

import math

import jax.numpy as jnp
from flax import nnx

from ..errors import ShardingRuleError, StarscreamError
from ..sharding.layouts import Layout, get_layout
from .config import ModelConfig
from .decoder import Transformer

PADDED = {"wq": 2, "bq": 1, "wo": 1}
"""The stacked weights with a query-head dimension, and its index ([L, D, H, E], [L, H, E], [L, H, E, D])."""


def padded_heads(config: ModelConfig, gpus: int) -> int:
    """The query heads after padding each kv head's group to a size whose K groups the `gpus` divide."""
    group = config.n_heads // config.n_kv_heads
    step = gpus // math.gcd(gpus, config.n_kv_heads)  # K * G' is a multiple of gpus iff G' is one of step
    return config.n_kv_heads * (-(-group // step) * step)


def pad_query_heads(model: Transformer, gpus: int) -> Transformer:
    """A copy of `model` with its query heads padded to `padded_heads(config, gpus)` (the module docstring); the
    model itself where they already divide. Unsharded arrays in, unsharded arrays out: place the result with a
    layout afterwards (`create_sharded`, `generate.place_params`)."""
    if gpus < 1:
        raise StarscreamError(f"{gpus} GPUs: pad query heads for at least 1")
    return pad_query_heads_to(model, padded_heads(model.config, gpus))


def heads_parts(layout: Layout | str, mesh) -> int:
    """How many parts `layout` splits the query heads into on `mesh`: the mesh size of the axes its `heads` rules
    name, the largest of its tables (at rest, at use, activations); 1 where it may copy heads it cannot split."""
    layout = get_layout(layout)
    tables = (layout.params, layout.weights, layout.activations)
    if any("heads" in rules.may_replicate for rules in tables):
        return 1
    return math.lcm(*(math.prod(mesh.shape[axis] for axis in rules.lookup("heads")[1]) for rules in tables))


def pad_heads_fix(config: ModelConfig, layouts, mesh) -> str:
    """The fix the commands that pad query heads take (`inspect`, `generate`, `serve`: --pad-heads N) when `layouts`
    cannot split `config`'s query heads over `mesh`: "pass --pad-heads N ...", N the fewest heads every one of them
    splits (`padded_heads`); "" where they already split, or where the kv heads neither divide nor are divided by
    the parts, so that each part's query heads would split some kv head's group whatever its size (`model.ops`
    refuses it) and padding cannot help."""
    parts = math.lcm(*(heads_parts(layout, mesh) for layout in layouts))
    kv = config.n_kv_heads
    if config.n_heads % parts == 0 or (parts % kv and kv % parts):
        return ""
    heads = padded_heads(config, parts)
    return (f"pass --pad-heads {heads}: each kv head's {config.n_heads // kv} query heads padded with zero heads to "
            f"{heads // kv} ({heads} in all, which the {parts} parts divide); the logits are unchanged")


def refuse_unsplit_heads(config: ModelConfig, layouts, mesh) -> None:
    """A ShardingRuleError naming --pad-heads N (`pad_heads_fix`) where `layouts` cannot split `config`'s query
    heads over `mesh` and padding them would; nothing otherwise (the resolver then says what is wrong)."""
    fix = pad_heads_fix(config, layouts, mesh)
    if fix:
        parts = {get_layout(layout).name: heads_parts(layout, mesh) for layout in layouts}
        refused = ", ".join(f"{name} into {count}" for name, count in parts.items() if config.n_heads % count)
        raise ShardingRuleError(f"model {config.name}'s {config.n_heads} query heads do not split as the layouts "
                                f"split heads on mesh {dict(mesh.shape)} ({refused}); {fix}")


def check_padded_heads(config: ModelConfig, heads: int) -> None:
    """A StarscreamError unless `heads` query heads pad `config`'s: at least its own, a multiple of its kv heads."""
    if heads < config.n_heads or heads % config.n_kv_heads:
        raise StarscreamError(
            f"--pad-heads {heads}: model {config.name} has {config.n_heads} query heads sharing {config.n_kv_heads} "
            f"kv heads; pad to a multiple of {config.n_kv_heads} no smaller than {config.n_heads}")


def pad_query_heads_to(model: Transformer, heads: int) -> Transformer:
    """A copy of `model` with each kv head's group of query heads padded with zero heads to `heads` in all
    (`check_padded_heads`); the model itself where it has that many. Arrays in any placement; the result's are
    computed from them (place it with a layout afterwards)."""
    config = model.config
    check_padded_heads(config, heads)
    if heads == config.n_heads:
        return model
    if config.weight_format:
        raise StarscreamError(f"--pad-heads {heads}: the weights are already in {config.weight_format}, whose scales "
                              "the zero heads would lack; pad the float weights, then quantize (--quantize)")
    K, G = config.n_kv_heads, config.n_heads // config.n_kv_heads
    extra = heads // K - G
    graphdef, state = nnx.split(nnx.clone(model))  # the state's variables are the module's own: leave it whole
    layers = state["layers"]
    for name, axis in PADDED.items():
        if name not in layers:
            continue
        value = layers[name].get_value()
        grouped = value.reshape(*value.shape[:axis], K, G, *value.shape[axis + 1:])
        widths = [(0, 0)] * grouped.ndim
        widths[axis + 1] = (0, extra)
        layers[name].set_value(jnp.pad(grouped, widths).reshape(*value.shape[:axis], heads, *value.shape[axis + 1:]))
    padded = nnx.merge(graphdef, state)
    padded.config = config.replace(n_heads=heads)
    return padded
