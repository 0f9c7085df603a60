"""scripts/bench_hf_load.py: what it counts as read hooks the loader where the loader reads."""
import inspect

import pytest

from starscream_jax.model.hf_checkpoint import CheckpointReader



@pytest.fixture(scope="module")
def bench(script):
    return script("bench_hf_load")


def test_the_read_it_counts_is_the_loaders_read_of_one_tensor(bench):
    method = getattr(CheckpointReader, bench.READ_METHOD)
    assert list(inspect.signature(method).parameters) == ["self", "source", "name", "ours"]
    assert bench.READ_METHOD in inspect.getsource(CheckpointReader.read)
