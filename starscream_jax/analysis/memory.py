"""What a GPU would hold for one step, per device, at full depth: the planner's memory figure.

The CPU compile's memory analysis is no guide to a GPU's: the CPU backend keeps bfloat16 values as float32 and
stores attention's whole score matrix, which a fused GPU attention kernel never does. This estimate counts instead,
from the model's shapes and the layout's placement of each tensor (the activation rules give every tensor's shard):

  persistent   parameters, optimizer state and KV cache, exact (`layout_report.memory_per_device`).
  gradients    train: one float32 copy of the parameters, placed like them; with gradient accumulation two (the
               running sum and the micro-step's gradients are live at once).
  saved        train: what the backward pass keeps of each layer's forward, per layer x layers, by remat policy:
               none  the residual in and out of each half, q / k / v before and after rotary, the attention output,
                     gate / up / their product (compute dtype), the normalised residuals and the gate's activation
                     (float32), and the layer's weights cast to the compute dtype;
               dots  the layer's input and the outputs of its projection matmuls;
               full  the layer's input alone.
  working      train: the larger of the step's logits (float32) and one layer's forward as `none` keeps it (the
               layer recomputed or running); they are not live at once.
               prefill: the larger of the logits (in the compute dtype and their float32 copy, live at once: an
               H200 compile of Llama 3.2 1B at 8 x 4096 held both) and one layer's activations (the new KV cache
               is persistent).
               decode: the logits, and with a stacked cache half a KV cache more: the layer loop writes the new keys
               and values into the donated cache in place and holds about half a cache in flight (read from H200
               compiles of Llama 3.2 1B and Llama 3 8B decode steps, batch 64, cache 8192: temporaries 0.54x and
               0.52x the cache, benchmarks/results/h200_memory_inplace_cache.json; before the in-place write they
               were 1.57x and 1.53x). With the cache one array per layer (generation's decode, no layer loop)
               nothing of it: each layer's array is updated in place (Llama 3 8B, cache 4096: temporaries 34 MB at
               batch 1 and 86 MB at batch 64 against caches of 0.5 and 34 GB,
               benchmarks/results/decode_llama3-8b_1gpu.json).
  micro-batch  train with gradient accumulation: the saved and working activations are one micro-batch's.

`memory_passes` counts, from the same shapes and placements, the bytes a step moves through HBM outside its
matmuls: the cost model's memory-bound term (`costmodel`).

H200 memory_analysis() of the same programs (benchmarks/results/h200_costmodel.json; decode with the in-place cache:
h200_memory_inplace_cache.json) is what the terms were read from, and programs held out from that (other models,
batches, remat policies, gradient accumulation, prefill: h200_costmodel_heldout.json) what they are checked against
(`scripts/compare_costmodel.py`).
"""
from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from ..hardware.backend import policy_of_vendor
from ..model.config import ModelConfig
from ..model.decoder import rolls_layers
from ..model.names import ATTN_KV, ATTN_Q, LOGITS, RESIDUAL
from ..sharding.apply import activation_spec, use_layout
from ..sharding.layouts import get_layout
from ..sharding.rules import resolve

MLP_HIDDEN = ("batch", "seq", "mlp")
FLOAT32 = 4
DECODE_CACHE_COPIES = 0.55
"""KV caches the decode step holds beside its donated input when the cache is stacked (see the module docstring)."""



def shard_elements(spec: PartitionSpec | None, shape: tuple[int, ...], mesh) -> int:
    """Elements of one device's shard of a tensor of `shape` placed by `spec` (None: whole)."""
    return math.prod(NamedSharding(mesh, spec or PartitionSpec()).shard_shape(shape))


def held_bytes(tree) -> int:
    """Bytes one device holds of the placed arrays (or ShapeDtypeStructs with shardings) of `tree`: each leaf's
    shard."""
    return sum(math.prod(leaf.sharding.shard_shape(leaf.shape)) * np.dtype(leaf.dtype).itemsize
               for leaf in jax.tree.leaves(tree))


def local_elements(names: tuple, shape: tuple[int, ...], mesh) -> int:
    """Elements of one device's shard of a tensor of `shape` placed by the active layout's activation rules."""
    return shard_elements(activation_spec(names, shape), shape, mesh)


def activation_bytes(config: ModelConfig, layout, mesh, batch: int, seq: int) -> dict[str, float]:
    """Bytes per device of one layer's activations for `batch` x `seq` tokens: {"none", "dots", "full"} (what each
    remat policy keeps of a layer) and "logits" (float32)."""
    c, itemsize, layout = config, np.dtype(config.dtype).itemsize, get_layout(layout)
    with use_layout(layout, mesh):
        residual = local_elements(RESIDUAL, (batch, seq, c.d_model), mesh)
        queries = local_elements(ATTN_Q, (batch, seq, c.n_heads, c.head_dim), mesh)
        keys = local_elements(ATTN_KV, (batch, seq, c.n_kv_heads, c.head_dim), mesh)
        hidden = local_elements(MLP_HIDDEN, (batch, seq, c.d_ff), mesh) * max(1, c.n_experts)
        logits = local_elements(LOGITS, (batch, seq, c.vocab_size), mesh)
        weights = layer_weight_elements(c, layout, mesh)
    return {
        "none": itemsize * (4 * residual + 3 * queries + 5 * keys + 3 * hidden + weights)
        + FLOAT32 * (2 * residual + hidden),
        "dots": itemsize * (3 * residual + queries + 2 * keys + 2 * hidden),
        "full": itemsize * residual,
        "logits": FLOAT32 * logits,
    }


def matmul_flops(config: ModelConfig, layout, mesh, batch: int, seq: int) -> float:
    """Forward FLOPs per device of the projection matmuls of every layer and of the head, for `batch` x `seq` tokens:
    2 x the device's tokens x its share of each weight at use (attention's score matmuls not counted)."""
    layout = get_layout(layout)
    with use_layout(layout, mesh):
        tokens = local_elements(RESIDUAL, (batch, seq, config.d_model), mesh) / config.d_model
        head = resolve(("embed", "vocab"), (config.d_model, config.vocab_size), layout.weights, mesh, "head at use")
        head_elements = shard_elements(head, (config.d_model, config.vocab_size), mesh)
    return 2 * tokens * (config.n_layers * layer_weight_elements(config, layout, mesh) + head_elements)


def layer_weight_elements(c: ModelConfig, layout, mesh) -> float:
    """Elements per device of one layer's weights as the matmuls use them (the layout's weight rules at use)."""
    experts = max(1, c.n_experts)
    shapes = {("embed", "heads", "head_dim"): (c.d_model, c.n_heads, c.head_dim),
              ("embed", "kv_heads", "head_dim"): (c.d_model, c.n_kv_heads, c.head_dim),
              ("heads", "head_dim", "embed"): (c.n_heads, c.head_dim, c.d_model),
              ("embed", "mlp"): (c.d_model, c.d_ff * experts), ("mlp", "embed"): (c.d_ff * experts, c.d_model)}
    counts = {("embed", "kv_heads", "head_dim"): 2, ("embed", "mlp"): 2}
    total = 0.0
    for names, shape in shapes.items():
        spec = resolve(names, shape, layout.weights, mesh, "weight at use")
        total += counts.get(names, 1) * shard_elements(spec, shape, mesh)
    return total


def gpu_memory(config: ModelConfig, layout, mesh, phase: str, batch: int, seq: int, persistent: dict[str, Any],
               micro_batches: int = 1, cache_per_layer: bool = False) -> dict[str, float]:
    """{component: bytes per device} and "total" for a GPU running the step (see the module docstring).
    `config` at full depth with its remat policy; `persistent` the exact params / optimizer_state / kv_cache bytes;
    `micro_batches` the gradient-accumulation steps (train); `cache_per_layer` whether decode holds the KV cache as
    one array per layer."""
    layers = config.n_layers
    rows = batch // micro_batches
    one_layer = activation_bytes(config, layout, mesh, rows, seq if phase != "decode" else 1)
    parts = {"params": persistent["params"], "optimizer_state": persistent.get("optimizer_state") or 0.0,
             "kv_cache": persistent.get("kv_cache") or 0.0}
    if phase == "train":
        parts["gradients"] = persistent["params"] * (2 if micro_batches > 1 else 1)
        parts["saved_activations"] = layers * one_layer[config.remat]
        parts["working"] = max(one_layer["logits"], one_layer["none"])
    elif phase == "prefill":
        logits = one_layer["logits"] * (1 + np.dtype(config.dtype).itemsize / FLOAT32)
        parts["working"] = max(logits, one_layer["none"])
    else:
        parts["working"] = one_layer["logits"] + (0 if cache_per_layer else DECODE_CACHE_COPIES) * parts["kv_cache"]
    parts["total"] = sum(parts.values())
    return parts


def memory_passes(config: ModelConfig, layout, mesh, phase: str, batch: int, seq: int, persistent: dict[str, Any],
                  cache_per_layer: bool = False, cache_read_in_place: bool = False) -> dict[str, float]:
    """{kind: bytes per device} a step reads and writes through HBM outside its matmuls, for `config` at full depth
    (its remat policy and layer loop unroll) and `batch` x `seq` tokens (decode: one per sequence, against a cache
    of `persistent["kv_cache"]` bytes). Each pass reads its inputs and writes its outputs once:

      layers       per layer forward: two norms (read the residual, write the normalised copy), rotary on q and k,
                   two residual adds (two reads, one write), the gated MLP's product (two reads, one write), in the
                   compute dtype; training runs the backward (twice the forward's bytes) and recomputes the forward
                   once more under remat "dots" or "full".
      saved        train: what the backward pass keeps of each layer's forward (`activation_bytes` by remat
                   policy), written into the layer loop's stacked outputs by the forward and read by the backward.
      loss         train: the logits written, read for their maximum and their sum of exponentials, written as
                   float32 log-probabilities and read back by the backward, which writes their gradient.
      logits       prefill and decode: the logits written and read by sampling.
      casts        train: the float32 weights cast to the compute dtype in the forward (again when remat "full"
                   recomputes it) and their gradients widened to float32 in the backward.
      update       train: the optimizer reads the gradients twice (clipping's norm, the update), reads and writes
                   the parameters and the optimizer state.
      accumulate   train: adding one micro-step's float32 gradients into their sum (read both, write the sum).
      weight_copies  prefill and decode with a rolled layer loop: each layer's weights copied out of the stacked
                   arrays (read and write) before the matmuls read them.
      cache_copies decode, each a read and a write of the whole cache (`decode_cache_copies`); prefill: the new
                   cache written once.

    The decode program is `config`'s (a layer loop unless `layers_per_trip` is every layer) with the KV cache one
    array per layer when `cache_per_layer` (as generation holds it without a loop, `dense_cache.split_cache`), and
    attention reading each layer's cache in place when `cache_read_in_place` (`reads_cache_in_place`).
    """
    c, itemsize = config, np.dtype(config.dtype).itemsize
    rows = 1 if phase == "decode" else seq
    hidden = c.d_ff * (c.experts_per_token if c.n_experts else 1)
    with use_layout(get_layout(layout), mesh):
        residual = local_elements(RESIDUAL, (batch, rows, c.d_model), mesh)
        queries = local_elements(ATTN_Q, (batch, rows, c.n_heads, c.head_dim), mesh)
        keys = local_elements(ATTN_KV, (batch, rows, c.n_kv_heads, c.head_dim), mesh)
        gated = local_elements(MLP_HIDDEN, (batch, rows, hidden), mesh)
        logits = local_elements(LOGITS, (batch, rows, c.vocab_size), mesh)
    forward = itemsize * (10 * residual + 2 * queries + 2 * keys + 3 * gated)
    rolled = rolls_layers(c, cache_per_layer)
    if phase == "train":
        recomputed = c.remat != "none"
        params = persistent["params"]
        weights = params / FLOAT32
        saved = 2 * c.n_layers * activation_bytes(c, layout, mesh, batch, seq)[c.remat]
        return {"layers": c.n_layers * forward * (3 + recomputed), "saved": saved,
                "loss": logits * (4 * itemsize + 2 * FLOAT32),
                "casts": weights * (FLOAT32 + itemsize) * (2 + (c.remat == "full")),
                "update": 4 * params + 2 * (persistent.get("optimizer_state") or 0.0), "accumulate": 3 * params}
    cache = persistent.get("kv_cache") or 0.0
    passes = {"layers": c.n_layers * forward, "logits": 2 * itemsize * logits,
              "cache_copies": cache if phase == "prefill" else cache * decode_cache_copies(rolled, cache_per_layer,
                                                                                          cache_read_in_place)}
    if rolled:
        passes["weight_copies"] = 2 * itemsize * c.n_layers * layer_weight_elements(c, get_layout(layout), mesh)
    return passes


def decode_cache_copies(rolled: bool, cache_per_layer: bool, read_in_place: bool) -> int:
    """How many times a decode step reads and writes its whole KV cache outside attention, by what the program does
    (read from profiles of Llama 3 8B decode, benchmarks/NOTES.md):
      2  a transposed copy of each layer's keys and values for XLA's attention (not when it reads the cache in
         place, `read_in_place`: cuDNN's fused kernel);
      2  each layer's slice copied out of a stacked cache ([L, B, T, K, E]): by a rolled layer loop, which carries
         the cache, or before a library call (cuDNN) can read it; none when the cache is one array per layer;
      2  a rolled loop's whole cache transposed into and out of the loop.
    Measured: rolled with XLA's attention (6), no loop over a stacked cache with XLA's attention (2) or cuDNN's (2),
    per-layer arrays with cuDNN's (0). Not measured: a rolled loop with cuDNN's (4), per-layer arrays with XLA's (2)."""
    through_xla = 0 if read_in_place else 2
    sliced = 2 if not cache_per_layer and (rolled or read_in_place) else 0
    return through_xla + sliced + (2 if rolled else 0)


def reads_cache_in_place(chip, dtype) -> bool:
    """Whether decode's attention reads each layer's KV cache where it lies on `chip` (a `hardware.presets.Chip`):
    where the model calls the vendor's fused attention (`hardware.backend.BackendPolicy.fuses_attention`: cuDNN's
    on NVIDIA GPUs for 16-bit inputs), which takes the cache with its strides. XLA's attention (on other chips, and
    in the programs the inspector compiles for CPU devices) reads a transposed copy."""
    return policy_of_vendor(chip.vendor).fuses_attention(dtype)
