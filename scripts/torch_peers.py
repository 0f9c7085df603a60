"""The PyTorch peers of bench_mfu.py and bench_decode.py: what a user would pick instead of this library, written as
PyTorch users write it, timed on one GPU beside the library's rows.

Training (`train_benchmark`, in torchtitan's manner): a plain Llama (`Llama`: embedding, blocks of RMSNorm -> q / k / v
projections -> rotary embedding -> causal SDPA over the kv heads repeated to the query heads -> o projection, then
RMSNorm -> SwiGLU MLP, a final RMSNorm and the head, tied to the embedding where the model ties it), each block
compiled by `torch.compile`, parameters in float32 (the master weights) and compute under
`torch.autocast(bfloat16)`, the residual stream in bfloat16, the loss in float32, gradient clipping by global norm,
fused AdamW on the library's warm-up + cosine schedule with no weight decay on norm scales. It starts from the
library's initial parameters (`load_library_params`), so its step-0 loss is the library's on the same tokens.

Decode (`decode_benchmark`, at gpt-fast's strength): `Decoder`, the same Llama with bfloat16 weights held as a
PyTorch user tuning decode holds them: q, k and v in one weight and gate and up in one (4 GEMMs per layer, not 7), a
static KV cache per layer ([B, K, T, E] buffers of a fixed shape, the new keys and values written in place with
`index_copy_` at the decoded position), attention as two batched matmuls over the cache with each kv head's query
heads as its rows (no copy of the cache per query head) and a float32 softmax masked up to the position. The whole
step (embedding to the next token, greedy) is one `torch.compile(mode="reduce-overhead", fullgraph=True)` graph, run
as one CUDA graph; the position is a device tensor, so a new position replays the same graph instead of compiling
another. The benchmark reports the compile time, the compiles a second position caused (0), inductor's count of
steps it could not capture as CUDA graphs (0), and from a profile of a few steps the CUDA graph launches per step (1)
and the kernels launched outside a graph per step (0).

Both use the library's rotary embedding (rotate-half over E / 2 frequencies, in float32) and the library's formulas
for what they report: bench_mfu's tokens / s and FLOP accounting (applied by the caller), bench_decode's bytes per
step (`decode_bytes`). torch is imported here only; the benchmarks load this module lazily
(`starscream_jax.benchmarks.harness.torch_peers`) and only where torch is present.
"""
from __future__ import annotations

import contextlib
import math
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


class Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.wq = nn.Linear(config.d_model, self.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.d_model, self.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.d_model, self.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.heads * self.head_dim, config.d_model, bias=False)

    def forward(self, x_BSD, cos_SE, sin_SE):
        batch, seq, _ = x_BSD.shape
        q = rotate(self.wq(x_BSD).view(batch, seq, self.heads, self.head_dim), cos_SE, sin_SE)
        k = rotate(self.wk(x_BSD).view(batch, seq, self.kv_heads, self.head_dim), cos_SE, sin_SE)
        v = self.wv(x_BSD).view(batch, seq, self.kv_heads, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, N, S, E]
        group = self.heads // self.kv_heads  # causal self-attention, kv heads repeated to their query heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out_BHSE = F.scaled_dot_product_attention(q, k, v, is_causal=True)
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

    def forward(self, x, cos, sin):
        x = x + self.attention(rms_norm(x, self.attn_norm, self.eps), cos, sin)
        return x + self.mlp(rms_norm(x, self.mlp_norm, self.eps))


class Llama(nn.Module):
    """The library's Llama (`model.decoder.Transformer` without the options this peer does not implement): logits
    [B, S, V] float32 of tokens [B, S], the residual stream in `config.dtype`."""

    def __init__(self, config):
        super().__init__()
        self.check_supported(config)
        self.config = config
        self.embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.final_norm = nn.Parameter(torch.ones(config.d_model))
        self.lm_head = None if config.tie_embeddings else nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.remat = config.remat not in (False, "none")

    @staticmethod
    def check_supported(config) -> None:
        """Refuses a configuration with what this plain Llama lacks (biases, q/k norms, rope scaling, experts)."""
        unsupported = [name for name in ("qkv_bias", "qk_norm", "rope_scaling") if getattr(config, name, None)]
        if unsupported or getattr(config, "n_experts", 0):
            raise ValueError(f"model {config.name}: the PyTorch peer implements the plain Llama; it lacks "
                             f"{', '.join(unsupported or ['experts'])}")

    def forward(self, tokens_BS):
        dtype = getattr(torch, self.config.dtype)
        x = self.embedding(tokens_BS).to(dtype)
        cos, sin = rope_tables(self.config, torch.arange(tokens_BS.shape[1], device=tokens_BS.device))
        for layer in self.layers:
            if self.remat and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, use_reentrant=False)
            else:
                x = layer(x, cos, sin)
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




class DecodeLayer(nn.Module):
    """One block of `Decoder` for a batch of B sequences: q | k | v as one weight [(H + 2K) E, D], gate | up as one
    [2F, D] (nn.Linear's [out, in]), and this layer's static cache, keys and values [B, K, T, E] (random, never
    zeros: real reads), written in place at the decoded position."""

    def __init__(self, config, batch: int, cache_length: int):
        super().__init__()
        D, H, K, E = config.d_model, config.n_heads, config.n_kv_heads, config.head_dim
        self.heads, self.kv_heads, self.head_dim, self.eps = H, K, E, config.norm_eps
        self.attn_norm = nn.Parameter(torch.ones(D))
        self.wqkv = nn.Linear(D, (H + 2 * K) * E, bias=False)
        self.wo = nn.Linear(H * E, D, bias=False)
        self.mlp_norm = nn.Parameter(torch.ones(D))
        self.w_gate_up = nn.Linear(D, 2 * config.d_ff, bias=False)
        self.w_down = nn.Linear(config.d_ff, D, bias=False)
        self.register_buffer("k_cache", None, persistent=False)
        self.register_buffer("v_cache", None, persistent=False)
        self.new_cache(batch, cache_length)

    def new_cache(self, batch: int, cache_length: int) -> None:
        """Replaces the cache by a random one of `batch` sequences (the old one freed first)."""
        shape = (batch, self.kv_heads, cache_length, self.head_dim)
        device, dtype = self.wo.weight.device, self.wo.weight.dtype
        self.k_cache = self.v_cache = None
        self.k_cache = torch.randn(shape, device=device, dtype=dtype)
        self.v_cache = torch.randn(shape, device=device, dtype=dtype)

    def forward(self, x_B1D, cos_1E, sin_1E, position_1, visible_T):
        """x [B, 1, D] at `position_1` [1] (a device tensor) -> [B, 1, D]; `visible_T` [T] bool: the cached
        positions attention reads (those up to the position)."""
        B, H, K, E = x_B1D.shape[0], self.heads, self.kv_heads, self.head_dim
        q, k, v = self.wqkv(rms_norm(x_B1D, self.attn_norm, self.eps)).split((H * E, K * E, K * E), dim=-1)
        q_B1HE = rotate(q.view(B, 1, H, E), cos_1E, sin_1E)
        k_B1KE = rotate(k.view(B, 1, K, E), cos_1E, sin_1E)
        self.k_cache.index_copy_(2, position_1, k_B1KE.transpose(1, 2))
        self.v_cache.index_copy_(2, position_1, v.view(B, 1, K, E).transpose(1, 2))
        out_BKGE = cached_attention(q_B1HE.view(B, K, H // K, E), self.k_cache, self.v_cache, visible_T)
        x_B1D = x_B1D + self.wo(out_BKGE.reshape(B, 1, H * E))
        gate, up = self.w_gate_up(rms_norm(x_B1D, self.mlp_norm, self.eps)).chunk(2, dim=-1)
        return x_B1D + self.w_down(F.silu(gate) * up)


def cached_attention(q_BKGE: torch.Tensor, k_BKTE: torch.Tensor, v_BKTE: torch.Tensor,
                     visible_T: torch.Tensor) -> torch.Tensor:
    """One decoded token's attention [B, K, G, E]: each kv head's G query heads as the rows of two batched matmuls
    over that head's cache [B, K, T, E] (read once, in place: no copy per query head), the softmax in float32 over
    the visible positions."""
    scores_BKGT = torch.matmul(q_BKGE * q_BKGE.shape[-1] ** -0.5, k_BKTE.transpose(-1, -2))
    scores_BKGT = scores_BKGT.float().masked_fill(~visible_T, float("-inf"))
    return torch.matmul(torch.softmax(scores_BKGT, dim=-1).to(q_BKGE.dtype), v_BKTE)


class Decoder(nn.Module):
    """The library's Llama for decode at gpt-fast's strength (module docstring): `logits` of one token per sequence
    at a position, every layer's cache written in place."""

    def __init__(self, config, batch: int, cache_length: int):
        super().__init__()
        Llama.check_supported(config)
        self.config = config
        self.embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(DecodeLayer(config, batch, cache_length) for _ in range(config.n_layers))
        self.final_norm = nn.Parameter(torch.ones(config.d_model))
        self.lm_head = None if config.tie_embeddings else nn.Linear(config.d_model, config.vocab_size, bias=False)

    def new_cache(self, batch: int, cache_length: int) -> None:
        for layer in self.layers:
            layer.new_cache(batch, cache_length)

    def logits(self, token_B1: torch.Tensor, position_1: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] float32 of tokens [B, 1] at `position_1` [1] (int64, on the device)."""
        x_B1D = self.embedding(token_B1)
        cos, sin = rope_tables(self.config, position_1)
        visible_T = torch.arange(self.layers[0].k_cache.shape[2], device=position_1.device) <= position_1
        for layer in self.layers:
            x_B1D = layer(x_B1D, cos, sin, position_1, visible_T)
        x_BD = rms_norm(x_B1D[:, 0], self.final_norm, self.config.norm_eps)
        head = self.embedding.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(x_BD, head).float()


def fuse_from(decoder: Decoder, llama: Llama) -> None:
    """Copies the weights of `llama` (the training peer's modules) into `decoder`, q | k | v and gate | up stacked
    along the output dimension."""
    with torch.no_grad():
        decoder.embedding.weight.copy_(llama.embedding.weight)
        decoder.final_norm.copy_(llama.final_norm)
        if decoder.lm_head is not None:
            decoder.lm_head.weight.copy_(llama.lm_head.weight)
        for mine, theirs in zip(decoder.layers, llama.layers):
            attention, mlp = theirs.attention, theirs.mlp
            mine.attn_norm.copy_(theirs.attn_norm)
            mine.mlp_norm.copy_(theirs.mlp_norm)
            mine.wqkv.weight.copy_(torch.cat([attention.wq.weight, attention.wk.weight, attention.wv.weight]))
            mine.wo.weight.copy_(attention.wo.weight)
            mine.w_gate_up.weight.copy_(torch.cat([mlp.w_gate.weight, mlp.w_up.weight]))
            mine.w_down.weight.copy_(mlp.w_down.weight)


def decode_step(model: Decoder, token_B1: torch.Tensor, position_1: torch.Tensor) -> torch.Tensor:
    """The next token [B, 1] (greedy) after `token_B1` at `position_1`, the caches written in place: the function
    compiled whole."""
    return torch.argmax(model.logits(token_B1, position_1), dim=-1, keepdim=True)


def decode_bytes(model: Decoder, batch: int, cache_length: int) -> dict:
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


def compiled_graphs() -> int:
    """Graphs torch.compile has compiled in this process (dynamo's count)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def cudagraph_skips() -> int:
    """Compiled graphs inductor ran without a CUDA graph (reduce-overhead could not capture them)."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


def launches_per_step(step, state, steps: int) -> dict:
    """From a torch.profiler trace of `steps` more steps: CUDA graph launches and kernel launches outside a graph,
    per step (a step captured whole launches one graph and no kernel)."""
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as trace:
            for _ in range(steps):
                state, _ = step(state)
            torch.cuda.synchronize()
        names = [event.name for event in trace.events()]
    except Exception as error:  # noqa: BLE001 - a profiler that fails leaves the timing standing
        return {"profile_error": f"{type(error).__name__}: {error}"[:300]}
    return {"graph_launches_per_step": sum("GraphLaunch" in name for name in names) / steps,
            "kernel_launches_per_step": sum("LaunchKernel" in name for name in names) / steps}


def decode_benchmark(model_config, batches: list[int], cache_length: int, *, warmup: int, steps: int,
                     device: str = "cuda", compile_mode: str | None = "reduce-overhead", tuned: bool = True,
                     profile_steps: int = 5) -> list[dict]:
    """Time the gpt-fast-strength decode step (`Decoder`, `decode_step` compiled whole) at each batch size
    against a full cache of `cache_length` positions (random bfloat16 weights and cache, decoding at the last
    position, as bench_decode does). `tuned`: inductor's coordinate-descent tuning of its kernels, as gpt-fast
    turns on (longer compiles).

    Each row: batch, cache_length, compile_s (the first step's wall time: tracing, compiling, running),
    capture_s (the next two steps': CUDA graph trees warm up, then record), recompiles_at_new_position (graphs
    compiled when the same step ran at another position: 0 where the position is data), cudagraph_skips (0 where
    every compiled graph runs as a CUDA graph), graph_launches_per_step and kernel_launches_per_step (from a
    profile of `profile_steps` steps, on CUDA), step_s, tokens_per_s, bytes_per_step (`decode_bytes`) and
    bandwidth_bytes_per_s."""
    config = model_config.replace(dtype="bfloat16")
    if tuned and device == "cuda":
        import torch._inductor.config as inductor_config

        inductor_config.coordinate_descent_tuning = True
    with torch.device(device), default_dtype(torch.bfloat16):
        torch.manual_seed(0)
        model = Decoder(config, batches[0], cache_length).eval().requires_grad_(False)
    decode = torch.compile(decode_step, mode=compile_mode, fullgraph=True, dynamic=False) if compile_mode \
        else decode_step
    sync = synchronizer(device)
    rows = []
    for batch in batches:
        model.new_cache(batch, cache_length)
        last = torch.tensor([cache_length - 1], device=device)
        token = torch.randint(config.vocab_size, (batch, 1), device=device)

        def step(token, position=last):
            return decode(model, token, position).clone(), None  # a CUDA graph's output is overwritten next replay

        with torch.no_grad():
            skips = cudagraph_skips()
            start = time.perf_counter()
            token, _ = step(token)
            sync(None)
            compile_s = time.perf_counter() - start
            start = time.perf_counter()
            for _ in range(2):
                token, _ = step(token)
            sync(None)
            capture_s = time.perf_counter() - start
            graphs = compiled_graphs()
            token, _ = step(token, torch.tensor([cache_length - 2], device=device))
            sync(None)
            recompiles = compiled_graphs() - graphs
            timed = harness.timed_steps(step, token, warmup=max(warmup - 3, 0), steps=steps, sync=sync)
            read = decode_bytes(model, batch, cache_length)
            row = {"name": DECODE_NAME, "batch": batch, "cache_length": cache_length, "compile_s": compile_s,
                   "capture_s": capture_s, "recompiles_at_new_position": recompiles,
                   "cudagraph_skips": cudagraph_skips() - skips, "step_s": timed.seconds_per_step,
                   "tokens_per_s": batch / timed.seconds_per_step, "bytes_per_step": read,
                   "bandwidth_bytes_per_s": sum(read.values()) / timed.seconds_per_step}
            print(graph_line(row), flush=True)  # before the profile: its figures stand whatever the profiler does
            if device == "cuda":
                row.update(launches_per_step(step, timed.state, profile_steps))
                print(launches_line(row), flush=True)
        rows.append(row)
    del model, decode
    torch._dynamo.reset()  # the CUDA graphs' memory pool goes with the compiled step
    release_memory(device)
    return rows


def graph_line(row: dict) -> str:
    """The peer's compile and capture figures and its speed for one batch, printed beside the benchmark's table."""
    return (f"{row['name']} batch {row['batch']}: compile {row['compile_s']:.1f} s, capture {row['capture_s']:.2f} s, "
            f"{row['recompiles_at_new_position']} recompiles at a new position, {row['cudagraph_skips']} graphs "
            f"not captured as CUDA graphs; {1e3 * row['step_s']:.2f} ms/step, "
            f"{row['bandwidth_bytes_per_s'] / 1e12:.2f} TB/s")


def launches_line(row: dict) -> str:
    """What the profile of a few steps saw (`launches_per_step`)."""
    if "profile_error" in row:
        return f"{row['name']} batch {row['batch']}: the profile failed ({row['profile_error']})"
    return (f"{row['name']} batch {row['batch']}: per step {row['graph_launches_per_step']:.1f} CUDA graph launches, "
            f"{row['kernel_launches_per_step']:.1f} kernel launches outside a graph (profile of a few steps)")
