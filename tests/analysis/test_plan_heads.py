"""The planner's padded-head candidates: priced beside smaller tensor-parallel groups, their cost stated."""
import dataclasses
from pathlib import Path

import pytest

from starscream_jax.analysis.compile import make_settings
from starscream_jax.analysis.memory import matmul_flops
from starscream_jax.analysis.plan import head_counts, padding_cost, plan_phase, with_heads
from starscream_jax.cli.plan import format_plans
from starscream_jax.hardware.mesh import build_topology_mesh
from starscream_jax.hardware.topology import Topology
from starscream_jax.model.config import load_model_config

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny.toml"


@pytest.fixture(scope="module")
def three_heads(tmp_path_factory) -> str:
    """The tiny model with 3 query heads sharing 1 kv head: 2 GPUs do not divide its heads (padded: 4)."""
    text = TINY.read_text().replace("n_heads = 8", "n_heads = 3").replace("n_kv_heads = 4", "n_kv_heads = 1")
    path = tmp_path_factory.mktemp("model") / "three.toml"
    path.write_text(text)
    return str(path)


def test_padded_heads_are_a_candidate_priced_and_chosen_only_when_cheapest(three_heads):
    settings = make_settings(three_heads, "prefill", 4, 16, "starscream_tp", 2)
    plan = plan_phase(settings, Topology.from_preset("mi300x-qpx-nps1", gpus=2))
    by_name = {entry["name"]: entry for entry in plan["candidates"]}
    assert by_name["starscream_tp data 1 x gpu 2"]["status"] == "cannot place"
    padded = by_name["starscream_tp data 1 x gpu 2, heads padded to 4"]
    assert padded["heads"] == 4 and padded["estimate"] is not None
    assert padded["padding_cost"] == padding_cost(settings, 4)
    fastest = min((entry for entry in plan["candidates"] if entry["estimate"]),
                  key=lambda entry: entry["estimate"]["serial_s"])
    assert plan["choice"] == fastest["name"]
    assert all(entry["heads"] == 0 for entry in plan["candidates"] if "gpu 1" in entry["name"])
    row = next(line for line in format_plans({"prefill": plan}).splitlines() if "heads padded to 4" in line)
    assert "+2.36e+06 FLOP, +64.0 KiB of zero heads" in row


def test_padding_cost_is_the_zero_heads_weights_and_their_matmuls(three_heads):
    """The weight bytes are the padded model's extra parameters at float32; the projection FLOPs are the planner's
    own count of the matmuls (`memory.matmul_flops`, summed over the devices) of the padded model less the
    model's; the rest is attention over the `seq` positions."""
    settings = make_settings(three_heads, "prefill", 4, 16, "starscream_tp", 2)
    settings = dataclasses.replace(settings, full_layers=settings.config.n_layers)
    cost = padding_cost(settings, 4)
    padded = with_heads(settings, 4).config
    assert cost["extra_param_bytes"] == 4 * (padded.num_params() - settings.config.num_params())
    mesh = build_topology_mesh(Topology.from_preset("mi300x-qpx-nps1", gpus=1), simulate=True)[1]
    projections = mesh.size * (matmul_flops(padded, "starscream_tp", mesh, 4, 16)
                               - matmul_flops(settings.config, "starscream_tp", mesh, 4, 16))
    attention = 2 * 2 * 16 * 16 * (4 * 16) * settings.full_layers  # scores and mixing: 16 positions, 1 head of 16
    assert cost["extra_flops"] == projections + attention


@pytest.mark.parametrize("heads, kv_heads, gpu, counts", [(28, 4, 8, (0, 32)), (28, 4, 4, (0,)), (3, 1, 2, (0, 4)),
                                                          (3, 3, 2, (0,)), (8, 8, 3, (0,))])
def test_padding_is_offered_only_where_it_lets_the_heads_split(heads, kv_heads, gpu, counts):
    """Qwen2-7B's 28 heads and 4 kv heads pad to 32 on 8 GPUs; on 4 they divide already. Where the kv heads neither
    divide nor are divided by the GPUs (3 on 2, 8 on 3), every padded count still splits a group unevenly."""
    config = load_model_config("tiny").replace(n_heads=heads, n_kv_heads=kv_heads)
    assert head_counts(config, gpu) == counts
