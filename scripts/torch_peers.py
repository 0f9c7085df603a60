"""The PyTorch peers of bench_mfu.py and bench_decode.py: what a user would pick instead of this library, written as
PyTorch users write it, timed on one GPU beside the library's rows.

Training (`train_benchmark`, in torchtitan's manner): a plain Llama (`Llama`: embedding, blocks of RMSNorm -> q / k / v
projections -> rotary embedding -> causal SDPA over the kv heads repeated to the query heads -> o projection, then
RMSNorm -> SwiGLU MLP, a final RMSNorm and the head, tied to the embedding where the model ties it), each block
compiled by `torch.compile`, parameters in float32 (the master weights) and compute under
`torch.autocast(bfloat16)`, the residual stream in bfloat16, the loss in float32, gradient clipping by global norm,
fused AdamW on the library's warm-up + cosine schedule with no weight decay on norm scales. It starts from the
library's initial parameters (`load_library_params`), so its step-0 loss is the library's on the same tokens.

Decode (`decode_benchmark`, in gpt-fast's manner): the same Llama with bfloat16 weights, a static KV cache per layer
([B, K, T, E] buffers written in place at the decoded position), one token per step (greedy), the step compiled by
`torch.compile(mode="reduce-overhead")` (CUDA graphs); attention reads the cache through SDPA with each kv head's
query heads as its queries (no copy of the cache per query head) and a mask up to the position.

Both use the library's rotary embedding (rotate-half over E / 2 frequencies, in float32) and the library's formulas
for what they report: bench_mfu's tokens / s and FLOP accounting (applied by the caller), bench_decode's bytes per
step (`decode_bytes`). torch is imported here only; the benchmarks load this module lazily
(`starscream_jax.benchmarks.harness.torch_peers`) and only where torch is present.
"""
from __future__ import annotations

import contextlib
import math
import re
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from starscream_jax.benchmarks import harness

TRAIN_NAME = "PyTorch (torchtitan-style)"
DECODE_NAME = "PyTorch (gpt-fast-style)"
LAYER_WEIGHTS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")
"""The per-layer parameters of the library's Llama (stacked [L, ...]) this peer implements."""


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, returned in x's dtype (as the library's)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def rope_tables(config, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [S, E/2] float32 of the rotary embedding at `positions` [S]."""
    half = config.head_dim // 2
    inv_freq = config.rope_theta ** (-torch.arange(half, dtype=torch.float32, device=positions.device) / half)
    angles = positions.float()[:, None] * inv_freq[None, :]
    return torch.cos(angles), torch.sin(angles)


def rotate(x_BSNE: torch.Tensor, cos_SE: torch.Tensor, sin_SE: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding of [B, S, N, E] in float32, returned in x's dtype."""
    half = x_BSNE.shape[-1] // 2
    cos, sin = cos_SE[None, :, None, :], sin_SE[None, :, None, :]
    x1, x2 = x_BSNE[..., :half].float(), x_BSNE[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x_BSNE.dtype)


class KVCache(nn.Module):
    """One layer's static cache: keys and values [B, K, T, E], written in place at the decoded position."""

    def __init__(self, batch: int, kv_heads: int, length: int, head_dim: int, dtype: torch.dtype):
        super().__init__()
        shape = (batch, kv_heads, length, head_dim)
        self.register_buffer("k", torch.randn(shape, dtype=dtype), persistent=False)  # never zeros: real reads
        self.register_buffer("v", torch.randn(shape, dtype=dtype), persistent=False)

    def update(self, position: torch.Tensor, k_BK1E: torch.Tensor, v_BK1E: torch.Tensor):
        self.k.index_copy_(2, position, k_BK1E)
        self.v.index_copy_(2, position, v_BK1E)
        return self.k, self.v


class Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.wq = nn.Linear(config.d_model, self.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.d_model, self.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.d_model, self.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.heads * self.head_dim, config.d_model, bias=False)
        self.cache: KVCache | None = None

    def forward(self, x_BSD, cos_SE, sin_SE, position=None):
        batch, seq, _ = x_BSD.shape
        q = rotate(self.wq(x_BSD).view(batch, seq, self.heads, self.head_dim), cos_SE, sin_SE)
        k = rotate(self.wk(x_BSD).view(batch, seq, self.kv_heads, self.head_dim), cos_SE, sin_SE)
        v = self.wv(x_BSD).view(batch, seq, self.kv_heads, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, N, S, E]
        group = self.heads // self.kv_heads
        if self.cache is None:  # training: causal self-attention, kv heads repeated to their query heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            out_BHSE = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # decode, one token: each kv head's `group` query heads read its cache as `group` queries
            k, v = self.cache.update(position, k, v)
            mask = (torch.arange(k.shape[2], device=k.device) <= position).view(1, 1, 1, -1)
            q_BKGE = q.reshape(batch, self.kv_heads, group, self.head_dim)
            out_BHSE = F.scaled_dot_product_attention(q_BKGE, k, v, attn_mask=mask).reshape(
                batch, self.heads, 1, self.head_dim)
        return self.wo(out_BHSE.transpose(1, 2).reshape(batch, seq, self.heads * self.head_dim))


class FeedForward(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.w_gate = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.w_up = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.w_down = nn.Linear(config.d_ff, config.d_model, bias=False)

    def forward(self, x):
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.eps = config.norm_eps
        self.attn_norm = nn.Parameter(torch.ones(config.d_model))
        self.attention = Attention(config)
        self.mlp_norm = nn.Parameter(torch.ones(config.d_model))
        self.mlp = FeedForward(config)

    def forward(self, x, cos, sin, position=None):
        x = x + self.attention(rms_norm(x, self.attn_norm, self.eps), cos, sin, position)
        return x + self.mlp(rms_norm(x, self.mlp_norm, self.eps))


class Llama(nn.Module):
    """The library's Llama (`model.decoder.Transformer` without the options this peer does not implement): logits
    [B, S, V] float32 of tokens [B, S], the residual stream in `config.dtype`."""

    def __init__(self, config):
        super().__init__()
        unsupported = [name for name in ("qkv_bias", "qk_norm", "rope_scaling") if getattr(config, name, None)]
        if unsupported or getattr(config, "n_experts", 0):
            raise ValueError(f"model {config.name}: the PyTorch peer implements the plain Llama; it lacks "
                             f"{', '.join(unsupported or ['experts'])}")
        self.config = config
        self.embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.final_norm = nn.Parameter(torch.ones(config.d_model))
        self.lm_head = None if config.tie_embeddings else nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.remat = config.remat not in (False, "none")

    def forward(self, tokens_BS, position=None):
        dtype = getattr(torch, self.config.dtype)
        x = self.embedding(tokens_BS).to(dtype)
        positions = torch.arange(tokens_BS.shape[1], device=tokens_BS.device) if position is None else position
        cos, sin = rope_tables(self.config, positions)
        for layer in self.layers:
            if self.remat and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, use_reentrant=False)
            else:
                x = layer(x, cos, sin, position)
        x = rms_norm(x, self.final_norm, self.config.norm_eps)
        head = self.embedding.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(x, head.to(x.dtype)).float()


def load_library_params(model: Llama, params: dict) -> None:
    """Copies the library's parameters (`nnx.to_pure_dict` of its nnx.State, as numpy: "embedding" [V, D],
    "final_norm" [D], "layers" {name: [L, ...]} of LAYER_WEIGHTS, "lm_head" [D, V] unless tied) into `model`, each
    matrix transposed to nn.Linear's [out, in]."""
    layers = params["layers"]
    missing = [name for name in LAYER_WEIGHTS if name not in layers]
    extra = sorted(set(layers) - set(LAYER_WEIGHTS))
    if missing or extra:
        raise ValueError(f"the library's layer parameters {sorted(layers)} are not the plain Llama's "
                         f"{list(LAYER_WEIGHTS)} (missing {missing}, not implemented {extra})")

    def put(target: torch.Tensor, value: np.ndarray) -> None:
        value = np.array(value, dtype=np.float32).reshape(target.shape)  # a writable copy
        with torch.no_grad():
            target.copy_(torch.from_numpy(value))

    put(model.embedding.weight, params["embedding"])
    put(model.final_norm, params["final_norm"])
    if model.lm_head is not None:
        put(model.lm_head.weight, params["lm_head"].T)
    for index, block in enumerate(model.layers):
        w = {name: np.asarray(layers[name][index]) for name in LAYER_WEIGHTS}
        put(block.attn_norm, w["attn_norm"])
        put(block.mlp_norm, w["mlp_norm"])
        for name in ("wq", "wk", "wv"):  # [D, N, E] -> [N * E, D]
            put(getattr(block.attention, name).weight, w[name].reshape(w[name].shape[0], -1).T)
        put(block.attention.wo.weight, w["wo"].reshape(-1, w["wo"].shape[-1]).T)  # [H, E, D] -> [D, H * E]
        for name in ("w_gate", "w_up", "w_down"):
            put(getattr(block.mlp, name).weight, w[name].T)


def learning_rate_factor(train_config):
    """The library's schedule (optax.warmup_cosine_decay_schedule) as a factor of the peak rate, per step."""
    peak = train_config.learning_rate
    end = peak * train_config.final_learning_rate_fraction
    warmup = train_config.warmup_steps
    decay_steps = max(train_config.steps, warmup + 1)

    def factor(step: int) -> float:
        if step < warmup:
            return step / warmup
        progress = min((step - warmup) / (decay_steps - warmup), 1.0)
        return (end + (peak - end) * 0.5 * (1 + math.cos(math.pi * progress))) / peak

    return factor


def synchronizer(device: str):
    """What makes a step's results ready before the clock reads: CUDA's synchronize (nothing to wait for on CPU)."""
    if device == "cuda":
        return lambda _: torch.cuda.synchronize()
    return lambda _: None


def train_benchmark(params: dict, model_config, train_config, tokens: np.ndarray, *, warmup: int, steps: int,
                    device: str = "cuda") -> dict:
    """Time the torchtitan-style training step on tokens [B, S+1] (int) from the library's initial `params`.

    Returns compile_s (the first step's wall time: torch.compile compiles each block as it is first called, and
    that step is step 0), step_s (seconds per timed step after `warmup` steps, the first included), the loss of
    every step (the first: step 0's, of the initial parameters), "attention" and peak_bytes (torch's peak
    allocation on the GPU)."""
    torch.manual_seed(0)
    with torch.device(device):
        model = Llama(model_config)
    load_library_params(model, params)
    for index, block in enumerate(model.layers):  # torchtitan compiles each block on its own
        model.layers[index] = torch.compile(block, fullgraph=True)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": train_config.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=train_config.learning_rate,
                                  betas=(0.9, 0.999), eps=1e-8, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, learning_rate_factor(train_config))
    tokens = torch.from_numpy(np.asarray(tokens, dtype=np.int64)).to(device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    compute_dtype = getattr(torch, model_config.dtype)

    def step(state):
        with torch.autocast(device_type=device, dtype=compute_dtype, enabled=compute_dtype != torch.float32):
            logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), train_config.clip_norm, foreach=True)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return state, loss.detach()

    sync = synchronizer(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    _, first_loss = step(None)
    sync(None)
    compile_s = time.perf_counter() - start
    timed = harness.timed_steps(step, None, warmup=max(warmup - 1, 0), steps=steps, sync=sync)
    result = {"compile_s": compile_s, "step_s": timed.seconds_per_step,
              "losses": [float(loss) for loss in [first_loss, *timed.outputs]], "attention": "SDPA (causal)",
              "peak_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None}
    del model, optimizer, scheduler, step, timed
    release_memory(device)
    return result


def release_memory(device: str) -> None:
    """Hands the GPU memory torch's caching allocator holds back to the device, for the JAX rows after."""
    if device == "cuda":
        torch.cuda.empty_cache()


def decode_bytes(model: Llama, batch: int, cache_length: int) -> dict:
    """{"weights", "kv_cache"}: bytes one decode step must read, as bench_decode counts them: every weight once
    (the embedding table only for the `batch` rows it looks up, unless it is the head too) and the whole cache."""
    config = model.config
    weights = 0
    for name, value in model.named_parameters():
        if name == "embedding.weight" and model.lm_head is not None:
            weights += batch * value.shape[1] * value.element_size()
        else:
            weights += value.numel() * value.element_size()
    cache = 2 * config.n_layers * batch * cache_length * config.n_kv_heads * config.head_dim * 2
    return {"weights": weights, "kv_cache": cache}


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def decode_benchmark(model_config, batches: list[int], cache_length: int, *, warmup: int, steps: int,
                     device: str = "cuda", compile_mode: str | None = "reduce-overhead") -> list[dict]:
    """Time the gpt-fast-style decode step at each batch size against a full cache of `cache_length` positions
    (random bfloat16 weights and cache, decoding at the last position, as bench_decode does).

    Each row: batch, cache_length, compile_s (the first step's wall time), step_s, tokens_per_s, bytes_per_step
    (`decode_bytes`) and bandwidth_bytes_per_s."""
    config = model_config.replace(dtype="bfloat16")
    with torch.device(device), default_dtype(torch.bfloat16):
        torch.manual_seed(0)
        model = Llama(config).eval()
    decode_one = torch.compile(decode_one_token, mode=compile_mode, fullgraph=True, dynamic=False) \
        if compile_mode else decode_one_token
    sync = synchronizer(device)
    rows = []
    for batch in batches:
        for block in model.layers:
            block.attention.cache = None  # the previous batch's cache freed before the next one is made
        with torch.device(device):
            for block in model.layers:
                block.attention.cache = KVCache(batch, config.n_kv_heads, cache_length, config.head_dim,
                                                torch.bfloat16)
        position = torch.tensor([cache_length - 1], device=device)
        token = torch.randint(config.vocab_size, (batch, 1), device=device)

        def step(token):
            return decode_one(model, token, position).clone(), None

        with torch.inference_mode():
            start = time.perf_counter()
            token, _ = step(token)
            sync(None)
            compile_s = time.perf_counter() - start
            timed = harness.timed_steps(step, token, warmup=max(warmup - 1, 0), steps=steps, sync=sync)
        read = decode_bytes(model, batch, cache_length)
        rows.append({"name": DECODE_NAME, "batch": batch, "cache_length": cache_length, "compile_s": compile_s,
                     "step_s": timed.seconds_per_step, "tokens_per_s": batch / timed.seconds_per_step,
                     "bytes_per_step": read, "bandwidth_bytes_per_s": sum(read.values()) / timed.seconds_per_step})
    del model, decode_one
    torch._dynamo.reset()  # the CUDA graphs' memory pool goes with the compiled step
    release_memory(device)
    return rows


def decode_one_token(model: Llama, token_B1: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """The next token [B, 1] (greedy) after `token_B1` at `position`, the caches written in place."""
    logits = model(token_B1, position)
    return torch.argmax(logits[:, -1], dim=-1, keepdim=True)
