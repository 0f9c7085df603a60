"""config.json -> ModelConfig for each family, both spellings of the rotary settings, refusals of what the decoder
does not compute, and config.json written back."""
import json
import math
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from starscream_jax.analysis.compile import make_settings
from starscream_jax.errors import CheckpointError
from starscream_jax.model.catalog import load_model_config
from starscream_jax.model.decoder import rope, rope_frequencies
from starscream_jax.model.hf_config import family_of, hf_config_from_model, model_config_from_hf, written_family

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "hf"
LLAMA_3_1_8B = {  # the fields of Llama 3.1 8B's config.json (older spelling: rope_theta beside rope_scaling)
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "hidden_act": "silu",
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16",
}


def model_dir(tmp_path, **fields) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA_3_1_8B, **fields}))
    return tmp_path


def test_llama_3_1_8b(tmp_path):
    config = model_config_from_hf(model_dir(tmp_path))
    assert (config.d_model, config.n_heads, config.n_kv_heads, config.head_dim, config.d_ff) == (4096, 32, 8, 128,
                                                                                               14336)
    assert (config.rope_scaling, config.rope_factor, config.rope_original_max_len) == ("llama3", 8.0, 8192)
    assert config.num_params() == 8_030_261_248  # Llama 3.1 8B's published parameter count


@pytest.mark.parametrize("family, features", [
    ("llama", {"tie_embeddings": True, "rope_scaling": "llama3", "qkv_bias": False, "qk_norm": False}),
    ("mistral", {"head_dim": 16, "d_model": 64, "qkv_bias": False}),
    ("qwen2", {"qkv_bias": True, "qk_norm": False}),
    ("qwen3", {"qk_norm": True, "qkv_bias": False, "head_dim": 16}),
    ("mixtral", {"n_experts": 4, "experts_per_token": 2, "normalize_gates": True, "d_ff": 64}),
    ("qwen3_moe", {"n_experts": 8, "experts_per_token": 2, "normalize_gates": False, "d_ff": 32, "qk_norm": True,
                   "load_balance_weight": 0.001}),
    ("gemma2", {"mlp_activation": "gelu_tanh", "norm_plus_one": True, "post_norms": True, "scale_embedding": True,
                "attn_softcap": 8.0, "logit_softcap": 10.0, "query_pre_attn_scalar": 24.0, "sliding_window": 6,
                "sliding_layers": (0,), "tie_embeddings": True, "max_seq_len": 256}),
])
def test_each_fixture_family_reads_with_its_features(family, features):
    config = model_config_from_hf(FIXTURES / family)
    assert {name: getattr(config, name) for name in features} == features
    assert family_of(config) == family
    assert load_model_config(FIXTURES / family) == config
    settings = make_settings(str(FIXTURES / family), "train", 8, 32, "starscream_tp", 2)  # inspect / plan --model
    # the inspector compiles the model as it runs (its own scan_unroll), at the compiled depth
    assert settings.config == config.replace(n_layers=2) and settings.full_layers == config.n_layers


def test_llama3_rope_scaling_stretches_only_the_long_wavelengths(tmp_path):
    """Wavelengths under original / high_freq_factor are kept, over original / low_freq_factor divided by factor."""
    config = model_config_from_hf(model_dir(tmp_path))
    plain = np.asarray(rope_frequencies(config.replace(rope_scaling="")))
    scaled = np.asarray(rope_frequencies(config))
    wavelength = 2 * math.pi / plain
    np.testing.assert_allclose(scaled[wavelength < 8192 / 4], plain[wavelength < 8192 / 4])
    np.testing.assert_allclose(scaled[wavelength > 8192], plain[wavelength > 8192] / 8, rtol=1e-6)
    between = (wavelength > 8192 / 4) & (wavelength < 8192)
    assert between.any() and np.all(scaled[between] < plain[between]) and np.all(scaled[between] > plain[between] / 8)
    assert scaled.dtype == jnp.float32


@pytest.mark.parametrize("rope_scaling", [{"type": "linear", "factor": 4.0}, {"rope_type": "linear", "factor": 4.0}])
def test_linear_rope_scaling_interpolates_the_positions_and_is_written_back(tmp_path, rope_scaling):
    """A linear rope_scaling (either spelling) rotates position p as the plain embedding rotates p / factor, and an
    export writes it back as it was read."""
    config = model_config_from_hf(model_dir(tmp_path, rope_scaling=rope_scaling))
    assert (config.rope_scaling, config.rope_factor) == ("linear", 4.0)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 6, 2, config.head_dim)), jnp.float32)
    positions = jnp.arange(0, 6000, 1000)[None]
    plain = config.replace(rope_scaling="")
    np.testing.assert_allclose(rope(x, positions, rope_frequencies(config)),
                               rope(x, positions / 4.0, rope_frequencies(plain)), atol=2e-3)
    written = hf_config_from_model(config, "bfloat16")["rope_scaling"]
    assert written == {"rope_type": "linear", "rope_theta": config.rope_theta, "factor": 4.0}
    (tmp_path / "again").mkdir()
    assert model_config_from_hf(model_dir(tmp_path / "again", rope_scaling=written)) == config.replace(name="again")


@pytest.mark.parametrize("fields, message", [
    ({"model_type": "gemma3"}, r"model_type 'gemma3' is not supported; supported: llama, mistral, qwen2, qwen3"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, r"rope type 'yarn' is not implemented"),
    ({"mlp_bias": True}, r"mlp_bias = True is not implemented for llama"),
    ({"hidden_act": "gelu"}, r"hidden_act = 'gelu' is not implemented for llama"),
    ({"attention_bias": True}, r"attention_bias = True is not implemented for llama"),
    ({"model_type": "qwen2", "use_sliding_window": True}, r"use_sliding_window = True is not implemented for qwen2"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, r"layer_types = .* is not implemented"),
])
def test_fields_that_would_change_the_computation_are_refused(tmp_path, fields, message):
    with pytest.raises(CheckpointError, match=message):
        model_config_from_hf(model_dir(tmp_path, **fields))


QWEN3_30B_A3B = {  # the fields of Qwen3-30B-A3B's config.json that differ from Llama 3.1 8B's
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "router_aux_loss_coef": 0.001, "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "rope_scaling": None, "use_sliding_window": False,
    "sliding_window": None, "max_window_layers": 48, "output_router_logits": False,
}


@pytest.mark.parametrize("fields, dtype", [({}, "bfloat16"), ({"torch_dtype": None, "dtype": "bfloat16"}, "bfloat16"),
                                           ({"torch_dtype": "float32"}, "float32"), ({"torch_dtype": "float16"},
                                                                                    "float32")])
def test_the_compute_dtype_is_the_checkpoints(tmp_path, fields, dtype):
    """A bf16 checkpoint computes in bf16 unless told (torch_dtype, or dtype in newer files); --dtype overrides."""
    assert model_config_from_hf(model_dir(tmp_path, **fields)).dtype == dtype
    assert model_config_from_hf(model_dir(tmp_path, **fields), dtype="float32").dtype == "float32"


def test_qwen3_30b_a3b_reads_as_the_preset(tmp_path):
    """config.json of Qwen3-30B-A3B is the hand-written models/qwen3-30b-a3b.toml, field for field."""
    config = model_config_from_hf(model_dir(tmp_path, **QWEN3_30B_A3B))
    preset = load_model_config("qwen3-30b-a3b")
    assert config.replace(name=preset.name, dtype=preset.dtype) == preset


@pytest.mark.parametrize("fields, message", [
    ({"decoder_sparse_step": 2}, r"decoder_sparse_step = 2 is not implemented for qwen3_moe"),
    ({"mlp_only_layers": [0, 5]}, r"mlp_only_layers = \[0, 5\] is not implemented for qwen3_moe"),
    ({"shared_expert_intermediate_size": 512}, r"shared_expert_intermediate_size = 512 is not implemented"),
    ({"use_sliding_window": True, "sliding_window": 4096}, r"use_sliding_window = True is not implemented for "
                                                          r"qwen3_moe"),
])
def test_qwen3_moe_features_the_block_lacks_are_refused(tmp_path, fields, message):
    with pytest.raises(CheckpointError, match=message):
        model_config_from_hf(model_dir(tmp_path, **{**QWEN3_30B_A3B, **fields}))


def test_experts_that_no_family_computes_are_refused_at_export():
    """Experts whose gates are not renormalised and without q/k norms are neither Mixtral nor Qwen3-MoE."""
    config = model_config_from_hf(FIXTURES / "mixtral").replace(normalize_gates=False)
    with pytest.raises(CheckpointError, match="normalize_gates = false and no q/k norms is no Hugging Face family"):
        hf_config_from_model(config, "float32")


def test_mistral_and_mixtral_slide_on_every_layer_and_write_their_window_back(tmp_path):
    """Mistral 7B v0.1 (32,768 positions, a window of 4,096): its window slides on every layer, as transformers
    applies it, and the model runs its whole context; config.json written back names the window (and reads back
    alike); a window no shorter than the positions is none; Mixtral likewise; layer_types of every layer sliding
    agree; a window on a Qwen config that does not ask for it still cuts max_seq_len (its use_sliding_window is
    refused)."""
    fields = dict(model_type="mistral", sliding_window=4096, max_position_embeddings=32768, rope_scaling=None)
    config = model_config_from_hf(model_dir(tmp_path, **fields))
    assert (config.max_seq_len, config.sliding_window, config.sliding_layers) == (32768, 4096, tuple(range(32)))
    written = hf_config_from_model(config, "bfloat16")
    assert (written["model_type"], written["sliding_window"], written["max_position_embeddings"]) == (
        "mistral", 4096, 32768)
    (tmp_path / "back").mkdir()
    (tmp_path / "back" / "config.json").write_text(json.dumps(written))
    assert model_config_from_hf(tmp_path / "back").replace(name=config.name) == config
    wide = model_config_from_hf(model_dir(tmp_path, **{**fields, "sliding_window": 32768}))
    assert (wide.max_seq_len, wide.sliding_window, wide.sliding_layers) == (32768, 0, ())
    typed = model_config_from_hf(model_dir(tmp_path, **fields, layer_types=["sliding_attention"] * 32))
    assert typed.sliding_layers == tuple(range(32))
    with pytest.raises(CheckpointError, match="layer_types"):
        model_config_from_hf(model_dir(tmp_path, **fields, layer_types=["full_attention"] * 32))
    mixtral = model_config_from_hf(FIXTURES / "mixtral", sliding_window=6, sliding_layers=(0, 1))
    assert family_of(mixtral) == "mixtral" and hf_config_from_model(mixtral, "float32")["sliding_window"] == 6
    qwen = model_config_from_hf(model_dir(tmp_path, model_type="qwen2", sliding_window=4096, rope_scaling=None))
    assert (qwen.max_seq_len, qwen.sliding_window) == (4096, 0)
    with pytest.raises(CheckpointError, match="sliding window on every layer with qwen3's q/k norms"):
        family_of(model_config_from_hf(FIXTURES / "qwen3").replace(sliding_window=4, sliding_layers=(0, 1)))


def test_a_missing_or_broken_config_is_named(tmp_path):
    with pytest.raises(CheckpointError, match="config.json not found"):
        model_config_from_hf(tmp_path)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(CheckpointError, match="config.json is not valid JSON"):
        model_config_from_hf(tmp_path)


GEMMA_2_2B = {  # the fields of Gemma 2 2B's config.json that differ from Llama 3.1 8B's
    "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "vocab_size": 256000, "hidden_size": 2304,
    "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 256, "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "final_logit_softcapping": 30.0,
    "attn_logit_softcapping": 50.0, "max_position_embeddings": 8192, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
    "rope_scaling": None, "cache_implementation": "hybrid", "torch_dtype": "float32", "tie_word_embeddings": True,
}


def test_gemma_2_2b(tmp_path):
    """Gemma 2 2B's config.json (no layer_types: transformers slides the even layers) and its published parameter
    count; a window shorter than max_position_embeddings stays a window. Fields left out take transformers'
    Gemma 2 defaults."""
    config = model_config_from_hf(model_dir(tmp_path, **GEMMA_2_2B))
    assert config.sliding_layers == tuple(range(0, 26, 2)) and config.sliding_window == 4096
    assert (config.max_seq_len, config.tie_embeddings, config.attn_softcap, config.logit_softcap) == (8192, True,
                                                                                                  50.0, 30.0)
    assert config.num_params() == 2_614_341_888
    assert family_of(config) == "gemma2"
    left_out = ("head_dim", "sliding_window", "attn_logit_softcapping", "tie_word_embeddings")
    (tmp_path / "config.json").write_text(json.dumps({key: value for key, value in GEMMA_2_2B.items()
                                                      if key not in left_out}))
    defaults = model_config_from_hf(tmp_path)
    assert (defaults.head_dim, defaults.sliding_window, defaults.attn_softcap, defaults.tie_embeddings) == (
        256, 4096, 50.0, True)


@pytest.mark.parametrize("fields, message", [
    ({"hidden_activation": "gelu"}, r"hidden_activation = 'gelu' is not implemented for gemma2"),
    ({"layer_types": ["sliding_attention"] * 25}, r"layer_types = .*; expected 26 entries"),
    ({"layer_types": ["local"] * 26}, r"layer_types = .*; expected 26 entries, each one of full_attention"),
    ({"sliding_window": None}, r"layer_types names sliding_attention layers but sliding_window is null"),
    ({"use_bidirectional_attention": True}, r"use_bidirectional_attention = True is not implemented"),
    ({"attention_bias": True}, r"attention_bias = True is not implemented for gemma2"),
])
def test_gemma2_features_the_decoder_lacks_are_refused(tmp_path, fields, message):
    with pytest.raises(CheckpointError, match=message):
        model_config_from_hf(model_dir(tmp_path, **{**GEMMA_2_2B, **fields}))


def test_gemma2_without_windows_or_caps_reads_and_writes_back(tmp_path):
    """Null caps and window, every layer full: Gemma 2's norms, GeGLU and scaled embedding without the rest."""
    config = model_config_from_hf(model_dir(tmp_path, **{
        **GEMMA_2_2B, "attn_logit_softcapping": None, "final_logit_softcapping": None, "sliding_window": None,
        "layer_types": ["full_attention"] * 26}))
    assert (config.attn_softcap, config.logit_softcap, config.sliding_window, config.sliding_layers) == (0, 0, 0, ())
    (tmp_path / "config.json").write_text(json.dumps(hf_config_from_model(config, "float32")))
    assert model_config_from_hf(tmp_path) == config


def test_part_of_gemma2_is_no_family_at_export():
    config = model_config_from_hf(FIXTURES / "gemma2")
    with pytest.raises(CheckpointError, match=r"post_norms = False.* is no Hugging Face family; Gemma 2 is"):
        family_of(config.replace(post_norms=False))
    with pytest.raises(CheckpointError, match=r"qkv_bias = True.* is no Hugging Face family"):
        family_of(config.replace(qkv_bias=True))
    with pytest.raises(CheckpointError, match=r"mlp_activation = 'silu'.*logit_softcap = 10.0.* is no Hugging Face"):
        family_of(model_config_from_hf(FIXTURES / "llama").replace(logit_softcap=10.0))


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "gemma2"])
def test_config_json_written_back_reads_as_the_same_model(family, tmp_path):
    config = model_config_from_hf(FIXTURES / family)
    (tmp_path / "config.json").write_text(json.dumps(hf_config_from_model(config, "float32")))
    assert model_config_from_hf(tmp_path).replace(name=config.name) == config


@pytest.mark.parametrize("text, message", [
    ("[1, 2]", "holds a JSON list, not an object"),
    ('"llama"', "holds a JSON str, not an object"),
    ("{}", "model_type None is not supported"),
    (json.dumps({"model_type": ["llama"]}), "model_type \\['llama'\\] is not supported"),
])
def test_a_config_that_is_not_an_object_of_fields_is_named(tmp_path, text, message):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(CheckpointError, match=message):
        model_config_from_hf(tmp_path)


@pytest.mark.parametrize("fields, message", [
    ({"hidden_size": None}, "lacks 'hidden_size'"),
    ({"num_hidden_layers": "32"}, "num_hidden_layers = '32'; expected a whole number"),
    ({"vocab_size": 0}, "vocab_size = 0; expected a whole number"),
    ({"num_key_value_heads": 2.5}, "num_key_value_heads = 2.5"),
    ({"rms_norm_eps": "tiny"}, "rms_norm_eps = 'tiny'; expected a finite number"),
    ({"rope_scaling": [8.0]}, "rope settings \\[8.0\\] are not an object"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "lacks 'low_freq_factor'"),
    ({"layer_types": 3}, "malformed field \\(TypeError"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings = 'yes'; expected true or false"),
    ({"rope_theta": -1}, "json: rope_theta = -1; expected a finite number above zero$"),
    ({"model_type": "mixtral"}, "json lacks 'num_local_experts'"),
])
def test_a_missing_or_mistyped_field_is_named(tmp_path, fields, message):
    with pytest.raises(CheckpointError, match=message):
        model_config_from_hf(model_dir(tmp_path, **fields))


def test_a_config_that_is_not_utf8_is_named(tmp_path):
    text = json.dumps({**LLAMA_3_1_8B, "name": "caf\xe9"}, ensure_ascii=False)
    (tmp_path / "config.json").write_bytes(text.encode("latin-1"))
    with pytest.raises(CheckpointError, match="is not UTF-8"):
        model_config_from_hf(tmp_path)


def test_an_export_keeps_the_source_family_where_it_computes_the_model(tmp_path):
    """Llama and Mistral compute the same model but for Mistral's window: a Mistral whose head_dim is hidden_size /
    heads (7B v0.2, v0.3) stays a Mistral and a Llama with a head_dim of its own a Llama; a window makes a Mistral;
    a family that computes another model is not kept."""
    mistral_like = model_config_from_hf(model_dir(tmp_path, model_type="mistral", rope_scaling=None))
    assert family_of(mistral_like) == "llama" and written_family(mistral_like, "mistral") == "mistral"
    assert hf_config_from_model(mistral_like, "bfloat16", {"model_type": "mistral"})["architectures"] == [
        "MistralForCausalLM"]
    own_head_dim = mistral_like.replace(head_dim=64)
    assert family_of(own_head_dim) == "mistral" and written_family(own_head_dim, "llama") == "llama"
    windowed = mistral_like.replace(sliding_window=8, sliding_layers=tuple(range(mistral_like.n_layers)))
    assert written_family(windowed, "llama") == "mistral"
    assert written_family(mistral_like, "qwen2") == "llama" and written_family(mistral_like, None) == "llama"
