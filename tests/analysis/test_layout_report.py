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
