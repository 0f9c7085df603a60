"""`starscream serve`: its flags become the engine's configuration; bad input is one error line before anything
loads (the server itself: tests/serving/test_server.py)."""
import argparse

import pytest

from starscream_jax.cli import main as cli
from starscream_jax.cli import generate, serve
from starscream_jax.serving.engine import EngineConfig


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(argv)


def test_flags_set_the_engine_configuration():
    """vLLM's flag names and today's aliases; --max-num-seqs is split among the cache shards."""
    config = serve.engine_config(parse("--page-size", "8", "--cache-pages", "64", "--max-seqs", "6",
                                       "--token-budget", "128", "--chunk", "32", "--kernel", "pallas",
                                       "--max-model-len", "96", "--gpu-memory-utilization", "0.5"), shards=4)
    assert config == EngineConfig(page_size=8, pages_per_shard=64, rows_per_shard=2, token_budget=128, chunk=32,
                                  kernel="pallas", max_model_len=96, memory_utilization=0.5)
    defaults = serve.engine_config(parse(), shards=1)
    assert (defaults.pages_per_shard, defaults.rows_per_shard, defaults.token_budget, defaults.memory_utilization,
            defaults.max_model_len) == (None, 256, 2048, 0.9, None)


def test_serve_reads_the_model_from_the_arguments_generate_reads():
    """Both commands take the model's source from `arguments.add_model_source_arguments`: the same flags, values
    and defaults."""
    dests = ("checkpoint", "model_dir", "step", "dtype", "prefill_layout", "decode_layout", "quantize",
             "quantize_scales", "kv_cache")
    for argv in ((), ("--model-dir", "m", "--dtype", "bfloat16", "--decode-layout", "gpu_tp", "--kv-cache", "int8")):
        read = []
        for command in (generate, serve):
            parser = argparse.ArgumentParser()
            command.add_arguments(parser)
            read.append({dest: getattr(parser.parse_args(argv), dest) for dest in dests})
        assert read[0] == read[1]


@pytest.mark.parametrize("argv, message", [
    (("--model-dir", "m", "--checkpoint", "runs/x"), "--model-dir contradicts --checkpoint"),
    (("--model-dir", "m", "--step", "2"), "--model-dir contradicts --step"),
])
def test_contradicting_flags_are_one_error_line(capsys, argv, message):
    assert cli.main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and err.startswith("starscream serve: error: ")


@pytest.mark.parametrize("argv, message", [
    (("--port", "70000"), "--port 70000: give a port number from 0 to 65535"),
    (("--kernel", "flash"), "invalid choice: 'flash'"),
    (("--page-size", "0"), "--page-size"),
    (("--gpu-memory-utilization", "1.5"), "give a fraction above 0 and at most 1"),
    (("--fake-engine", "-3"), "give a positive number of milliseconds"),
])
def test_bad_values_are_refused_as_the_flags_are_read(capsys, argv, message):
    with pytest.raises(SystemExit) as exited:
        cli.main(["serve", *argv])
    assert exited.value.code == 2 and message in capsys.readouterr().err.splitlines()[-1]
