"""Model configurations as data: one TOML file per architecture in `models/`, read into `ModelConfig`.

Loading a configuration never allocates the model; `jax.eval_shape` / `nnx.eval_shape` give abstract shapes.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..checks import finite_number, whole_number
from ..errors import PresetError
from .quantize import MATMUL_FORMATS, SCALE_GRANULARITIES, WEIGHT_FORMATS
from .weight_only import IMPLEMENTATIONS as WEIGHT_ONLY_IMPLEMENTATIONS

EIGHT_BIT_MATMULS = ("", *WEIGHT_ONLY_IMPLEMENTATIONS)
"""ModelConfig.eight_bit_matmul's values: "" for the backend's choice, or a `weight_only` implementation."""

REMAT_POLICIES = ("none", "dots", "full")
MLP_ACTIVATIONS = ("silu", "gelu_tanh")
ROPE_SCALINGS = ("", "linear", "llama3")
"""The gated MLP's activation of its gate: SiLU (SwiGLU: Llama, Mistral, Qwen) or the tanh approximation of GELU
(GeGLU: Gemma 2's gelu_pytorch_tanh)."""
"""What the backward pass keeps of each layer's forward: everything ("none": nothing recomputed), the outputs of the
projection matmuls ("dots": norms, rotary, attention and activations recomputed), or only the layer's input ("full":
the whole layer recomputed)."""


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A Llama-family decoder. d_model D, n_heads H query heads of head_dim, n_kv_heads K (H % K == 0), d_ff F (each
    expert's hidden width in a mixture of experts), n_experts X (0 = dense MLP) with experts_per_token routed per
    token: their gates are the router's softmax probabilities of the chosen experts, renormalised to sum to one when
    `normalize_gates` (Mixtral; Qwen3-MoE's norm_topk_prob); `load_balance_weight` times the load-balancing loss is
    added to the training loss (`moe.routed_mlp`).

    qkv_bias: biases on the q, k and v projections (Qwen2). qk_norm: RMSNorm of each query and key head over
    head_dim before the rotary embedding (Qwen3). rope_scaling "llama3": Llama 3.1's frequency-dependent stretch of
    the rotary wavelengths by rope_factor between rope_original_max_len / rope_low_freq_factor and
    rope_original_max_len / rope_high_freq_factor; "linear": every wavelength stretched by rope_factor (positions
    interpolated); "" = plain rotary embedding.

    Gemma 2's differences from Llama, each off by default: mlp_activation "gelu_tanh" (one of MLP_ACTIVATIONS);
    norm_plus_one: every RMSNorm scales by (1 + weight) rather than weight; post_norms: the attention's and the
    MLP's outputs are RMSNormed (weights `attn_post_norm`, `mlp_post_norm`) before they join the residual stream;
    scale_embedding: the embedding's rows are multiplied by sqrt(d_model), rounded to the compute dtype;
    attn_softcap / logit_softcap (0 = none): attention scores and final logits soft-capped as cap * tanh(x / cap);
    query_pre_attn_scalar: attention scores scaled by its inverse square root (0 = head_dim's);
    sliding_window (0 = none): the layers listed in sliding_layers attend to the sliding_window latest positions up
    to their own (a query at position p sees keys at p - sliding_window + 1 .. p), the others to every earlier one.

    remat: one of REMAT_POLICIES (True / False are read as "full" / "none").

    fuse_projections: q, k, v in one GEMM and gate, up in one (the weights stay stored apart; see decoder._qkv).
    scan_unroll: layers per iteration of a rolled layer loop (`jax.lax.scan`'s unroll); 0 (the default) runs the
    layers one after another with no loop in the program, in every phase. A rolled loop costs time where nothing is
    gained from it: in decode XLA copies each layer's weights out of the stacked arrays before its GEMMs read them;
    in training each layer's saved activations are written into [L, ...] arrays zeroed first and copied out again
    for the backward pass (measured in benchmarks/NOTES.md). A rolled loop (1) compiles in a time that does not grow
    with depth: for very deep models whose compile time matters more than the step's.

    weight_format: "" (the projections' weights in `dtype`) or one of quantize.WEIGHT_FORMATS: the layers'
    projections stored in 8 bits with float32 scales per output channel (`weight_scales` "channel") or per layer
    ("tensor"), for inference (`quantize`). kv_format: "" (the KV cache in `dtype`) or one of
    quantize.WEIGHT_FORMATS: keys and values stored in 8 bits with a float32 scale per position and kv head.
    eight_bit_matmul: how decode's projections by 8-bit weights run (a few rows: `model.weight_only`): "" (the
    backend's choice, `hardware.backend.BackendPolicy.eight_bit_matmul`: the Pallas kernel on CUDA, XLA's matmul of
    the converted weights elsewhere), "pallas", "interpret" (the kernel interpreted: CPU tests) or "xla".

    matmul_format: "" (the projections compute in `dtype`) or one of quantize.MATMUL_FORMATS, the e4m3 format of fp8
    training: the q, k, v, o, gate, up and down projections read e4m3 operands and their output gradients in the chip's
    matching e5m2 format, with current per-tensor scales (`quantize.fp8_einsum`); weights stay stored in float32 and the
    embedding, the logits (unless fp8_logits), attention and a mixture's experts compute in `dtype`. For training; it
    excludes weight_format. fp8_logits: with matmul_format, the vocabulary projection reads e4m3 operands and the
    logits' gradient in e5m2 too (off by default, as fp8 recipes keep the head in higher precision: its rounding reaches
    the loss directly; with a large vocabulary its three GEMMs are the largest left in `dtype`).

    vocab_padding: rows of the embedding (and columns of an untied head) past the tokens, zeros added so that the
    layouts' parts divide vocab_size (`model.vocabulary`); their logits are the float minimum."""

    name: str
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    n_experts: int = 0
    experts_per_token: int = 2
    normalize_gates: bool = True
    load_balance_weight: float = 0.0
    dtype: str = "float32"
    remat: str = "none"
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_scaling: str = ""
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    fuse_projections: bool = True
    scan_unroll: int = 0
    weight_format: str = ""
    weight_scales: str = "channel"
    eight_bit_matmul: str = ""
    kv_format: str = ""
    matmul_format: str = ""
    fp8_logits: bool = False
    vocab_padding: int = 0
    mlp_activation: str = "silu"
    norm_plus_one: bool = False
    post_norms: bool = False
    scale_embedding: bool = False
    attn_softcap: float = 0.0
    logit_softcap: float = 0.0
    query_pre_attn_scalar: float = 0.0
    sliding_window: int = 0
    sliding_layers: tuple[int, ...] = ()

    def __post_init__(self):
        if isinstance(self.sliding_layers, list):  # TOML and saved runs give a list
            object.__setattr__(self, "sliding_layers", tuple(self.sliding_layers))
        if isinstance(self.remat, bool):  # older configurations and checkpoints say true / false
            object.__setattr__(self, "remat", "full" if self.remat else "none")
        if self.remat not in REMAT_POLICIES:
            raise PresetError(f"model {self.name}: remat policy {self.remat!r}; use one of {', '.join(REMAT_POLICIES)}")
        self._check_field_types()
        if self.n_heads % self.n_kv_heads:
            raise PresetError(f"model {self.name}: n_heads {self.n_heads} is not a multiple of n_kv_heads "
                              f"{self.n_kv_heads}; grouped-query attention needs whole groups")
        if self.n_experts and not 0 < self.experts_per_token <= self.n_experts:
            raise PresetError(f"model {self.name}: experts_per_token {self.experts_per_token} must be in "
                              f"1..n_experts ({self.n_experts})")
        self._check_load_balance_weight()
        if self.dtype not in ("float32", "bfloat16"):
            raise PresetError(f"model {self.name}: dtype {self.dtype!r}; use 'float32' or 'bfloat16'")
        if self.head_dim % 2:
            raise PresetError(f"model {self.name}: head_dim {self.head_dim} must be even for rotary embeddings")
        for field in ("weight_format", "kv_format"):
            if getattr(self, field) not in ("", *WEIGHT_FORMATS):
                raise PresetError(f"model {self.name}: {field} {getattr(self, field)!r}; use '' (the compute dtype) "
                                  f"or one of {', '.join(WEIGHT_FORMATS)}")
        if self.matmul_format not in ("", *MATMUL_FORMATS):
            raise PresetError(f"model {self.name}: matmul_format {self.matmul_format!r}; use '' (the compute dtype) "
                              f"or one of {', '.join(MATMUL_FORMATS)} (the chip's e4m3 format)")
        if self.matmul_format and self.weight_format:
            raise PresetError(f"model {self.name}: matmul_format {self.matmul_format!r} (fp8 training) with "
                              f"weight_format {self.weight_format!r} (8-bit stored weights); train from float weights")
        if self.fp8_logits and not self.matmul_format:
            raise PresetError(f"model {self.name}: fp8_logits without matmul_format: the vocabulary projection takes "
                              "fp8 training's formats; set matmul_format (train --fp8) or leave fp8_logits off")
        if self.eight_bit_matmul not in EIGHT_BIT_MATMULS:
            raise PresetError(f"model {self.name}: eight_bit_matmul {self.eight_bit_matmul!r}; use one of "
                              f"{', '.join(map(repr, EIGHT_BIT_MATMULS))} ('': the backend's choice)")
        if self.weight_scales not in SCALE_GRANULARITIES:
            raise PresetError(f"model {self.name}: weight_scales {self.weight_scales!r}; use one of "
                              f"{', '.join(SCALE_GRANULARITIES)}")
        if self.rope_scaling not in ROPE_SCALINGS:
            raise PresetError(f"model {self.name}: rope_scaling {self.rope_scaling!r}; use '' (none), 'linear' or "
                              "'llama3'")
        if self.mlp_activation not in MLP_ACTIVATIONS:
            raise PresetError(f"model {self.name}: mlp_activation {self.mlp_activation!r}; use one of "
                              f"{', '.join(MLP_ACTIVATIONS)}")
        self._check_sliding_layers()
        if self.n_experts and self.mlp_activation != "silu":
            raise PresetError(f"model {self.name}: mlp_activation {self.mlp_activation!r} with experts; a mixture of "
                              "experts runs SwiGLU (silu)")

    def _check_sliding_layers(self) -> None:
        """sliding_layers: distinct layer indices, given exactly when there is a sliding window."""
        layers = self.sliding_layers
        if not isinstance(layers, tuple) or any(isinstance(i, bool) or not isinstance(i, int) for i in layers):
            raise PresetError(f"model {self.name}: sliding_layers {layers!r}; give a list of layer indices")
        if any(not 0 <= i < self.n_layers for i in layers) or len(set(layers)) != len(layers):
            raise PresetError(f"model {self.name}: sliding_layers {list(layers)} must be distinct layer indices in "
                              f"0..{self.n_layers - 1}")
        if bool(layers) != bool(self.sliding_window):
            raise PresetError(f"model {self.name}: sliding_window {self.sliding_window} with sliding_layers "
                              f"{list(layers)}; give both (a window and the layers that use it) or neither")

    def _check_load_balance_weight(self) -> None:
        """load_balance_weight is a finite number of at least 0: it multiplies a loss added to the training loss, so a
        string fails deep in the step and a NaN turns every loss NaN."""
        weight = self.load_balance_weight
        real = isinstance(weight, (int, float)) and not isinstance(weight, bool)
        if real and math.isfinite(weight) and weight >= 0:
            return
        problem = "is negative" if real and weight < 0 else "is not a finite number"
        raise PresetError(f"model {self.name}: load_balance_weight {weight!r} {problem}; give 0 (off) or a small "
                          "positive weight such as 0.01")

    def _check_field_types(self) -> None:
        """Sizes are whole numbers of at least 1 (n_experts at least 0), rope_theta, rope_factor, llama3's frequency
        factors (divisors of rope_original_max_len) and norm_eps positive numbers, the flags booleans: a file with a
        wrong type or sign is refused before anything is built from it.
        The name is a non-empty string: every message, table and saved run names the model by it."""
        if not isinstance(self.name, str) or not self.name.strip():
            raise PresetError(f"model name {self.name!r}: expected a non-empty string; write name = \"my-model\"")
        for field in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff", "max_seq_len",
                      "experts_per_token", "rope_original_max_len"):
            whole_number(getattr(self, field), f"model {self.name}: {field}")
        whole_number(self.n_experts, f"model {self.name}: n_experts", minimum=0)
        for field in ("rope_theta", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "norm_eps"):
            finite_number(getattr(self, field), f"model {self.name}: {field}", positive=True)
        for field in ("attn_softcap", "logit_softcap", "query_pre_attn_scalar"):
            finite_number(getattr(self, field), f"model {self.name}: {field}")
        whole_number(self.scan_unroll, f"model {self.name}: scan_unroll", minimum=0)
        whole_number(self.vocab_padding, f"model {self.name}: vocab_padding", minimum=0)
        if self.vocab_padding >= self.vocab_size:
            raise PresetError(f"model {self.name}: vocab_padding {self.vocab_padding} leaves no token of its "
                              f"vocab_size {self.vocab_size}; the padding counts rows past the tokens")
        whole_number(self.sliding_window, f"model {self.name}: sliding_window", minimum=0)
        for field in ("tie_embeddings", "qkv_bias", "qk_norm", "normalize_gates", "fuse_projections", "norm_plus_one",
                      "post_norms", "scale_embedding", "fp8_logits"):
            if not isinstance(getattr(self, field), bool):
                raise PresetError(f"model {self.name}: {field} {getattr(self, field)!r}; use true or false")

    def replace(self, **changes) -> ModelConfig:
        """A copy with `changes`. A new depth (n_layers) without new sliding_layers repeats the sliding pattern by its
        period (`sliding_at_depth`): 2 of Gemma 2's 46 layers, as inspect and plan compile them, are one local and
        one global layer, as the 46 alternate, and the full depth restored from them is the 46 again."""
        if "n_layers" in changes and "sliding_layers" not in changes and self.sliding_layers:
            changes["sliding_layers"] = sliding_at_depth(self.sliding_layers, self.n_layers, changes["n_layers"])
        return dataclasses.replace(self, **changes)

    def num_params(self) -> int:
        """Parameter count (embedding and head counted once each unless tied)."""
        d, f, h, k, hd = self.d_model, self.d_ff, self.n_heads, self.n_kv_heads, self.head_dim
        attention = d * hd * (2 * h + 2 * k)
        attention += (hd * (h + 2 * k) if self.qkv_bias else 0) + (2 * hd if self.qk_norm else 0)
        mlp = 3 * d * f * max(1, self.n_experts) + (d * self.n_experts if self.n_experts else 0)
        embeddings = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        norms = (4 if self.post_norms else 2) * d
        return self.n_layers * (attention + mlp + norms) + embeddings + d

    @property
    def vocab_tokens(self) -> int:
        """The ids that are tokens: vocab_size less the padding rows (`model.vocabulary`)."""
        return self.vocab_size - self.vocab_padding

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 x active matmul parameters + attention (12 L S D_attn), as in the PaLM paper's
        MFU accounting; routed experts count experts_per_token times."""
        d, f, h, k, hd = self.d_model, self.d_ff, self.n_heads, self.n_kv_heads, self.head_dim
        experts = self.experts_per_token if self.n_experts else 1
        per_layer = d * hd * (2 * h + 2 * k) + 3 * d * f * experts
        matmul = self.n_layers * per_layer + self.vocab_size * d
        return 6 * matmul + 12 * self.n_layers * seq_len * h * hd


FIELDS = {f.name: f for f in dataclasses.fields(ModelConfig)}


def sliding_at_depth(layers: tuple[int, ...], depth: int, new_depth: int) -> tuple[int, ...]:
    """The sliding layers among `new_depth` layers that repeat those of `depth` layers (`layers`) by the pattern's
    shortest period (`depth` itself for a pattern that does not repeat: then its first `new_depth` layers)."""
    chosen = set(layers)
    period = next(p for p in range(1, depth + 1) if all((i in chosen) == (i % p in chosen) for i in range(depth)))
    return tuple(i for i in range(new_depth) if i % period in chosen)
