"""One layout's result: the tokens per device principle 1 divides by are the known ones, not a guess."""
import pytest

from starscream_jax.analysis.layout_report import tokens_per_device
from starscream_jax.hardware.mesh import build_mesh
from starscream_jax.sharding.layouts import get_layout


@pytest.mark.parametrize("layout, expected", [
    ("gpu_tp", 8 * 32),           # tokens split over data (1) only
    ("flat_tp", 8 * 32),
    ("starscream_tp", 8 // 4 * 32),  # batch over (data, xcd): 4 ways
    ("flat_fsdp", 8 // 8 * 32),      # batch over every device
    ("starscream_cp", 8 * (32 // 4)),  # the sequence over xcd
])
def test_tokens_per_device_follow_the_layouts_batch_and_seq_rules(layout, expected):
    assert tokens_per_device(get_layout(layout), build_mesh("2x4"), (8, 32)) == expected


def test_the_result_cache_key_is_the_same_in_every_process():
    """Sets in a layout (its may_replicate names) iterate in an order that follows each process's string hashing;
    the key must not, or a second `plan` compiles everything again."""
    import os
    import subprocess
    import sys

    script = ("from starscream_jax.hardware.simulation import simulate_cpu_devices; simulate_cpu_devices(2)\n"
              "from starscream_jax.analysis.compile import make_settings\n"
              "from starscream_jax.analysis.layout_report import ResultCache\n"
              "from starscream_jax.hardware.mesh import build_topology_mesh\n"
              "topology, mesh = build_topology_mesh('cpu', gpus=2, simulate=True)\n"
              "settings = make_settings('tiny', 'train', 8, 32, 'starscream_tp', 2)\n"
              "print(ResultCache('cache')._path(settings, topology, mesh, 'starscream_tp').name)\n")
    keys = {subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    assert len(keys) == 1
