"""8-bit weights: the quantization's error bounds, the scales' names and placement, every family's logits against
its float model, and every decode layout against the unsharded quantized model."""
import functools
import json
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec
from safetensors.numpy import load_file

from starscream_jax.errors import CheckpointError, PresetError
from starscream_jax.hardware.mesh import build_mesh
from starscream_jax.hardware.presets import load_chip
from starscream_jax.inference.generate import generate
from starscream_jax.model.catalog import load_model_config
from starscream_jax.model.decoder import abstract_model, create_sharded_model
from starscream_jax.model.dense_cache import DenseLayer, init_cache, split_cache
from starscream_jax.model.hf_checkpoint import load_hf_model
from starscream_jax.model.layer_weights import split_layer_weights
from starscream_jax.model.ops import attention
from starscream_jax.model.quantize import Scaled, dequantize, largest, quantize, quantize_cache_entry, scale_names
from starscream_jax.model.weight_formats import to_fnuz
from starscream_jax.sharding.apply import (Placement, batch_sharding, param_shardings, param_specs, token_sharding,
                                          use_layout)
from starscream_jax.sharding.layouts import LAYOUTS
from starscream_jax.training.steps import Sampling, decode_step

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "hf"
DECODE_LAYOUTS = [name for name, layout in LAYOUTS.items() if not layout.splits_sequence]
"""Every layout that can hold a KV cache (generation refuses those that split the sequence)."""
TOLERANCE = {"int8": (0.03, 0.9), "float8_e4m3fn": (0.15, 0.8)}
"""Format -> (largest relative RMS difference of the logits against the float model's, smallest share of positions
whose top token agrees), on the random fixtures (their logits' top-2 gaps are small; trained models do better).
Measured: int8 per channel 0.010-0.019 and 0.95-0.97 for the dense families, fp8 e4m3 0.05-0.07 and 0.87-0.92."""
MOE_TOLERANCE = {"int8": (0.08, 0.9), "float8_e4m3fn": (0.2, 0.8)}
"""As TOLERANCE for the mixtures of experts, where a token near a routing tie may pick another expert."""
ROWS = 4
"""Rows generated on 2 GPUs x 4 partitions: the batch split over the partitions, each row whole (an 8-bit cache split
by position, split-K decode, is refused)."""
GREEDY_AGREEMENT = 8
"""Greedy tokens that 8-bit weights and caches must agree on with the float reference (the random fixtures' top-2
logit gaps are small: 9 to 20 agree on the llama and qwen3 fixtures with int8 or fp8 weights or caches)."""


@pytest.mark.parametrize("format_name", ["int8", "float8_e4m3fn", "float8_e4m3fnuz"])
@pytest.mark.parametrize("granularity", ["channel", "tensor"])
def test_quantized_weights_are_within_half_a_step_of_the_float_ones(format_name, granularity):
    """int8 rounds to the nearest of 255 steps of the channel's range; e4m3 keeps 3 mantissa bits (a relative
    error of at most 2^-4 for normal values). The largest magnitude maps to the format's largest value."""
    names = ("layers", "embed", "heads", "head_dim")
    w = jax.random.normal(jax.random.key(0), (2, 32, 4, 8)) * jnp.arange(1, 5)[None, None, :, None]
    values, scale = quantize(w, "wq", names, format_name, granularity)
    assert values.dtype == jnp.dtype(format_name) and scale.dtype == jnp.float32
    assert scale.shape == ((2, 4, 8) if granularity == "channel" else (2,))
    back = dequantize(Scaled(values, scale), "wq", names, granularity, jnp.float32)
    scale_b = scale.reshape((2, 1, 4, 8) if granularity == "channel" else (2, 1, 1, 1))
    if format_name == "int8":
        assert float(jnp.max(jnp.abs(back - w) / scale_b)) <= 0.5 + 1e-5
    else:
        normal = jnp.abs(w) / scale_b >= float(jnp.finfo(format_name).smallest_normal)
        relative = jnp.where(normal, jnp.abs(back - w) / jnp.abs(w), 0)
        assert float(jnp.max(relative)) <= 2.0 ** -4 + 1e-6
    top = jnp.max(jnp.abs(values.astype(jnp.float32)), axis=1)
    assert float(jnp.max(top)) == largest(format_name)


def test_scales_carry_the_output_names_and_are_placed_with_their_weights():
    """Per channel the scale keeps the weight's names but the contracted ones; under starscream_decode wo's scale
    [L, D] is split over xcd as wo's embed dimension is, and wq's [L, H, E] over gpu as its heads."""
    assert scale_names("wq", ("layers", "embed", "heads", "head_dim"), "channel") == ("layers", "heads", "head_dim")
    assert scale_names("wo", ("layers", "heads", "head_dim", "embed"), "channel") == ("layers", "embed")
    assert scale_names("w_down", ("layers", "experts", "expert_mlp", "embed"), "tensor") == ("layers", "experts")
    config = load_model_config("tiny").replace(weight_format="int8")
    specs = param_specs(nnx.state(abstract_model(config), nnx.Param), "starscream_decode", build_mesh("2x4"))
    layers = specs["layers"]
    assert tuple(layers["wo"]) == (None, "gpu", None, "xcd") and tuple(layers["wo_scale"]) == (None, "xcd")
    assert tuple(layers["wq"]) == (None, "xcd", "gpu", None) and tuple(layers["wq_scale"]) == (None, "gpu", None)


def test_a_format_the_chip_lacks_is_refused_naming_the_chip_and_its_formats():
    assert load_chip("mi300x").fp8_pair() == ("float8_e4m3fnuz", "float8_e5m2fnuz")
    assert load_chip("h200").fp8_pair() == load_chip("mi355x").fp8_pair() == ("float8_e4m3fn", "float8_e5m2")
    with pytest.raises(PresetError, match=r"AMD Instinct MI300X \(mi300x\) does not compute in float8_e4m3fn; its "
                                          r"8-bit formats: int8, float8_e4m3fnuz, float8_e5m2fnuz"):
        load_chip("mi300x").check_format("float8_e4m3fn")
    load_chip("h200").check_format("float8_e4m3fn")


@functools.cache
def fixture(family: str) -> dict:
    """The fixture's reference: input_ids [8, 16] and the reference implementation's float32 logits."""
    return load_file(FIXTURES / family / "reference.safetensors")


def logits(model, tokens_BS: np.ndarray, layout: str = "starscream_tp", mesh=None) -> np.ndarray:
    mesh = mesh or build_mesh("1x1")
    with use_layout(layout, mesh):
        tokens = jax.device_put(tokens_BS, batch_sharding(layout, mesh, tokens_BS.shape[0]))
        return np.asarray(jax.jit(lambda m, t: m(t).logits)(model, tokens))


@functools.cache
def quantized_model(family: str, format_name: str):
    """The fixture with its layers' weights in `format_name` (per channel), unsharded."""
    return load_hf_model(FIXTURES / family, "starscream_tp", build_mesh("1x1"), quantize=format_name)


@functools.cache
def quantized_logits(family: str, format_name: str) -> np.ndarray:
    return logits(quantized_model(family, format_name), fixture(family)["input_ids"])


@pytest.mark.parametrize("family, format_name", [
    *((family, "int8") for family in ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe")),
    ("llama", "float8_e4m3fn")])
def test_8_bit_logits_are_near_the_float_models(family, format_name):
    """Against the reference implementation's float32 logits (which the float model matches to 1e-4)."""
    expected = fixture(family)["logits"]
    got = quantized_logits(family, format_name)
    relative = np.sqrt(np.mean((got - expected) ** 2) / np.mean(expected ** 2))
    agree = np.mean(got.argmax(-1) == expected.argmax(-1))
    largest_difference, least_agreement = (MOE_TOLERANCE if "mixtral" in family or "moe" in family
                                           else TOLERANCE)[format_name]
    assert 0 < relative <= largest_difference and agree >= least_agreement, (relative, agree)


def test_every_decode_layout_gives_the_unsharded_8_bit_logits():
    """int8 weights per channel of the llama fixture, moved into each layout's placement on 2 GPUs x 4 partitions
    (loading with quantize into a sharded placement: the generation tests)."""
    expected, mesh = quantized_logits("llama", "int8"), build_mesh("2x4")
    graphdef, params, rest = nnx.split(quantized_model("llama", "int8"), nnx.Param, ...)
    errors = {}
    for layout in DECODE_LAYOUTS:
        placed = nnx.merge(graphdef, jax.device_put(params, param_shardings(params, layout, mesh)), rest)
        errors[layout] = float(np.max(np.abs(logits(placed, fixture("llama")["input_ids"], layout, mesh) - expected)))
    assert max(errors.values()) <= 1e-4, errors


FP8_FIXTURE = FIXTURES / "mistral_fp8"
"""The mistral fixture quantized to float8_e4m3fn per channel in the compressed-tensors format, with the reference
implementation's logits of it (scripts/make_fp8_fixture.py)."""


def test_a_pre_quantized_fp8_checkpoint_gives_the_reference_logits_and_continuation():
    """Loaded as stored (fp8 values, float32 scales), sharded for prefill and decode on 2 GPUs x 4 partitions; held
    as e4m3fnuz values with doubled scales (for MI300X), the same logits."""
    expected, mesh = load_file(FP8_FIXTURE / "reference.safetensors"), build_mesh("2x4")
    model = load_hf_model(FP8_FIXTURE, "starscream_tp", mesh)
    assert model.layers.wq[...].dtype == jnp.float8_e4m3fn and model.config.weight_scales == "channel"
    assert np.max(np.abs(logits(model, expected["input_ids"], "starscream_tp", mesh) - expected["logits"])) <= 1e-4
    rows = ROWS
    result = generate(model, np.tile(expected["prompt_ids"], (rows, 1)), len(expected["generated_ids"]),
                      Sampling(top_p=None), mesh)
    np.testing.assert_array_equal(result.tokens, np.tile(expected["generated_ids"], (rows, 1)))
    fnuz = to_fnuz(model)  # as MI300X holds it
    assert fnuz.layers.wq[...].dtype == jnp.float8_e4m3fnuz and fnuz.config.weight_format == "float8_e4m3fnuz"
    assert np.max(np.abs(logits(fnuz, expected["input_ids"], "starscream_tp", mesh) - expected["logits"])) <= 1e-4


def _with_quantization(tmp_path, change) -> Path:
    """A copy of the fp8 fixture whose quantization_config `change` edits in place."""
    copy = tmp_path / "fp8"
    shutil.copytree(FP8_FIXTURE, copy)
    config = json.loads((copy / "config.json").read_text())
    change(config["quantization_config"])
    (copy / "config.json").write_text(json.dumps(config))
    return copy


@pytest.mark.parametrize("change, message", [
    (lambda q: q.update(quant_method="fbgemm_fp8"), r"quant_method 'fbgemm_fp8' is not implemented; only "
                                                    r"compressed-tensors"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="block"), r"strategy 'channel' or 'tensor'"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=4), r"symmetric static 8-bit float"),
    (lambda q: q.update(kv_cache_scheme={"num_bits": 8}), r"kv_cache_scheme .* is not implemented"),
    (lambda q: q.update(ignore=["lm_head", "model.layers.0.mlp.down_proj"]), r"ignore = .*; only checkpoints whose"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="tensor"), r"holds 64 scales, but its weight"),
])
def test_a_quantization_the_loader_does_not_implement_is_named(tmp_path, change, message):
    with pytest.raises(CheckpointError, match=message) as caught:
        load_hf_model(_with_quantization(tmp_path, change), "starscream_tp", build_mesh("1x1"))
    assert "\n" not in str(caught.value)


def test_quantizing_an_already_quantized_checkpoint_is_refused():
    with pytest.raises(CheckpointError, match=r"already quantized to float8_e4m3fn; drop the quantization"):
        load_hf_model(FP8_FIXTURE, "starscream_tp", build_mesh("1x1"), quantize="int8")


@pytest.mark.parametrize("format_name", ["int8", "float8_e4m3fn"])
def test_attention_over_an_8_bit_cache_is_near_attention_over_the_float_one(format_name):
    """One layer's cache [B, T, K, E] of 2 x 12 positions, 2 kv heads of 4 queries each; a query at each position
    sees the positions up to its own. The scales per position and head bound the error by the format's step."""
    q_BSHE = jax.random.normal(jax.random.key(1), (2, 12, 8, 16))
    k_BTKE, v_BTKE = jax.random.normal(jax.random.key(2), (2, 2, 12, 2, 16)) * jnp.arange(1, 13)[:, None, None]
    positions_BS = jnp.broadcast_to(jnp.arange(12), (2, 12))
    cached = jax.jit(lambda cache: attention(q_BSHE, k_BTKE, v_BTKE, positions_BS, cache))
    expected = cached(DenseLayer(k=k_BTKE, v=v_BTKE))
    (k8, k_scale), (v8, v_scale) = (quantize_cache_entry(x, format_name) for x in (k_BTKE, v_BTKE))
    assert k8.dtype == jnp.dtype(format_name) and k_scale.shape == (2, 12, 2)
    got = cached(DenseLayer(k=k8, v=v8, k_scale=k_scale, v_scale=v_scale))
    relative = float(jnp.sqrt(jnp.mean((got - expected) ** 2) / jnp.mean(expected ** 2)))
    assert 0 < relative <= (0.01 if format_name == "int8" else 0.05), relative


def test_generation_with_8_bit_weights_and_cache_follows_the_reference():
    """int8 weights per channel and an int8 KV cache, prefilled under starscream_tp and decoded under
    starscream_decode on 2 GPUs x 4 partitions: the greedy continuation agrees with the reference implementation's
    float one for its first GREEDY_AGREEMENT tokens (13 are seen; the fixture's top-2 gaps are as small as 0.06).
    One sequence, fewer than the partitions: the 8-bit cache and its scales split by position, the same tokens."""
    expected, mesh = fixture("llama"), build_mesh("2x4")
    model = load_hf_model(FIXTURES / "llama", "starscream_tp", mesh, quantize="int8")
    model.config = model.config.replace(kv_format="int8")
    rows = ROWS
    result = generate(model, np.tile(expected["prompt_ids"], (rows, 1)), GREEDY_AGREEMENT, Sampling(top_p=None), mesh)
    np.testing.assert_array_equal(result.tokens, np.tile(expected["generated_ids"][:GREEDY_AGREEMENT], (rows, 1)))
    one = generate(model, expected["prompt_ids"][None], GREEDY_AGREEMENT, Sampling(top_p=None), mesh)
    np.testing.assert_array_equal(one.tokens, result.tokens[:1])  # prefill split by sequence, split-K decode


def test_decode_reads_8_bit_weights_held_per_layer_without_slicing_a_stack():
    """`split_layer_weights` under starscream_decode on 2 GPUs x 4 partitions: each layer's int8 array placed as its
    slice of the stack was, the decode step's next tokens and cache equal the stacked weights', and the compiled step
    slices no 8-bit stack (a GPU's converting GEMM fusion copies such slices out first, benchmarks/NOTES.md run 19)."""
    mesh, layout = build_mesh("2x4"), "starscream_decode"
    config = load_model_config("tiny").replace(n_layers=2, weight_format="int8", dtype="bfloat16")
    with use_layout(layout, mesh):
        graphdef, stacked, rest = nnx.split(create_sharded_model(config, layout, mesh), nnx.Param, ...)
        cache = jax.jit(split_cache)(init_cache(config, 8, 16))
    held = split_layer_weights(stacked)
    layers = held["layers"]["wq"].get_value()
    assert len(layers) == 2 and layers[0].sharding.spec == PartitionSpec(*stacked["layers"]["wq"].get_value().sharding.spec[1:])
    token_B = jax.device_put(jnp.arange(8, dtype=jnp.int32), token_sharding(layout, mesh, 8))
    step = decode_step(graphdef, Sampling(top_p=None), under=Placement.of(layout, mesh), eight_bit_weights=True)
    results = {}
    for name, params in (("stacked", stacked), ("held", held)):
        compiled = step.lower(params, rest, cache, token_B, jnp.int32(3)).compile()
        results[name] = compiled(params, rest, jax.tree.map(jnp.copy, cache), token_B, jnp.int32(3))
        results[name + " slices"] = len(re.findall(r"= s8\[[^\]]*\]\S* (?:dynamic-)?slice\(", compiled.as_text()))
    np.testing.assert_array_equal(results["held"][0], results["stacked"][0])
    for got, expected in zip(jax.tree.leaves(results["held"][1]), jax.tree.leaves(results["stacked"][1])):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(expected, np.float32))
    assert results["stacked slices"] > 0 and results["held slices"] == 0, results
