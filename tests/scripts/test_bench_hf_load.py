"""scripts/bench_hf_load.py: what it counts as read hooks the loader where the loader reads."""
import importlib.util
import inspect
from pathlib import Path

import pytest

from starscream_jax.model.hf_checkpoint import CheckpointReader

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_hf_load.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_hf_load", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_read_it_counts_is_the_loaders_read_of_one_tensor(bench):
    method = getattr(CheckpointReader, bench.READ_METHOD)
    assert list(inspect.signature(method).parameters) == ["self", "source", "name", "ours"]
    assert bench.READ_METHOD in inspect.getsource(CheckpointReader.read)
