"""TrainConfig's compute dtype: --init's checkpoint dtype unless --dtype names one; a resumed run keeps its own."""
import argparse
import json
from pathlib import Path

import pytest

from starscream_jax.cli.train import add_arguments, config_from_args
from starscream_jax.training.config import TrainConfig
from starscream_jax.training.loop import resumed_model

LLAMA = Path(__file__).resolve().parent.parent / "fixtures" / "hf" / "llama"


@pytest.fixture
def bf16_dir(tmp_path) -> Path:
    """The llama fixture's config.json saying torch_dtype bfloat16 (as published checkpoints do)."""
    raw = json.loads((LLAMA / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "torch_dtype": "bfloat16"}))
    return tmp_path


def train_config(*argv: str) -> TrainConfig:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(list(argv)))


@pytest.mark.parametrize("flags, dtype", [((), "bfloat16"), (("--dtype", "float32"), "float32"),
                                          (("--dtype", "bfloat16"), "bfloat16")])
def test_init_computes_in_the_checkpoints_dtype_unless_dtype_is_given(bf16_dir, flags, dtype):
    config = train_config("--init", str(bf16_dir), "--seq-len", "32", *flags)
    assert config.model_config().dtype == dtype


def test_a_model_file_keeps_its_own_dtype():
    assert train_config().model_config().dtype == "float32"
    assert train_config("--dtype", "bfloat16").model_config().dtype == "bfloat16"


@pytest.mark.parametrize("flags, dtype", [((), "float32"), (("--dtype", "bfloat16"), "bfloat16")])
def test_a_resume_without_dtype_keeps_the_runs_recorded_dtype(bf16_dir, flags, dtype):
    """A run recorded in float32 (say, started before the default followed the checkpoint) resumes in float32;
    an explicit --dtype is kept, for the resume check to refuse."""
    config = train_config("--init", str(bf16_dir), "--seq-len", "32", *flags)
    saved = {"model_config": {"dtype": "float32"}}
    assert resumed_model(config, config.model_config(), saved).dtype == dtype


def test_a_run_shorter_than_the_default_warm_up_keeps_it_and_an_explicit_one_may_span_the_run():
    """Only a --warmup-steps given beyond --steps is refused (tests/cli/test_main.py)."""
    assert train_config("--steps", "20").warmup_steps == TrainConfig().warmup_steps == 30
    assert train_config("--steps", "20", "--warmup-steps", "20").warmup_steps == 20
