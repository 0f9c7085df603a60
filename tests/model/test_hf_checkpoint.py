"""Hugging Face checkpoints: our logits equal the reference implementation's on every layout and mesh, greedy
decoding gives the reference's tokens, export is the exact inverse of loading, and a broken checkpoint is a clear error.

The fixtures in tests/fixtures/hf/<family>/ (written by scripts/make_hf_fixtures.py with transformers; versions in
each reference.json) hold a tiny random checkpoint of each family, its tokenizer, and the reference's float32 logits
for a fixed [8, 16] batch and its greedy continuation of a prompt. Each (family, mesh, layout) loads the checkpoint
straight into that layout's shards and compiles one forward pass.
"""
import errno
import functools
import json
import math
import os
import shutil
import socket
import subprocess
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from starscream_jax.errors import CheckpointError, ShardingRuleError, StarscreamError
from starscream_jax.hardware.mesh import build_mesh
from starscream_jax.inference.generate import generate
from starscream_jax.model.decoder import Transformer, next_token_loss
from starscream_jax.model.hf_checkpoint import (
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointReader,
    check_export_target,
    export_hf_model,
    load_hf_model,
)
from starscream_jax.model.hf_config import model_config_from_hf
from starscream_jax.sharding.apply import batch_sharding, param_shardings, use_layout
from starscream_jax.sharding.layouts import LAYOUTS, fit_batch
from starscream_jax.training.steps import Sampling

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "hf"
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "gemma2")
TOLERANCE = 1e-4
"""Largest absolute logit difference allowed against the reference (float32 on both sides; about 5e-6 is seen, 3e-5
for the llama fixture whose tied N(0, 1) embeddings give logits up to 43)."""
MESHES = {"1x1x1": (1, 1, 1), "1x2x4": (1, 2, 4), "2x2x2": (2, 2, 2), "1x2x8": (1, 2, 8)}
TABLE_MESHES = ("1x1x1", "1x2x4", "2x2x2")
"""The meshes of docs/hugging_face.md's table, which `python -m tests.model.test_hf_checkpoint --table` prints on the
8 devices its usage line asks for."""


def mesh_of(name: str):
    data, gpu, xcd = MESHES[name]
    return build_mesh(f"{data * gpu}x{xcd}", data=data)


@functools.cache
def reference(family: str) -> dict:
    return load_file(FIXTURES / family / "reference.safetensors")


def logits_under(model_dir: Path, layout: str, mesh, tokens_BS: np.ndarray) -> np.ndarray:
    """The model of `model_dir` loaded into `layout`'s shards on `mesh`, run on `tokens_BS` (placed likewise)."""
    model = load_hf_model(model_dir, layout, mesh)
    with use_layout(layout, mesh):
        tokens = jax.device_put(tokens_BS, batch_sharding(layout, mesh, tokens_BS.shape[0]))
        return np.asarray(jax.jit(lambda m, t: m(t).logits)(model, tokens))


DEFAULT_MESHES = ("1x1x1", "1x2x4")
"""The default run covers every layout on these; (2, 2, 2) adds the data axis (the batch split across GPU groups as
well) and runs with the slow tests. On one device every layout places every tensor whole, so one layout stands for
all there."""


def equivalence_errors(family: str, mesh_names) -> dict[str, float]:
    """{"layout on mesh": largest absolute logit difference against the reference}, every layout on each mesh."""
    expected = reference(family)
    errors = {}
    for mesh_name in mesh_names:
        for layout in LAYOUTS if mesh_name != "1x1x1" else ["starscream_tp"]:
            logits = logits_under(FIXTURES / family, layout, mesh_of(mesh_name), expected["input_ids"])
            errors[f"{layout} on {mesh_name}"] = float(np.max(np.abs(logits - expected["logits"])))
    return errors


SWEPT_ONLY = ("mistral", "qwen3", "qwen3_moe", "mixtral", "qwen2", "gemma2")
"""Families whose every-layout sweep runs with `-m slow` (Llama's runs by default): Mistral's weights map as Llama's;
Qwen3's and Qwen3-MoE's q/k norms are checked under sharding by the gradient test below and against the reference by
their greedy tokens and batch-split logits here, and Qwen3-MoE's routed experts on every layout by tests/model/
test_decoder.py (tiny-moe); Gemma 2's four norms, soft caps and windows by its sharded gradients below, its greedy
tokens and its served tokens (tests/serving/test_engine.py); Mixtral's tokens are served under the decode layout by
tests/serving/test_engine.py, and Qwen2's biases are checked by its greedy tokens at any batch."""


@pytest.mark.parametrize("family", [pytest.param(family, marks=pytest.mark.slow) if family in SWEPT_ONLY else family
                                    for family in FAMILIES])
def test_logits_equal_the_reference_on_every_layout(family):
    errors = equivalence_errors(family, DEFAULT_MESHES)
    assert len(errors) == 1 + len(LAYOUTS)
    assert max(errors.values()) <= TOLERANCE, errors


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_the_reference_on_every_layout_with_a_data_axis(family):
    errors = equivalence_errors(family, ["2x2x2"])
    assert len(errors) == len(LAYOUTS)
    assert max(errors.values()) <= TOLERANCE, errors


ANY_BATCH = {"llama": ("1x2x4", 1), "mistral": ("2x2x2", 3), "qwen2": ("1x2x8", 5), "qwen3": ("1x1x1", 2),
             "mixtral": ("1x2x8", 2), "qwen3_moe": ("2x2x2", 1), "gemma2": ("1x2x4", 2)}
"""A mesh and a batch per family, together every mesh and batches 1, 2, 3 and 5: fewer sequences than the (data x)
xcd split of the batch, so prefill splits each 9-token prompt over the partitions (padded to a multiple of them)
and decode attends split-K; batch 5 on 2 x 8 partitions and 3 on a data axis of 2 leave parts of the batch split
unused as well."""


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_of_any_batch_gives_the_reference_tokens(family):
    """Prefill under starscream_tp and decode under starscream_decode, as `generate` fits them to the batch."""
    check_greedy_generation(family, *ANY_BATCH[family])


def check_greedy_generation(family: str, mesh_name: str, rows: int) -> None:
    """`rows` copies of the reference prompt generate the reference's greedy tokens on mesh `mesh_name`."""
    expected = reference(family)
    mesh = mesh_of(mesh_name)
    model = load_hf_model(FIXTURES / family, "starscream_tp", mesh)
    prompt = np.tile(expected["prompt_ids"], (rows, 1))
    result = generate(model, prompt, len(expected["generated_ids"]), Sampling(top_p=None), mesh)
    assert len(expected["generated_ids"]) == 20 and len(set(expected["generated_ids"].tolist())) > 1
    np.testing.assert_array_equal(result.tokens, np.tile(expected["generated_ids"], (rows, 1)))


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_of_a_batch_split_by_sequence_equal_the_reference(family):
    """starscream_tp fitted to each family's batch of ANY_BATCH (each sequence of 16 tokens over the partitions)."""
    expected, (mesh_name, rows) = reference(family), ANY_BATCH[family]
    mesh = mesh_of(mesh_name)
    layout = fit_batch("starscream_tp", mesh, rows, expected["input_ids"].shape[1])
    logits = logits_under(FIXTURES / family, layout, mesh, expected["input_ids"][:rows])
    assert np.max(np.abs(logits - expected["logits"][:rows])) <= TOLERANCE


@pytest.mark.parametrize("family, layout", [("llama", "starscream_tp"), ("mixtral", "starscream_tp"),
                                            ("mixtral", "starscream_ep"), ("qwen3_moe", "flat_ep"),
                                            ("gemma2", "starscream_tp")])
def test_export_then_load_is_bit_identical(family, layout, tmp_path):
    """llama: three shards and an index, tied embeddings; mixtral: one file, experts (also placed by an expert
    layout, the experts split over the mesh); qwen3_moe: experts under their own names, q/k norms, gates not
    renormalised; gemma2: four norms a layer and its own fields. Exported from a 2 x 4 mesh in several shards; every
    tensor and the configuration read back the same."""
    mesh = mesh_of("1x2x4")
    model = load_hf_model(FIXTURES / family, layout, mesh)
    written = export_hf_model(model, tmp_path, tokenizer_dir=FIXTURES / family, max_shard_bytes=150_000,
                              source_config=json.loads((FIXTURES / family / "config.json").read_text()))
    assert (tmp_path / INDEX_FILE) in written and (tmp_path / "tokenizer.json") in written
    original, exported = all_tensors(FIXTURES / family), all_tensors(tmp_path)
    assert original.keys() == exported.keys()
    for name, tensor in original.items():
        assert tensor.dtype == exported[name].dtype and tensor.tobytes() == exported[name].tobytes(), name
    assert model_config_from_hf(tmp_path).replace(name="x") == model_config_from_hf(FIXTURES / family).replace(name="x")


def all_tensors(model_dir: Path) -> dict[str, np.ndarray]:
    tensors = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        if path.name != "reference.safetensors":
            tensors.update(load_file(path))
    return tensors


def test_layers_stored_in_several_float_formats_each_load_exactly(tmp_path):
    """Layer 0 stored in float16, layer 1 in float32: each layer's values load as stored (the same model as one
    stored all in float32 with layer 0's values rounded to float16), none rounded to another layer's format."""
    mixed, uniform = tmp_path / "mixed", tmp_path / "uniform"
    for target, stored in ((mixed, np.float16), (uniform, np.float32)):
        shutil.copytree(FIXTURES / "llama", target)
        for path in target.glob("model-*.safetensors"):
            rewrite(path, lambda tensors, stored=stored: tensors.update({
                name: tensor.astype(np.float16).astype(stored) for name, tensor in tensors.items()
                if name.startswith("model.layers.0.")}))
    tokens = reference("llama")["input_ids"][:1]
    np.testing.assert_array_equal(logits_under(mixed, "gpu_tp", mesh_of("1x1x1"), tokens),
                                  logits_under(uniform, "gpu_tp", mesh_of("1x1x1"), tokens))


def test_a_mistral_window_slides_on_every_layer_and_places_under_the_layouts(tmp_path):
    """The Mistral fixture given a window of 4: positions whose keys all lie within 4 of them keep the logits of the
    model without a window, later ones change; the windowed model's logits under starscream_tp on 2 GPUs x 4
    partitions equal its unsharded ones."""
    windowed = tmp_path / "mistral"
    shutil.copytree(FIXTURES / "mistral", windowed)
    config = json.loads((windowed / "config.json").read_text())
    (windowed / "config.json").write_text(json.dumps({**config, "sliding_window": 4}))
    tokens = reference("mistral")["input_ids"][:1]
    assert tokens.shape[1] > 8
    whole = logits_under(FIXTURES / "mistral", "gpu_tp", mesh_of("1x1x1"), tokens)
    slid = logits_under(windowed, "gpu_tp", mesh_of("1x1x1"), tokens)
    np.testing.assert_allclose(slid[:, :4], whole[:, :4], rtol=1e-5, atol=1e-5)
    assert not np.allclose(slid[:, 8:], whole[:, 8:], atol=1e-3)
    placed = logits_under(windowed, "starscream_tp", mesh_of("1x2x4"), np.repeat(tokens, 8, axis=0))
    np.testing.assert_allclose(placed, np.repeat(slid, 8, axis=0), rtol=2e-4, atol=2e-4)


@pytest.fixture
def broken_copy(tmp_path):
    """A copy of the sharded llama fixture to break."""
    target = tmp_path / "llama"
    shutil.copytree(FIXTURES / "llama", target)
    return target


def rewrite(path: Path, change) -> None:
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path)


def test_a_missing_shard_names_the_file(broken_copy):
    (broken_copy / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"shard .*model-00002-of-00003.safetensors is missing"):
        load_hf_model(broken_copy, "starscream_tp", mesh_of("1x2x4"))


def test_a_shape_mismatch_names_the_tensor_and_file(broken_copy):
    shard = broken_copy / "model-00001-of-00003.safetensors"
    name = next(iter(load_file(shard)))
    rewrite(shard, lambda tensors: tensors.update({name: tensors[name][..., :-1]}))
    with pytest.raises(CheckpointError, match=rf"tensor {name} in .*model-00001-of-00003.safetensors has shape"):
        load_hf_model(broken_copy, "starscream_tp", mesh_of("1x2x4"))


def test_an_unconvertible_dtype_names_the_tensor(broken_copy):
    shard = broken_copy / "model-00003-of-00003.safetensors"
    name = next(iter(load_file(shard)))
    rewrite(shard, lambda tensors: tensors.update({name: tensors[name].astype(np.int32)}))
    with pytest.raises(CheckpointError, match=rf"tensor {name} in .* is stored as I32, which cannot be converted"):
        load_hf_model(broken_copy, "starscream_tp", mesh_of("1x2x4"))


def test_a_tensor_missing_from_the_index_names_the_tensor(broken_copy):
    index = json.loads((broken_copy / INDEX_FILE).read_text())
    del index["weight_map"]["model.norm.weight"]
    (broken_copy / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"do not match its config.json: missing 1 \(model.norm.weight\)"):
        load_hf_model(broken_copy, "starscream_tp", mesh_of("1x2x4"))


def test_a_config_with_fewer_layers_than_the_weights_is_refused(broken_copy):
    config = json.loads((broken_copy / "config.json").read_text())
    (broken_copy / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    with pytest.raises(CheckpointError, match=r"unexpected 9 \(model.layers.1.input_layernorm.weight, "):
        load_hf_model(broken_copy, "starscream_tp", mesh_of("1x1x1"))


def test_an_unexpected_tensor_is_refused(broken_copy):
    shard = broken_copy / "model-00003-of-00003.safetensors"
    rewrite(shard, lambda tensors: tensors.update({"model.extra.weight": np.ones(4, np.float32)}))
    index = json.loads((broken_copy / INDEX_FILE).read_text())
    index["weight_map"]["model.extra.weight"] = shard.name
    (broken_copy / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"unexpected 1 \(model.extra.weight\)"):
        load_hf_model(broken_copy, "starscream_tp", mesh_of("1x1x1"))


@pytest.mark.parametrize("same", [True, False])
def test_a_tied_checkpoints_lm_head_is_accepted_only_when_it_is_the_embedding(broken_copy, same):
    shard = broken_copy / "model-00001-of-00003.safetensors"
    embedding = load_file(shard)["model.embed_tokens.weight"]
    rewrite(shard, lambda tensors: tensors.update({"lm_head.weight": embedding if same else embedding * 2}))
    index = json.loads((broken_copy / INDEX_FILE).read_text())
    index["weight_map"]["lm_head.weight"] = shard.name
    (broken_copy / INDEX_FILE).write_text(json.dumps(index))
    if same:
        assert load_hf_model(broken_copy, "starscream_tp", mesh_of("1x1x1")).config.tie_embeddings
    else:
        with pytest.raises(CheckpointError, match=r"tie_word_embeddings true, but lm_head.weight in .*00001-of-00003"
                                                  r".safetensors differs from model.embed_tokens.weight; set "
                                                  r"tie_word_embeddings to false"):
            load_hf_model(broken_copy, "starscream_tp", mesh_of("1x1x1"))


def test_an_untied_config_over_weights_without_a_head_names_the_flag(broken_copy):
    """The tied fixture's weights under a config.json that says the head is its own: the one tensor missing is the
    head, so the error names tie_word_embeddings rather than a mismatch of models."""
    config = json.loads((broken_copy / "config.json").read_text())
    (broken_copy / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    with pytest.raises(CheckpointError, match=r"holds no lm_head.weight, but .*config.json has tie_word_embeddings "
                                              r"false \(or absent\); .* set tie_word_embeddings to true"):
        load_hf_model(broken_copy, "starscream_tp", mesh_of("1x1x1"))


@pytest.mark.parametrize("value, found", [(np.nan, "1 NaN and 0 infinite"), (-np.inf, "0 NaN and 1 infinite")])
def test_a_non_finite_weight_is_refused_at_load(broken_copy, value, found):
    shard = broken_copy / "model-00002-of-00003.safetensors"
    name = sorted(load_file(shard))[-1]

    def poison(tensors):
        tensors[name] = tensors[name].copy()
        tensors[name].flat[5] = value
    rewrite(shard, poison)
    with pytest.raises(CheckpointError, match=rf"tensor {name} in .*00002-of-00003.safetensors holds {found} values"):
        load_hf_model(broken_copy, "starscream_tp", mesh_of("1x2x4"))


@pytest.mark.parametrize("index, message", [
    ({"weight_map": ["a", "b"]}, "weight_map is not an object"),
    ([1], r"is not a safetensors index \(TypeError"),
    ({"metadata": {}}, r"is not a safetensors index \(KeyError"),
])
def test_a_malformed_index_is_named(broken_copy, index, message):
    (broken_copy / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=message):
        load_hf_model(broken_copy, "starscream_tp", mesh_of("1x1x1"))


def test_a_single_file_beside_an_index_is_read_as_transformers_reads_it(broken_copy):
    """transformers' from_pretrained takes model.safetensors before model.safetensors.index.json: so do we."""
    shards = sorted(broken_copy.glob("model-*.safetensors"))
    save_file({name: array for shard in shards for name, array in load_file(shard).items()},
              broken_copy / SINGLE_FILE)
    for shard in shards:
        shard.unlink()
    (broken_copy / INDEX_FILE).write_text("{not read")
    reader = CheckpointReader(broken_copy)
    assert set(reader.weight_map.values()) == {SINGLE_FILE} and "model.norm.weight" in reader.weight_map


def with_index_entries(directory: Path, **entries) -> None:
    index = json.loads((directory / INDEX_FILE).read_text())
    index["weight_map"].update({name.replace("__", "."): file for name, file in entries.items()})
    (directory / INDEX_FILE).write_text(json.dumps(index))


@pytest.mark.parametrize("file", ["../elsewhere.safetensors", "/tmp/model-00001-of-00003.safetensors",
                                  "sub/../../x.safetensors"])
def test_an_index_entry_outside_the_directory_is_refused(broken_copy, file):
    with_index_entries(broken_copy, model__norm__weight=file)
    with pytest.raises(CheckpointError, match=rf"puts tensor model.norm.weight in '{file}', outside "):
        CheckpointReader(broken_copy)


def test_a_tensor_held_by_two_shards_is_refused_naming_both(broken_copy):
    held_by = json.loads((broken_copy / INDEX_FILE).read_text())["weight_map"]["model.norm.weight"]
    other = next(shard for shard in sorted(broken_copy.glob("model-*.safetensors")) if shard.name != held_by)
    rewrite(other, lambda tensors: tensors.update({"model.norm.weight": load_file(broken_copy / held_by)[
        "model.norm.weight"]}))
    with pytest.raises(CheckpointError, match=r"tensor model.norm.weight is in both .*-of-00003.safetensors and "
                                              r".*-of-00003.safetensors; .*remove the stale copy"):
        CheckpointReader(broken_copy)


def test_an_index_naming_a_tensor_twice_or_in_a_file_without_it_is_refused(broken_copy):
    text = (broken_copy / INDEX_FILE).read_text()
    (broken_copy / INDEX_FILE).write_text(text.replace(
        '"model.norm.weight"', '"model.norm.weight": "model-00009-of-00009.safetensors",\n    "model.norm.weight"'))
    with pytest.raises(CheckpointError, match=r"names tensor model.norm.weight twice \(in model-00009-of-00009"):
        CheckpointReader(broken_copy)
    (broken_copy / INDEX_FILE).write_text(text)
    held_by = json.loads(text)["weight_map"]["model.norm.weight"]
    other = next(shard.name for shard in sorted(broken_copy.glob("model-*.safetensors")) if shard.name != held_by)
    with_index_entries(broken_copy, model__norm__weight=other)
    with pytest.raises(CheckpointError, match=rf"puts tensor model.norm.weight in .*{other}, which does not hold it"):
        CheckpointReader(broken_copy)


def test_arguments_of_the_wrong_kind_are_named():
    with pytest.raises(StarscreamError, match=r"mesh None \(NoneType\): expected a jax.sharding.Mesh"):
        load_hf_model(FIXTURES / "llama", "starscream_tp", None)
    with pytest.raises(StarscreamError, match=r"config 'llama' \(str\): expected a ModelConfig"):
        load_hf_model(FIXTURES / "llama", "starscream_tp", mesh_of("1x1x1"), config="llama")


def test_a_truncated_shard_names_the_file(broken_copy):
    shard = broken_copy / "model-00002-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="model-00002-of-00003.safetensors is not a readable safetensors file"):
        load_hf_model(broken_copy, "starscream_tp", mesh_of("1x2x4"))


def test_a_layout_that_cannot_place_the_model_says_why():
    """7 heads cannot split over 2 GPUs: the resolver's error, before any byte is read."""
    config = model_config_from_hf(FIXTURES / "qwen2").replace(n_heads=7, n_kv_heads=7)
    with pytest.raises(ShardingRuleError, match="not divisible"):
        load_hf_model(FIXTURES / "qwen2", "starscream_tp", mesh_of("1x2x4"), config=config)


def gradients_match_unsharded(graphdef, params, tokens):
    """The next-token loss's gradients under starscream_tp on (2, 2, 2), checked against the unsharded ones (loss
    and every gradient within 2e-5, every gradient informative); returns them."""
    def loss_and_grads(params, tokens_BS):
        return jax.value_and_grad(lambda p: next_token_loss(nnx.merge(graphdef, p), tokens_BS))(params)

    expected_loss, expected = jax.jit(loss_and_grads)(params, tokens)
    mesh = mesh_of("2x2x2")
    with use_layout("starscream_tp", mesh):
        loss, grads = jax.jit(loss_and_grads)(
            jax.device_put(params, param_shardings(params, "starscream_tp", mesh)),
            jax.device_put(tokens, batch_sharding("starscream_tp", mesh, len(tokens))))
    assert abs(float(loss) - float(expected_loss)) <= 2e-5
    for (path, gradient), (_, wanted) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(expected)):
        assert float(np.max(np.abs(wanted.get_value()))) > 1e-3, path  # every gradient is informative
        error = float(np.max(np.abs(np.asarray(gradient.get_value()) - np.asarray(wanted.get_value()))))
        assert error <= 2e-5, (path, error)
    return grads


def test_gradients_of_biases_and_qk_norms_match_the_unsharded_model():
    """starscream_tp on (2, 2, 2) splits the tokens inside and across GPUs, where a weight's gradient is summed in
    two stages (`weight`): the q/k/v biases and the per-head q/k norm scales (whose gradient also sums over the
    heads split across GPUs) go through it like the matrices. One model with both (Qwen3's fixture plus biases),
    random, against its unsharded gradients."""
    config = model_config_from_hf(FIXTURES / "qwen3").replace(qkv_bias=True)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(1)  # biases and norm scales away from their zeros and ones too
    params = jax.tree.map_with_path(lambda path, x: rng.normal("norm" in jax.tree_util.keystr(path), 0.3, x.shape)
                                    .astype(np.float32), params)
    grads = gradients_match_unsharded(graphdef, params, reference("qwen3")["input_ids"])
    assert {"bq", "bk", "bv", "q_norm", "k_norm"} <= set(grads["layers"].keys())


def test_gradients_of_gemma2_match_the_unsharded_model():
    """Gemma 2's post-attention and post-MLP norm scales, (1 + weight) norms, soft-caps and sliding window in
    training: the gradients under starscream_tp on (2, 2, 2) equal the unsharded ones."""
    graphdef, params = nnx.split(load_hf_model(FIXTURES / "gemma2", "gpu_tp", mesh_of("1x1x1")))
    params = jax.tree.map(np.asarray, params)
    grads = gradients_match_unsharded(graphdef, params, reference("gemma2")["input_ids"])
    assert {"attn_post_norm", "mlp_post_norm"} <= set(grads["layers"].keys())


def test_the_docs_table_is_printed_for_its_meshes_on_eight_devices():
    header = "| family | " + " | ".join(f"mesh {name}" for name in TABLE_MESHES) + " | 20 greedy tokens |"
    assert header in (Path(__file__).resolve().parents[2] / "docs" / "hugging_face.md").read_text()
    assert all(math.prod(MESHES[name]) <= 8 for name in TABLE_MESHES)


def equivalence_table() -> str:
    """docs/hugging_face.md's table: per family, the largest logit difference against the reference over every
    layout on each mesh, and whether greedy generation (prefill starscream_tp, decode starscream_decode, 1 x 2 x 4)
    matched."""
    rows = ["| family | " + " | ".join(f"mesh {name}" for name in TABLE_MESHES) + " | 20 greedy tokens |",
            "|---|" + "---|" * (len(TABLE_MESHES) + 1)]
    for family in FAMILIES:
        worst = [max(equivalence_errors(family, [mesh]).values()) for mesh in TABLE_MESHES]
        try:
            check_greedy_generation(family, "1x2x4", 1)
            greedy = "equal"
        except AssertionError:
            greedy = "differ"
        rows.append(f"| {family} | " + " | ".join(f"{error:.1e}" for error in worst) + f" | {greedy} |")
    return "\n".join(rows)


if __name__ == "__main__":
    import sys

    if "--table" not in sys.argv:
        sys.exit("usage: XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.model.test_hf_checkpoint "
                 "--table")
    assert "device_count=8" in os.environ.get("XLA_FLAGS", ""), "set XLA_FLAGS (see the usage line)"
    print(equivalence_table())


@pytest.fixture(scope="module")
def small_model():
    return load_hf_model(FIXTURES / "llama", "starscream_tp", mesh_of("1x1x1"))


@pytest.fixture
def older_export(tmp_path):
    """A directory holding another model: sharded weights with their index and a foreign tokenizer."""
    out = tmp_path / "model"
    shutil.copytree(FIXTURES / "qwen2", out)
    for name in ("model-00001-of-00002.safetensors", INDEX_FILE):
        (out / name).write_text("{}")
    (out / "vocab.txt").write_text("foreign")
    return out


def test_exporting_into_a_directory_that_holds_a_model_is_refused_and_changes_nothing(small_model, older_export):
    before = {path.name: path.read_bytes() for path in older_export.iterdir()}
    with pytest.raises(CheckpointError, match=r"already holds 10 files \(config.json, .*pass --replace"):
        export_hf_model(small_model, older_export, tokenizer_dir=FIXTURES / "llama")
    assert {path.name: path.read_bytes() for path in older_export.iterdir()} == before


def test_replacing_an_export_leaves_nothing_of_the_old_one(small_model, older_export):
    written = export_hf_model(small_model, older_export, tokenizer_dir=FIXTURES / "llama", replace=True,
                              max_shard_bytes=150_000)
    assert sorted(path.name for path in older_export.iterdir()) == sorted(path.name for path in written) == [
        "config.json", "generation_config.json", "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors", INDEX_FILE, "tokenizer.json",
        "tokenizer_config.json"]
    assert [path.name for path in older_export.parent.iterdir()] == ["model"]  # no staging directory left
    assert all_tensors(older_export).keys() == all_tensors(FIXTURES / "llama").keys()


def test_a_failed_export_leaves_the_target_as_it_was(small_model, older_export, monkeypatch):
    before = {path.name: path.read_bytes() for path in older_export.iterdir()}
    monkeypatch.setattr("starscream_jax.model.hf_checkpoint.save_file", lambda *_, **__: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        export_hf_model(small_model, older_export, replace=True)
    assert {path.name: path.read_bytes() for path in older_export.iterdir()} == before
    assert [path.name for path in older_export.parent.iterdir()] == ["model"]


@pytest.mark.parametrize("failure, message", [
    (OSError(errno.ENOSPC, "No space left on device", "/disk/x.safetensors"),
     r"/disk/x.safetensors \(No space left on device\); free space on that file system, or pass an --out on"),
    (SafetensorError('Error while serializing: I/O error: Permission denied (os error 13) at path "/x/.tmpA"'),
     r"/x/.tmpA \(Permission denied\); pass an --out in a directory you can write to"),
])
def test_a_write_that_fails_is_one_line_naming_the_path_and_the_fix(small_model, older_export, monkeypatch,
                                                                    failure, message):
    """A full disk, a quota or a directory that cannot be written: no traceback, nothing changed, nothing left."""
    before = {path.name: path.read_bytes() for path in older_export.iterdir()}

    def failing(*args, **kwargs):
        raise failure

    monkeypatch.setattr("starscream_jax.model.hf_checkpoint.save_file", failing)
    with pytest.raises(CheckpointError, match=rf"writing the export to .*model failed: {message}"):
        export_hf_model(small_model, older_export, replace=True)
    assert {path.name: path.read_bytes() for path in older_export.iterdir()} == before
    assert [path.name for path in older_export.parent.iterdir()] == ["model"]


def test_a_mount_point_or_an_unwritable_path_is_refused_before_anything_is_read(tmp_path, monkeypatch):
    with pytest.raises(CheckpointError, match=r"export target /proc: cannot write there \(.* in /proc\); pass a "
                                              r"directory on a writable file system"):
        check_export_target(Path("/proc/model"), replace=False)
    mount = tmp_path / "mounted"
    mount.mkdir()
    monkeypatch.setattr(os.path, "ismount", lambda path: Path(path) == mount)
    with pytest.raises(CheckpointError, match=rf"export target {mount} is a mount point, .*pass a directory inside "
                                              rf"it, such as {mount}/model"):
        check_export_target(mount, replace=True)


def test_staging_left_by_a_killed_export_of_this_host_is_removed(small_model, tmp_path):
    """An export killed mid-write leaves a model-sized hidden directory; the next export beside it removes it when
    its writer is gone (a process of this host), never another host's or a live process's."""
    host = socket.gethostname()
    gone = subprocess.Popen(["true"])
    gone.wait()
    abandoned = [tmp_path / f".out.partial-{host}-{gone.pid}-x1", tmp_path / f".out.old-{host}-{gone.pid}-x2"]
    kept = [tmp_path / f".out.partial-{host}-{os.getpid()}-x3", tmp_path / f".out.partial-elsewhere-{gone.pid}-x4",
            tmp_path / f".other.partial-{host}-{gone.pid}-x5"]
    for aside in abandoned + kept:
        aside.mkdir()
        (aside / "model.safetensors").write_bytes(b"0" * 64)
    (tmp_path / "out").mkdir()  # an export in place: what a killed replacement set aside is no longer needed
    export_hf_model(small_model, tmp_path / "out", replace=True)
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(["out", *(path.name for path in kept)])


def test_exported_files_take_the_modes_of_the_umask(small_model, tmp_path):
    import os
    previous = os.umask(0o022)
    try:
        export_hf_model(small_model, tmp_path / "out", tokenizer_dir=FIXTURES / "llama")
    finally:
        os.umask(previous)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o755
    assert {path.stat().st_mode & 0o777 for path in (tmp_path / "out").iterdir()} == {0o644}


def test_export_targets_and_shard_sizes_that_cannot_work_are_named(small_model, tmp_path):
    with pytest.raises(CheckpointError, match=r"model 'llama' \(str\): expected a Transformer"):
        export_hf_model("llama", tmp_path / "out")
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="export target .*file is a file; pass a directory path"):
        export_hf_model(small_model, tmp_path / "file")
    for size in (0, -5):
        with pytest.raises(StarscreamError, match=rf"max_shard_bytes \(--shard-size\) {size}: must be at least 1"):
            export_hf_model(small_model, tmp_path / "out", max_shard_bytes=size)
    tokenizer = tmp_path / "holder" / "tokenizer"
    shutil.copytree(FIXTURES / "llama", tokenizer)
    with pytest.raises(CheckpointError, match=r"holds .*tokenizer, which replacing it would delete"):
        export_hf_model(small_model, tmp_path / "holder", tokenizer_dir=tokenizer, replace=True)
    assert not (tmp_path / "out").exists() and (tokenizer / "config.json").is_file()
    checkpoints = tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    with pytest.raises(CheckpointError, match=r"export target .*checkpoints/99 lies inside .*checkpoints, which the "
                                              r"export reads .*; choose an --out outside it"):
        check_export_target(checkpoints / "99", False, reads=[checkpoints])
