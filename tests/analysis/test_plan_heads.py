"""The planner's padded-head candidates: priced beside smaller tensor-parallel groups, their cost stated."""
import argparse
import dataclasses
import io
import shlex
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from starscream_jax.analysis.compile import make_settings
from starscream_jax.analysis.memory import matmul_flops
from starscream_jax.analysis.plan import head_counts, padding_cost, plan_phase, with_heads
from starscream_jax.cli.plan import commands, format_plans, generate_command
from starscream_jax.hardware.mesh import build_topology_mesh
from starscream_jax.hardware.topology import Topology
from starscream_jax.model.catalog import load_model_config

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny.toml"
TOPOLOGY = Topology.from_preset("mi300x-qpx-nps1", gpus=2)


@pytest.fixture(scope="module")
def three_heads(tmp_path_factory) -> str:
    """The tiny model with 3 query heads sharing 1 kv head: 2 GPUs do not divide its heads (padded: 4)."""
    text = TINY.read_text().replace("n_heads = 8", "n_heads = 3").replace("n_kv_heads = 4", "n_kv_heads = 1")
    path = tmp_path_factory.mktemp("model") / "three.toml"
    path.write_text(text)
    return str(path)


@pytest.fixture(scope="module")
def prefill_plan(three_heads) -> dict:
    """The prefill plan of 4 x 16 tokens under starscream_tp on 2 GPUs of 4 partitions."""
    return plan_phase(make_settings(three_heads, "prefill", 4, 16, "starscream_tp", 2), TOPOLOGY)


def test_padded_heads_are_a_candidate_priced_and_chosen_only_when_cheapest(three_heads, prefill_plan):
    settings, plan = make_settings(three_heads, "prefill", 4, 16, "starscream_tp", 2), prefill_plan
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


def test_a_padded_decode_candidate_keeps_its_collectives_hierarchical(three_heads):
    """3 query heads sharing 1 kv head on 2 GPUs of 2 partitions: padded to 4, the kv head is copied over both
    GPUs, and the decode step still sums and scatters its k and v projections inside each GPU (XLA, left to place
    that product, sent it between GPUs by flat collective-permutes)."""
    topology = Topology.from_preset("mi300x-dpx-nps1", gpus=2)
    plan = plan_phase(make_settings(three_heads, "decode", 8, 16, "starscream_decode", 2), topology)
    by_name = {entry["name"]: entry for entry in plan["candidates"]}
    assert by_name["starscream_decode data 1 x gpu 2"]["status"] == "cannot place"
    padded = by_name["starscream_decode data 1 x gpu 2, heads padded to 4"]
    assert padded["estimate"] is not None
    assert padded["principles"] == {"no_redundancy": True, "hierarchical_collectives": True}


def test_the_printed_commands_of_a_padded_choice_pad_the_heads_and_run(three_heads, prefill_plan, tmp_path,
                                                                       monkeypatch):
    """Of the padded candidates alone (on 2 GPUs they compete with data 2 x gpu 1, whose batch split the 4 sequences
    fit as starscream_tp+seq): plan's inspect command carries --pad-heads 4 and runs as printed, and
    generate's (decode padded too) picks the prefill candidate of the same heads and pads; a train plan prints no
    command, as `train` does not pad."""
    from starscream_jax.cli import main as cli

    padded = [entry for entry in prefill_plan["candidates"] if entry["heads"]]
    plan = dict(prefill_plan, candidates=padded, choice="starscream_tp data 1 x gpu 2, heads padded to 4")
    args = argparse.Namespace(model=three_heads, quantize=None, kv_cache=None, topology=None, gpus=None, nodes=None,
                              preset=TOPOLOGY.preset.name)  # (the mesh flags as plan parses them)
    [inspect] = commands(plan, args, TOPOLOGY)
    assert inspect.endswith("--phase prefill --batch 4 --seq 16 --pad-heads 4") and "--data-parallel" not in inspect
    monkeypatch.chdir(tmp_path)
    with redirect_stdout(io.StringIO()):
        assert cli.main(shlex.split(inspect)[1:]) == 0
    decode = dict(plan, phase="decode")
    generate = generate_command({"prefill": plan, "decode": decode}, args, TOPOLOGY)
    assert "--prefill-layout starscream_tp --decode-layout starscream_tp --pad-heads 4" in generate
    assert commands(dict(plan, phase="train", dtype="float32"), args, TOPOLOGY) == []

