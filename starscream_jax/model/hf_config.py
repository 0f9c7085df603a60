"""Hugging Face `config.json` <-> `ModelConfig`, for the Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE and Gemma 2
families.

Reading accepts both spellings of the rotary settings (`rope_theta` and `rope_scaling`, or the newer
`rope_parameters`). A field that would change the computation and that the decoder does not implement (another
rope type, an attention or MLP bias, a different activation, ...) is a `CheckpointError` naming the field and its
value, never a quietly different model. Mistral's and Mixtral's `sliding_window` is a true sliding window on every
layer, as transformers applies it, and Gemma 2's one on the layers its `layer_types` names
(`ModelConfig.sliding_layers`); a window no shorter than `max_position_embeddings` is none. The Qwen families'
`use_sliding_window` is refused (their window covers some layers by `max_window_layers`, which transformers
versions read differently); where such a config names a window without asking for it, the window cuts
`max_seq_len` (inside it attention is fully causal).
"""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import CheckpointError
from .config import ModelConfig

FAMILIES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
            "gemma2": "Gemma2ForCausalLM"}
"""model_type -> the architecture name config.json gives it."""
CONFIG_FILE = "config.json"
QKV_BIAS = {"llama": False, "mistral": False, "qwen2": True, "qwen3": False, "mixtral": False, "qwen3_moe": False,
            "gemma2": False}
"""Whether each family's q, k, v projections carry biases (Qwen2's always do, whatever `attention_bias` says; in
the others `attention_bias` would add them to the output projection too, which is refused)."""
WIDTH_FIELD = {"qwen3_moe": "moe_intermediate_size"}
"""The field holding d_ff where it is not intermediate_size (Qwen3-MoE's intermediate_size is the width of dense
layers, which only a non-empty mlp_only_layers would have)."""


EVERY_LAYER_SLIDES = ("mistral", "mixtral")
"""The families whose `sliding_window` (when shorter than the positions) slides on every layer."""
GEMMA2_DEFAULTS = {"head_dim": 256, "max_position_embeddings": 8192, "tie_word_embeddings": True,
                   "query_pre_attn_scalar": 256, "sliding_window": 4096, "attn_logit_softcapping": 50.0,
                   "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh"}
"""What transformers' Gemma2Config takes for a field config.json leaves out (a null soft-capping or window is
none)."""
GEMMA2_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")
"""Gemma 2's `hidden_activation` values that are GELU's tanh approximation (`ModelConfig.mlp_activation`
"gelu_tanh")."""
LAYER_TYPES = {"full_attention": False, "sliding_attention": True}
"""Gemma 2's `layer_types` entries: whether the layer attends through the sliding window."""


def read_hf_config(model_dir: str | Path) -> dict:
    """The parsed `config.json` of a checkpoint directory."""
    path = Path(model_dir) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{path} not found; pass a Hugging Face model directory holding config.json")
    return read_json_object(path, "model fields")


def read_json_object(path: Path, holding: str) -> dict:
    """The JSON object in the checkpoint file `path` (an object of `holding`, for the error); CheckpointError in one
    line, naming the file, when it is not UTF-8, not JSON or not an object."""
    try:
        raw = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        raise CheckpointError(f"{path}: byte {err.start} is not UTF-8; {path.name} must be UTF-8 JSON") from None
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path} is not valid JSON ({err}); fix or replace the file") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} holds a JSON {type(raw).__name__}, not an object of {holding}; fix or "
                              "replace the file")
    return raw


def _whole(raw: dict, field: str, where: str, default=None) -> int:
    """config.json's `field` when it is a positive whole number; `default` when absent (or null) and a default is
    given, else a CheckpointError naming the field."""
    value = raw.get(field)
    if value is None and default is not None:
        return default
    if value is None:
        raise CheckpointError(f"{where} lacks {field!r}; a Hugging Face config.json gives it as a whole number")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CheckpointError(f"{where}: {field} = {value!r}; expected a whole number of at least 1")
    return value


def _flag(raw: dict, field: str, where: str) -> bool:
    """config.json's `field` when it is true or false (False when absent or null)."""
    value = raw.get(field)
    if value is not None and not isinstance(value, bool):
        raise CheckpointError(f"{where}: {field} = {value!r}; expected true or false")
    return bool(value)


def _number(raw: dict, field: str, where: str, default: float | None) -> float:
    """config.json's `field` as a float (finite, above zero), `default` when absent (an error when None)."""
    value = raw.get(field, default)
    if value is None and default is not None:
        return default
    if value is None:
        raise CheckpointError(f"{where} lacks {field!r}; give it as a number")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise CheckpointError(f"{where}: {field} = {value!r}; expected a finite number above zero")
    return float(value)


def model_config_from_hf(model_dir: str | Path, **overrides) -> ModelConfig:
    """The ModelConfig that `model_dir/config.json` describes (keyword overrides win, e.g. dtype="bfloat16")."""
    raw = read_hf_config(model_dir)
    where = f"{Path(model_dir) / CONFIG_FILE}"
    family = raw.get("model_type")
    if not isinstance(family, str) or family not in FAMILIES:
        raise CheckpointError(f"{where}: model_type {family!r} is not supported; supported: {', '.join(FAMILIES)}")
    if family == "gemma2":
        raw = {**GEMMA2_DEFAULTS, **raw}
    try:
        _refuse_unimplemented(raw, family, where)
        fields = _model_fields(raw, family, where)
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as err:  # a nested field of the wrong shape
        raise CheckpointError(f"{where}: malformed field ({type(err).__name__}: {err}); fix or replace the "
                              "file") from None
    return ModelConfig(**{**fields, "name": Path(model_dir).resolve().name, **overrides})


def _model_fields(raw: dict, family: str, where: str) -> dict:
    """ModelConfig's fields (but the name) from a parsed config.json of `family`, each value checked."""
    heads, d_model = _whole(raw, "num_attention_heads", where), _whole(raw, "hidden_size", where)
    fields = dict(
        vocab_size=_whole(raw, "vocab_size", where), d_model=d_model,
        n_layers=_whole(raw, "num_hidden_layers", where), n_heads=heads,
        n_kv_heads=_whole(raw, "num_key_value_heads", where, heads),
        head_dim=_whole(raw, "head_dim", where, d_model // heads),
        d_ff=_whole(raw, WIDTH_FIELD.get(family, "intermediate_size"), where),
        max_seq_len=_max_seq_len(raw, where, family not in ("gemma2", *EVERY_LAYER_SLIDES)),
        norm_eps=_number(raw, "rms_norm_eps", where, 1e-6),
        tie_embeddings=_flag(raw, "tie_word_embeddings", where),
        qkv_bias=QKV_BIAS[family], qk_norm=family in ("qwen3", "qwen3_moe"), dtype=_compute_dtype(raw),
        **_rope_fields(raw, where), **quantization_fields(raw.get("quantization_config"), where))
    if family in EVERY_LAYER_SLIDES:
        fields.update(_every_layer_window(raw, fields["n_layers"], fields["max_seq_len"], where))
    if family == "mixtral":
        fields.update(n_experts=_whole(raw, "num_local_experts", where),
                      experts_per_token=_whole(raw, "num_experts_per_tok", where))
    if family == "qwen3_moe":
        experts = raw.get("num_experts") and _whole(raw, "num_experts", where)
        fields.update(n_experts=experts or _whole(raw, "num_local_experts", where),
                      experts_per_token=_whole(raw, "num_experts_per_tok", where),
                      normalize_gates=_flag(raw, "norm_topk_prob", where),
                      load_balance_weight=float(raw.get("router_aux_loss_coef") or 0.0))
    if family == "gemma2":
        fields.update(_gemma2_fields(raw, fields["n_layers"], where))
    return fields


def _every_layer_window(raw: dict, n_layers: int, positions: int, where: str) -> dict:
    """Mistral's and Mixtral's sliding window (sliding_window, sliding_layers): on every layer where it is shorter
    than the positions, else none."""
    window = _whole(raw, "sliding_window", where, 0)
    return dict(sliding_window=window, sliding_layers=tuple(range(n_layers))) if 0 < window < positions else {}


def _gemma2_fields(raw: dict, n_layers: int, where: str) -> dict:
    """Gemma 2's departures from Llama (raw with GEMMA2_DEFAULTS filled in): GeGLU, (1 + weight) norms, the norms
    after attention and the MLP, the embedding scaled by sqrt(d_model), soft-capped attention scores and logits,
    `query_pre_attn_scalar` as the attention scale, and the sliding window of the layers `layer_types` names."""
    kinds = raw.get("layer_types")
    if kinds is None:  # transformers' default: the even layers slide
        kinds = ["sliding_attention" if layer % 2 == 0 else "full_attention" for layer in range(n_layers)]
    if not isinstance(kinds, list) or len(kinds) != n_layers or any(kind not in LAYER_TYPES for kind in kinds):
        raise CheckpointError(f"{where}: layer_types = {kinds!r}; expected {n_layers} entries, each one of "
                              f"{', '.join(LAYER_TYPES)}")
    sliding = tuple(layer for layer, kind in enumerate(kinds) if LAYER_TYPES[kind])
    window = _whole(raw, "sliding_window", where, 0) if sliding else 0
    if sliding and not window:
        raise CheckpointError(f"{where}: layer_types names sliding_attention layers but sliding_window is null; "
                              "give the window")
    return dict(mlp_activation="gelu_tanh", norm_plus_one=True, post_norms=True, scale_embedding=True,
                attn_softcap=_cap(raw, "attn_logit_softcapping", where),
                logit_softcap=_cap(raw, "final_logit_softcapping", where),
                query_pre_attn_scalar=_number(raw, "query_pre_attn_scalar", where, None),
                sliding_window=window, sliding_layers=sliding if window else ())


def _cap(raw: dict, field: str, where: str) -> float:
    """A soft-capping field: its value (a number above zero), or 0 (none) where it is null."""
    return 0.0 if raw.get(field) is None else _number(raw, field, where, None)


def _compute_dtype(raw: dict) -> str:
    """The compute dtype a checkpoint runs in, as its users run it: its `torch_dtype` (or, in newer files, `dtype`)
    where that is bfloat16, else float32 (float16 and unnamed ones: the model's float32 default). Training keeps
    float32 master weights either way (`training.loop`)."""
    stored = raw.get("torch_dtype") or raw.get("dtype")
    return "bfloat16" if stored == "bfloat16" else "float32"


QUANTIZATION_METHOD = "compressed-tensors"
"""The one `quantization_config.quant_method` read: fp8 (float8_e4m3fn) weights of every layer's projections with a
`weight_scale` per output channel or per tensor (format "float-quantized"), the output head left in float."""


def quantization_fields(quantization: dict | None, where: str) -> dict:
    """The ModelConfig fields (weight_format, weight_scales) of a checkpoint's `quantization_config`; none for a
    float checkpoint. Any other scheme is a CheckpointError naming it. The activations' own quantization (their
    `input_activations`) is not applied: the 8-bit weights multiply activations in the compute dtype."""
    if quantization is None:
        return {}
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    if method != QUANTIZATION_METHOD:
        raise CheckpointError(f"{where}: quantization_config quant_method {method!r} is not implemented; only "
                              f"{QUANTIZATION_METHOD} fp8 checkpoints load (or load a bf16 checkpoint with --quantize)")
    groups = list((quantization.get("config_groups") or {}).values())
    weights = (groups[0].get("weights") or {}) if len(groups) == 1 else {}
    expected = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}
    wrong = {key: weights.get(key) for key, value in expected.items() if weights.get(key) != value}
    if len(groups) != 1 or wrong or weights.get("strategy") not in ("channel", "tensor"):
        raise CheckpointError(f"{where}: quantization_config {quantization.get('format')!r} with weights "
                              f"{weights or groups} is not implemented; only one group of symmetric static 8-bit float "
                              f"weights with strategy 'channel' or 'tensor' loads")
    if quantization.get("format") != "float-quantized" or quantization.get("kv_cache_scheme"):
        raise CheckpointError(f"{where}: quantization_config format {quantization.get('format')!r} / kv_cache_scheme "
                              f"{quantization.get('kv_cache_scheme')!r} is not implemented; only 'float-quantized' "
                              f"weights with no kv_cache_scheme load (choose an 8-bit cache with --kv-cache)")
    if list(quantization.get("ignore") or []) != ["lm_head"]:
        raise CheckpointError(f"{where}: quantization_config ignore = {quantization.get('ignore')!r}; only "
                              f"checkpoints whose every layer is quantized and whose lm_head is not (['lm_head']) load")
    return {"weight_format": "float8_e4m3fn", "weight_scales": weights["strategy"]}


def _refuse_unimplemented(raw: dict, family: str, where: str) -> None:
    """A CheckpointError for the first field whose value would make the reference compute something else."""
    unsupported = {
        "hidden_act": lambda v: v not in ("silu", None) and family != "gemma2",  # Gemma 2 reads hidden_activation
        "hidden_activation": lambda v: family == "gemma2" and v not in GEMMA2_ACTIVATIONS,
        "use_bidirectional_attention": lambda v: bool(v),
        "mlp_bias": lambda v: bool(v),
        "attention_bias": lambda v: bool(v) and not QKV_BIAS[family],
        "use_sliding_window": lambda v: bool(v) and family in ("qwen2", "qwen3", "qwen3_moe"),
        "decoder_sparse_step": lambda v: family == "qwen3_moe" and v != 1,
        "mlp_only_layers": lambda v: bool(v),
        "shared_expert_intermediate_size": lambda v: bool(v),
        "n_shared_experts": lambda v: bool(v),
        "num_shared_experts": lambda v: bool(v),
        "pretraining_tp": lambda v: v not in (None, 1),
        "router_jitter_noise": lambda v: bool(v),
        "layer_types": lambda v: family != "gemma2" and any(kind != _every_layer_kind(raw, family) for kind in v or ()),
    }
    for field, refused in unsupported.items():
        if field in raw and refused(raw[field]):
            raise CheckpointError(f"{where}: {field} = {raw[field]!r} is not implemented for {family}; only the "
                                  f"computation of the standard {FAMILIES[family]} is")


def _every_layer_kind(raw: dict, family: str) -> str:
    """The `layer_types` entry every layer of a family other than Gemma 2 must have: "sliding_attention" where
    Mistral's or Mixtral's window is given, else "full_attention"."""
    return "sliding_attention" if family in EVERY_LAYER_SLIDES and raw.get("sliding_window") else "full_attention"


def _max_seq_len(raw: dict, where: str, window_cuts: bool = True) -> int:
    """max_position_embeddings, cut to an active sliding window where `window_cuts` (inside the window attention is
    fully causal; Gemma 2 runs its window instead)."""
    length = _whole(raw, "max_position_embeddings", where, 2048)
    window = (_whole(raw, "sliding_window", where, 0) if raw.get("use_sliding_window", True) and window_cuts
              else None)
    return min(length, window) if window else length


def _rope_fields(raw: dict, where: str) -> dict:
    """rope_theta and the linear or llama3 scaling fields, from `rope_parameters` or `rope_theta` + `rope_scaling`."""
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise CheckpointError(f"{where}: rope settings {rope!r} are not an object; give rope_scaling as "
                              "{\"rope_type\": ..., ...} or null")
    theta = _number(rope, "rope_theta", where, _number(raw, "rope_theta", where, 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return {"rope_theta": theta}
    scaling = f"{where} (rope settings)"
    if kind == "linear":
        return {"rope_theta": theta, "rope_scaling": "linear", "rope_factor": _number(rope, "factor", scaling, None)}
    if kind != "llama3":
        raise CheckpointError(f"{where}: rope type {kind!r} is not implemented; supported: default, linear, llama3")
    return {"rope_theta": theta, "rope_scaling": "llama3", "rope_factor": _number(rope, "factor", scaling, None),
            "rope_low_freq_factor": _number(rope, "low_freq_factor", scaling, None),
            "rope_high_freq_factor": _number(rope, "high_freq_factor", scaling, None),
            "rope_original_max_len": _whole(rope, "original_max_position_embeddings", scaling)}


GEMMA2_FEATURES = {"mlp_activation": "gelu_tanh", "norm_plus_one": True, "post_norms": True, "scale_embedding": True}
"""The ModelConfig fields that make a Gemma 2, all four together."""


def family_of(config: ModelConfig) -> str:
    """The model_type whose computation `config` is: gemma2 (GEMMA2_FEATURES), qwen3_moe (experts and q/k norms),
    mixtral (experts, gates renormalised), qwen3 (q/k norms), qwen2 (q/k/v biases), mistral (head_dim other than
    d_model / heads, or a sliding window on every layer) or llama. Gemma 2's other features (soft-capping, attention
    scale, a window on some layers) exist in no other family."""
    gemma = {field: getattr(config, field) == value for field, value in GEMMA2_FEATURES.items()}
    gemma_only = {"attn_softcap": config.attn_softcap, "logit_softcap": config.logit_softcap,
                  "query_pre_attn_scalar": config.query_pre_attn_scalar}
    every_layer = config.sliding_window and set(config.sliding_layers) == set(range(config.n_layers))
    if any(gemma.values()) or any(gemma_only.values()) or (config.sliding_window and not every_layer):
        gemma_only["sliding_window"] = config.sliding_window
        others = {"qkv_bias": config.qkv_bias, "qk_norm": config.qk_norm, "n_experts": config.n_experts,
                  "rope_scaling": config.rope_scaling}
        if not all(gemma.values()) or any(others.values()):
            raise CheckpointError(f"model {config.name}: {_fields_text(config, GEMMA2_FEATURES)} with "
                                  f"{_fields_text(config, {**gemma_only, **others})} is no Hugging Face family; "
                                  f"Gemma 2 is {GEMMA2_FEATURES} with none of {sorted(others)}")
        return "gemma2"
    family = _family_without_gemma(config)
    if not config.sliding_window:
        return family
    if family not in ("llama", *EVERY_LAYER_SLIDES):
        raise CheckpointError(f"model {config.name}: a sliding window on every layer with {family}'s q/k norms or "
                              f"q/k/v biases is no Hugging Face family; Mistral and Mixtral slide on every layer "
                              f"(drop the window, or the norms and biases)")
    return "mixtral" if family == "mixtral" else "mistral"


INTERCHANGEABLE = ("llama", "mistral")
"""Families that compute the same model (a head_dim of its own, llama3 rotary scaling) but for Mistral's window."""


def written_family(config: ModelConfig, source: str | None) -> str:
    """The model_type an export writes: the source checkpoint's where it computes `config` as `family_of` does (a
    Mistral whose head_dim is hidden_size / heads stays a Mistral, a Llama with its own head_dim a Llama), else
    `family_of`'s."""
    family = family_of(config)
    if source in INTERCHANGEABLE and family in INTERCHANGEABLE and (source == "mistral" or not config.sliding_window):
        return source
    return family


def _family_without_gemma(config: ModelConfig) -> str:
    """`family_of` a config that has none of Gemma 2's features."""
    if config.n_experts:
        if config.qk_norm:
            return "qwen3_moe"
        if not config.normalize_gates:
            raise CheckpointError(f"model {config.name}: experts with normalize_gates = false and no q/k norms is "
                                  "no Hugging Face family; set normalize_gates = true (Mixtral) or qk_norm = true "
                                  "(Qwen3-MoE)")
        return "mixtral"
    if config.qk_norm:
        return "qwen3"
    if config.qkv_bias:
        return "qwen2"
    return "mistral" if config.head_dim * config.n_heads != config.d_model else "llama"


def _fields_text(config: ModelConfig, fields) -> str:
    return ", ".join(f"{field} = {getattr(config, field)!r}" for field in fields)


def hf_config_from_model(config: ModelConfig, dtype: str, extra: dict | None = None) -> dict:
    """config.json for `config`, its tensors stored as `dtype`; `extra` (e.g. the source's token ids) is kept
    where it does not contradict, its model_type too where that family computes `config` (`written_family`)."""
    family = written_family(config, (extra or {}).get("model_type"))
    rope = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling == "linear":
        rope = {"rope_type": "linear", "rope_theta": config.rope_theta, "factor": config.rope_factor}
    if config.rope_scaling == "llama3":
        rope = {"rope_type": "llama3", "rope_theta": config.rope_theta, "factor": config.rope_factor,
                "low_freq_factor": config.rope_low_freq_factor, "high_freq_factor": config.rope_high_freq_factor,
                "original_max_position_embeddings": config.rope_original_max_len}
    written = {
        "architectures": [FAMILIES[family]], "model_type": family, "vocab_size": config.vocab_size,
        "hidden_size": config.d_model, "num_hidden_layers": config.n_layers, "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads, "head_dim": config.head_dim, "intermediate_size": config.d_ff,
        "max_position_embeddings": config.max_seq_len, "rms_norm_eps": config.norm_eps, "hidden_act": "silu",
        "tie_word_embeddings": config.tie_embeddings, "attention_bias": config.qkv_bias,
        "rope_theta": config.rope_theta, "rope_scaling": None if rope["rope_type"] == "default" else rope,
        "torch_dtype": dtype, "dtype": dtype, "sliding_window": config.sliding_window or None,
        "use_sliding_window": False,
    }
    if family == "mixtral":
        written.update(num_local_experts=config.n_experts, num_experts_per_tok=config.experts_per_token)
    if family == "qwen3_moe":
        del written["intermediate_size"]  # the width of dense layers: the source's is kept
        written.update(num_experts=config.n_experts, num_experts_per_tok=config.experts_per_token,
                       moe_intermediate_size=config.d_ff, norm_topk_prob=config.normalize_gates,
                       router_aux_loss_coef=config.load_balance_weight, decoder_sparse_step=1, mlp_only_layers=[])
    if family == "gemma2":
        del written["use_sliding_window"]
        slides = set(config.sliding_layers)
        written.update(hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh",
                       query_pre_attn_scalar=config.query_pre_attn_scalar or config.head_dim,
                       attn_logit_softcapping=config.attn_softcap or None,
                       final_logit_softcapping=config.logit_softcap or None,
                       sliding_window=config.sliding_window or None,
                       layer_types=["sliding_attention" if layer in slides else "full_attention"
                                    for layer in range(config.n_layers)])
    kept = {key: value for key, value in (extra or {}).items() if key not in written and key != "rope_parameters"}
    return {**kept, **written}
