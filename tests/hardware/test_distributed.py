"""jax.distributed start-up from arguments, and a two-process training run on CPU that matches one process."""
import argparse
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from starscream_jax.cli import arguments as cli_arguments
from starscream_jax.errors import StarscreamError
from starscream_jax.hardware.mesh import build_mesh
from starscream_jax.training.config import TrainConfig
from starscream_jax.training.loop import train
from starscream_jax.training.metrics import read_metrics

TRAIN_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train.py"


def parse(argv):
    parser = argparse.ArgumentParser()
    cli_arguments.add_distributed_arguments(parser)
    return parser.parse_args(argv)


def test_no_arguments_stay_single_process():
    assert cli_arguments.initialize_from_args(parse([])) is False


def test_partial_explicit_arguments_are_refused():
    with pytest.raises(StarscreamError, match="expected all three together"):
        cli_arguments.initialize_from_args(parse(["--coordinator", "localhost:1234", "--num-processes", "2"]))


def test_process_id_outside_the_range_is_refused():
    arguments = parse(["--coordinator", "localhost:1234", "--num-processes", "2", "--process-id", "2"])
    with pytest.raises(StarscreamError, match=r"process id 2 is outside 0..1"):
        cli_arguments.initialize_from_args(arguments)



@pytest.mark.slow  # 40 s of two processes; tests/serving/test_engine.py serves over two processes by default
@pytest.mark.multiprocess
def test_two_processes_train_like_one_with_the_same_global_mesh(tmp_path, cpu_child_env, free_port,
                                                                 local_processes):
    """Each process simulates 4 CPU devices (one QPX GPU); the 1 x 2 x 4 mesh spans both."""
    run_dir = tmp_path / "two_processes"
    common = ["--preset", "mi300x-qpx-nps1", "--nodes", "2", "--gpus", "1", "--no-simulate", "--steps", "3",
              "--batch-size", "8", "--seq-len", "16", "--eval-batches", "1", "--no-progress", "--run-dir", str(run_dir),
              "--coordinator", f"localhost:{free_port()}", "--num-processes", "2"]
    outputs = local_processes([[sys.executable, str(TRAIN_SCRIPT), *common, "--process-id", str(process_id)]
                               for process_id in range(2)], cpu_child_env(4), timeout=300)
    (main_output, _), (other_output, _) = outputs
    assert "mesh {'data': 1, 'gpu': 2, 'xcd': 4}" in main_output and "unigram entropy" in main_output
    # Only process 0 reports. Both also carry gloo's connection messages on stdout, which gloo's threads may write
    # in pieces, so the check is that none of process 0's report appears in process 1's output.
    report_lines = [line for line in main_output.splitlines() if line.strip() and "Gloo" not in line
                    and "peer rank" not in line]
    assert report_lines, "process 0 printed its report"
    assert [line for line in report_lines if line in other_output] == [], "only process 0 prints"

    config = dataclasses.replace(TrainConfig(), steps=3, batch_size=8, seq_len=16, eval_batches=1,
                                 run_dir=str(tmp_path / "one_process"))
    one_process = train(config, build_mesh("1x2x4"), show_progress=False, echo=lambda *_: None)
    two_processes = [(record["step"], record["loss"]) for record in read_metrics(run_dir / "metrics.jsonl")
                     if "loss" in record]
    assert [step for step, _ in two_processes] == [1, 2, 3]
    np.testing.assert_allclose([loss for _, loss in two_processes], [loss for _, loss in one_process.losses],
                               rtol=1e-5)


def test_a_process_that_never_joins_is_named_after_the_join_timeout(free_port):
    """Process 0 waits for process 1, process 1 (of another run) for a coordinator that is not there: each says
    which process is missing and exits with status 2 instead of waiting without a word."""
    lonely = [subprocess.Popen([sys.executable, "-c", "from starscream_jax.hardware.distributed import initialize; "
                                f"initialize('localhost:{free_port()}', 2, {process_id}, join_timeout=2)"],
                               env={**os.environ, "JAX_PLATFORMS": "cpu"}, stderr=subprocess.PIPE, text=True)
              for process_id in (0, 1)]
    errors = [process.communicate(timeout=120)[1] for process in lonely]
    assert [process.returncode for process in lonely] == [2, 2]
    assert "error: process 1 did not join localhost:" in errors[0] and "(this is process 0)" in errors[0]
    assert "error: process 0 (the coordinator at localhost:" in errors[1] and "does not answer within 2 s" in errors[1]
