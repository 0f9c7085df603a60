"""`starscream generate` (and `serve`, which loads its model the same way: `generate.load_request`, then
`inference.loading.load_for_inference`): query heads the prefill or decode layout cannot split over the mesh are
refused before anything runs, naming the --pad-heads N that splits them; so are a prompt of no tokens or no room
and a seed JAX cannot take. Nothing is compiled: the Llama fixture (8 query heads sharing 4 kv heads) is only
placed."""
import argparse
from pathlib import Path

import pytest

from starscream_jax.cli import generate as generate_command
from starscream_jax.errors import ShardingRuleError, StarscreamError
from starscream_jax.hardware.mesh import build_mesh
from starscream_jax.hardware.presets import load_chip
from starscream_jax.inference.loading import load_for_inference
from starscream_jax.model.catalog import load_model_config
from starscream_jax.text.tokenizer import ByteTokenizer

LLAMA = Path(__file__).resolve().parents[1] / "fixtures" / "hf" / "llama"


def load(*argv: str):
    parser = argparse.ArgumentParser()
    generate_command.add_arguments(parser)
    chip = load_chip("mi300x")
    request = generate_command.load_request(parser.parse_args(["--model-dir", str(LLAMA), *argv]), chip)
    return load_for_inference(request, build_mesh("16x1"), chip)


@pytest.mark.parametrize("argv, refused", [
    ((), "starscream_tp into 16, starscream_decode into 16"),  # the prefill layout cannot load it
    (("--prefill-layout", "starscream_fsdp"), "starscream_decode into 16"),  # loaded; the decode layout cannot
])
def test_heads_16_gpus_do_not_split_are_refused_naming_the_pad_heads_that_does(argv, refused):
    with pytest.raises(ShardingRuleError, match=rf"\({refused}\); pass --pad-heads 16: each kv head's 2 query heads"):
        load(*argv)
    model, _, _ = load(*argv, "--pad-heads", "16")
    assert model.config.n_heads == 16


@pytest.mark.parametrize("prompt, max_new_tokens, message", [
    ("", 4, r"--prompt '' encodes to no tokens with this model's tokenizer; pass some text"),
    ("hi", 255, r"--prompt of 2 tokens \+ --max-new-tokens 255 exceed model tiny's max_seq_len 256; pass "
                r"--max-new-tokens 254 or less"),
    ("x" * 256, 1, r"--prompt of 256 tokens \+ --max-new-tokens 1 exceed .*; shorten --prompt"),
])
def test_a_prompt_without_tokens_or_room_is_refused_naming_the_flag(prompt, max_new_tokens, message):
    """The engine divided by the empty prompt's length (ZeroDivisionError) and named its own max model length."""
    with pytest.raises(StarscreamError, match=message):
        generate_command.checked_prompt(prompt, max_new_tokens, ByteTokenizer(), load_model_config("tiny"))
    assert list(generate_command.checked_prompt("hi", 254, ByteTokenizer(), load_model_config("tiny"))) == [104, 105]


@pytest.mark.parametrize("seed, accepted", [("-1", True), (str(2**63 - 1), True), (str(2**63), False)])
def test_a_seed_beyond_64_bits_is_refused_while_parsing(seed, accepted, capsys):
    parser = argparse.ArgumentParser()
    generate_command.add_arguments(parser)
    if accepted:
        assert parser.parse_args(["--seed", seed]).seed == int(seed)
        return
    with pytest.raises(SystemExit):
        parser.parse_args(["--seed", seed])
    assert "a seed is a 64-bit signed integer; pass one from" in capsys.readouterr().err
