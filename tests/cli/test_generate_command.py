"""`starscream generate` (and `serve`, which loads its model the same way: `generate.load_request`, then
`inference.loading.load_for_inference`): query heads the prefill or decode layout cannot split over the mesh are
refused before anything runs, naming the --pad-heads N that splits them. Nothing is compiled: the Llama fixture (8 query heads sharing 4 kv heads) is only
placed."""
import argparse
from pathlib import Path

import pytest

from starscream_jax.cli import generate as generate_command
from starscream_jax.errors import ShardingRuleError
from starscream_jax.hardware.mesh import build_mesh
from starscream_jax.hardware.presets import load_chip
from starscream_jax.inference.loading import load_for_inference

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
