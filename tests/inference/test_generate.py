"""Generation: sharded prefill + decode equals unsharded token for token; the KV cache and top-p are exact."""
import argparse
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from starscream_jax.cli import generate as generate_cli
from starscream_jax.cli import main as cli
from starscream_jax.errors import StarscreamError
from starscream_jax.hardware.mesh import build_mesh
from starscream_jax.hardware.presets import load_chip
from starscream_jax.inference.generate import generate, is_stop, stop_ids_of
from starscream_jax.inference.loading import LoadRequest, load_for_inference
from starscream_jax.inference.served import generate_served
from starscream_jax.model.catalog import load_model_config
from starscream_jax.model.decoder import Transformer
from starscream_jax.model.dense_cache import cache_shardings
from starscream_jax.sharding.apply import use_layout
from starscream_jax.sharding.layouts import get_layout
from starscream_jax.text import byte_level
from starscream_jax.training.checkpoint import CheckpointStore
from starscream_jax.training.config import TrainConfig
from starscream_jax.training.loop import initial_state, run_description
from starscream_jax.training.steps import Sampling, choose_token

PROMPT = np.tile(byte_level.encode("ROMEO:"), (4, 1))


@pytest.fixture(scope="module")
def model():
    return Transformer(load_model_config("tiny"), rngs=nnx.Rngs(7))


@pytest.mark.parametrize("sampling", [Sampling(), pytest.param(Sampling(top_p=0.9, temperature=0.8, seed=3),
                                                                 marks=pytest.mark.slow)], ids=["greedy", "top_p"])
def test_sharded_generation_equals_unsharded(model, sampling):
    unsharded = generate(model, PROMPT, 10, sampling)
    sharded = generate(model, PROMPT, 10, sampling, build_mesh("1x2x4"), "starscream_tp", "starscream_decode")
    assert unsharded.tokens.shape == (4, 10)
    np.testing.assert_array_equal(sharded.tokens, unsharded.tokens)
    assert sharded.prefill_tokens_per_s > 0 and sharded.decode_tokens_per_s > 0


def test_flat_layouts_generate_the_same_tokens(model):
    mesh = build_mesh("1x4x2")
    flat = generate(model, PROMPT[:1], 6, Sampling(), mesh, "flat_tp", "flat_tp")
    np.testing.assert_array_equal(flat.tokens, generate(model, PROMPT[:1], 6, Sampling()).tokens)


def test_decode_cache_is_placed_by_the_decode_layout():
    config = load_model_config("tiny")
    mesh = build_mesh("1x2x4")
    shardings = cache_shardings(config, batch=4, length=16, layout="starscream_decode", mesh=mesh)
    # [layers, batch, positions, kv_heads, head_dim]: batch over the partitions, kv heads over the GPUs.
    assert shardings.k.spec == shardings.v.spec == P(None, ("data", "xcd"), None, "gpu", None)


def test_greedy_tokens_are_the_argmax_of_a_full_forward_pass(model):
    generated = generate(model, PROMPT[:1], 8).tokens
    sequence = np.concatenate([PROMPT[:1], generated], axis=1)
    logits = model(jnp.asarray(sequence[:, :-1])).logits
    predicted = np.asarray(jnp.argmax(logits, axis=-1))[:, PROMPT.shape[1] - 1:]
    np.testing.assert_array_equal(predicted, generated)


def test_top_p_samples_only_inside_the_nucleus():
    probabilities = np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32)
    logits = jnp.asarray(np.tile(np.log(probabilities), (2000, 1)))
    chosen = np.asarray(choose_token(logits, 5, Sampling(top_p=0.7, seed=1)))
    assert set(chosen.tolist()) == {0, 1}
    assert 0.55 < np.mean(chosen == 0) < 0.70  # 0.5 / 0.8 of the nucleus
    everything = np.asarray(choose_token(logits, 5, Sampling(top_p=1.0, seed=1)))
    assert set(everything.tolist()) == {0, 1, 2, 3}


def test_a_tiny_nucleus_is_greedy():
    logits = jax.random.normal(jax.random.key(0), (16, 256))
    nucleus = choose_token(logits, 3, Sampling(top_p=1e-6, temperature=0.5, seed=9))
    np.testing.assert_array_equal(nucleus, jnp.argmax(logits, axis=-1))


@pytest.mark.parametrize("options, message", [
    ({"top_p": 1.5}, "top-p 1.5 is outside"),
    ({"temperature": 0.0}, "--temperature 0.0: must be a finite number above zero"),
    ({"temperature": float("nan")}, "--temperature nan: must be a finite number above zero"),
])
def test_bad_sampling_options_are_refused(options, message):
    with pytest.raises(StarscreamError, match=message):
        Sampling(**options)


def test_too_many_tokens_for_the_model_are_refused(model):
    with pytest.raises(StarscreamError, match="exceed model tiny's max_seq_len 256"):
        generate(model, PROMPT, 251)


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_layouts_that_split_the_cache_differently_are_refused_before_anything_compiles(model, phase):
    layouts = {"prefill_layout": "starscream_tp", "decode_layout": "starscream_decode", f"{phase}_layout": "flat_cp"}
    with pytest.raises(StarscreamError, match=r"splits the KV cache's positions over .* over .*; prefill with"):
        generate(model, PROMPT, 4, mesh=build_mesh("2x4"), **layouts)


@pytest.fixture
def generate_command(monkeypatch, capsys):
    """Runs `starscream generate ARGS` in this process; returns (exit status, stdout lines, stderr)."""
    monkeypatch.setattr(cli, "SUBCOMMANDS", {"generate": cli.SUBCOMMANDS["generate"]})

    def run(*args):
        status = cli.main(["generate", *args])
        captured = capsys.readouterr()
        return status, captured.out.splitlines(), captured.err

    return run


def save_fresh_run(directory, mesh):
    """A checkpoint at step 1 of a freshly initialised tiny model, as training writes it."""
    config = TrainConfig()
    model_config = load_model_config(config.model)
    with use_layout(config.layout, mesh):
        _, params, _, _, opt_state = initial_state(config, model_config, get_layout(config.layout), mesh)
    with CheckpointStore(directory) as store:
        store.save(1, params, opt_state, run_description(config, model_config, mesh, 1, layout=config.layout),
                   force=True)


def test_command_generates_from_a_checkpoint(tmp_path, generate_command):
    save_fresh_run(tmp_path / "checkpoints", build_mesh("1x2x4"))
    not_utf8 = b"KING:\xff".decode("utf-8", errors="surrogateescape")  # as Python reads such bytes from argv
    status, out, _ = generate_command("--checkpoint", str(tmp_path / "checkpoints"), "--prompt", not_utf8,
                                      "--max-new-tokens", "5", "--top-p", "0.95")
    assert status == 0
    assert out[0] == ("tiny from step 1 on mesh {'data': 1, 'gpu': 2, 'xcd': 4}; prefill starscream_tp, "
                      "decode starscream_decode")
    # one sample by default: a batch of 1 places (prompt split over the partitions, split-K decode)
    assert [line for line in out if line.startswith("--- sample")] == ["--- sample 0"]
    assert sum(line.startswith("KING:\ufffd") for line in out) == 1
    assert out[-1].startswith("prefill ") and out[-1].endswith(
        "tokens/s (1 x 5 new tokens; the static path: split-K decode: fewer samples than cache shards)")


def test_missing_checkpoint_is_one_error_line(tmp_path, generate_command):
    status, _, err = generate_command("--checkpoint", str(tmp_path / "nothing"))
    assert status == 2
    assert err.startswith("starscream generate: error: checkpoint directory") and err.count("\n") == 1


def test_damaged_checkpoint_is_named_in_one_line(tmp_path, generate_command):
    save_fresh_run(tmp_path / "checkpoints", build_mesh("1x2x4"))
    for data_file in (tmp_path / "checkpoints" / "1").glob("params/d/*"):
        data_file.write_bytes(data_file.read_bytes()[:10])
    status, _, err = generate_command("--checkpoint", str(tmp_path / "checkpoints"))
    assert status == 2
    assert re.fullmatch(r"starscream generate: error: checkpoint step 1 in \S+ is damaged: \S+/1/params/d/\w+ \(.*\); "
                        r"no other checkpoint is there: train again\n", err)


@pytest.mark.parametrize("option", [("--samples", "0"), ("--max-new-tokens", "-1"), ("--step", "x")])
def test_bad_counts_are_refused_before_anything_is_read(option, generate_command, capsys):
    with pytest.raises(SystemExit) as exited:
        generate_command(*option)
    assert exited.value.code == 2
    assert f"error: argument {option[0]}: " in capsys.readouterr().err



def test_padded_query_heads_generate_the_reference_tokens(generate_command):
    """--pad-heads 12: the llama fixture's 8 query heads (4 kv heads) grown to 12 with zero heads, loaded under a
    layout that splits no heads, then placed by the generation layouts on 2 GPUs x 4 partitions; greedy decoding
    gives the reference implementation's tokens. A count the kv heads do not divide is one error line naming the
    counts that work."""
    from safetensors.numpy import load_file

    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "hf" / "llama"
    parser = argparse.ArgumentParser()
    generate_cli.add_arguments(parser)
    mesh = build_mesh("1x2x4")
    chip = load_chip("mi300x")
    request = generate_cli.load_request(parser.parse_args(["--model-dir", str(fixture), "--pad-heads", "12"]), chip)
    model = load_for_inference(request, mesh, chip).model
    assert model.config.n_heads == 12 and model.layers.wq.shape[2] == 12
    expected = load_file(fixture / "reference.safetensors")
    result = generate(model, expected["prompt_ids"][None], 8, Sampling(top_p=None), mesh)
    np.testing.assert_array_equal(result.tokens[0], expected["generated_ids"][:8])
    status, _, err = generate_command("--model-dir", str(fixture), "--pad-heads", "10", "--max-new-tokens", "1")
    assert status != 0 and "pad to a multiple of 4 no smaller than 8" in err


def _odd_vocabulary_run(directory) -> None:
    """A checkpoint at step 1 of a 1-layer tiny model of 390 tokens, trained under starscream_fsdp (which splits no
    vocabulary) on 2 GPUs x 4 partitions."""
    config, mesh = TrainConfig(layout="starscream_fsdp"), build_mesh("1x2x4")
    model_config = load_model_config(config.model).replace(n_layers=1, vocab_size=390)
    with use_layout(config.layout, mesh):
        _, params, _, _, opt_state = initial_state(config, model_config, get_layout(config.layout), mesh)
    with CheckpointStore(directory) as store:
        store.save(1, params, opt_state, run_description(config, model_config, mesh, 1, layout=config.layout),
                   force=True)


def _padded_and_whole(directory):
    """(the run loaded for starscream_tp prefill and starscream_decode on 1x2x4, which splits the vocabulary over
    8 partitions, the mesh; the run loaded on one device)."""
    chip, mesh = load_chip("mi300x"), build_mesh("1x2x4")
    padded = load_for_inference(LoadRequest(checkpoint=directory), mesh, chip).model
    whole = load_for_inference(LoadRequest(checkpoint=directory), build_mesh("1x1"), chip).model
    return padded, mesh, whole


def test_a_vocabulary_the_decode_layout_does_not_split_is_padded_and_generates_the_unsharded_tokens(tmp_path):
    """390 tokens on 8 partitions: loading pads the vocabulary to 392 rows; greedy tokens equal the unsharded
    model's, and no token id names a padded row."""
    _odd_vocabulary_run(tmp_path)
    padded, mesh, whole = _padded_and_whole(tmp_path)
    assert (padded.config.vocab_size, padded.config.vocab_tokens, whole.config.vocab_size) == (392, 390, 390)
    expected = generate(whole, PROMPT, 6, Sampling(), build_mesh("1x1")).tokens
    np.testing.assert_array_equal(generate(padded, PROMPT, 6, Sampling(), mesh).tokens, expected)
    assert np.all(expected < 390)


@pytest.mark.slow
def test_a_padded_vocabulary_generates_the_unsharded_tokens_on_the_serving_engine(tmp_path):
    _odd_vocabulary_run(tmp_path)
    padded, mesh, whole = _padded_and_whole(tmp_path)
    expected = generate(whole, PROMPT, 6, Sampling(), build_mesh("1x1")).tokens
    served = generate_served(padded, PROMPT, 6, Sampling(), mesh, "starscream_tp", "starscream_decode")
    np.testing.assert_array_equal(served.tokens, expected)


def test_generation_stops_on_any_of_several_eos_ids():
    """Llama 3 ends a turn with <|eot_id|> and a text with <|end_of_text|>: either stops a row."""
    assert [stop_ids_of(stop) for stop in (None, 7, np.int64(7), (7, 9))] == [(), (7,), (7,), (7, 9)]
    np.testing.assert_array_equal(is_stop(jnp.asarray([7, 8, 9, 1], jnp.int32), (9, 7)), [True, False, True, False])
    with pytest.raises(StarscreamError, match="stop token -1: expected a token id"):
        stop_ids_of((3, -1))


def test_a_printed_sample_ends_before_its_first_eos_of_any_kind():
    row = np.asarray([5, 6, 9, 7, 9], np.int32)
    np.testing.assert_array_equal(generate_cli.until_stop(row, (7, 9)), [5, 6])
    np.testing.assert_array_equal(generate_cli.until_stop(row, 7), [5, 6, 9])
    np.testing.assert_array_equal(generate_cli.until_stop(row, ()), row)
    np.testing.assert_array_equal(generate_cli.until_stop(row, None), row)
